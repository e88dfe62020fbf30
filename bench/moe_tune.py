"""Device script for the fused-MoE kernels: correctness on real shapes + timings of config variants.

PYTHONPATH=src PYTHONUNBUFFERED=1 python3 bench/moe_tune.py [check] [time] [variants]
Experts only (topk given); the whole-layer benchmark is `replaymoe bench moe`.
"""

import json
import os
import sys
from dataclasses import replace

import torch

from replaymoe.bench._timing import time_graph
from replaymoe.bench.moe import SHAPES, VLLM_KERNELS_MS, layer_floor_ms, make_weights, routing_inputs
from replaymoe.moe import fused_moe_torch
from replaymoe.moe._forward import experts_triton
from replaymoe.moe.configs import moe_config

OUT = os.environ.get("OUT", "/tmp")
what = set(sys.argv[1:]) or {"check", "time"}
rows = []
W = {}


def weights(name, fp8):
    key = (name, fp8)
    if key not in W:
        for k in list(W):
            if k[0] != name:
                del W[k]
        torch.cuda.empty_cache()
        H, I, E, K, _ = SHAPES[name]  # noqa: E741
        W[key] = make_weights(H, I, E, fp8=fp8)
    return W[key]


def call(x, w, ids, wts, cfg=None, out=None):
    w13, w2, s13, s2 = w
    return experts_triton(
        x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=0, out=out, config=cfg
    )


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


if "check" in what:
    for name in ("qwen3", "mixtral", "deepseek"):
        H, I, E, K, _ = SHAPES[name]  # noqa: E741
        for fp8 in (False, True):
            w = weights(name, fp8)
            for T in (1, 8, 64, 256, 4096):
                if fp8 and T not in (1, 64, 4096):
                    continue
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                _, _, _, _, ids, wts = routing_inputs(name, T)
                try:
                    y = call(x, w, ids, wts)
                except Exception as ex:
                    print("CHECK FAIL", name, T, fp8, repr(ex)[:400], flush=True)
                    continue
                y2 = call(x, w, ids, wts)
                ref = fused_moe_torch(
                    x, w[0], w[1], topk_ids=ids, topk_weights=wts, w13_scale=w[2], w2_scale=w[3]
                )
                out = torch.full_like(y, float("nan"))
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call(x, w, ids, wts, out=out)
                torch.cuda.current_stream().wait_stream(s)
                out.fill_(float("nan"))
                with torch.cuda.graph(g):
                    call(x, w, ids, wts, out=out)
                g.replay()
                torch.cuda.synchronize()
                r = dict(
                    kind="check",
                    shape=name,
                    T=T,
                    fp8=fp8,
                    cfg=str(moe_config(T, K, H, I, E, fp8=fp8).direct),
                    rel_err=rel(y, ref),
                    nan=bool(torch.isnan(y).any()),
                    determ=bool(torch.equal(y, y2)),
                    graph_eq=bool(torch.equal(out, y)),
                )
                rows.append(r)
                print(r, flush=True)
    # skewed: all tokens to expert 3; and empty experts
    name = "qwen3"
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    w = weights(name, False)
    for T in (64, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.arange(3, 3 + K, device="cuda")] * T).int()
        ids[:, 0] = 3
        wts = torch.rand(T, K, device="cuda")
        y = call(x, w, ids, wts)
        ref = fused_moe_torch(x, w[0], w[1], topk_ids=ids, topk_weights=wts)
        r = dict(kind="skew", shape=name, T=T, rel_err=rel(y, ref))
        rows.append(r)
        print(r, flush=True)


def timeit(name, T, fp8, cfg=None, tag="default"):
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    w = weights(name, fp8)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, _, _, _, ids, wts = routing_inputs(name, T)
    c = cfg or moe_config(T, K, H, I, E, fp8=fp8)
    try:
        us = time_graph(lambda: call(x, w, ids, wts, cfg=c), rep_ms=30)
    except Exception as ex:
        print("FAIL", name, T, tag, repr(ex)[:200])
        return None
    fl, bound = layer_floor_ms(name, T, ids, 1 if fp8 else 2)
    r = dict(
        kind="time",
        shape=name,
        T=T,
        fp8=fp8,
        tag=tag,
        us=round(us, 1),
        floor_us=round(fl * 1e3, 1),
        frac=round(fl * 1e3 / us, 3),
        vllm_us=VLLM_KERNELS_MS.get((name, T), 0) * 1e3,
        cfg=str(c),
    )
    rows.append(r)
    print({k: v for k, v in r.items() if k != "cfg"}, flush=True)
    return us


if "time" in what:
    for name in ("qwen3", "mixtral", "deepseek"):
        for fp8 in (False, True):
            for T in (1, 8, 64, 256, 1024, 4096, 16384):
                timeit(name, T, fp8)


def V(name, T, fp8, tag, **kw):
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    timeit(name, T, fp8, replace(moe_config(T, K, H, I, E, fp8=fp8), **kw), tag)


def P(bm, bn1, bk1, w1, s1, bn2, bk2, w2, s2, g=8, direct=False):
    return dict(
        direct=direct,
        block_m=bm,
        block_n1=bn1,
        block_k1=bk1,
        warps1=w1,
        stages1=s1,
        block_n2=bn2,
        block_k2=bk2,
        warps2=w2,
        stages2=s2,
        group_m=g,
    )


if "variants" in what:
    mid = [
        P(16, 32, 256, 4, 4, 32, 256, 4, 4),
        P(16, 128, 64, 4, 4, 128, 64, 4, 4),
        P(16, 64, 64, 4, 5, 128, 64, 4, 5),
        P(16, 64, 256, 4, 3, 64, 256, 4, 3),
        P(16, 128, 128, 8, 3, 128, 128, 8, 3),
        P(32, 64, 128, 4, 4, 64, 128, 4, 4),
    ]
    for name, T in (
        ("qwen3", 8),
        ("qwen3", 64),
        ("qwen3", 256),
        ("mixtral", 8),
        ("mixtral", 64),
        ("mixtral", 256),
        ("deepseek", 8),
    ):
        for i, c in enumerate(mid):
            V(name, T, False, f"mid{i}", **c)
    for T in (1024,):
        for i, c in enumerate(
            [
                P(32, 64, 128, 4, 4, 64, 128, 4, 4),
                P(64, 128, 64, 4, 4, 128, 64, 4, 4),
                P(128, 128, 64, 8, 4, 256, 64, 8, 4),
                P(64, 64, 64, 4, 4, 128, 64, 4, 4),
            ]
        ):
            V("qwen3", T, False, f"q1k{i}", **c)
    pre = [
        P(128, 128, 64, 8, 4, 256, 64, 8, 4, 16),
        P(128, 128, 64, 8, 4, 256, 64, 8, 4, 4),
        P(128, 128, 64, 8, 3, 256, 64, 8, 3),
        P(128, 64, 64, 4, 4, 128, 64, 4, 4),
        P(64, 128, 64, 8, 4, 256, 64, 8, 4),
        P(128, 128, 64, 8, 4, 128, 64, 4, 4),
    ]
    for name in ("qwen3", "mixtral", "deepseek"):
        for i, c in enumerate(pre):
            V(name, 4096, False, f"pre{i}", **c)
    for name, T in (("qwen3", 1), ("qwen3", 64), ("mixtral", 64), ("deepseek", 1)):
        for i, c in enumerate(
            [
                P(16, 64, 128, 4, 4, 64, 128, 4, 4, direct=T == 1),
                P(16, 32, 128, 4, 4, 32, 128, 4, 4, direct=T == 1),
                P(16, 128, 128, 4, 3, 128, 128, 4, 3, direct=T == 1),
            ]
        ):
            V(name, T, True, f"f8d{i}", **c)

if "variants2" in what:
    for i, c in enumerate(
        [
            P(16, 32, 256, 4, 4, 16, 256, 4, 3, direct=True),
            P(16, 32, 256, 4, 4, 64, 128, 4, 4, direct=True),
            P(16, 16, 256, 4, 4, 32, 128, 4, 4, direct=True),
            P(16, 32, 128, 4, 4, 32, 128, 4, 4, direct=True),
            P(16, 64, 128, 4, 4, 32, 256, 4, 4, direct=True),
        ]
    ):
        V("qwen3", 1, False, f"dec{i}", **c)
        V("deepseek", 1, False, f"dec{i}", **c)
    for i, c in enumerate(
        [
            P(16, 32, 128, 4, 4, 32, 128, 4, 4, direct=True),
            P(16, 64, 128, 4, 4, 64, 128, 4, 4, direct=True),
            P(16, 128, 128, 4, 3, 64, 128, 4, 3, direct=True),
        ]
    ):
        V("qwen3", 1, True, f"f8dec{i}", **c)
    for i, c in enumerate(
        [
            P(64, 128, 64, 8, 4, 256, 64, 8, 4),
            P(64, 64, 128, 4, 4, 64, 128, 4, 4),
            P(128, 128, 64, 8, 4, 256, 64, 8, 4),
            P(32, 64, 128, 4, 4, 64, 128, 4, 4),
            P(64, 128, 64, 4, 4, 128, 64, 4, 4),
        ]
    ):
        V("mixtral", 256, False, f"m256_{i}", **c)
        V("qwen3", 1024, False, f"m256_{i}", **c)

if "profile" in what:
    from torch.profiler import ProfilerActivity, profile

    for name, T, fp8 in (
        ("qwen3", 1, False),
        ("qwen3", 64, False),
        ("qwen3", 4096, False),
        ("mixtral", 4096, False),
        ("qwen3", 1, True),
    ):
        H, I, E, K, _ = SHAPES[name]  # noqa: E741
        w = weights(name, fp8)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        _, _, _, _, ids, wts = routing_inputs(name, T)
        for _ in range(3):
            call(x, w, ids, wts)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call(x, w, ids, wts)
            torch.cuda.synchronize()
        print("PROFILE", name, T, fp8)
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                print(f"   {ev.key[:40]:<40} {ev.device_time_total / ev.count:8.1f} us x{ev.count}")

json.dump(rows, open(os.path.join(OUT, "tune.json"), "w"), indent=1)
print(f"\n{'shape':<8} {'T':>6} {'fp8':>4} {'tag':<22} {'us':>9} {'floor':>9} {'frac':>6} {'vllm':>8} extra")
for r in rows:
    if r["kind"] == "time":
        print(
            f"{r['shape']:<8} {r['T']:6d} {r['fp8']:4d} {r['tag']:<22} {r['us']:9.1f} {r['floor_us']:9.1f} "
            f"{r['frac']:6.3f} {r['vllm_us']:8.1f}"
        )
    else:
        print(
            r["kind"],
            r["shape"],
            r["T"],
            r.get("fp8"),
            f"rel={r['rel_err']:.2e}",
            "nan" if r.get("nan") else "",
            "det" if r.get("determ") else "",
            "geq" if r.get("graph_eq") else "",
        )

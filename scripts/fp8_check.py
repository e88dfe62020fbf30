"""fp8 fused MoE: batch invariance and the one-tile-height configurations vs the previous ones (GPU).

For each shape: tokens computed alone (T=1) against the same tokens inside batches of T (eager and
one CUDA graph), fp8 and bf16; then CUDA-graph times (L2 flushed) of the fp8 experts with the default
(batch-invariant) configuration and with batch_invariant=False (16/32-row tiles at decode sizes), and of
bf16.

Usage: PYTHONPATH=src python3 scripts/fp8_check.py [--shapes qwen3,mixtral,deepseek]
"""

import argparse

import torch

from replaymoe.bench._timing import time_graph
from replaymoe.bench.moe import SHAPES, make_weights, routing_inputs
from replaymoe.moe import fused_moe
from replaymoe.moe_triton import experts_triton, moe_config

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="qwen3,mixtral,deepseek")
p.add_argument("--Ts", default="1,8,64,256,1024,4096")
a = p.parse_args()
Ts = [int(t) for t in a.Ts.split(",")]


def old_fp8_config(T, K, H, I, E):  # noqa: E741
    """The fp8 configuration without the invariance guarantee (16/32-row tiles at decode sizes)."""
    return moe_config(T, K, H, I, E, fp8=True, batch_invariant=False)


def call(x, w, ids, wts, cfg=None, out=None):
    w13, w2, s13, s2 = w
    return experts_triton(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=0, out=out,
                          config=cfg)  # fmt: skip


def timed(x, w, ids, wts, cfg=None):
    return time_graph(lambda: call(x, w, ids, wts, cfg=cfg))


summary = []
for name in a.shapes.split(","):
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    for fp8 in (True, False):
        w = make_weights(H, I, E, fp8=fp8)
        Tmax = max(Ts)
        _, _, _, _, ids, wts = routing_inputs(name, Tmax)
        g = torch.Generator(device="cuda").manual_seed(3)
        x = torch.randn(Tmax, H, device="cuda", generator=g, dtype=torch.bfloat16)
        probe = 4
        alone = torch.cat([call(x[t : t + 1], w, ids[t : t + 1], wts[t : t + 1]) for t in range(probe)])
        bad = []
        for T in Ts[1:]:
            out = fused_moe(
                x[:T], w[0], w[1], topk_ids=ids[:T], topk_weights=wts[:T], w13_scale=w[2], w2_scale=w[3]
            )  # fmt: skip  (the public op, eager configuration)
            n = min(T, probe)
            if not torch.equal(out[:n], alone[:n]):
                bad.append((T, float((out[:n].float() - alone[:n].float()).abs().max())))
        # graph at T=64
        T = 64
        o = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(x[:T], w, ids[:T], wts[:T], out=o)
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            call(x[:T], w, ids[:T], wts[:T], out=o)
        o.fill_(float("nan"))
        gr.replay()
        torch.cuda.synchronize()
        graph_ok = torch.equal(o[:probe], alone)
        inv = "OK" if not bad else "DIFF " + str(bad)
        kind = "fp8" if fp8 else "bf16"
        line = f"{name:8s} {kind} invariance: {inv}; graph T=64 {'OK' if graph_ok else 'DIFF'}"
        print(line, flush=True)
        summary.append(line)
        for T in Ts:
            new_us = timed(x[:T], w, ids[:T], wts[:T])
            row = f"  {name:8s} {'fp8' if fp8 else 'bf16'} T={T:5d} default {new_us:8.1f} us"
            if fp8:
                oc = old_fp8_config(T, K, H, I, E)
                old_us = timed(x[:T], w, ids[:T], wts[:T], oc)
                row += f"  non-invariant {old_us:8.1f} us  invariant/non-invariant {new_us / old_us:.2f}"
            print(row, flush=True)
            summary.append(row)
        w = None
        torch.cuda.empty_cache()
print("\n".join(["", "SUMMARY"] + summary))

"""Prefill experts with and without TMA descriptors (GPU timing check for the tile-mode TMA change).

For the bench shapes (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3; bf16, topk given) at T in {1024,
4096, 16384}, the experts are timed with ``moe_triton.TMA_ENABLED`` off and on, in alternation (off,
on, off, on; the better median of each kept, so that clock or host drift falls on both alike), under
CUDA-graph replay with the L2 flushed (``replaymoe.bench._timing.time_graph``). The configuration is
the wrapper's own choice (``moe_config``: TMA only for the 128-row prefill tiles, so points that take
the mid-size tiles time the same kernels twice and say so; ``--all-tiles`` gives those tiles TMA
too). Prints one row per point: the configuration, both times, the ratio, TFLOP/s and % of the
700 TFLOP/s bf16 peak, and whether the outputs are bitwise equal. ``--kernels`` adds an eager profile
(torch.profiler) of GEMM1 and GEMM2 alone.

Usage: PYTHONPATH=src python3 scripts/fwd_tma_check.py [--shapes qwen3,mixtral,deepseek]
       [--tokens 1024,4096,16384] [--kernels] [--all-tiles]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

import replaymoe.moe_triton as mt
from replaymoe.bench._timing import BF16_FLOPS_PER_S, NO_CUDA_EXIT, no_cuda, time_graph
from replaymoe.bench.moe import SHAPES, make_weights, routing_inputs


def kernel_us(f, names=("moe_gemm1_kernel", "moe_gemm2_kernel"), calls: int = 5) -> dict[str, float]:
    """Mean device time per call of each named kernel over ``calls`` eager calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    got = {n: 0.0 for n in names}
    for ev in prof.key_averages():
        for n in names:
            if n in ev.key:
                got[n] += ev.device_time_total / calls  # µs
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3,mixtral,deepseek")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--kernels", action="store_true", help="also profile GEMM1 / GEMM2 alone (eager)")
    tiles = "TMA for every tile configuration (16/32-row mid-size tiles too), not only the prefill tiles"
    ap.add_argument("--all-tiles", action="store_true", help=tiles)
    a = ap.parse_args()
    if no_cuda("fwd_tma_check.py"):
        return NO_CUDA_EXIT
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(dev)}; TMA usable here: {mt.tma_ok(dev)} (TMA_ENABLED "
          f"{mt.TMA_ENABLED}); times: CUDA-graph replay medians, L2 flushed, µs")  # fmt: skip
    print(f"{'shape':8s} {'T':>6s} {'config':>22s} {'off us':>9s} {'on us':>9s} {'off/on':>6s} "
          f"{'TF/s off':>8s} {'TF/s on':>8s} {'% 700 on':>8s}  same bits")  # fmt: skip
    for name in a.shapes.split(","):
        H, I, E, K, _ = SHAPES[name]  # noqa: E741
        w13, w2, _, _ = make_weights(H, I, E, fp8=False)
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            _, _, _, _, ids, wts = routing_inputs(name, T)

            c0 = mt.moe_config(T, K, H, I, E, tma=True)  # --all-tiles: this shape's tiles, TMA as switched

            def f(x=x, ids=ids, wts=wts, w13=w13, w2=w2, c0=c0):
                # None: the wrapper's choice, which reads mt.TMA_ENABLED
                c = replace(c0, tma=mt.tma_ok(dev) and not c0.direct) if a.all_tiles else None
                return mt.experts_triton(
                    x,
                    w13,
                    w2,
                    ids,
                    wts,
                    w13_scale=None,
                    w2_scale=None,
                    local_expert_offset=0,
                    out=None,
                    config=c,
                )

            res = {}
            for _ in range(2):  # off, on, off, on
                for tma in (False, True):
                    mt.TMA_ENABLED = tma
                    y = f()
                    us = time_graph(f, rep_ms=200)
                    prev = res.get(tma)
                    res[tma] = (y, min(us, prev[1]) if prev else us)
            mt.TMA_ENABLED = True
            c = mt.moe_config(T, K, H, I, E, tma=mt.tma_ok(dev))
            if a.all_tiles:
                c = replace(c, tma=mt.tma_ok(dev) and not c.direct)
            flops = 2 * T * K * 3 * H * I
            off, on = res[False][1], res[True][1]
            tf_off, tf_on = flops / off / 1e6, flops / on / 1e6
            cfg = f"bm{c.block_m} tma={c.tma}" + ("" if c.tma else " (same kernels)")
            same = torch.equal(res[False][0], res[True][0])
            print(f"{name:8s} {T:6d} {cfg:>22s} {off:9.1f} {on:9.1f} {off / on:6.3f} {tf_off:8.0f} "
                  f"{tf_on:8.0f} {tf_on * 1e12 / BF16_FLOPS_PER_S:8.0%}  {same}", flush=True)  # fmt: skip
            if a.kernels:
                for tma in (False, True):
                    mt.TMA_ENABLED = tma
                    k = kernel_us(f)
                    g1, g2 = k["moe_gemm1_kernel"], k["moe_gemm2_kernel"]
                    f1, f2 = 2 * T * K * 2 * H * I, 2 * T * K * H * I
                    print(f"{'':15s} eager TMA={str(tma):5s} GEMM1 {g1:8.1f} us ({f1 / g1 / 1e6:4.0f} TF/s)  "
                          f"GEMM2 {g2:8.1f} us ({f2 / g2 / 1e6:4.0f} TF/s)", flush=True)  # fmt: skip
                mt.TMA_ENABLED = True
            del x, ids, wts, res, y
        del w13, w2
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

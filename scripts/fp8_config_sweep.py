"""fp8 small-batch configuration sweep on the GPU (batch-invariant 64-row tiles, BLOCK_K 128).

For each (shape, T) point, GEMM1's and then GEMM2's BLOCK_N / stages / warps are varied one GEMM at a
time around the configuration :func:`replaymoe.moe_triton.moe_config` picks; every variant must give
the default's bits (the tile height and BLOCK_K are fixed, so the batch-invariance guarantee holds).
Times are medians of CUDA-graph replays with the L2 flushed (``replaymoe.bench._timing.time_graph``),
experts only (top-k given). The last lines combine each GEMM's best and time it against the default
twice. bench/results/diag/s10_fp8_sweep_h200.txt is its output on the H200 (session 10).

Usage: PYTHONPATH=src python3 scripts/fp8_config_sweep.py [qwen3:1 mixtral:8 ...]
"""

import dataclasses
import sys

import torch

from replaymoe.bench._timing import time_graph
from replaymoe.bench.moe import SHAPES, make_weights, routing_inputs
from replaymoe.moe_triton import experts_triton, moe_config

DEFAULT_POINTS = ["qwen3:1", "mixtral:1", "deepseek:1", "qwen3:8", "mixtral:8", "deepseek:8", "qwen3:64",
                  "mixtral:64", "deepseek:64"]  # fmt: skip
# (BLOCK_N, stages, warps) tried for each GEMM
VARIANTS = [(bn, st, 4) for bn in (32, 64, 128) for st in (3, 4, 6)] + [(64, 4, 8), (128, 4, 8)]


def run(x, w, ids, wts, cfg):
    w13, w2, s13, s2 = w
    return experts_triton(
        x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=0, out=None, config=cfg
    )


def sweep(name: str, T: int, w) -> str:
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    *_, ids, wts = routing_inputs(name, T)
    c0 = moe_config(T, K, H, I, E, fp8=True)
    ref = run(x, w, ids, wts, c0).clone()
    t0 = time_graph(lambda: run(x, w, ids, wts, c0))
    print(f"{name} T={T} default {c0} {t0:.1f} us", flush=True)
    best = {}
    for g, fields in (("g1", ("block_n1", "stages1", "warps1")), ("g2", ("block_n2", "stages2", "warps2"))):
        best[g] = (t0, c0)
        for values in VARIANTS:
            c = dataclasses.replace(c0, **dict(zip(fields, values)))
            if c == c0:
                continue
            try:
                ok = torch.equal(run(x, w, ids, wts, c), ref)
                t = time_graph(lambda c=c: run(x, w, ids, wts, c))
            except Exception as exc:  # e.g. OutOfResources: the variant does not fit
                print(f"  {g} bn{values[0]} st{values[1]} w{values[2]} ERR {type(exc).__name__}")
                continue
            print(f"  {g} bn{values[0]} st{values[1]} w{values[2]}: {t:.1f} us {ok}", flush=True)
            if ok and t < best[g][0]:
                best[g] = (t, c)
    b1, b2 = best["g1"][1], best["g2"][1]
    cb = dataclasses.replace(b1, block_n2=b2.block_n2, stages2=b2.stages2, warps2=b2.warps2)
    okb = torch.equal(run(x, w, ids, wts, cb), ref)
    tb = min(time_graph(lambda: run(x, w, ids, wts, cb)) for _ in range(2))
    t0b = min(time_graph(lambda: run(x, w, ids, wts, c0)) for _ in range(2))
    return (f"{name:8s} T={T:3d} default {t0b:7.1f} us  combined {tb:7.1f} us ({tb / t0b:.2f}) bitwise {okb}"
            f"  cfg {list(dataclasses.astuple(cb))}")  # fmt: skip


def main(points: list[str]) -> None:
    weights: dict = {}
    summary = []
    for point in points or DEFAULT_POINTS:
        name, T = point.split(":")
        if name not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            H, I, E, _, _ = SHAPES[name]  # noqa: E741
            weights[name] = make_weights(H, I, E, fp8=True)
        summary.append(sweep(name, int(T), weights[name]))
        print(summary[-1], flush=True)
    print("=== summary")
    print("\n".join(summary))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Device script: the TMA dW GEMM's partial last chunk, one masked full chunk against 16-row pieces.

PYTHONPATH=src python3 bench/dw_tail_probe.py [--points mixtral:1024,qwen3:1024,...]

For each bench shape (``replaymoe.bench.train.SHAPES``) and T: random routing (top-k of normal logits), both
dW GEMMs (dW13: C[e] = [2I, H]; dW2: C[e] = [H, I]) over random pre-gathered rows, run by
``moe_bwd_dw_tma_kernel`` with ``TAIL_K = BLOCK_K`` (one masked full chunk) and ``TAIL_K = 16`` (pieces), on
the tile grid (the 128×128×32 tiles, 4 warps, 4 stages, 168 registers that small experts take) and on the
persistent grid (128×256×32, 8 warps, 6 stages, one program per SM: the large-expert tiles). Prints µs
(``triton.testing.do_bench``, L2 flushed), TFLOP/s and whether the pieces give the same values
(``torch.equal``). The kernel takes pieces on the tile grid only (``moe._backward``, bench/moe_notes.md
session 23).
"""

import argparse

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from replaymoe.bench.train import SHAPES
from replaymoe.moe._kernel_bwd import moe_bwd_dw_tma_kernel

GRIDS = {"tile": (128, 128, 32, 4, 4, 168, 0), "persistent": (128, 256, 32, 8, 6, None, -1)}


def launcher(a, b, c, starts, counts, E, cfg, tail_k):
    bm, bn, bk, warps, stages, maxnreg, progs = cfg
    (slots, m), n = a.shape, b.shape[1]
    ad = TensorDescriptor(a, [slots, m], [m, 1], [bk, bm])
    bd = TensorDescriptor(b, [slots, n], [n, 1], [bk, bn])
    at = TensorDescriptor(a, [slots, m], [m, 1], [tail_k, bm])
    bt = TensorDescriptor(b, [slots, n], [n, 1], [tail_k, bn])
    cd = TensorDescriptor(c, [E * m, n], [n, 1], [bm, bn])
    tiles = E * triton.cdiv(m, bm) * triton.cdiv(n, bn)
    progs = torch.cuda.get_device_properties(0).multi_processor_count if progs < 0 else progs

    def run():
        moe_bwd_dw_tma_kernel[(progs or tiles,)](
            ad, bd, at, bt, cd, c, starts, counts, m, n, tiles, c.stride(0), c.stride(1), C_DESC=True,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TAIL_K=tail_k, GROUP_M=8, DOT_PREC="ieee", NUM_PROGS=progs,
            num_warps=warps, num_stages=stages, maxnreg=maxnreg,
        )  # fmt: skip

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="mixtral:1024,qwen3:1024,qwen3:4096,mixtral:4096,dsv3:4096")
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}: bench/dw_tail_probe.py --points {a.points}", flush=True)
    for point in a.points.split(","):
        name, T = point.split(":")
        T = int(T)
        H, I, E, K = SHAPES[name]  # noqa: E741
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.topk(torch.randn(T, E, device="cuda", generator=g), K, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
        starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        for gemm, (m, n) in (("dW13", (2 * I, H)), ("dW2", (H, I))):
            x = torch.randn(T * K, m, device="cuda", dtype=torch.bfloat16, generator=g)
            y = torch.randn(T * K, n, device="cuda", dtype=torch.bfloat16, generator=g)
            flops = 2 * T * K * m * n
            for grid, cfg in GRIDS.items():
                outs, us = [], []
                for tail_k in (cfg[2], 16):
                    c = torch.full((E, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    run = launcher(x, y, c, starts, counts, E, cfg, tail_k)
                    run()
                    outs.append(c)
                    us.append(triton.testing.do_bench(run, warmup=30, rep=200) * 1e3)
                tflops = flops / us[0] / 1e6
                print(f"{name} T={T} {gemm} {grid:10s}: full chunk {us[0]:8.1f} us ({tflops:4.0f} TFLOP/s), "
                      f"pieces {us[1]:8.1f} us ({us[1] / us[0]:.3f}x), same values "
                      f"{torch.equal(outs[0], outs[1])}", flush=True)  # fmt: skip
                del outs
            del x, y
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

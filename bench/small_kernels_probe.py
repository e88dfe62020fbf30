"""Device script: the layout scatter's and the reduce's launch shapes at small T.

PYTHONPATH=src python3 bench/small_kernels_probe.py: graph replay of 20 launches, µs per launch.
Results: bench/results/small_kernels_h100_s28.txt (bench/moe_notes.md, session 28).
"""

import torch

from replaymoe._launch import cdiv
from replaymoe.bench._timing import time_graph
from replaymoe.moe import layout as L
from replaymoe.moe._kernel_fwd import moe_reduce_kernel
from replaymoe.moe._kernel_layout import layout_hist_kernel, layout_scatter_kernel


def tg(fn, n: int = 20) -> float:
    """µs per launch of ``fn`` over a CUDA graph of ``n`` launches (``bench._timing.time_graph``)."""

    def many():
        for _ in range(n):
            fn()

    return time_graph(many, rep_ms=200.0) / n


def layout_variant(ids, E, bm, warps_s, warps_h):
    T, K = ids.shape
    plan = L._host_plan(T * K, E, bm, 1, False)
    buf = torch.empty(plan.total, dtype=torch.int32, device="cuda")
    parts = buf.split(plan.rounded)
    hist, base, ss, te, tre, offs, cnts, nt, *_ = (
        p if ex else p[:n] for p, (n, ex) in zip(parts, plan.sizes)
    )
    base = base.view(1, plan.num_chunks, plan.e_pad)
    single = plan.num_chunks == 1

    def run():
        if not single:
            layout_hist_kernel[(plan.num_chunks,)](ids, hist, T * K, 0, E, CH=plan.ch, E_PAD=plan.e_pad,
                                                   num_warps=warps_h)  # fmt: skip
        layout_scatter_kernel[(plan.grid,)](
            ids, hist, base, ss, te, tre, offs, cnts, nt, T * K, 0, E, plan.num_chunks, plan.max_tiles,
            CH=plan.ch, E_PAD=plan.e_pad, NC_PAD=plan.nc_pad, BLOCK_M=bm, SEG=bm, TILE_BLOCK=plan.tile_block,
            SINGLE=single, num_warps=warps_s)  # fmt: skip

    return run


# (name, T, H, E, K, tile rows): decode to mid-size batches, then prefill (the reduce's block at large T)
POINTS = [
    ("qwen3", 8, 2048, 128, 8, 16),
    ("qwen3", 64, 2048, 128, 8, 16),
    ("qwen3", 64, 2048, 128, 8, 64),
    ("dsv3", 64, 7168, 256, 8, 16),
    ("mixtral", 64, 4096, 8, 2, 32),
    ("qwen3", 4096, 2048, 128, 8, 64),
    ("qwen3", 16384, 2048, 128, 8, 128),
    ("dsv3", 4096, 7168, 256, 8, 128),
]


def main():
    print(torch.cuda.get_device_name())
    for name, T, H, E, K, bm in POINTS:
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
        line = [f"{name} T={T} bm={bm} layout:"]
        for ws, wh in [(8, 4), (4, 4), (2, 2), (4, 1)]:
            line.append(f"s{ws}/h{wh} {tg(layout_variant(ids, E, bm, ws, wh)):.2f}")
        print("  ".join(line), flush=True)
        y = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        line = [f"{name} T={T} reduce:"]
        for bh in (256, 512, 1024, 2048):
            for w in (1, 2, 4, 8) if T <= 64 else (4,):
                if bh > H:
                    continue

                def run(bh=bh, w=w, T=T, H=H, K=K, E=E, y=y, ids=ids, out=out):
                    moe_reduce_kernel[(T, cdiv(H, bh))](y, ids, out, H, K, 0, E, y.stride(0), out.stride(0),
                                                        BLOCK_H=bh, num_warps=w)  # fmt: skip

                line.append(f"bh{bh}/w{w} {tg(run):.2f}")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()

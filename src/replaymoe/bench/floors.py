"""``replaymoe bench moe --read-floors``: the bare-read floor of each decode point.

For each shape and token count: the experts the bench's routing hits (random top-k from softmaxed normal
logits, seed 0, as ``bench moe``'s peer driver draws them), their weight bytes in bf16 and in fp8
(``active * 3 * H * I`` elements), and the best time of a plain one-kernel read of that many bytes over a
small configuration sweep, timed as every ``bench moe`` point is (one CUDA-graph replay, L2 flushed
before each: :func:`replaymoe.bench._timing.time_graph`). The read is of one contiguous buffer, so it is
a floor for the experts' scattered weights, not their exact cost; the decode times are held to 1.10 × it
(current figures: ``bench/README.md``, "Read floors").
"""

from __future__ import annotations

import torch
import triton

from ._kernel_read import read_kernel
from ._timing import time_graph

FLOOR_COLUMNS = ["shape", "T", "dtype", "active_experts", "mbytes", "read_us", "tb_s", "bound_us", "config"]


def best_read_us(nbytes: int) -> tuple[float, str]:
    """The fastest read of ``nbytes`` (a bf16 buffer) over the sweep: (µs, "block/iters/warps")."""
    n = nbytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    best: tuple[float, str] | None = None
    for block in (1024, 2048, 4096):
        for iters in (1, 2, 4, 8):
            for warps in (4, 8):
                grid = triton.cdiv(n, block * iters)
                out = torch.empty(grid, device="cuda")

                def read(grid=grid, out=out, block=block, iters=iters, warps=warps):
                    read_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)

                us = time_graph(read, rep_ms=50)
                if best is None or us < best[0]:
                    best = (us, f"{block}/{iters}/{warps}")
    assert best is not None
    return best


def run_read_floors(shapes: dict[str, tuple[int, int, int, int]], tokens: list[int]) -> list[dict]:
    """One row per (shape, T, dtype) of ``shapes`` (name -> (H, I, E, K), ``bench moe``'s): the active
    experts, their bytes, the best read and 1.10 × it."""
    rows: list[dict] = []
    for name, (H, I, E, K) in shapes.items():  # noqa: E741
        for T in tokens:
            g = torch.Generator(device="cuda").manual_seed(0)
            logits = torch.randn(T, E, device="cuda", generator=g)
            ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1).indices
            active = int(torch.unique(ids).numel())  # a benchmark's setup, outside any timed call
            for dtype, size in (("bf16", 2), ("fp8", 1)):
                nbytes = active * 3 * H * I * size
                us, cfg = best_read_us(nbytes)
                row = {"shape": name, "T": T, "dtype": dtype, "active_experts": active,
                       "mbytes": nbytes / 1e6, "read_us": us, "tb_s": nbytes / us / 1e6,
                       "bound_us": 1.1 * us, "config": cfg}  # fmt: skip
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                torch.cuda.empty_cache()
    return rows

"""The receive side of the all-to-all: sanitize dispatched expert ids, sum combined rows per token.

:func:`combine_reduce` is the per-token fp32 sum that ends every ``combine`` (Triton or torch ops,
both transports); :func:`sanitize_triton` launches the received-id sanitization on its own (the
all-to-all launches the same kernel from its cached plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._launch import addresses, cdiv, next_power_of_2
from .packing import row_tiling

if TYPE_CHECKING:
    from ._core import AlltoAllCore


def sanitize_triton(core: AlltoAllCore, flat, recv, counts, rt, lo, hi, invalid) -> None:
    """Launch ``ep_sanitize_kernel`` alone on the received id rows ``flat`` (``[n, K]`` int32 over
    all blocks of ``recv``): ids outside ``[lo, hi)`` and rows past each source's count (read from
    ``counts``) become ``invalid``. The all-to-all fuses this into its receive; tests call it."""

    from ._kernel_sanitize import ep_sanitize_kernel

    n, K = flat.shape
    hdr = recv.view(torch.int32)
    hdr_block = counts.stride(0)
    hdr_off = counts.storage_offset() - hdr.storage_offset()
    block = 128
    ep_sanitize_kernel[(cdiv(n, block),)](
        flat, hdr, core.recv_counts, n, flat.stride(0), rt + 1, hdr_block, hdr_off, lo, hi, invalid,
        counts, counts, 0, 0, K=K, K_P2=max(2, next_power_of_2(K)), EP=core.ep,
        EP_P2=max(2, next_power_of_2(core.ep)), BLOCK=block, RANK=core.rank, HAS_IDS=True, WAIT=False,
        TIMER=False,
    )  # fmt: skip


def combine_reduce(
    core: AlltoAllCore,
    rows: torch.Tensor,
    block_stride: int,
    slot: torch.Tensor,
    out: torch.Tensor,
    cache: dict | None = None,
    own: torch.Tensor | None = None,
    wait: tuple | None = None,
) -> None:
    """out[t] = sum_r [slot[t, r] >= 0] rows[r, slot[t, r]] in fp32 (rank order). ``own``: this rank's
    rows [rt, H] (row stride free) when the transport did not copy them into ``rows`` (symm).
    ``cache`` keeps the launch plans per layout (the dispatch state's)."""
    T, H = out.shape
    ep = core.ep
    if T == 0 and wait is None:
        return
    row_stride = rows.stride(0)
    if core.use_triton():
        persistent = core.num_sms is not None
        own_key = None if own is None else (own.stride(0), own.data_ptr() & 15)
        key = (rows.dtype, rows.data_ptr() & 15, H, block_stride, row_stride, own_key, persistent)
        key = (*key, wait is None)
        plan = None if cache is None else cache.get(key)
        if plan is None:
            from .._launch import Launcher
            from ._kernel_combine import ep_combine_reduce_kernel

            nb, chunks, tt, warps = row_tiling(H, persistent)
            plan = (Launcher(ep_combine_reduce_kernel, num_warps=warps), chunks, max(1, -(-T // tt)), nb, tt)
            if cache is not None:
                cache[key] = plan
        launch, chunks, work, nb, tt = plan
        nprog = core.programs(work * chunks, chunks) if persistent else core.dense_programs(work, chunks)
        own_t, own_rs, own_r = (rows, 0, -1) if own is None else (own, own.stride(0), core.rank)
        w = wait if wait is not None else (slot, slot, 0, 0, False)
        args = (rows, slot, out, own_t, T, H, block_stride, row_stride, own_rs, *w[:4], ep, own_r, nb, tt,
                wait is not None, w[4])  # fmt: skip
        if launch.ready():
            launch.fast((nprog, chunks), addresses(args))
        else:
            launch((nprog, chunks), args)
        return
    nrows = rows.shape[0]  # rows is a 2-D [N, H] view of the buffer; rank r's row j = r*bs/rs + j
    per_rank = block_stride // row_stride
    idx = (torch.arange(ep, device=slot.device, dtype=torch.int64)[None, :] * per_rank + slot.long()).clamp(
        0, nrows - 1
    )
    g = rows[idx.reshape(-1)].reshape(T, ep, H).float()
    g = torch.where((slot >= 0)[:, :, None], g, torch.zeros((), dtype=torch.float32, device=g.device))
    acc = g[:, 0]
    for r in range(1, ep):
        acc = acc + g[:, r]
    out.copy_(acc)

"""Triton kernel of the dispatch's receive side: sanitize the received expert ids and copy the counts
(``ep_sanitize_kernel``; the pack kernel's last programs run the same rows, :func:`sanitize_rows`). Only
``@triton.jit`` code lives here; the launch logic is in ``replaymoe.ep``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_sync import wait_peers


@triton.jit
def ep_sanitize_kernel(
    ids_ptr,  # int32 received ids, rows [n_rows, K] with row stride stride_ids_row (a run over all blocks)
    hdr_ptr,  # int32 view of the receive buffer: count of source s at s * hdr_block + hdr_off
    recv_counts_ptr,  # int32 [EP] out (written by program 0)
    n_rows,
    stride_ids_row,
    rows_per_block,  # runtime_max + 1 (row rt of a block is its header)
    hdr_block,
    hdr_off,
    lo,
    hi,
    invalid,
    epoch_ptr,  # int32: this rank's dispatch epoch (WAIT)
    pad_ptr,  # int32: this rank's signal pad (WAIT)
    pad_base,
    timeout_ns,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    RANK: tl.constexpr,
    HAS_IDS: tl.constexpr,  # False: only wait (WAIT) and copy the counts
    WAIT: tl.constexpr,  # symm: wait for every peer's dispatch signal first
    TIMER: tl.constexpr,
):
    """Ids of padding rows (slot >= count of its source, header rows included) and of experts outside
    [lo, hi) become ``invalid``; program 0 also copies the counts to ``recv_counts``."""
    if WAIT:
        wait_peers(tl.load(epoch_ptr), pad_ptr, pad_base, timeout_ns, EP, RANK, TIMER)
    sanitize_rows(ids_ptr, hdr_ptr, recv_counts_ptr, n_rows, stride_ids_row, rows_per_block, hdr_block,
                  hdr_off, lo, hi, invalid, tl.program_id(0), tl.num_programs(0), K, K_P2, EP, EP_P2, BLOCK,
                  HAS_IDS)  # fmt: skip


@triton.jit
def sanitize_rows(ids_ptr, hdr_ptr, recv_counts_ptr, n_rows, stride_ids_row, rows_per_block, hdr_block,
                  hdr_off, lo, hi, invalid, pid, nprog, K: tl.constexpr, K_P2: tl.constexpr,
                  EP: tl.constexpr, EP_P2: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_IDS: tl.constexpr):  # fmt: skip
    """The receive side's work after the wait (:func:`ep_sanitize_kernel`), as program ``pid`` of
    ``nprog``: rows ``pid * BLOCK, (pid + nprog) * BLOCK, ...``; program 0 copies the counts."""
    ks = tl.arange(0, K_P2)
    if HAS_IDS:
        for r0 in range(pid * BLOCK, n_rows, nprog * BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            rmask = rows < n_rows
            s = rows // rows_per_block
            j = rows % rows_per_block
            # (L2 only: in the pack's launch, peers and other programs wrote them during the launch)
            cnt = tl.load(hdr_ptr + s.to(tl.int64) * hdr_block + hdr_off, mask=rmask, other=0,
                          cache_modifier=".cg")  # fmt: skip
            m = rmask[:, None] & (ks < K)[None, :]
            ptrs = ids_ptr + rows.to(tl.int64)[:, None] * stride_ids_row + ks[None, :]
            v = tl.load(ptrs, mask=m, other=0, cache_modifier=".cg")
            drop = (j >= cnt)[:, None] | (v < lo) | (v >= hi)
            tl.store(ptrs, tl.where(drop, invalid, v), mask=m)
    if pid == 0:
        r = tl.arange(0, EP_P2)
        c = tl.load(hdr_ptr + r.to(tl.int64) * hdr_block + hdr_off, mask=r < EP, other=0,
                    cache_modifier=".cg")  # fmt: skip
        tl.store(recv_counts_ptr + r, c, mask=r < EP)

"""Triton kernels for expert-parallel all-to-all (dispatch / combine).

Only ``@triton.jit`` code lives here; the launch logic is in ``replaymoe.ep``.

Every kernel takes up to eight destination (or source) base pointers ``p0 .. p7`` and a
compile-time ``EP``; the loop over ranks is unrolled with ``tl.static_range`` and the pointer
for rank ``r`` is chosen at compile time, so that each base keeps the 16-byte alignment that
Triton infers for tensor arguments and the row copies compile to 128-bit loads and stores.
With the ``symm`` transport the pointers are peers' symmetric-memory buffers (the stores cross
NVLink); with the ``nccl`` transport they are all the same local send buffer.

Units: a payload row is copied in "units" (int32 when its byte width allows, else int16 or
uint8); every offset and stride passed here is in those units.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pick(r: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """Base pointer of rank ``r`` (compile-time choice among the eight arguments)."""
    p = p0
    if r == 1:
        p = p1
    if r == 2:
        p = p2
    if r == 3:
        p = p3
    if r == 4:
        p = p4
    if r == 5:
        p = p5
    if r == 6:
        p = p6
    if r == 7:
        p = p7
    return p


@triton.jit
def ep_dispatch_copy_kernel(
    src_ptr,  # payload as units [T, n_cols], row stride src_row_stride
    slot_ptr,  # int32 [T, EP]: slot of token t in rank r's block, -1 = not sent there
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # destination base per rank (units)
    src_row_stride,
    n_cols,
    dst_rank_stride,  # units added per destination rank index (nccl: one block; symm: 0)
    dst_offset,  # units added to every destination (block of this source + header + column offset)
    dst_row_stride,  # units per received row
    EP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Copy token ``t``'s payload row to every rank that receives it, at its slot there."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < n_cols
    vals = tl.load(src_ptr + t * src_row_stride + cols, mask=cmask)
    for r in tl.static_range(EP):
        base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
        slot = tl.load(slot_ptr + t * EP + r).to(tl.int64)
        # (t * 0 + r) is an int64 rank index, so that the product cannot overflow int32
        off = (t * 0 + r) * dst_rank_stride + dst_offset + slot * dst_row_stride
        tl.store(base + off + cols, vals, mask=cmask & (slot >= 0))


@triton.jit
def ep_put_counts_kernel(
    counts_ptr,  # int32 [EP]: rows this rank sends to each rank
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # int32 views of each rank's receive buffer
    dst_offset,  # int32 units: where this source's count lives in a receive buffer
    EP: tl.constexpr,
):
    """Write ``counts[r]`` into rank ``r``'s receive buffer (the header row of this source's block)."""
    for r in tl.static_range(EP):
        base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
        c = tl.load(counts_ptr + r)
        tl.store(base + dst_offset, c)


@triton.jit
def ep_combine_send_kernel(
    src_ptr,  # combine payload as units [EP, rows, n_cols] with strides (src_block_stride, src_row_stride)
    counts_ptr,  # int32 [EP]: rows received from each source in the dispatch (only these go back)
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # each source rank's combine receive buffer (units)
    rows,  # runtime_max_tokens_per_rank
    n_cols,
    src_block_stride,
    src_row_stride,
    dst_offset,  # units: this rank's block in every source's combine receive buffer
    dst_row_stride,
    EP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Send row ``[s, j]`` (``j < counts[s]``) back to source rank ``s`` at ``[this rank, j]``."""
    pid = tl.program_id(0)
    s = pid // rows
    j = (pid % rows).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = j < tl.load(counts_ptr + s)
    cmask = (cols < n_cols) & live
    vals = tl.load(src_ptr + s.to(tl.int64) * src_block_stride + j * src_row_stride + cols, mask=cmask)
    for r in tl.static_range(EP):
        base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
        tl.store(base + dst_offset + j * dst_row_stride + cols, vals, mask=cmask & (s == r))


@triton.jit
def ep_combine_reduce_kernel(
    recv_ptr,  # returned rows [EP, rows, H] (payload dtype), strides (recv_block_stride, recv_row_stride)
    slot_ptr,  # int32 [T, EP]: slot of token t on rank r, -1 = not sent there
    out_ptr,  # [T, H] contiguous, payload dtype
    H,
    recv_block_stride,
    recv_row_stride,
    EP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = sum over ranks r that received t of recv[r, slot[t, r]], accumulated in fp32 in rank order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(EP):
        slot = tl.load(slot_ptr + t * EP + r).to(tl.int64)
        v = tl.load(
            recv_ptr + r * recv_block_stride + slot * recv_row_stride + cols,
            mask=cmask & (slot >= 0),
            other=0.0,
        )
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def ep_plan_kernel(
    ids_ptr,  # int32 [T, K] contiguous: global expert ids (outside [0, E) = not sent)
    slot_ptr,  # int32 [T, EP] out: slot of token t in rank r's block, -1 = not sent there
    counts_ptr,  # int32 [EP] out: tokens sent to each rank
    T,
    E,
    base,  # E // EP
    rem,  # E % EP (ranks below own base + 1 experts)
    K: tl.constexpr,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: owner rank of every id, one mark per distinct (token, rank), slots by a running
    prefix sum over tokens (token order), and the per-rank totals."""
    ranks = tl.arange(0, EP_P2)
    carry = tl.zeros([EP_P2], dtype=tl.int32)
    cut = rem * (base + 1)
    for start in range(0, T, BLOCK_T):
        toks = start + tl.arange(0, BLOCK_T)
        tmask = toks < T
        m = tl.zeros([BLOCK_T, EP_P2], dtype=tl.int32)
        for k in tl.static_range(K):
            e = tl.load(ids_ptr + toks.to(tl.int64) * K + k, mask=tmask, other=-1)
            owner = tl.where(e < cut, e // (base + 1), rem + (e - cut) // base)
            owner = tl.where((e >= 0) & (e < E), owner, -1)
            m = m | (owner[:, None] == ranks[None, :]).to(tl.int32)
        cs = tl.cumsum(m, axis=0) + carry[None, :]
        slot = tl.where(m > 0, cs - 1, -1)
        smask = tmask[:, None] & (ranks[None, :] < EP)
        tl.store(slot_ptr + toks.to(tl.int64)[:, None] * EP + ranks[None, :], slot, mask=smask)
        carry += tl.sum(m, axis=0)
    tl.store(counts_ptr + ranks, carry, mask=ranks < EP)


@triton.jit
def ep_sanitize_kernel(
    ids_ptr,  # int32 received ids, rows [n_rows, K] with row stride row_stride (a run over all blocks)
    hdr_ptr,  # int32 view of the receive buffer: count of source s at s * hdr_block + hdr_off
    recv_counts_ptr,  # int32 [EP] out (written by program 0)
    n_rows,
    row_stride,
    rows_per_block,  # runtime_max + 1 (row rt of a block is its header)
    hdr_block,
    hdr_off,
    lo,
    hi,
    invalid,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Ids of padding rows (slot >= count of its source, header rows included) and of experts outside
    [lo, hi) become ``invalid``; program 0 also copies the counts to ``recv_counts``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    s = rows // rows_per_block
    j = rows % rows_per_block
    cnt = tl.load(hdr_ptr + s.to(tl.int64) * hdr_block + hdr_off, mask=rmask, other=0)
    ks = tl.arange(0, K_P2)
    m = rmask[:, None] & (ks < K)[None, :]
    ptrs = ids_ptr + rows.to(tl.int64)[:, None] * row_stride + ks[None, :]
    v = tl.load(ptrs, mask=m, other=0)
    drop = (j >= cnt)[:, None] | (v < lo) | (v >= hi)
    tl.store(ptrs, tl.where(drop, invalid, v), mask=m)
    if pid == 0:
        r = tl.arange(0, EP_P2)
        c = tl.load(hdr_ptr + r.to(tl.int64) * hdr_block + hdr_off, mask=r < EP, other=0)
        tl.store(recv_counts_ptr + r, c, mask=r < EP)

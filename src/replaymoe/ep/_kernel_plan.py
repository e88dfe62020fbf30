"""Triton kernels of the dispatch plan: per token and destination rank, the token's slot in that rank's
block, and the per-rank totals (``ep_plan_kernel``; the same look-back inside the pack kernel,
:func:`plan_lookback`). Only ``@triton.jit`` code lives here; the launch logic is in ``replaymoe.ep``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_sync import pick, spin_gpu


@triton.jit
def marks(ids_ptr, toks, tmask, ranks, E, base, rem, K: tl.constexpr, BT: tl.constexpr, EP_P2: tl.constexpr):
    """[BT, EP_P2] int32: 1 where token ``toks[i]`` has an expert on rank ``ranks[j]`` (contiguous split)."""
    cut = rem * (base + 1)
    m = tl.zeros([BT, EP_P2], dtype=tl.int32)
    for k in tl.static_range(K):
        e = tl.load(ids_ptr + toks * K + k, mask=tmask, other=-1)
        owner = tl.where(e < cut, e // (base + 1), rem + (e - cut) // base)
        owner = tl.where((e >= 0) & (e < E), owner, -1)
        m = m | (owner[:, None] == ranks[None, :]).to(tl.int32)
    return m


@triton.jit
def ep_plan_kernel(
    ids_ptr,  # int32 [T, K] contiguous: global expert ids (outside [0, E) = not sent)
    slot_ptr,  # int32 [T, EP] out: slot of token t in rank r's block, -1 = not sent there
    counts_ptr,  # int32 [EP] out: tokens sent to each rank
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,  # int32 views where count r also goes: h_r + r * stride_hdr_rank + hdr_offset (if PUT)
    stride_hdr_rank,
    hdr_offset,
    T,
    E,
    base,  # E // EP
    rem,  # E % EP (ranks below own base + 1 experts)
    scratch_ptr,  # int32 [PLAN_SCRATCH]: ticket, arrivals, epoch, block flags [NBLK], block counts [NBLK, 8]
    K: tl.constexpr,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    NBLK: tl.constexpr,  # most programs (a power of 2; the grid is cdiv(T, BLOCK_T), at least 1)
    PUT: tl.constexpr,
):
    """Owner rank of every id, one mark per distinct (token, rank), slots by a prefix sum over tokens
    (token order), and the per-rank totals (also stored into each rank's header when ``PUT``: the
    nccl send buffer's blocks, or the peers' symm receive buffers).

    One block of ``BLOCK_T`` tokens per program, the prefix across blocks by look-back: a program takes
    its block index from a ticket (so every lower block's program has started: its waits cannot starve
    one that is not resident), publishes its block's per-rank counts with a flag (this call's epoch,
    release), waits for the flags of all lower blocks (acquire) and sums their counts. The last program
    to finish resets the ticket and the arrivals and stores the epoch, so graph replays and eager calls
    stay in step without a reset launch; flags only grow."""
    ticket_ptr = scratch_ptr
    arrive_ptr = scratch_ptr + 1
    epoch_ptr = scratch_ptr + 2
    nprog = tl.num_programs(0)
    e = tl.load(epoch_ptr) + 1
    blk = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    _plan_block(blk, nprog, e, ids_ptr, slot_ptr, counts_ptr, h0, h1, h2, h3, h4, h5, h6, h7, stride_hdr_rank,
                hdr_offset, T, E, base, rem, scratch_ptr, K, EP, EP_P2, BLOCK_T, NBLK, PUT)  # fmt: skip
    tl.debug_barrier()
    old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if old == nprog - 1:
        tl.store(ticket_ptr, 0)
        tl.store(arrive_ptr, 0)
        tl.store(epoch_ptr, e)


@triton.jit
def _plan_block(blk, nblk, e, ids_ptr, slot_ptr, counts_ptr, h0, h1, h2, h3, h4, h5, h6, h7, stride_hdr_rank,
                hdr_offset, T, E, base, rem, scratch_ptr, K: tl.constexpr, EP: tl.constexpr,
                EP_P2: tl.constexpr, BLOCK_T: tl.constexpr, NBLK: tl.constexpr,
                PUT: tl.constexpr):  # fmt: skip
    """Block ``blk`` of ``nblk`` of the plan (:func:`ep_plan_kernel`'s docstring), in call epoch ``e``:
    publish its counts and flag, wait for the lower blocks', store its slots; the last block also the
    totals."""
    flag_ptr = scratch_ptr + 3
    agg_ptr = scratch_ptr + 3 + NBLK
    ranks = tl.arange(0, EP_P2)
    toks = (blk * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = toks < T
    m = marks(ids_ptr, toks, tmask, ranks, E, base, rem, K, BLOCK_T, EP_P2)
    cnt = tl.sum(m, axis=0)
    tl.store(agg_ptr + blk * 8 + ranks, cnt, mask=ranks < EP)
    tl.debug_barrier()  # every thread's counts before the flag
    tl.atomic_xchg(flag_ptr + blk, e, sem="release", scope="gpu")
    # the lower blocks' counts
    js = tl.arange(0, NBLK)
    lower = js < blk
    waiting = blk > 0
    while waiting:  # (a scalar carried through the loop: a tensor one breaks Triton's layout pass)
        f = tl.atomic_add(flag_ptr + js, 0, mask=lower, sem="acquire", scope="gpu")
        waiting = tl.min(tl.where(lower, f, e)) < e
    tl.debug_barrier()
    am = lower[:, None] & (ranks < EP)[None, :]
    aggs = tl.load(agg_ptr + js[:, None] * 8 + ranks[None, :], mask=am, other=0, cache_modifier=".cg")
    prefix = tl.sum(aggs, axis=0)
    cs = tl.cumsum(m, axis=0) + prefix[None, :]
    slot = tl.where(m > 0, cs - 1, -1)
    smask = tmask[:, None] & (ranks[None, :] < EP)
    tl.store(slot_ptr + toks[:, None] * EP + ranks[None, :], slot, mask=smask)
    if blk == nblk - 1:  # the last block: the totals
        tot = prefix + cnt
        tl.store(counts_ptr + ranks, tot, mask=ranks < EP)
        if PUT:
            for r in tl.static_range(EP):
                dst = pick(r, h0, h1, h2, h3, h4, h5, h6, h7)
                c = tl.sum(tl.where(ranks == r, tot, 0))
                tl.store(dst + r * stride_hdr_rank + hdr_offset, c)


@triton.jit
def plan_lookback(ids_ptr, slot_ptr, counts_ptr, h0, h1, h2, h3, h4, h5, h6, h7, stride_hdr_rank, hdr_offset,
                  T, E, base, rem, scratch_ptr, K: tl.constexpr, EP: tl.constexpr, EP_P2: tl.constexpr,
                  BLOCK_T: tl.constexpr, NBLK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The plan inside another kernel (the pack's ``LOOKBACK``), on any grid: every program takes block
    tickets until they run out, computing each block as :func:`ep_plan_kernel` does, then waits until
    every block's slots are stored (a count in the scratch); the last program past the wait resets the
    ticket, the count and the arrivals and stores the epoch. A program waits only on blocks whose
    tickets were taken, so by programs already running: no grid needs to be resident at once (and the
    interpreter, which runs programs one after another, runs it too). ``ASM`` (CUDA): the waiting
    programs poll with plain acquire loads, not atomics (thousands of them on a dense grid)."""
    ticket_ptr = scratch_ptr
    arrive_ptr = scratch_ptr + 1
    epoch_ptr = scratch_ptr + 2
    stored_ptr = scratch_ptr + 3 + 9 * NBLK
    total = tl.num_programs(0) * tl.num_programs(1)
    e = tl.load(epoch_ptr) + 1
    nblk = tl.maximum(tl.cdiv(T, BLOCK_T), 1)
    blk = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    while blk < nblk:
        _plan_block(blk, nblk, e, ids_ptr, slot_ptr, counts_ptr, h0, h1, h2, h3, h4, h5, h6, h7,
                    stride_hdr_rank, hdr_offset, T, E, base, rem, scratch_ptr, K, EP, EP_P2, BLOCK_T, NBLK,
                    True)  # fmt: skip
        tl.debug_barrier()  # every thread's slots before the count
        tl.atomic_add(stored_ptr, 1, sem="release", scope="gpu")
        blk = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    spin_gpu(stored_ptr, nblk, ASM)
    tl.debug_barrier()
    old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if old == total - 1:  # every program is past the wait and took its last ticket
        tl.store(ticket_ptr, 0)
        tl.store(stored_ptr, 0)
        tl.store(arrive_ptr, 0)
        tl.store(epoch_ptr, e)

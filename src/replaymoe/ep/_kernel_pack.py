"""Triton kernel of the dispatch's copy: ``ep_pack_kernel`` stores every token row into each destination
rank's block (with the plan, the barrier's signal and the receive side's sanitize fused in where the
call allows). Only ``@triton.jit`` code lives here; the launch logic is in ``replaymoe.ep``.

Units: a payload row is copied in "units" (int32 when its byte width allows, else int16 or
uint8); every offset and stride passed here is in those units.

Grids: the copy loops over its rows with a grid stride, so any grid is valid. With ``num_sms`` set
the first grid axis has at most that many programs (the SMs the all-to-all may occupy) and each
iteration moves several rows; without it the grids are dense (one short program per row chunk, up to
16 per SM). All loads of an iteration are issued before its stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_plan import marks, plan_lookback
from ._kernel_sanitize import sanitize_rows
from ._kernel_sync import pick, signal_done, spin_gpu, wait_peers


@triton.jit
def _put_counts(tot, ranks, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7, stride_dst_rank, dst_base, hdr_off,
                EP: tl.constexpr):  # fmt: skip
    """Per-rank totals into ``counts_ptr`` and into each destination's header (int32 units)."""
    tl.store(counts_ptr + ranks, tot, mask=ranks < EP)
    for r in tl.static_range(EP):
        dst = pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
        c = tl.sum(tl.where(ranks == r, tot, 0))
        tl.store(dst + stride_dst_rank.to(tl.int64) * r + dst_base + hdr_off, c)


@triton.jit
def _load_rows(src, toks, tmask, chunk, N: tl.constexpr, NB: tl.constexpr):
    """Tile [TT, NB] of rows ``toks`` of a contiguous [T, N] payload, column chunk ``chunk``."""
    cols = chunk * NB + tl.arange(0, NB)
    m = tmask[:, None] & (cols < N)[None, :]
    return tl.load(src + toks[:, None] * N + cols[None, :], mask=m)


@triton.jit
def _store_rows(vals, toks, tmask, chunk, slots, ranks, p0, p1, p2, p3, p4, p5, p6, p7,
                stride_dst_rank, dst_base, RB: tl.constexpr, N: tl.constexpr, NB: tl.constexpr,
                OFF: tl.constexpr, EP: tl.constexpr, FIRST: tl.constexpr = 0):  # fmt: skip
    """Store the tile at ``dst_base + r * stride_dst_rank + slot * RB + OFF`` of every rank r with
    slot >= 0 (``slots``: [TT, EP_P2] tile of the plan), ranks in the order ``FIRST, ..., EP - 1, 0, ...,
    FIRST - 1``."""
    cols = chunk * NB + tl.arange(0, NB)
    m = tmask[:, None] & (cols < N)[None, :]
    for r in tl.static_range(FIRST, EP):
        _store_rank(vals, toks, cols, m, slots, ranks, r, pick(r, p0, p1, p2, p3, p4, p5, p6, p7),
                    stride_dst_rank, dst_base, RB, OFF)  # fmt: skip
    for q in tl.static_range(0, FIRST):
        _store_rank(vals, toks, cols, m, slots, ranks, q, pick(q, p0, p1, p2, p3, p4, p5, p6, p7),
                    stride_dst_rank, dst_base, RB, OFF)  # fmt: skip


@triton.jit
def _store_rank(vals, toks, cols, m, slots, ranks, r: tl.constexpr, base, stride_dst_rank, dst_base,
                RB: tl.constexpr, OFF: tl.constexpr):  # fmt: skip
    """:func:`_store_rows`' stores to rank ``r`` (its buffer at ``base``)."""
    slot = tl.sum(tl.where(ranks[None, :] == r, slots, 0), axis=1).to(tl.int64)
    # (r + toks * 0) is an int64 rank index, so the product cannot overflow int32
    off = (toks * 0 + r) * stride_dst_rank + dst_base + slot * RB + OFF
    tl.store(base + off[:, None] + cols[None, :], vals, mask=m & (slot >= 0)[:, None])


@triton.jit
def ep_pack_kernel(
    slot_ptr,  # int32 [T, EP]: slot of token t in rank r's block, -1 = not sent there
    s0,
    s1,
    s2,
    s3,  # up to four payloads, as units [T, N_i] contiguous (unused ones: any pointer)
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # destination base per rank (units)
    T,
    stride_dst_rank,  # units added per destination rank index (nccl: one block; symm: 0)
    dst_base,  # units added to every destination (symm: this source's block)
    arrive_ptr,  # int32: programs finished (SIGNAL)
    epoch_ptr,  # int32: this rank's dispatch epoch (SIGNAL)
    q0,
    q1,
    q2,
    q3,
    q4,
    q5,
    q6,
    q7,  # int32 signal pad of each rank (SIGNAL)
    pad_off,  # this rank's dispatch flag in a pad
    ids_ptr,  # int32 [T, K] global expert ids (FUSED_PLAN)
    counts_ptr,  # int32 [EP] out: tokens sent to each rank (FUSED_PLAN)
    E,
    base,  # E // EP
    rem,  # E % EP
    hdr_off,  # units: the count's place in a destination block (FUSED_PLAN; int32 units)
    RB: tl.constexpr,  # units per received row
    N0: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N3: tl.constexpr,  # units per token of each payload
    NB0: tl.constexpr,
    NB1: tl.constexpr,
    NB2: tl.constexpr,
    NB3: tl.constexpr,  # column chunk of each payload (power of 2)
    O0: tl.constexpr,
    O1: tl.constexpr,
    O2: tl.constexpr,
    O3: tl.constexpr,  # unit offset of each payload's region in a row
    NP: tl.constexpr,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    TT: tl.constexpr,  # tokens per iteration
    RANK: tl.constexpr,
    SIGNAL: tl.constexpr,  # symm: the last program signals the peers (see signal_done)
    FUSED_PLAN: tl.constexpr,  # compute the plan here (small T): slots from a scan of the earlier ids
    K: tl.constexpr,
    BT: tl.constexpr,  # tokens per scan block (FUSED_PLAN)
    # SANITIZE (with SIGNAL): the last programs to arrive wait for the peers and do ep_sanitize_kernel's
    # work (no sanitize launch); its arguments, as that kernel's (the epoch is epoch_ptr)
    z_ids,
    z_hdr,
    z_recv_counts,
    z_n_rows,
    z_stride_ids_row,
    z_rows_per_block,
    z_hdr_block,
    z_hdr_off,
    z_lo,
    z_hi,
    z_invalid,
    z_pad,
    z_pad_base,
    z_timeout_ns,
    Z_K_P2: tl.constexpr,
    Z_BLOCK: tl.constexpr,
    Z_HAS_IDS: tl.constexpr,
    SANITIZE: tl.constexpr,
    TIMER: tl.constexpr,
    Z_SANITIZERS: tl.constexpr,  # up to this many of the last programs to arrive sanitize (interpreter: 1)
    # LOOKBACK (int32 units, not FUSED_PLAN): the plan computed here first (plan_lookback; no plan launch)
    pl_scratch,  # int32 [PLAN_SCRATCH], the plan kernel's
    PL_BLOCK_T: tl.constexpr,
    PL_NBLK: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PL_ASM: tl.constexpr,  # CUDA: poll with acquire loads (see plan_lookback)
    PREFETCH: tl.constexpr = False,  # the next iteration's rows load before these stores (not FUSED_PLAN)
    FIRST: tl.constexpr = 0,  # each tile's stores go to ranks FIRST, FIRST + 1, ... (mod EP)
):
    """Persistent dispatch copy: program (i, c) walks tokens ``i*TT, (i + nprog)*TT, ...`` and copies
    column chunk ``c`` of every payload's row to each rank that receives the token (all ranks'
    stores issued from the same program: with ``symm`` every peer is written concurrently). Each
    iteration loads the plan and every payload's tile first and stores after, so one memory latency
    is paid per iteration. ``PREFETCH`` (persistent grids): the rows of a program's next iteration are
    loaded before this iteration's stores are issued, so that their latency passes while the stores
    drain. The grid's first axis bounds the number of SMs used (``num_sms``)."""
    tl.static_assert(not (PREFETCH and FUSED_PLAN))
    if SIGNAL:
        if SANITIZE:  # this launch's epoch is e0 + 1 (only its last arrival stores it)
            e0 = tl.load(epoch_ptr)
    if LOOKBACK:
        plan_lookback(ids_ptr, slot_ptr, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7, stride_dst_rank,
                      dst_base + hdr_off, T, E, base, rem, pl_scratch, K, EP, EP_P2, PL_BLOCK_T,
                      PL_NBLK, PL_ASM)  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    chunk = tl.program_id(1)
    ranks = tl.arange(0, EP_P2)
    if PREFETCH:  # the first iteration's rows
        tn = (pid * TT + tl.arange(0, TT)).to(tl.int64)
        n0 = _load_rows(s0, tn, tn < T, chunk, N0, NB0)
        if NP > 1:
            n1 = _load_rows(s1, tn, tn < T, chunk, N1, NB1)
        if NP > 2:
            n2 = _load_rows(s2, tn, tn < T, chunk, N2, NB2)
        if NP > 3:
            n3 = _load_rows(s3, tn, tn < T, chunk, N3, NB3)
    for t0 in range(pid * TT, T, nprog * TT):
        toks = (t0 + tl.arange(0, TT)).to(tl.int64)
        tmask = toks < T
        sm = tmask[:, None] & (ranks < EP)[None, :]
        if FUSED_PLAN:
            # slot of (token, rank) = tokens before it sent to that rank (+ its own mark)
            acc = tl.zeros([EP_P2], dtype=tl.int32)
            for b0 in range(0, t0, BT):
                bt = (b0 + tl.arange(0, BT)).to(tl.int64)
                acc += tl.sum(marks(ids_ptr, bt, bt < t0, ranks, E, base, rem, K, BT, EP_P2), axis=0)
            mt = marks(ids_ptr, toks, tmask, ranks, E, base, rem, K, TT, EP_P2)
            # inclusive prefix over the tile's tokens (a triangular sum: tl.cumsum fails on 1-row tiles)
            ii = tl.arange(0, TT)
            tri = (ii[None, :] <= ii[:, None]).to(tl.int32)
            incl = tl.sum(tri[:, :, None] * mt[None, :, :], axis=1)
            slots = tl.where(mt > 0, acc[None, :] + incl - 1, -1)
            tl.store(slot_ptr + toks[:, None] * EP + ranks[None, :], slots, mask=sm)
            if (t0 + TT >= T) & (chunk == 0):  # the tile with the last token: totals, headers
                tot = acc + tl.sum(mt, axis=0)
                _put_counts(tot, ranks, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7,
                            stride_dst_rank, dst_base, hdr_off, EP)  # fmt: skip
        elif LOOKBACK:  # (L2: other programs of this launch stored them)
            sp = slot_ptr + toks[:, None] * EP + ranks[None, :]
            slots = tl.load(sp, mask=sm, other=-1, cache_modifier=".cg")
        else:
            slots = tl.load(slot_ptr + toks[:, None] * EP + ranks[None, :], mask=sm, other=-1)
        if PREFETCH:  # this iteration's rows were loaded by the last; load the next iteration's
            tn = toks + nprog * TT
            v0 = n0
            n0 = _load_rows(s0, tn, tn < T, chunk, N0, NB0)
            if NP > 1:
                v1 = n1
                n1 = _load_rows(s1, tn, tn < T, chunk, N1, NB1)
            if NP > 2:
                v2 = n2
                n2 = _load_rows(s2, tn, tn < T, chunk, N2, NB2)
            if NP > 3:
                v3 = n3
                n3 = _load_rows(s3, tn, tn < T, chunk, N3, NB3)
        else:
            v0 = _load_rows(s0, toks, tmask, chunk, N0, NB0)
            if NP > 1:
                v1 = _load_rows(s1, toks, tmask, chunk, N1, NB1)
            if NP > 2:
                v2 = _load_rows(s2, toks, tmask, chunk, N2, NB2)
            if NP > 3:
                v3 = _load_rows(s3, toks, tmask, chunk, N3, NB3)
        _store_rows(v0, toks, tmask, chunk, slots, ranks, p0, p1, p2, p3, p4, p5, p6, p7,
                    stride_dst_rank, dst_base, RB, N0, NB0, O0, EP, FIRST)  # fmt: skip
        if NP > 1:
            _store_rows(v1, toks, tmask, chunk, slots, ranks, p0, p1, p2, p3, p4, p5, p6, p7,
                        stride_dst_rank, dst_base, RB, N1, NB1, O1, EP, FIRST)  # fmt: skip
        if NP > 2:
            _store_rows(v2, toks, tmask, chunk, slots, ranks, p0, p1, p2, p3, p4, p5, p6, p7,
                        stride_dst_rank, dst_base, RB, N2, NB2, O2, EP, FIRST)  # fmt: skip
        if NP > 3:
            _store_rows(v3, toks, tmask, chunk, slots, ranks, p0, p1, p2, p3, p4, p5, p6, p7,
                        stride_dst_rank, dst_base, RB, N3, NB3, O3, EP, FIRST)  # fmt: skip
    if FUSED_PLAN:
        if (T == 0) & (pid == 0) & (chunk == 0):  # no tokens: zero counts everywhere
            _put_counts(tl.zeros([EP_P2], dtype=tl.int32), ranks, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7,
                        stride_dst_rank, dst_base, hdr_off, EP)  # fmt: skip
    if SIGNAL:
        old = signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off, EP, RANK)
        if SANITIZE:
            # the last nz programs to arrive share the receive side's work. Each has arrived, so it runs;
            # one that is not the last waits for the last's epoch store (every program's rows are stored,
            # this rank's own block included), then all wait for the peers. Programs that have not
            # arrived are never waited on, so no grid needs to be resident at once.
            total = tl.num_programs(0) * tl.num_programs(1)
            nz = tl.minimum(tl.minimum(total, Z_SANITIZERS), tl.maximum(tl.cdiv(z_n_rows, Z_BLOCK), 1))
            i = old - (total - nz)
            if i >= 0:
                if i < nz - 1:
                    spin_gpu(epoch_ptr, e0 + 1, PL_ASM)  # this rank's epoch, bumped by the last
                wait_peers(e0 + 1, z_pad, z_pad_base, z_timeout_ns, EP, RANK, TIMER)
                sanitize_rows(z_ids, z_hdr, z_recv_counts, z_n_rows, z_stride_ids_row, z_rows_per_block,
                              z_hdr_block, z_hdr_off, z_lo, z_hi, z_invalid, i, nz, K, Z_K_P2, EP, EP_P2,
                              Z_BLOCK, Z_HAS_IDS)  # fmt: skip

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

Grids: the copy kernels loop over their rows with a grid stride, so any grid is valid. With
``num_sms`` set the first grid axis has at most that many programs (the SMs the all-to-all may
occupy) and each iteration moves several rows; without it the grids are dense (one short program per
row chunk, up to 16 per SM). All loads of an iteration are issued before its stores.

Size: over 600 lines because these are all of the all-to-all's kernels (plan, pack, sanitize,
combine, the pipelined combine, barrier), kept in one module beside their op.
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


# ----------------------------------------------------------------------------------------------
# In-kernel barrier of the symm transport (no extra launch): the producing kernel's last program
# to finish publishes a new epoch into every peer's signal pad (release, system scope, after a
# CTA barrier and an acq_rel arrival so that every program's stores are covered); every program
# of the consuming kernel first waits until each peer's flag in its own pad reaches its epoch
# (acquire, system scope). Epochs count up in device memory, so CUDA-graph replays stay in step.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _globaltimer(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trap(x):
    return tl.inline_asm_elementwise(
        "trap; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off,
                 EP: tl.constexpr, RANK: tl.constexpr):  # fmt: skip
    """Called by every program after its stores; the last to arrive bumps this rank's epoch (a
    release store: a program that sees it sees every program's stores) and stores it into slot
    ``pad_off`` of every peer's signal pad. Returns this program's arrival index (the last:
    ``num_programs - 1``)."""
    total = tl.num_programs(0) * tl.num_programs(1)
    tl.debug_barrier()
    old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="sys")
    if old == total - 1:
        tl.store(arrive_ptr, 0)
        e = tl.load(epoch_ptr) + 1
        tl.atomic_xchg(epoch_ptr, e, sem="release", scope="gpu")
        for r in tl.static_range(EP):
            if r != RANK:
                base = _pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                tl.atomic_xchg(base + pad_off, e, sem="release", scope="sys")
    return old


@triton.jit
def _wait_peers(e, pad_ptr, pad_base, timeout_ns, EP: tl.constexpr, RANK: tl.constexpr,
                TIMER: tl.constexpr):  # fmt: skip
    """Wait until every peer's flag ``pad_ptr[pad_base + r]`` reaches ``e``, this rank's epoch of the
    phase (the caller reads it: a kernel after the producing one loads it; a program of the producing
    launch knows it, as its L1 may hold the value from before the bump). With ``TIMER``, print and trap
    after ``timeout_ns``."""
    for r in tl.static_range(EP):
        if r != RANK:
            v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")
            if TIMER:
                t0 = _globaltimer(v)
                while v < e:
                    v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")
                    if _globaltimer(v) - t0 > timeout_ns:
                        tl.device_print("replaymoe MoeAlltoAll(symm): barrier timeout, rank/peer", RANK, r)
                        v = _trap(v) + e
            else:
                while v < e:
                    v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")


@triton.jit
def _marks(ids_ptr, toks, tmask, ranks, E, base, rem, K: tl.constexpr, BT: tl.constexpr, EP_P2: tl.constexpr):
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
def _put_counts(tot, ranks, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7, stride_dst_rank, dst_base, hdr_off,
                EP: tl.constexpr):  # fmt: skip
    """Per-rank totals into ``counts_ptr`` and into each destination's header (int32 units)."""
    tl.store(counts_ptr + ranks, tot, mask=ranks < EP)
    for r in tl.static_range(EP):
        dst = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
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
        _store_rank(vals, toks, cols, m, slots, ranks, r, _pick(r, p0, p1, p2, p3, p4, p5, p6, p7),
                    stride_dst_rank, dst_base, RB, OFF)  # fmt: skip
    for q in tl.static_range(0, FIRST):
        _store_rank(vals, toks, cols, m, slots, ranks, q, _pick(q, p0, p1, p2, p3, p4, p5, p6, p7),
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
    SIGNAL: tl.constexpr,  # symm: the last program signals the peers (see _signal_done)
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
    # LOOKBACK (int32 units, not FUSED_PLAN): the plan computed here first (_plan_lookback; no plan launch)
    pl_scratch,  # int32 [PLAN_SCRATCH], the plan kernel's
    PL_BLOCK_T: tl.constexpr,
    PL_NBLK: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PL_ASM: tl.constexpr,  # CUDA: poll with acquire loads (see _plan_lookback)
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
        _plan_lookback(ids_ptr, slot_ptr, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7, stride_dst_rank,
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
                acc += tl.sum(_marks(ids_ptr, bt, bt < t0, ranks, E, base, rem, K, BT, EP_P2), axis=0)
            mt = _marks(ids_ptr, toks, tmask, ranks, E, base, rem, K, TT, EP_P2)
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
        old = _signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off, EP, RANK)
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
                    _spin_gpu(epoch_ptr, e0 + 1, PL_ASM)  # this rank's epoch, bumped by the last
                _wait_peers(e0 + 1, z_pad, z_pad_base, z_timeout_ns, EP, RANK, TIMER)
                _sanitize_rows(z_ids, z_hdr, z_recv_counts, z_n_rows, z_stride_ids_row, z_rows_per_block,
                               z_hdr_block, z_hdr_off, z_lo, z_hi, z_invalid, i, nz, K, Z_K_P2, EP, EP_P2,
                               Z_BLOCK, Z_HAS_IDS)  # fmt: skip


@triton.jit
def ep_combine_send_kernel(
    src_ptr,  # combine payload [EP, rows, n_cols] with strides (stride_src_block, stride_src_row)
    counts_ptr,  # int32 [EP]: rows received from each source in the dispatch (only these go back)
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # each source rank's combine receive buffer
    rows,  # runtime_max_tokens_per_rank
    n_cols,
    stride_src_block,
    stride_src_row,
    dst_offset,  # elements: this rank's block in every source's combine receive buffer
    stride_dst_row,
    arrive_ptr,  # int32: programs finished (SIGNAL)
    epoch_ptr,  # int32: this rank's combine epoch (SIGNAL)
    q0,
    q1,
    q2,
    q3,
    q4,
    q5,
    q6,
    q7,  # int32 signal pad of each rank (SIGNAL)
    pad_off,  # this rank's combine flag in a pad
    EP: tl.constexpr,
    SKIP: tl.constexpr,  # a source rank whose rows are not sent (this rank: it reads them in place), -1: none
    NB: tl.constexpr,  # column chunk (power of 2); program_id(1) is the chunk
    TT: tl.constexpr,  # rows per iteration
    SIGNAL: tl.constexpr,  # the last program signals the peers (see _signal_done); SKIP is this rank
):
    """Send row ``[s, j]`` (``j < counts[s]``) back to source rank ``s`` at ``[this rank, j]``.
    Persistent over work items of TT rows of one source (the grid's first axis bounds the SMs used),
    the sources interleaved: item ``k`` is row tile ``k // P`` of the ``k % P``-th source other than
    ``SKIP`` (``P`` of them), so the programs of one wave write to every peer at once instead of all
    to the same one (with every rank walking its sources in the same order, that made up to three
    ranks write into one GPU while others received nothing; docs/DESIGN.md, "Expert parallelism").
    Rows past a source's count are neither read nor sent."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1) * NB + tl.arange(0, NB)
    cm = cols < n_cols
    P: tl.constexpr = EP - 1 if SKIP >= 0 else EP
    ntiles = (rows + TT - 1) // TT
    for k in range(pid, P * ntiles, nprog):
        q = k % P
        s = q
        if SKIP >= 0:
            s = q + (q >= SKIP).to(q.dtype)
        j = ((k // P) * TT + tl.arange(0, TT)).to(tl.int64)
        cnt = tl.load(counts_ptr + s)
        live = (j < rows) & (j < cnt)
        m = live[:, None] & cm[None, :]
        row = s.to(tl.int64) * stride_src_block + j * stride_src_row
        v = tl.load(src_ptr + row[:, None] + cols[None, :], mask=m)
        dst = dst_offset + j * stride_dst_row
        for r in tl.static_range(EP):
            if r != SKIP:
                base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
                tl.store(base + dst[:, None] + cols[None, :], v, mask=m & (s == r))
    if SIGNAL:
        _signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off, EP, SKIP)


@triton.jit
def ep_combine_reduce_kernel(
    recv_ptr,  # returned rows [EP, rows, H] (payload dtype), strides (stride_recv_block, stride_recv_row)
    slot_ptr,  # int32 [T, EP]: slot of token t on rank r, -1 = not sent there
    out_ptr,  # [T, H] contiguous, payload dtype
    own_ptr,  # rank OWN's rows [rows, H] with row stride stride_own_row (when OWN >= 0)
    T,
    H,
    stride_recv_block,
    stride_recv_row,
    stride_own_row,
    epoch_ptr,  # int32: this rank's combine epoch (WAIT)
    pad_ptr,  # int32: this rank's signal pad (WAIT)
    pad_base,
    timeout_ns,
    EP: tl.constexpr,
    OWN: tl.constexpr,  # rank whose rows are read from own_ptr instead of recv_ptr (-1: none)
    NB: tl.constexpr,  # column chunk (power of 2); program_id(1) is the chunk
    TT: tl.constexpr,  # tokens per iteration
    WAIT: tl.constexpr,  # symm: wait for every peer's combine signal first (OWN is this rank)
    TIMER: tl.constexpr,
):
    """out[t] = sum over ranks r that received t of recv[r, slot[t, r]], accumulated in fp32 in rank
    order. Persistent over tokens (the grid's first axis bounds the SMs used)."""
    if WAIT:
        _wait_peers(tl.load(epoch_ptr), pad_ptr, pad_base, timeout_ns, EP, OWN, TIMER)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1) * NB + tl.arange(0, NB)
    cm = cols < H
    for t0 in range(pid * TT, T, nprog * TT):
        toks = (t0 + tl.arange(0, TT)).to(tl.int64)
        tmask = toks < T
        acc = tl.zeros([TT, NB], dtype=tl.float32)
        for r in tl.static_range(EP):
            slot = tl.load(slot_ptr + toks * EP + r, mask=tmask, other=-1).to(tl.int64)
            m = (slot >= 0)[:, None] & cm[None, :]
            if r == OWN:
                row = slot * stride_own_row
                v = tl.load(own_ptr + row[:, None] + cols[None, :], mask=m, other=0.0)
            else:
                row = stride_recv_block.to(tl.int64) * r + slot * stride_recv_row
                v = tl.load(recv_ptr + row[:, None] + cols[None, :], mask=m, other=0.0)
            acc += v.to(tl.float32)
        om = tmask[:, None] & cm[None, :]
        tl.store(out_ptr + toks[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=om)


# ----------------------------------------------------------------------------------------------
# The pipelined combine (symm, fused barrier, num_sms >= 2): send and reduce in one launch. The
# first S programs send, the rest reduce while the rows land. A sender's work item is one chunk of
# CHUNK rows of one source (items interleaved over the sources, chunks in ascending order); after
# its stores it publishes the call's epoch into the source's pad at flag ``r * NCMAX + c`` (release,
# system scope, after a CTA barrier: the pattern of ``_signal_done``). A reducer takes token blocks
# in ascending order; the slot plan is a prefix sum over tokens, so a block's rows on rank ``r`` lie
# in one ascending slot range, and the reducer waits only for the chunks that cover it (acquire,
# system scope), remembering per rank the highest chunk it has seen complete.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ld_acquire(ptr):
    """``*ptr`` as an acquire load at system scope (no read-modify-write)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _ld_acquire_gpu(ptr):
    """``*ptr`` as an acquire load at GPU scope (no read-modify-write)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _nanosleep(ptr):
    """``ptr``, after this thread sleeps about 100 ns (a poll's back-off)."""
    return tl.inline_asm_elementwise(
        "nanosleep.u32 100; mov.b64 $0, $1;", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
    ).to(tl.pointer_type(tl.int32))


@triton.jit
def _spin_gpu(ptr, target, ASM: tl.constexpr):
    """Spin until ``*ptr >= target`` (acquire, GPU scope: other programs of the same launch store it with
    release). ``ASM`` (CUDA): acquire loads with a 100 ns back-off; else acquire atomics."""
    if ASM:
        v = _ld_acquire_gpu(ptr)
        while v < target:
            v = _ld_acquire_gpu(_nanosleep(ptr))
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while v < target:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _wait_flag(ptr, e, timeout_ns, RANK: tl.constexpr, PEER: tl.constexpr, TIMER: tl.constexpr):
    """Spin until ``*ptr >= e`` (acquire, system scope); with ``TIMER`` (CUDA) print and trap after the
    timeout. On CUDA the polls are acquire loads, in the interpreter acquire atomics."""
    if TIMER:
        v = _ld_acquire(ptr)
        t0 = _globaltimer(v)
        while v < e:
            v = _ld_acquire(ptr)
            if _globaltimer(v) - t0 > timeout_ns:
                tl.device_print("replaymoe MoeAlltoAll(symm): combine flag timeout, rank/peer", RANK, PEER)
                v = _trap(v) + e
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        while v < e:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def ep_combine_kernel(
    src_ptr,  # combine payload [EP, rows, W], strides (stride_src_block, stride_src_row, 1)
    counts_ptr,  # int32 [EP]: rows received from each source in the dispatch (only these go back)
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,  # each rank's combine receive buffer (payload dtype), block r at r * stride_recv_block
    q0,
    q1,
    q2,
    q3,
    q4,
    q5,
    q6,
    q7,  # each rank's int32 signal pad; chunk flags at flag_base + source * NCMAX + chunk
    slot_ptr,  # int32 [T, EP]: slot of token t on rank r, -1 = not sent there
    out_ptr,  # [T, W] contiguous
    own_ptr,  # this rank's rows [rows, W] (row stride stride_own_row): read in place, never sent
    rows,  # runtime_max_tokens_per_rank
    W,
    T,
    stride_src_block,
    stride_src_row,
    stride_recv_block,  # elements: one source's block in a receive buffer (rows * W)
    stride_own_row,
    flag_base,
    arrive_ptr,  # int32: programs finished (the last one stores the epoch)
    epoch_ptr,  # int32: this rank's combine epoch
    send_arrive_ptr,  # int32: sender programs finished (the last one signals every peer)
    done_base,  # int32 slot of source s's "sends done" epoch in a pad: done_base + s
    timeout_ns,
    EP: tl.constexpr,
    EP_P2: tl.constexpr,
    RANK: tl.constexpr,
    SENDERS: tl.constexpr,  # programs [0, SENDERS) send, the rest reduce
    NCMAX: tl.constexpr,  # chunk flags per source in a pad (cdiv(max_num_tokens, CHUNK))
    CHUNK: tl.constexpr,  # rows per flag (a multiple of TT)
    NB: tl.constexpr,  # columns per tile (power of 2)
    TT: tl.constexpr,  # rows (send) / tokens (reduce) per tile
    GROUP: tl.constexpr,  # tiles per reducer step: its chunk waits cover GROUP * TT tokens at once
    ROLES: tl.constexpr,  # 0: both in this launch; 1: send only; 2: reduce only (the CPU tests run the
    # ranks one after another in Triton's interpreter, all sends first)
    TIMER: tl.constexpr,
):
    """Row ``[s, j]`` (``j < counts[s]``, ``s != RANK``) goes to rank ``s``'s receive buffer at block
    ``RANK``, row ``j``; then ``out[t] = sum over ranks r that received t of row slot[t, r] of r's
    block`` (this rank's own rows from ``own_ptr``), accumulated in fp32 in rank order: the same bits as
    ``ep_combine_send_kernel`` + ``ep_combine_reduce_kernel``. The epoch of this call is the stored
    epoch + 1 (ROLES 2: the stored one); the last program to finish stores it (ROLES 0 and 1).

    The last sender to finish stores the epoch into every peer's pad at ``done_base + RANK``, and every
    reducer, once its tokens are summed, waits until each peer's flag there reaches the epoch: the
    launch ends only after every peer has sent all its rows (and so had consumed this round's dispatch,
    its received counts included), as with the two kernels, whose reduce waits on the same flags. Without
    it a rank that received nothing from a peer could run ahead into the next dispatch and overwrite
    the header row that peer had not yet read."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e = tl.load(epoch_ptr)
    if ROLES != 2:
        e = e + 1
    do_send = (pid < SENDERS) & (ROLES != 2)
    if ROLES == 1:
        do_send = pid >= 0
    if do_send:
        n_send = SENDERS
        if ROLES == 1:
            n_send = nprog
        P: tl.constexpr = EP - 1
        nch = (rows + CHUNK - 1) // CHUNK
        for k in range(pid, P * nch, n_send):
            q = k % P
            c = k // P
            s = q + (q >= RANK).to(q.dtype)
            cnt = tl.load(counts_ptr + s)
            j_hi = tl.minimum(cnt, (c + 1) * CHUNK)
            if c * CHUNK < cnt:
                for j0 in range(c * CHUNK, j_hi, TT):
                    j = (j0 + tl.arange(0, TT)).to(tl.int64)
                    jm = j < j_hi
                    src_row = s.to(tl.int64) * stride_src_block + j * stride_src_row
                    dst_row = stride_recv_block.to(tl.int64) * RANK + j * W
                    for c0 in range(0, W, NB):
                        cols = c0 + tl.arange(0, NB)
                        m = jm[:, None] & (cols < W)[None, :]
                        v = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=m)
                        for r in tl.static_range(EP):
                            if r != RANK:
                                base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
                                tl.store(base + dst_row[:, None] + cols[None, :], v, mask=m & (s == r))
                tl.debug_barrier()  # every thread's stores of the chunk before the flag
                for r in tl.static_range(EP):
                    if r != RANK:
                        fq = _pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                        tl.atomic_xchg(fq + flag_base + RANK * NCMAX + c, e, mask=s == r, sem="release",
                                       scope="sys")  # fmt: skip
        # the last sender tells every peer that this rank's sends are done (after every chunk's flag)
        tl.debug_barrier()
        done = tl.atomic_add(send_arrive_ptr, 1, sem="acq_rel", scope="gpu")
        if done == n_send - 1:
            tl.store(send_arrive_ptr, 0)
            for r in tl.static_range(EP):
                if r != RANK:
                    fq = _pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                    tl.atomic_xchg(fq + done_base + RANK, e, sem="release", scope="sys")
    else:
        rid = pid - SENDERS
        n_red = nprog - SENDERS
        if ROLES == 2:
            rid = pid
            n_red = nprog
        rk = tl.arange(0, EP_P2)
        seen = tl.full([EP_P2], -1, dtype=tl.int32)  # per rank: chunks up to here are known complete
        pad = _pick(RANK, q0, q1, q2, q3, q4, q5, q6, q7) + flag_base
        SB: tl.constexpr = GROUP * TT
        for t0 in range(rid * SB, T, n_red * SB):
            toks = (t0 + tl.arange(0, SB)).to(tl.int64)
            tmask = toks < T
            sm = tmask[:, None] & (rk < EP)[None, :]
            sl = tl.load(slot_ptr + toks[:, None] * EP + rk[None, :], mask=sm, other=-1)
            mx = tl.max(sl, axis=0)  # [EP_P2]: the block's last slot on each rank, -1: none there
            hi = tl.where(mx >= 0, mx // CHUNK, -1)
            lo = tl.min(tl.where(sl >= 0, sl, 2147483647), axis=0) // CHUNK
            first = tl.maximum(lo, seen + 1)
            for r in tl.static_range(EP):
                if r != RANK:
                    a = tl.sum(tl.where(rk == r, first, 0))
                    b = tl.sum(tl.where(rk == r, hi, 0))
                    for c in range(a, b + 1):
                        _wait_flag(pad + r * NCMAX + c, e, timeout_ns, RANK, r, TIMER)
            seen = tl.maximum(seen, hi)
            for b0 in range(t0, tl.minimum(t0 + SB, T), TT):
                tb = (b0 + tl.arange(0, TT)).to(tl.int64)
                bm = tb < T
                for c0 in range(0, W, NB):
                    cols = c0 + tl.arange(0, NB)
                    cm = cols < W
                    acc = tl.zeros([TT, NB], dtype=tl.float32)
                    for r in tl.static_range(EP):
                        slot = tl.load(slot_ptr + tb * EP + r, mask=bm, other=-1).to(tl.int64)
                        m = (slot >= 0)[:, None] & cm[None, :]
                        if r == RANK:
                            own = own_ptr + (slot * stride_own_row)[:, None]
                            v = tl.load(own + cols[None, :], mask=m, other=0.0)
                        else:
                            recv = _pick(RANK, p0, p1, p2, p3, p4, p5, p6, p7)
                            row = stride_recv_block.to(tl.int64) * r + slot * W
                            # (L2 only: the rows were written by peers during this launch)
                            v = tl.load(recv + row[:, None] + cols[None, :], mask=m, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
                        acc += v.to(tl.float32)
                    om = bm[:, None] & cm[None, :]
                    res = acc.to(out_ptr.dtype.element_ty)
                    tl.store(out_ptr + tb[:, None] * W + cols[None, :], res, mask=om)
        # every peer's sends done (see the docstring)
        mine = _pick(RANK, q0, q1, q2, q3, q4, q5, q6, q7) + done_base
        for r in tl.static_range(EP):
            if r != RANK:
                _wait_flag(mine + r, e, timeout_ns, RANK, r, TIMER)
    if ROLES != 2:
        tl.debug_barrier()
        old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
        if old == nprog - 1:
            tl.store(arrive_ptr, 0)
            tl.store(epoch_ptr, e)


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
    m = _marks(ids_ptr, toks, tmask, ranks, E, base, rem, K, BLOCK_T, EP_P2)
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
                dst = _pick(r, h0, h1, h2, h3, h4, h5, h6, h7)
                c = tl.sum(tl.where(ranks == r, tot, 0))
                tl.store(dst + r * stride_hdr_rank + hdr_offset, c)


@triton.jit
def _plan_lookback(ids_ptr, slot_ptr, counts_ptr, h0, h1, h2, h3, h4, h5, h6, h7, stride_hdr_rank, hdr_offset,
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
    _spin_gpu(stored_ptr, nblk, ASM)
    tl.debug_barrier()
    old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if old == total - 1:  # every program is past the wait and took its last ticket
        tl.store(ticket_ptr, 0)
        tl.store(stored_ptr, 0)
        tl.store(arrive_ptr, 0)
        tl.store(epoch_ptr, e)


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
        _wait_peers(tl.load(epoch_ptr), pad_ptr, pad_base, timeout_ns, EP, RANK, TIMER)
    _sanitize_rows(ids_ptr, hdr_ptr, recv_counts_ptr, n_rows, stride_ids_row, rows_per_block, hdr_block,
                   hdr_off, lo, hi, invalid, tl.program_id(0), tl.num_programs(0), K, K_P2, EP, EP_P2, BLOCK,
                   HAS_IDS)  # fmt: skip


@triton.jit
def _sanitize_rows(ids_ptr, hdr_ptr, recv_counts_ptr, n_rows, stride_ids_row, rows_per_block, hdr_block,
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

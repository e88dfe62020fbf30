"""Triton kernels of the combine: send each rank's rows back to their source
(``ep_combine_send_kernel``), sum them per token (``ep_combine_reduce_kernel``), or both in one
pipelined launch (``ep_combine_kernel``). Only ``@triton.jit`` code lives here; the launch logic is in
``replaymoe.ep``.

The row copies loop over their work with a grid stride, so any grid is valid; with ``num_sms`` set
the first grid axis has at most that many programs (the SMs the all-to-all may occupy).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_sync import pick, signal_done, wait_flag, wait_peers


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
    SIGNAL: tl.constexpr,  # the last program signals the peers (see signal_done); SKIP is this rank
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
                base = pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
                tl.store(base + dst[:, None] + cols[None, :], v, mask=m & (s == r))
    if SIGNAL:
        signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off, EP, SKIP)


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
        wait_peers(tl.load(epoch_ptr), pad_ptr, pad_base, timeout_ns, EP, OWN, TIMER)
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
# system scope, after a CTA barrier: the pattern of ``signal_done``). A reducer takes token blocks
# in ascending order; the slot plan is a prefix sum over tokens, so a block's rows on rank ``r`` lie
# in one ascending slot range, and the reducer waits only for the chunks that cover it (acquire,
# system scope), remembering per rank the highest chunk it has seen complete.
# ----------------------------------------------------------------------------------------------


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
                                base = pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
                                tl.store(base + dst_row[:, None] + cols[None, :], v, mask=m & (s == r))
                tl.debug_barrier()  # every thread's stores of the chunk before the flag
                for r in tl.static_range(EP):
                    if r != RANK:
                        fq = pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                        tl.atomic_xchg(fq + flag_base + RANK * NCMAX + c, e, mask=s == r, sem="release",
                                       scope="sys")  # fmt: skip
        # the last sender tells every peer that this rank's sends are done (after every chunk's flag)
        tl.debug_barrier()
        done = tl.atomic_add(send_arrive_ptr, 1, sem="acq_rel", scope="gpu")
        if done == n_send - 1:
            tl.store(send_arrive_ptr, 0)
            for r in tl.static_range(EP):
                if r != RANK:
                    fq = pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                    tl.atomic_xchg(fq + done_base + RANK, e, sem="release", scope="sys")
    else:
        rid = pid - SENDERS
        n_red = nprog - SENDERS
        if ROLES == 2:
            rid = pid
            n_red = nprog
        rk = tl.arange(0, EP_P2)
        seen = tl.full([EP_P2], -1, dtype=tl.int32)  # per rank: chunks up to here are known complete
        pad = pick(RANK, q0, q1, q2, q3, q4, q5, q6, q7) + flag_base
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
                        wait_flag(pad + r * NCMAX + c, e, timeout_ns, RANK, r, TIMER)
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
                            recv = pick(RANK, p0, p1, p2, p3, p4, p5, p6, p7)
                            row = stride_recv_block.to(tl.int64) * r + slot * W
                            # (L2 only: the rows were written by peers during this launch)
                            v = tl.load(recv + row[:, None] + cols[None, :], mask=m, other=0.0,
                                        cache_modifier=".cg")  # fmt: skip
                        acc += v.to(tl.float32)
                    om = bm[:, None] & cm[None, :]
                    res = acc.to(out_ptr.dtype.element_ty)
                    tl.store(out_ptr + tb[:, None] * W + cols[None, :], res, mask=om)
        # every peer's sends done (see the docstring)
        mine = pick(RANK, q0, q1, q2, q3, q4, q5, q6, q7) + done_base
        for r in tl.static_range(EP):
            if r != RANK:
                wait_flag(mine + r, e, timeout_ns, RANK, r, TIMER)
    if ROLES != 2:
        tl.debug_barrier()
        old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
        if old == nprog - 1:
            tl.store(arrive_ptr, 0)
            tl.store(epoch_ptr, e)

"""Triton helpers the fused-MoE GEMM kernels share (GEMM1, GEMM2, the swapped fp8 kernels, the backward).

* ``grouped_pid``: a program's (tile, column block) in grouped order;
* ``apply_act``: the activation of the fp32 gate / up accumulators (``ACT``, see
  :mod:`replaymoe.moe._kernel_gemm1`);
* direct mode (one program per slot): ``direct_rows`` and, with ``MERGE``, ``_merged_slots`` (the slots of
  one expert as the rows of one tile, led by its first slot's program);
* the top-k sum's tickets (``TICKET``): ``zero_tickets`` (GEMM1), ``ticket_sum`` / ``ticket_sum_rows``
  (GEMM2's epilogue).

Only ``@triton.jit`` code lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def apply_act(g, u, alpha, limit, ACT: tl.constexpr):
    """The activation of fp32 gate / up accumulators (see the module docstring)."""
    if ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    else:
        return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def zero_tickets(cnt_ptr, pid_m, pid_n, TOP_K, num_cnt_n):
    """Direct mode, GEMM1 (``TICKET``): the program of a token's first slot and first column block zeroes
    the token's ``num_cnt_n`` GEMM2 tickets ``cnt[t, :]`` (GEMM2 runs after GEMM1 on the stream, or
    waits for it as a dependent launch)."""
    if (pid_n == 0) & (pid_m % TOP_K == 0):
        t = (pid_m // TOP_K).to(tl.int64)
        for j in range(0, num_cnt_n, 128):
            r = j + tl.arange(0, 128)
            tl.store(cnt_ptr + t * num_cnt_n + r, tl.zeros((128,), dtype=tl.int32), mask=r < num_cnt_n)


@triton.jit
def ticket_sum(y_ptr, out_ptr, ids_ptr, cnt_ptr, tok, pid_n, num_pid_n, rn, n_ok, TOP_K, expert_offset,
                num_local, stride_ym, stride_om, KP: tl.constexpr, ARRIVE: tl.constexpr):  # fmt: skip
    """Direct mode, GEMM2's epilogue (``TICKET``): the top-k sum without the reduce kernel.

    ``ARRIVE``: this program has stored its slot's row of ``y`` for columns ``rn``; it counts itself on
    the ticket ``cnt[tok, pid_n]`` (after a CTA barrier, one gpu-scope acq_rel atomic), and the program
    that completes the token's count of local slots sums the token's rows in k order (read from L2) into
    ``out[tok, rn]``: ``moe_reduce_kernel``'s arithmetic, so the same bits. Without ``ARRIVE`` (the
    program of a token's first slot, whose expert is not local): writes zeros where the token has no
    local slot at all. ``KP``: TOP_K rounded up to a power of two."""
    rk = tl.arange(0, KP)
    ek = tl.load(ids_ptr + tok * TOP_K + rk, mask=rk < TOP_K, other=0).to(tl.int32) - expert_offset
    n_local = tl.sum(((rk < TOP_K) & (ek >= 0) & (ek < num_local)).to(tl.int32), axis=0)
    if ARRIVE:
        tl.debug_barrier()  # every thread's row stores before the release
        last = tl.atomic_add(cnt_ptr + tok * num_pid_n + pid_n, 1, sem="acq_rel", scope="gpu") == n_local - 1
    else:
        last = n_local == 0
    if last:
        acc = tl.zeros(rn.shape, dtype=tl.float32)
        for kk in range(0, TOP_K):
            slot = tok * TOP_K + kk
            e = tl.load(ids_ptr + slot).to(tl.int32) - expert_offset
            local = (e >= 0) & (e < num_local)
            row = tl.load(y_ptr + slot * stride_ym + rn, mask=n_ok & local, other=0.0, cache_modifier=".cg")
            acc += row.to(tl.float32)
        tl.store(out_ptr + tok * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _merged_slots(pid_m, ids_ptr, num_slots, ROWS: tl.constexpr, SCAN: tl.constexpr):
    """Direct mode with merged slots (``MERGE``): ``(lead, slots [ROWS])`` of slot ``pid_m``'s program.

    The slots of one expert, in slot order, form tiles of ``ROWS``: the program of a tile's first slot
    leads it, its rows being the tile's slots (``num_slots`` past the expert's last), and the programs of
    the tile's other slots do nothing. ``SCAN``: ``num_slots`` rounded up to a power of two (every program
    reads the batch's ``ids`` [num_slots])."""
    idx = tl.arange(0, SCAN)
    ids = tl.load(ids_ptr + idx, mask=idx < num_slots, other=-1)
    match = (ids == tl.load(ids_ptr + pid_m)) & (idx < num_slots)
    pos = tl.cumsum(match.to(tl.int32), axis=0) - 1  # a matching slot's place among its expert's slots
    mine = tl.sum((match & (idx < pid_m)).to(tl.int32), axis=0)  # this slot's place
    hit = match[None, :] & (pos[None, :] == mine + tl.arange(0, ROWS)[:, None])  # [ROWS, SCAN]
    slot = tl.sum(tl.where(hit, idx[None, :] + 1, 0), axis=1) - 1  # -1: no such slot
    return mine % ROWS == 0, tl.where(slot >= 0, slot, num_slots)


@triton.jit
def direct_rows(pid_m, ids_ptr, num_slots, ROWS: tl.constexpr, MERGE: tl.constexpr, SCAN: tl.constexpr):
    """Direct mode: ``(lead, slots [ROWS], rows [ROWS])`` of slot ``pid_m``'s program: whether it computes
    a tile (always, unless ``MERGE``), the tile's slots (``num_slots``: padding) and their rows of the
    intermediate: the slot alone on row 0 (its row ``pid_m``), or with ``MERGE`` the slots of its expert
    that it leads (``_merged_slots``), each on its own row."""
    if MERGE:
        lead, slots = _merged_slots(pid_m, ids_ptr, num_slots, ROWS, SCAN)
        rows = tl.where(slots < num_slots, slots, pid_m)
    else:
        rm = tl.arange(0, ROWS)
        lead = pid_m >= 0
        slots = tl.where(rm == 0, pid_m, num_slots)
        rows = pid_m + rm * 0
    return lead, slots, rows


@triton.jit
def ticket_sum_rows(y_ptr, out_ptr, ids_ptr, cnt_ptr, slots, pid_n, num_pid_n, rn, n_ok, num_slots, TOP_K,
                     expert_offset, num_local, stride_ym, stride_om, KP: tl.constexpr):  # fmt: skip
    """``ticket_sum`` with ``ARRIVE`` for a merged tile (``MERGE``): every real row (``slots`` [R], each
    a different token's) counts itself on its token's ticket ``cnt[tok, pid_n]``, and the rows whose
    count completes their token's local slots sum that token's rows in k order into ``out[tok, rn]``:
    the same arithmetic, so the same bits."""
    ok = slots < num_slots
    tok = tl.where(ok, slots // TOP_K, 0).to(tl.int64)
    rk = tl.arange(0, KP)
    k_ok = ok[:, None] & (rk[None, :] < TOP_K)
    ek = tl.load(ids_ptr + tok[:, None] * TOP_K + rk[None, :], mask=k_ok, other=0).to(tl.int32)
    ek -= expert_offset
    n_local = tl.sum((k_ok & (ek >= 0) & (ek < num_local)).to(tl.int32), axis=1)
    tl.debug_barrier()  # every thread's row stores before the release
    old = tl.atomic_add(cnt_ptr + tok * num_pid_n + pid_n, 1, mask=ok, sem="acq_rel", scope="gpu")
    last = ok & (old == n_local - 1)
    if tl.sum(last.to(tl.int32), axis=0) > 0:
        acc = tl.zeros((slots.shape[0], rn.shape[0]), dtype=tl.float32)
        for kk in range(0, TOP_K):
            slot = tok * TOP_K + kk
            e = tl.load(ids_ptr + slot, mask=last, other=0).to(tl.int32) - expert_offset
            use = last & (e >= 0) & (e < num_local)
            row = tl.load(y_ptr + slot[:, None] * stride_ym + rn[None, :], mask=use[:, None] & n_ok[None, :],
                          other=0.0, cache_modifier=".cg")  # fmt: skip
            acc += row.to(tl.float32)
        o_ptrs = out_ptr + tok[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=last[:, None] & n_ok[None, :])

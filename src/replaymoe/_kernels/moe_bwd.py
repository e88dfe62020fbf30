"""Triton kernels of the fused-MoE backward (bf16 / fp16 / fp32, fp32 accumulation).

Forward, per slot s = (t, k) routed to local expert e (rows of the backward's own tile layout,
:mod:`replaymoe.layout`)::

    g, u = x_t W13[e, :I]^T, x_t W13[e, I:]^T     a = silu(g) * u     out_t = sum_k w_s * a W2[e]^T

Backward, given dO [T, H], in three kinds of launch (no float atomics; every reduction in a fixed
order, so two backward passes are bitwise equal):

* ``_moe_bwd_act_kernel`` (grid: tiles × I-blocks): ``da' = dO[t] @ W2[e]`` gathered through the
  layout (K loop over H); g, u are loaded from the forward's saved rows (per slot) or recomputed
  in the same K loop (``RECOMPUTE``: two more accumulators over x and W13). Epilogue:
  ``dh = [w·da'·u·silu'(g), w·da'·silu(g)]`` and ``aw = w·a`` in layout order, and the partial row
  dot ``sum_n da'·a`` of this I-block per slot (d topk_weights; summed over blocks by the host in
  block order).
* ``_moe_bwd_dx_kernel`` (grid: tiles × H-blocks): ``dxs[s] = dh[row] @ W13[e]`` (K loop over 2I),
  one row per slot; the forward's ``_moe_reduce_kernel`` then sums each token's K rows in k order.
* ``_moe_bwd_dw_kernel`` (grid: experts × M-blocks × N-blocks): ``C[e] = P_e^T Q_e`` over the
  expert's real rows, whole (no split-K): dW13 with P = dh, Q = x (gathered), dW2 with P = dO
  (gathered), Q = aw. An expert without tokens gets zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe import _grouped_pid


@triton.jit
def _moe_bwd_act_kernel(
    dout_ptr,
    x_ptr,
    w13_ptr,
    w2_ptr,
    h_ptr,
    wts_ptr,
    dh_ptr,
    aw_ptr,
    dwp_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    TOP_K,
    num_slots,
    stride_dm,
    stride_xm,
    stride_w13e,
    stride_w13n,
    stride_w2e,
    stride_w2h,
    stride_hm,
    stride_dhm,
    stride_awm,
    RECOMPUTE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dh, aw (layout rows) and the per-slot partial row dots of one tile × BLOCK_N of I."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
    rows = (pid_m * BLOCK_M + rm).to(tl.int64)
    row_ok = slots < num_slots
    slot_c = tl.where(row_ok, slots, 0).to(tl.int64)
    tok = slot_c // TOP_K
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    rk = tl.arange(0, BLOCK_K)
    d_ptrs = dout_ptr + tok[:, None] * stride_dm + rk[None, :]
    b_ptrs = w2_ptr + e * stride_w2e + rk[:, None] * stride_w2h + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RECOMPUTE:
        x_ptrs = x_ptr + tok[:, None] * stride_xm + rk[None, :]
        g_ptrs = w13_ptr + e * stride_w13e + rn[None, :] * stride_w13n + rk[:, None]
        u_ptrs = g_ptrs + I * stride_w13n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            d = tl.load(d_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < H - k * BLOCK_K
            d = tl.load(d_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(d, b, acc, input_precision=DOT_PREC)
        if RECOMPUTE:
            if EVEN_K:
                xa = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = tl.dot(xa, bg, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(xa, bu, acc_u, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        d_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_w2h
    ok2 = row_ok[:, None] & n_ok[None, :]
    if RECOMPUTE:
        g = acc_g
        u = acc_u
    else:
        h_ptrs = h_ptr + slot_c[:, None] * stride_hm + rn[None, :]
        g = tl.load(h_ptrs, mask=ok2, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + I, mask=ok2, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    sg = g * sig
    a = (sg * u).to(aw_ptr.dtype.element_ty).to(tl.float32)  # the forward's SwiGLU rows, as rounded
    wt = tl.load(wts_ptr + slot_c, mask=row_ok, other=0.0).to(tl.float32)
    part = tl.sum(tl.where(ok2, acc * a, 0.0), axis=1)
    tl.store(dwp_ptr + slot_c * num_pid_n + pid_n, part, mask=row_ok)
    da = acc * wt[:, None]
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    du = da * sg
    dh_ptrs = dh_ptr + rows[:, None] * stride_dhm + rn[None, :]
    dt = dh_ptr.dtype.element_ty
    tl.store(dh_ptrs, tl.where(ok2, dg, 0.0).to(dt), mask=n_ok[None, :])
    tl.store(dh_ptrs + I, tl.where(ok2, du, 0.0).to(dt), mask=n_ok[None, :])
    aw_ptrs = aw_ptr + rows[:, None] * stride_awm + rn[None, :]
    tl.store(aw_ptrs, tl.where(ok2, a * wt[:, None], 0.0).to(dt), mask=n_ok[None, :])


@triton.jit
def _moe_bwd_dx_kernel(
    dh_ptr,
    w13_ptr,
    dxs_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I2,
    num_slots,
    stride_dhm,
    stride_we,
    stride_wn,
    stride_xm,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dxs[slot, n] = dh[row] @ W13[e][:, n] for the real rows of one tile × BLOCK_N of H."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
    rows = (pid_m * BLOCK_M + rm).to(tl.int64)
    row_ok = slots < num_slots
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = dh_ptr + rows[:, None] * stride_dhm + rk[None, :]
    b_ptrs = w13_ptr + e * stride_we + rk[:, None] * stride_wn + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(I2, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < I2 - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wn
    o_ptrs = dxs_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * stride_xm + rn[None, :]
    tl.store(o_ptrs, acc.to(dxs_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_bwd_dw_kernel(
    p_ptr,
    q_ptr,
    c_ptr,
    sorted_ptr,
    offsets_ptr,
    counts_ptr,
    M,
    N,
    TOP_K,
    stride_pm,
    stride_qm,
    stride_ce,
    stride_cm,
    P_GATHER: tl.constexpr,
    Q_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """C[e, m, n] = sum over expert e's real rows r (in row order) of P[r, m] * Q[r, n].

    Rows r are layout positions; a ``*_GATHER`` operand is read at token ``sorted[r] // TOP_K``
    instead (x or dO), the other at row r (dh or aw)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_m * num_n
    e = pid // per_e
    pid_m, pid_n = _grouped_pid(pid % per_e, num_m, num_n, GROUP_M)
    start = tl.load(offsets_ptr + e)
    cnt = tl.load(counts_ptr + e)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, cnt, BLOCK_K):
        r = start + r0 + rk
        ok = r0 + rk < cnt
        if P_GATHER or Q_GATHER:
            tok = (tl.load(sorted_ptr + r, mask=ok, other=0) // TOP_K).to(tl.int64)
        if P_GATHER:
            prow = tok
        else:
            prow = r.to(tl.int64)
        if Q_GATHER:
            qrow = tok
        else:
            qrow = r.to(tl.int64)
        p = tl.load(
            p_ptr + prow[:, None] * stride_pm + rm[None, :], mask=ok[:, None] & m_ok[None, :], other=0.0
        )
        q = tl.load(
            q_ptr + qrow[:, None] * stride_qm + rn[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0
        )
        acc = tl.dot(tl.trans(p), q, acc, input_precision=DOT_PREC)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

"""Triton kernels of the fused-MoE backward (bf16 / fp16 / fp32, fp32 accumulation): dA, the SwiGLU
backward and dX here, dW and the bias gradients in :mod:`replaymoe.moe._kernel_bwd_dw`.

Forward, per slot s = (t, k) routed to local expert e (rows of the backward's own tile layout,
:mod:`replaymoe.moe.layout`)::

    g, u = x_t W13[e, :I]^T, x_t W13[e, I:]^T     a = silu(g) * u     out_t = sum_k w_s * a W2[e]^T

Buffers: the intermediates (dh [T*K, 2I], aw [T*K, I], pre-gathered token rows) have exactly one
row per slot, in the layout's compact order (:func:`replaymoe.moe.layout.compact_layout`): compact row
``exact_start[e] + j`` is expert e's j-th real slot. Tile kernels walk the padded layout and map a
real row r of a tile of expert e to compact row ``r - shift[e]``; padding rows are neither stored
nor used. Rows of non-local slots (EP) hold the marker ``T*K`` in ``compact_slots`` and are skipped.

Backward, given dO [T, H] (no float atomics; every reduction in a fixed order, so two backward
passes are bitwise equal):

* ``moe_bwd_da_kernel`` (grid: tiles × I-blocks): the grouped GEMM ``da' = dO[t] @ W2[e]``, dO rows
  gathered through the layout, written into the gate half of dh at compact rows.
* ``moe_bwd_swiglu_kernel`` (elementwise over compact rows × I-blocks): with g, u from the forward's
  saved rows (per slot; or from GEMM1 run again, ``recompute``) writes, in place,
  ``dh = [w·da'·u·silu'(g), w·da'·silu(g)]``, ``aw = w·a`` and the partial row dot
  ``sum_n da'·a`` of each I-block per slot (d topk_weights, summed over blocks in block order).
* ``moe_bwd_dx_kernel`` (grid: tiles × H-blocks): ``dxs[s] = dh[row] @ W13[e]`` (K loop over 2I),
  one row per slot; the forward's ``moe_reduce_kernel`` then sums each token's K rows in k order.
* the weight and bias gradients (``moe_bwd_dw_kernel``, its TMA twin, the row gather and the bias
  sums): :mod:`replaymoe.moe._kernel_bwd_dw`.

Expert variants (see :mod:`replaymoe.moe._kernel_gemm1`): with ``INTERLEAVED`` w13's gate row j is row
2j and up row j is 2j + 1, and dh's columns follow w13's rows (so that dX = dh @ W13 and dW13 =
dh^T x need no mapping); ``ACT`` 1 is gpt-oss's clamped SwiGLU, whose derivative is zero where a
clamp is active (a w2 bias adds dO[t]·b2[e] to the topk_weights gradient, out = sum_k w_k (a W2^T +
b2): the launcher computes that term with one matmul). Weights may have any strides.

dA and dX take half tiles (``HALF_TILES``) as the forward GEMMs do (:mod:`replaymoe.moe._kernel_gemm1`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_common import grouped_pid


@triton.jit
def moe_bwd_da_kernel(
    dout_ptr,
    w2_ptr,
    da_ptr,
    sorted_ptr,
    tile_expert_ptr,
    shift_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    TOP_K,
    num_slots,
    stride_dm,
    stride_w2e,
    stride_w2h,
    stride_w2i,
    stride_am,
    INTERLEAVED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr = False,
    w_desc=None,
    HALF_TILES: tl.constexpr = False,
):
    """da[row, gate column of n] = dO[tok] @ W2[e][:, n] (unweighted) for one tile × BLOCK_N of I,
    stored at the real rows' compact rows (padded row - shift[e]); padding rows are not stored.
    ``TMA`` (``EVEN_K``): the W2 tiles come through ``w_desc``, a descriptor of w2 viewed as
    ``[E_local * H, I]`` with blocks ``[BLOCK_K, BLOCK_N]`` (zeros past I, as the pointer loads' mask).

    ``HALF_TILES``: a tile with at most ``BLOCK_M // 2`` real rows computes only its first half; a
    row's dot does not depend on the tile height, so the same bits."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if HALF_TILES:  # real rows come first in a tile, padding markers (>= num_slots) after them
        if tl.load(sorted_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_slots:
            _bwd_da_tile(pid_m, pid_n, dout_ptr, w2_ptr, da_ptr, sorted_ptr, tile_expert_ptr,
                         shift_ptr, num_tiles_ptr, num_pid_m, H, I, TOP_K, num_slots, stride_dm,
                         stride_w2e, stride_w2h, stride_w2i, stride_am, INTERLEAVED, EVEN_K,
                         BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC, TMA, w_desc,
                         ROWS=BLOCK_M // 2)  # fmt: skip
        else:
            _bwd_da_tile(pid_m, pid_n, dout_ptr, w2_ptr, da_ptr, sorted_ptr, tile_expert_ptr,
                         shift_ptr, num_tiles_ptr, num_pid_m, H, I, TOP_K, num_slots, stride_dm,
                         stride_w2e, stride_w2h, stride_w2i, stride_am, INTERLEAVED, EVEN_K,
                         BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC, TMA, w_desc, ROWS=BLOCK_M)  # fmt: skip
    else:
        _bwd_da_tile(pid_m, pid_n, dout_ptr, w2_ptr, da_ptr, sorted_ptr, tile_expert_ptr,
                     shift_ptr, num_tiles_ptr, num_pid_m, H, I, TOP_K, num_slots, stride_dm,
                     stride_w2e, stride_w2h, stride_w2i, stride_am, INTERLEAVED, EVEN_K,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC, TMA, w_desc, ROWS=BLOCK_M)  # fmt: skip


@triton.jit
def _bwd_da_tile(
    pid_m,
    pid_n,
    dout_ptr,
    w2_ptr,
    da_ptr,
    sorted_ptr,
    tile_expert_ptr,
    shift_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    TOP_K,
    num_slots,
    stride_dm,
    stride_w2e,
    stride_w2h,
    stride_w2i,
    stride_am,
    INTERLEAVED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    w_desc,
    ROWS: tl.constexpr,
):
    """One tile of ``moe_bwd_da_kernel`` (program ``pid_m, pid_n``): its first ``ROWS`` of ``BLOCK_M``
    rows."""
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rm = tl.arange(0, ROWS)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
    row_ok = slots < num_slots
    rows = tl.where(row_ok, pid_m * BLOCK_M + rm - tl.load(shift_ptr + e), 0).to(tl.int64)  # compact
    tok = (tl.where(row_ok, slots, 0) // TOP_K).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    rk = tl.arange(0, BLOCK_K)
    d_ptrs = dout_ptr + tok[:, None] * stride_dm + rk[None, :]
    b_ptrs = w2_ptr + e * stride_w2e + rk[:, None] * stride_w2h + rn[None, :] * stride_w2i
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    tl.static_assert(not TMA or EVEN_K)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if TMA:
            d = tl.load(d_ptrs, mask=row_ok[:, None], other=0.0)
            b = w_desc.load([(e * H + k * BLOCK_K).to(tl.int32), pid_n * BLOCK_N])
        elif EVEN_K:
            d = tl.load(d_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < H - k * BLOCK_K
            d = tl.load(d_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(d, b, acc, input_precision=DOT_PREC)
        d_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_w2h
    if INTERLEAVED:
        cols = 2 * rn
    else:
        cols = rn
    o_ptrs = da_ptr + rows[:, None] * stride_am + cols[None, :]
    tl.store(o_ptrs, acc.to(da_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_bwd_swiglu_kernel(
    dh_ptr,
    h_ptr,
    wts_ptr,
    aw_ptr,
    dwp_ptr,
    compact_ptr,
    I,
    num_slots,
    alpha,
    limit,
    stride_dhm,
    stride_hm,
    stride_awm,
    stride_dwp,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Through the activation, for BLOCK_R compact rows × BLOCK_N of I: reads da' from dh's gate
    columns and g, u from h (per slot); writes dh's gate and up columns in place (SwiGLU:
    [w·da'·u·silu'(g), w·da'·silu(g)]; clamped: the same through the clamps, zero where one is
    active), aw = w·a and the partial row dot sum_n da'·a of this block per slot."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.load(compact_ptr + rows, mask=rows < num_slots, other=num_slots)
    row_ok = slots < num_slots  # rows of non-local slots (the marker): nothing to do
    slot_c = tl.where(row_ok, slots, 0).to(tl.int64)
    rows = rows.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    ok2 = row_ok[:, None] & n_ok[None, :]
    if INTERLEAVED:
        dh_ptrs = dh_ptr + rows[:, None] * stride_dhm + 2 * rn[None, :]
        du_ptrs = dh_ptrs + 1
    else:
        dh_ptrs = dh_ptr + rows[:, None] * stride_dhm + rn[None, :]
        du_ptrs = dh_ptrs + I
    da = tl.load(dh_ptrs, mask=ok2, other=0.0).to(tl.float32)
    h_ptrs = h_ptr + slot_c[:, None] * stride_hm + rn[None, :]
    g = tl.load(h_ptrs, mask=ok2, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + I, mask=ok2, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + slot_c, mask=row_ok, other=0.0).to(tl.float32)
    dt = dh_ptr.dtype.element_ty
    if ACT == 1:  # g' = min(g, limit), u' = clamp(u, -limit, limit), a = (u' + 1) g' sigmoid(alpha g')
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * gc))
        glu = gc * sig
        a = (gc / (1.0 + tl.exp(-alpha * gc)) * (uc + 1.0)).to(dt).to(tl.float32)  # as the forward's rows
    else:
        sig = 1.0 / (1.0 + tl.exp(-g))
        sg = g * sig
        a = (sg * u).to(dt).to(tl.float32)  # the forward's SwiGLU rows, as rounded
    part = tl.sum(da * a, axis=1)
    tl.store(dwp_ptr + slot_c * stride_dwp + pid_n, part, mask=row_ok)
    tl.store(aw_ptr + rows[:, None] * stride_awm + rn[None, :], (a * wt[:, None]).to(dt), mask=ok2)
    da = da * wt[:, None]
    if ACT == 1:  # zero where a clamp is active
        d_up = tl.where((u >= -limit) & (u <= limit), da * glu, 0.0)
        d_gate = tl.where(g <= limit, da * (uc + 1.0) * sig * (1.0 + alpha * gc * (1.0 - sig)), 0.0)
    else:
        d_up = da * sg
        d_gate = da * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(du_ptrs, d_up.to(dt), mask=ok2)
    tl.store(dh_ptrs, d_gate.to(dt), mask=ok2)


@triton.jit
def moe_bwd_dx_kernel(
    dh_ptr,
    w13_ptr,
    dxs_ptr,
    sorted_ptr,
    tile_expert_ptr,
    shift_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I2,
    num_slots,
    stride_dhm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_xm,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr = False,
    a_desc=None,
    w_desc=None,
    HALF_TILES: tl.constexpr = False,
    a_desc_half=None,
):
    """dxs[slot, n] = dh[row] @ W13[e][:, n] for the real rows of one tile × BLOCK_N of H (dh at
    compact rows: padded row - shift[e]; padding rows read row 0, their results are not stored).
    ``TMA`` (``EVEN_K``): both operands through descriptors, ``a_desc`` over dh ``[T*K, 2I]`` with
    blocks ``[BLOCK_M, BLOCK_K]`` (a tile's real rows are consecutive compact rows; the rows after
    them, another expert's or zeros past the end, only feed output rows that are not stored) and
    ``w_desc`` over w13 viewed as ``[E_local * 2I, H]`` with blocks ``[BLOCK_K, BLOCK_N]``.

    ``HALF_TILES``: a tile with at most ``BLOCK_M // 2`` real rows computes only its first half
    (``a_desc_half``: ``a_desc`` with ``BLOCK_M // 2``-row blocks); a row's dot does not depend on the
    tile height, so the same bits."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if HALF_TILES:  # real rows come first in a tile, padding markers (>= num_slots) after them
        if tl.load(sorted_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_slots:
            _bwd_dx_tile(pid_m, pid_n, dh_ptr, w13_ptr, dxs_ptr, sorted_ptr, tile_expert_ptr,
                         shift_ptr, num_tiles_ptr, num_pid_m, H, I2, num_slots, stride_dhm,
                         stride_we, stride_wn, stride_wk, stride_xm, EVEN_K, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, DOT_PREC, TMA, a_desc_half, w_desc, ROWS=BLOCK_M // 2)  # fmt: skip
        else:
            _bwd_dx_tile(pid_m, pid_n, dh_ptr, w13_ptr, dxs_ptr, sorted_ptr, tile_expert_ptr,
                         shift_ptr, num_tiles_ptr, num_pid_m, H, I2, num_slots, stride_dhm,
                         stride_we, stride_wn, stride_wk, stride_xm, EVEN_K, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, DOT_PREC, TMA, a_desc, w_desc, ROWS=BLOCK_M)  # fmt: skip
    else:
        _bwd_dx_tile(pid_m, pid_n, dh_ptr, w13_ptr, dxs_ptr, sorted_ptr, tile_expert_ptr,
                     shift_ptr, num_tiles_ptr, num_pid_m, H, I2, num_slots, stride_dhm,
                     stride_we, stride_wn, stride_wk, stride_xm, EVEN_K, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, DOT_PREC, TMA, a_desc, w_desc, ROWS=BLOCK_M)  # fmt: skip


@triton.jit
def _bwd_dx_tile(
    pid_m,
    pid_n,
    dh_ptr,
    w13_ptr,
    dxs_ptr,
    sorted_ptr,
    tile_expert_ptr,
    shift_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I2,
    num_slots,
    stride_dhm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_xm,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    a_desc,
    w_desc,
    ROWS: tl.constexpr,
):
    """One tile of ``moe_bwd_dx_kernel`` (program ``pid_m, pid_n``): its first ``ROWS`` of ``BLOCK_M``
    rows."""
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rm = tl.arange(0, ROWS)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
    row_ok = slots < num_slots
    rows = tl.where(row_ok, pid_m * BLOCK_M + rm - tl.load(shift_ptr + e), 0).to(tl.int64)  # compact
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = dh_ptr + rows[:, None] * stride_dhm + rk[None, :]
    b_ptrs = w13_ptr + e * stride_we + rk[:, None] * stride_wn + rn[None, :] * stride_wk
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    tl.static_assert(not TMA or EVEN_K)
    a_row = (pid_m * BLOCK_M - tl.load(shift_ptr + e)).to(tl.int32)  # TMA: the tile's first compact row
    for k in range(0, tl.cdiv(I2, BLOCK_K)):
        if TMA:
            a = a_desc.load([a_row, k * BLOCK_K])
            b = w_desc.load([(e * I2 + k * BLOCK_K).to(tl.int32), pid_n * BLOCK_N])
        elif EVEN_K:
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

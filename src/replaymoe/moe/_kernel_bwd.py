"""Triton kernels of the fused-MoE backward (bf16 / fp16 / fp32, fp32 accumulation).

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
* ``moe_bwd_dw_kernel`` (grid: experts × M-blocks × N-blocks): ``C[e] = A_e B_e`` over the
  expert's compact rows in row order, whole (no split-K): dW13 = dh^T x and dW2 = dO^T aw, with
  the token rows of x / dO gathered inside the loop or beforehand (optionally transposed, so that A
  is K-major). An expert without tokens gets zeros.
* ``moe_bwd_dw_tma_kernel`` (same grid, or a persistent one): the pre-gathered case (A [T*K, M], B
  [T*K, N] row-major, an expert's rows one contiguous segment) through TMA tensor descriptors built
  on the host: [BLOCK_K, BLOCK_M] blocks of A (transposed in shared memory for the dot) and
  [BLOCK_K, BLOCK_N] blocks of B; full row chunks go straight from the descriptors to the dot, the
  expert's last partial chunk is zeroed past its end in both operands (the next expert's rows may be
  anything, NaN included); C is stored through a descriptor over dW viewed [E*M, N] when BLOCK_M
  divides M, else by pointer stores. Same chunks, same order, same operand values: the pointer
  kernel's bits (bitwise on the H200; the sm_90 compile check: scripts/dw_tma_ptx_check.py).
* ``moe_bwd_gather_rows_kernel`` (grid: compact-row blocks × feature blocks): the token rows of x
  or dO in compact order for the dW GEMMs, ``dst[r] = src[compact_slots[r] // K]`` (token 0 for
  the rows of non-local slots, which the dW GEMMs never read).
* ``moe_bwd_bias_kernel`` (grid: experts × N-blocks): the bias gradients, per expert a sum over its
  compact rows in row order (dB13 = sum of dh rows; dB2 = sum of w·dO[t]).

Expert variants (see :mod:`replaymoe.moe._kernel_fwd`): with ``INTERLEAVED`` w13's gate row j is row
2j and up row j is 2j + 1, and dh's columns follow w13's rows (so that dX = dh @ W13 and dW13 =
dh^T x need no mapping); ``ACT`` 1 is gpt-oss's clamped SwiGLU, whose derivative is zero where a
clamp is active (a w2 bias adds dO[t]·b2[e] to the topk_weights gradient, out = sum_k w_k (a W2^T +
b2): the launcher computes that term with one matmul). Weights may have any strides.

dA and dX take half tiles (``HALF_TILES``) as the forward GEMMs do (:mod:`replaymoe.moe._kernel_fwd`).

Size: over 600 lines (about 660); the TMA dW kernel is the pointer dW kernel's twin (same tiles, same
chunk order, tested bitwise against it), so the two stay side by side, and dA / dX each carry a
half-tile dispatcher next to their tile body.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_fwd import grouped_pid


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


@triton.jit
def moe_bwd_dw_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    compact_ptr,
    starts_ptr,
    counts_ptr,
    M,
    N,
    TOP_K,
    stride_a0,  # A's dim-0 stride: per row, or per M index with A_T
    stride_b0,  # B's row stride
    stride_ce,
    stride_cm,
    A_T: tl.constexpr,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    C_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """C[e] (M × N; stored transposed with ``C_T``) = sum over expert e's compact rows r
    (``[starts[e], +counts[e])``), in row order, of A[m, r] * B[r, n].

    A is stored [T*K, M] (read at row r, or at token ``compact[r] // TOP_K`` with ``A_GATHER``) or,
    with ``A_T``, [M, T*K] (K-major); B is stored [T*K, N] (``B_GATHER`` as A's)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_m * num_n
    e = pid // per_e
    pid_m, pid_n = grouped_pid(pid % per_e, num_m, num_n, GROUP_M)
    start = tl.load(starts_ptr + e)
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
        if A_GATHER or B_GATHER:
            tok = (tl.load(compact_ptr + r, mask=ok, other=0) // TOP_K).to(tl.int64)
        if A_T:
            a_ok = m_ok[:, None] & ok[None, :]
            a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_a0 + r[None, :], mask=a_ok, other=0.0)
        else:
            if A_GATHER:
                arow = tok
            else:
                arow = r.to(tl.int64)
            p = tl.load(
                a_ptr + arow[:, None] * stride_a0 + rm[None, :], mask=ok[:, None] & m_ok[None, :], other=0.0
            )
            a = tl.trans(p)
        if B_GATHER:
            brow = tok
        else:
            brow = r.to(tl.int64)
        b = tl.load(
            b_ptr + brow[:, None] * stride_b0 + rn[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0
        )
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    c_base = c_ptr + e.to(tl.int64) * stride_ce
    if C_T:
        c_ptrs = c_base + rn[None, :].to(tl.int64) * stride_cm + rm[:, None]
    else:
        c_ptrs = c_base + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_bwd_gather_rows_kernel(
    src_ptr,
    dst_ptr,
    compact_ptr,
    num_slots,
    TOP_K,
    N,
    stride_src,
    stride_dst,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``dst[r, :N] = src[tok(r), :N]`` for BLOCK_R compact rows × BLOCK_N columns, where
    ``tok(r) = compact_slots[r] // TOP_K`` (0 for the marker ``num_slots``): a plain copy. The rows
    are stored streaming (``.cs``): the dW GEMMs read them only after the rest of the backward has
    passed through the L2, which keeps the source rows, read K times each."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_slots
    slots = tl.load(compact_ptr + rows, mask=row_ok, other=num_slots)
    tok = tl.where(slots < num_slots, slots // TOP_K, 0).to(tl.int64)
    ok = row_ok[:, None] & (rn < N)[None, :]
    v = tl.load(src_ptr + tok[:, None] * stride_src + rn[None, :], mask=ok)
    dst_ptrs = dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + rn[None, :]
    tl.store(dst_ptrs, v, mask=ok, cache_modifier=".cs")


@triton.jit
def moe_bwd_bias_kernel(
    src_ptr,
    wts_ptr,
    out_ptr,
    compact_ptr,
    starts_ptr,
    counts_ptr,
    N,
    TOP_K,
    stride_sm,
    stride_oe,
    GATHER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[e, n] = sum over expert e's compact rows r (``[starts[e], +counts[e])``), in row order, of
    src[r, n] or, with ``GATHER``, of wts[slot] * src[token, n] (slot = compact[r], token = slot //
    TOP_K); fp32."""
    e = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    start = tl.load(starts_ptr + e)
    cnt = tl.load(counts_ptr + e)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, cnt, BLOCK_R):
        r = start + r0 + rr
        ok = r0 + rr < cnt
        if GATHER:
            slot = tl.load(compact_ptr + r, mask=ok, other=0)
            row = (slot // TOP_K).to(tl.int64)
            w = tl.load(wts_ptr + slot, mask=ok, other=0.0).to(tl.float32)
        else:
            row = r.to(tl.int64)
        v = tl.load(
            src_ptr + row[:, None] * stride_sm + rn[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0
        )
        v = v.to(tl.float32)
        if GATHER:
            v = v * w[:, None]
        acc += tl.sum(v, axis=0)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + rn, acc, mask=n_ok)


@triton.jit
def _dw_tma_tile(
    tile,
    a_desc,
    b_desc,
    a_tail_desc,
    b_tail_desc,
    c_desc,
    c_ptr,
    starts_ptr,
    counts_ptr,
    M,
    N,
    stride_ce,
    stride_cm,
    C_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One ``BLOCK_M × BLOCK_N`` block of C[e] (tile = e * per_e + grouped block index, as
    ``moe_bwd_dw_kernel``'s program id): the expert's full BLOCK_K row chunks straight from the
    descriptors, then its last partial chunk with the rows past the expert's end zeroed in both operands
    (they are the next expert's rows or, past the buffer, zero fill): one masked BLOCK_K chunk where
    ``TAIL_K == BLOCK_K``, else ``TAIL_K``-row pieces (the ``*_tail_desc`` blocks; TAIL_K divides
    BLOCK_K), which skip the all-zero rows a full-width chunk would multiply and add the same products
    in the same order."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_m * num_n
    e = tile // per_e
    pid_m, pid_n = grouped_pid(tile % per_e, num_m, num_n, GROUP_M)
    start = tl.load(starts_ptr + e)
    cnt = tl.load(counts_ptr + e)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_full = cnt // BLOCK_K
    for i in range(0, n_full):
        r = start + i * BLOCK_K
        a = a_desc.load([r, m0])  # [BLOCK_K, BLOCK_M]; columns past M: zero fill
        b = b_desc.load([r, n0])  # [BLOCK_K, BLOCK_N]; columns past N: zero fill
        acc = tl.dot(a.T, b, acc, input_precision=DOT_PREC)
    tail = cnt - n_full * BLOCK_K
    r = start + n_full * BLOCK_K
    if TAIL_K == BLOCK_K:
        if tail > 0:
            ok = tl.arange(0, BLOCK_K) < tail
            a = tl.where(ok[:, None], a_desc.load([r, m0]), 0.0)
            b = tl.where(ok[:, None], b_desc.load([r, n0]), 0.0)
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PREC)
    else:
        for j in range(0, tl.cdiv(tail, TAIL_K)):
            ok = tl.arange(0, TAIL_K) < tail - j * TAIL_K
            a = tl.where(ok[:, None], a_tail_desc.load([r + j * TAIL_K, m0]), 0.0)
            b = tl.where(ok[:, None], b_tail_desc.load([r + j * TAIL_K, n0]), 0.0)
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PREC)
    out = acc.to(c_ptr.dtype.element_ty)
    if C_DESC:  # C viewed [E*M, N] with M % BLOCK_M == 0: the block never crosses into expert e + 1
        c_desc.store([e * M + m0, n0], out)
    else:
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, out, mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def moe_bwd_dw_tma_kernel(
    a_desc,
    b_desc,
    a_tail_desc,
    b_tail_desc,
    c_desc,
    c_ptr,
    starts_ptr,
    counts_ptr,
    M,
    N,
    num_tiles,
    stride_ce,
    stride_cm,
    C_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    NUM_PROGS: tl.constexpr = 0,
):
    """``moe_bwd_dw_kernel`` for pre-gathered rows (A [T*K, M] and B [T*K, N] row-major, C not
    transposed) through TMA tensor descriptors: ``a_desc`` over A with blocks ``[BLOCK_K, BLOCK_M]``
    (transposed in shared memory for the dot), ``b_desc`` over B with blocks ``[BLOCK_K, BLOCK_N]``,
    ``a_tail_desc`` / ``b_tail_desc`` over the same A and B with ``[TAIL_K, *]`` blocks for the pieces
    of an expert's partial last chunk (unused where ``TAIL_K == BLOCK_K``), and,
    with ``C_DESC``, ``c_desc`` over C viewed ``[E*M, N]`` with blocks ``[BLOCK_M, BLOCK_N]`` (pointer
    stores otherwise). The same BLOCK_K row chunks in the same order with the same operand values
    (masked rows and columns are zeros either way; a narrow piece leaves out only all-zero rows),
    so the same values as the pointer kernel.

    ``NUM_PROGS`` 0: one program per (expert, block) tile (grid ``num_tiles``); otherwise a
    persistent grid of ``NUM_PROGS`` programs, program p computing tiles p, p + NUM_PROGS, ... in
    expert-major order (programs running together share an expert's rows in L2). Every tile is still
    computed whole by one program, its K loop in row order: deterministic."""
    pid = tl.program_id(0)
    if NUM_PROGS == 0:
        _dw_tma_tile(pid, a_desc, b_desc, a_tail_desc, b_tail_desc, c_desc, c_ptr, starts_ptr, counts_ptr,
                     M, N, stride_ce, stride_cm, C_DESC, BLOCK_M, BLOCK_N, BLOCK_K, TAIL_K, GROUP_M,
                     DOT_PREC)  # fmt: skip
    else:
        for tile in range(pid, num_tiles, NUM_PROGS):
            _dw_tma_tile(tile, a_desc, b_desc, a_tail_desc, b_tail_desc, c_desc, c_ptr, starts_ptr,
                         counts_ptr, M, N, stride_ce, stride_cm, C_DESC, BLOCK_M, BLOCK_N, BLOCK_K, TAIL_K,
                         GROUP_M, DOT_PREC)  # fmt: skip

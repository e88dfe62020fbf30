"""Triton kernels of the fp8 experts with swapped operands: the weights on the MMA's rows.

The fp8 path keeps :data:`~replaymoe.moe.configs.FP8_BLOCK_M`-row token tiles for batch invariance
(Hopper's fp8 dot rounds differently on fewer rows), so at decode and small batches the unswapped
kernels run 64-row MMAs for one or a few real token rows. These kernels compute the transposed product
instead: ``w_tile [BLOCK_N, BLOCK_K] @ a^T [BLOCK_K, TN]``, the weight rows on the MMA's M side (64 or
more rows: the wgmma instruction of the 64-row tiles) and ``TN`` token columns on its N side. An output
element is the same sum of the same products in the same K chunks, scaled by the same ``scale_a *
scale_w`` product and accumulated in the same order, so the bits are those of the unswapped kernels
(a GPU test checks it at the three bench shapes).

Two modes, as the unswapped kernels:

* ``DIRECT`` (decode): one program column per slot, ``TN = 16`` token columns of which column 0 is
  the slot's (the others masked to zero); with ``MERGE`` the columns are the slots of the slot's expert
  that its program leads (``_kernel_common._merged_slots``);
* tile mode: the tiles of :mod:`replaymoe.moe.layout` with ``TN = block_m`` rows (16 or 32: an
  expert's rows of a small batch), gathered through ``sorted_slots``; GEMM1 writes its rows in layout
  order, GEMM2 reads them so and writes one row per slot.

* ``moe_gemm1_swapped_fp8_kernel``: one program per (tile, ``BLOCK_N`` columns of I): gate and up
  accumulators, SwiGLU, then (``PREQ``, 128 columns) quantized to e4m3 with one scale per row, or
  stored in bf16 for GEMM2 to quantize. x arrives quantized per 1×128 group with its scales.
* ``moe_gemm2_swapped_fp8_kernel``: one program per (tile, ``BLOCK_N`` columns of H): the SwiGLU rows
  (e4m3, or bf16 quantized as loaded) times w2, scaled by each slot's routing weight (the reduce
  kernel sums a token's rows).

Only the standard experts variant (no biases, SwiGLU, gate rows then up rows), as every fp8 call.
At decode the gain is the narrower GEMM1 blocks more than the smaller MMA (docs/TUNING.md, "fp8 decode
with swapped operands"): the decode is bound by load latency, not by the tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replaymoe.routing._kernel_ids import check_all_ids

from ._kernel_common import apply_act, direct_rows, grouped_pid, ticket_sum, ticket_sum_rows, zero_tickets

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _quant_cols(a):
    """Quantize fp32 columns [128, TN] to e4m3 with one scale per column; returns (q, scale [TN]).
    The arithmetic of ``_kernel_quant.quant_rows`` on the transposed tile (so the same bits)."""
    amax = tl.max(tl.abs(a), axis=0)
    s = tl.maximum(amax / FP8_MAX, 1e-12)
    q = tl.clamp(a / s[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return q, s


@triton.jit
def _tile_columns(pid_m, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_slots, TOP_K, expert_offset,
                  num_local, DIRECT: tl.constexpr, TN: tl.constexpr, MERGE: tl.constexpr = False,
                  SCAN: tl.constexpr = 16):  # fmt: skip
    """(run, e, slots [TN], rows [TN]) of tile ``pid_m``: whether it has work, its local expert, its
    columns' slots (``>= num_slots``: padding) and their rows of the intermediate (layout order; DIRECT:
    the slot's row; ``MERGE``: the slots of the slot's expert that this program leads, ``_merged_slots``,
    each on its own row)."""
    rt = tl.arange(0, TN)
    if DIRECT:
        e = tl.load(ids_ptr + pid_m).to(tl.int32) - expert_offset
        lead, slots, rows = direct_rows(pid_m, ids_ptr, num_slots, TN, MERGE, SCAN)
        run = (e >= 0) & (e < num_local) & lead
    else:
        run = pid_m < tl.load(num_tiles_ptr)
        e = tl.load(tile_expert_ptr + pid_m, mask=run, other=0)
        slots = tl.load(sorted_ptr + pid_m * TN + rt, mask=run, other=num_slots)
        rows = pid_m * TN + rt
    return run, e, slots, rows


@triton.jit
def moe_gemm1_swapped_fp8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    inter_ptr,
    inter_s_ptr,
    ids_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    num_slots,
    H,
    I,
    TOP_K,
    expert_offset,
    num_local,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_im,
    DIRECT: tl.constexpr,
    PREQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TN: tl.constexpr,
    GROUP_M: tl.constexpr,
    cnt_ptr=None,
    num_cnt_n=0,
    TICKET: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    SCAN: tl.constexpr = 16,
    err_addr=None,
    id_bound=0,
    CHECK_IDS: tl.constexpr = False,
):
    """inter[row, n] = silu(x[tok] @ w13[e, n]) * (x[tok] @ w13[e, I + n]) for ``BLOCK_N`` columns n of
    each real row of a tile, computed transposed (module docstring).

    ``PREQ`` (``BLOCK_N == 128``): the 128 columns leave quantized to e4m3 with one scale per row in
    ``inter_s[row, n // 128]``; otherwise in bf16 (GEMM2 quantizes them). ``BLOCK_N == 32``: the gate
    and up rows are stacked into one 64-row dot (a dot of fewer weight rows would take another MMA
    kind, which rounds differently).

    x [T, H] e4m3 with ``xs`` [T, H // 128] fp32 (``quant_groups_kernel``'s); w13 [E, 2I, H] e4m3 with
    unit stride along H, ``ws`` [E, 2I // 128, H // 128] fp32; ``ids`` [T * K] int; the layout's
    ``sorted_slots`` / ``tile_expert`` / ``num_tiles`` (tile mode); inter [rows, I] (e4m3 and
    ``inter_s`` [rows, I // 128] fp32 with ``PREQ``, else bf16; rows: T * K in DIRECT mode, the
    layout's rows otherwise). H and I are multiples of 128 (BLOCK_K); BLOCK_N is 32, 64 or 128.
    ``TICKET`` (DIRECT): also zero GEMM2's tickets ``cnt`` [T, num_cnt_n]. ``CHECK_IDS`` (DIRECT): program
    0 also checks the caller's ids into the error mailbox ``err_addr`` (``routing/_kernel_ids.py``)."""
    tl.static_assert(not PREQ or BLOCK_N == 128)
    tl.static_assert(DIRECT or not TICKET)
    tl.static_assert(DIRECT or not CHECK_IDS)
    STACK: tl.constexpr = BLOCK_N < 64
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if CHECK_IDS:
        if tl.program_id(0) == 0:
            check_all_ids(ids_ptr, num_slots, TOP_K, id_bound, err_addr)
    if TICKET:
        zero_tickets(cnt_ptr, pid_m, pid_n, TOP_K, num_cnt_n)
    run, e, slots, rows = _tile_columns(pid_m, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_slots,
                                        TOP_K, expert_offset, num_local, DIRECT, TN, MERGE, SCAN)  # fmt: skip
    if not run:
        return
    col_ok = slots < num_slots  # padding columns stay zero
    tok = tl.where(col_ok, slots // TOP_K, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[None, :] * stride_xm + rk[:, None]  # x^T: [BLOCK_K, TN]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = ws_ptr + e.to(tl.int64) * stride_se
    sg_ptr = s_base + (pid_n * BLOCK_N // 128) * stride_sn
    su_ptr = sg_ptr + (I // 128) * stride_sn
    if STACK:  # rows 0..BLOCK_N-1: gate rows rn; BLOCK_N..2 BLOCK_N-1: up rows I + rn
        r2 = tl.arange(0, 2 * BLOCK_N)
        up = r2 >= BLOCK_N
        w_rows = pid_n * BLOCK_N + tl.where(up, r2 - BLOCK_N + I, r2)
        gu_ptrs = w_base + w_rows[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros((2 * BLOCK_N, TN), dtype=tl.float32)
    else:
        g_ptrs = w_base + rn[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
        u_ptrs = g_ptrs + I * stride_wn
        acc_g = tl.zeros((BLOCK_N, TN), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, TN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        aq = tl.load(a_ptrs, mask=col_ok[None, :], other=0.0)
        sa = tl.load(xs_ptr + tok * (H // 128) + k, mask=col_ok, other=0.0)
        sg = tl.load(sg_ptr + k)
        su = tl.load(su_ptr + k)
        if STACK:
            s_rows = tl.where(up, su, sg)
            acc += tl.dot(tl.load(gu_ptrs), aq) * (sa[None, :] * s_rows[:, None])
            gu_ptrs += BLOCK_K
        else:
            acc_g += tl.dot(tl.load(g_ptrs), aq) * (sa[None, :] * sg)
            acc_u += tl.dot(tl.load(u_ptrs), aq) * (sa[None, :] * su)
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if STACK:
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, TN)), (1, 2, 0)))
    h = apply_act(acc_g, acc_u, 0.0, 0.0, 0)
    o_ptrs = inter_ptr + rows.to(tl.int64)[None, :] * stride_im + rn[:, None]
    if PREQ:
        hq, hs = _quant_cols(h.to(tl.bfloat16).to(tl.float32))  # rounded to bf16 first, as the reference
        tl.store(o_ptrs, hq, mask=col_ok[None, :])
        tl.store(inter_s_ptr + rows.to(tl.int64) * (I // 128) + pid_n, hs, mask=col_ok)
    else:
        tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def moe_gemm2_swapped_fp8_kernel(
    inter_ptr,
    inter_s_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    ids_ptr,
    wts_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    num_slots,
    H,
    I,
    TOP_K,
    expert_offset,
    num_local,
    stride_im,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ym,
    DIRECT: tl.constexpr,
    PREQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TN: tl.constexpr,
    GROUP_M: tl.constexpr,
    out_ptr=None,
    cnt_ptr=None,
    stride_om=0,
    KP: tl.constexpr = 1,
    TICKET: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    SCAN: tl.constexpr = 16,
):
    """y[slot, n] = w[slot] * (inter[row] @ w2[e, n]^T) for each real row of a tile, computed transposed
    (module docstring).

    inter [rows, I]: e4m3 with ``inter_s`` [rows, I // 128] fp32 (``PREQ``), or bf16, quantized here
    per 1×128 group as it is loaded (GEMM1's ``PREQ`` arithmetic, so the same bits); w2 [E, H, I] e4m3
    with unit stride along I, ``ws`` [E, H // 128, I // 128] fp32; ``wts`` [T * K] fp32; y [T * K, H].
    BLOCK_N is 64 or 128; H and I are multiples of 128 (BLOCK_K). ``TICKET`` (DIRECT): also the top-k
    sum into ``out`` [T, H], as ``moe_gemm2_kernel``'s (``ticket_sum``), so no reduce kernel runs."""
    tl.static_assert(DIRECT or not TICKET)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    run, e, slots, rows = _tile_columns(pid_m, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_slots,
                                        TOP_K, expert_offset, num_local, DIRECT, TN, MERGE, SCAN)  # fmt: skip
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if not run:
        if TICKET:
            if pid_m % TOP_K == 0:  # a token without local slots gets zeros
                ticket_sum(y_ptr, out_ptr, ids_ptr, cnt_ptr, (pid_m // TOP_K).to(tl.int64), pid_n, num_pid_n,
                            rn, rn < H, TOP_K, expert_offset, num_local, stride_ym, stride_om, KP,
                            ARRIVE=False)  # fmt: skip
        return
    col_ok = slots < num_slots
    rk = tl.arange(0, BLOCK_K)
    row = rows.to(tl.int64)
    a_ptrs = inter_ptr + row[None, :] * stride_im + rk[:, None]  # [BLOCK_K, TN]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    bs_ptr = ws_ptr + e.to(tl.int64) * stride_se + (pid_n * BLOCK_N // 128) * stride_sn
    acc = tl.zeros((BLOCK_N, TN), dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        if PREQ:
            a = tl.load(a_ptrs, mask=col_ok[None, :], other=0.0)
            sa = tl.load(inter_s_ptr + row * (I // 128) + k, mask=col_ok, other=0.0)
        else:
            a, sa = _quant_cols(tl.load(a_ptrs, mask=col_ok[None, :], other=0.0).to(tl.float32))
        b = tl.load(b_ptrs)
        sb = tl.load(bs_ptr + k)
        acc += tl.dot(b, a) * (sa[None, :] * sb)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    wt = tl.load(wts_ptr + slots, mask=col_ok, other=0.0).to(tl.float32)
    acc = acc * wt[None, :]
    o_ptrs = y_ptr + tl.where(col_ok, slots, 0).to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(o_ptrs, acc.to(y_ptr.dtype.element_ty), mask=col_ok[None, :])
    if TICKET:
        if MERGE:  # each column its own token's
            ticket_sum_rows(y_ptr, out_ptr, ids_ptr, cnt_ptr, slots, pid_n, num_pid_n, rn, rn < H, num_slots,
                             TOP_K, expert_offset, num_local, stride_ym, stride_om, KP)  # fmt: skip
        else:
            tok = (pid_m // TOP_K).to(tl.int64)
            ticket_sum(y_ptr, out_ptr, ids_ptr, cnt_ptr, tok, pid_n, num_pid_n, rn, rn < H, TOP_K,
                        expert_offset, num_local, stride_ym, stride_om, KP, ARRIVE=True)  # fmt: skip

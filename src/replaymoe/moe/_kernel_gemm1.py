"""Triton kernels of the fused-MoE experts: GEMM1 (``moe_gemm1_kernel``) here, and the forward's
modes, variants and fp8 path, which GEMM2 and the reduction (:mod:`replaymoe.moe._kernel_gemm2`)
share.

Two modes, chosen by the wrapper from the shape:

* LAYOUT (prefill, mid-size batches): tiles of ``BLOCK_M`` rows from :mod:`replaymoe.moe.layout`;
  GEMM1 gathers token rows through ``sorted_slots`` and writes ``silu(gate)*up`` rows in layout
  order; GEMM2 reads them contiguously, applies the routing weight and writes one row per slot;
  ``moe_reduce_kernel`` sums each token's K rows in k order (deterministic, no atomics).
* DIRECT (decode): one tile per slot (row 0 real; ``MERGE``: the slots of one expert as the rows of
  one tile, led by its first slot's program, ``_merged_slots``), no layout; GEMM2 writes one row per
  slot and sums each token's rows itself (``TICKET``: the program that completes a token's count of
  local slots sums them in k order, the reduce kernel's arithmetic; ``MoEConfig.fused_reduce``), or the same
  reduction kernel sums them. On Hopper the kernels can be programmatic dependent launches (``PDL``):
  GEMM1 waits for its inputs' producer and lets GEMM2 start at once; GEMM2 reads its slot's expert,
  prefetches its weight rows into L2 and waits for GEMM1's rows; the reduction (if it runs) waits for
  GEMM2's. Same arithmetic, so the same bits.
* ``TMA`` (tile mode, bf16 / fp16 / fp32 weights with unit stride along K; Hopper): the operands that
  are plain 2-D tiles come through host-side tensor descriptors (``TensorDescriptor`` arguments, no
  ``triton.set_allocator``): GEMM2's SwiGLU rows (``inter`` [rows, I]: a tile's rows are contiguous)
  and w2 viewed as [E*H, I]; GEMM1's w13 viewed as [E*2I, H] (gate and up tiles at rows e*2I + n and
  e*2I + I + n, or one [2 BLOCK_N, BLOCK_K] tile interleaved). GEMM1's x rows stay pointer loads
  (gathered through ``sorted_slots``; Hopper's TMA has no gather). The descriptors fill zeros past
  the K edge as the masks do; rows a tile reads past its expert (the next expert's weights) or past
  the real rows (never-written padding rows of ``inter``) feed only output columns / rows that are
  not stored. Same BLOCK_K chunks in the same order, fp32 accumulation, same epilogue: the same bits
  as the pointer loads (interpreter tests; ``scripts/fwd_tma_ptx_check.py`` for the sm_90 code).

fp8 block-scale (``FP8``): weights e4m3 with one fp32 scale per 128×128 block; activations are
quantized per 1×128 group (x, and the SwiGLU rows rounded to bf16). ``PREQ_X``: x is quantized once
by ``quant_groups_kernel`` (tile mode: by the layout's scatter launch, the same arithmetic) and GEMM1
reads e4m3 rows plus scales. ``PREQ`` (GEMM1 on 128-column
blocks, either mode): also GEMM1's epilogue quantizes its 128-column block of SwiGLU rows, so GEMM2
reads e4m3 too; without it (GEMM1 on narrower blocks) GEMM2 quantizes its activation tiles in registers
as it loads them, once per N-block program (the same arithmetic, so the same bits). ``BLOCK_K == 128``
and ``BLOCK_N`` divides 128 so each dot sees one weight scale.

Expert variants (bf16 / fp16 / fp32 only): weights with any strides (``stride_wk``: the stride
along the reduction dimension, 1 for contiguous weights, which Triton specializes, so the standard
layout compiles as before; gpt-oss passes transposed views); ``INTERLEAVED``: gate row j of w13 at
row 2j and up row j at 2j + 1 (otherwise j and I + j; interleaved, GEMM1 loads both as one contiguous
tile, runs one dot of twice the width and splits the accumulator's columns); ``HAS_BIAS``: biases
added in the GEMM epilogues (w13's before the activation, w2's before the routing weight); ``ACT``: 0 = SwiGLU
``silu(g) * u``, 1 = gpt-oss's clamped SwiGLU ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g')``
with ``g' = min(g, limit)``.

Half tiles (``HALF_TILES``, tile mode, not fp8): each GEMM kernel is a dispatcher over a ``_*_tile``
body with a constexpr row count; a tile whose row ``BLOCK_M // 2`` is padding (an expert's last, at
most half full) runs the body with ``BLOCK_M // 2`` rows, the others with ``BLOCK_M``. A row's dot does
not depend on the tile height on the GPU (bf16 / fp16), so the same bits; the padding rows are skipped.

Where the forward's kernels live: GEMM1 here; GEMM2 and ``moe_reduce_kernel`` (which also serves the
backward: the dX rows and the ``topk_weights`` partials, ``DWTS``) in :mod:`replaymoe.moe._kernel_gemm2`;
the tile and direct-mode helpers both GEMMs (and the swapped fp8 kernels) call, ``grouped_pid``,
``apply_act``, ``direct_rows`` / ``_merged_slots`` and the tickets, in :mod:`replaymoe.moe._kernel_common`;
the fp8 quantization (``quant_rows``, ``quant_groups_kernel``) in :mod:`replaymoe.moe._kernel_quant`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from replaymoe.routing._kernel_ids import check_all_ids

from ._kernel_common import apply_act, direct_rows, grouped_pid, zero_tickets
from ._kernel_quant import quant_rows


@triton.jit
def moe_gemm1_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    inter_ptr,
    inter_s_ptr,
    h_ptr,
    ids_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    TOP_K,
    num_slots,
    expert_offset,
    num_local,
    alpha,
    limit,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_bn,
    stride_im,
    stride_hm,
    DIRECT: tl.constexpr,
    FP8: tl.constexpr,
    PREQ_X: tl.constexpr,
    PREQ: tl.constexpr,
    SAVE_H: tl.constexpr,
    STORE_ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
    TMA: tl.constexpr = False,
    w_desc=None,
    HALF_TILES: tl.constexpr = False,
    cnt_ptr=None,
    num_cnt_n=0,
    TICKET: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    SCAN: tl.constexpr = 16,
    err_addr=None,
    id_bound=0,
    CHECK_IDS: tl.constexpr = False,
):
    """inter[row, n] = act(x[tok] @ w13[e, gate n] + b, x[tok] @ w13[e, up n] + b) for one tile × BLOCK_N.

    ``SAVE_H`` (training): also store the gate and up pre-activations (bias included) per slot,
    h[slot, n] and h[slot, I + n] (in this order whatever w13's layout), for the backward; without
    ``STORE_ACT`` (the backward's recomputation) only those.

    ``PDL`` (launched as a programmatic dependent launch): wait for the previous kernel's results
    first, then let the next kernel (GEMM2) start its prologue while this one runs.

    ``TMA`` (tile mode, not fp8, weights with unit stride along K): the weight tiles come through
    ``w_desc``, a host-side tensor descriptor of w13 viewed as ``[E_local * 2I, H]`` with blocks
    ``[BLOCK_N, BLOCK_K]`` (``[2 BLOCK_N, BLOCK_K]`` interleaved); the gathered x rows stay pointer
    loads. Same K chunks in the same order, so the same bits.

    ``HALF_TILES`` (tile mode): a tile with at most ``BLOCK_M // 2`` real rows (an expert's last)
    computes only its first ``BLOCK_M // 2`` rows (the same bits: a row's dot does not depend on the
    tile height, bf16 / fp16 / fp32; fp8 keeps one tile height, see FP8_BLOCK_M).

    ``TICKET`` (DIRECT): also zero GEMM2's tickets ``cnt`` [T, num_cnt_n] (``zero_tickets``).

    ``MERGE`` (DIRECT): the slots that share an expert run as the rows of one tile (``_merged_slots``;
    ``SCAN``: ``num_slots`` rounded up to a power of two); rows are written per slot.

    ``CHECK_IDS`` (DIRECT): program 0 also checks the caller's ids against ``[-1, id_bound)`` and for
    duplicates within a row, into the error mailbox ``err_addr`` (``routing/_kernel_ids.py``)."""
    tl.static_assert(not TMA or (not DIRECT and not FP8))
    tl.static_assert(DIRECT or not CHECK_IDS)
    tl.static_assert(not HALF_TILES or (not DIRECT and not FP8))
    tl.static_assert(DIRECT or not TICKET)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if CHECK_IDS:
        if pid == 0:
            check_all_ids(ids_ptr, num_slots, TOP_K, id_bound, err_addr)
    if TICKET:
        zero_tickets(cnt_ptr, pid_m, pid_n, TOP_K, num_cnt_n)
    if HALF_TILES:  # rows are a tile's first entries, padding markers (>= num_slots) after them
        if tl.load(sorted_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_slots:
            _gemm1_tile(pid_m, pid_n, x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, inter_ptr, inter_s_ptr,
                        h_ptr, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                        TOP_K, num_slots, expert_offset, num_local, alpha, limit, stride_xm,
                        stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_bn,
                        stride_im, stride_hm, DIRECT, FP8, PREQ_X, PREQ, SAVE_H, STORE_ACT,
                        HAS_BIAS, INTERLEAVED, ACT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                        DOT_PREC, PDL, TMA, w_desc, ROWS=BLOCK_M // 2, MERGE=MERGE, SCAN=SCAN)  # fmt: skip
        else:
            _gemm1_tile(pid_m, pid_n, x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, inter_ptr, inter_s_ptr,
                        h_ptr, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                        TOP_K, num_slots, expert_offset, num_local, alpha, limit, stride_xm,
                        stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_bn,
                        stride_im, stride_hm, DIRECT, FP8, PREQ_X, PREQ, SAVE_H, STORE_ACT,
                        HAS_BIAS, INTERLEAVED, ACT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                        DOT_PREC, PDL, TMA, w_desc, ROWS=BLOCK_M, MERGE=MERGE, SCAN=SCAN)  # fmt: skip
    else:
        _gemm1_tile(pid_m, pid_n, x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, inter_ptr, inter_s_ptr,
                    h_ptr, ids_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                    TOP_K, num_slots, expert_offset, num_local, alpha, limit, stride_xm,
                    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_bn,
                    stride_im, stride_hm, DIRECT, FP8, PREQ_X, PREQ, SAVE_H, STORE_ACT,
                    HAS_BIAS, INTERLEAVED, ACT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                    DOT_PREC, PDL, TMA, w_desc, ROWS=BLOCK_M, MERGE=MERGE, SCAN=SCAN)  # fmt: skip


@triton.jit
def _gemm1_tile(
    pid_m,
    pid_n,
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    inter_ptr,
    inter_s_ptr,
    h_ptr,
    ids_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    TOP_K,
    num_slots,
    expert_offset,
    num_local,
    alpha,
    limit,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_bn,
    stride_im,
    stride_hm,
    DIRECT: tl.constexpr,
    FP8: tl.constexpr,
    PREQ_X: tl.constexpr,
    PREQ: tl.constexpr,
    SAVE_H: tl.constexpr,
    STORE_ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
    TMA: tl.constexpr,
    w_desc,
    ROWS: tl.constexpr,
    MERGE: tl.constexpr,
    SCAN: tl.constexpr,
):
    """One tile of ``moe_gemm1_kernel`` (its program ``pid_m, pid_n``): the first ``ROWS`` rows of
    the tile's ``BLOCK_M`` (all of them but for a half tile)."""
    rm = tl.arange(0, ROWS)
    if DIRECT:
        slot0 = tl.load(ids_ptr + pid_m).to(tl.int32)
        e = slot0 - expert_offset
        if (e < 0) | (e >= num_local):
            return
        lead, slots, out_rows = direct_rows(pid_m, ids_ptr, num_slots, ROWS, MERGE, SCAN)
        if MERGE:
            if not lead:
                return
    else:
        if pid_m >= tl.load(num_tiles_ptr):
            return
        e = tl.load(tile_expert_ptr + pid_m)
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
        out_rows = pid_m * BLOCK_M + rm
    row_ok = slots < num_slots
    tok = tl.where(row_ok, slots // TOP_K, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + rk[None, :]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    if INTERLEAVED:  # gate, up columns side by side: one contiguous [BLOCK_K, 2 BLOCK_N] tile, one dot
        tl.static_assert(not FP8)
        g_rows = 2 * rn
        u_rows = g_rows + 1
        rn2 = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        n2_ok = rn2 < 2 * I
        b_ptrs = w_base + rn2[None, :] * stride_wn + rk[:, None] * stride_wk
        w_row = e * (2 * I) + pid_n * (2 * BLOCK_N)  # TMA: the tile's first row in the [E*2I, H] view
        acc = tl.zeros((ROWS, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                k_ok = rk < H - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if TMA:  # rows past 2I (the next expert's, or zeros past the last) only feed masked columns
                b = w_desc.load([w_row, k * BLOCK_K]).T
            elif EVEN_K:
                b = tl.load(b_ptrs, mask=n2_ok[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=n2_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        acc_g, acc_u = tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 2)))
    else:
        g_rows = rn
        u_rows = rn + I
        g_ptrs = w_base + rn[None, :] * stride_wn + rk[:, None] * stride_wk
        u_ptrs = g_ptrs + I * stride_wn
        acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        if FP8:
            s_base = ws_ptr + e.to(tl.int64) * stride_se
            sg_ptr = s_base + (pid_n * BLOCK_N // 128) * stride_sn
            su_ptr = sg_ptr + (I // 128) * stride_sn
        w_row = e * (2 * I) + pid_n * BLOCK_N  # TMA: the gate tile's first row in the [E*2I, H] view
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                k_ok = rk < H - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if TMA:  # rows past the half (up rows, the next expert's) only feed masked columns
                bg = w_desc.load([w_row, k * BLOCK_K]).T
                bu = w_desc.load([w_row + I, k * BLOCK_K]).T
            elif EVEN_K:
                bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                bg = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if PREQ_X:
                sa = tl.load(xs_ptr + tok * (H // 128) + k, mask=row_ok, other=0.0)
                sg = tl.load(sg_ptr + k)
                su = tl.load(su_ptr + k)
                acc_g += tl.dot(a, bg) * (sa[:, None] * sg)
                acc_u += tl.dot(a, bu) * (sa[:, None] * su)
            elif FP8:
                aq, sa = quant_rows(a.to(tl.float32))
                sg = tl.load(sg_ptr + k)
                su = tl.load(su_ptr + k)
                acc_g += tl.dot(aq, bg) * (sa[:, None] * sg)
                acc_u += tl.dot(aq, bu) * (sa[:, None] * su)
            else:
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + g_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + u_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SAVE_H:
        h_ptrs = h_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * stride_hm + rn[None, :]
        h_ok = row_ok[:, None] & n_ok[None, :]
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=h_ok)
        tl.store(h_ptrs + I, acc_u.to(h_ptr.dtype.element_ty), mask=h_ok)
    if not STORE_ACT:
        return
    h = apply_act(acc_g, acc_u, alpha, limit, ACT)
    o_ptrs = inter_ptr + out_rows[:, None].to(tl.int64) * stride_im + rn[None, :]
    if PREQ:  # quantize the SwiGLU rows (rounded to bf16 first, as the reference) per 1x128 group
        tl.static_assert(BLOCK_N == 128)
        hq, hs = quant_rows(h.to(tl.bfloat16).to(tl.float32))
        tl.store(o_ptrs, hq, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(inter_s_ptr + out_rows.to(tl.int64) * (I // 128) + pid_n, hs, mask=row_ok)
    else:
        tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

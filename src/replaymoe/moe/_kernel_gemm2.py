"""Triton kernels of the fused-MoE experts' second half: GEMM2 (``moe_gemm2_kernel``: the SwiGLU rows
times w2, scaled by each slot's routing weight, one row per slot; in direct mode with ``TICKET`` also the
token's top-k sum) and ``moe_reduce_kernel`` (each token's K rows summed in k order; it also serves the
backward: the dX rows and the ``topk_weights`` partials, ``DWTS``).

The modes (tile / direct, ``PDL``, ``TMA``), the fp8 path, the expert variants and the half tiles are
GEMM1's: see :mod:`replaymoe.moe._kernel_gemm1`. Only ``@triton.jit`` code lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._kernel_common import direct_rows, grouped_pid, ticket_sum, ticket_sum_rows
from ._kernel_quant import quant_rows


@triton.jit
def moe_gemm2_kernel(
    inter_ptr,
    inter_s_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    ids_ptr,
    wts_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    num_slots,
    expert_offset,
    num_local,
    stride_im,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_bn,
    stride_ym,
    DIRECT: tl.constexpr,
    FP8: tl.constexpr,
    PREQ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
    TMA: tl.constexpr = False,
    a_desc=None,
    w_desc=None,
    HALF_TILES: tl.constexpr = False,
    a_desc_half=None,
    out_ptr=None,
    cnt_ptr=None,
    TOP_K=1,
    stride_om=0,
    KP: tl.constexpr = 1,
    TICKET: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    SCAN: tl.constexpr = 16,
):
    """y[slot, n] = w[slot] * (inter[row] @ w2[e, n]^T + b2[e, n]) for each real row of a tile (DIRECT:
    tile = slot; the bias only with ``HAS_BIAS``).

    ``PDL`` (DIRECT only; launched as a programmatic dependent launch of GEMM1, whose programs waited
    for the ids' producer before letting this kernel start): read the slot's expert and prefetch this
    program's weight rows into L2 while GEMM1 finishes, then wait for GEMM1's rows.

    ``TMA`` (tile mode, not fp8, weights with unit stride along K): both operands come through
    host-side tensor descriptors, ``a_desc`` over the SwiGLU rows ``inter [rows, I]`` (blocks
    ``[BLOCK_M, BLOCK_K]``: a tile's rows are contiguous) and ``w_desc`` over w2 viewed as
    ``[E_local * H, I]`` (blocks ``[BLOCK_N, BLOCK_K]``). Padding rows of ``inter`` (never written)
    and weight rows past H (the next expert's) are read but only feed rows / columns that are not
    stored; past I the descriptors fill zeros, as the masks do. Same K chunks in the same order, so
    the same bits.

    ``HALF_TILES``: a tile with at most ``BLOCK_M // 2`` real rows computes only its first half
    (``a_desc_half``: ``a_desc`` with ``BLOCK_M // 2``-row blocks); a row's dot does not depend on the
    tile height, so the same bits.

    ``TICKET`` (DIRECT): also the top-k sum into ``out`` [T, H] (``ticket_sum``; tickets ``cnt``
    [T, cdiv(H, BLOCK_N)] zeroed by GEMM1; ``KP``: TOP_K rounded up to a power of two), so no reduce
    kernel runs. ``MERGE`` (DIRECT): as ``moe_gemm1_kernel``'s (a merged tile's program counts each of
    its rows on its token's ticket, ``ticket_sum_rows``)."""
    tl.static_assert(DIRECT or not PDL)
    tl.static_assert(DIRECT or not TICKET)
    tl.static_assert(not TMA or (not DIRECT and not FP8))
    tl.static_assert(not HALF_TILES or (not DIRECT and not FP8))
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M)
    if HALF_TILES:  # real rows come first in a tile, padding markers (>= num_slots) after them
        if tl.load(sorted_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_slots:
            _gemm2_tile(pid_m, pid_n, inter_ptr, inter_s_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, ids_ptr,
                        wts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                        num_slots, expert_offset, num_local, stride_im, stride_we, stride_wn,
                        stride_wk, stride_se, stride_sn, stride_be, stride_bn, stride_ym, DIRECT,
                        FP8, PREQ, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC,
                        PDL, TMA, a_desc_half, w_desc, ROWS=BLOCK_M // 2, MERGE=MERGE, SCAN=SCAN,
                        out_ptr=out_ptr, cnt_ptr=cnt_ptr, TOP_K=TOP_K, stride_om=stride_om, KP=KP,
                        TICKET=TICKET)  # fmt: skip
        else:
            _gemm2_tile(pid_m, pid_n, inter_ptr, inter_s_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, ids_ptr,
                        wts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                        num_slots, expert_offset, num_local, stride_im, stride_we, stride_wn,
                        stride_wk, stride_se, stride_sn, stride_be, stride_bn, stride_ym, DIRECT,
                        FP8, PREQ, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC,
                        PDL, TMA, a_desc, w_desc, ROWS=BLOCK_M, MERGE=MERGE, SCAN=SCAN,
                        out_ptr=out_ptr, cnt_ptr=cnt_ptr, TOP_K=TOP_K, stride_om=stride_om, KP=KP,
                        TICKET=TICKET)  # fmt: skip
    else:
        _gemm2_tile(pid_m, pid_n, inter_ptr, inter_s_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, ids_ptr,
                    wts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, num_pid_m, H, I,
                    num_slots, expert_offset, num_local, stride_im, stride_we, stride_wn,
                    stride_wk, stride_se, stride_sn, stride_be, stride_bn, stride_ym, DIRECT,
                    FP8, PREQ, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PREC,
                    PDL, TMA, a_desc, w_desc, ROWS=BLOCK_M, MERGE=MERGE, SCAN=SCAN, out_ptr=out_ptr,
                    cnt_ptr=cnt_ptr, TOP_K=TOP_K, stride_om=stride_om, KP=KP, TICKET=TICKET)  # fmt: skip


@triton.jit
def _gemm2_tile(
    pid_m,
    pid_n,
    inter_ptr,
    inter_s_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    ids_ptr,
    wts_ptr,
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pid_m,
    H,
    I,
    num_slots,
    expert_offset,
    num_local,
    stride_im,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_bn,
    stride_ym,
    DIRECT: tl.constexpr,
    FP8: tl.constexpr,
    PREQ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
    TMA: tl.constexpr,
    a_desc,
    w_desc,
    ROWS: tl.constexpr,
    MERGE: tl.constexpr,
    SCAN: tl.constexpr,
    out_ptr,
    cnt_ptr,
    TOP_K,
    stride_om,
    KP: tl.constexpr,
    TICKET: tl.constexpr,
):
    """One tile of ``moe_gemm2_kernel`` (program ``pid_m, pid_n``): its first ``ROWS`` of ``BLOCK_M``
    rows."""
    rm = tl.arange(0, ROWS)
    if DIRECT:
        e = tl.load(ids_ptr + pid_m).to(tl.int32) - expert_offset
        if PDL:
            tl.static_assert(not FP8)
            tl.static_assert(BLOCK_K >= 64)
            if (e >= 0) & (e < num_local):
                rn_p = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                rn_p = tl.where(rn_p < H, rn_p, 0)
                row_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn_p[:, None] * stride_wn
                line = tl.arange(0, BLOCK_K // 64) * 64  # one 128-byte line per 64 bf16/fp16 columns
                for k in range(0, tl.cdiv(I, BLOCK_K)):
                    kk = tl.minimum(k * BLOCK_K + line, I - 1)
                    p_ptrs = row_ptrs + kk[None, :] * stride_wk
                    tl.inline_asm_elementwise(
                        "prefetch.global.L2 [$1];", "=r,l", [p_ptrs], dtype=tl.int32, is_pure=False, pack=1
                    )
            gdc_wait()
            gdc_launch_dependents()
        if (e < 0) | (e >= num_local):
            if TICKET:
                if pid_m % TOP_K == 0:  # a token without local slots gets zeros
                    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                    ticket_sum(y_ptr, out_ptr, ids_ptr, cnt_ptr, (pid_m // TOP_K).to(tl.int64), pid_n,
                                tl.cdiv(H, BLOCK_N), rn, rn < H, TOP_K, expert_offset, num_local, stride_ym,
                                stride_om, KP, ARRIVE=False)  # fmt: skip
            return
        lead, slots, rows = direct_rows(pid_m, ids_ptr, num_slots, ROWS, MERGE, SCAN)
        if MERGE:
            if not lead:
                return
    else:
        if pid_m >= tl.load(num_tiles_ptr):
            return
        e = tl.load(tile_expert_ptr + pid_m)
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + rm)
        rows = pid_m * BLOCK_M + rm
    row_ok = slots < num_slots
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + rk[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[None, :] * stride_wn + rk[:, None] * stride_wk
    if FP8:
        bs_ptr = ws_ptr + e.to(tl.int64) * stride_se + (pid_n * BLOCK_N // 128) * stride_sn
    a_row = pid_m * BLOCK_M  # TMA: the tile's first row of inter and of the [E*H, I] view of w2
    w_row = e * H + pid_n * BLOCK_N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        if TMA:
            a = a_desc.load([a_row, k * BLOCK_K])
            b = w_desc.load([w_row, k * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < I - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if PREQ:
            sa = tl.load(inter_s_ptr + rows.to(tl.int64) * (I // 128) + k, mask=row_ok, other=0.0)
            sb = tl.load(bs_ptr + k)
            acc += tl.dot(a, b) * (sa[:, None] * sb)
        elif FP8:
            aq, sa = quant_rows(a.to(tl.float32))
            sb = tl.load(bs_ptr + k)
            acc += tl.dot(aq, b) * (sa[:, None] * sb)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b2 = tl.load(b_ptr + e.to(tl.int64) * stride_be + rn * stride_bn, mask=n_ok, other=0.0)
        acc += b2.to(tl.float32)[None, :]
    wt = tl.load(wts_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    o_ptrs = y_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(o_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    if TICKET:
        if MERGE:  # the tile's leader counts every row (each its own token's)
            ticket_sum_rows(y_ptr, out_ptr, ids_ptr, cnt_ptr, slots, pid_n, tl.cdiv(H, BLOCK_N), rn,
                             n_ok, num_slots, TOP_K, expert_offset, num_local, stride_ym, stride_om,
                             KP)  # fmt: skip
        else:
            ticket_sum(y_ptr, out_ptr, ids_ptr, cnt_ptr, (pid_m // TOP_K).to(tl.int64), pid_n,
                        tl.cdiv(H, BLOCK_N), rn, n_ok, TOP_K, expert_offset, num_local, stride_ym, stride_om,
                        KP, ARRIVE=True)  # fmt: skip


@triton.jit
def moe_reduce_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    H,
    TOP_K,
    expert_offset,
    num_local,
    stride_ym,
    stride_om,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
    dwp_ptr=None,
    dwts_ptr=None,
    num_parts=0,
    stride_dwp=0,
    DWTS: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 16,
    DX: tl.constexpr = True,
):
    """out[t] = sum over k (in k order) of y[t*K + k] for the token's local experts (``PDL``: launched
    as a programmatic dependent launch; waits for GEMM2's rows first). ``DWTS`` (the backward): the
    programs of the first H-block also write ``dwts[t*K + k]`` = the fp32 sum of the slot's
    ``num_parts`` partials ``dwp[t*K + k, :]`` in a fixed order (0 for non-local slots, whose rows are
    not read); ``DX=False``: that only (``y`` and ``out`` unused, one H-block)."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for kk in range(0, TOP_K):
        slot = t * TOP_K + kk
        e = tl.load(ids_ptr + slot).to(tl.int32) - expert_offset
        local = (e >= 0) & (e < num_local)
        if DX:
            acc += tl.load(y_ptr + slot * stride_ym + rh, mask=h_ok & local, other=0.0).to(tl.float32)
        if DWTS:
            if tl.program_id(1) == 0:
                rp = tl.arange(0, BLOCK_P)
                part = tl.zeros((BLOCK_P,), dtype=tl.float32)
                for p0 in range(0, num_parts, BLOCK_P):
                    p_ok = local & (p0 + rp < num_parts)
                    part += tl.load(dwp_ptr + slot * stride_dwp + p0 + rp, mask=p_ok, other=0.0)
                tl.store(dwts_ptr + slot, tl.sum(part, axis=0).to(dwts_ptr.dtype.element_ty))
    if DX:
        tl.store(out_ptr + t * stride_om + rh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)

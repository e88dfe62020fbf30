"""Triton kernels of the fused-MoE experts.

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

Size: over 600 lines (about 820); ``moe_reduce_kernel`` also serves the backward (the dX rows and the
``topk_weights`` partials, ``DWTS``), the GEMMs share their variant and fp8 code paths here, and each
half-tile dispatcher sits next to its tile body.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from replaymoe.routing._kernel_ids import check_all_ids

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def _quant_rows(a):
    """Quantize fp32 rows [M, 128] to e4m3 with one scale per row; returns (q, scale [M])."""
    amax = tl.max(tl.abs(a), axis=1)
    s = tl.maximum(amax / FP8_MAX, 1e-12)
    q = tl.clamp(a / s[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return q, s


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
    err_ptr=None,
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
    duplicates within a row, into the error mailbox ``err_ptr`` (``routing/_kernel_ids.py``)."""
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
            check_all_ids(ids_ptr, num_slots, TOP_K, id_bound, err_ptr)
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
                aq, sa = _quant_rows(a.to(tl.float32))
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
        hq, hs = _quant_rows(h.to(tl.bfloat16).to(tl.float32))
        tl.store(o_ptrs, hq, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(inter_s_ptr + out_rows.to(tl.int64) * (I // 128) + pid_n, hs, mask=row_ok)
    else:
        tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


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
            aq, sa = _quant_rows(a.to(tl.float32))
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
def quant_group_block(x_ptr, q_ptr, s_ptr, t, gb, n_groups, stride_xm, G: tl.constexpr):
    """Row ``t`` (int64) of x, its ``G`` 1x128 groups of block ``gb``: q [T, n_groups * 128] = e4m3(x / s),
    s [T, n_groups] = amax / 448 (``_quant_rows``)."""
    gi = gb * G + tl.arange(0, G)
    ok = gi < n_groups
    offs = gi[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + t * stride_xm + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    q, s = _quant_rows(x)
    tl.store(q_ptr + t * n_groups * 128 + offs, q, mask=ok[:, None])
    tl.store(s_ptr + t * n_groups + gi, s, mask=ok)


@triton.jit
def quant_groups_kernel(x_ptr, q_ptr, s_ptr, n_groups, stride_xm, G: tl.constexpr):
    """Per 1x128 group of each row: q = e4m3(x / s), s = amax / 448 (activations of the fp8 path)."""
    t = tl.program_id(0).to(tl.int64)
    quant_group_block(x_ptr, q_ptr, s_ptr, t, tl.program_id(1), n_groups, stride_xm, G)


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

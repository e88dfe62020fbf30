"""Triton kernels of the fused-MoE backward's weight and bias gradients (bf16 / fp16 / fp32, fp32
accumulation; buffers and compact rows: :mod:`replaymoe.moe._kernel_bwd_dx`), each a reduction over
an expert's compact rows in row order (no float atomics):

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

The TMA dW kernel is the pointer dW kernel's twin (same tiles, same chunk order, tested bitwise against
it), so the two stay side by side. Only ``@triton.jit`` code lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kernel_common import grouped_pid


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

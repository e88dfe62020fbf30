"""Triton kernel of one forward's capture and replay bookkeeping (``replaymoe.hf``), in one launch.

One program per batch row ``b``. From the row's 2-D attention mask ``[P]`` (nonzero = kept) it
derives the position of each of the forward's ``S`` tokens (the last ``S`` columns): the number of
kept columns up to and including it, plus ``pos_shift``; -1 for padding. Then, per token
``t = b * S + j``:

* ``CAPTURE``: the capture-buffer row ``b * S_cap + pos`` (padding and positions ``>= S_cap``: the
  dump row; the latter also set ``overflow``);
* ``REPLAY``: the replay-table row ``pos + shift[b]`` when ``offsets[b] <= pos < ends[b]`` (else the
  table's last row, all -1), copied for every layer into ``forced [L, T, K]``; per layer, the
  non-padding tokens are added to ``seen`` and those whose row is -1 to ``fallback`` (integer
  atomics: the sums do not depend on the order); of those, the ones that coverage does not excuse
  (every position but ``ends[b]``, the row's last sampled token) to ``uncovered[layer]``, and the
  smallest of their keys ``layer << 48 | b << 28 | pos`` to ``uncovered[L]`` (an atomic minimum:
  ``ReplayTable.count_uncovered`` is the reference).

``PENDING`` (capture): the previous forward's deferred commit rides along. Its staged router ids
``[L, Tp, K]`` are written to the capture buffer ``ids [L, R, K]`` at its slots ``[Tp]``, the
programs striding over its ``Tp`` tokens. That is what ``CaptureBuffer.commit``'s ``index_copy_``
would do, with one launch fewer per forward. The writes touch no memory this launch reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Only the argument types and the constexprs pick the compiled variant (no specialization on integer
# values or pointer alignment), so that ``hf.step.step_rows`` launches it without Triton's binder
# (``FastLaunch.launch_fixed``).
_INTS = "stride_mb P S pos_shift seq_cap dump stride_tl last_row stride_fl L Tp stride_il".split()
_POINTERS = (
    "mask_ptr slot_ptr overflow_ptr table_ptr offsets_ptr ends_ptr shift_ptr forced_ptr seen_ptr "
    "fallback_ptr uncovered_ptr pend_staged_ptr pend_slot_ptr ids_ptr next_pos_ptr"
).split()


@triton.jit
def _copy_layers(src, out, mask, L, stride_src, stride_out):
    """The pending commit: ``out[layer] = src[layer]`` (masked) for every layer; the pointers advance by
    a layer's stride (no int32 product overflows)."""
    for _ in range(L):
        tl.store(out, tl.load(src, mask=mask), mask=mask)
        src += stride_src
        out += stride_out


@triton.jit
def _replay_window(offsets_ptr, ends_ptr, shift_ptr, b, REPLAY: tl.constexpr):
    """Row ``b``'s replay window ``[first, end)`` and table shift (zeros without ``REPLAY``)."""
    first = tl.zeros([], dtype=tl.int64)
    end = tl.zeros([], dtype=tl.int64)
    shift = tl.zeros([], dtype=tl.int64)
    if REPLAY:
        first = tl.load(offsets_ptr + b)
        end = tl.load(ends_ptr + b)
        shift = tl.load(shift_ptr + b)
    return first, end, shift


@triton.jit
def _token_rows(pos, real, in_s, t, kc, row_base, slot_ptr, seq_cap, dump, overflow_ptr, table_ptr, stride_tl,
                last_row, first, end, shift, forced_ptr, stride_fl, seen_ptr, fallback_ptr, uncovered_ptr, b,
                L, K: tl.constexpr, CAPTURE: tl.constexpr, REPLAY: tl.constexpr):  # fmt: skip
    """Tokens ``t`` (int64; ``in_s``: valid) of one batch row at positions ``pos`` (-1: padding;
    ``real``: not padding): capture rows ``row_base + pos`` into ``slot_ptr`` (the dump row outside
    the capacity, which also sets ``overflow``), replay ids into ``forced_ptr`` and the per-layer
    ``seen`` / ``fallback`` counters."""
    if CAPTURE:
        inside = (pos >= 0) & (pos < seq_cap)
        tl.store(slot_ptr + t, tl.where(inside, pos + row_base, dump), mask=in_s)
        over = tl.max((real & (pos >= seq_cap)).to(tl.int32), axis=0)
        if over > 0:
            tl.store(overflow_ptr, over.to(tl.int8))
    if REPLAY:
        hit = (pos >= first) & (pos < end)
        src = tl.where(hit, pos + shift, last_row)
        n_real = tl.sum(real.to(tl.int64), axis=0)
        io = in_s[:, None] & (kc[None, :] < K)
        for layer in range(L):
            ids = tl.load(table_ptr + layer * stride_tl + src[:, None] * K + kc[None, :], mask=io, other=0)
            tl.store(forced_ptr + layer * stride_fl + t[:, None] * K + kc[None, :], ids, mask=io)
            first_id = tl.sum(tl.where(kc[None, :] == 0, ids, 0), axis=1)
            fell_back = tl.sum((real & (first_id < 0)).to(tl.int64), axis=0)
            tl.atomic_add(seen_ptr + layer, n_real)
            tl.atomic_add(fallback_ptr + layer, fell_back)
            bad = real & (first_id < 0) & (pos != end)
            n_bad = tl.sum(bad.to(tl.int64), axis=0)
            if n_bad > 0:
                tl.atomic_add(uncovered_ptr + layer, n_bad)
                key = (tl.full([], layer, tl.int64) << 48) | (b.to(tl.int64) << 28) | pos
                tl.atomic_min(uncovered_ptr + L, tl.min(tl.where(bad, key, 9223372036854775807), axis=0))


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def step_rows_kernel(
    mask_ptr,  # [B, P] attention mask, unit column stride
    stride_mb,
    P,
    S,
    pos_shift,  # position = kept columns up to and including the token + pos_shift
    slot_ptr,  # int64 [B*S] out (CAPTURE)
    seq_cap,
    dump,
    overflow_ptr,  # int8 [1] (CAPTURE)
    table_ptr,  # int32 [L, R, K] (REPLAY)
    stride_tl,
    last_row,
    offsets_ptr,  # int64 [B] (REPLAY)
    ends_ptr,
    shift_ptr,
    forced_ptr,  # int32 [L, B*S, K] out (REPLAY), contiguous
    stride_fl,
    seen_ptr,  # int64 [L] (REPLAY)
    fallback_ptr,
    uncovered_ptr,  # int64 [L + 1] (REPLAY): per-layer counts, then the smallest key
    L,
    pend_staged_ptr,  # int16 [L, Tp, K] contiguous (PENDING)
    pend_slot_ptr,  # int64 [Tp] (PENDING)
    Tp,
    ids_ptr,  # int16 [L, R, K] capture buffer, contiguous (PENDING)
    stride_il,
    K: tl.constexpr,
    KP: tl.constexpr,
    CAPTURE: tl.constexpr,
    REPLAY: tl.constexpr,
    BLOCK: tl.constexpr,
    PENDING: tl.constexpr = False,
    next_pos_ptr=None,  # int64 [B] out (NEXT_POS)
    NEXT_POS: tl.constexpr = False,
):
    b = tl.program_id(0)
    kc = tl.arange(0, KP)
    if PENDING:
        for p0 in range(b * BLOCK, Tp, tl.num_programs(0) * BLOCK):
            tp = p0 + tl.arange(0, BLOCK)
            tp_ok = tp < Tp
            dst = tl.load(pend_slot_ptr + tp, mask=tp_ok, other=0)
            io_p = tp_ok[:, None] & (kc[None, :] < K)
            src = pend_staged_ptr + tp.to(tl.int64)[:, None] * K + kc[None, :]
            out = ids_ptr + dst[:, None] * K + kc[None, :]
            _copy_layers(src, out, io_p, L, Tp * K, stride_il)
    row = mask_ptr + b.to(tl.int64) * stride_mb
    lead = P - S
    kept = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, lead, BLOCK):  # the columns before the forward's tokens: only counted
        cols = start + tl.arange(0, BLOCK)
        m = tl.load(row + cols, mask=cols < lead, other=0)
        kept += (m != 0).to(tl.int64)
    carry = tl.sum(kept, axis=0)
    first, end, shift = _replay_window(offsets_ptr, ends_ptr, shift_ptr, b, REPLAY)
    for s0 in range(0, S, BLOCK):
        j = s0 + tl.arange(0, BLOCK)
        in_s = j < S
        m = tl.load(row + lead + j, mask=in_s, other=0) != 0
        real = m & in_s
        pos = tl.cumsum(real.to(tl.int64), axis=0) + carry
        carry += tl.sum(real.to(tl.int64), axis=0)
        pos = tl.where(real, pos - 1 + pos_shift, -1)
        t = b.to(tl.int64) * S + j
        _token_rows(pos, real, in_s, t, kc, b.to(tl.int64) * seq_cap, slot_ptr, seq_cap, dump, overflow_ptr,
                    table_ptr, stride_tl, last_row, first, end, shift, forced_ptr, stride_fl, seen_ptr,
                    fallback_ptr, uncovered_ptr, b, L, K, CAPTURE, REPLAY)  # fmt: skip
    if NEXT_POS:  # the position the row's next token gets (a decode step that only appends a kept column)
        tl.store(next_pos_ptr + b, carry + pos_shift)


_DECODE_INTS = "seq_cap dump stride_tl last_row stride_fl L stride_il".split()
_DECODE_POINTERS = (
    "next_pos_ptr slot_ptr overflow_ptr table_ptr offsets_ptr ends_ptr shift_ptr forced_ptr seen_ptr "
    "fallback_ptr uncovered_ptr pend_staged_ptr ids_ptr"
).split()


@triton.jit(do_not_specialize=_DECODE_INTS, do_not_specialize_on_alignment=_DECODE_POINTERS)
def decode_rows_kernel(
    next_pos_ptr,  # int64 [B] in/out: the position of each row's next token
    slot_ptr,  # int64 [B] in (PENDING: the previous step's rows) / out (CAPTURE)
    seq_cap,
    dump,
    overflow_ptr,  # int8 [1] (CAPTURE)
    table_ptr,  # int32 [L, R, K] (REPLAY)
    stride_tl,
    last_row,
    offsets_ptr,  # int64 [B] (REPLAY)
    ends_ptr,
    shift_ptr,
    forced_ptr,  # int32 [L, B, K] out (REPLAY), contiguous
    stride_fl,
    seen_ptr,  # int64 [L] (REPLAY)
    fallback_ptr,
    uncovered_ptr,  # int64 [L + 1] (REPLAY)
    L,
    pend_staged_ptr,  # int16 [L, B, K] contiguous: the previous step's staged ids (PENDING)
    ids_ptr,  # int16 [L, R, K] capture buffer, contiguous (PENDING)
    stride_il,
    K: tl.constexpr,
    KP: tl.constexpr,
    CAPTURE: tl.constexpr,
    REPLAY: tl.constexpr,
    PENDING: tl.constexpr,
):
    """``step_rows`` for a decode step whose every row appends one kept token (one program per row):
    the position is ``next_pos[b]``, which advances by one, so the attention mask is not read. With
    ``PENDING`` the previous decode step's deferred commit (its staged ids at the rows still in
    ``slot``) is written first, each program its own row's, before the row's new slot overwrites it.
    All addresses are fixed across steps, so it can be part of a CUDA graph."""
    b = tl.program_id(0)
    B = tl.num_programs(0)
    kc = tl.arange(0, KP)
    if PENDING:
        dst = tl.load(slot_ptr + b)
        io = kc < K
        src = pend_staged_ptr + b.to(tl.int64) * K + kc
        out = ids_ptr + dst * K + kc
        _copy_layers(src, out, io, L, B * K, stride_il)
    p = tl.load(next_pos_ptr + b)
    tl.store(next_pos_ptr + b, p + 1)
    j = tl.arange(0, 2)  # one token per row (a 2-lane vector, lane 1 masked off)
    in_s = j < 1
    pos = tl.where(in_s, p, -1)
    first, end, shift = _replay_window(offsets_ptr, ends_ptr, shift_ptr, b, REPLAY)
    _token_rows(pos, in_s, in_s, b.to(tl.int64) + j, kc, b.to(tl.int64) * seq_cap, slot_ptr, seq_cap, dump,
                overflow_ptr, table_ptr, stride_tl, last_row, first, end, shift, forced_ptr, stride_fl,
                seen_ptr, fallback_ptr, uncovered_ptr, b, L, K, CAPTURE, REPLAY)  # fmt: skip

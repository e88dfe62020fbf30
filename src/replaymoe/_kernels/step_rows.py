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
  atomics: the sums do not depend on the order).

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
    "fallback_ptr pend_staged_ptr pend_slot_ptr ids_ptr"
).split()


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
            for _ in range(L):  # pointers advance by a layer's stride (no int32 product overflows)
                tl.store(out, tl.load(src, mask=io_p), mask=io_p)
                src += Tp * K
                out += stride_il
    row = mask_ptr + b.to(tl.int64) * stride_mb
    lead = P - S
    kept = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, lead, BLOCK):  # the columns before the forward's tokens: only counted
        cols = start + tl.arange(0, BLOCK)
        m = tl.load(row + cols, mask=cols < lead, other=0)
        kept += (m != 0).to(tl.int64)
    carry = tl.sum(kept, axis=0)
    if REPLAY:
        first = tl.load(offsets_ptr + b)
        end = tl.load(ends_ptr + b)
        shift = tl.load(shift_ptr + b)
    for s0 in range(0, S, BLOCK):
        j = s0 + tl.arange(0, BLOCK)
        in_s = j < S
        m = tl.load(row + lead + j, mask=in_s, other=0) != 0
        real = m & in_s
        pos = tl.cumsum(real.to(tl.int64), axis=0) + carry
        carry += tl.sum(real.to(tl.int64), axis=0)
        pos = tl.where(real, pos - 1 + pos_shift, -1)
        t = b.to(tl.int64) * S + j
        if CAPTURE:
            inside = (pos >= 0) & (pos < seq_cap)
            tl.store(slot_ptr + t, tl.where(inside, pos + b.to(tl.int64) * seq_cap, dump), mask=in_s)
            over = tl.max((real & (pos >= seq_cap)).to(tl.int32), axis=0)
            if over > 0:
                tl.store(overflow_ptr, over.to(tl.int8))
        if REPLAY:
            hit = (pos >= first) & (pos < end)
            src = tl.where(hit, pos + shift, last_row)
            n_real = tl.sum(real.to(tl.int64), axis=0)
            io = in_s[:, None] & (kc[None, :] < K)
            for layer in range(L):
                ids = tl.load(
                    table_ptr + layer * stride_tl + src[:, None] * K + kc[None, :], mask=io, other=0
                )
                tl.store(forced_ptr + layer * stride_fl + t[:, None] * K + kc[None, :], ids, mask=io)
                first_id = tl.sum(tl.where(kc[None, :] == 0, ids, 0), axis=1)
                fell_back = tl.sum((real & (first_id < 0)).to(tl.int64), axis=0)
                tl.atomic_add(seen_ptr + layer, n_real)
                tl.atomic_add(fallback_ptr + layer, fell_back)

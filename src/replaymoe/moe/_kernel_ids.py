"""Triton side of the caller-id check: a kernel that reads ``topk_ids`` checks them as it goes.

``fused_moe``'s caller-given ids are checked on the device by a kernel that reads them anyway (the
layout's scatter in tile mode, GEMM1's first program in direct mode), so the check costs no launch
and no host synchronization. A bad slot (an id outside ``[-1, id_bound)``, or an id other than -1
that an earlier slot of its row holds) writes one word into the error mailbox
(:mod:`replaymoe.moe._id_mailbox`), which lives in pinned host memory and which the host reads
without a copy. The word packs the first bad slot of the program's block:

* bit 62: set (a word of 0 means no error);
* bits 40-61: the token row (clamped to ``2**22 - 1``);
* bit 39: 0 out of range, 1 a duplicate within its row;
* bits 32-38: the slot within its row (``k < 128``);
* bits 0-31: the id, clamped to int32 and offset by ``2**31``.

The word next to it receives ``id_bound``. Several programs may write: one of their words lands (each
a single aligned 64-bit store), naming a real bad slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the word's fields (constexpr: the kernels read them; the host decodes with their ``.value``)
ROW_SHIFT = tl.constexpr(40)
KIND_SHIFT = tl.constexpr(39)
SLOT_SHIFT = tl.constexpr(32)
PRESENT = tl.constexpr(1 << 62)
MAX_ROW = tl.constexpr((1 << 22) - 1)


@triton.jit
def check_id_block(ids_ptr, offs, num_slots, TOP_K, id_bound, err_ptr):
    """Check the slots ``offs`` [B] (``< num_slots`` real) of ``ids`` [T, TOP_K] (row-major): write
    the mailbox word of the first bad one to ``err_ptr[0]`` and ``id_bound`` to ``err_ptr[1]``."""
    real = offs < num_slots
    e = tl.load(ids_ptr + offs, mask=real, other=-1).to(tl.int64)
    out = real & ((e < -1) | (e >= id_bound))
    k = offs % TOP_K
    dup = tl.zeros(offs.shape, dtype=tl.int1)
    for j in range(1, TOP_K):
        earlier = real & (k >= j)
        prev = tl.load(ids_ptr + offs - j, mask=earlier, other=-1).to(tl.int64)
        dup = dup | (earlier & (prev == e) & (e != -1))
    bad = out | dup
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        row = tl.minimum(offs // TOP_K, MAX_ROW).to(tl.int64)
        val = tl.minimum(tl.maximum(e, -2147483648), 2147483647) + 2147483648
        kind = tl.where(out, 0, 1).to(tl.int64)
        word = PRESENT | (row << ROW_SHIFT) | (kind << KIND_SHIFT) | (k.to(tl.int64) << SLOT_SHIFT) | val
        first = tl.min(tl.where(bad, word, 9223372036854775807), axis=0)
        tl.store(err_ptr + 1, id_bound.to(tl.int64))
        tl.store(err_ptr, first)


@triton.jit
def check_all_ids(ids_ptr, num_slots, TOP_K, id_bound, err_ptr, B: tl.constexpr = 128):
    """:func:`check_id_block` over every slot, ``B`` at a time (one program: direct mode's few slots)."""
    for start in range(0, num_slots, B):
        check_id_block(ids_ptr, start + tl.arange(0, B), num_slots, TOP_K, id_bound, err_ptr)

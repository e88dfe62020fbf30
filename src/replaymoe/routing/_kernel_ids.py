"""Triton side of the device-side id checks: a kernel that reads caller ids checks them as it goes.

Two callers, one mailbox (:mod:`replaymoe.routing._id_mailbox`):

* ``fused_moe``'s caller-given ``topk_ids`` (:func:`check_id_block`, :func:`check_all_ids`): checked by
  the kernel that reads them first (the layout's scatter in tile mode, GEMM1's program 0 in direct
  mode). Rule: each id in ``[-1, bound)``, no id other than -1 twice in a row.
* ``route``'s ``replay_ids`` (:func:`check_replay_tile`): checked by the routing kernel on the tile it
  loads anyway. Rule: each row all -1 (routed natively) or ``K`` distinct ids in ``[0, bound)``.
  Its ``replay_weights`` (full recall, :func:`check_weights_tile`), on the tile of weights it loads:
  finite (and >= 0 where the method's weights are) in every replayed row.

No launch and no host synchronization: a bad slot writes one word into the mailbox, which lives in
pinned host memory and which the host reads without a copy. The word packs the first bad slot of the
program's block:

* bit 62: set (a word of 0 means no error);
* bits 41-61: the token row (clamped to ``2**21 - 1``);
* bit 40: the argument, 0 ``topk_ids``, 1 ``replay_ids`` (or ``replay_weights``, rule 3);
* bits 38-39: the rule broken, 0 out of range, 1 a duplicate within its row, 2 a -1 in a row of ids,
  3 a replayed weight not finite (or negative);
* bits 32-37: the slot within its row (clamped to 63);
* bits 0-31: the id, clamped to int32 and offset by ``2**31`` (rule 3: the weight's float32 bits).

The word next to it receives the bound (rule 3: 1 when the weights must be >= 0, else 0). Several
programs may write: one of their words lands (each a single aligned 64-bit store), naming a real bad
slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the word's fields (constexpr: the kernels read them; the host decodes with their ``.value``)
ROW_SHIFT = tl.constexpr(41)
ARG_SHIFT = tl.constexpr(40)
KIND_SHIFT = tl.constexpr(38)
SLOT_SHIFT = tl.constexpr(32)
PRESENT = tl.constexpr(1 << 62)
MAX_ROW = tl.constexpr((1 << 21) - 1)
MAX_SLOT = tl.constexpr(63)
_HEADS = ((1 << 62), (1 << 62) | (1 << 40))  # PRESENT, and the replay_ids bit (ARG = 0, 1)
_HEAD_TOPK = tl.constexpr(_HEADS[0])
_HEAD_REPLAY = tl.constexpr(_HEADS[1])
_NONE = tl.constexpr(9223372036854775807)  # larger than any word: "no bad slot" in the min


@triton.jit
def _word(row, slot, value, kind, ARG: tl.constexpr):
    """The mailbox word of a bad slot (any broadcastable shapes; int64)."""
    row = tl.minimum(row.to(tl.int64), MAX_ROW)
    slot = tl.minimum(slot.to(tl.int64), MAX_SLOT)
    val = tl.minimum(tl.maximum(value, -2147483648), 2147483647) + 2147483648
    head = _HEAD_REPLAY if ARG else _HEAD_TOPK
    return head | (row << ROW_SHIFT) | (kind.to(tl.int64) << KIND_SHIFT) | (slot << SLOT_SHIFT) | val


@triton.jit
def _post(first, bound, err_addr):
    """Write ``first`` (a word, or ``_NONE``) and the bound into the mailbox when a slot was bad.

    ``err_addr``: the mailbox's address as an integer (:func:`~replaymoe.routing._id_mailbox.mailbox_for`:
    an int argument costs the launcher less than a tensor's, on every checked call)."""
    if first != _NONE:
        box = err_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
        tl.store(box + 1, bound)
        tl.store(box, first)


@triton.jit
def check_id_block(ids_ptr, offs, num_slots, TOP_K, id_bound, err_addr):
    """``topk_ids``: check the slots ``offs`` [B] (``< num_slots`` real) of ``ids`` [T, TOP_K]
    (row-major): each id in ``[-1, id_bound)``, no id but -1 twice in a row."""
    real = offs < num_slots
    e = tl.load(ids_ptr + offs, mask=real, other=-1).to(tl.int64)
    out = real & ((e < -1) | (e >= id_bound))
    k = offs % TOP_K
    dup = tl.zeros(offs.shape, dtype=tl.int1)
    for j in range(1, TOP_K):
        earlier = real & (k >= j)
        prev = tl.load(ids_ptr + offs - j, mask=earlier, other=-1).to(tl.int64)
        dup = dup | (earlier & (prev == e) & (e != -1))
    word = _word(offs // TOP_K, k, e, tl.where(out, 0, 1), 0)
    _post(tl.min(tl.where(out | dup, word, _NONE), axis=0), id_bound, err_addr)


@triton.jit
def check_all_ids(ids_ptr, num_slots, TOP_K, id_bound, err_addr, B: tl.constexpr = 128):
    """:func:`check_id_block` over every slot, ``B`` at a time (one program: direct mode's few slots)."""
    for start in range(0, num_slots, B):
        check_id_block(ids_ptr, start + tl.arange(0, B), num_slots, TOP_K, id_bound, err_addr)


@triton.jit
def check_replay_tile(forced, rows, cols, omask, K: tl.constexpr, num_experts, err_addr):
    """``replay_ids``: check the routing kernel's tile ``forced`` [BLOCK_T, KP] (int64; -1 where
    ``omask`` is off) of rows ``rows`` [BLOCK_T] and columns ``cols`` [1, KP]: each row all -1, or ``K``
    distinct ids in ``[0, num_experts)``."""
    neg = omask & (forced == -1)
    n_neg = tl.sum(neg.to(tl.int32), axis=1)
    n_real = tl.sum(omask.to(tl.int32), axis=1)
    mixed = neg & (n_neg != n_real)[:, None]  # the -1 slots of a row that holds ids
    out = omask & ((forced < -1) | (forced >= num_experts))
    dup = tl.zeros(forced.shape, dtype=tl.int1)
    for j in tl.static_range(K - 1):
        fj = tl.sum(tl.where(cols == j, forced, 0), axis=1)  # column j
        dup = dup | (omask & (cols > j) & (forced == fj[:, None]) & (forced != -1))
    kind = tl.where(out, 0, tl.where(dup, 1, 2))
    word = _word(rows[:, None], cols, forced, kind, 1)
    first = tl.min(tl.min(tl.where(out | dup | mixed, word, _NONE), axis=1), axis=0)
    _post(first, num_experts, err_addr)


@triton.jit
def check_weights_tile(rw, replayed, rows, cols, omask, NONNEG: tl.constexpr, err_addr):
    """``replay_weights``: check the routing kernel's tile ``rw`` [BLOCK_T, KP] (float32) of rows
    ``rows`` [BLOCK_T] (``replayed``: the rows whose ids are replayed; the others route natively and
    their weights are not read) and columns ``cols`` [1, KP]: finite, and with ``NONNEG`` >= 0."""
    ok = (rw == rw) & (tl.abs(rw) < float("inf"))
    if NONNEG:
        ok = ok & (rw >= 0)
    bad = omask & replayed[:, None] & (ok == 0)
    bits = rw.to(tl.int32, bitcast=True).to(tl.int64)
    word = _word(rows[:, None], cols, bits, tl.full(rw.shape, 3, tl.int32), 1)
    first = tl.min(tl.min(tl.where(bad, word, _NONE), axis=1), axis=0)
    _post(first, 1 if NONNEG else 0, err_addr)

"""Host side of the device-side id checks: the error mailbox and the error it raises.

On CUDA, ``fused_moe``'s caller-given ``topk_ids`` and ``route``'s ``replay_ids`` are checked inside a
kernel that reads them anyway (:mod:`replaymoe.routing._kernel_ids`): no extra launch, no host
synchronization, in eager mode, under ``torch.compile`` and inside CUDA graphs alike. A bad slot writes
one packed word into this module's mailbox: two int64 words per device in pinned host memory, which the
kernels write through its device mapping (its address passed as an integer) and the host reads in place
(a numpy view: no copy, no sync).

The error therefore comes one call late: the host reads the mailbox when the next checked call on that
device starts (``fused_moe`` with caller ids, ``route`` with replay ids), and raises there, once the
device has run the bad call; :func:`raise_id_errors` waits for the device and raises at once (tests, the
end of a step). A CUDA graph's replays write the mailbox too; nothing is raised while a graph is being
captured.
"""

from __future__ import annotations

import numpy as np
import torch

from .._validation import fail, is_capturing
from ._kernel_ids import ARG_SHIFT, KIND_SHIFT, PRESENT, ROW_SHIFT, SLOT_SHIFT

__all__ = ["mailbox", "mailbox_for", "raise_pending", "raise_id_errors"]

_MAX_DEVICES = 64
_box: torch.Tensor | None = None  # int64 [2 * _MAX_DEVICES]: per device (word, id bound)
_words: np.ndarray | None = None  # the same memory, as the host reads it
_slots: list[torch.Tensor] = []  # per device, the [2] view a kernel writes


def mailbox(index: int) -> torch.Tensor:
    """Device ``index``'s two mailbox words, int64 [2] in pinned host memory (the kernels' ``err_addr``).

    Allocated at the first call (pinned where CUDA is present; on a CPU-only machine plain memory, for
    Triton's interpreter); the same tensors afterwards, so a CUDA graph may keep their address.
    """
    global _box, _words
    if _box is None:
        box = torch.zeros(2 * _MAX_DEVICES, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        _slots.extend(box[2 * i : 2 * i + 2] for i in range(_MAX_DEVICES))
        _words, _box = box.numpy(), box
    if not 0 <= index < _MAX_DEVICES:
        raise RuntimeError(f"fused_moe's id check supports device indices below {_MAX_DEVICES}, got {index}")
    return _slots[index]


def mailbox_for(ids: torch.Tensor) -> int:
    """The address of the mailbox words a checking launch on ``ids``' device writes (:func:`mailbox`;
    the kernels' ``err_addr``), after raising the error an earlier call left there
    (:func:`raise_pending`). CPU tensors (Triton's interpreter) use index 0's words and raise nothing
    here."""
    index = ids.get_device()  # -1 on the CPU
    if index >= 0:
        raise_pending(index)
    return mailbox(max(index, 0)).data_ptr()


def raise_pending(index: int) -> None:
    """Raise the id error that an earlier call on device ``index`` left in the mailbox, if any (a read of
    host memory: no copy, no sync). Nothing while a CUDA graph is being captured."""
    if _words is not None and _words[2 * index] and not is_capturing():
        _raise(index, synced=False)


def raise_id_errors(device: torch.device | str | int | None = None) -> None:
    """Wait for ``device`` (default: the current CUDA device) and raise the id error of any call that
    ran there with bad caller ids (``fused_moe``'s ``topk_ids``, ``route``'s ``replay_ids``); a no-op
    without CUDA.

    On CUDA those ids are checked on the device, without a host sync, and the error comes at the next
    checked call on the same device; call this where it must surface at once (after the last call of
    a step, in tests).

    Raises
    ------
    ValueError
        Naming the argument, the rule broken, the row, the slot and the id.
    """
    if not torch.cuda.is_available() or _words is None:
        return
    if isinstance(device, int):
        index = device
    else:
        d = torch.device("cuda") if device is None else torch.device(device)
        if d.type != "cuda":
            fail("device", "a CUDA device", str(d))
        index = torch.cuda.current_device() if d.index is None else d.index
    torch.cuda.synchronize(index)
    if _words[2 * index]:
        _raise(index, synced=True)


def _raise(index: int, synced: bool) -> None:
    assert _words is not None
    if not synced:  # both words have landed once the device has run the writer
        torch.cuda.synchronize(index)
    word, bound = int(_words[2 * index]), int(_words[2 * index + 1])
    _words[2 * index : 2 * index + 2] = 0
    row = (word & ~PRESENT.value) >> ROW_SHIFT.value
    replay = (word >> ARG_SHIFT.value) & 1
    kind = (word >> KIND_SHIFT.value) & 3
    slot = (word >> SLOT_SHIFT.value) & 0x3F
    value = (word & 0xFFFFFFFF) - (1 << 31)
    if kind == 3:  # a replayed weight (full recall); the bound word says whether >= 0 was required
        weight = float(np.array([value], dtype=np.int32).view(np.float32)[0])
        rule = "finite weights >= 0" if bound else "finite weights"
        fail(
            "replay_weights",
            f"{rule} in every replayed row (rows of all -1 ids excepted)",
            f"{weight} at row {row}, slot {slot} of an earlier route call on cuda:{index} (checked on the "
            "device without a host sync: the error comes at the next checked call, or at "
            "replaymoe.routing.raise_id_errors())",
        )
    name = "replay_ids" if replay else "topk_ids"
    where = (
        f"row {row}, slot {slot} of an earlier {'route' if replay else 'fused_moe'} call on cuda:{index} "
        f"({name} is checked on the device without a host sync: the error comes at the next checked call, "
        "or at replaymoe.moe.raise_id_errors())"
    )
    if kind == 1:
        fail(name, "distinct expert ids within each row (-1 aside)", f"id {value} again at {where}")
    if kind == 2:
        fail(name, "each row either all -1 (route natively) or all valid ids", f"-1 at {where}")
    # the word holds the id clamped to int32
    shown = f">= {value}" if value == 2**31 - 1 else f"<= {value}" if value == -(2**31) else str(value)
    spare = "or a row of all -1" if replay else "or -1: a slot with no expert"
    fail(name, f"expert ids in [0, {bound}) ({spare})", f"{shown} at {where}")

"""The capture side of a :class:`~replaymoe.hf.session.ReplayMoE` session: the device buffer
(:class:`~replaymoe.hf.state.CaptureBuffer`), whether forwards capture, and the traces read from the
buffer that :meth:`~replaymoe.hf.session.ReplayMoE.traces` has not returned yet.

Its methods that may warn take ``stacklevel``: the level ``warnings.warn`` would be given in the
method itself, so that a warning points at the user's call whatever the chain of calls in between.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from replaymoe._validation import check_int, fail

from .state import CaptureBuffer, TraceMeta

__all__ = ["CaptureState"]


class CaptureState:
    """What one session captures and has captured.

    Attributes
    ----------
    buffer : CaptureBuffer or None
        The device buffer, allocated by ``set_capture(True)`` (or a rollout-mode ``generate``).
    on : bool
        Forwards capture now (rollout mode turns it on inside ``generate``).
    user_on : bool
        Capture as ``set_capture`` left it.
    begin_pending : bool
        ``generate`` was called: its first forward starts a batch.
    user_weights : bool
        ``set_capture(True, weights=True)``: traces carry the combine weights (full recall).
    finished : list[RoutingTrace]
        Harvested from the buffer but not yet returned by ``traces()``.
    """

    def __init__(self, meta: TraceMeta, capacity: tuple[int, int]) -> None:
        self.meta, self.capacity = meta, capacity
        self.buffer: Optional[CaptureBuffer] = None
        self.on = False
        self.user_on = False
        self.begin_pending = False
        self.user_weights = False
        self.finished: list = []

    def allocate(self, device: torch.device, weights: bool | None = None) -> None:
        """A new buffer on ``device``, of ``enable``'s initial capacity; ``weights``: it records the
        combine weights too (None: as the current buffer does, else as ``set_capture`` asked)."""
        if weights is None:
            weights = self.buffer.with_weights if self.buffer is not None else self.user_weights
        self.buffer = CaptureBuffer(self.meta, device, *self.capacity, with_weights=weights)

    def ensure_weights(self, device: torch.device, stacklevel: int) -> None:
        """A buffer that records weights (full recall): the current one, or a new one once the
        current one's sequences are harvested."""
        if self.buffer is not None and self.buffer.with_weights:
            return
        if self.buffer is not None:
            self.harvest(stacklevel + 1)
        self.allocate(device, weights=True)

    def harvest(self, stacklevel: int) -> None:
        """Move the buffer's sequences to :attr:`finished`; warn when batches were overwritten."""
        traces, lost = self.buffer.harvest()
        self.finished.extend(traces)
        if lost:
            warnings.warn(
                f"replaymoe: {lost} captured batch(es) were overwritten before traces() was called "
                "(batches begun inside a compiled forward cannot be kept on the host side); call "
                "traces() after each compiled forward or generate",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def set(self, enabled: bool, device: torch.device, stacklevel: int, weights: bool = False) -> None:
        """``set_capture(enabled, weights=)`` once checked: ``device`` is where a new buffer goes."""
        if enabled:
            self.user_weights = weights
        if enabled and weights:
            self.ensure_weights(device, stacklevel + 1)
        elif enabled and (self.buffer is None or self.buffer.with_weights):  # (weights off: none kept)
            if self.buffer is not None:
                self.harvest(stacklevel + 1)
            self.allocate(device, weights=False)
        if not enabled and self.buffer is not None:
            self.harvest(stacklevel + 1)
        self.on = self.user_on = enabled

    def take(self, num_positions: Sequence[int] | None, stacklevel: int) -> list:
        """The traces captured since the last call, each cut to (or padded with -1 to)
        ``num_positions`` when given (``traces()``)."""
        if self.buffer is not None:
            self.harvest(stacklevel + 1)
        if num_positions is not None:  # checked whole before the traces are handed out: a bad call loses none
            if isinstance(num_positions, (str, bytes)) or not hasattr(num_positions, "__len__"):
                fail("num_positions", "a sequence of ints (one length per trace)",
                     type(num_positions).__name__, what="type")  # fmt: skip
            lengths = list(num_positions)
            for n in lengths:
                check_int("num_positions", n, low=0)
            if len(lengths) != len(self.finished):
                fail("num_positions", f"{len(self.finished)} lengths (one per trace)", len(lengths))
        out, self.finished = self.finished, []
        if num_positions is None:
            return out
        cut = []
        for trace, n in zip(out, lengths):
            n = int(n)
            ids = trace.ids[:n]
            if ids.shape[0] < n:
                pad = np.full((n - ids.shape[0], *ids.shape[1:]), -1, dtype=ids.dtype)
                ids = np.concatenate([ids, pad])
            cut.append(trace.replace(ids=ids))  # (token ids and weights follow the cut)
        return cut

    def drop_unread(self, stacklevel: int) -> None:
        """``disable()``: the buffer's last sequences are read, and any trace ``traces()`` never
        returned is dropped with a warning."""
        unread = ""
        try:
            if self.buffer is not None and self.buffer.device.type != "meta":
                self.harvest(stacklevel + 1)
        except ValueError as exc:  # (e.g. an overflowed compiled capture): the patch goes all the same
            unread = f"; the capture buffer could not be read: {exc}"
        if self.finished or unread:
            warnings.warn(
                f"replaymoe: disable() drops {len(self.finished)} captured trace(s) that traces() "
                f"never returned{unread}; call traces() first to keep them",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            self.finished = []

"""Device-side capture buffers and replay tables of a patched transformers model.

Both are indexed by what a forward already holds on the device: the batch row and the token's
position in its sequence (:func:`replaymoe.hf.positions.token_positions`). A forward only runs
device indexing ops on them (no host sync, fixed shapes), so the same code runs eagerly, under
``torch.compile(fullgraph=True)`` and inside CUDA graphs. Host work (one
:class:`~replaymoe.record.trace.RoutingTrace` per sequence) happens once, in :meth:`CaptureBuffer.harvest`.

The capture buffer and the replay table are one contract (the rows a forward writes are the rows a
replay reads, the tokens capture records are what content matching hashes); the replay table itself
lives in :mod:`replaymoe.record.replay`, where ``ReplaySource`` shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replaymoe._validation import fail
from replaymoe.record.replay import ReplayTable, prefix_hashes, prefix_hashes_np
from replaymoe.record.trace import RoutingTrace

from .._launch import next_power_of_2

# ReplayTable and the prefix hashes live in replaymoe.record.replay (one replay table: ReplaySource uses it
# too); they stay importable from here
__all__ = ["CaptureBuffer", "ReplayTable", "TraceMeta", "prefix_hashes", "prefix_hashes_np"]


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a long-lived buffer as a static input of compiled graphs (no copy into CUDA graphs), as
    :class:`ReplayTable` marks its own."""
    torch._dynamo.mark_static_address(t)
    return t


@dataclass(frozen=True)
class TraceMeta:
    """What every trace of one model shares: ``L`` MoE layers of top-``K`` over ``E`` experts."""

    num_layers: int
    top_k: int
    num_experts: int
    layer_ids: tuple[int, ...]
    model_id: str


@dataclass
class _Snapshot:
    """One finished batch, still on the device: ``ids [L, rows*S + 1, K]``."""

    ids: torch.Tensor
    rows: int
    seq_cap: int
    tokens: torch.Tensor  # int64 [rows*S + 1]
    weights: torch.Tensor | None = None  # float32 [L, rows*S + 1, K] (full recall), or None


class CaptureBuffer:
    """Routing capture for one batch of sequences at a time, on the device.

    Attributes
    ----------
    ids : torch.Tensor int16 [L, B_cap * S_cap + 1, K]
        Row ``b * S_cap + p`` holds position ``p`` of batch row ``b``; -1 = not recorded (every
        batch start clears it). The last row is a dump that padding tokens and tokens outside the
        capacity write to. A sequence's length is 1 + its last recorded position.
    tokens : torch.Tensor int64 [B_cap * S_cap + 1]
        The token fed at each row of :attr:`ids` (-1 = not recorded): traces carry them, so that
        replay can match rows by content.
    weights : torch.Tensor float32 [L, B_cap * S_cap + 1, K] or None
        (``with_weights``: full recall) The combine weights of :attr:`ids`' rows (NaN = not
        recorded), static like :attr:`ids`; None otherwise (capture of weights costs nothing).
    row_base : torch.Tensor int64 [B_cap, 1]
        ``b * S_cap``: the first row of batch row ``b``.
    overflow : torch.Tensor bool [1]
        Set when a token fell outside ``S_cap`` (only possible where the buffer could not grow
        first: inside a compiled forward); :meth:`harvest` raises then.
    repeated : torch.Tensor bool [1]
        Set when a forward's row held a position twice, or went back (packed sequences whose
        position ids restart: one row would be recorded as a mix of them); :meth:`harvest` raises then.
    started : torch.Tensor int64 [1]
        Batches started since the last harvest (counted on the device, so that batches begun
        inside compiled forwards are counted too).
    batch_cap, seq_cap : int
        ``B_cap`` and ``S_cap``.
    pending : tuple of (staged, slot), optional
        An eager forward's ids not yet written to :attr:`ids` (:meth:`defer`): the next
        :func:`~replaymoe.hf.step.step_rows` launch writes them, and every method that reads or
        reshapes :attr:`ids` writes them first (:meth:`flush`).
    """

    def __init__(
        self,
        meta: TraceMeta,
        device: torch.device,
        batch_cap: int,
        seq_cap: int,
        *,
        with_weights: bool = False,
    ) -> None:
        self.meta = meta
        self.device = device
        self.with_weights = with_weights
        self.batch_cap, self.seq_cap = 0, 0
        self.ids = self.row_base = self.tokens = torch.empty(0)
        self.weights: torch.Tensor | None = None
        self.overflow = _static(torch.zeros(1, dtype=torch.bool, device=device))
        self.overflow_i8 = self.overflow.view(torch.int8)  # what the step_rows kernel writes
        self.repeated = _static(torch.zeros(1, dtype=torch.bool, device=device))
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.started = _static(torch.zeros(1, dtype=torch.int64, device=device))
        self.rows = 0  # batch rows of the current batch
        self.dirty = False  # the current batch recorded something (host flag, eager only)
        self._history: list[_Snapshot] = []
        self._grow(batch_cap, seq_cap, keep=False)

    # ------------------------------------------------------------------ capacity
    def _grow(self, batch_cap: int, seq_cap: int, *, keep: bool) -> None:
        self.flush()
        L, K = self.meta.num_layers, self.meta.top_k
        ids = torch.full((L, batch_cap * seq_cap + 1, K), -1, dtype=torch.int16, device=self.device)
        if keep and self.batch_cap and self.seq_cap:
            old = self.ids[:, :-1].view(L, self.batch_cap, self.seq_cap, K)
            ids[:, :-1].view(L, batch_cap, seq_cap, K)[:, : self.batch_cap, : self.seq_cap] = old
        tokens = torch.full((batch_cap * seq_cap + 1,), -1, dtype=torch.int64, device=self.device)
        if keep and self.batch_cap and self.seq_cap:
            old = self.tokens[:-1].view(self.batch_cap, self.seq_cap)
            tokens[:-1].view(batch_cap, seq_cap)[: self.batch_cap, : self.seq_cap] = old
        base = torch.arange(batch_cap, dtype=torch.int64, device=self.device).unsqueeze(1) * seq_cap
        if self.with_weights:
            w = torch.full(ids.shape, float("nan"), dtype=torch.float32, device=self.device)
            if keep and self.weights is not None and self.batch_cap and self.seq_cap:
                old = self.weights[:, :-1].view(L, self.batch_cap, self.seq_cap, K)
                w[:, :-1].view(L, batch_cap, seq_cap, K)[:, : self.batch_cap, : self.seq_cap] = old
            self.weights = _static(w)
        self.ids, self.row_base, self.tokens = _static(ids), _static(base), _static(tokens)
        self.batch_cap, self.seq_cap = batch_cap, seq_cap

    def ensure(self, rows: int, positions: int) -> None:
        """Grow (eagerly, keeping the contents) to hold ``rows`` x ``positions``; powers of two."""
        if rows > self.batch_cap or positions > self.seq_cap:
            self._grow(
                max(self.batch_cap, rows),
                max(self.seq_cap, next_power_of_2(max(positions, 1))),
                keep=True,
            )

    # ------------------------------------------------------------------ per forward
    def begin_batch(self, rows: int, positions: int | None, *, eager: bool) -> None:
        """A new batch of ``rows`` sequences starts (the host knows it: empty cache or ``generate``).

        Eagerly, the previous batch is kept on the device for :meth:`harvest` and the buffer grows
        to ``positions``; inside a compiled forward it is overwritten (:meth:`harvest` warns).
        """
        self.flush()
        if eager:
            if self.dirty:
                w = None if self.weights is None else self.weights.clone()
                self._history.append(
                    _Snapshot(self.ids.clone(), self.rows, self.seq_cap, self.tokens.clone(), w)
                )
            self.ensure(rows, positions or 0)
            self.dirty = False
        self.ids.fill_(-1)
        self.tokens.fill_(-1)
        if self.weights is not None:
            self.weights.fill_(float("nan"))
        self.started.add_(1)
        self.rows = min(rows, self.batch_cap)  # (compiled, rows past B_cap: recorded as overflow)

    def prepare(
        self, rows: int, past: int | torch.Tensor, needed: int | None, *, new_batch: bool, eager: bool
    ) -> None:
        """Before a forward of ``rows`` sequences with ``past`` tokens cached: start a batch (on
        ``new_batch`` — ``generate`` was called — or an empty cache), else grow eagerly to ``needed``
        positions, or restart on the device where the cache length lives there.

        Rows beyond the capacity (only inside a compiled forward: eager ones grow it) are recorded as
        overflow (:meth:`slots`), which :meth:`harvest` raises naming ``max_batch_size``.
        """
        if new_batch or (isinstance(past, int) and past == 0) or self.rows == 0:
            self.begin_batch(rows, needed, eager=eager)
        else:
            if eager and needed is not None:
                self.ensure(rows, needed)
            if isinstance(past, torch.Tensor):
                self.restart_if(past == 0)
        self.dirty = True

    def restart_if(self, is_new: torch.Tensor) -> None:
        """Device-side batch start (``is_new``: a 0-dim bool tensor, e.g. a static cache's length
        is 0, outside ``generate``): the buffer is cleared where it holds (one pass over it)."""
        self.flush()
        self.ids.masked_fill_(is_new, -1)
        self.tokens.masked_fill_(is_new, -1)
        if self.weights is not None:
            self.weights.masked_fill_(is_new, float("nan"))
        self.started.add_(is_new.to(torch.int64))

    def slots(
        self, positions: torch.Tensor, *, check_overflow: bool, check_order: bool = False
    ) -> torch.Tensor:
        """Row of ``ids`` for every token, ``int64 [B*S]`` (padding and overflow: the dump row).

        ``positions`` is ``int64 [B, S]`` with -1 for padding, ``B <= B_cap``. ``check_overflow``
        sends positions beyond ``S_cap`` to the dump row and records them in :attr:`overflow`
        (needed where the buffer could not grow to the forward's positions first); without it every
        position must be below ``S_cap``. ``check_order`` (positions the caller gave, ``S > 1``)
        records in :attr:`repeated` a row whose positions do not increase (padding aside).
        """
        B = positions.shape[0]
        if check_order:  # each position above every earlier one of its row
            before = positions.cummax(dim=1).values[:, :-1]
            back = (positions[:, 1:] >= 0) & (positions[:, 1:] <= before)
            self.repeated.logical_or_(back.any().reshape(1))
        dump = self.batch_cap * self.seq_cap
        if not check_overflow:  # every position is below S_cap (the buffer grew to them first)
            return torch.where(positions >= 0, positions + self.row_base[:B], dump).reshape(-1)
        base = self.row_base
        if B > self.batch_cap:  # (compiled: the buffer could not grow) the rows past B_cap: overflow
            self.overflow.fill_(True)
            positions = positions[: self.batch_cap]
        inside = (positions >= 0) & (positions < self.seq_cap)
        slot = torch.where(inside, positions + base[: positions.shape[0]], dump)
        self.overflow.logical_or_((positions >= self.seq_cap).any().reshape(1))
        if B > self.batch_cap:
            slot = torch.cat([slot, slot.new_full((B - self.batch_cap, slot.shape[1]), dump)])
        return slot.reshape(-1)

    def commit(self, staged: torch.Tensor, slot: torch.Tensor) -> None:
        """Write one forward's ids (``int16 [L, T, K]``) to their slots (``int64 [T]``)."""
        self.flush()
        self.ids.index_copy_(1, slot, staged)

    def commit_weights(self, staged: torch.Tensor, slot: torch.Tensor) -> None:
        """Write one forward's weights (``float32 [L, T, K]``) to their slots (``int64 [T]``), at once
        (never deferred: the slots are read while still this forward's)."""
        assert self.weights is not None
        self.weights.index_copy_(1, slot, staged)

    def write_tokens(self, slot: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record one forward's tokens (``int64 [T]``) at their slots (``int64 [T]``)."""
        self.tokens.index_copy_(0, slot, tokens)

    def defer(self, staged: torch.Tensor, slot: torch.Tensor) -> None:
        """:meth:`commit`, left to the next :func:`~replaymoe.hf.step.step_rows` launch (eager
        forwards that took it: one launch fewer per forward) or to :meth:`flush`. ``staged`` is
        contiguous; neither tensor may be written before then (a graphed forward's slab is written
        again only by the next forward's routers, which run after that launch). Like every capture
        operation, the write runs on the current stream: forwards of one session share a stream."""
        self.flush()
        self.pending = (staged, slot)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deferred commit, now the caller's to write (:func:`~replaymoe.hf.step.step_rows`)."""
        pending, self.pending = self.pending, None
        return pending

    def flush(self) -> None:
        """Write the deferred commit, if any (:meth:`defer`). Without one it only reads
        :attr:`pending`, so a compiled forward that calls it traces nothing."""
        if self.pending is None:
            return
        (staged, slot), self.pending = self.pending, None
        self.ids.index_copy_(1, slot, staged)

    # ------------------------------------------------------------------ host side
    def harvest(self) -> tuple[list[RoutingTrace], int]:
        """Traces of every batch since the last harvest, in (batch, row) order, and the number of
        batches that were overwritten before they could be kept (begun inside compiled forwards).

        Raises
        ------
        ValueError
            When a token fell outside the buffer's capacity (see :func:`replaymoe.hf.enable`'s
            ``max_batch_size`` / ``max_positions``), or a row's given positions repeated (packed
            sequences: the batches since the last harvest are dropped).
        """
        self.flush()
        started = int(self.started.item())
        overflow, repeated = torch.cat([self.overflow, self.repeated]).tolist()
        if repeated:  # which batch is unknown: all of them go, none is returned mixed
            self.repeated.zero_()
            self._history.clear()
            self.started.zero_()
            self.dirty = False
            fail(
                "position_ids",
                "positions that increase along each row of a captured forward (one sequence per row: "
                "a row of packed sequences whose position ids restart would record them over each "
                "other; the traces captured since the last traces() call are dropped)",
                "a row whose positions repeat or go back",
            )
        if overflow:
            self.overflow.zero_()
            fail(
                "max_batch_size / max_positions",
                f"a capture capacity of at least the batch and length of every compiled forward "
                f"(enable(..., max_batch_size=, max_positions=); now {self.batch_cap} x {self.seq_cap})",
                "a token outside it (a row past max_batch_size or a position past max_positions), "
                "recorded as missing",
                what="capacity",
            )
        batches = list(self._history)
        if started > len(batches):
            batches.append(_Snapshot(self.ids, self.rows, self.seq_cap, self.tokens, self.weights))
        lost = max(0, started - len(batches))
        out = [t for snap in batches for t in self._traces(snap)]
        self._history.clear()
        self.started.zero_()
        self.dirty = False
        return out, lost

    def _traces(self, snap: _Snapshot) -> list[RoutingTrace]:
        L, K, S = self.meta.num_layers, self.meta.top_k, snap.seq_cap
        ids = snap.ids[:, : snap.rows * S].view(L, snap.rows, S, K)
        recorded = (ids[:, :, :, 0] >= 0).any(dim=0)  # [rows, S]
        last = torch.where(recorded, torch.arange(S, device=ids.device), -1).amax(dim=1)
        lengths = (last + 1).cpu().numpy()
        n = int(lengths.max()) if lengths.size else 0
        host = ids[:, :, :n].permute(1, 2, 0, 3).cpu().numpy()  # [rows, n, L, K]
        tokens = snap.tokens[: snap.rows * S].view(snap.rows, S)[:, :n].cpu().numpy()
        weights = None
        if snap.weights is not None:
            w = snap.weights[:, : snap.rows * S].view(L, snap.rows, S, K)
            weights = w[:, :, :n].permute(1, 2, 0, 3).cpu().numpy()  # [rows, n, L, K]
        return RoutingTrace.from_batch(
            host,
            lengths.tolist(),
            num_experts=self.meta.num_experts,
            top_k=K,
            layer_ids=list(self.meta.layer_ids),
            model_id=self.meta.model_id,
            token_ids=tokens,
            weights=weights,
        )

"""Coverage of a replayed forward: which lookups no trace covers, counted on the device and raised later.

This module's one job is strict coverage (``replaying(..., missing="error")``, the default): a replayed
forward must find a recorded route for every token except padding and each sequence's last sampled
token. :class:`CoverageChecks`, which :class:`~replaymoe.record.replay.ReplayTable` inherits, counts the
lookups that break it with device ops only (eagerly, under ``torch.compile`` and inside CUDA graphs) and
raises at the next check, naming the layer, batch row and position of the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from ..._validation import fail

__all__ = ["NO_KEY", "CoverageChecks", "fail_token_diff", "fail_uncovered", "smallest_key"]

NO_KEY = (1 << 63) - 1  # ReplayTable.uncovered's last entry while no uncovered lookup was counted


def smallest_key(bad: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [1]: the smallest key ``layer << 48 | batch row << 28 | position`` of the lookups ``bad``
    (bool [L, B*S]) of a forward at ``positions`` (int64 [B, S]); :data:`NO_KEY` where there is none.
    Device ops only (:meth:`CoverageChecks.count_uncovered`)."""
    L = bad.shape[0]
    B, S = positions.shape
    rows = torch.arange(B, device=positions.device).repeat_interleave(S)
    layers = torch.arange(L, device=positions.device)[:, None]
    key = (layers << 48) | ((rows << 28) | positions.reshape(-1))[None, :]
    return torch.where(bad, key, NO_KEY).amin().reshape(1)


def fail_token_diff(count: int, key: int, recorded: int, got: int) -> NoReturn:
    """The ValueError of :meth:`CoverageChecks.check_uncovered` for tokens that differ from their
    trace's (:meth:`CoverageChecks.count_token_diff`): ``count`` of them, the first by ``key``
    (``batch row << 28 | position``) with the trace's token and the forward's."""
    row, pos = key >> 28, key & ((1 << 28) - 1)
    fail(
        "replay",
        "the tokens each trace recorded, in forwards matched to traces by batch row (a forward with a "
        "KV cache, as in generate, or traces that do not start at position 0: traces[b] replays batch "
        "row b, so it must hold that row's sequence)",
        f"batch row {row}, position {pos}: traces[{row}] recorded token {recorded}, the forward has {got}; "
        f"{count} token(s) differ since the last check",
        what="tokens",
    )


def fail_uncovered(counts: list[int], key: int, layer_names: Sequence[str]) -> NoReturn:
    """The ValueError of :meth:`CoverageChecks.check_uncovered`: ``counts`` per layer, the first lookup by
    ``key`` (:func:`smallest_key`); ``layer_names[l]`` names MoE layer ``l``."""
    layer, row, pos = key >> 48, (key >> 28) & ((1 << 20) - 1), key & ((1 << 28) - 1)
    per_layer = ", ".join(f"{layer_names[i]}: {n}" for i, n in enumerate(counts) if n)
    fail(
        "replay",
        "a recorded route for every token of a replayed forward except padding and each "
        "sequence's last sampled token (or missing='native' to route the others natively)",
        f"none for batch row {row}, position {pos}, {layer_names[layer]}; token-layer lookups "
        f"without one since the last check: {per_layer}",
        what="coverage",
    )


class CoverageChecks:
    """The coverage counters' methods of :class:`~replaymoe.record.replay.ReplayTable` (a mixin: the
    table owns the state, see its attributes ``uncovered``, ``ends`` and ``missing``)."""

    uncovered: torch.Tensor  # int64 [L + 1]: per-layer counts, then the smallest key
    token_diff: torch.Tensor  # int64 [4]: count, smallest key, the recorded and the forward's token
    row_tokens: torch.Tensor  # int64 [R_cap]
    checks_tokens: bool
    ends: torch.Tensor  # int64 [B]
    missing: str

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Table row of every token by batch row (:class:`~replaymoe.record.replay.ReplayTable`'s)."""
        raise NotImplementedError

    _snapshot: tuple[torch.Tensor, torch.cuda.Event] | None
    _snapshot_pending: bool

    def uncovered_mask(
        self, forced: torch.Tensor, positions: torch.Tensor, *, by_content: bool
    ) -> torch.Tensor:
        """bool ``[L, B*S]``: the lookups of one forward that no trace covers and that coverage does
        not excuse. Device ops only.

        A replayed forward must find a recorded row for every token except padding (``positions <
        0``) and each sequence's last sampled token, which was never fed through the model that
        recorded the trace and so has no routing: by batch row, the position one past the row's
        trace (``ends``); matched by content (whole sequences), each row's last token.

        Parameters
        ----------
        forced : torch.Tensor int32 [L, B*S, K]
            The forward's replay ids (-1 rows: no recorded row).
        positions : torch.Tensor int64 [B, S]
            Each token's position (-1 = padding).
        by_content : bool
            Whether the forward looked its rows up by content (:meth:`gather_by_content`).
        """
        real = positions >= 0
        if by_content:
            last = positions == positions.amax(dim=1, keepdim=True)
        else:
            last = positions == self.ends[:, None]
        need = (real & ~last).reshape(1, -1)
        return (forced[:, :, 0] < 0) & need

    def count_uncovered(self, forced: torch.Tensor, positions: torch.Tensor, *, by_content: bool) -> None:
        """Add one forward's uncovered lookups (:meth:`uncovered_mask`) to :attr:`uncovered`, and their
        smallest key. Device ops only (no host sync, fixed shapes): runs eagerly, under
        ``torch.compile`` and inside CUDA graphs. (The eager CUDA forwards that the step bookkeeping
        kernel serves count in that kernel instead, by batch row.)"""
        bad = self.uncovered_mask(forced, positions, by_content=by_content)
        L = bad.shape[0]
        smallest = smallest_key(bad, positions)
        self.uncovered[:L].add_(bad.sum(dim=1))
        self.uncovered[L:].copy_(torch.minimum(self.uncovered[L:], smallest))

    def count_token_diff(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Count the tokens ``int64 [B, S]`` of a forward matched by batch row (at ``positions``, int64
        [B, S], -1 = padding) that differ from the token their trace recorded at that position, into
        :attr:`token_diff` with the first one's key and tokens. Device ops only (as
        :meth:`count_uncovered`); positions a trace does not cover, and unknown tokens, are not
        compared. A route is a function of its token's whole prefix: a trace replayed into another
        sequence (traces in another order than the batch, or a generate that samples other tokens)
        replays another sequence's routes, so this always raises, whatever ``missing`` says."""
        recorded = self.row_tokens.index_select(0, self._rows(positions))
        got = tokens.reshape(-1)
        bad = (recorded >= 0) & (recorded != got) & (positions.reshape(-1) >= 0)
        B, S = positions.shape
        rows = torch.arange(B, device=positions.device).repeat_interleave(S)
        key = torch.where(bad, (rows << 28) | positions.reshape(-1), NO_KEY)
        first = key.argmin().reshape(1)  # (index_select, not key[first]: no data-dependent index)
        smallest = key.index_select(0, first)
        earlier = smallest < self.token_diff[1:2]
        total = self.token_diff[0:1] + bad.sum().reshape(1)
        update = torch.cat([total, smallest, recorded.index_select(0, first), got.index_select(0, first)])
        keep = torch.cat([torch.ones_like(earlier), earlier, earlier, earlier])
        merged = torch.where(keep, update, self.token_diff)
        self.token_diff.copy_(merged)

    def snapshot_uncovered(self) -> None:
        """Start copying the counters to pinned host memory, without waiting (CUDA, eager, outside a
        graph capture): a later :meth:`check_uncovered` with ``block=False`` reads them once the
        copy is done."""
        if not self.uncovered.is_cuda or self._snapshot is None:
            return
        if self.missing != "error" and not self.checks_tokens:
            return
        host, event = self._snapshot
        L1 = self.uncovered.shape[0]
        host[:L1].copy_(self.uncovered, non_blocking=True)
        host[L1:].copy_(self.token_diff, non_blocking=True)
        event.record()
        self._snapshot_pending = True

    def check_uncovered(self, layer_names: Sequence[str], *, block: bool) -> None:
        """Raise ValueError for uncovered lookups counted since the last check (then start again).

        ``block=True`` reads the device counters (one host sync; on the CPU, no wait). ``block=False``
        never waits: it reads the last :meth:`snapshot_uncovered` once its copy is done, and does
        nothing before. ``layer_names[l]`` names MoE layer ``l`` in the message.
        """
        if self.uncovered.numel() == 0 or self.uncovered.is_meta:
            return  # (a table on the meta device counted nothing: it follows the model at its first forward)
        if self.missing != "error" and not self.checks_tokens:
            return
        snapshot = self._snapshot
        L1 = self.uncovered.shape[0]
        if block or not self.uncovered.is_cuda:
            values = self.uncovered.tolist() + self.token_diff.tolist()
        elif self._snapshot_pending and snapshot is not None and snapshot[1].query():
            values = snapshot[0].tolist()
            self._snapshot_pending = False
        else:
            return
        counts, key, diff = values[: L1 - 1], values[L1 - 1], values[L1:]
        if diff[0]:  # tokens of another sequence: the cause of anything else counted
            self._clear_uncovered()
            fail_token_diff(*diff)
        if self.missing != "error" or not any(counts):
            return
        self._clear_uncovered()
        fail_uncovered(counts, key, layer_names)

    def _clear_uncovered(self) -> None:
        self.uncovered[:-1].zero_()
        self.uncovered[-1:].fill_(NO_KEY)
        if self.token_diff.numel():  # (device fills: no host-to-device copy)
            self.token_diff.zero_()
            self.token_diff[1:2].fill_(NO_KEY)
        self._snapshot_pending = False

"""The device replay table: :class:`ReplayTable`, and :class:`ReplayReport`, the counts it keeps.

:class:`ReplayTable` is the one device table behind every replay:
:class:`~replaymoe.record.replay.ReplaySource` looks its rows up by batch row and position, and the
transformers integration (:mod:`replaymoe.hf`) by batch row or by content (each token's prefix hash:
:func:`~replaymoe.record.replay.prefix_hashes`), all layers with one gather per forward. Its
:meth:`~ReplayTable.lookup` picks the producer of a forward's ids (a torch gather here, or a caller's
device kernel handed :meth:`~ReplayTable.kernel_args`), so no caller reads the table's layout. What a
load computes on the host (the packed rows, the sorted content index) comes from
:mod:`~replaymoe.record.replay.packing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..._validation import fail
from ..trace import RoutingTrace
from .coverage import CoverageChecks
from .hashes import hash_powers, prefix_hashes
from .packing import capacity, content_index, pack_ids, pack_tokens, pack_weights, row_meta

__all__ = ["MISSING_MODES", "REPLAY_MODES", "ReplayReport", "ReplayTable"]

# What a replayed forward does with a token its traces do not cover (``replaying(..., missing=)``):
# "error" raises (the default), "native" routes it natively and counts it in the report
MISSING_MODES = ("error", "native")
# What a replay forces (``replaying(..., replay=)``, ``R3Config(replay=)``): "ids" (R3: the weights are
# recomputed from the trainer's logits, so the router gets a gradient) or "ids+weights" (full recall, or
# router recall: the rollout's weights too, no gradient to the router through them)
REPLAY_MODES = ("ids", "ids+weights")


def _upload(dst: torch.Tensor, host: np.ndarray) -> None:
    """Copy ``host`` into ``dst`` (same shape); to a GPU through pinned memory, without waiting (the
    caching host allocator keeps the pinned block until the copy is done)."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=dst.is_cuda)


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a long-lived buffer as a static input of compiled graphs (no copy into CUDA graphs)."""
    torch._dynamo.mark_static_address(t)
    return t


@dataclass
class ReplayReport:
    """How much of the replayed batches fell back to native routing.

    Attributes
    ----------
    tokens_seen : int
        Non-padding tokens looked up per layer (the maximum over layers, i.e. the tokens of all
        ``ids_for`` calls of one layer since the last reset).
    fallback_tokens_per_layer : np.ndarray int64 [L]
        Per MoE layer, non-padding tokens that got a -1 row (not recorded, or beyond the trace).
    layers_with_fallback : int
        Number of layers with at least one fallback token.
    tokens_seen_per_layer : np.ndarray int64 [L]
        Non-padding tokens looked up per layer.
    """

    tokens_seen: int
    fallback_tokens_per_layer: np.ndarray
    layers_with_fallback: int
    tokens_seen_per_layer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def from_counts(cls, seen: np.ndarray, fallback: np.ndarray) -> ReplayReport:
        """The report of per-layer counts: tokens looked up and tokens that fell back (int64 [L])."""
        return cls(
            tokens_seen=int(seen.max()) if seen.size else 0,
            fallback_tokens_per_layer=fallback,
            layers_with_fallback=int((fallback > 0).sum()),
            tokens_seen_per_layer=seen,
        )

    @property
    def fallback_fraction(self) -> float:
        """Fallback tokens over tokens looked up, all layers together (0.0 when nothing was seen)."""
        seen = int(self.tokens_seen_per_layer.sum())
        return float(self.fallback_tokens_per_layer.sum()) / seen if seen else 0.0

    def __str__(self) -> str:
        L = len(self.fallback_tokens_per_layer)
        fallback = int(self.fallback_tokens_per_layer.sum())
        lines = [
            f"replay: {self.tokens_seen} tokens looked up per MoE layer, {L} layers; {fallback} "
            f"token-layer lookups routed natively (no recorded row: "
            f"{100 * self.fallback_fraction:.2f}%), in {self.layers_with_fallback} of the {L} layers"
        ]
        order = np.argsort(-self.fallback_tokens_per_layer, kind="stable")[: min(5, L)]
        worst = [int(i) for i in order if self.fallback_tokens_per_layer[i] > 0]
        if worst:
            lines.append(
                "  tokens routed natively, by MoE-layer index: "
                + ", ".join(f"{i}: {int(self.fallback_tokens_per_layer[i])}" for i in worst)
            )
        return "\n".join(lines)


class ReplayTable(CoverageChecks):
    """Recorded ids of a batch of sequences as one device table, gathered once per forward.

    A forward's replay ids come from :meth:`lookup`, which picks their producer: the torch gathers here
    (by batch row, :meth:`gather`; by content, :meth:`gather_by_content`) or a device kernel that
    derives each token's position itself and reads the table through :meth:`kernel_args` (the
    transformers integration's step bookkeeping kernels, ``hf/_kernel_step_rows.py``). Every producer
    counts :attr:`seen` and :attr:`fallback`.

    Attributes
    ----------
    table : torch.Tensor int32 [L, R_cap, K]
        Model MoE layer ``l``'s ids: the traces' positions back to back (sequence ``b``'s
        position ``p`` at row ``bases[b] + p - offsets[b]``), then all -1 rows; ``R_cap`` is a
        power of two, so that new traces of a similar size reuse the buffer (same shapes, same
        address: no recompile, no CUDA-graph re-record).
    weights : torch.Tensor float32 [L, R_cap, K]
        (full recall, :attr:`with_weights`) The traces' combine weights in :attr:`table`'s rows
        (NaN in rows of no recorded route); every producer that looks ids up hands these rows'
        weights too (:meth:`lookup`'s ``weights_out``). Empty otherwise.
    with_weights : bool
        The table holds weights (``load(..., weights=True)``).
    offsets, lengths, bases : torch.Tensor int64 [B]
        Per trace: ``token_offset``, number of positions and first table row (``ends`` and
        ``shift`` are ``offsets + lengths`` and ``bases - offsets``).
    seen, fallback : torch.Tensor int64 [L]
        Non-padding tokens looked up, and those routed natively (no recorded row), per layer.
    uncovered : torch.Tensor int64 [L + 1]
        ``[:L]``: lookups that no trace covers and that coverage does not excuse (:meth:`uncovered_mask`),
        per layer, since the last :meth:`check_uncovered` (:meth:`count_uncovered` adds them, and so
        does the step bookkeeping kernel, ``hf/_kernel_step_rows.py``); ``[L]``: the smallest key
        ``layer << 48 | batch row << 28 | position`` among them (``coverage.NO_KEY`` while there is none).
    row_tokens : torch.Tensor int64 [R_cap]
        The token each trace recorded at each of :attr:`table`'s rows (-1: unknown), when some trace
        carries its tokens (:attr:`checks_tokens`); empty otherwise.
    token_diff : torch.Tensor int64 [4]
        Tokens of forwards matched by batch row that differ from their trace's recorded token
        (:meth:`count_token_diff`) since the last :meth:`check_uncovered`: the count, the smallest key
        ``batch row << 28 | position``, and the recorded and the forward's token there.
    checks_tokens : bool
        Some trace carries its tokens: forwards matched by batch row are checked against them.
    missing : {"error", "native"}
        What a forward does with a token no trace covers: raise (the default) or route it natively
        (counted in :attr:`fallback`). A token that differs from its trace's always raises.
    by_content : bool
        Every trace carries its tokens and starts at position 0: forwards are matched to traces
        by content (:meth:`gather_by_content`), whatever their rows' order, subset or padding.
    hashes, hash_rows : torch.Tensor int64 [H_cap]
        (content mode) Every recorded position's prefix hash, sorted (then a sentinel above any
        hash), and the table row each one names.
    powers : torch.Tensor int64 [2, P_cap]
        (content mode) The hash's powers, for positions below the longest trace.
    source : tuple of (list of RoutingTrace, list of int), or None
        What :meth:`load` was given last (``traces``, ``layer_of``), to load it again elsewhere
        (None before the first load).
    """

    class KernelArgs(NamedTuple):
        """The table as a device kernel reads it (:meth:`ReplayTable.kernel_args`): the step
        bookkeeping kernels (``hf/_kernel_step_rows.py``) take these fields in this order, with the
        forced ids (and their layer stride) between ``shift`` and ``seen``.

        Attributes
        ----------
        table : torch.Tensor int32 [L, R_cap, K]
            :attr:`ReplayTable.table` (contiguous).
        stride_layer : int
            ``R_cap * K``: elements from one layer of ``table`` to the next.
        last_row : int
            ``R_cap - 1``: the all -1 row (no recorded route).
        offsets, ends, shift : torch.Tensor int64 [B]
            Per batch row: the first position its trace covers, one past the last, and the table row
            of position ``p`` minus ``p`` (:attr:`ReplayTable.offsets`, ``ends``, ``shift``).
        seen, fallback : torch.Tensor int64 [L]
            The counters the kernel adds to (:attr:`ReplayTable.seen`, ``fallback``).
        uncovered : torch.Tensor int64 [L + 1]
            The coverage counters (:attr:`ReplayTable.uncovered`; counted by batch row: every
            position but the row's ``ends``, and padding, needs a recorded route).
        num_layers, top_k : int
            ``L`` and ``K``.
        """

        table: torch.Tensor
        stride_layer: int
        last_row: int
        offsets: torch.Tensor
        ends: torch.Tensor
        shift: torch.Tensor
        seen: torch.Tensor
        fallback: torch.Tensor
        uncovered: torch.Tensor
        num_layers: int
        top_k: int

        def tensors(self) -> tuple[torch.Tensor, ...]:
            """The tensors (``table``, ``offsets``, ``ends``, ``shift``, ``seen``, ``fallback``,
            ``uncovered``): a kernel bound to their addresses must be bound again when one changes."""
            return (self.table, self.offsets, self.ends, self.shift, self.seen, self.fallback, self.uncovered)

    def __init__(self) -> None:
        self.table = self.weights = torch.empty(0)
        self.with_weights = False
        self.by_content = False
        self.source: tuple[list[RoutingTrace], list[int]] | None = None
        self.hashes = self.hash_rows = self.powers = torch.empty(0)
        self.offsets = self.lengths = self.bases = self.ends = self.shift = torch.empty(0)
        self.seen = self.fallback = self.uncovered = self.row_tokens = self.token_diff = torch.empty(0)
        self.checks_tokens = False
        self.missing = "error"
        # (pinned int64 [L + 5]: uncovered, then token_diff; event): the counters' last asynchronous
        # copy (CUDA)
        self._snapshot: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._snapshot_pending = False

    @property
    def batch_size(self) -> int:
        """Number of traces loaded (``B``): one per batch row of a forward looked up by batch row."""
        return int(self.offsets.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the table and its counters live (the CPU before the first :meth:`load`)."""
        return self.table.device

    def kernel_args(self) -> ReplayTable.KernelArgs:
        """The table's device tensors and sizes as a device kernel reads them (after :meth:`load`).

        Returns
        -------
        ReplayTable.KernelArgs
            ``table`` int32 [L, R_cap, K], ``offsets`` / ``ends`` / ``shift`` int64 [B], the counters
            ``seen`` / ``fallback`` int64 [L] and ``uncovered`` int64 [L + 1], and the ints
            ``stride_layer`` (``R_cap * K``), ``last_row`` (``R_cap - 1``), ``num_layers``, ``top_k``.
        """
        L, R, K = self.table.shape
        return ReplayTable.KernelArgs(
            self.table, R * K, R - 1, self.offsets, self.ends, self.shift,
            self.seen, self.fallback, self.uncovered, L, K,
        )  # fmt: skip

    def lookup(
        self,
        positions: torch.Tensor | None = None,
        *,
        tokens: torch.Tensor | None = None,
        kernel: Callable[[ReplayTable.KernelArgs, torch.Tensor | None], torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
        weights_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A forward's forced ids, from the one producer that serves it (and, when the table holds
        weights, their weights, into ``weights_out``).

        The producer, in this order: ``kernel`` when given; by content (:meth:`gather_by_content`)
        when ``tokens`` are given; else by batch row (:meth:`gather`). Each gives the same ids for the
        same tokens and counts them (:attr:`seen`, :attr:`fallback`); a kernel also counts
        :attr:`uncovered`, by batch row (the gathers leave that to :meth:`count_uncovered`).

        Parameters
        ----------
        positions : torch.Tensor int64 [B, S], optional
            Each token's position in its sequence (-1 = padding); needed unless ``kernel`` is given,
            which derives them on the device.
        tokens : torch.Tensor int64 [B, S], optional
            The forward's tokens, whole sequences (no KV cache), to match rows by content; the table
            must hold its traces' tokens (:attr:`by_content`).
        kernel : callable, optional
            ``kernel(self.kernel_args(), out)``: a device kernel that writes the ids into ``out`` (or a
            tensor of its own) and returns them; it may launch later, as long as it writes them
            before they are read (a decode step's head, inside a CUDA graph).
        out : torch.Tensor int32 [L, B*S, K], optional
            Contiguous; where the ids go.
        weights_out : torch.Tensor float32 [L, B*S, K]
            Contiguous; where the weights of the same rows go (NaN where the ids are -1). Required
            when the table holds weights (:attr:`with_weights`), and then served by the torch
            gathers only: a ``kernel`` is refused (the step kernels write ids only).

        Returns
        -------
        torch.Tensor int32 [L, B*S, K]
            Row-major over the forward's tokens; a row of -1 where no trace recorded a route (routed
            natively), padding included.
        """
        if self.with_weights and weights_out is None:
            fail("weights_out", "float32 [L, B*S, K] for a table that holds weights", None)
        if kernel is not None:
            if self.with_weights:
                fail("kernel", "None for a table that holds weights (the torch gathers serve it)", "a kernel")
            return kernel(self.kernel_args(), out)
        if positions is None:
            fail("positions", "int64 [B, S] (or a kernel that derives them on the device)", None)
        if tokens is not None:
            return self.gather_by_content(tokens, positions, out, weights_out)
        return self.gather(positions, out, weights_out)

    def load(
        self,
        traces: Sequence[RoutingTrace],
        layer_of: Sequence[int],
        device: torch.device,
        *,
        match_content: bool = True,
        weights: bool = False,
    ) -> None:
        """Fill the table from ``traces`` (one per batch row); ``layer_of[l]`` is the trace layer
        that model MoE layer ``l`` replays. ``match_content=False`` skips the content hashes (a
        caller that looks rows up by batch row only, like :class:`ReplaySource`). ``weights``: also
        the traces' weights (full recall; every trace must carry them, :meth:`check_weighted`;
        their values were checked when each trace was made, finite in every recorded row). The rows are not
        checked again: a ``RoutingTrace`` checked its rows (all -1 or K distinct ids) when it was
        made, and ``ReplaySource.check_model`` the expert range. The host-to-device copies go
        through pinned memory, asynchronously, so a load between training steps does not wait for
        the queued step."""
        if weights:
            ReplayTable.check_weighted(traces)
        self.source = (list(traces), list(layer_of))
        L = len(layer_of)
        host = pack_ids(traces, layer_of)
        if tuple(self.table.shape) != host.shape or self.table.device != device:
            self.table = _static(torch.empty(host.shape, dtype=torch.int32, device=device))
        _upload(self.table, host)
        self.with_weights = weights
        if weights:
            if tuple(self.weights.shape) != host.shape or self.weights.device != device:
                self.weights = _static(torch.empty(host.shape, dtype=torch.float32, device=device))
            _upload(self.weights, pack_weights(traces, layer_of))
        meta = row_meta(traces)  # offsets, lengths, bases, ends, shift
        if tuple(self.offsets.shape) != (len(traces),) or self.offsets.device != device:
            self.offsets, self.lengths, self.bases, self.ends, self.shift = (
                _static(torch.empty(len(traces), dtype=torch.int64, device=device)) for _ in range(5)
            )
        for dst, src in zip((self.offsets, self.lengths, self.bases, self.ends, self.shift), meta):
            _upload(dst, src)
        self.by_content = match_content and all(
            t.token_ids is not None and t.token_offset == 0 for t in traces
        )
        if self.by_content:
            self._load_hashes(traces, meta[2], device)
        self.checks_tokens = any(t.token_ids is not None for t in traces)
        if self.checks_tokens:
            tokens = pack_tokens(traces)
            if tuple(self.row_tokens.shape) != tokens.shape or self.row_tokens.device != device:
                self.row_tokens = _static(torch.empty(tokens.shape, dtype=torch.int64, device=device))
            _upload(self.row_tokens, tokens)
        if tuple(self.seen.shape) != (L,) or self.seen.device != device:
            self.seen = _static(torch.zeros(L, dtype=torch.int64, device=device))
            self.fallback = _static(torch.zeros(L, dtype=torch.int64, device=device))
            self.uncovered = _static(torch.zeros(L + 1, dtype=torch.int64, device=device))
            self.token_diff = _static(torch.zeros(4, dtype=torch.int64, device=device))
            self._snapshot = None
            if device.type == "cuda":  # made here, not in a forward (a pinned allocation may wait)
                pinned = torch.empty(L + 5, dtype=torch.int64, pin_memory=True)
                self._snapshot = (pinned, torch.cuda.Event())
        self._clear_uncovered()
        self.reset_report()

    @staticmethod
    def check_weighted(traces: Sequence[RoutingTrace]) -> None:
        """Raise ValueError unless every trace carries weights (full recall, ``replay="ids+weights"``)."""
        for i, t in enumerate(traces):
            if t.weights is None:
                fail(
                    f"traces[{i}]",
                    "a trace with its combine weights for replay='ids+weights' (captured with "
                    "set_capture(True, weights=True) or a rollout in replay='ids+weights' mode)",
                    "a trace of ids only (e.g. from vLLM or SGLang, which return expert ids only; "
                    "replay='ids' replays those)",
                )

    def holds(
        self,
        traces: Sequence[RoutingTrace],
        layer_of: Sequence[int],
        device: torch.device,
        *,
        weights: bool = False,
    ) -> bool:
        """Whether :meth:`load` of these very trace objects (same order, same layer mapping, the same
        ``weights``) on ``device`` is what the table holds now (traces are not to be modified once
        replayed)."""
        if self.source is None or self.table.device != device or self.with_weights != weights:
            return False
        held, mapping = self.source
        return (
            mapping == list(layer_of)
            and len(held) == len(traces)
            and all(a is b for a, b in zip(held, traces))
        )

    def _load_hashes(self, traces: Sequence[RoutingTrace], bases: np.ndarray, device: torch.device) -> None:
        """The content index (:func:`~replaymoe.record.replay.packing.content_index`) and the hash's
        powers on the device, for content matching."""
        sorted_h, sorted_r = content_index(traces, bases, self.table.shape[1] - 1)
        cap = sorted_h.shape[0]
        if tuple(self.hashes.shape) != (cap,) or self.hashes.device != device:
            self.hashes = _static(torch.empty(cap, dtype=torch.int64, device=device))
            self.hash_rows = _static(torch.empty(cap, dtype=torch.int64, device=device))
        _upload(self.hashes, sorted_h)
        _upload(self.hash_rows, sorted_r)
        pcap = capacity(max((t.num_tokens for t in traces), default=0))
        if self.powers.shape[-1] != pcap or self.powers.device != device:
            self.powers = _static(torch.tensor(hash_powers(pcap), device=device))

    def gather_by_content(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor | None = None,
        weights_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forced ids ``int32 [L, B*S, K]`` for the tokens ``int64 [B, S]`` at ``positions`` (``int64
        [B, S]``, -1 = padding), matched by content: a token gets the row some trace recorded for
        the same token prefix (the prefix decides a causal model's routing), wherever its row sits
        in this forward; a prefix no trace recorded gets a -1 row (routed natively). Device ops
        only (a sort-free binary search in :attr:`hashes`). Counts both per layer, like
        :meth:`gather`. Needs whole sequences (no KV cache): a row's prefix starts at position 0.
        ``weights_out``: as in :meth:`gather`."""
        key = prefix_hashes(tokens, positions, self.powers).reshape(-1)
        idx = torch.searchsorted(self.hashes, key).clamp_(max=self.hashes.shape[0] - 1)
        hit = self.hashes[idx] == key
        row = torch.where(hit, self.hash_rows[idx], self.table.shape[1] - 1)
        return self._take(row, positions, out, weights_out=weights_out)

    def gather(
        self,
        positions: torch.Tensor,
        out: torch.Tensor | None = None,
        weights_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forced ids ``int32 [L, B*S, K]`` for ``positions`` (``int64 [B, S]``, -1 = padding); a
        token with no recorded row gets a row of -1 (routed natively). Counts both per layer.
        ``out``: a contiguous ``int32 [L, B*S, K]`` to write them to (returned). ``weights_out``: a
        contiguous ``float32 [L, B*S, K]`` that receives the same rows' weights (tables that hold
        weights)."""
        return self._take(self._rows(positions), positions, out, weights_out=weights_out)

    def gather_layer(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`gather` for one MoE layer: ``int32 [B*S, K]`` (counted for that layer alone)."""
        return self._take(self._rows(positions), positions, None, layer=layer)

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Table row of every token, by batch row: ``int64 [B*S]`` (the all -1 last row where the
        row's trace does not cover the position, and for padding)."""
        # offsets >= 0, so a covered position is never padding
        inside = (positions >= self.offsets[:, None]) & (positions < self.ends[:, None])
        return torch.where(inside, positions + self.shift[:, None], self.table.shape[1] - 1).reshape(-1)

    def _take(
        self,
        row: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor | None,
        *,
        layer: int | None = None,
        weights_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The table's rows ``row`` (``int64 [B*S]``) of every layer (or of ``layer``), and the counts:
        tokens looked up, and tokens that got a -1 row (every padding token reads one too: they are
        taken out). ``weights_out`` (all layers, a table with weights): those rows' weights."""
        if weights_out is not None and self.with_weights:
            torch.index_select(self.weights, 1, row, out=weights_out)
        real = (positions >= 0).sum()
        padding = positions.numel() - real
        if layer is not None:
            ids = self.table[layer].index_select(0, row)
            self.seen[layer] += real
            self.fallback[layer] += (ids[:, 0] < 0).sum() - padding
            return ids
        forced = (
            self.table.index_select(1, row)
            if out is None
            else torch.index_select(self.table, 1, row, out=out)
        )
        self.seen.add_(real)
        self.fallback.add_((forced[:, :, 0] < 0).sum(dim=1) - padding)
        return forced

    def report(self) -> ReplayReport:
        """Counts since :meth:`load` or :meth:`reset_report` (one host sync)."""
        if self.seen.is_meta:  # a table made for a model on the meta device: no forward ran yet
            zeros = np.zeros(self.seen.shape, dtype=np.int64)
            return ReplayReport.from_counts(zeros, zeros.copy())
        # copies: on the CPU, .numpy() would share memory with the live counters
        return ReplayReport.from_counts(self.seen.cpu().numpy().copy(), self.fallback.cpu().numpy().copy())

    def reset_report(self) -> None:
        self.seen.zero_()
        self.fallback.zero_()

"""Device-side capture buffers and replay tables of a patched transformers model.

Both are indexed by what a forward already holds on the device: the batch row and the token's
position in its sequence (:func:`replaymoe.hf.positions.token_positions`). A forward only runs
device indexing ops on them (no host sync, fixed shapes), so the same code runs eagerly, under
``torch.compile(fullgraph=True)`` and inside CUDA graphs. Host work (one
:class:`~replaymoe.trace.RoutingTrace` per sequence) happens once, in :meth:`CaptureBuffer.harvest`.

Size: over 450 lines; the capture buffer and the replay table are one contract (the rows a forward
writes are the rows a replay reads, the tokens capture records are what content matching hashes),
and issue 34 moves the replay table to ``record/replay.py`` where ``ReplaySource`` shares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton

from replaymoe._validation import fail
from replaymoe.replay import ReplayReport
from replaymoe.trace import RoutingTrace

__all__ = ["CaptureBuffer", "ReplayTable", "TraceMeta", "prefix_hashes", "prefix_hashes_np"]

# Prefix hashes (content-addressed replay): two polynomial hashes modulo primes below 2^31, of the
# tokens at positions 0..p, combined into 62 bits. Every step stays below 2^63 in int64 (a product
# of two values below 2^31; a cumulative sum of fewer than 2^32 terms below 2^31), so the device
# (torch) and the host (numpy) compute the same integers exactly.
_PRIMES = (2147483647, 2147483629)
_BASES = (1000003, 917513)


def _powers(n: int) -> np.ndarray:
    """int64 [2, n]: ``base^i mod prime`` for each hash, i < n."""
    out = np.ones((2, max(n, 1)), dtype=np.int64)
    for h, (p, a) in enumerate(zip(_PRIMES, _BASES)):
        k, step = 1, a % p
        while k < n:  # out[k:2k] = out[:k] * a^k
            m = min(k, n - k)
            out[h, k : k + m] = out[h, :m] * step % p
            step = step * step % p
            k += m
    return out


def prefix_hashes_np(tokens: np.ndarray) -> np.ndarray:
    """int64 [N]: hash of ``tokens[:p + 1]`` for each p (``tokens`` int [N] at positions 0..N-1);
    -1 from the first unknown (-1) token on. Equal to :func:`prefix_hashes` on the same tokens."""
    tok = np.asarray(tokens, dtype=np.int64)
    n = tok.shape[0]
    pw = _powers(n)[:, :n]
    parts = [np.cumsum((tok + 1) % p * pw[h] % p) % p for h, p in enumerate(_PRIMES)]
    out = parts[0] * (1 << 31) + parts[1]
    unknown = np.cumsum(tok < 0) > 0
    return np.where(unknown, -1, out)


def _trace_hashes(trace: RoutingTrace) -> np.ndarray:
    """:func:`prefix_hashes_np` of ``trace.token_ids``, computed once per trace (kept on the trace)."""
    cached = getattr(trace, "_replaymoe_prefix_hashes", None)
    if cached is not None and cached[0] is trace.token_ids:
        return cached[1]
    hashes = prefix_hashes_np(trace.token_ids)
    trace._replaymoe_prefix_hashes = (trace.token_ids, hashes)
    return hashes


def _upload(dst: torch.Tensor, host: np.ndarray) -> None:
    """Copy ``host`` into ``dst`` (same shape); to a GPU through pinned memory, without waiting (the
    caching host allocator keeps the pinned block until the copy is done)."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=dst.is_cuda)


def prefix_hashes(tokens: torch.Tensor, positions: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: per token, the hash of its sequence's tokens at positions 0..p (the prefix the
    model saw when it routed it); -1 for padding (``positions < 0``) and positions past
    ``powers``' length. ``tokens``, ``positions``: int64 [B, S] with each row's positions increasing
    (left or right padding); ``powers``: int64 [2, P] from :func:`_powers`. Device ops only."""
    P = powers.shape[1]
    valid = (positions >= 0) & (positions < P)
    pos = positions.clamp(0, P - 1)
    parts = []
    for h, p in enumerate(_PRIMES):
        term = torch.where(valid, (tokens + 1) % p * powers[h][pos] % p, 0)
        parts.append(torch.cumsum(term, dim=1) % p)
    return torch.where(valid, parts[0] * (1 << 31) + parts[1], -1)


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a long-lived buffer as a static input of compiled graphs (no copy into CUDA graphs)."""
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
    row_base : torch.Tensor int64 [B_cap, 1]
        ``b * S_cap``: the first row of batch row ``b``.
    overflow : torch.Tensor bool [1]
        Set when a token fell outside ``S_cap`` (only possible where the buffer could not grow
        first: inside a compiled forward); :meth:`harvest` raises then.
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

    def __init__(self, meta: TraceMeta, device: torch.device, batch_cap: int, seq_cap: int) -> None:
        self.meta = meta
        self.device = device
        self.batch_cap, self.seq_cap = 0, 0
        self.ids = self.row_base = self.tokens = torch.empty(0)
        self.overflow = _static(torch.zeros(1, dtype=torch.bool, device=device))
        self.overflow_i8 = self.overflow.view(torch.int8)  # what the step_rows kernel writes
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
        self.ids, self.row_base, self.tokens = _static(ids), _static(base), _static(tokens)
        self.batch_cap, self.seq_cap = batch_cap, seq_cap

    def ensure(self, rows: int, positions: int) -> None:
        """Grow (eagerly, keeping the contents) to hold ``rows`` x ``positions``; powers of two."""
        if rows > self.batch_cap or positions > self.seq_cap:
            self._grow(
                max(self.batch_cap, rows),
                max(self.seq_cap, triton.next_power_of_2(max(positions, 1))),
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
                self._history.append(
                    _Snapshot(self.ids.clone(), self.rows, self.seq_cap, self.tokens.clone())
                )
            self.ensure(rows, positions or 0)
            self.dirty = False
        self.ids.fill_(-1)
        self.tokens.fill_(-1)
        self.started.add_(1)
        self.rows = rows

    def prepare(
        self, rows: int, past: int | torch.Tensor, needed: int | None, *, new_batch: bool, eager: bool
    ) -> None:
        """Before a forward of ``rows`` sequences with ``past`` tokens cached: start a batch (on
        ``new_batch`` — ``generate`` was called — or an empty cache), else grow eagerly to ``needed``
        positions, or restart on the device where the cache length lives there.

        Raises
        ------
        ValueError
            ``rows`` beyond the capacity (only inside a compiled forward: eager ones grow it).
        """
        if new_batch or (isinstance(past, int) and past == 0) or self.rows == 0:
            self.begin_batch(rows, needed, eager=eager)
        else:
            if eager and needed is not None:
                self.ensure(rows, needed)
            if isinstance(past, torch.Tensor):
                self.restart_if(past == 0)
        if rows > self.batch_cap:
            fail(
                "max_batch_size",
                f">= {rows} (the batch of a compiled forward with capture on; enable(..., max_batch_size=))",
                self.batch_cap,
            )
        self.dirty = True

    def restart_if(self, is_new: torch.Tensor) -> None:
        """Device-side batch start (``is_new``: a 0-dim bool tensor, e.g. a static cache's length
        is 0, outside ``generate``): the buffer is cleared where it holds (one pass over it)."""
        self.flush()
        self.ids.masked_fill_(is_new, -1)
        self.tokens.masked_fill_(is_new, -1)
        self.started.add_(is_new.to(torch.int64))

    def slots(self, positions: torch.Tensor, *, check_overflow: bool) -> torch.Tensor:
        """Row of ``ids`` for every token, ``int64 [B*S]`` (padding and overflow: the dump row).

        ``positions`` is ``int64 [B, S]`` with -1 for padding, ``B <= B_cap``. ``check_overflow``
        sends positions beyond ``S_cap`` to the dump row and records them in :attr:`overflow`
        (needed where the buffer could not grow to the forward's positions first); without it every
        position must be below ``S_cap``.
        """
        B = positions.shape[0]
        dump = self.batch_cap * self.seq_cap
        if not check_overflow:  # every position is below S_cap (the buffer grew to them first)
            return torch.where(positions >= 0, positions + self.row_base[:B], dump).reshape(-1)
        inside = (positions >= 0) & (positions < self.seq_cap)
        slot = torch.where(inside, positions + self.row_base[:B], dump)
        self.overflow.logical_or_((positions >= self.seq_cap).any().reshape(1))
        return slot.reshape(-1)

    def commit(self, staged: torch.Tensor, slot: torch.Tensor) -> None:
        """Write one forward's ids (``int16 [L, T, K]``) to their slots (``int64 [T]``)."""
        self.flush()
        self.ids.index_copy_(1, slot, staged)

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
            ``max_batch_size`` / ``max_positions``).
        """
        self.flush()
        started = int(self.started.item())
        if bool(self.overflow.item()):
            self.overflow.zero_()
            fail(
                "max_positions",
                f"a capture capacity of at least the batch and length of every compiled forward "
                f"(enable(..., max_batch_size=, max_positions=); now {self.batch_cap} x {self.seq_cap})",
                "a token outside it, recorded as missing",
                what="capacity",
            )
        batches = list(self._history)
        if started > len(batches):
            batches.append(_Snapshot(self.ids, self.rows, self.seq_cap, self.tokens))
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
        return [
            RoutingTrace(
                np.ascontiguousarray(host[b, : lengths[b]]),
                num_experts=self.meta.num_experts,
                top_k=K,
                layer_ids=list(self.meta.layer_ids),
                model_id=self.meta.model_id,
                token_ids=tokens[b, : lengths[b]],
            )
            for b in range(snap.rows)
        ]


class ReplayTable:
    """Recorded ids of a batch of sequences as one device table, gathered once per forward.

    Attributes
    ----------
    table : torch.Tensor int32 [L, R_cap, K]
        Model MoE layer ``l``'s ids: the traces' positions back to back (sequence ``b``'s
        position ``p`` at row ``bases[b] + p - offsets[b]``), then all -1 rows; ``R_cap`` is a
        power of two, so that new traces of a similar size reuse the buffer (same shapes, same
        address: no recompile, no CUDA-graph re-record).
    offsets, lengths, bases : torch.Tensor int64 [B]
        Per trace: ``token_offset``, number of positions and first table row (``ends`` and
        ``shift`` are ``offsets + lengths`` and ``bases - offsets``).
    seen, fallback : torch.Tensor int64 [L]
        Non-padding tokens looked up, and those routed natively (no recorded row), per layer.
    by_content : bool
        Every trace carries its tokens and starts at position 0: forwards are matched to traces
        by content (:meth:`gather_by_content`), whatever their rows' order, subset or padding.
    hashes, hash_rows : torch.Tensor int64 [H_cap]
        (content mode) Every recorded position's prefix hash, sorted (then a sentinel above any
        hash), and the table row each one names.
    powers : torch.Tensor int64 [2, P_cap]
        (content mode) The hash's powers, for positions below the longest trace.
    """

    def __init__(self) -> None:
        self.table = torch.empty(0)
        self.by_content = False
        self.source: tuple | None = None  # (traces, layer_of): what load() was given, to reload elsewhere
        self.hashes = self.hash_rows = self.powers = torch.empty(0)
        self.offsets = self.lengths = self.bases = self.ends = self.shift = torch.empty(0)
        self.seen = self.fallback = torch.empty(0)

    @property
    def batch_size(self) -> int:
        return int(self.offsets.shape[0])

    def load(
        self, traces: Sequence[RoutingTrace], layer_of: Sequence[int], num_experts: int, device: torch.device
    ) -> None:
        """Fill the table from ``traces`` (one per batch row); ``layer_of[l]`` is the trace layer
        that model MoE layer ``l`` replays. The rows are not checked again: a ``RoutingTrace`` checked
        its rows (all -1 or K distinct ids) when it was made, and ``ReplaySource.check_model`` the
        expert range. The host-to-device copies go through pinned memory, asynchronously, so a load
        between training steps does not wait for the queued step."""
        self.source = (list(traces), list(layer_of))
        L, K = len(layer_of), traces[0].top_k
        lengths = [t.num_tokens for t in traces]
        total = sum(lengths)
        rows = max(triton.next_power_of_2(total + 1), 64)
        host = np.full((L, rows, K), -1, dtype=np.int32)
        base = 0
        for t in traces:
            host[:, base : base + t.num_tokens] = t.ids[:, list(layer_of)].transpose(1, 0, 2)
            base += t.num_tokens
        shape = (L, rows, K)
        if tuple(self.table.shape) != shape or self.table.device != device:
            self.table = _static(torch.empty(shape, dtype=torch.int32, device=device))
        _upload(self.table, host)
        bases = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        offsets = np.array([t.token_offset for t in traces], dtype=np.int64)
        lengths = np.array(lengths, dtype=np.int64)
        # offsets, lengths, bases; ends = offsets + lengths; shift = bases - offsets
        meta = torch.from_numpy(np.stack([offsets, lengths, bases, offsets + lengths, bases - offsets]))
        if tuple(self.offsets.shape) != (len(traces),) or self.offsets.device != device:
            self.offsets, self.lengths, self.bases, self.ends, self.shift = (
                _static(torch.empty(len(traces), dtype=torch.int64, device=device)) for _ in range(5)
            )
        for dst, src in zip((self.offsets, self.lengths, self.bases, self.ends, self.shift), meta.numpy()):
            _upload(dst, src)
        self.by_content = all(t.token_ids is not None and t.token_offset == 0 for t in traces)
        if self.by_content:
            self._load_hashes(traces, bases, device)
        if tuple(self.seen.shape) != (L,) or self.seen.device != device:
            self.seen = _static(torch.zeros(L, dtype=torch.int64, device=device))
            self.fallback = _static(torch.zeros(L, dtype=torch.int64, device=device))
        self.reset_report()

    def holds(self, traces: Sequence[RoutingTrace], layer_of: Sequence[int], device: torch.device) -> bool:
        """Whether :meth:`load` of these very trace objects (same order, same layer mapping) on
        ``device`` is what the table holds now (traces are not to be modified once replayed)."""
        if self.source is None or self.table.device != device:
            return False
        held, mapping = self.source
        return (
            mapping == list(layer_of)
            and len(held) == len(traces)
            and all(a is b for a, b in zip(held, traces))
        )

    def _load_hashes(self, traces: Sequence[RoutingTrace], bases: np.ndarray, device: torch.device) -> None:
        """Sorted prefix hashes of every recorded position (one host pass), for content matching. Of
        equal hashes (the same prefix in several traces: a group's shared prompt) the earliest
        trace's row comes first, and is the one replayed."""
        hashes = np.concatenate([_trace_hashes(t) for t in traces]) if traces else np.zeros(0)
        rows = (
            np.concatenate([b + np.arange(t.num_tokens) for t, b in zip(traces, bases)]) if traces else hashes
        )
        keep = hashes >= 0
        hashes, rows = hashes[keep], rows[keep].astype(np.int64)
        order = np.lexsort((rows, hashes))
        cap = max(64, triton.next_power_of_2(len(hashes) + 1))
        sorted_h = np.full(cap, np.iinfo(np.int64).max, dtype=np.int64)  # sentinel: above any hash
        sorted_r = np.full(cap, self.table.shape[1] - 1, dtype=np.int64)  # (the all -1 last row)
        sorted_h[: len(hashes)], sorted_r[: len(hashes)] = hashes[order], rows[order]
        if tuple(self.hashes.shape) != (cap,) or self.hashes.device != device:
            self.hashes = _static(torch.empty(cap, dtype=torch.int64, device=device))
            self.hash_rows = _static(torch.empty(cap, dtype=torch.int64, device=device))
        _upload(self.hashes, sorted_h)
        _upload(self.hash_rows, sorted_r)
        longest = max((t.num_tokens for t in traces), default=0)
        pcap = max(64, triton.next_power_of_2(longest + 1))
        if self.powers.shape[-1] != pcap or self.powers.device != device:
            self.powers = _static(torch.from_numpy(_powers(pcap)).to(device))

    def gather_by_content(
        self, tokens: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forced ids ``int32 [L, B*S, K]`` for the tokens ``int64 [B, S]`` at ``positions`` (``int64
        [B, S]``, -1 = padding), matched by content: a token gets the row some trace recorded for
        the same token prefix (the prefix decides a causal model's routing), wherever its row sits
        in this forward; a prefix no trace recorded gets a -1 row (routed natively). Device ops
        only (a sort-free binary search in :attr:`hashes`). Counts both per layer, like
        :meth:`gather`. Needs whole sequences (no KV cache): a row's prefix starts at position 0."""
        key = prefix_hashes(tokens, positions, self.powers).reshape(-1)
        idx = torch.searchsorted(self.hashes, key).clamp_(max=self.hashes.shape[0] - 1)
        hit = self.hashes[idx] == key
        row = torch.where(hit, self.hash_rows[idx], self.table.shape[1] - 1)
        return self._take(row, positions, out)

    def gather(self, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Forced ids ``int32 [L, B*S, K]`` for ``positions`` (``int64 [B, S]``, -1 = padding); a
        token with no recorded row gets a row of -1 (routed natively). Counts both per layer.
        ``out``: a contiguous ``int32 [L, B*S, K]`` to write them to (returned)."""
        # offsets >= 0, so a covered position is never padding
        inside = (positions >= self.offsets[:, None]) & (positions < self.ends[:, None])
        row = torch.where(inside, positions + self.shift[:, None], self.table.shape[1] - 1).reshape(-1)
        return self._take(row, positions, out)

    def _take(self, row: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The table's rows ``row`` (``int64 [B*S]``) of every layer, and the counts: tokens looked up,
        and tokens that got a -1 row (every padding token reads one too: they are taken out)."""
        forced = (
            self.table.index_select(1, row)
            if out is None
            else torch.index_select(self.table, 1, row, out=out)
        )
        real = (positions >= 0).sum()
        self.seen.add_(real)
        self.fallback.add_((forced[:, :, 0] < 0).sum(dim=1) - (positions.numel() - real))
        return forced

    def report(self) -> ReplayReport:
        """Counts since :meth:`load` or :meth:`reset_report` (one host sync)."""
        return ReplayReport.from_counts(self.seen.cpu().numpy(), self.fallback.cpu().numpy())

    def reset_report(self) -> None:
        self.seen.zero_()
        self.fallback.zero_()

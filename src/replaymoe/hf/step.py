"""What one forward of the decoder stack hands its routers (:class:`Step`), and the fixed-address
slabs of forwards whose MoE blocks replay CUDA graphs (:class:`StepBuffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch

from replaymoe._backend import INTERPRET
from replaymoe._launch import fast
from replaymoe.hf._kernel_step_rows import decode_rows_kernel, step_rows_kernel
from replaymoe.record.replay import ReplayTable

from .._launch import next_power_of_2

__all__ = [
    "DecodeChain",
    "DecodeHead",
    "Step",
    "StepBuffers",
    "fused_rows_ok",
    "positions_bound",
    "step_rows",
]


@dataclass
class Step:
    """One forward of the decoder stack, as the routers see it."""

    num_tokens: int  # B * S
    forced: Optional[torch.Tensor]  # int32 [L, T, K] replay ids (-1 rows: route natively), or None
    staged: Optional[torch.Tensor]  # int16 [L, T, K] capture slab, or None
    slot: Optional[torch.Tensor]  # int64 [T] capture-buffer row of each token, or None
    graphable: bool = False  # the MoE blocks may run as CUDA graphs (see replaymoe.hf.graphs)
    defer_commit: bool = False  # capture: the next step_rows launch writes the staged ids
    head: Optional[DecodeHead] = None  # run by the first MoE block, before its router (then None)
    tokens: Optional[torch.Tensor] = None  # int64 [T] the forward's tokens (capture records them), or None
    # replay with missing="error": (table, matched by content, positions int64 [B, S], or None where the
    # step bookkeeping kernel counted the uncovered lookups); counted when the forward ends
    coverage: Optional[tuple] = None
    # full recall: float32 [L, T, K] replayed weights (NaN in -1 rows), and the weights' capture slab
    forced_w: Optional[torch.Tensor] = None
    staged_w: Optional[torch.Tensor] = None


class StepBuffers:
    """One ``[L, T, K]`` slab per (kind, T, device), kept: a block's CUDA graph reads the replay ids
    and writes the capture slab at the addresses it saw at capture (graphed forwards have at most
    ``GRAPH_MAX_TOKENS`` tokens, so there are few)."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.slabs: dict[tuple, torch.Tensor] = {}

    def get(self, kind: str, num_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (kind, num_tokens, device)
        slab = self.slabs.get(key)
        if slab is None:
            slab = torch.empty((self.num_layers, num_tokens, self.top_k), dtype=dtype, device=device)
            self.slabs[key] = slab
        return slab

    def vector(self, kind: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One kept ``[n]`` tensor per (kind, n, device) (capture rows, next positions)."""
        key = (kind, n, device)
        vec = self.slabs.get(key)
        if vec is None:
            vec = self.slabs[key] = torch.empty(n, dtype=dtype, device=device)
        return vec

    def clear(self) -> None:
        self.slabs.clear()


def positions_bound(cache: Any, past: Any, seq_len: int) -> Optional[int]:
    """An upper bound of 1 + any position of this forward known on the host, or None."""
    get_max = getattr(cache, "get_max_length", None)
    max_len = get_max() if callable(get_max) else None
    if isinstance(max_len, int) and max_len > 0:
        return max_len
    if isinstance(past, int):
        return past + seq_len
    return None


def fused_rows_ok(attention_mask: Any, seq_len: int, past: Any, device: torch.device, backend: str) -> bool:
    """Whether :func:`step_rows` serves this eager forward: the Triton backend on ``device`` (CUDA,
    or the interpreter with ``backend="triton"``), a 2-D mask there covering the forward's tokens with
    unit column stride, and a host-side cache length."""
    kernels = (
        device.type == "cuda"
        if backend == "auto"
        else backend == "triton" and (device.type == "cuda" or INTERPRET)
    )
    return (
        kernels
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.shape[1] >= seq_len
        and attention_mask.device == device
        and attention_mask.stride(1) == 1
        and isinstance(past, int)
    )


def step_rows(
    attention_mask: torch.Tensor,
    seq_len: int,
    past: int,
    capture: Any = None,
    replay: Any = None,
    forced_out: Optional[torch.Tensor] = None,
    slot_out: Optional[torch.Tensor] = None,
    next_pos_out: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One forward's capture rows and replay ids in one kernel launch (``hf/_kernel_step_rows.py``).

    The same values as :func:`~replaymoe.hf.positions.token_positions` followed by
    :meth:`CaptureBuffer.slots` (with the overflow check) and :meth:`ReplayTable.gather`, which are
    its reference (and the path under ``torch.compile``). The same launch writes the capture
    buffer's deferred commit (:meth:`CaptureBuffer.defer`), if any.

    Parameters
    ----------
    attention_mask : torch.Tensor
        ``[B, P]`` (any dtype; nonzero = kept) covering the cached and the forward's ``seq_len``
        tokens (:func:`fused_rows_ok`).
    seq_len, past : int
        ``S`` and the tokens already in the cache.
    capture : CaptureBuffer, optional
        Gives the capture rows ``int64 [B*S]`` (and its ``overflow`` flag).
    replay : ReplayTable, optional
        Gives the forced ids ``int32 [L, B*S, K]`` (into ``forced_out`` when given) and counts
        ``seen`` / ``fallback`` / ``uncovered`` (:meth:`ReplayTable.count_uncovered`'s counts, by batch
        row): the launch is the producer that :meth:`ReplayTable.lookup` picks, reading the table
        through :meth:`ReplayTable.kernel_args`.
    slot_out : torch.Tensor, optional
        ``int64 [B*S]`` for the capture rows (not the pending commit's slots: they are read here).
    next_pos_out : torch.Tensor, optional
        ``int64 [B]``: each row's next position (where a decode step that appends one kept token
        would put it; :class:`DecodeHead` continues from there).

    Returns
    -------
    (slot or None, forced or None)
    """
    T = attention_mask.shape[0] * seq_len
    dev = attention_mask.device
    slot = pending = None
    if capture is not None:
        slot = slot_out if slot_out is not None else torch.empty(T, dtype=torch.int64, device=dev)
        pending = capture.take_pending()
        assert pending is None or pending[1] is not slot, "the pending slots are read by this launch"
    launch = partial(_launch_step_rows, attention_mask, seq_len, past, capture, slot, pending, next_pos_out)
    if replay is None:
        launch(None, None)
        return slot, None
    return slot, replay.lookup(kernel=launch, out=forced_out)  # the table's producer: this launch


def _launch_step_rows(
    attention_mask: torch.Tensor,
    seq_len: int,
    past: int,
    capture: Any,
    slot: Optional[torch.Tensor],
    pending: Optional[tuple],
    next_pos_out: Optional[torch.Tensor],
    rows: Optional[ReplayTable.KernelArgs],
    forced_out: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """:func:`step_rows`'s launch, with the replay table's ``rows`` (:meth:`ReplayTable.kernel_args`)
    or None; returns the forced ids (``forced_out`` when given) or None without ``rows``."""
    B, P = attention_mask.shape
    T = B * seq_len
    dev = attention_mask.device
    forced = None
    if rows is not None:
        L, K = rows.num_layers, rows.top_k
        forced = (
            forced_out if forced_out is not None else torch.empty((L, T, K), dtype=torch.int32, device=dev)
        )
    else:
        L, K = 0, 1
    if T == 0:
        if pending is not None:
            capture.pending = pending
            capture.flush()
        return forced
    if pending is not None:
        L, _, K = pending[0].shape  # the capture's layers (replay's, when both are on: the same)
    d = attention_mask  # stands in for the pointers of the parts that are off
    cap, rep, pend = capture is not None, rows is not None, pending is not None
    table, counters = (rows[:6], rows[6:9]) if rows is not None else ((d, K, 0, d, d, d), (d, d, d))
    args = (  # in the kernel's order
        attention_mask, attention_mask.stride(0), P, seq_len, past + seq_len - P,
        slot if cap else d, capture.seq_cap if cap else 1, capture.batch_cap * capture.seq_cap if cap else 0,
        capture.overflow_i8 if cap else d,
        *table, d if forced is None else forced, T * K, *counters, L,
        pending[0] if pend else d, pending[1] if pend else d, pending[1].shape[0] if pend else 0,
        capture.ids if pend else d, capture.ids.stride(0) if pend else 0,
    )  # fmt: skip
    ints = [a for a in args if isinstance(a, int)]
    nxt = next_pos_out is not None
    consts = dict(K=K, KP=next_power_of_2(K), CAPTURE=cap, REPLAY=rep, BLOCK=128, PENDING=pend,
                  next_pos_ptr=next_pos_out, NEXT_POS=nxt)  # fmt: skip
    if max(ints) < 2**31 and min(ints) >= -(2**31):  # the int32 variant (the key's promise)
        _STEP_ROWS.launch_fixed((dev.index, attention_mask.dtype, K, cap, rep, pend, nxt), (B,), args, consts)
    else:
        _STEP_ROWS[(B,)](*args, **consts)
    return forced


_STEP_ROWS = fast(step_rows_kernel)
_DECODE_ROWS = fast(decode_rows_kernel)


class DecodeHead:
    """:func:`step_rows` for an eager decode step that appends one kept token to every row, at fixed
    addresses so that it runs inside the first MoE block's CUDA graph (``decode_rows_kernel``).

    Positions come from ``next_pos`` (``int64 [B]``, written by the last :func:`step_rows` with
    ``next_pos_out`` and advanced here); with ``capture``, the previous decode step's deferred commit
    (``staged [L, B, K]`` at the rows in ``slot``) is written first and ``slot`` then holds this
    step's rows; with ``replay``, ``forced [L, B, K]`` gets this step's ids. ``key`` holds every
    address and flag the launch depends on (part of the graph's key).
    """

    __slots__ = ("args", "consts", "grid", "key", "slot", "fixed")

    def __init__(self, next_pos, slot, staged, capture=None, replay=None, forced=None) -> None:
        self.slot = slot
        if replay is None:
            self._bind(next_pos, staged, capture, None, None)
        else:  # the table's producer of this step's ids: this head, which writes ``forced`` at its launch
            replay.lookup(kernel=partial(self._bind, next_pos, staged, capture), out=forced)

    def _bind(self, next_pos, staged, capture, rows: Optional[ReplayTable.KernelArgs], forced):
        """The launch's arguments, with the replay table's ``rows`` (:meth:`ReplayTable.kernel_args`)
        or None; returns ``forced`` (written when the head launches)."""
        B = next_pos.shape[0]
        d = next_pos  # stands in for the pointers of the parts that are off
        cap, rep = capture is not None, rows is not None
        if rows is not None:
            L, K = rows.num_layers, rows.top_k
        else:
            L, _, K = staged.shape
        table, counters = (rows[:6], rows[6:9]) if rows is not None else ((d, 0, 0, d, d, d), (d, d, d))
        self.args = (  # in the kernel's order
            next_pos, self.slot if cap else d, capture.seq_cap if cap else 1,
            capture.batch_cap * capture.seq_cap if cap else 0, capture.overflow_i8 if cap else d,
            *table, forced if rep else d, B * K, *counters, L,
            staged if cap else d, capture.ids if cap else d, capture.ids.stride(0) if cap else 0,
        )  # fmt: skip
        self.consts = dict(K=K, KP=next_power_of_2(K), CAPTURE=cap, REPLAY=rep, PENDING=cap)
        self.grid = (B,)
        self.key = (
            "decode",
            cap,
            rep,
            *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args),
        )
        ints = [a for a in self.args if isinstance(a, int)]
        self.fixed = max(ints) < 2**31 and min(ints) >= -(2**31)  # the int32 variant (launch_fixed's key)
        return forced

    def launch(self) -> None:
        c = self.consts
        if not self.fixed:
            _DECODE_ROWS[self.grid](*self.args, **c)
            return
        key = (self.args[0].device.index, c["K"], c["CAPTURE"], c["REPLAY"])
        _DECODE_ROWS.launch_fixed(key, self.grid, self.args, c)


class DecodeChain:
    """Which eager forward may take a :class:`DecodeHead` instead of :func:`step_rows`.

    It records the last graphed eager forward that :func:`step_rows` served (or a head continued):
    its ``generate`` call, batch ``B``, mask width ``P``, the cache length after it and the capture
    rows' buffer. The next forward continues the chain when it is the same ``generate`` call's next
    decode step: ``S = 1``, the same ``B``, a cache one forward longer and a mask one column wider
    (``generate`` appends a column of ones for every row), and, with capture, the previous step's
    deferred commit still pending in the fixed buffers (a capture buffer that grew wrote it). Any
    other forward ends the chain (:meth:`reset`).

    The capture rows alternate between two kept buffers per token count, so that a :func:`step_rows`
    launch never writes the rows its pending commit reads; a head reads and rewrites one in place
    (each program its own row).
    """

    def __init__(self, buffers: StepBuffers) -> None:
        self.buffers = buffers
        self.state: Optional[tuple] = None  # (generation, B, P, cache length after, slot buffer)
        self._head: Optional[DecodeHead] = None
        self._head_src: Optional[tuple] = None
        self.heads = 0  # forwards served by a head so far

    def reset(self) -> None:
        self.state = None

    def outputs(self, T: int, B: int, device: torch.device, capture: Any) -> tuple[Any, torch.Tensor]:
        """``(slot_out or None, next_pos_out)`` for a graphed forward's :func:`step_rows` (``T = B*S``)."""
        next_pos = self.buffers.vector("next_pos", B, torch.int64, device)
        if capture is None:
            return None, next_pos
        slot = self.buffers.vector("slot0", T, torch.int64, device)
        pending = capture.pending
        if pending is not None and pending[1] is slot:
            slot = self.buffers.vector("slot1", T, torch.int64, device)
        return slot, next_pos

    def served(self, generation: Optional[int], B: int, P: int, past_after: int, slot: Any) -> None:
        """:func:`step_rows` served a graphed forward (with ``next_pos_out``)."""
        self.state = None if generation is None else (generation, B, P, past_after, slot)

    def head(self, generation, B, S, P, past, capture, replay, staged, forced) -> Optional[DecodeHead]:
        """The head for this forward, if it continues the chain (then the chain advances)."""
        st = self.state
        if st is None or generation is None or S != 1 or st[:4] != (generation, B, P - 1, past):
            return None
        slot = st[4]
        if capture is not None:  # the previous step's commit, pending in the fixed buffers (S was 1)
            pending = capture.pending
            if pending is None or pending[0] is not staged or pending[1] is not slot or slot.shape[0] != B:
                return None
        device = staged.device if staged is not None else forced.device
        next_pos = self.buffers.vector("next_pos", B, torch.int64, device)
        src = (  # everything the head's arguments hold (a reloaded pooled replay table replaces its tensors)
            capture, None if capture is None else capture.ids, staged, forced, slot, next_pos, replay,
            *(replay.kernel_args().tensors() if replay is not None else ()),
        )  # fmt: skip
        old = self._head_src
        if self._head is None or old is None or any(x is not y for x, y in zip(src, old)):
            self._head = DecodeHead(next_pos, slot, staged, capture, replay, forced)
            self._head_src = src
        self.state = (generation, B, P, past + 1, slot)
        self.heads += 1
        return self._head

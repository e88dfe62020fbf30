"""The routing-trace data model: :class:`RoutingTrace` and joining traces.

This module's one job is the in-memory trace. A trace holds, for one sequence, the expert ids every
MoE layer chose for every token::

    ids : int16 [N, L, K]     N tokens (positions token_offset .. token_offset+N-1),
                              L MoE layers (trace order), K = top_k columns in the
                              router's selection order; -1 = no routing recorded
                              (a whole [K] row is either -1 or K distinct ids in [0, E)).
    weights : float32 [N, L, K] or None
                              the combine weights the router gave those ids (full recall,
                              ``replay="ids+weights"``): finite in every recorded row, NaN in
                              every missing one. Engines that send ids only give None.

Its constructor checks its arguments with :mod:`replaymoe.record.trace.checks`, its file-format methods
(``save``, ``load``) delegate to :mod:`replaymoe.record.trace.file` and its wire-format methods
(``to_vllm``, ``from_vllm``, ``to_sglang``, ``from_sglang``) come from
:class:`~replaymoe.record.trace.engines.EngineFormats`, which delegates to
:mod:`replaymoe.record.trace.wire`; none of those imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._validation import check_bool, check_choice, check_int, fail
from . import file as _file
from .checks import as_int, as_int_array, check_ids, check_layer_ids, check_token_ids, check_weights
from .engines import EngineFormats

__all__ = ["RoutingFingerprint", "RoutingTrace"]


# --------------------------------------------------------------------------------------------
# the model a trace belongs to
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingFingerprint:
    """What recorded routes are valid for: the routing of the model that made them.

    Routes replayed into a model with another fingerprint would force experts chosen by another
    router, so replay compares the two (:meth:`differences`). ``None`` means unknown (e.g. a vLLM
    payload without model information) and matches anything.

    Attributes
    ----------
    model_id : str or None
        The model's identifier (the HF repo id or path, vLLM's ``model`` field, or the
        architecture's ``model_type`` for a model built from a config).
    layer_ids : tuple of int or None
        Model layer number of each MoE layer (None: MoE layer ``l`` is layer ``l``); compared as a
        set, since replay maps layers by number.
    num_layers : int
        Number of MoE layers.
    num_experts : int or None
        Routed experts E.
    top_k : int
        Experts per token K.
    """

    model_id: str | None
    layer_ids: tuple[int, ...] | None
    num_layers: int
    num_experts: int | None
    top_k: int

    def differences(self, other: RoutingFingerprint, *, model_id: bool = True) -> list[str]:
        """What differs from ``other``, one phrase per field (empty when they match); fields unknown
        on either side match. ``model_id=False`` leaves the model id out (the caller vouches for
        routes of a model known under another name)."""
        out = []
        if model_id and None not in (self.model_id, other.model_id) and self.model_id != other.model_id:
            out.append(f"model_id {self.model_id!r} vs {other.model_id!r}")
        if self.num_layers != other.num_layers:
            out.append(f"{self.num_layers} vs {other.num_layers} MoE layers")
        mine, theirs = self.layer_ids, other.layer_ids
        if mine is not None and theirs is not None and sorted(mine) != sorted(theirs):
            out.append(f"MoE layers {list(mine)} vs {list(theirs)}")
        if None not in (self.num_experts, other.num_experts) and self.num_experts != other.num_experts:
            out.append(f"{self.num_experts} vs {other.num_experts} experts")
        if self.top_k != other.top_k:
            out.append(f"top-{self.top_k} vs top-{other.top_k}")
        return out


# --------------------------------------------------------------------------------------------
# the trace
# --------------------------------------------------------------------------------------------


def _frozen(checked: np.ndarray, given: Any) -> np.ndarray:
    """``checked`` (a checked array of the constructor argument ``given``) as a trace keeps it:
    read-only, and copied first where it still is the caller's memory, so that no edit after the
    trace was made (and replayed, or saved) changes what it holds."""
    if isinstance(given, np.ndarray) and np.may_share_memory(checked, given):
        checked = checked.copy()
    checked.setflags(write=False)
    return checked


class RoutingTrace(EngineFormats):
    """Expert ids recorded for one sequence.

    Parameters
    ----------
    ids : array-like of int, shape [N, L, K]
        Expert ids per token (position ``token_offset + n``), MoE layer and top-k column; -1 = missing
        (e.g. positions served from a prefix cache). Any integer dtype, numpy array or torch tensor;
        stored as C-contiguous int16. A [K] row is either all -1 or K distinct ids in [0, num_experts).
    num_experts : int or None
        Number of routed experts E of the model; ``None`` when unknown (e.g. a vLLM payload without
        model information), in which case consumers that need E infer ``max(id) + 1`` or take it as
        an argument.
    top_k : int
        K; must equal ``ids.shape[2]``.
    layer_ids : sequence of int, optional
        MoE-layer index -> model layer number (length L, distinct). ``None`` = identity. Needed
        because dense layers (e.g. DeepSeek-V3's first three) shift MoE indices.
    model_id : str, optional
        Free-form model identifier (e.g. the HF repo id or vLLM's ``model`` field).
    token_offset : int
        Position in the sequence of ``ids[0]`` (non-zero for a multi-turn continuation or a vLLM
        request with ``routed_experts_prompt_start``).
    token_ids : array-like of int, shape [N], optional
        The token fed at each covered position (``token_offset + n``); -1 where unknown. Capture
        records them (:func:`replaymoe.hf.enable`), and replay then matches a forward's tokens to
        traces by content (the token prefix up to each position) instead of by batch row, so a
        forward over any subset, permutation or chunk of the rollout's rows replays correctly.
    weights : array-like of float, shape [N, L, K], optional
        The combine weights of each recorded row, in the ids' column order (the fp32 weights the
        routing kernel returned: ``ReplayMoE.set_capture(True, weights=True)`` records them), for
        full-recall replay (``replay="ids+weights"``). Stored as C-contiguous float32; every recorded
        row must be finite, and missing rows (-1 ids) are set to NaN. None (the default, and every
        trace read from vLLM or SGLang, which send ids only): ids only.

    Attributes
    ----------
    ids : np.ndarray int16 [N, L, K]
    num_experts, top_k, layer_ids (tuple or None), model_id, token_offset
    token_ids : np.ndarray int64 [N] or None
    weights : np.ndarray float32 [N, L, K] or None
        The three arrays are read-only (the trace's own copies): a trace is checked once, when it is
        made, and replay may keep its device table across calls; ``replace(ids=...)`` makes an edited
        trace.
    format_version : int
        :data:`FORMAT_VERSION` of the file format this class writes.
    """

    format_version = _file.FORMAT_VERSION

    def __init__(
        self,
        ids: Any,
        *,
        num_experts: int | None,
        top_k: int,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
        token_offset: int = 0,
        token_ids: Any = None,
        weights: Any = None,
    ):
        if num_experts is not None:  # Python or numpy ints, never a bool, a float or a str
            num_experts = as_int("num_experts", num_experts, low=1, high=np.iinfo(np.int16).max + 1)
        top_k = as_int("top_k", top_k, low=1, high=num_experts)
        token_offset = as_int("token_offset", token_offset, low=0)
        if model_id is not None and not isinstance(model_id, str):
            fail("model_id", "a str or None", type(model_id).__name__, what="type")
        arr = as_int_array("ids", ids)
        if arr.ndim == 3 and arr.shape[2] != top_k:
            fail("ids", f"shape[2] == top_k == {top_k}", f"shape {arr.shape}", what="shape")
        self.ids: np.ndarray = _frozen(check_ids(arr, num_experts), arr)
        self.num_experts = num_experts
        self.top_k = top_k
        self.layer_ids = check_layer_ids(layer_ids, self.ids.shape[1])
        self.model_id = model_id
        self.token_offset = token_offset
        self.token_ids = (
            None if token_ids is None else _frozen(check_token_ids(token_ids, self.ids.shape[0]), token_ids)
        )
        self.weights: np.ndarray | None = (
            None if weights is None else _frozen(check_weights(weights, self.ids), weights)
        )

    @classmethod
    def from_batch(cls, ids: Any, lengths: Sequence[int], *, num_experts: int | None, top_k: int,
                   layer_ids: Sequence[int] | None = None, model_id: str | None = None, token_ids: Any = None,
                   weights: Any = None) -> list[RoutingTrace]:  # fmt: skip
        """One trace per row of a batch, checked in one pass (what ``R`` calls of the constructor on
        ``ids[b, :lengths[b]]`` give, without ``R`` passes of the checks): ``ids`` [R, n, L, K],
        ``lengths`` [R] (each <= n), ``token_ids`` [R, n] and ``weights`` [R, n, L, K] optional; the
        other arguments as the constructor's, shared by the rows. Beyond a row's length the arrays are
        checked too, so a batch padded with -1 ids (NaN weights, -1 tokens) is what they should hold."""
        arr = as_int_array("ids", ids)
        if arr.ndim != 4:
            fail("ids", "a 4-D array [rows, positions, layers, top_k]", f"shape {arr.shape}", what="shape")
        R, n = arr.shape[:2]
        lens = [check_int("lengths", int(v), low=0, high=n) for v in lengths]
        if len(lens) != R:
            fail("lengths", f"{R} lengths (one per row of ids)", len(lens))
        if R == 0:
            return []
        # the shared arguments' checks, on an empty trace whose attributes every row's trace starts from
        shared = cls(arr[0, :0], num_experts=num_experts, top_k=top_k, layer_ids=layer_ids, model_id=model_id)
        # int16 [R * n, L, K], never a view of the caller's (a CPU capture buffer is written again)
        rows = check_ids(arr.reshape(R * n, *arr.shape[2:]), num_experts)
        rows = rows.copy() if np.may_share_memory(rows, arr) else rows
        tok = None
        if token_ids is not None:
            given = np.asarray(token_ids)
            tok = check_token_ids(given.reshape(-1), R * n)
            tok = tok.copy() if np.may_share_memory(tok, given) else tok
        w = None if weights is None else check_weights(np.asarray(weights).reshape(rows.shape), rows)
        for a in (rows, tok, w):  # the rows' traces share them: read-only, as every trace's arrays
            if a is not None:
                a.setflags(write=False)
        out = []
        for b, length in enumerate(lens):
            t = object.__new__(cls)
            t.__dict__.update(shared.__dict__)
            t.ids = rows[b * n : b * n + length]
            t.token_ids = None if tok is None else tok[b * n : b * n + length]
            t.weights = None if w is None else w[b * n : b * n + length]
            out.append(t)
        return out

    # ---------------------------------------------------------------- basic properties
    @property
    def num_tokens(self) -> int:
        """N, the number of positions the trace covers."""
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers."""
        return int(self.ids.shape[1])

    @property
    def end(self) -> int:
        """One past the last position covered: ``token_offset + num_tokens``."""
        return self.token_offset + self.num_tokens

    @property
    def has_weights(self) -> bool:
        """Whether the trace carries its combine weights (full recall)."""
        return self.weights is not None

    def missing_mask(self) -> np.ndarray:
        """bool [N, L]: True where the (token, layer) row is missing (-1)."""
        return self.ids[..., 0] < 0

    def missing_fraction(self) -> float:
        """Fraction of (token, layer) rows that are missing; 0.0 for an empty trace."""
        m = self.missing_mask()
        return float(m.mean()) if m.size else 0.0

    def model_layer_ids(self) -> tuple[int, ...]:
        """Model layer number of each MoE layer (``layer_ids`` or the identity)."""
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.num_layers))

    @property
    def fingerprint(self) -> RoutingFingerprint:
        """The routing of the model that recorded this trace (what replay checks it against)."""
        return RoutingFingerprint(
            self.model_id, self.layer_ids, self.num_layers, self.num_experts, self.top_k
        )

    def _meta(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layer_ids": list(self.layer_ids) if self.layer_ids is not None else None,
            "model_id": self.model_id,
            "token_offset": self.token_offset,
            "token_ids": None if self.token_ids is None else self.token_ids.tolist(),
        }

    def replace(self, **changes: Any) -> RoutingTrace:
        """A copy with some constructor arguments changed (``ids`` and ``weights`` included). When
        ``ids`` change length and ``token_ids`` / ``weights`` are not given, they follow: cut, or
        extended with unknown tokens (-1) and missing weights (NaN)."""
        kw = {"ids": self.ids.copy(), **self._meta(), "weights": self.weights}
        kw.update(changes)
        ids = kw.pop("ids")
        tok, w = kw["token_ids"], kw["weights"]
        n = len(ids)
        if "token_ids" not in changes and tok is not None and len(tok) != n:  # ids cut or extended:
            kw["token_ids"] = (list(tok) + [-1] * n)[:n]  # the tokens follow (unknown past the old end)
        if "weights" not in changes and w is not None and len(w) != n:
            pad = np.full((max(n - len(w), 0), *w.shape[1:]), np.nan, dtype=np.float32)
            kw["weights"] = np.concatenate([w, pad])[:n]
        return RoutingTrace(ids, **kw)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        mine, theirs = self.weights, other.weights
        if mine is None or theirs is None:
            same_w = mine is None and theirs is None
        else:
            same_w = np.array_equal(mine, theirs, equal_nan=True)
        return self._meta() == other._meta() and np.array_equal(self.ids, other.ids) and same_w

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(tokens={self.num_tokens}, layers={self.num_layers}, top_k={self.top_k}, "
            f"num_experts={self.num_experts}, token_offset={self.token_offset}, model_id={self.model_id!r}, "
            f"missing={self.missing_fraction():.3f})"
        )

    # ---------------------------------------------------------------- file format
    def save(self, path: str | os.PathLike, *, compress: bool = True) -> None:
        """Write the trace to ``path`` atomically (the format: :mod:`replaymoe.record.trace.file`).

        Parameters
        ----------
        path : str or os.PathLike
            Target file; written exactly there (no suffix is added). Its directory must exist.
        compress : bool
            Deflate the archive members (ids of < 256 experts typically shrink 2-3x).
        """
        check_bool("compress", compress)
        _file.write_trace(path, self.ids, self._meta(), compress=compress, weights=self.weights)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read a trace written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist.
        TraceFormatError
            The file is truncated, corrupted (checksum or archive CRC), not a replaymoe trace, or of a
            newer format version. The message names the file.
        """
        return _file.read_trace(path, cls)

    # ---------------------------------------------------------------- combining
    @classmethod
    def concat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Join traces of consecutive position ranges (e.g. prompt then completion).

        Each trace must start where the previous one ends (``t[i+1].token_offset == t[i].end``); the
        result starts at ``traces[0].token_offset``. Metadata must agree (see :meth:`merge`).
        """
        traces = list(traces)
        if not traces:
            fail("traces", "at least one RoutingTrace", "an empty sequence")
        meta = _common_meta(traces)
        for prev, nxt in zip(traces, traces[1:]):
            if nxt.token_offset != prev.end:
                fail(
                    "traces",
                    f"consecutive position ranges (next token_offset == {prev.end})",
                    f"token_offset {nxt.token_offset}; use RoutingTrace.merge for gaps or overlaps",
                )
        ids = np.concatenate([t.ids for t in traces], axis=0)
        weights = None
        if _all_weighted(traces):
            weights = np.concatenate([t.weights for t in traces if t.weights is not None], axis=0)
        return cls(ids, **meta, token_offset=traces[0].token_offset, weights=weights)

    @classmethod
    def merge(cls, traces: Sequence[RoutingTrace], *, on_conflict: str = "error") -> RoutingTrace:
        """Overlay traces by position (multi-turn: turn 2's payload starts at its prompt offset).

        The result covers ``min(token_offset)`` .. ``max(end)``; positions no trace covers are -1. A
        recorded row fills a missing one; where two traces record *different* experts for the same
        (position, layer), ``on_conflict`` decides: ``"error"`` (ValueError naming the position),
        ``"first"`` (keep the earlier trace's row) or ``"last"`` (take the later one's).
        """
        check_choice("on_conflict", on_conflict, ("error", "first", "last"))
        traces = list(traces)
        if not traces:
            fail("traces", "at least one RoutingTrace", "an empty sequence")
        meta = _common_meta(traces)
        start = min(t.token_offset for t in traces)
        weighted = _all_weighted(traces)
        ids, weights = _overlay(traces, start, on_conflict, weighted)
        return cls(ids, **meta, token_offset=start, weights=weights)


def _all_weighted(traces: Sequence[RoutingTrace]) -> bool:
    """Whether every trace carries weights (the join then does); a mix raises ValueError."""
    have = [t.weights is not None for t in traces]
    if any(have) and not all(have):
        fail("traces", "all with weights or all without (full recall joins whole traces)",
             f"weights on traces {[i for i, h in enumerate(have) if h]} only")  # fmt: skip
    return all(have)


def _overlay(
    traces: Sequence[RoutingTrace], start: int, on_conflict: str, weighted: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """int16 [max(end) - start, L, K]: the ids of ``traces`` overlaid by position from ``start`` (-1 where
    no trace records a row), clashes settled by ``on_conflict`` (see :meth:`RoutingTrace.merge`); and,
    when ``weighted``, their weights taken with the same rows (NaN elsewhere)."""
    stop = max(t.end for t in traces)
    L, K = traces[0].num_layers, traces[0].top_k
    out = np.full((stop - start, L, K), -1, dtype=np.int16)
    wout = np.full((stop - start, L, K), np.nan, dtype=np.float32) if weighted else None
    for t in traces:
        dst = out[t.token_offset - start : t.end - start]
        have_new = t.ids[..., 0] >= 0
        have_old = dst[..., 0] >= 0
        clash = have_new & have_old & (dst != t.ids).any(-1)
        if clash.any() and on_conflict == "error":
            n, layer = np.argwhere(clash)[0].tolist()
            fail(
                "traces",
                "the same experts where traces overlap (or on_conflict='first'/'last')",
                f"{dst[n, layer].tolist()} vs {t.ids[n, layer].tolist()} at position "
                f"{t.token_offset + n}, layer {layer}",
            )
        take = have_new & ~have_old if on_conflict != "last" else have_new
        dst[take] = t.ids[take]
        if wout is not None and t.weights is not None:
            wdst = wout[t.token_offset - start : t.end - start]
            wdst[take] = t.weights[take]
    return out, wout


def _common_meta(traces: Sequence[RoutingTrace]) -> dict[str, Any]:
    """Metadata shared by ``traces`` (None = unknown is compatible with any value)."""
    for i, t in enumerate(traces):
        if not isinstance(t, RoutingTrace):
            fail(f"traces[{i}]", "a RoutingTrace", type(t).__name__, what="type")
    first = traces[0]
    out: dict[str, Any] = {"top_k": first.top_k}
    for i, t in enumerate(traces[1:], 1):
        if (t.num_layers, t.top_k) != (first.num_layers, first.top_k):
            fail(
                f"traces[{i}]",
                f"layers={first.num_layers}, top_k={first.top_k} like traces[0]",
                f"layers={t.num_layers}, top_k={t.top_k}",
            )
    for key in ("num_experts", "layer_ids", "model_id"):
        known = {getattr(t, key) for t in traces if getattr(t, key) is not None}
        if len(known) > 1:
            fail("traces", f"one {key} across traces", sorted(map(str, known)))
        out[key] = known.pop() if known else None
    return out

"""The report of a route check: what :func:`replaymoe.hf.conformance.check_routes` found, as data and text.

The check itself teacher-forces a model (:mod:`replaymoe.hf.conformance`); its result needs no model,
so it lives here: :class:`RouteCheckReport` (per-layer :class:`LayerCheck`, per-sequence
:class:`SequenceCheck`, the :class:`Defect` kinds found with a first :class:`Example` each, the
model's :class:`ModelLayout`), the table ``str(report)`` prints, the dict :meth:`~RouteCheckReport.to_dict`
returns (``replaymoe check --json``), and the defect taxonomy with its exit bits.

Exit codes (:class:`CheckCode`, bits OR-ed; ``replaymoe check`` exits with them, 2 stays "cannot
run as asked" and is never a sum of these bits, nor are 130 and 141):

====  ==================  ==========================================================
bit   name                defects (:data:`DEFECT_KINDS`)
====  ==================  ==========================================================
1     DISAGREEMENT        disagreement above ``max_disagreement`` in some layer; a layer where
                          more than half of the compared rows were excused as near-ties
4     INVALID_IDS         ids out of range, repeated ids in a row
8     DEGENERATE_ROWS     all-zero rows, constant layers, rows of -1 (missing) within a sequence
16    LAYOUT              non-zero dense-layer columns, a column count that fits nothing, a row
                          count that does not fit the sequence's tokens, a MoE layer with no routed
                          row in a sequence whose other MoE layers are routed, or with no judged
                          row at all, a trace recorded for another model (its model id or MoE
                          layers; other experts or top-k are refused as an input error, exit 2)
32    MISALIGNED          a sequence agrees better at another row shift
64    DTYPE_OVERFLOW      a dtype narrower than E, wrapped ids, ids at the dtype's maximum
====  ==================  ==========================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any

import numpy as np

__all__ = [
    "DEFECT_KINDS",
    "CheckCode",
    "Defect",
    "Defects",
    "Example",
    "LayerCheck",
    "ModelLayout",
    "RouteCheckReport",
    "SequenceCheck",
]


class CheckCode(IntFlag):
    """Exit-status bits of a route check (module docstring); 0 = clean. Never 2, 130 or 141."""

    OK = 0
    DISAGREEMENT = 1
    INVALID_IDS = 4
    DEGENERATE_ROWS = 8
    LAYOUT = 16
    MISALIGNED = 32
    DTYPE_OVERFLOW = 64


# defect kind -> (its exit bit, what it means)
DEFECT_KINDS: dict[str, tuple[CheckCode, str]] = {
    "out_of_range": (CheckCode.INVALID_IDS, "ids outside [0, E) (a whole row of -1 is missing, not invalid)"),
    "duplicate": (CheckCode.INVALID_IDS, "an id repeated within a row"),
    "all_zero": (CheckCode.DEGENERATE_ROWS, "rows of all zeros (a kernel that never wrote its routing)"),
    "constant": (
        CheckCode.DEGENERATE_ROWS,
        "one expert set at every row of a layer; the recomputation varies",
    ),
    "missing_rows": (
        CheckCode.DEGENERATE_ROWS,
        "rows of all -1 (missing) within a sequence, in a layer it routes elsewhere: replay refuses them "
        'unless missing="native" (positions before the prompt start are not rows)',
    ),
    "dense_column": (CheckCode.LAYOUT, "non-zero rows in the column of a dense (non-MoE) layer"),
    "column_count": (
        CheckCode.LAYOUT,
        "a column count that is neither the MoE-layer nor the decoder-layer count",
    ),
    "row_count": (
        CheckCode.LAYOUT,
        "a row count that is not the sequence's tokens - 1 - prompt start (the rows that fit are judged)",
    ),
    "unrouted_layer": (
        CheckCode.LAYOUT,
        "a MoE layer with every row -1 in a sequence whose other MoE layers are routed, or with no judged "
        "row in any source (no column for it) that no other defect explains",
    ),
    "fingerprint": (
        CheckCode.LAYOUT,
        "a trace recorded for another model: its model id or MoE layers differ from the model's (replay "
        "would refuse it); a trace of other experts or top-k is refused before the check (exit 2)",
    ),
    "misaligned": (CheckCode.MISALIGNED, "rows agree better at a shift of the positions than at 0"),
    "dtype_narrow": (CheckCode.DTYPE_OVERFLOW, "a payload dtype that cannot hold the ids 0 .. E-1"),
    "dtype_overflow": (CheckCode.DTYPE_OVERFLOW, "rows with wrapped ids, or ids at the dtype's maximum >= E"),
    "disagreement": (
        CheckCode.DISAGREEMENT,
        "rows whose set differs from the recomputation, above the threshold",
    ),
    "excused": (
        CheckCode.DISAGREEMENT,
        "a layer where more than half of the compared rows were excused as near-ties: the near-tie "
        "tolerance, not the routes, passed it",
    ),
}


@dataclass(frozen=True)
class Example:
    """Where a defect was first seen. Fields that do not apply are None.

    Attributes
    ----------
    source : str
        The routes' source (file, choice).
    row, position : int or None
        Payload row and its sequence position (``start + row``).
    layer, column : int or None
        Model layer number and payload column.
    ids : tuple of int or None
        The engine's row, as sent.
    recomputed : tuple of int or None
        The recomputed expert set (sorted).
    note : str
        Anything else (a payload-level defect's reason).
    """

    source: str
    row: int | None = None
    position: int | None = None
    layer: int | None = None
    column: int | None = None
    ids: tuple[int, ...] | None = None
    recomputed: tuple[int, ...] | None = None
    note: str = ""

    def __str__(self) -> str:
        parts = [self.source]
        if self.row is not None:
            parts.append(f"row {self.row} (position {self.position})")
        if self.layer is not None:
            parts.append(f"layer {self.layer}" + ("" if self.column is None else f" (column {self.column})"))
        elif self.column is not None:
            parts.append(f"column {self.column}")
        s = ", ".join(parts)
        if self.ids is not None:
            s += f": {list(self.ids)}"
        if self.recomputed is not None:
            s += f", recomputed {list(self.recomputed)}"
        if self.note:
            s += f" ({self.note})"
        return s

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("source", "row", "position", "layer", "column", "note")}
        d["ids"] = None if self.ids is None else list(self.ids)
        d["recomputed"] = None if self.recomputed is None else list(self.recomputed)
        return d


@dataclass(frozen=True)
class Defect:
    """One defect kind found: how many, the first example, its exit bit.

    Attributes
    ----------
    kind : str
        A key of :data:`DEFECT_KINDS`.
    count : int
        How many ``unit`` have it.
    unit : str
        ``"rows"``, ``"layers"`` (sequence x layer; model layers for ``excused``, and for
        ``unrouted_layer`` found in no source),
        ``"sequences"``, ``"payloads"`` or ``"sources"``.
    first : Example
        The first occurrence.
    detail : str
        A rate or a reason, when there is one.
    sources : tuple of str
        Every source that has it, in the order seen (empty for a defect of the model's layers as a
        whole, ``unrouted_layer``).
    """

    kind: str
    count: int
    unit: str
    first: Example
    detail: str = ""
    sources: tuple[str, ...] = ()

    @property
    def code(self) -> CheckCode:
        """The exit bit of this kind."""
        return DEFECT_KINDS[self.kind][0]

    def __str__(self) -> str:
        detail = f"; {self.detail}" if self.detail else ""
        n = len(self.sources)
        where = ""
        if n > 1:
            names = ", ".join(self.sources[:3]) + (f", +{n - 3} more" if n > 3 else "")
            where = f" in {n} sources ({names})"
        return f"{self.kind} [{int(self.code)}]: {self.count} {self.unit}{where}{detail}; first: {self.first}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "code": int(self.code),
            "count": self.count,
            "unit": self.unit,
            "detail": self.detail,
            "sources": list(self.sources),
            "first": self.first.to_dict(),
        }


@dataclass(frozen=True)
class LayerCheck:
    """One MoE layer, over every sequence.

    Attributes
    ----------
    layer, index : int
        Model layer number and MoE-layer index.
    rows : int
        Rows examined (not missing; rows past a sequence's last token are not examined).
    missing : int
        Rows of all -1 (the missing marker), not examined.
    agreement : float
        Fraction of ``rows`` whose set equals the recomputed set (nan without rows).
    near_tie_rate : float
        Fraction of ``rows`` at a recomputed near-tie.
    excused : int
        Rows whose set differs from the recomputed one only within a near-tie (a top-K choice up to
        the tolerance): not judged.
    judged : int
        Rows the disagreement rate counts: those no defect or near-tie explains
        (:mod:`replaymoe.hf.conformance`); a misaligned sequence's rows are judged at its best shift.
    disagreement : float
        Fraction of ``judged`` that disagree (nan when none is judged).
    out_of_range, duplicate, all_zero, overflow : int
        Rows with each defect.
    constant : int
        Sequences whose rows of this layer are constant: within the sequence (at least
        ``min_constant_rows`` rows), or as part of a layer constant across the sequences.
    shift_agreement : tuple of float
        Agreement at each shift of the report's ``shifts`` (defective rows left out).
    best_shift : int
        The shift of highest agreement (0 on ties); the table shows ``-`` for a layer with no judged
        row (a constant layer's chance matches name no shift).
    """

    layer: int
    index: int
    rows: int
    missing: int
    agreement: float
    near_tie_rate: float
    excused: int
    judged: int
    disagreement: float
    out_of_range: int
    duplicate: int
    all_zero: int
    overflow: int
    constant: int
    shift_agreement: tuple[float, ...]
    best_shift: int


@dataclass(frozen=True)
class SequenceCheck:
    """One sequence's routes.

    Attributes
    ----------
    source : str
    start, rows, expected_rows, tokens : int
        Position of row 0, rows sent, rows expected (``tokens - 1 - start`` for engine payloads),
        tokens teacher-forced.
    dtype : str
        The payload's element type.
    columns : int
    layout : str
        How columns map to layers: ``"moe"`` (one per MoE layer), ``"decoder"`` (one per decoder
        layer), ``"layer_ids"`` (given), ``"trace"`` (a trace's own ``layer_ids``) or ``"unmapped"``.
    agreement : float
        Over its MoE-layer rows (shift 0).
    shift_agreement : tuple of float
    best_shift : int
    misaligned : bool
    """

    source: str
    start: int
    rows: int
    expected_rows: int
    tokens: int
    dtype: str
    columns: int
    layout: str
    agreement: float
    shift_agreement: tuple[float, ...]
    best_shift: int
    misaligned: bool


@dataclass(frozen=True)
class ModelLayout:
    """What the check reads off the model (:func:`replaymoe.hf.conformance.model_layout`).

    Attributes
    ----------
    num_hidden_layers : int
        Decoder layers.
    moe_layers : tuple of int
        The MoE layers' numbers.
    num_experts, top_k : int
        E and K.
    """

    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class RouteCheckReport:
    """What :func:`~replaymoe.hf.conformance.check_routes` found. ``str(report)`` is the table
    ``replaymoe check`` prints, :meth:`to_dict` its ``--json``; :attr:`exit_code` the :class:`CheckCode`
    bits.

    Attributes
    ----------
    layers : tuple of LayerCheck
        One per MoE layer of the model.
    sequences : tuple of SequenceCheck
    defects : tuple of Defect
        Every defect kind found (empty: clean).
    layout : ModelLayout
    agreement, near_tie_rate, disagreement : float
        Over every layer's rows (``disagreement`` over the judged rows).
    shifts : tuple of int
    shift_agreement : tuple of float
        Overall agreement at each shift.
    best_shift : int
    max_disagreement, near_tie : float
        The thresholds used.
    model_id : str
    notes : tuple of str
        Remarks that are not defects (none at present: a row count that does not fit the tokens is
        the ``row_count`` defect).
    """

    layers: tuple[LayerCheck, ...]
    sequences: tuple[SequenceCheck, ...]
    defects: tuple[Defect, ...]
    layout: ModelLayout
    agreement: float
    near_tie_rate: float
    disagreement: float
    shifts: tuple[int, ...]
    shift_agreement: tuple[float, ...]
    best_shift: int
    max_disagreement: float
    near_tie: float
    model_id: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def code(self) -> CheckCode:
        """The OR of the defects' bits (``CheckCode.OK`` when clean)."""
        code = CheckCode.OK
        for d in self.defects:
            code |= d.code
        return code

    @property
    def exit_code(self) -> int:
        """``int(self.code)``: what ``replaymoe check`` exits with."""
        return int(self.code)

    @property
    def ok(self) -> bool:
        """No defect."""
        return not self.defects

    def defect(self, kind: str) -> Defect | None:
        """The defect of ``kind``, or None."""
        return next((d for d in self.defects if d.kind == kind), None)

    def __str__(self) -> str:
        lay = self.layout
        rows = sum(s.rows for s in self.sequences)
        lines = [
            f"route check: {len(self.sequences)} sequence(s), {rows} rows; model {self.model_id or '-'}: "
            f"{lay.num_hidden_layers} decoder layers, MoE layers {_ranges(lay.moe_layers)}, "
            f"E={lay.num_experts}, top_k={lay.top_k}",
        ]
        head = ["layer", "rows", "agree", "near-tie", "excused", "judged", "disagree", "missing", "zero",
                "const", "range", "dup", "ovfl", "shift"]  # fmt: skip
        table = [
            [str(c.layer), str(c.rows), _f(c.agreement), _f(c.near_tie_rate), str(c.excused), str(c.judged),
             _f(c.disagreement), str(c.missing), str(c.all_zero), str(c.constant), str(c.out_of_range),
             str(c.duplicate), str(c.overflow), f"{c.best_shift:+d}" if c.judged else "-"]
            for c in self.layers
        ]  # fmt: skip
        table.append(
            ["all", str(sum(c.rows for c in self.layers)), _f(self.agreement), _f(self.near_tie_rate),
             str(sum(c.excused for c in self.layers)), str(sum(c.judged for c in self.layers)),
             _f(self.disagreement), str(sum(c.missing for c in self.layers)),
             str(sum(c.all_zero for c in self.layers)), str(sum(c.constant for c in self.layers)),
             str(sum(c.out_of_range for c in self.layers)), str(sum(c.duplicate for c in self.layers)),
             str(sum(c.overflow for c in self.layers)),
             f"{self.best_shift:+d}" if any(c.judged for c in self.layers) else "-"]
        )  # fmt: skip
        lines += _table(head, table)
        lines.append("  sequences (agree at a row shift: over the rows without a defect):")
        shead = ["source", "start", "rows", "expected", "dtype", "columns", "agree",
                 *(f"at {s:+d}" for s in self.shifts)]  # fmt: skip
        stable = [
            [s.source, str(s.start), str(s.rows), str(s.expected_rows), s.dtype, f"{s.columns} ({s.layout})",
             _f(s.agreement), *(_f(a, 2) for a in s.shift_agreement)]
            for s in self.sequences
        ]  # fmt: skip
        lines += ["  " + x for x in _table(shead, stable, left=1)]
        lines += [f"  note: {n}" for n in self.notes]
        thresholds = f"max disagreement {self.max_disagreement:g}, near-tie {self.near_tie:g}"
        if self.ok:
            lines.append(f"  clean ({thresholds}): exit 0")
        else:
            lines.append(f"  defects ({thresholds}):")
            lines += [f"    {d}" for d in self.defects]
            names = " | ".join(str(c.name) for c in CheckCode if c and c in self.code)  # members: named
            lines.append(f"  exit {self.exit_code} ({names})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nan -> None) of everything the report holds, plus ``exit_code``."""
        return _jsonable(
            {
                "exit_code": self.exit_code,
                "codes": [c.name for c in CheckCode if c and c in self.code],
                "model_id": self.model_id,
                "layout": self.layout.__dict__,
                "agreement": self.agreement,
                "near_tie_rate": self.near_tie_rate,
                "disagreement": self.disagreement,
                "shifts": list(self.shifts),
                "shift_agreement": list(self.shift_agreement),
                "best_shift": self.best_shift,
                "max_disagreement": self.max_disagreement,
                "near_tie": self.near_tie,
                "layers": [c.__dict__ for c in self.layers],
                "sequences": [s.__dict__ for s in self.sequences],
                "defects": [d.to_dict() for d in self.defects],
                "notes": list(self.notes),
            }
        )


class Defects:
    """Defect counts with the first example of each (internal): the report's
    :attr:`~RouteCheckReport.defects` as a check finds them, in :data:`DEFECT_KINDS` order once frozen."""

    def __init__(self) -> None:
        self.found: dict[str, list[Any]] = {}

    def add(
        self, kind: str, count: int, unit: str, first: Example, detail: str = "", sources: Any = None
    ) -> None:
        """Count ``count`` more of ``kind`` in ``sources`` (default ``first``'s); the first call's
        example, unit and detail are kept."""
        if count <= 0:
            return
        if kind not in self.found:
            self.found[kind] = [0, unit, first, detail, {}]
        entry = self.found[kind]
        entry[0] += count
        for s in (first.source,) if sources is None else sources:
            entry[4].setdefault(s, None)  # an ordered set

    def freeze(self) -> tuple[Defect, ...]:
        order = list(DEFECT_KINDS)
        return tuple(
            Defect(k, c, u, f, d, tuple(s))
            for k, (c, u, f, d, s) in sorted(self.found.items(), key=lambda kv: order.index(kv[0]))
        )


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.integer, np.floating)):
        return _jsonable(x.item())
    return x


def _f(x: float, digits: int = 4) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"


def _ranges(nums: Sequence[int]) -> str:
    return ", ".join(str(n) for n in nums) if len(nums) <= 8 else f"{nums[0]}..{nums[-1]} ({len(nums)})"


def _table(head: list[str], rows: list[list[str]], left: int = 0) -> list[str]:
    w = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(head)]

    def line(vals: list[str]) -> str:
        return "  " + "  ".join(
            v.ljust(x) if j < left else v.rjust(x) for j, (v, x) in enumerate(zip(vals, w))
        )

    return [line(head)] + [line(r) for r in rows]

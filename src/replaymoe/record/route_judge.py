"""The judgement of engine rows against a model's recomputation: numpy only, no model.

:func:`replaymoe.hf.conformance.check_routes` runs the model (one teacher-forced forward per
sequence, the router's selection scores at the near-ties); :class:`RouteJudge` here takes each
sequence's rows beside that recomputation, classifies every row (missing, defective, matching,
excused at a near-tie, judged), finds the alignment, and sums the findings per MoE layer across the
sequences into a :class:`~replaymoe.record.route_check.RouteCheckReport`. The rules are documented in
:mod:`replaymoe.hf.conformance`; the constants they use are here.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from .._validation import fail
from .engine_routes import EngineRoutes
from .route_check import Defects, Example, LayerCheck, ModelLayout, RouteCheckReport, SequenceCheck

__all__ = ["LayerTies", "RouteJudge", "columns", "refuse_unrouted", "tie_excused"]

# a sequence is misaligned when its best shift s != 0 compares at least MISALIGN_ROWS rows (rows, not
# row x layer pairs), its agreement there reaches MISALIGN_MIN and beats shift 0 by MISALIGN_GAIN, and
# at least MISALIGN_MARGIN more rows agree in every layer than at shift 0 (a few chance matches of a
# short sequence are not an off-by-one)
MISALIGN_MIN, MISALIGN_GAIN, MISALIGN_ROWS, MISALIGN_MARGIN = 0.5, 0.2, 8, 4
_MAX_GROUP_CHOICES = 256  # kept-group sets tried for one row at a group near-tie


class LayerTies(NamedTuple):
    """One MoE layer's recomputed near-ties in one forward (what the router pre-hooks give).

    ``near`` bool [T]: positions at a near-tie; ``at`` int64 [T]: each near position's row of
    ``scores``, -1 elsewhere; ``scores`` float32 [n, E]: the selection scores at those positions
    before any group masking; ``n_group`` 1 without group selection."""

    near: np.ndarray
    at: np.ndarray
    scores: np.ndarray
    top_k: int
    n_group: int
    topk_group: int
    tol: float


def _gap_ok(score: np.ndarray, chosen: np.ndarray, pool: np.ndarray, tol: float) -> bool:
    """No member of ``pool`` outside ``chosen`` scores more than ``tol`` above a chosen one (bool masks)."""
    left = score[pool & ~chosen]
    if left.size == 0:
        return True
    return bool(left.max() - score[chosen].min() <= tol)  # nan (-inf - -inf): False


def tie_excused(u: np.ndarray, x: np.ndarray, ties: LayerTies) -> bool:
    """Whether the engine's set ``x`` (K distinct ids in ``[0, E)``) is a top-K choice of the selection
    scores ``u`` [E] up to the near-tie tolerance: no expert it left out scores more than
    ``tol * max(1, |score_K|)`` above one it chose, so that every expert where it differs from the
    recomputed set is within that tolerance of the K-th score. Under group selection (DeepSeek-V3) the
    groups holding ``x`` must be a kept-group choice up to the same tolerance of the group scores, and
    ``x`` a top-K choice within them."""
    E, K, ng, kept = u.size, ties.top_k, ties.n_group, ties.topk_group
    chosen = np.zeros(E, dtype=bool)
    chosen[np.asarray(x, dtype=np.int64)] = True
    if ng <= 1 or kept >= ng:
        sk = float(np.sort(u)[-K])
        return _gap_ok(u, chosen, np.ones(E, dtype=bool), ties.tol * max(1.0, abs(sk)))
    size = E // ng
    g = np.sort(u.reshape(ng, size), axis=1)[:, ::-1]
    gs = g[:, :2].sum(1) if size >= 2 else g[:, 0]  # methods.selection_scores' group score
    order = np.argsort(-gs, kind="stable")
    kept_now = np.zeros(ng, dtype=bool)
    kept_now[order[:kept]] = True
    sk = float(np.sort(np.where(np.repeat(kept_now, size), u, -np.inf))[-K])
    tol, tol_g = ties.tol * max(1.0, abs(sk)), ties.tol * max(1.0, abs(float(gs[order[kept - 1]])))
    need = sorted(set((np.flatnonzero(chosen) // size).tolist()))
    if len(need) > kept:
        return False
    others = [int(v) for v in order if v not in need]  # best groups first: the recomputed choice first
    for extra in itertools.islice(itertools.combinations(others, kept - len(need)), _MAX_GROUP_CHOICES):
        keep = np.zeros(ng, dtype=bool)
        keep[need + list(extra)] = True
        if _gap_ok(gs, keep, np.ones(ng, dtype=bool), tol_g) and _gap_ok(
            u, chosen, np.repeat(keep, size), tol
        ):
            return True
    return False


def rate(num: Any, den: Any) -> Any:
    """``num / den`` elementwise, nan where ``den`` is 0 (a float for scalars)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)
    return float(out) if out.ndim == 0 else out


def best_shift(agree: np.ndarray, compared: np.ndarray, shifts: tuple[int, ...]) -> int:
    """The shift of highest agreement among those with compared rows; 0 wins ties, then smaller |shift|."""
    cands = [
        (agree[j], -abs(s), s) for j, s in enumerate(shifts) if compared[j] > 0 and math.isfinite(agree[j])
    ]
    return max(cands)[2] if cands else 0


def columns(
    r: EngineRoutes, lay: ModelLayout, layer_ids: tuple[int, ...] | None
) -> tuple[str, list[int] | None]:
    """(layout name, model layer number of each column or None when unmapped) of ``r``'s payload.

    ``layer_ids`` given: the model layer of each column, or, for a payload of one column per decoder
    layer, one number per MoE layer naming the MoE layers' columns (the form of ``inspect`` and
    ``demo --from-vllm``: column ``c`` is layer ``c``), which must be the model's MoE layers; the
    other columns are dense layers', checked to be zero."""
    ids = layer_ids if layer_ids is not None else r.layer_ids
    moe, n_dec = lay.moe_layers, lay.num_hidden_layers
    if layer_ids is not None and len(layer_ids) == len(moe) != r.columns == n_dec:  # the MoE layers' columns
        if sorted(layer_ids) != list(moe):
            want = f"the model's MoE layers {','.join(map(str, moe))} (one number per MoE layer names their"
            fail("layer_ids", f"{want} columns of {r.source}, one column per decoder layer)", list(layer_ids))
        return "layer_ids", list(range(n_dec))
    if ids is not None:
        name = "layer_ids" if layer_ids is not None else f"layer_ids of {r.source}"  # given, or recorded
        if len(ids) != r.columns:
            moe_form = layer_ids is not None and r.columns == n_dec
            also = f", or {len(moe)}: the MoE layers' columns" if moe_form else ""
            fail(name, f"{r.columns} layer numbers (one per column of {r.source}){also}", list(ids))
        if max(ids) >= lay.num_hidden_layers:
            fail(name, f"layer numbers below the model's {lay.num_hidden_layers} layers", list(ids))
        return ("layer_ids" if layer_ids is not None else "trace"), list(ids)
    if r.columns == len(lay.moe_layers):
        return "moe", list(lay.moe_layers)
    if r.columns == lay.num_hidden_layers:
        return "decoder", list(range(lay.num_hidden_layers))
    return "unmapped", None


def refuse_unrouted(r: EngineRoutes, lay: ModelLayout, col_layers: list[int] | None) -> None:
    """Refuse (ValueError naming the source) mapped routes with no routed row in a MoE layer's column:
    no column maps to a MoE layer, or every such row is -1 (dense columns of zeros hid that)."""
    if col_layers is None:
        return  # unmapped: the column_count defect
    moe = [c for c, n in enumerate(col_layers) if n in lay.moe_layers]
    rows = r.ids[: max(0, len(r.token_ids) - r.start)]
    if not moe:
        why = f"its columns are layers {col_layers}, none a MoE layer of the model ({list(lay.moe_layers)})"
    elif (rows[:, moe] == -1).all():
        why = f"every row of its MoE-layer columns {moe} is -1 (missing)"
    else:
        return
    fail(
        f"routes of {r.source}", "at least one routed row", f"no routed rows to check ({why})", what="length"
    )


def _start_hint(r: EngineRoutes, best: int) -> str:
    """What a best shift says about the prompt start (never a start below 0)."""
    s = r.start + best
    if s < 0:
        return f"the rows carry {-s} extra leading row(s) before position 0"
    if best > 0:
        fits = r.prompt_tokens is None or s <= r.prompt_tokens
        return f"the first {best} row(s) are missing" + (f", or the prompt start is {s}" if fits else "")
    return f"is the prompt start {s}?"


class _Rows(NamedTuple):
    """One sequence's MoE-layer columns (internal); R rows that fit the tokens, M examined columns."""

    source: str
    pos: np.ndarray  # int [R]: the position of each row as sent
    cols: list[int]  # [M]: the payload column of each examined MoE layer
    col_layers: list[int]  # the model layer number of every payload column
    li: np.ndarray  # int [M]: the MoE-layer index of each examined column
    X: np.ndarray  # int64 [R, M, K]: the engine's rows, as sent
    Xs: np.ndarray  # [R, M, K]: the same, sorted

    def at(self, rec: np.ndarray, shift: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(recomputed sets int64 [R, M, K], whether within the sequence bool [R], positions clipped
        int [R]) of row ``i`` against position ``pos[i] + shift``."""
        p = self.pos + shift
        pc = np.clip(p, 0, rec.shape[0] - 1)
        return rec[pc][:, self.li], (p >= 0) & (p < rec.shape[0]), pc

    def example(
        self, mask: np.ndarray, rc: np.ndarray | None = None, shift: int = 0, note: str = ""
    ) -> Example:
        """The first row of ``mask`` (bool [R, M]) as an :class:`Example` (``rc``: its recomputed sets)."""
        i, m = (int(v) for v in np.argwhere(mask)[0])
        c = self.cols[m]
        got = None if rc is None else tuple(rc[i, m].tolist())
        return Example(self.source, i, int(self.pos[i]) + shift, self.col_layers[c], c,
                       tuple(self.X[i, m].tolist()), got, note)  # fmt: skip


class _RowMasks(NamedTuple):
    """Per-row findings of one sequence at shift 0, bool [R, M] each (internal)."""

    missing: np.ndarray  # all -1: the missing marker
    present: np.ndarray
    ovfl: np.ndarray  # wrapped, or ids at the dtype's maximum >= E
    oor: np.ndarray  # ids outside [0, E)
    zero: np.ndarray  # all zero (K >= 2)
    dup: np.ndarray  # an id repeated
    match: np.ndarray  # the set equals the recomputed set

    @property
    def defective(self) -> np.ndarray:
        return self.ovfl | self.oor | self.zero | self.dup


def _row_masks(x: _Rows, RC: np.ndarray, E: int, K: int, dt: np.dtype) -> _RowMasks:
    """Classify every row: missing, overflowed, out of range, all zero, duplicated, matching.

    A row has at most one of overflow, out-of-range, all-zero, duplicate (in that precedence)."""
    X, Xs = x.X, x.Xs
    narrow = dt.kind in "iu" and dt.itemsize <= 2
    dmax = int(np.iinfo(dt).max) if narrow else 0
    missing = (X == -1).all(-1)
    present = ~missing
    at_max = (X == dmax) & (dmax >= E) if narrow else np.zeros(X.shape, dtype=bool)
    wrapped = np.zeros(missing.shape, dtype=bool)
    if narrow and E > dmax + 1:
        cast = np.sort(RC.astype(dt).astype(np.int64), axis=-1)  # wrapped into dt as astype does (modular)
        wrapped = (Xs == cast).all(-1) & ~(Xs == RC).all(-1) & present
    ovfl = (at_max.any(-1) | wrapped) & present
    oor = (((X < 0) | (X >= E)) & ~at_max).any(-1) & present & ~ovfl
    zero = (X == 0).all(-1) & ~ovfl if K >= 2 else np.zeros(missing.shape, dtype=bool)
    dup = (Xs[..., 1:] == Xs[..., :-1]).any(-1) & present & ~zero & ~ovfl & ~oor
    match = (Xs == RC).all(-1) & present
    return _RowMasks(missing, present, ovfl, oor, zero, dup, match)


def _dense_columns(r: EngineRoutes, col_layers: list[int], dense_cols: list[int], defects: Defects) -> None:
    """Dense layers' columns must be all zero (a whole row of -1 counts as missing)."""
    d = r.ids[:, dense_cols]
    nz = (d != 0).any(-1) & ~(d == -1).all(-1)
    if nz.any():
        i, j = np.argwhere(nz)[0]
        c = dense_cols[j]
        defects.add("dense_column", int(nz.sum()), "rows",
                    Example(r.source, int(i), r.start + int(i), col_layers[c], c, tuple(d[i, j].tolist()),
                            note="a dense layer's column must be all zero"))  # fmt: skip


def _z(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


class RouteJudge:
    """The per-layer sums over the sequences of one check (internal to check_routes): call
    :meth:`sequence` for each sequence, then :meth:`report`."""

    def __init__(self, lay: ModelLayout, shifts: tuple[int, ...], min_constant_rows: int, defects: Defects):
        L, S = len(lay.moe_layers), len(shifts)
        self.lay, self.shifts, self.min_rows, self.defects = lay, shifts, min_constant_rows, defects
        self.rows, self.missing, self.match, self.near, self.excused = _z(L), _z(L), _z(L), _z(L), _z(L)
        self.judged, self.disagree = _z(L), _z(L)
        self.oor, self.dup, self.zero, self.ovfl, self.seq_const = _z(L), _z(L), _z(L), _z(L), _z(L)
        self.shift_match, self.shift_cmp = np.zeros((L, S), dtype=np.int64), np.zeros((L, S), dtype=np.int64)
        # a layer's engine sets across the sequences: usable rows, sequences with some, first set, varies
        self.usable, self.usable_seqs = _z(L), _z(L)
        self.first_set: list[Any] = [None] * L
        self.first_rec: list[Any] = [None] * L
        self.set_varies, self.rec_varies = np.zeros(L, dtype=bool), np.zeros(L, dtype=bool)
        self.first_usable: list[Example | None] = [None] * L
        self.usable_sources: list[dict[str, None]] = [{} for _ in range(L)]
        self.first_disagree: list[Example | None] = [None] * L
        self.disagree_sources: list[dict[str, None]] = [{} for _ in range(L)]
        self.first_excused: list[Example | None] = [None] * L
        self.excused_sources: list[dict[str, None]] = [{} for _ in range(L)]
        self.unrouted_seqs = _z(L)  # sequences with no routed row in the layer while others are routed
        self.sources: dict[str, None] = {}
        self.unmapped = 0  # payloads whose columns map to no layers (the column_count defect)

    # ---------------------------------------------------------------------------------------------
    # one sequence
    # ---------------------------------------------------------------------------------------------

    def sequence(
        self,
        r: EngineRoutes,
        layout: str,
        col_layers: list[int] | None,
        rec: np.ndarray,
        ties: list[LayerTies],
    ) -> SequenceCheck:
        """Judge one sequence: ``rec`` int64 [T, L_moe, K] its recomputed sets (sorted), ``ties`` one
        :class:`LayerTies` per MoE layer; adds to the sums and the defects."""
        lay, defects = self.lay, self.defects
        E, K, T = lay.num_experts, lay.top_k, rec.shape[0]
        self.sources.setdefault(r.source)
        dt = np.dtype(r.dtype)
        if dt.kind in "iu" and dt.itemsize <= 2 and E > int(np.iinfo(dt).max) + 1:
            defects.add("dtype_narrow", 1, "payloads", Example(
                r.source, note=f"{dt.name} holds ids up to {int(np.iinfo(dt).max)}; the model has {E} experts"
            ))  # fmt: skip
        if r.rows != r.expected_rows:
            defects.add("row_count", 1, "sequences", Example(r.source, note=r.row_count_note()))
        n_s = len(self.shifts)

        expected = r.expected_rows
        assert expected is not None  # (EngineRoutes sets it)

        def seq(agreement: float, shift_agree: Any, best: int, misaligned: bool) -> SequenceCheck:
            return SequenceCheck(r.source, r.start, r.rows, expected, len(r.token_ids), dt.name,
                                 r.columns, layout, agreement, tuple(float(a) for a in shift_agree), best,
                                 misaligned)  # fmt: skip

        if col_layers is None:
            self.unmapped += 1
            defects.add("column_count", 1, "payloads", Example(
                r.source, note=f"{r.columns} columns; the model has {len(lay.moe_layers)} MoE layers and "
                f"{lay.num_hidden_layers} decoder layers (--layer-ids maps them)"))  # fmt: skip
            return seq(math.nan, (math.nan,) * n_s, 0, False)
        moe_index = {n: i for i, n in enumerate(lay.moe_layers)}
        moe_cols = [c for c, n in enumerate(col_layers) if n in moe_index]
        dense_cols = [c for c, n in enumerate(col_layers) if n not in moe_index]
        if dense_cols:
            _dense_columns(r, col_layers, dense_cols, defects)
        R = max(0, min(r.rows, T - r.start))  # rows past the last token: the row_count defect, not examined
        if not moe_cols or R == 0:
            return seq(math.nan, (math.nan,) * n_s, 0, False)
        li = np.array([moe_index[col_layers[c]] for c in moe_cols])
        X = r.ids[:R][:, moe_cols]
        x = _Rows(r.source, r.start + np.arange(R), moe_cols, col_layers, li, X, np.sort(X, axis=-1))
        RC, _, _ = x.at(rec, 0)
        k = _row_masks(x, RC, E, K, dt)
        for kind, mask in (("dtype_overflow", k.ovfl), ("out_of_range", k.oor), ("all_zero", k.zero),
                           ("duplicate", k.dup)):  # fmt: skip
            if mask.any():
                defects.add(kind, int(mask.sum()), "rows", x.example(mask, RC))
        self._missing(x, k, RC)
        const = self._constant(x, RC, k)
        seq_agree, best, misaligned = self._alignment(r, x, k, rec)
        self._judge(x, k, rec, ties, const, best if misaligned else 0)
        near0 = np.stack([ties[i].near[x.pos] for i in li], axis=1) & k.present
        for acc, v in ((self.rows, k.present), (self.missing, k.missing), (self.match, k.match),
                       (self.near, near0), (self.oor, k.oor), (self.dup, k.dup), (self.zero, k.zero),
                       (self.ovfl, k.ovfl)):  # fmt: skip
            acc[li] += v.sum(0)
        return seq(rate(int(k.match.sum()), int(k.present.sum())), seq_agree, best, misaligned)

    def _missing(self, x: _Rows, k: _RowMasks, RC: np.ndarray) -> None:
        """A MoE layer's column with no routed row while the sequence's other MoE layers are routed is
        ``unrouted_layer`` for this sequence (whatever other sources route); rows of -1 in the other
        columns are ``missing_rows`` (replay refuses them unless ``missing="native"``). Positions before
        the start are not rows: never counted."""
        gone = np.asarray(k.missing.all(0))  # [M]; not every column: refuse_unrouted refused that
        if gone.any() and not gone.all():
            m = int(np.flatnonzero(gone)[0])
            self.unrouted_seqs[x.li[gone]] += 1
            note = f"every one of its {len(x.pos)} rows -1 (missing) while its other MoE layers are routed"
            first = Example(x.source, layer=x.col_layers[x.cols[m]], column=x.cols[m], note=note)
            self.defects.add("unrouted_layer", int(gone.sum()), "layers", first)
        part = k.missing & ~gone[None, :]
        if part.any():
            note = 'replay refuses rows of -1 unless missing="native", which routes them natively'
            self.defects.add("missing_rows", int(part.sum()), "rows", x.example(part, RC, note=note))

    def _constant(self, x: _Rows, RC: np.ndarray, k: _RowMasks) -> np.ndarray:
        """bool [M]: layers with one set at every usable row of this sequence (at least
        ``min_constant_rows``) while the recomputation varies (the ``constant`` defect); records each
        layer's sets for the same test across the sequences (:meth:`report`)."""
        M = len(x.cols)
        const = np.zeros(M, dtype=bool)
        usable = k.present & ~k.zero & ~k.oor & ~k.ovfl
        for m in range(M):
            rows, i = np.flatnonzero(usable[:, m]), int(x.li[m])
            if len(rows) == 0:
                continue
            sets, rsets = x.Xs[rows, m], RC[rows, m]
            one, rone = bool((sets == sets[0]).all()), bool((rsets == rsets[0]).all())
            if self.first_set[i] is None:
                self.first_set[i], self.first_rec[i] = sets[0].copy(), rsets[0].copy()
                self.first_usable[i] = x.example(usable & (np.arange(M) == m)[None, :], RC)
            self.set_varies[i] |= not one or not (sets[0] == self.first_set[i]).all()
            self.rec_varies[i] |= not rone or not (rsets[0] == self.first_rec[i]).all()
            self.usable[i] += len(rows)
            self.usable_seqs[i] += 1
            self.usable_sources[i].setdefault(x.source)
            const[m] = len(rows) >= self.min_rows and one and not rone
        if const.any():
            m = int(np.flatnonzero(const)[0])
            note = f"{int(usable[:, m].sum())} rows of this sequence, one set"
            first = x.example(usable & (np.arange(M) == m)[None, :], RC, note=note)
            self.defects.add("constant", int(const.sum()), "layers", first)
        self.seq_const[x.li] += const
        return const

    def _alignment(self, r: EngineRoutes, x: _Rows, k: _RowMasks, rec: np.ndarray) -> tuple[Any, int, bool]:
        """Agreement of engine row ``i`` with position ``pos[i] + shift`` (defective rows left out) for
        each shift: (agreement [S], best shift, misaligned); adds the ``misaligned`` defect."""
        shifts, M = self.shifts, len(x.cols)
        use = k.present & ~k.defective
        sm, sc = np.zeros((M, len(shifts)), dtype=np.int64), np.zeros((M, len(shifts)), dtype=np.int64)
        rows_cmp, rows_ok = _z(len(shifts)), _z(len(shifts))  # rows compared; rows agreeing in every layer
        for j, s in enumerate(shifts):
            RC, valid, _ = x.at(rec, s)
            u = use & valid[:, None]
            m_s = (x.Xs == RC).all(-1) & u
            sm[:, j], sc[:, j] = m_s.sum(0), u.sum(0)
            row_used = u.any(1)
            rows_cmp[j], rows_ok[j] = row_used.sum(), (row_used & (m_s | ~u).all(1)).sum()
        self.shift_match[x.li] += sm
        self.shift_cmp[x.li] += sc
        agree = rate(sm.sum(0), sc.sum(0))
        best = best_shift(agree, sc.sum(0), shifts)
        j0, jb = shifts.index(0), shifts.index(best)
        a0 = agree[j0] if math.isfinite(agree[j0]) else 0.0
        misaligned = bool(
            best != 0
            and rows_cmp[jb] >= MISALIGN_ROWS
            and agree[jb] >= MISALIGN_MIN
            and agree[jb] - a0 >= MISALIGN_GAIN
            and rows_ok[jb] - rows_ok[j0] >= MISALIGN_MARGIN
        )
        if misaligned:
            self.defects.add("misaligned", 1, "sequences", Example(
                r.source, note=f"agreement {agree[jb]:.3f} at shift {best:+d} vs {a0:.3f} at 0 "
                f"({int(rows_cmp[jb])} rows): row i is position {r.start}+i{best:+d}; "
                f"{_start_hint(r, best)}; its rows are judged at shift {best:+d}"))  # fmt: skip
        return agree, best, misaligned

    def _judge(
        self, x: _Rows, k: _RowMasks, rec: np.ndarray, ties: list[LayerTies], const: np.ndarray, shift: int
    ) -> None:
        """Judge the rows against position ``pos + shift`` (0, or a misaligned sequence's best shift):
        a row that differs only within a near-tie is excused, any other valid row is judged."""
        RC, valid, pc = x.at(rec, shift)
        base = k.present & ~k.defective & valid[:, None] & ~const[None, :]
        match = (x.Xs == RC).all(-1)
        near = np.stack([ties[i].near[pc] for i in x.li], axis=1)
        excused = np.zeros_like(base)
        for i, m in np.argwhere(base & near & ~match):
            t = ties[x.li[m]]
            excused[i, m] = tie_excused(t.scores[t.at[pc[i]]], x.X[i, m], t)
        judged = base & ~excused
        disagree = judged & ~match
        self.excused[x.li] += excused.sum(0)
        self.judged[x.li] += judged.sum(0)
        self.disagree[x.li] += disagree.sum(0)
        at = f" at shift {shift:+d}" if shift else ""
        why = f"excused at a near-tie{at}"
        found = ((disagree, self.first_disagree, self.disagree_sources, at and f"judged{at}"),
                 (excused, self.first_excused, self.excused_sources, why))  # fmt: skip
        for mask, firsts, srcs, note in found:
            for m in np.flatnonzero(mask.any(0)):
                i = int(x.li[m])
                srcs[i].setdefault(x.source)
                if firsts[i] is None:
                    firsts[i] = x.example(mask & (np.arange(len(x.cols)) == m)[None, :], RC, shift, note)

    # ---------------------------------------------------------------------------------------------
    # across the sequences
    # ---------------------------------------------------------------------------------------------

    def _layer_constant(self) -> np.ndarray:
        """bool [L]: layers with one set at every usable row of every sequence (at least
        ``min_constant_rows`` in all) while the recomputation varies; adds the ``constant`` defect for
        the sequences not already found constant on their own."""
        glob = (self.usable >= self.min_rows) & ~self.set_varies & self.rec_varies
        for i in np.flatnonzero(glob):
            first = self.first_usable[i]
            note = f"{int(self.usable[i])} rows of {int(self.usable_seqs[i])} sequence(s), one set"
            self.defects.add("constant", int(self.usable_seqs[i] - self.seq_const[i]), "layers",
                             Example(first.source, first.row, first.position, first.layer, first.column,
                                     first.ids, first.recomputed, note),
                             sources=self.usable_sources[i])  # fmt: skip
        return glob

    def _unrouted(self, judged: np.ndarray, const: np.ndarray) -> None:
        """The ``unrouted_layer`` defect of the sources together: MoE layers with no judged row that no
        other defect explains (a row defect, a constant layer, a sequence's column of -1, rows excused
        at near-ties; for a layer without rows, a payload of unmapped columns)."""
        lay = self.lay
        explained = self.oor + self.dup + self.zero + self.ovfl + const + self.unrouted_seqs + self.excused
        bad = (judged == 0) & (explained == 0)
        if self.unmapped:
            bad &= self.rows + self.missing > 0
        if not bad.any():
            return
        why = [(lay.moe_layers[i], "no source has a row for it" if self.rows[i] == 0 else
                f"none of its {int(self.rows[i])} rows judged") for i in np.flatnonzero(bad)]  # fmt: skip
        srcs = list(self.sources)
        where = srcs[0] if len(srcs) == 1 else f"all {len(srcs)} sources"
        detail = "; ".join(f"layer {n}: {w}" for n, w in why) if len(why) > 1 else ""
        first = Example(where, layer=why[0][0], note=why[0][1])
        self.defects.add("unrouted_layer", len(why), "layers", first, detail, sources=())

    def _excused(self, judged: np.ndarray, glob: np.ndarray, near_tie: float) -> None:
        """The ``excused`` defect: layers where more than half of the compared rows (judged or excused)
        were excused as near-ties: the tolerance, not the routes, passed them."""
        compared = judged + self.excused
        bad = ~glob & (2 * self.excused > compared)
        if not bad.any():
            return
        share = rate(self.excused, compared)
        parts = [f"layer {self.lay.moe_layers[i]}: {int(self.excused[i])} of {int(compared[i])} "
                 f"({share[i]:.2f})" for i in np.flatnonzero(bad)]  # fmt: skip
        found = [e for i in np.flatnonzero(bad) if (e := self.first_excused[i]) is not None]
        srcs = {s: None for i in np.flatnonzero(bad) for s in self.excused_sources[i]}
        self.defects.add(
            "excused", int(bad.sum()), "layers", found[0],
            f"more than half of the compared rows excused as near-ties at a near-tie tolerance of "
            f"{near_tie:g} (--near-tie): {'; '.join(parts)}; the tolerance cannot vouch for such a layer",
            sources=sorted(srcs, key=list(self.sources).index),
        )  # fmt: skip

    def report(
        self, sequences: list[SequenceCheck], max_disagreement: float, near_tie: float, model_id: str
    ) -> RouteCheckReport:
        """The report of every sequence judged so far."""
        lay, shifts = self.lay, self.shifts
        glob = self._layer_constant()
        const = np.where(glob, self.usable_seqs, self.seq_const)
        judged = np.where(glob, 0, self.judged)  # a constant layer's rows are not judged
        disagree = np.where(glob, 0, self.disagree)
        dis = rate(disagree, judged)
        shift_agree = rate(self.shift_match, self.shift_cmp)  # [L, S]
        layers = tuple(
            LayerCheck(
                n, i, int(self.rows[i]), int(self.missing[i]), rate(self.match[i], self.rows[i]),
                rate(self.near[i], self.rows[i]), int(self.excused[i]), int(judged[i]), float(dis[i]),
                int(self.oor[i]), int(self.dup[i]), int(self.zero[i]), int(self.ovfl[i]), int(const[i]),
                tuple(float(a) for a in shift_agree[i]),
                best_shift(shift_agree[i], self.shift_cmp[i], shifts),
            )
            for i, n in enumerate(lay.moe_layers)
        )  # fmt: skip
        finite = np.where(np.isfinite(dis), dis, -1.0)
        if finite.max(initial=-1.0) > max_disagreement:
            worst = int(np.argmax(finite))
            live = [i for i in range(len(layers)) if not glob[i] and self.first_disagree[i] is not None]
            found = [e for i in live if (e := self.first_disagree[i]) is not None]
            first = min(found, key=lambda e: list(self.sources).index(e.source))
            srcs = {s: None for i in live for s in self.disagree_sources[i]}
            self.defects.add(
                "disagreement", int(disagree.sum()), "rows", first,
                f"{finite[worst]:.4f} of the judged rows of layer {lay.moe_layers[worst]} disagree "
                f"(> {max_disagreement:g}); {rate(disagree.sum(), judged.sum()):.4f} overall",
                sources=sorted(srcs, key=list(self.sources).index),
            )  # fmt: skip
        self._excused(judged, glob, near_tie)
        self._unrouted(judged, const)
        overall = rate(self.shift_match.sum(0), self.shift_cmp.sum(0))
        return RouteCheckReport(
            layers=layers,
            sequences=tuple(sequences),
            defects=self.defects.freeze(),
            layout=lay,
            agreement=rate(self.match.sum(), self.rows.sum()),
            near_tie_rate=rate(self.near.sum(), self.rows.sum()),
            disagreement=rate(disagree.sum(), judged.sum()),
            shifts=shifts,
            shift_agreement=tuple(float(a) for a in overall),
            best_shift=best_shift(overall, self.shift_cmp.sum(0), shifts),
            max_disagreement=float(max_disagreement),
            near_tie=float(near_tie),
            model_id=model_id,
        )

"""Conformance check of an engine's routes: teacher-force each sequence, compare, name the defects.

Before training on an engine's routes (the R3 recipe), check that they are the routes of this model:
:func:`check_routes` runs every sequence (its prompt + completion token ids) through the model with
replaymoe capture on, and compares the engine's rows with the recomputed ones, per MoE layer::

    model = replaymoe.hf.models.build_model("deepseek_v3", "tiny", seed=0)   # or from_pretrained
    report = check_routes(model, load_routes("response.json", num_layers=(3, 2), top_k=2))
    print(report)             # the per-layer table, the defects with a first example each
    report.exit_code          # 0 clean, else the CheckCode bits

What it reports
---------------
* **agreement**: the fraction of (token, layer) rows whose expert *set* equals the recomputed set
  (engines give no column order). **Near-ties**: rows where the recomputed selection score of the
  K-th choice and of the best expert not chosen are within ``near_tie * max(1, |score_K|)``
  (DeepSeek-V3's grouping: also the ``topk_group``-th kept group and the best dropped one); there a
  bf16 engine and the trainer may legitimately differ. The scores are
  :func:`replaymoe.routing.methods.selection_scores` of the router's own logits (a pre-hook on each
  router), so every routing method is scored as the kernels select.
* per-row defects of the raw values: ids outside ``[0, E)`` (a whole row of -1 is the documented
  missing marker, counted apart), a repeated id in a row, rows of all zeros (K >= 2: a fused kernel
  that never wrote its routing), and layers whose every row holds one expert set (at least
  ``min_constant_rows`` rows) while the recomputation varies;
* the layout: with one column per decoder layer (vLLM 0.33), dense layers' columns must be all zero;
  a column count that is neither the MoE-layer nor the decoder-layer count cannot be mapped;
* alignment: agreement of engine row ``i`` with recomputed position ``start + i + shift`` for each
  shift in ``shifts``; a sequence whose best shift is not 0, reaches ``0.5`` and beats shift 0 by
  ``0.2`` is misaligned (an off-by-one prompt start);
* dtype overflow: a payload dtype that cannot hold ``E - 1`` (uint8 for more than 256 experts), rows
  that equal the recomputed ids wrapped into the dtype, ids at the dtype's maximum where E is smaller
  (a -1 or a larger id cast to an unsigned type).

Rows a defect explains are kept out of the disagreement rate: it counts the rows that are not
missing, defective, near-tied, in a constant layer or in a misaligned sequence, and fails when, in
some layer, more than ``max_disagreement`` of them disagree.

The report (:class:`RouteCheckReport`, its table and dict), the defect kinds and their exit bits
(:class:`CheckCode`: 1 disagreement, 4 invalid ids, 8 degenerate rows, 16 layout, 32 misaligned,
64 dtype overflow) are in :mod:`replaymoe.record.route_check`; the routes' readers (vLLM, SGLang,
trace files) in :mod:`replaymoe.record.engine_routes`. Both are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from replaymoe._validation import check_int, fail
from replaymoe.record.engine_routes import (
    EngineRoutes,
    check_fit,
    load_routes,
    routes_from_sglang,
    routes_from_trace,
    routes_from_vllm,
)
from replaymoe.record.route_check import (
    DEFECT_KINDS,
    CheckCode,
    Defect,
    Defects,
    Example,
    LayerCheck,
    ModelLayout,
    RouteCheckReport,
    SequenceCheck,
)
from replaymoe.record.trace.checks import int_tuple
from replaymoe.routing.methods import METHODS, Params, selection_scores

from ._engine import enabled_handle
from .discovery import MoELayerInfo
from .session import enable

__all__ = [
    "DEFECT_KINDS",
    "CheckCode",
    "Defect",
    "EngineRoutes",
    "Example",
    "LayerCheck",
    "ModelLayout",
    "RouteCheckReport",
    "SequenceCheck",
    "check_routes",
    "load_model",
    "load_routes",
    "model_layout",
    "routes_from_sglang",
    "routes_from_trace",
    "routes_from_vllm",
]

_MISALIGN_MIN, _MISALIGN_GAIN, _MISALIGN_ROWS = 0.5, 0.2, 4
NEAR_TIE_MAX = 1e9  # the largest near_tie check_routes takes (a relative tolerance)


def model_layout(model: nn.Module) -> ModelLayout:
    """The decoder-layer count, MoE layer numbers, E and K of a transformers MoE model."""
    from .discovery import find_moe_layers

    layers = find_moe_layers(model)
    ks = {info.plan.top_k for info in layers}
    es = {int(info.router.weight.shape[0]) for info in layers}
    if len(ks) != 1 or len(es) != 1:
        fail("model", "the same top_k and num_experts in every MoE layer", f"top_k {ks}, experts {es}")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    numbers = tuple(info.layer_number for info in layers)
    n = int(n) if isinstance(n, int) and n > max(numbers) else max(numbers) + 1
    return ModelLayout(n, numbers, es.pop(), ks.pop())


def load_model(spec: str, *, seed: int = 0) -> nn.Module:
    """A model for the check: ``SIZE:ARCH`` (:func:`replaymoe.hf.models.build_model`, seeded), or a
    transformers checkpoint (a directory, or a cached hub id) loaded offline in eval mode.

    Raises
    ------
    ValueError
        Naming ``model``: an unknown size/architecture, or a checkpoint transformers cannot load
        (the reason on the same line).
    """
    import os

    from .models import ARCHITECTURES, SIZES, build_model

    if not isinstance(spec, str) or not spec:
        fail("model", "a checkpoint path or SIZE:ARCH", repr(spec))
    size, sep, arch = spec.partition(":")
    if sep and not os.path.exists(spec):
        if size not in SIZES or arch not in ARCHITECTURES:
            fail(
                "model",
                f"SIZE:ARCH with SIZE in {', '.join(SIZES)} and ARCH in {', '.join(ARCHITECTURES)}, or a "
                "checkpoint path",
                repr(spec),
            )
        return build_model(arch, size, seed=seed)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a non-model
        reason = " ".join(str(e).split())[:300]
        fail("model", "a transformers MoE checkpoint loadable offline, or SIZE:ARCH", f"{spec!r} ({reason})")
    return model.eval()


def _near_ties(info: MoELayerInfo, hidden: torch.Tensor, tol: float) -> np.ndarray:
    """bool [T]: tokens whose recomputed selection is within ``tol`` of another one (module docstring)."""
    r = info.plan.routing
    with torch.no_grad():
        x32 = info.plan.logits(info.router, hidden).float()
        p = Params(r.method, r.top_k, r.num_groups, r.groups_kept, r.scale)
        s = selection_scores(x32, p, r.bias)
        t, e = s.shape
        k = r.top_k
        if e > k:
            top = s.topk(k + 1, dim=1).values
            kth = top[:, k - 1]
            near = (kth - top[:, k]) <= tol * kth.abs().clamp(min=1.0)
        else:
            near = torch.zeros(t, dtype=torch.bool, device=s.device)
        ng, kept = p.n_group, p.topk_group
        if METHODS[p.method].grouped and ng > 1 and kept < ng:
            # the group score of methods.selection_scores: the sum of a group's two largest scores
            u = selection_scores(x32, p._replace(n_group=1, topk_group=1), r.bias).view(t, ng, e // ng)
            g = u.topk(min(2, e // ng), dim=2).values.sum(dim=2)
            gt = g.topk(kept + 1, dim=1).values
            near |= (gt[:, kept - 1] - gt[:, kept]) <= tol * gt[:, kept - 1].abs().clamp(min=1.0)
    return near.cpu().numpy()


class _Acc:
    """Per-layer sums over the sequences (internal)."""

    def __init__(self, n_layers: int, n_shifts: int):
        z = lambda: np.zeros(n_layers, dtype=np.int64)  # noqa: E731
        self.rows, self.missing, self.match, self.near = z(), z(), z(), z()
        self.judged, self.disagree = z(), z()
        self.oor, self.dup, self.zero, self.ovfl, self.const = z(), z(), z(), z(), z()
        self.shift_match = np.zeros((n_layers, n_shifts), dtype=np.int64)
        self.shift_cmp = np.zeros((n_layers, n_shifts), dtype=np.int64)
        self.first_disagree: Example | None = None  # the first judged row that disagrees


def _best(agree: np.ndarray, compared: np.ndarray, shifts: tuple[int, ...]) -> int:
    """The shift of highest agreement among those with compared rows; 0 wins ties, then smaller |shift|."""
    cands = [
        (agree[j], -abs(s), s) for j, s in enumerate(shifts) if compared[j] > 0 and math.isfinite(agree[j])
    ]
    return max(cands)[2] if cands else 0


def _rate(num: np.ndarray | int, den: np.ndarray | int) -> Any:
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)
    return float(out) if out.ndim == 0 else out


def _columns(
    r: EngineRoutes, lay: ModelLayout, layer_ids: tuple[int, ...] | None
) -> tuple[str, list[int] | None]:
    """(layout name, model layer number of each column or None when unmapped)."""
    ids = layer_ids if layer_ids is not None else r.layer_ids
    if ids is not None:
        name = "layer_ids" if layer_ids is not None else f"layer_ids of {r.source}"  # given, or recorded
        if len(ids) != r.columns:
            fail(name, f"{r.columns} layer numbers (one per column of {r.source})", list(ids))
        if max(ids) >= lay.num_hidden_layers:
            fail(name, f"layer numbers below the model's {lay.num_hidden_layers} layers", list(ids))
        return ("layer_ids" if layer_ids is not None else "trace"), list(ids)
    if r.columns == len(lay.moe_layers):
        return "moe", list(lay.moe_layers)
    if r.columns == lay.num_hidden_layers:
        return "decoder", list(range(lay.num_hidden_layers))
    return "unmapped", None


class _Rows(NamedTuple):
    """One sequence's MoE-layer columns beside their recomputation (internal); M examined columns."""

    source: str
    pos: np.ndarray  # int [R]: the sequence position of each row
    cols: list[int]  # [M]: the payload column of each examined MoE layer
    col_layers: list[int]  # the model layer number of every payload column
    li: np.ndarray  # int [M]: the MoE-layer index of each examined column
    X: np.ndarray  # int64 [R, M, K]: the engine's rows, as sent
    Xs: np.ndarray  # [R, M, K]: the same, sorted
    RC: np.ndarray  # int64 [R, M, K]: the recomputed sets, sorted
    NT: np.ndarray  # bool [R, M]: recomputed near-ties

    def example(self, mask: np.ndarray, note: str = "") -> Example:
        """The first row of ``mask`` (bool [R, M]) as an :class:`Example`."""
        i, m = (int(v) for v in np.argwhere(mask)[0])
        c = self.cols[m]
        return Example(self.source, i, int(self.pos[i]), self.col_layers[c], c, tuple(self.X[i, m].tolist()),
                       tuple(self.RC[i, m].tolist()), note)  # fmt: skip


class _RowMasks(NamedTuple):
    """Per-row findings of one sequence, bool [R, M] each (internal)."""

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


def _check_dense_columns(
    r: EngineRoutes, pos: np.ndarray, col_layers: list[int], dense_cols: list[int], defects: Defects
) -> None:
    """Dense layers' columns must be all zero (a whole row of -1 counts as missing)."""
    d = r.ids[:, dense_cols]
    nz = (d != 0).any(-1) & ~(d == -1).all(-1)
    if nz.any():
        i, j = np.argwhere(nz)[0]
        c = dense_cols[j]
        defects.add("dense_column", int(nz.sum()), "rows",
                    Example(r.source, int(i), int(pos[i]), col_layers[c], c, tuple(d[i, j].tolist()),
                            note="a dense layer's column must be all zero"))  # fmt: skip


def _row_masks(x: _Rows, E: int, K: int, dt: np.dtype, narrow: bool, dmax: int | None) -> _RowMasks:
    """Classify every row: missing, overflowed, out of range, all zero, duplicated, matching.

    A row has at most one of overflow, out-of-range, all-zero, duplicate (in that precedence)."""
    X, Xs, RC = x.X, x.Xs, x.RC
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
    dup = (Xs[..., 1:] == Xs[..., :-1]).any(-1) & present & ~zero & ~ovfl
    match = (Xs == RC).all(-1) & present
    return _RowMasks(missing, present, ovfl, oor, zero, dup, match)


def _constant_layers(x: _Rows, k: _RowMasks, min_constant_rows: int, defects: Defects) -> np.ndarray:
    """bool [M]: layers with one set at every usable row (at least ``min_constant_rows``) while the
    recomputation varies; adds the ``constant`` defect."""
    M = len(x.cols)
    const = np.zeros(M, dtype=bool)
    usable = k.present & ~k.zero & ~k.oor & ~k.ovfl
    for m in range(M):
        rows = np.flatnonzero(usable[:, m])
        if len(rows) >= min_constant_rows:
            sets, rsets = x.Xs[rows, m], x.RC[rows, m]
            if (sets == sets[0]).all() and not (rsets == rsets[0]).all():
                const[m] = True
    if const.any():
        m = int(np.flatnonzero(const)[0])
        defects.add("constant", int(const.sum()), "layers",
                    x.example(usable & (np.arange(M) == m)[None, :],
                              note=f"{int(usable[:, m].sum())} rows, one set"))  # fmt: skip
    return const


def _alignment(
    r: EngineRoutes, x: _Rows, k: _RowMasks, rec: np.ndarray, shifts: tuple[int, ...], defects: Defects
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]:
    """Agreement of engine row ``i`` with recomputed position ``start + i + shift`` (defective rows left
    out): (rows matched, rows compared) int64 [M, S], the agreement [S], the best shift and whether
    the sequence is misaligned (then adds the ``misaligned`` defect)."""
    M, T = len(x.cols), rec.shape[0]
    use = k.present & ~k.defective
    sm = np.zeros((M, len(shifts)), dtype=np.int64)
    sc = np.zeros((M, len(shifts)), dtype=np.int64)
    for j, s in enumerate(shifts):
        p = x.pos + s
        ok = (p >= 0) & (p < T)
        if not ok.any():
            continue
        m_s = (x.Xs[ok] == rec[p[ok]][:, x.li]).all(-1) & use[ok]
        sm[:, j] = m_s.sum(0)
        sc[:, j] = use[ok].sum(0)
    seq_agree = _rate(sm.sum(0), sc.sum(0))
    best = _best(seq_agree, sc.sum(0), shifts)
    a0 = seq_agree[shifts.index(0)] if 0 in shifts else math.nan
    a0 = 0.0 if not math.isfinite(a0) else a0
    jb = shifts.index(best)
    misaligned = (
        best != 0
        and sc.sum(0)[jb] >= _MISALIGN_ROWS
        and seq_agree[jb] >= _MISALIGN_MIN
        and seq_agree[jb] - a0 >= _MISALIGN_GAIN
    )
    if misaligned:
        defects.add(
            "misaligned", 1, "sequences",
            Example(r.source, note=f"agreement {seq_agree[jb]:.3f} at shift {best:+d} vs {a0:.3f} at 0: "
                    f"row i is position {r.start}+i{best:+d} (is the prompt start {r.start + best}?)"),
        )  # fmt: skip
    return sm, sc, seq_agree, best, bool(misaligned)


def _accumulate(
    acc: _Acc, x: _Rows, k: _RowMasks, const: np.ndarray, sm: np.ndarray, sc: np.ndarray, misaligned: bool
) -> None:
    """Add one sequence's counts to ``acc``: the judged rows (module docstring) and those that disagree."""
    judged = k.present & ~k.defective & ~x.NT & ~const[None, :] & (not misaligned)
    disagree = judged & ~k.match
    for m in range(len(x.cols)):
        i = x.li[m]
        acc.rows[i] += int(k.present[:, m].sum())
        acc.missing[i] += int(k.missing[:, m].sum())
        acc.match[i] += int(k.match[:, m].sum())
        acc.near[i] += int((x.NT[:, m] & k.present[:, m]).sum())
        acc.judged[i] += int(judged[:, m].sum())
        acc.disagree[i] += int(disagree[:, m].sum())
        acc.oor[i] += int(k.oor[:, m].sum())
        acc.dup[i] += int(k.dup[:, m].sum())
        acc.zero[i] += int(k.zero[:, m].sum())
        acc.ovfl[i] += int(k.ovfl[:, m].sum())
        acc.const[i] += int(const[m])
        acc.shift_match[i] += sm[m]
        acc.shift_cmp[i] += sc[m]
    if disagree.any():
        acc.first_disagree = acc.first_disagree or x.example(disagree)


def _examine(
    r: EngineRoutes,
    rec: np.ndarray,
    near: np.ndarray,
    lay: ModelLayout,
    layer_ids: tuple[int, ...] | None,
    acc: _Acc,
    defects: Defects,
    shifts: tuple[int, ...],
    min_constant_rows: int,
) -> SequenceCheck:
    """Examine one sequence's routes against its recomputation (``rec`` int64 [T, L_moe, K] sorted,
    ``near`` bool [T, L_moe]): its layout, then each MoE column's rows; adds to ``acc`` and ``defects``."""
    E, K, R = lay.num_experts, lay.top_k, r.rows
    dt = np.dtype(r.dtype)
    narrow = dt.kind in "iu" and dt.itemsize <= 2
    dmax = int(np.iinfo(dt).max) if dt.kind in "iu" else None
    if narrow and E > dmax + 1:
        defects.add(
            "dtype_narrow", 1, "payloads",
            Example(r.source, note=f"{dt.name} holds ids up to {dmax}; the model has {E} experts"),
        )  # fmt: skip
    if R != r.expected_rows:
        defects.add("row_count", 1, "sequences", Example(r.source, note=r.row_count_note()))
    layout, col_layers = _columns(r, lay, layer_ids)
    n_s = len(shifts)

    def seq(agreement: float, shift_agree: tuple[float, ...], best: int, misaligned: bool) -> SequenceCheck:
        return SequenceCheck(
            r.source, r.start, R, r.expected_rows, len(r.token_ids), dt.name, r.columns, layout,
            agreement, shift_agree, best, misaligned,
        )  # fmt: skip

    if col_layers is None:
        defects.add(
            "column_count", 1, "payloads",
            Example(r.source, note=f"{r.columns} columns; the model has {len(lay.moe_layers)} MoE layers "
                    f"and {lay.num_hidden_layers} decoder layers (--layer-ids maps them)"),
        )  # fmt: skip
        return seq(math.nan, (math.nan,) * n_s, 0, False)
    moe_index = {n: i for i, n in enumerate(lay.moe_layers)}
    moe_cols = [c for c, n in enumerate(col_layers) if n in moe_index]
    dense_cols = [c for c, n in enumerate(col_layers) if n not in moe_index]
    pos = r.start + np.arange(R)
    if dense_cols:
        _check_dense_columns(r, pos, col_layers, dense_cols, defects)
    if not moe_cols:
        return seq(math.nan, (math.nan,) * n_s, 0, False)
    li = np.array([moe_index[col_layers[c]] for c in moe_cols])
    X = r.ids[:, moe_cols]
    x = _Rows(
        r.source, pos, moe_cols, col_layers, li, X, np.sort(X, axis=-1), rec[pos][:, li], near[pos][:, li]
    )

    k = _row_masks(x, E, K, dt, narrow, dmax)
    for kind, mask in (("dtype_overflow", k.ovfl), ("out_of_range", k.oor), ("all_zero", k.zero),
                       ("duplicate", k.dup)):  # fmt: skip
        if mask.any():
            defects.add(kind, int(mask.sum()), "rows", x.example(mask))
    const = _constant_layers(x, k, min_constant_rows, defects)
    sm, sc, seq_agree, best, misaligned = _alignment(r, x, k, rec, shifts, defects)
    _accumulate(acc, x, k, const, sm, sc, misaligned)
    agreement = _rate(int(k.match.sum()), int(k.present.sum()))
    return seq(agreement, tuple(float(a) for a in seq_agree), best, misaligned)


def check_routes(
    model: nn.Module,
    routes: EngineRoutes | Sequence[EngineRoutes],
    *,
    num_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
    max_disagreement: float = 0.05,
    near_tie: float = 5e-3,
    shifts: Sequence[int] = range(-2, 3),
    min_constant_rows: int = 16,
) -> RouteCheckReport:
    """Check an engine's routes against this model's own routing of the same tokens.

    Parameters
    ----------
    model : nn.Module
        A transformers MoE model of a supported architecture, without replaymoe enabled (the check
        enables capture for its forwards and disables it after). E, K and the MoE layer numbers come
        from it.
    routes : EngineRoutes or sequence of EngineRoutes
        The sequences (:func:`load_routes`, :func:`routes_from_vllm`, :func:`routes_from_sglang`,
        :func:`routes_from_trace`).
    num_experts : int, optional
        A cross-check: must equal the model's E.
    layer_ids : sequence of int, optional
        The model layer number of each payload column, for every route (default: a trace's own, else
        one column per MoE layer or per decoder layer, by the count).
    max_disagreement : float
        Fail (``CheckCode.DISAGREEMENT``) when more than this fraction of a layer's judged rows
        disagree (module docstring).
    near_tie : float
        Relative tolerance of a near-tie: ``|score_K - score_next| <= near_tie * max(1, |score_K|)``.
        The default, 5e-3, is about two bf16 roundings (bf16 keeps 8 significant bits, 2^-8 = 0.0039
        relative): an engine that computes its router in bf16 can flip a pair that close.
    shifts : sequence of int
        Row shifts tried for the alignment (must include 0).
    min_constant_rows : int
        A layer is called constant only with at least this many rows.

    Returns
    -------
    RouteCheckReport

    Raises
    ------
    ValueError
        Naming the argument: routes whose top_k is not the model's, token ids outside the model's
        vocabulary, ``layer_ids`` that do not fit, a model with replaymoe already enabled.
    """
    rs = [routes] if isinstance(routes, EngineRoutes) else list(routes)
    if not rs:
        fail("routes", "at least one EngineRoutes", "an empty sequence")
    for i, r in enumerate(rs):
        if not isinstance(r, EngineRoutes):
            fail(f"routes[{i}]", "an EngineRoutes", type(r).__name__, what="type")
    shifts = tuple(int(s) for s in shifts)
    if 0 not in shifts or len(set(shifts)) != len(shifts):
        fail("shifts", "distinct row shifts including 0", list(shifts))
    for name, v, high, want in (
        ("max_disagreement", max_disagreement, 1, "a number in [0, 1]"),
        ("near_tie", near_tie, NEAR_TIE_MAX, "a number in [0, 1e9]"),
    ):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= high:
            fail(name, want, v)
    check_int("min_constant_rows", min_constant_rows, low=2)
    if enabled_handle(model) is not None:
        fail("model", "a model without replaymoe enabled (call .disable() first)", "already enabled")
    lay = model_layout(model)
    if num_experts is not None and num_experts != lay.num_experts:
        fail("num_experts", f"the model's {lay.num_experts} experts", num_experts)
    if layer_ids is not None:
        layer_ids = int_tuple("layer_ids", layer_ids)
        if not layer_ids or min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
            fail("layer_ids", "distinct layer numbers >= 0", list(layer_ids))
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    check_fit(rs, top_k=lay.top_k, num_experts=lay.num_experts, vocab=vocab)

    acc, defects = _Acc(len(lay.moe_layers), len(shifts)), Defects()
    sequences = []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    session = enable(model, capture=True, graphs=False)
    near_ties: dict[int, np.ndarray] = {}  # MoE-layer index -> bool [T] of the current forward

    def router_hook(info: MoELayerInfo) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            near_ties[info.index] = _near_ties(info, hidden, near_tie)

        return hook

    hooks = [
        info.router.register_forward_pre_hook(router_hook(info), with_kwargs=True) for info in session.layers
    ]
    try:
        for r in rs:
            near_ties.clear()
            session.traces()  # nothing pending from an earlier forward
            with torch.no_grad():
                model(torch.as_tensor(r.token_ids, device=device)[None], use_cache=False)
            (trace,) = session.traces()
            rec = np.sort(trace.ids.astype(np.int64), axis=-1)
            near = np.stack([near_ties[info.index] for info in session.layers], axis=1)
            sequences.append(_examine(r, rec, near, lay, layer_ids, acc, defects, shifts, min_constant_rows))
    finally:
        for h in hooks:
            h.remove()
        session.disable()
        model.train(was_training)

    per_layer_dis = _rate(acc.disagree, acc.judged)
    shift_agree = _rate(acc.shift_match, acc.shift_cmp)  # [L, S]
    overall_shift = _rate(acc.shift_match.sum(0), acc.shift_cmp.sum(0))
    layers = tuple(
        LayerCheck(
            n, i, int(acc.rows[i]), int(acc.missing[i]), _rate(acc.match[i], acc.rows[i]),
            _rate(acc.near[i], acc.rows[i]), int(acc.judged[i]), float(per_layer_dis[i]), int(acc.oor[i]),
            int(acc.dup[i]), int(acc.zero[i]), int(acc.ovfl[i]), int(acc.const[i]),
            tuple(float(a) for a in shift_agree[i]), _best(shift_agree[i], acc.shift_cmp[i], shifts),
        )
        for i, n in enumerate(lay.moe_layers)
    )  # fmt: skip
    finite = np.where(np.isfinite(per_layer_dis), per_layer_dis, -1.0)
    if finite.max(initial=-1.0) > max_disagreement:
        worst = int(np.argmax(finite))
        defects.add(
            "disagreement", int(acc.disagree.sum()), "rows", acc.first_disagree,
            f"{finite[worst]:.4f} of the judged rows of layer {lay.moe_layers[worst]} disagree "
            f"(> {max_disagreement:g}); {_rate(acc.disagree.sum(), acc.judged.sum()):.4f} overall",
        )  # fmt: skip
    return RouteCheckReport(
        layers=layers,
        sequences=tuple(sequences),
        defects=defects.freeze(),
        layout=lay,
        agreement=_rate(acc.match.sum(), acc.rows.sum()),
        near_tie_rate=_rate(acc.near.sum(), acc.rows.sum()),
        disagreement=_rate(acc.disagree.sum(), acc.judged.sum()),
        shifts=shifts,
        shift_agreement=tuple(float(a) for a in overall_shift),
        best_shift=_best(overall_shift, acc.shift_cmp.sum(0), shifts),
        max_disagreement=float(max_disagreement),
        near_tie=float(near_tie),
        model_id=session.model_id,
    )

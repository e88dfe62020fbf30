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
  bf16 engine and the trainer may legitimately differ, so a near-tie row is **excused** when the
  engine's set is a top-K choice up to that tolerance: no expert it left out scores more than the
  tolerance above one it chose (every expert where the sets differ is within the tolerance of the
  K-th score; with grouping, its groups a kept-group choice up to the tolerance of the group
  scores). Any other set sent at a near-tie is judged; a layer where more than half of the compared
  rows (judged or excused) were excused is the ``excused`` defect (the tolerance, not the routes,
  passed it: a bf16 engine differs at a small share of its near-ties). The scores are
  :func:`replaymoe.routing.methods.selection_scores` of the router's own logits (a pre-hook on each
  router), so every routing method is scored as the kernels select.
* per-row defects of the raw values, each row counted under one at most: ids outside ``[0, E)``, a
  repeated id in a row, rows of all zeros (K >= 2: a fused kernel that never wrote its routing), rows
  of all -1 (the missing marker: ``missing_rows``, which replay refuses unless ``missing="native"``;
  positions before the prompt start are not rows), and layers with one expert set at every row (at
  least ``min_constant_rows`` rows, within one sequence or across them all) while the recomputation
  varies;
* the layout: with one column per decoder layer (vLLM 0.33), dense layers' columns must be all zero;
  a column count that is neither the MoE-layer nor the decoder-layer count cannot be mapped; a row
  count that is not ``tokens - 1 - start`` (the rows within the tokens are judged, the defect names a
  prompt start that fits); a MoE layer every row of which is -1 in a sequence whose other MoE layers
  are routed, whatever the other sources hold, or with no judged row in any source that no other
  defect explains (``unrouted_layer``); a trace whose model id or MoE layers are not the model's,
  which replay would refuse (``fingerprint``; a trace of other experts or top-k is refused with a
  ``ValueError``, before any forward);
* alignment: agreement of engine row ``i`` with recomputed position ``start + i + shift`` for each
  shift in ``shifts``; a sequence whose best shift is not 0, compares at least 8 rows there, reaches
  ``0.5``, beats shift 0 by ``0.2`` and has 4 more rows agreeing in every layer is misaligned (a
  wrong prompt start, missing or extra leading rows); its rows are judged at that shift;
* dtype overflow: a payload dtype that cannot hold ``E - 1`` (uint8 for more than 256 experts), rows
  that equal the recomputed ids wrapped into the dtype, ids at the dtype's maximum where E is smaller
  (a -1 or a larger id cast to an unsigned type).

Rows a defect explains are kept out of the disagreement rate: it counts the rows that are not
missing, defective, excused at a near-tie or in a constant layer, and fails when, in some layer, more
than ``max_disagreement`` of them disagree. Routes with no routed row in any MoE layer's column (every
such row -1, or no such column) are refused: nothing to check.

The report (:class:`RouteCheckReport`, its table and dict), the defect kinds and their exit bits
(:class:`CheckCode`: 1 disagreement, 4 invalid ids, 8 degenerate rows, 16 layout, 32 misaligned,
64 dtype overflow) are in :mod:`replaymoe.record.route_check`; the routes' readers (vLLM, SGLang,
trace files) in :mod:`replaymoe.record.engine_routes`, the judgement of the rows in
:mod:`replaymoe.record.route_judge`. The first two are re-exported here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from replaymoe._validation import check_bool, check_int, fail
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
from replaymoe.record.route_judge import LayerTies, RouteJudge, columns, refuse_unrouted
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

NEAR_TIE_MAX = 1e9  # the largest near_tie check_routes takes (a relative tolerance)


def model_layout(model: nn.Module) -> ModelLayout:
    """The decoder-layer count, MoE layer numbers, E and K of a transformers MoE model."""
    from .discovery import find_moe_layers

    if not isinstance(model, nn.Module):
        fail("model", "a transformers MoE model (a torch.nn.Module)", type(model).__name__, what="type")
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


def load_model(spec: str, *, seed: int | None = None) -> nn.Module:
    """A model for the check: ``SIZE:ARCH`` (:func:`replaymoe.hf.models.build_model`, seeded with
    ``seed``, default 0), or a transformers checkpoint (a directory, or a cached hub id) loaded offline
    in eval mode.

    Raises
    ------
    ValueError
        Naming ``model``: an unknown size/architecture, or a checkpoint transformers cannot load
        (the reason on the same line); naming ``seed``: a seed for a checkpoint (its weights are
        loaded, not drawn).
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
        return build_model(arch, size, seed=0 if seed is None else check_int("seed", seed))
    if seed is not None:
        fail(
            "seed", f"none for the checkpoint {spec!r} (its weights are loaded, not drawn from a seed)", seed
        )
    from transformers import AutoModelForCausalLM

    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a non-model
        reason = " ".join(str(e).split())[:300]
        fail("model", "a transformers MoE checkpoint loadable offline, or SIZE:ARCH", f"{spec!r} ({reason})")
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") and its logging below errors off, then restored
    as they were (the hub's bars too): a check's stderr holds its own errors only."""
    import warnings

    from huggingface_hub import utils as hub
    from transformers.utils import logging as tf_logging

    bar, hub_off, verbosity = (tf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled(),
                               tf_logging.get_verbosity())  # fmt: skip
    with warnings.catch_warnings():  # the hub warns when HF_HUB_DISABLE_PROGRESS_BARS overrides a call
        warnings.simplefilter("ignore")
        tf_logging.disable_progress_bar()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(verbosity)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if bar:
                tf_logging.enable_progress_bar()
            if hub_off != hub.are_progress_bars_disabled():
                (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()


def _near_ties(info: MoELayerInfo, hidden: torch.Tensor, tol: float) -> LayerTies:
    """The recomputed near-ties of one router's forward (module docstring), with the selection scores
    at those positions (before group masking) that :func:`~replaymoe.record.route_judge.tie_excused`
    reads."""
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
        grouped = METHODS[p.method].grouped and ng > 1 and kept < ng
        u = s
        if grouped:
            # the group score of methods.selection_scores: the sum of a group's two largest scores
            u = selection_scores(x32, p._replace(n_group=1, topk_group=1), r.bias)
            g = u.view(t, ng, e // ng).topk(min(2, e // ng), dim=2).values.sum(dim=2)
            gt = g.topk(kept + 1, dim=1).values
            near |= (gt[:, kept - 1] - gt[:, kept]) <= tol * gt[:, kept - 1].abs().clamp(min=1.0)
        scores = u[near].cpu().numpy()
    near_np = near.cpu().numpy()
    at = np.full(t, -1, dtype=np.int64)
    at[near_np] = np.arange(int(near_np.sum()))
    return LayerTies(near_np, at, scores, k, ng if grouped else 1, kept if grouped else 1, tol)


def _as_routes(routes: Any) -> list[EngineRoutes]:
    """``routes`` as a list of EngineRoutes, or a ValueError naming it."""
    if isinstance(routes, EngineRoutes):
        return [routes]
    if isinstance(routes, (str, bytes, Mapping)) or not isinstance(routes, Iterable):
        what = "a dict (a response: read it with routes_from_vllm or routes_from_sglang)" if isinstance(
            routes, Mapping) else type(routes).__name__  # fmt: skip
        fail("routes", "an EngineRoutes or a sequence of them", what, what="type")
    rs = list(routes)
    if not rs:
        fail("routes", "at least one EngineRoutes", "an empty sequence")
    for i, r in enumerate(rs):
        if not isinstance(r, EngineRoutes):
            fail(f"routes[{i}]", "an EngineRoutes", type(r).__name__, what="type")
    return rs


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
    check_model_id: bool = True,
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
        For every route: the model layer number of each payload column, or, for a payload of one
        column per decoder layer, the model's MoE layer numbers, naming their columns (the form of
        ``RoutingTrace.from_vllm``; the other columns must be zero). Default: a trace's own, else one
        column per MoE layer or per decoder layer, by the count.
    max_disagreement : float
        Fail (``CheckCode.DISAGREEMENT``) when more than this fraction of a layer's judged rows
        disagree (module docstring).
    near_tie : float
        Relative tolerance of a near-tie: ``|score_K - score_next| <= near_tie * max(1, |score_K|)``.
        The default, 5e-3, is about two bf16 roundings (bf16 keeps 8 significant bits, 2^-8 = 0.0039
        relative): an engine that computes its router in bf16 can flip a pair that close. A row is
        excused only when the engine's set is a top-K choice up to this tolerance.
    shifts : sequence of int
        Row shifts tried for the alignment (distinct ints, 0 among them).
    min_constant_rows : int
        A layer is called constant only with at least this many rows.
    check_model_id : bool
        Compare a trace's model id with the model's (``fingerprint`` defect); False when the trace
        was recorded under another name of this model, as :meth:`ReplayMoE.set_replay
        <replaymoe.hf.session.ReplayMoE.set_replay>` takes it.

    Returns
    -------
    RouteCheckReport

    Raises
    ------
    ValueError
        Naming the argument: a model that is not a transformers MoE model or has replaymoe enabled,
        routes that are not EngineRoutes, routes whose top_k is not the model's, token ids outside the
        model's vocabulary, routes with no routed row in a MoE layer's column, ``layer_ids`` that do
        not fit, a bad threshold or shift.
    """
    rs = _as_routes(routes)
    shifts = int_tuple("shifts", shifts)
    if 0 not in shifts or len(set(shifts)) != len(shifts):
        fail("shifts", "distinct row shifts including 0", list(shifts))
    for name, v, high, want in (
        ("max_disagreement", max_disagreement, 1, "a number in [0, 1]"),
        ("near_tie", near_tie, NEAR_TIE_MAX, "a number in [0, 1e9]"),
    ):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= high:
            fail(name, want, v)
    check_int("min_constant_rows", min_constant_rows, low=2)
    check_bool("check_model_id", check_model_id)
    if not isinstance(model, nn.Module):
        fail("model", "a transformers MoE model (a torch.nn.Module; see load_model)", type(model).__name__,
             what="type")  # fmt: skip
    if enabled_handle(model) is not None:
        fail("model", "a model without replaymoe enabled (call .disable() first)", "already enabled")
    lay = model_layout(model)
    if num_experts is not None and check_int("num_experts", num_experts, low=1) != lay.num_experts:
        fail("num_experts", f"the model's {lay.num_experts} experts", num_experts)
    if layer_ids is not None:
        layer_ids = int_tuple("layer_ids", layer_ids)
        if not layer_ids or min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
            fail("layer_ids", "distinct layer numbers >= 0", list(layer_ids))
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    check_fit(rs, top_k=lay.top_k, num_experts=lay.num_experts, vocab=vocab)
    maps = [columns(r, lay, layer_ids) for r in rs]  # every input refused before the first forward
    for r, (_, col_layers) in zip(rs, maps):
        refuse_unrouted(r, lay, col_layers)

    defects = Defects()
    judge = RouteJudge(lay, shifts, min_constant_rows, defects)
    sequences = []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    session = enable(model, capture=True, graphs=False)
    near_ties: dict[int, LayerTies] = {}  # MoE-layer index -> the current forward's

    def router_hook(info: MoELayerInfo) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            near_ties[info.index] = _near_ties(info, hidden, near_tie)

        return hook

    hooks = [
        info.router.register_forward_pre_hook(router_hook(info), with_kwargs=True) for info in session.layers
    ]
    try:
        for r, (layout, col_layers) in zip(rs, maps):
            if r.fingerprint is not None:
                diff = r.fingerprint.differences(session.fingerprint, model_id=check_model_id)
                if diff:
                    note = "the trace's vs the model's: " + "; ".join(diff)
                    defects.add("fingerprint", 1, "sources", Example(r.source, note=note))
            near_ties.clear()
            session.traces()  # nothing pending from an earlier forward
            with torch.no_grad():
                model(torch.tensor(r.token_ids, device=device)[None], use_cache=False)
            (trace,) = session.traces()
            rec = np.sort(trace.ids.astype(np.int64), axis=-1)
            ties = [near_ties[info.index] for info in session.layers]
            sequences.append(judge.sequence(r, layout, col_layers, rec, ties))
    finally:
        for h in hooks:
            h.remove()
        session.disable()
        model.train(was_training)
    return judge.report(sequences, max_disagreement, near_tie, session.model_id)

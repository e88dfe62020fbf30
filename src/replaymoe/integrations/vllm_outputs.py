"""Routing traces from the outputs of vLLM's offline engine (``vllm.LLM.generate``), for replay.

An engine started with ``enable_return_routed_experts=True`` returns, on each finished
``CompletionOutput``, ``routed_experts``: as vLLM 0.33's source defines it, a numpy array
``[rows, num_hidden_layers, top_k]``

* with **one column per decoder layer**, indexed by layer number; dense layers (DeepSeek-V3's
  ``first_k_dense_replace``) are all-zero columns. ``layer_ids`` (the MoE layers' numbers,
  :func:`moe_layer_ids`) picks the MoE columns, and every other column must be zero;
* uint8 when the model has <= 256 experts, else uint16 (never int32, no -1 sentinel);
* of ``P + C - 1 - s`` rows for ``P`` prompt and ``C`` completion tokens (the last sampled token is
  never fed through the model): row ``i`` is position ``s + i``, ``s`` being the request's
  ``SamplingParams.routed_experts_prompt_start`` (default 0). ``RequestOutput`` carries no routing
  and does not echo ``s``: the caller passes it (``prompt_starts``), taken from the sampling
  parameters it gave ``generate``.

:func:`traces_from_vllm_outputs` turns each completion into one
:class:`~replaymoe.record.trace.RoutingTrace` from position 0 with the token ids of every covered
position, so that replay matches rows by content (:meth:`replaymoe.hf.ReplayMoE.add_rollout_traces`).
Positions below ``s`` are missing (-1): replay routes them natively and counts them as fallback
(``ReplayReport``). The legacy layout (one column per MoE layer, int32, as the first engines sent)
is still read. Only attributes are read: vLLM itself is never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replaymoe._validation import check_int, fail
from replaymoe.record.trace import RoutingTrace, TraceFormatError
from replaymoe.record.trace.wire import check_rows, select_moe_layers

__all__ = ["moe_layer_ids", "traces_from_vllm_outputs"]


def moe_layer_ids(model_or_config: Any) -> list[int]:
    """The model layer numbers of the MoE layers of a transformers model or config.

    The ``layer_ids`` that :func:`traces_from_vllm_outputs`, :meth:`RoutingTrace.from_vllm
    <replaymoe.record.trace.RoutingTrace.from_vllm>` and ``replaymoe inspect --layer-ids`` need to
    map vLLM's one-column-per-decoder-layer payload to the MoE layers (e.g. ``[1, 2, ..., 60]`` for
    DeepSeek-V3, whose ``first_k_dense_replace`` first layers are dense).

    Parameters
    ----------
    model_or_config : torch.nn.Module or transformers.PretrainedConfig
        A model, or its config: the model is then built on the ``meta`` device (no memory, no
        weights) and its MoE blocks found as :func:`replaymoe.hf.find_moe_layers` finds them, so
        every architecture replaymoe supports reads its own fields (``first_k_dense_replace``,
        ``mlp_only_layers``, ``decoder_sparse_step``, ...).

    Returns
    -------
    list of int
        Increasing layer numbers.

    Raises
    ------
    ValueError
        When the model has no MoE block replaymoe supports (:func:`~replaymoe.hf.find_moe_layers`).
    """
    import torch

    from replaymoe.hf import find_moe_layers

    model = model_or_config
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    return [info.layer_number for info in find_moe_layers(model)]


def _routes(value: Any, what: str) -> np.ndarray | None:
    """``value`` as an int array ``[N, L, K]``, or None when absent."""
    if value is None:
        return None
    arr = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        fail(what, "an integer array [positions, layers, top_k]", f"{arr.dtype} array of shape {arr.shape}")
    return arr


def _one_trace(
    prompt: np.ndarray,
    completion: np.ndarray,
    routes: np.ndarray,
    prompt_start: int,
    *,
    num_experts: int,
    layer_ids: Sequence[int] | None,
    model_id: str | None,
    where: str,
) -> RoutingTrace:
    """The trace of one completion: positions ``0 .. P + C - 2``, -1 below ``prompt_start``."""
    what = f"{where}.routed_experts"
    try:
        tokens = check_rows(
            len(routes),
            prompt.tolist(),
            completion.tolist(),
            prompt_start,
            what,
            start_name="routed_experts_prompt_start",
            start_from="pass the sampling parameters' value in prompt_starts",
        )
        routes = select_moe_layers(routes, layer_ids, what)
    except TraceFormatError as exc:
        raise ValueError(str(exc)) from None
    assert tokens is not None
    covered = len(prompt) + len(completion) - 1
    ids = np.full((covered, routes.shape[1], routes.shape[2]), -1, dtype=np.int64)  # checked by the trace
    ids[prompt_start:] = routes
    ids[(ids < 0).any(axis=2)] = -1  # legacy int payloads: a partly written row is missing as a whole
    _check_experts(ids, num_experts, layer_ids, prompt_start, what)
    return RoutingTrace(
        ids,
        num_experts=num_experts,
        top_k=routes.shape[2],
        layer_ids=layer_ids,
        model_id=model_id,
        token_ids=np.concatenate([prompt, completion])[:covered],
    )


def _check_experts(
    ids: np.ndarray, num_experts: int, layer_ids: Sequence[int] | None, prompt_start: int, what: str
) -> None:
    """Refuse a written ``[K]`` row of ``ids`` ``[positions, L, K]`` with an id past ``num_experts``
    or a repeated id, naming the first such row by position, MoE layer and model layer.

    ``ids`` is what :func:`_one_trace` hands the trace (missing rows all -1), so that the trace's own
    check, which would name its ``ids`` argument and a MoE column, never fails.
    """
    if ids.size == 0:  # no position, or top_k 0 (the trace refuses it)
        return
    bad = (ids >= num_experts).any(axis=2)
    if bad.any():
        pos, moe = np.argwhere(bad)[0].tolist()
        expected = f"expert ids in [0, {num_experts - 1}] (num_experts={num_experts})"
        got = f"{int(ids[pos, moe].max())} in {ids[pos, moe].tolist()}"
    else:
        K = ids.shape[2]
        if K <= 16:  # pairwise compares: faster than a sort per row for small top_k
            bad = np.zeros(ids.shape[:2], dtype=bool)
            for a in range(K - 1):
                for b in range(a + 1, K):
                    bad |= ids[..., a] == ids[..., b]
        else:
            srt = np.sort(ids, axis=2)
            bad = (srt[..., 1:] == srt[..., :-1]).any(axis=2)
        bad &= ids[..., 0] >= 0  # a missing row is -1 as a whole
        if not bad.any():
            return
        pos, moe = np.argwhere(bad)[0].tolist()
        expected, got = "distinct expert ids in a row", str(ids[pos, moe].tolist())
    layer = "" if layer_ids is None else f" (model layer {list(layer_ids)[moe]})"
    fail(what, expected, f"{got} at position {pos} (row {pos - prompt_start}), MoE layer {moe}{layer}")


def _starts(prompt_starts: int | Sequence[int] | None, n: int) -> list[int]:
    """One prompt start per request (``None`` -> 0 each)."""
    if prompt_starts is None:
        return [0] * n
    if isinstance(prompt_starts, (int, np.integer)) and not isinstance(prompt_starts, bool):
        check_int("prompt_starts", int(prompt_starts), low=0)
        return [int(prompt_starts)] * n
    starts = list(prompt_starts)
    if len(starts) != n:
        fail("prompt_starts", f"{n} entries (one per request of outputs)", f"{len(starts)} entries")
    for i, s in enumerate(starts):
        check_int(f"prompt_starts[{i}]", s, low=0)
    return [int(s) for s in starts]


def traces_from_vllm_outputs(
    outputs: Sequence[Any],
    *,
    num_experts: int,
    layer_ids: Sequence[int] | None = None,
    model_id: str | None = None,
    prompt_starts: int | Sequence[int] | None = None,
) -> list[RoutingTrace]:
    """One trace per completion of ``vllm.LLM.generate``'s outputs, in the engine's order.

    Parameters
    ----------
    outputs : sequence of ``vllm.RequestOutput``
        Each with ``prompt_token_ids`` (list of int) and ``outputs`` (the completions, each with
        ``token_ids`` and ``routed_experts``, an integer array ``[P + C - 1 - s, layers, top_k]``:
        module docstring).
    num_experts : int
        The model's routed experts E (the engine does not send it).
    layer_ids : sequence of int, optional
        The model layer numbers of the MoE layers (:func:`moe_layer_ids`), stored on each trace.
        vLLM 0.33's payload has a column per decoder layer: the MoE columns are kept and the
        others must be all zero. A payload of exactly ``len(layer_ids)`` columns (the legacy
        MoE-only layout) is taken as is. Without it, a column that is entirely zero (a dense
        layer) raises.
    model_id : str, optional
        Stored on each trace.
    prompt_starts : int or sequence of int, optional
        ``SamplingParams.routed_experts_prompt_start`` of each request (one int for all, or one
        per request of ``outputs``; ``None`` = 0): vLLM does not echo it, so pass what
        ``generate`` was given (``R3GRPOTrainer`` reads it from the ``sampling_params`` argument).

    Returns
    -------
    list of RoutingTrace
        ``[request 0 completion 0, request 0 completion 1, ..., request 1 completion 0, ...]``,
        each of ids int16 ``[P + C - 1, len(layer_ids), top_k]`` from position 0 (-1 below the
        prompt start) with ``token_ids`` int64 ``[P + C - 1]``.

    Raises
    ------
    ValueError
        When a completion carries no ``routed_experts`` (the engine was started without
        ``enable_return_routed_experts=True``, or the request was preempted); when its rows are not
        ``P + C - 1 - s`` (the message names the request, the rows got and expected); when a prompt
        start passes the prompt; when its columns do not fit ``layer_ids`` (or hold a zero column
        without them); when a MoE layer's row holds an id outside ``[0, num_experts)`` or a repeated
        id (an all-zero row included, for ``top_k > 1``): the message names the completion
        (``outputs[r].outputs[c].routed_experts``), the position (row + prompt start), the MoE
        layer and its model layer number.
    """
    check_int("num_experts", num_experts, low=1)
    outputs = list(outputs)
    starts = _starts(prompt_starts, len(outputs))
    traces: list[RoutingTrace] = []
    for r, request in enumerate(outputs):
        where = f"outputs[{r}]"
        prompt_ids = getattr(request, "prompt_token_ids", None)
        prompt = np.asarray([] if prompt_ids is None else prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            fail(f"{where}.prompt_token_ids", "the request's prompt token ids", "none")
        if starts[r] > len(prompt):
            fail(f"prompt_starts[{r}]", f"at most the prompt's {len(prompt)} tokens ({where})", starts[r])
        completions = getattr(request, "outputs", None)
        for c, completion in enumerate([] if completions is None else completions):
            routes = _routes(
                getattr(completion, "routed_experts", None), f"{where}.outputs[{c}].routed_experts"
            )
            if routes is None:
                fail(
                    f"{where}.outputs[{c}].routed_experts",
                    "the experts of every position (start the engine with enable_return_routed_experts=True)",
                    "None (an engine without it, or a preempted request)",
                )
            traces.append(
                _one_trace(
                    prompt,
                    np.asarray(completion.token_ids, dtype=np.int64).reshape(-1),
                    routes,
                    starts[r],
                    num_experts=num_experts,
                    layer_ids=layer_ids,
                    model_id=model_id,
                    where=f"{where}.outputs[{c}]",
                )
            )
    return traces

"""Routing traces from the outputs of vLLM's offline engine (``vllm.LLM.generate``), for replay.

An engine started with ``enable_return_routed_experts=True`` returns, per request, the experts each
position was routed to. Depending on the vLLM version they arrive in one of two forms:

* **whole sequence** (vLLM's first design): ``CompletionOutput.routed_experts`` is an array
  ``[num_positions, L, K]`` over the prompt and the completion;
* **split** (later versions): ``RequestOutput.prompt_routed_experts`` ``[prompt_len, L, K]`` shared by
  the request's completions, plus each ``CompletionOutput.routed_experts`` over the completion only.
  A request may skip the first ``routed_experts_prompt_start`` prompt positions.

:func:`traces_from_vllm_outputs` turns either into one :class:`~replaymoe.record.trace.RoutingTrace` per
completion, with the token ids of every covered position, so that replay matches rows by content
(:meth:`replaymoe.hf.ReplayMoE.add_rollout_traces`). Positions the engine did not return (a skipped
prompt prefix, vLLM's -1 prefix-cache sentinel) are kept as missing: replay routes them natively and
counts them as fallback (``ReplayReport``). Only attributes are read: vLLM itself is never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replaymoe._validation import check_int, fail
from replaymoe.record.trace import RoutingTrace

__all__ = ["traces_from_vllm_outputs"]


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
    prompt_routes: np.ndarray | None,
    routes: np.ndarray,
    prompt_start: int,
    *,
    num_experts: int,
    layer_ids: Sequence[int] | None,
    model_id: str | None,
    where: str,
) -> RoutingTrace:
    tokens = np.concatenate([prompt, completion]).astype(np.int64)
    num_positions = len(tokens) - 1  # the last sampled token was never fed through the model
    if prompt_routes is not None:  # split form
        if len(prompt_routes) + prompt_start != len(prompt):
            fail(
                f"{where}.prompt_routed_experts",
                f"{len(prompt) - prompt_start} rows (a prompt of {len(prompt)} tokens, from {prompt_start})",
                f"{len(prompt_routes)} rows",
                what="length",
            )
        routes = np.concatenate([prompt_routes, routes])
    elif len(routes) <= len(completion) < num_positions:  # completion only: the prompt part is unknown
        prompt_start = len(prompt)
    if not 0 < len(routes) + prompt_start <= len(tokens):
        fail(
            f"{where}.routed_experts",
            f"at most {len(tokens) - prompt_start} rows ({len(prompt)} prompt + {len(completion)} "
            f"completion tokens, from position {prompt_start})",
            f"{len(routes)} rows",
            what="length",
        )
    covered = min(len(routes) + prompt_start, num_positions)
    ids = np.full((covered, routes.shape[1], routes.shape[2]), -1, dtype=np.int16)
    ids[prompt_start:] = routes[: covered - prompt_start]
    ids[(ids < 0).any(axis=2)] = -1  # a partly written row is missing as a whole
    return RoutingTrace(
        ids,
        num_experts=num_experts,
        top_k=routes.shape[2],
        layer_ids=layer_ids,
        model_id=model_id,
        token_ids=tokens[:covered],
    )


def traces_from_vllm_outputs(
    outputs: Sequence[Any],
    *,
    num_experts: int,
    layer_ids: Sequence[int] | None = None,
    model_id: str | None = None,
) -> list[RoutingTrace]:
    """One trace per completion of ``vllm.LLM.generate``'s outputs, in the engine's order.

    Parameters
    ----------
    outputs : sequence of ``vllm.RequestOutput``
        Each with ``prompt_token_ids`` (list of int), ``outputs`` (the completions: ``token_ids`` and
        ``routed_experts``, an int array ``[positions, L, K]``) and, in the split form,
        ``prompt_routed_experts`` ``[prompt positions, L, K]`` and optionally
        ``routed_experts_prompt_start`` (module docstring).
    num_experts : int
        The model's routed experts E (the engine does not send it).
    layer_ids : sequence of int, optional
        MoE-layer index -> model layer number, stored on each trace.
    model_id : str, optional
        Stored on each trace.

    Returns
    -------
    list of RoutingTrace
        ``[request 0 completion 0, request 0 completion 1, ..., request 1 completion 0, ...]``,
        each covering positions ``0 .. len(prompt) + len(completion) - 2`` with ``token_ids``.

    Raises
    ------
    ValueError
        When a completion carries no ``routed_experts`` (the engine was started without
        ``enable_return_routed_experts=True``, or the request was preempted), or the arrays do not
        fit the token counts.
    """
    check_int("num_experts", num_experts, low=1)
    traces: list[RoutingTrace] = []
    for r, request in enumerate(outputs):
        where = f"outputs[{r}]"
        prompt_ids = getattr(request, "prompt_token_ids", None)
        prompt = np.asarray([] if prompt_ids is None else prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            fail(f"{where}.prompt_token_ids", "the request's prompt token ids", "none")
        prompt_routes = _routes(
            getattr(request, "prompt_routed_experts", None), f"{where}.prompt_routed_experts"
        )
        start = getattr(request, "routed_experts_prompt_start", None) or 0
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
                    np.asarray(completion.token_ids, dtype=np.int64),
                    prompt_routes,
                    routes,
                    int(start),
                    num_experts=num_experts,
                    layer_ids=layer_ids,
                    model_id=model_id,
                    where=f"{where}.outputs[{c}]",
                )
            )
    return traces

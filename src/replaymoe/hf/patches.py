"""What :func:`replaymoe.hf.enable` patches into a model: each router's forward and ``generate``.

``state`` below is the session (:class:`replaymoe.hf.session.ReplayMoE`; not imported here, so
that the session can import this module). A patched router computes its logits as the model's
own router does, takes this forward's replay ids and capture slab from the session
(``ReplayMoE._layer_io``), and routes with one :func:`replaymoe.routing.route` call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from replaymoe.routing import route

from .discovery import MoELayerInfo

__all__ = ["block_forward", "mark_batch_start", "refuse_paged", "router_forward"]


def refuse_paged(state: Any, init: Callable) -> Callable:
    """``model.init_continuous_batching`` (the entry of ``generate_batch`` and the
    ``ContinuousBatchingManager``) that refuses to start while capture or replay is on: paged,
    continuously batched generation packs requests into rows and positions that replaymoe cannot map
    back to sequences (its traces would be wrong, silently)."""

    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state._capturing or state._rollout_mode or state._replay is not None:
            from replaymoe._validation import fail

            fail(
                "generation",
                "model.generate (capture and replay map batch rows and positions to sequences)",
                "continuous batching (generate_batch / init_continuous_batching), which packs requests "
                "into paged rows replaymoe cannot map; turn capture, replay and rollout replay off for it",
                what="mode",
            )
        return init(*args, **kwargs)

    return wrapped


def mark_batch_start(state: Any, generate: Callable) -> Callable:
    """``model.generate`` that starts a new capture batch (so batches are kept apart on the host
    even when the cache's length lives on the device) and, when it returns, writes the last
    forward's deferred capture commit (so none outlives the call: a compiled forward after it
    never finds one) and lets the kept static cache go if the call returned it
    (:class:`~replaymoe.hf.static_cache.StaticCacheKeeper`)."""

    @functools.wraps(generate)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state._generate_begin()
        state._begin_pending = True
        state._generate_calls += 1
        outer, state._generation = state._generation, state._generate_calls  # (decode steps' chain)
        try:
            out = generate(*args, **kwargs)
            state._static_cache.release_if_returned(out)
            return out
        finally:
            state._generation = outer
            state._decode.reset()
            if state._capture is not None:
                state._capture.flush()
            state._generate_end()

    return wrapped


_HALF = (torch.bfloat16, torch.float16)  # the activations the fused kernels take


def block_forward(state: Any, graphs: Any) -> Callable:
    """The MoE block's forward, through its CUDA graphs (``graphs``: a
    :class:`~replaymoe.hf.graphs.BlockGraphs`) when this forward allows them (``state._step``
    says so, and the block does) and through its own forward otherwise."""
    own = graphs.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or args or kwargs:
            return own(hidden_states, *args, **kwargs)
        step = state._step
        head = None
        if step is not None and step.head is not None:  # the first MoE block of a device decode step
            head, step.head = step.head, None
        if step is None or not step.graphable or hidden_states.dtype not in _HALF or not graphs.usable():
            if head is not None:
                head.launch()
            return own(hidden_states)  # (fp32 experts take the torch reference on CUDA: not graphed)
        return graphs(hidden_states, (step.forced, step.staged), head)

    return forward


def router_forward(state: Any, info: MoELayerInfo, fused: bool) -> Callable:
    plan = info.plan
    routing = [plan.routing]  # rebound when the module's bias tensor is replaced (to_empty, .to())

    def forward(router: nn.Module, hidden_states: torch.Tensor):
        config = routing[0]
        if config.bias is not None and config.bias is not router.e_score_correction_bias:
            config = routing[0] = dataclasses.replace(config, bias=router.e_score_correction_bias)
        logits = plan.logits(router, hidden_states)
        replay_ids, staged = state._layer_io(info, logits.shape[0])
        dev = logits.device
        out_buf = staged
        if staged is not None and staged.device != dev:  # device_map: capture here, copy over
            out_buf = torch.empty(staged.shape, dtype=staged.dtype, device=dev)
        if replay_ids is not None and replay_ids.device != dev:
            replay_ids = replay_ids.to(dev)
        out = route(
            logits,
            config=config,
            routing_replay_out=out_buf,
            replay_ids=replay_ids,
            backend=state.backend,
            check_replay=False,  # the table was checked once, in set_replay
        )
        if out_buf is not staged:
            staged.copy_(out_buf)
        if replay_ids is not None and state._step is not None and not torch.compiler.is_compiling():
            state._used[info.index] = (logits, out.topk_ids)  # (the aux loss of this forward)
        if (
            replay_ids is not None and state._mismatch is not None and state._step is not None
        ):  # (not recomputes)
            state._count_mismatch(info.index, logits, replay_ids, out.topk_ids, config)
        weights = plan.weights(logits, out.topk_ids, out.topk_weights, fused=fused)
        # the fused experts take int32 ids as they are; transformers' own experts index with int64
        return logits, weights, out.topk_ids if fused else out.topk_ids.long()

    return forward

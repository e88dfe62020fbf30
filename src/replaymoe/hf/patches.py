"""What :func:`replaymoe.hf.enable` patches into a model: each router's forward, each MoE block's
forward and ``generate`` (continuous batching's entry points: :mod:`replaymoe.hf._paged`).

Each patch talks to the session's engine (:class:`replaymoe.hf._engine.Engine`, the private
collaborator of :class:`replaymoe.hf.session.ReplayMoE`) through :class:`SessionHooks`, the small
interface below (the engine is not imported here, so that it can import this module). A patched
router computes its logits as the model's own router does, takes this forward's replay ids and
capture slab from the engine (:meth:`SessionHooks.layer_io`), and routes with one
:func:`replaymoe.routing.route` call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from torch import nn

from replaymoe.routing import RoutingConfig, RoutingOutput, route
from replaymoe.routing._checks import validate, validate_weights
from replaymoe.routing._dispatch import run_route

from .discovery import MoELayerInfo
from .experts import IMPLEMENTATION_NAME

__all__ = ["SessionHooks", "block_forward", "mark_batch_start", "router_forward"]


class SessionHooks(Protocol):
    """What the patches need of the session.

    Attributes
    ----------
    backend : str
        ``"auto"`` | ``"triton"`` | ``"torch"`` for routing.
    step : Step or None
        The current forward of the decoder stack (:class:`replaymoe.hf.step.Step`); None outside it
        (an activation-checkpoint recompute, or a direct call).
    """

    backend: str

    @property
    def step(self) -> Any: ...

    def layer_io(self, info: MoELayerInfo, num_tokens: int) -> tuple[Optional[torch.Tensor], ...]:
        """(replay ids ``int32 [T, K]`` or None, capture slab ``int16 [T, K]`` or None, replayed weights
        ``float32 [T, K]`` or None, the weights' capture slab ``float32 [T, K]`` or None) of one router
        call (the weights: full recall)."""

    def routed(self, info: MoELayerInfo, logits: torch.Tensor, replay_ids: Optional[torch.Tensor],
               used: torch.Tensor, routing: RoutingConfig) -> None:  # fmt: skip
        """After a router call in the model's forward: what it was forced to and what it used (routed
        with ``routing``)."""

    def generate_begin(self, num_beams: int) -> None:
        """``generate`` was called (with ``num_beams`` beams): its first forward starts a capture batch
        (rollout mode: a round)."""

    def generate_end(self, out: Any) -> None:
        """``generate`` returned ``out`` (None when it raised)."""


def mark_batch_start(state: SessionHooks, generate: Callable) -> Callable:
    """``model.generate`` that starts a new capture batch (so batches are kept apart on the host
    even when the cache's length lives on the device) and, when it returns, writes the last
    forward's deferred capture commit (so none outlives the call: a compiled forward after it
    never finds one) and lets the kept static cache go if the call returned it
    (:class:`~replaymoe.hf.static_cache.StaticCacheKeeper`)."""

    @functools.wraps(generate)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state.generate_begin(_num_beams(getattr(generate, "__self__", None), args, kwargs))
        out = None
        try:
            out = generate(*args, **kwargs)
            return out
        finally:
            state.generate_end(out)

    return wrapped


def _num_beams(model: Any, args: tuple, kwargs: dict) -> int:
    """The beam count a ``generate(*args, **kwargs)`` call decodes with, as transformers resolves it:
    the ``num_beams`` keyword, else the call's ``generation_config`` (keyword, or second positional),
    else the model's."""
    n = kwargs.get("num_beams")
    if n is None:
        config = kwargs.get("generation_config")
        if config is None and len(args) > 1 and hasattr(args[1], "num_beams"):
            config = args[1]
        if config is None:
            config = getattr(model, "generation_config", None)
        n = getattr(config, "num_beams", None)
    return n if isinstance(n, int) and n > 1 else 1


_HALF = (torch.bfloat16, torch.float16)  # the activations the fused kernels take


def _experts_implementation(experts: nn.Module) -> Optional[str]:
    """The implementation transformers' experts dispatch (``use_experts_implementation``) picks for
    ``experts`` now: it reads ``experts.config._experts_implementation`` at every call, so
    ``model.set_experts_implementation(...)`` after :func:`~replaymoe.hf.enable` changes it."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)


def block_forward(state: SessionHooks, graphs: Any) -> Callable:
    """The MoE block's forward, through its CUDA graphs (``graphs``: a
    :class:`~replaymoe.hf.graphs.BlockGraphs`) when this forward allows them (``state.step``
    says so, and the block does) and through its own forward otherwise."""
    own = graphs.forward
    experts = getattr(graphs.block, "experts", None)

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or args or kwargs:
            return own(hidden_states, *args, **kwargs)
        step = state.step
        head = None
        if step is not None and step.head is not None:  # the first MoE block of a device decode step
            head, step.head = step.head, None
        if (
            step is None
            or not step.graphable
            or hidden_states.dtype not in _HALF
            # experts switched back to transformers' implementation after enable(): not graphed (its
            # eager loop syncs; a graph captured before the switch would run the fused experts)
            or _experts_implementation(experts) != IMPLEMENTATION_NAME
            or not graphs.usable()
        ):
            if head is not None:
                head.launch()
            return own(hidden_states)  # (fp32 experts take the torch reference on CUDA: not graphed)
        return graphs(hidden_states, (step.forced, step.staged, step.forced_w, step.staged_w), head)

    return forward


class _CheckedRouting:
    """The routing checks that depend only on what stays fixed between a router's calls, done once.

    ``route``'s per-call checks look at the logits (here the router's own ``F.linear`` output: 2-D,
    unit stride, of a fixed dtype and device), the routing against their number of experts, the
    capture slab and the replay ids. Once a call with the same logits dtype, device and expert
    count passed them, later calls re-check only the replay ids' shape (the rest cannot change) and
    go straight to :func:`replaymoe.routing._dispatch.run_route` (tens of microseconds of host time per
    layer call in an eager training step).
    """

    __slots__ = ("routing", "params", "key")

    def __init__(self, routing: RoutingConfig) -> None:
        self.routing, self.params, self.key = routing, None, None

    def route(self, logits, out_buf, replay_ids, backend: str, w_buf=None, replay_w=None):
        top_k = self.routing.top_k
        key = (logits.dtype, logits.device, logits.shape[1])
        w = dict(routing_weights_out=w_buf, replay_weights=replay_w)
        if (
            key == self.key
            and logits.dim() == 2
            and logits.stride(1) == 1
            and (out_buf is None or (out_buf.shape[0] >= logits.shape[0] and out_buf.shape[1] == top_k))
            and (replay_ids is None or (replay_ids.shape == (logits.shape[0], top_k)
                                        and replay_ids.dtype == torch.int32 and replay_ids.is_contiguous()))
            and (w_buf is None or (w_buf.shape[0] >= logits.shape[0] and w_buf.shape[1] == top_k
                                   and w_buf.dtype == torch.float32))
            and (replay_w is None or (replay_ids is not None and replay_w.shape == replay_ids.shape
                                      and replay_w.dtype == torch.float32 and replay_w.is_contiguous()))
        ):  # fmt: skip
            p = self.params
            return RoutingOutput(*run_route(logits, self.routing, p, out_buf, replay_ids, backend, **w))
        p, ids = validate(logits, self.routing, out_buf, replay_ids, False)
        w["replay_weights"] = validate_weights(logits, self.routing, w_buf, ids, replay_w, False)
        self.params, self.key = p, key
        return RoutingOutput(*run_route(logits, self.routing, p, out_buf, ids, backend, **w))


def router_forward(state: SessionHooks, info: MoELayerInfo, fused: bool) -> Callable:
    """The patched forward of ``info``'s router.

    ``fused``: :func:`~replaymoe.hf.enable` switched ``info``'s experts to replaymoe's fused
    implementation. While they still run it, the router returns ``route``'s int32 ids and fp32
    weights as they are (no cast on the hot path); once the experts run any other implementation
    (``model.set_experts_implementation("eager")``, ``"batched_mm"``, ...; or ``fused`` is False),
    it returns what transformers' own router returns: int64 ids (OLMoE's eager experts ``one_hot``
    them, which takes int64 only) and weights in the router's dtype.
    """
    plan = info.plan
    experts = info.experts
    # rebound when the module's bias tensor is replaced (to_empty, .to())
    bound = [_CheckedRouting(plan.routing)]

    def forward(router: nn.Module, hidden_states: torch.Tensor):
        checked = bound[0]
        routing = checked.routing
        if routing.bias is not None and routing.bias is not router.e_score_correction_bias:
            routing = dataclasses.replace(routing, bias=router.e_score_correction_bias)
            checked = bound[0] = _CheckedRouting(routing)
        logits = plan.logits(router, hidden_states)
        replay_ids, staged, replay_w, staged_w = state.layer_io(info, logits.shape[0])
        dev = logits.device
        out_buf, w_buf = staged, staged_w
        if staged is not None and staged.device != dev:  # device_map: capture here, copy over
            out_buf = torch.empty(staged.shape, dtype=staged.dtype, device=dev)
        if staged_w is not None and staged_w.device != dev:
            w_buf = torch.empty(staged_w.shape, dtype=staged_w.dtype, device=dev)
        if replay_ids is not None and replay_ids.device != dev:
            replay_ids = replay_ids.to(dev)
        if replay_w is not None and replay_w.device != dev:
            replay_w = replay_w.to(dev)
        # full recall: the weights the experts get are captured and replayed. Where they are route()'s
        # (every router but DeepSeek's without norm_topk_prob), by the routing kernel; otherwise below
        in_kernel = plan.sigmoid_scale is None
        kw_buf, kw_replay = (w_buf, replay_w) if in_kernel else (None, None)
        if torch.compiler.is_compiling():
            out = route(
                logits,
                routing=routing,
                routing_replay_out=out_buf,
                replay_ids=replay_ids,
                routing_weights_out=kw_buf,
                replay_weights=kw_replay,
                backend=state.backend,
                check_replay=False,  # the table was checked once, in set_replay
            )
        else:  # the replay table's ids were checked once, in set_replay
            out = checked.route(logits, out_buf, replay_ids, state.backend, kw_buf, kw_replay)
        if out_buf is not staged:
            staged.copy_(out_buf)
        if replay_ids is not None:
            state.routed(info, logits, replay_ids, out.topk_ids, routing)
        # read per call (a string compare): the experts' implementation may have been switched since
        ours = fused and _experts_implementation(experts) == IMPLEMENTATION_NAME
        weights = plan.weights(logits, out.topk_ids, out.topk_weights, fused=ours)
        if not in_kernel and replay_w is not None:  # replayed rows take the rollout's weights
            native = (replay_ids == -1).all(dim=1, keepdim=True)
            weights = torch.where(native, weights, replay_w.to(weights.dtype))
        if not in_kernel and w_buf is not None:
            with torch.no_grad():
                w_buf.copy_(weights)
        if w_buf is not staged_w:
            staged_w.copy_(w_buf)
        # the fused experts take int32 ids as they are; transformers' own experts index with int64
        return logits, weights, out.topk_ids if ours else out.topk_ids.long()

    return forward

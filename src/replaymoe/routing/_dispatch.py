"""The routing past its validation: the backend choice and the call of the torch or Triton backend.

:func:`run_route` is what :func:`replaymoe.routing.route` runs once :func:`replaymoe.routing._checks.validate`
passed, and what the library's entry points that validated the routing themselves run
(:func:`replaymoe.moe.fused_moe`; the transformers integration's routers, which repeat the checks only
when the logits' dtype, device or expert count change). The torch backend (:func:`route_torch_ids`) is
the executable spec of every method, in fp32; the Triton backend is :mod:`replaymoe.routing._triton`.
No argument checks here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch

from replaymoe._backend import resolve_backend
from replaymoe._validation import fail, is_capturing
from replaymoe.routing._checks import check_replay_weights, replay_ids_for_torch
from replaymoe.routing._triton import route_triton
from replaymoe.routing.methods import Params, nonnegative_weights, select_torch, weights_torch

if TYPE_CHECKING:
    from replaymoe.routing import RoutingConfig

__all__ = ["MAX_KERNEL_EXPERTS", "route_backend", "route_torch_ids", "run_route"]


MAX_KERNEL_EXPERTS = 4096  # the kernel holds a token's experts in registers


def route_torch_ids(
    router_logits: torch.Tensor,
    p: Params,
    bias: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    *,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend: (ids int32 [T, K], weights float32 [T, K]) with plain torch ops in fp32,
    differentiable with respect to the logits. ``replay_ids``: values already checked.
    ``replay_weights`` (with ``replay_ids``): the weights of the replayed rows, which then pass no
    gradient to the logits; rows of all -1 ids keep their computed weights. ``routing_weights_out``
    receives the weights returned (rows ``< T``)."""
    x32 = router_logits.float()
    native = None
    with torch.no_grad():
        ids = select_torch(x32.detach(), p, bias)
        if replay_ids is not None:
            forced = replay_ids.long()
            native = (forced == -1).all(dim=1, keepdim=True)
            ids = torch.where(native, ids, forced)
    weights = weights_torch(x32, ids, p)
    if replay_weights is not None:
        assert native is not None  # validate_weights: replay_weights only with replay_ids
        weights = torch.where(native, weights, replay_weights.detach())
    ids32 = ids.to(torch.int32)
    with torch.no_grad():
        if routing_replay_out is not None:
            routing_replay_out[: ids32.shape[0]].copy_(ids32)
        if routing_weights_out is not None:
            routing_weights_out[: weights.shape[0]].copy_(weights)
    return ids32, weights


def route_backend(backend: object, x: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for a call's ``backend`` and logits ``x`` (``"auto"`` takes the torch
    path beyond :data:`MAX_KERNEL_EXPERTS` experts; ``"triton"`` there raises ValueError)."""
    be = resolve_backend(backend, x)
    if x.shape[1] <= MAX_KERNEL_EXPERTS or be == "torch":
        return be
    if backend == "auto":
        return "torch"
    fail(
        "router_logits",
        f"at most {MAX_KERNEL_EXPERTS} experts for backend='triton' (one register tile per "
        "token; 'auto' uses the torch path beyond that)",
        x.shape[1],
    )


def run_route(
    router_logits: torch.Tensor,
    routing: RoutingConfig,
    p: Params,
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    backend: str,
    *,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route a validated call: ``(topk_ids, topk_weights)`` as :func:`replaymoe.routing.route` returns
    them (a plain tuple; ``route`` wraps it in a :class:`~replaymoe.routing.RoutingOutput`).

    The caller guarantees what :func:`replaymoe.routing._checks.validate` checks: ``p`` and
    ``replay_ids`` are what it returned for these ``router_logits``, ``routing`` (whose ``bias`` the
    kernels read) and ``routing_replay_out``, with ``defer=True`` (replay ids flagged in
    ``p.check_replay`` are checked here, by the backend) or with their values checked already.
    ``backend``: a call's ``backend`` argument (``"auto"``, ``"triton"``, ``"torch"``).
    ``routing_weights_out`` / ``replay_weights``: as :func:`replaymoe.routing._checks.validate_weights`
    returned them for this call.
    """
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]] = route_triton
    if route_backend(backend, router_logits) == "torch":
        run = route_torch_ids
        if p.check_replay:  # deferred by validate: the torch path checks them on the host
            assert replay_ids is not None
            replay_ids = replay_ids_for_torch(replay_ids, router_logits.shape[1])
            if replay_weights is not None and not is_capturing() and not torch.compiler.is_compiling():
                check_replay_weights(
                    replay_weights, replay_ids, nonnegative=nonnegative_weights(p.method, p.scale)
                )
            p = p._replace(check_replay=False)
    return run(
        router_logits,
        p,
        routing.bias,
        routing_replay_out,
        replay_ids,
        routing_weights_out=routing_weights_out,
        replay_weights=replay_weights,
    )

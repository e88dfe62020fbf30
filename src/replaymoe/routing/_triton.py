"""The Triton backend of :func:`replaymoe.routing.route`: launch, custom op and backward.

One kernel launch per call (``_kernel.py``, the method passed as its table row's flags,
:data:`~replaymoe.routing.methods.KERNEL_FLAGS`): eagerly through :func:`replaymoe._launch.fast`,
under ``torch.compile`` through the custom op ``replaymoe::route`` (with a fake implementation). With a
gradient, :class:`RouteFunction` adds the backward of the weights with respect to the logits at the selected
ids (:func:`weights_backward`): the row's closed form (:class:`~replaymoe.routing.methods.Formula`;
in one Triton launch of ``_kernel_grad.py``, eagerly and under ``torch.compile``; as torch ops for fp64),
or autograd of the row's formula where it gives none, so a new method needs no hand-derived gradient.
No argument checks here (:mod:`replaymoe.routing._checks` validates at the public boundary).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from replaymoe.routing.methods import (
    EPS,
    KERNEL_FLAGS,
    METHODS,
    Params,
    RoutingMethod,
    nonnegative_weights,
    weights_torch,
)

from .._backend import INTERPRET
from .._launch import cdiv, next_power_of_2
from ._id_mailbox import mailbox_for

if TYPE_CHECKING:
    from . import RoutingConfig, RoutingOutput

__all__ = ["LaunchConfig", "route_launched", "route_triton", "weights_backward"]


class LaunchConfig(NamedTuple):
    """How the routing kernel is launched, given per call by the benchmark's sweep and the tests of its
    top-k algorithms (:func:`route_launched`); every call of the library takes the defaults. ``algo``:
    the kernel's ``ALGO`` (0: ``tl.topk`` on packed keys; 1: iterative top-k on int64 keys; 2: on two
    int32 reductions; 3: on truncated int32 keys with verification and fallback); ``block_t``: tokens
    per program; ``num_warps``: 0 = 1 up to 512 padded experts, else 4."""

    algo: int = 3
    block_t: int = 2
    num_warps: int = 0


_DEFAULT_LAUNCH = LaunchConfig()


def _launch_config(ep: int, launch: Optional[list[int]]) -> tuple[int, int, int]:
    """(BLOCK_T, num_warps, ALGO) for a padded expert count ``ep``; ``launch``: a :class:`LaunchConfig`
    as a list (how it crosses the custom op), None for the defaults."""
    algo, block_t, num_warps = _DEFAULT_LAUNCH if launch is None else launch
    return block_t, num_warps or (1 if ep <= 512 else 4), algo


def _launch(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    top_k: int,
    method: int,
    n_group: int,
    topk_group: int,
    scale: float,
    check_replay: bool = False,
    launch: Optional[list[int]] = None,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and run the routing kernel once (no validation). ``check_replay``: the
    kernel also checks ``replay_ids`` on the device, into the error mailbox (:mod:`._id_mailbox`), after
    raising the error an earlier call left there. ``launch``: a :class:`LaunchConfig` (None: the
    defaults). ``routing_weights_out``: float32 ``[>= T, K]`` that receives the weights (rows ``< T``);
    ``replay_weights``: float32 ``[T, K]``, the weights of the rows ``replay_ids`` forces."""
    from replaymoe._launch import fast
    from replaymoe.routing._kernel import route_kernel

    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=dev)
    if num_tokens == 0:
        return ids, weights
    check: dict[str, Any] = {}
    if check_replay and replay_ids is not None:
        check = dict(err_addr=mailbox_for(replay_ids), CHECK_REPLAY=True)
    if routing_weights_out is not None:  # (compiled out of the kernel when absent, as the capture)
        check.update(wcap_ptr=routing_weights_out, HAS_WEIGHTS_OUT=True)
    if replay_weights is not None:
        check.update(rw_ptr=replay_weights, HAS_REPLAY_WEIGHTS=True)
        if check_replay:  # the weights are checked with the ids (validate_weights deferred them)
            check.update(RW_NONNEG=nonnegative_weights(method, scale))
    gs = num_experts // n_group
    ngp, gsp = next_power_of_2(n_group), next_power_of_2(gs)
    block_t, num_warps, algo = _launch_config(ngp * gsp, launch)
    flags = KERNEL_FLAGS[method]
    grid = ((num_tokens + block_t - 1) // block_t,)
    fast(route_kernel)[grid](
        router_logits,
        router_logits.stride(0),
        router_logits if bias is None else bias,
        router_logits if replay_ids is None else replay_ids,
        ids,
        weights,
        router_logits if routing_replay_out is None else routing_replay_out,
        num_tokens,
        scale,
        **flags,
        K=top_k,
        KP=next_power_of_2(top_k),
        NG=n_group,
        GS=gs,
        NGP=ngp,
        GSP=gsp,
        TOPK_GROUP=topk_group,
        HAS_BIAS=bias is not None,
        HAS_REPLAY=replay_ids is not None,
        HAS_CAPTURE=routing_replay_out is not None,
        BLOCK_T=block_t,
        ALGO=algo,
        KEY32=router_logits.dtype != torch.float32 and not flags["BIASED"],
        LOG_EP=(ngp * gsp).bit_length() - 1,
        num_warps=num_warps,
        **check,
    )
    return ids, weights


# the same function as torch.ops.replaymoe.route, for torch.compile; eager calls use _launch directly. The
# schema is written out so that no argument has a default: the dispatcher hands a Python kernel the
# trailing arguments that equal their defaults as missing, and torch 2.11's custom ops then index the
# mutated routing_weights_out past the end (IndexError under torch.compile); every call passes all of
# them (_op_args)
_ROUTE_SCHEMA = (
    "(Tensor router_logits, Tensor? bias, Tensor(a2!)? routing_replay_out, Tensor? replay_ids, SymInt top_k, "
    "SymInt method, SymInt n_group, SymInt topk_group, float scale, bool check_replay, SymInt[]? launch, "
    "Tensor(a11!)? routing_weights_out, Tensor? replay_weights) -> (Tensor, Tensor)"
)
_route_op = torch.library.custom_op(
    "replaymoe::route", mutates_args=("routing_replay_out", "routing_weights_out"), schema=_ROUTE_SCHEMA
)(_launch)


@_route_op.register_fake
def _route_op_fake(
    router_logits, bias, routing_replay_out, replay_ids, top_k, method, n_group, topk_group, scale,
    check_replay, launch, routing_weights_out, replay_weights,
):  # fmt: skip
    t = router_logits.shape[0]
    return (
        router_logits.new_empty((t, top_k), dtype=torch.int32),
        router_logits.new_empty((t, top_k), dtype=torch.float32),
    )


def _op_args(router_logits, bias, routing_replay_out, replay_ids, p: Params, launch=None,
             routing_weights_out=None, replay_weights=None) -> tuple:  # fmt: skip
    """The arguments of :func:`_launch` / ``replaymoe::route`` / :class:`RouteFunction`, in order."""
    return (router_logits, bias, routing_replay_out, replay_ids, p.top_k, int(p.method), p.n_group,
            p.topk_group, p.scale, p.check_replay, None if launch is None else list(launch),
            routing_weights_out, replay_weights)  # fmt: skip


def _kernel(router_logits, bias, routing_replay_out, replay_ids, p: Params, launch=None,
            routing_weights_out=None, replay_weights=None):  # fmt: skip
    args = _op_args(router_logits, bias, routing_replay_out, replay_ids, p, launch, routing_weights_out,
                    replay_weights)  # fmt: skip
    if torch.compiler.is_compiling():
        return torch.ops.replaymoe.route(*args)
    return _launch(*args)  # eager: skip the custom-op dispatch overhead, same code


def weights_backward(
    router_logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor, method: int, scale: float
) -> torch.Tensor:
    """Gradient of the method's weights w.r.t. the logits at fixed ``ids``, in fp32 (fp64 for fp64
    logits): the row's closed form (:attr:`replaymoe.routing.methods.Formula.grad`), or else
    autograd of its formula (:func:`replaymoe.routing.methods.weights_torch`) through
    ``torch.func.vjp``. 16- or 32-bit logits on CUDA (or in Triton's interpreter) with a closed form in
    the kernel take one launch of ``_kernel_grad.py`` (under ``torch.compile`` the custom op
    ``replaymoe::route_weights_grad``, the same kernel); otherwise torch ops, which ``torch.compile``
    traces."""
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    m = RoutingMethod(method)
    formula = METHODS[m].formula
    closed = formula.grad
    if formula.grad_kernel and acc == torch.float32 and _grad_kernel_ok(router_logits):
        kind = formula.kernel
        if torch.compiler.is_compiling():
            return torch.ops.replaymoe.route_weights_grad(router_logits, ids, grad_w, kind, float(scale))
        return _grad_launch(router_logits, ids, grad_w, kind, float(scale))
    p = Params(m, ids.shape[1], 1, 1, scale)
    # bad replay ids (checked on the device, reported later) must not index out of the row: clamped,
    # which leaves valid ids as they are
    idl = ids.long().clamp(0, router_logits.shape[1] - 1)
    x = router_logits.detach().to(acc)
    if closed is not None:
        return closed(x, idl, grad_w.to(acc), p).to(router_logits.dtype)
    vjp = torch.func.vjp(lambda t: weights_torch(t, idl, p), x)[1]  # (output, vjp_fn)
    (gx,) = vjp(grad_w.to(acc))
    return gx.to(router_logits.dtype)


def _grad_kernel_ok(router_logits: torch.Tensor) -> bool:
    """The one-launch backward applies: logits on a CUDA device (or Triton's interpreter), 2-D, of at
    most 4096 experts."""
    if router_logits.dim() != 2 or router_logits.shape[1] > 4096:
        return False
    return router_logits.is_cuda or INTERPRET


def _grad_launch(
    router_logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor, kind: int, scale: float
) -> torch.Tensor:
    """``route_weights_grad_kernel``: dL/d logits [T, E] in the logits' dtype, one launch. Also the
    custom op ``replaymoe::route_weights_grad``, so that ``torch.compile`` traces the same kernel as
    eager calls (the same bits); eager calls skip the op's dispatch."""
    from replaymoe._launch import fast
    from replaymoe.routing._kernel_grad import route_weights_grad_kernel

    T, E = router_logits.shape
    K = ids.shape[1]
    out = torch.empty((T, E), dtype=router_logits.dtype, device=router_logits.device)
    if T == 0:
        return out
    x = router_logits.detach()
    if x.stride(1) != 1:
        x = x.contiguous()
    ep, kp = next_power_of_2(E), next_power_of_2(K)
    block_t = max(1, min(8, 8192 // (ep * kp)))
    fast(route_weights_grad_kernel)[(cdiv(T, block_t),)](
        x, ids.contiguous(), grad_w.contiguous(), out, T, E, x.stride(0), out.stride(0), float(scale), EPS,
        KIND=kind, K=K, KP=kp, EP=ep, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
    return out


_grad_op = torch.library.custom_op("replaymoe::route_weights_grad", mutates_args=())(_grad_launch)


@_grad_op.register_fake
def _(router_logits, ids, grad_w, kind, scale):
    return router_logits.new_empty(router_logits.shape)


class RouteFunction(torch.autograd.Function):
    """route() on the Triton backend with a backward w.r.t. the logits (ids are not differentiable).
    With ``replay_weights`` the replayed rows' weights are those values: no gradient reaches the logits
    through them (only rows of all -1 replay ids, routed natively, pass one)."""

    @staticmethod
    def forward(
        ctx, router_logits, bias, routing_replay_out, replay_ids, top_k, method, n_group, topk_group, scale,
        check_replay, launch, routing_weights_out, replay_weights,
    ):  # fmt: skip
        p = Params(RoutingMethod(method), top_k, n_group, topk_group, scale, check_replay)
        ids, weights = _kernel(router_logits, bias, routing_replay_out, replay_ids, p, launch,
                               routing_weights_out, replay_weights)  # fmt: skip
        ctx.save_for_backward(router_logits, ids, replay_ids if replay_weights is not None else None)
        ctx.method, ctx.scale = method, scale
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, grad_ids, grad_w):
        router_logits, ids, forced = ctx.saved_tensors
        if forced is not None:  # replayed weights are constants: only native rows pass a gradient
            grad_w = torch.where((forced == -1).all(dim=1, keepdim=True), grad_w, 0.0)
        gx = weights_backward(router_logits, ids, grad_w, ctx.method, ctx.scale)
        # one gradient per input of forward: the logits', then None for the other twelve
        return gx, None, None, None, None, None, None, None, None, None, None, None, None


def route_triton(
    router_logits: torch.Tensor,
    p: Params,
    bias: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    launch: Optional[LaunchConfig] = None,
    *,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton backend of :func:`replaymoe.routing._dispatch.run_route` (no argument checks: its
    preconditions); ``launch``: how the kernel is launched (None: the defaults; :func:`route_launched`)."""
    w = (routing_weights_out, replay_weights)
    if torch.is_grad_enabled() and router_logits.requires_grad:
        args = _op_args(router_logits, bias, routing_replay_out, replay_ids, p, launch, *w)
        ids, weights = RouteFunction.apply(*args)
    else:
        ids, weights = _kernel(router_logits, bias, routing_replay_out, replay_ids, p, launch, *w)
    return ids, weights


def route_launched(
    launch: LaunchConfig,
    router_logits: torch.Tensor,
    routing: RoutingConfig,
    *,
    routing_replay_out: Optional[torch.Tensor] = None,
    replay_ids: Optional[torch.Tensor] = None,
    check_replay: bool = True,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
) -> RoutingOutput:
    """:func:`replaymoe.routing.route` on the Triton backend with the kernel launched as ``launch`` says
    (the routing benchmark's sweep of launch configurations, the tests of every top-k algorithm): the
    same per-call validation (``routing`` was validated when it was built), the same
    :class:`~replaymoe.routing.RoutingOutput`."""
    from . import RoutingOutput
    from ._checks import validate, validate_weights

    p, replay_ids = validate(router_logits, routing, routing_replay_out, replay_ids, check_replay, defer=True)
    replay_weights = validate_weights(
        router_logits, routing, routing_weights_out, replay_ids, replay_weights, check_replay, defer=True
    )
    return RoutingOutput(
        *route_triton(router_logits, p, routing.bias, routing_replay_out, replay_ids, launch,
                      routing_weights_out=routing_weights_out, replay_weights=replay_weights)
    )  # fmt: skip

"""MoE routing: top-k expert selection and weights, with capture and replay.

Ten routers with FlashInfer's numbering (:class:`RoutingMethod`); one fused Triton
kernel per :func:`route` call on the GPU; :func:`route_torch` is the pure-PyTorch
reference (fp32, CPU or GPU, differentiable) that defines the semantics.

The package, one op: this module (the public entry points, :class:`RoutingConfig`), ``methods`` (the
per-method table: the selection score, grouping and weights formula of every method, with its math),
``_checks`` (validation at the public boundary), ``_dispatch`` (the routing past validation:
``run_route``, the backend choice and the torch reference's ops), ``_triton`` (the host side of the
kernels: launch, custom ops, backward), ``_kernel`` and ``_kernel_grad`` (Triton code).

Semantics shared by every method and backend
--------------------------------------------
* Selection is on a per-method *selection score* (:mod:`replaymoe.routing.methods` gives each
  method's score and weights formula), in fp32. NaN scores are
  treated as ``-inf``; ties go to the smaller expert index (the order is the total
  order of the key ``(score, -index)``), so ids in a row are always distinct and in
  ``[0, E)``. Columns come in descending selection-score order.
* Weights are computed in fp32 from the logits at the chosen ids by the method's
  formula. With ``replay_ids`` the selection is skipped and the weights are
  recomputed over the forced ids, in the column order given (R3), unless
  ``replay_weights`` gives them too (full recall): the forced rows then take those
  weights, and no gradient reaches the logits through them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from replaymoe._validation import fail
from replaymoe.routing._checks import (
    check_replay_ids,
    check_replay_weights,
    mark_valid_ids,
    validate,
    validate_config,
    validate_weights,
)
from replaymoe.routing._dispatch import run_route
from replaymoe.routing._id_mailbox import raise_id_errors
from replaymoe.routing.methods import RoutingMethod

__all__ = [
    "RoutingConfig",
    "RoutingMethod",
    "RoutingOutput",
    "check_replay_ids",
    "check_replay_weights",
    "raise_id_errors",
    "route",
    "route_torch",
]


class RoutingOutput(NamedTuple):
    """Result of :func:`route`.

    Attributes
    ----------
    topk_ids : torch.Tensor
        int32 ``[T, K]``: global expert ids in ``[0, E)``, distinct within a row, columns in
        descending selection-score order (replay: the forced ids in the order given).
    topk_weights : torch.Tensor
        float32 ``[T, K]``: the routing weights of those experts (method's formula, fp32).
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


# --------------------------------------------------------------------------------------------------
# the routing configuration: everything route() needs besides the logits
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingConfig:
    """How tokens choose experts (see :mod:`replaymoe.routing.methods` for the math of each method).

    Validated once, when it is built; ``route``, ``route_torch``, ``fused_moe`` and ``ep_moe`` take
    one as ``routing=`` (``MoELayer`` and the transformers integration hold one as ``.routing``)
    instead of repeating the routing arguments, and check per call only what depends on the logits
    (the number of experts). The loose keyword arguments of those functions remain a convenience that
    builds one at once (:func:`as_routing`).

    Attributes
    ----------
    top_k : int
        Experts per token, ``>= 1`` (LLAMA4: exactly 1); at most E, checked per call.
    method : RoutingMethod
        The router.
    bias : torch.Tensor, optional
        ``[E]`` float32/bfloat16/float16 contiguous selection bias, DEEPSEEK_V3 and MINIMAX2 only.
    n_group, topk_group : int, optional
        DEEPSEEK_V3 grouping (``n_group <= 32``, ``1 <= topk_group <= n_group``, required when
        ``n_group > 1``).
    routed_scaling_factor : float, optional
        DEEPSEEK_V3 and MINIMAX2 weight scale (None = 1.0).
    num_groups, groups_kept : int
        Derived: ``n_group`` and ``topk_group`` with None resolved (1 without grouping).
    scale : float
        Derived: the weight scale (1.0 when not given).

    Raises
    ------
    ValueError
        At construction, naming the argument, for any invalid value or combination.
    """

    top_k: int
    method: RoutingMethod = RoutingMethod.RENORMALIZE
    bias: Optional[torch.Tensor] = field(default=None, compare=False)
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: Optional[float] = None
    num_groups: int = field(init=False, repr=False)
    groups_kept: int = field(init=False, repr=False)
    scale: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        method, ng, tg, scale = validate_config(
            self.top_k, self.method, self.bias, self.n_group, self.topk_group, self.routed_scaling_factor
        )
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "num_groups", ng)
        object.__setattr__(self, "groups_kept", tg)
        object.__setattr__(self, "scale", scale)


def as_routing(
    routing: object,
    top_k: Optional[int],
    method: Optional[RoutingMethod],
    bias: Optional[torch.Tensor],
    n_group: Optional[int],
    topk_group: Optional[int],
    routed_scaling_factor: Optional[float],
) -> RoutingConfig:
    """The routing object of a public entry point: ``routing``, or a :class:`RoutingConfig` built from
    the loose keyword arguments (exactly one of the two; ``method`` None means RENORMALIZE).

    Every entry point that takes the routing keywords (``route``, ``route_torch``, ``fused_moe``,
    ``ep_moe``, ``MoELayer``) folds them here, once, so that their list and its validation exist
    once.

    Raises
    ------
    ValueError
        Both or neither given, ``routing`` not a RoutingConfig, or an invalid routing argument.
    """
    if routing is None:
        if top_k is None:
            fail("top_k", "an int (or routing=RoutingConfig(...))", None)
        method = RoutingMethod.RENORMALIZE if method is None else method
        return RoutingConfig(top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    if not isinstance(routing, RoutingConfig):
        fail("routing", "a RoutingConfig", type(routing).__name__, what="type")
    given = [
        name
        for name, value in (
            ("top_k", top_k),
            ("method", method),  # (RENORMALIZE too: a method given beside routing is never ignored)
            ("bias", bias),
            ("n_group", n_group),
            ("topk_group", topk_group),
            ("routed_scaling_factor", routed_scaling_factor),
        )
        if value is not None
    ]
    if given:
        fail(given[0], "not given together with routing (the RoutingConfig holds it)", given[0] + " given")
    return routing


# --------------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------------


def route_torch(
    router_logits: torch.Tensor,
    top_k: Optional[int] = None,
    method: Optional[RoutingMethod] = None,
    **kwargs,
) -> RoutingOutput:
    """Pure-PyTorch reference of :func:`route` (the executable spec): ``route(..., backend="torch")``.

    Same arguments (minus ``backend``), validation and results as :func:`route` (see there);
    computes in fp32 with plain torch ops on any device and is differentiable with respect to
    ``router_logits`` (with and without ``replay_ids``).
    """
    if "backend" in kwargs:
        fail("backend", "not given to route_torch (it is the torch backend)", kwargs["backend"])
    return route(router_logits, top_k, method, backend="torch", **kwargs)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------


def route(
    router_logits: torch.Tensor,
    top_k: Optional[int] = None,
    method: Optional[RoutingMethod] = None,
    *,
    routing: Optional[RoutingConfig] = None,
    bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: Optional[float] = None,
    routing_replay_out: Optional[torch.Tensor] = None,
    replay_ids: Optional[torch.Tensor] = None,
    routing_weights_out: Optional[torch.Tensor] = None,
    replay_weights: Optional[torch.Tensor] = None,
    backend: str = "auto",
    check_replay: bool = True,
) -> RoutingOutput:
    """Select the top-k experts of every token and their weights (one fused kernel on the GPU).

    Parameters
    ----------
    router_logits : torch.Tensor
        ``[T, E]`` float32, bfloat16 or float16, unit stride along experts (rows may be strided).
    top_k : int
        Experts per token, ``1 <= top_k <= E`` (LLAMA4: exactly 1; DEEPSEEK_V3: at most
        ``topk_group * E / n_group``). Give either ``top_k`` (with ``method`` and the routing
        keywords below) or ``routing``.
    method : RoutingMethod, optional
        The router (module docstring has the math of every method); None (the default) means
        ``RENORMALIZE``, as in :func:`replaymoe.fused_moe`, :func:`replaymoe.ep_moe` and ``MoELayer``.
    routing : RoutingConfig, optional
        ``top_k``, ``method``, ``bias``, ``n_group``, ``topk_group`` and
        ``routed_scaling_factor`` together, validated once when it was built; give it or them,
        not both.
    bias : torch.Tensor, optional
        ``[E]`` float32/bfloat16/float16 selection bias, DEEPSEEK_V3 and MINIMAX2 only
        (None = zero bias). Affects selection only, never the weights.
    n_group, topk_group : int, optional
        DEEPSEEK_V3 grouping: ``E % n_group == 0``, ``n_group <= 32``,
        ``1 <= topk_group <= n_group`` (required when ``n_group > 1``). None = no grouping.
    routed_scaling_factor : float, optional
        Weight scale of DEEPSEEK_V3 and MINIMAX2 (None = 1.0).
    routing_replay_out : torch.Tensor, optional
        Capture buffer: int16 ``[>= T, K]``, contiguous, on the logits' device. Rows ``< T``
        receive ``topk_ids`` (same column order); rows ``>= T`` are untouched, so one max-size
        buffer serves every step of a CUDA graph. When None the write is compiled out of the
        kernel; results are bit-identical either way.
    replay_ids : torch.Tensor, optional
        ``[T, K]`` int16/int32/int64 expert ids to force (any strides; copied when not
        contiguous, e.g. ``trace_ids[:, layer]``): selection is skipped and the weights
        are recomputed from the logits over these ids (in this column order). A row of all -1
        is routed natively. Any other id outside ``[0, E)``, a row mixing -1 with ids, or a
        repeated id in a row raises ValueError (see ``check_replay``).
    routing_weights_out : torch.Tensor, optional
        Capture buffer of the weights (full recall): float32 ``[>= T, K]``, contiguous, on the
        logits' device, with ``routing_replay_out``'s row rules: rows ``< T`` receive
        ``topk_weights`` (the weights returned, replayed ones included), rows ``>= T`` are untouched;
        compiled out of the kernel when None.
    replay_weights : torch.Tensor, optional
        float32 ``[T, K]`` (any strides), only with ``replay_ids`` (full recall): the weights of the
        forced rows, returned as ``topk_weights`` as they are. Rows whose replay ids are all -1
        (routed natively) keep their computed weights, and their values here are not read (NaN is
        fine). No gradient reaches ``router_logits`` through the replayed weights. With
        ``check_replay`` their values are checked where the ids are (see ``check_replay``: on CUDA
        by the routing kernel, without a host sync): finite, and ``>= 0`` for every method but TOPK
        (whose weights are the raw logits) with a non-negative scale.
    backend : {"auto", "triton", "torch"}
        ``auto``: the Triton kernel on CUDA tensors (up to 4096 experts), the torch reference
        otherwise. ``triton`` on CPU tensors needs the process started with ``TRITON_INTERPRET=1``.
    check_replay : bool
        Check the values of ``replay_ids``. On CUDA with the Triton kernel: on the device, by the
        routing kernel itself (no launch, no host sync; eager, compiled and CUDA-graph calls alike);
        the ValueError comes at the next checked call on the device (``route`` with replay ids,
        ``fused_moe`` with caller ids), or at once from :func:`raise_id_errors`, and this call's
        output for a bad row is unspecified (nothing is read outside the row). Elsewhere (the CPU,
        the torch backend) on the host: one host sync per call eagerly on a GPU, an op in the graph
        under ``torch.compile``, skipped during CUDA-graph capture. Pass False only for ids already
        checked once with :func:`check_replay_ids` (e.g. a replay table built from validated
        traces).

    Returns
    -------
    RoutingOutput
        ``topk_ids`` int32 ``[T, K]`` and ``topk_weights`` float32 ``[T, K]``; differentiable
        with respect to ``router_logits`` on every backend.

    Raises
    ------
    ValueError
        Naming the argument, for any invalid dtype, shape, device, layout or value; ``routing``
        together with a routing keyword it holds.
    """
    routing = as_routing(routing, top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    p, replay_ids = validate(router_logits, routing, routing_replay_out, replay_ids, check_replay, defer=True)
    if routing_weights_out is not None or replay_weights is not None:
        replay_weights = validate_weights(
            router_logits, routing, routing_weights_out, replay_ids, replay_weights, check_replay, defer=True
        )
    out = RoutingOutput(
        *run_route(router_logits, routing, p, routing_replay_out, replay_ids, backend,
                   routing_weights_out=routing_weights_out, replay_weights=replay_weights)
    )  # fmt: skip
    if (replay_ids is None or check_replay) and not torch.compiler.is_compiling():
        mark_valid_ids(out.topk_ids, router_logits.shape[1])  # fused_moe need not check them again
    return out

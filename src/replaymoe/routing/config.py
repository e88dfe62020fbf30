"""The routing configuration: everything :func:`replaymoe.routing.route` needs besides the logits.

A :class:`RoutingConfig` is validated once, when it is built; ``route``, ``fused_moe``, ``ep_moe``,
``MoELayer`` and the transformers integration take one (``config=`` / ``routing=``) instead of
repeating the routing arguments, and check per call only what depends on the logits (the number of
experts). The keyword arguments of those functions remain as a convenience that builds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from replaymoe._routing_method import RoutingMethod
from replaymoe._validation import check_int, check_tensor, fail, tensor_ok
from replaymoe.routing.methods import METHODS

__all__ = ["BIAS_DTYPES", "RoutingConfig", "as_config"]

BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_N_GROUP = 32
_METHOD_VALUES = tuple(int(m) for m in METHODS)


@dataclass(frozen=True)
class RoutingConfig:
    """How tokens choose experts (see :mod:`replaymoe.routing` for the math of each method).

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


def validate_config(
    top_k: object,
    method: object,
    bias: object,
    n_group: object,
    topk_group: object,
    routed_scaling_factor: object,
) -> tuple[RoutingMethod, int, int, float]:
    """The checks of the routing arguments that need no logits: (method, n_group, topk_group, scale).

    The number of experts is checked against them per call (:func:`validate`).
    """
    # membership by ==, not chained <: torch 2.11's dynamo rejects `<` on enum constants
    if isinstance(method, bool) or not isinstance(method, int) or method not in _METHOD_VALUES:
        fail("method", "a RoutingMethod (0..9)", repr(method))
    if not isinstance(method, RoutingMethod):  # torch 2.11's dynamo cannot trace the enum constructor
        method = RoutingMethod(method)
    if type(top_k) is not int or top_k < 1:
        check_int("top_k", top_k, low=1)
    spec = METHODS[method]
    if spec.single_expert and top_k != 1:
        fail("top_k", f"1 for RoutingMethod.{method.name}", top_k)
    if spec.biased:
        if bias is not None and not tensor_ok(bias, 1, BIAS_DTYPES, None, True):
            check_tensor("bias", bias, ndim=1, dtype=BIAS_DTYPES, contiguous=True)
        if routed_scaling_factor is None:
            scale = 1.0
        else:
            if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
                fail(
                    "routed_scaling_factor",
                    "a float or None",
                    type(routed_scaling_factor).__name__,
                    what="type",
                )
            scale = float(routed_scaling_factor)
            if not math.isfinite(scale):
                fail("routed_scaling_factor", "a finite float", scale)
    else:
        if bias is not None:
            fail("bias", f"None for {method.name} (bias applies to DEEPSEEK_V3 and MINIMAX2)", "a tensor")
        if routed_scaling_factor is not None:
            fail(
                "routed_scaling_factor",
                f"None for {method.name} (it applies to DEEPSEEK_V3 and MINIMAX2)",
                routed_scaling_factor,
            )
        scale = 1.0
    if spec.grouped:
        ng = 1 if n_group is None else check_int("n_group", n_group, low=1, high=_MAX_N_GROUP)
        if topk_group is None:
            if ng > 1:
                fail("topk_group", f"an int in [1, {ng}] when n_group > 1", None)
            tg = 1
        else:
            tg = check_int("topk_group", topk_group, low=1, high=ng)
    else:
        for name, val in (("n_group", n_group), ("topk_group", topk_group)):
            if val is not None and val != 1:
                fail(name, f"None or 1 for {method.name} (grouping applies to DEEPSEEK_V3)", val)
        ng, tg = 1, 1
    return method, ng, tg, scale


def as_config(
    config: object,
    top_k: object,
    method: object,
    bias: object,
    n_group: object,
    topk_group: object,
    routed_scaling_factor: object,
) -> RoutingConfig:
    """``config``, or a :class:`RoutingConfig` built from the keyword arguments (exactly one of the two;
    ``method`` None means RENORMALIZE).

    Raises
    ------
    ValueError
        Both or neither given, ``config`` not a RoutingConfig, or an invalid routing argument.
    """
    if config is None:
        if top_k is None:
            fail("top_k", "an int (or config=RoutingConfig(...))", None)
        method = RoutingMethod.RENORMALIZE if method is None else method
        return RoutingConfig(top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    if not isinstance(config, RoutingConfig):
        fail("config", "a RoutingConfig", type(config).__name__, what="type")
    given = [
        name
        for name, value in (
            ("top_k", top_k),
            ("bias", bias),
            ("n_group", n_group),
            ("topk_group", topk_group),
            ("routed_scaling_factor", routed_scaling_factor),
        )
        if value is not None
    ]
    if method is not RoutingMethod.RENORMALIZE and method is not None:
        given.append("method")
    if given:
        fail(given[0], "not given together with config (the config holds it)", given[0] + " given")
    return config

"""Per-method routing in one table: how each :class:`RoutingMethod` selects and weighs experts.

:data:`METHODS` maps every method to a :class:`MethodSpec`: whether its selection score is
``sigmoid(x) + bias`` (and it takes a bias and a ``routed_scaling_factor``), whether it groups experts
(DeepSeek-V3), whether it needs ``top_k == 1`` (Llama-4), and its weights formula. The torch reference
(:func:`select_torch`, :func:`weights_torch`), the validation of :func:`replaymoe.routing.route` and
the Triton backward read this table; the Triton kernel has one branch per formula.

Adding a method: a :class:`~replaymoe._routing_method.RoutingMethod` number, one row here, one
branch in ``routing/_kernel.py``, one row in the tests' method table (the Triton op's backward is
autograd of the row's formula).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from replaymoe._routing_method import RoutingMethod

__all__ = [
    "EPS",
    "GRAD_KIND",
    "METHODS",
    "MethodSpec",
    "Params",
    "select_torch",
    "selection_scores",
    "weights_torch",
]

EPS = 1e-20


class Params(NamedTuple):
    """Validated, normalised routing arguments."""

    method: RoutingMethod
    top_k: int
    n_group: int
    topk_group: int
    scale: float


def _softmax_at(x32, ids, p):
    return torch.softmax(x32, dim=1).gather(1, ids)


def _softmax_at_renorm(x32, ids, p):
    probs = torch.softmax(x32, dim=1).gather(1, ids)
    return probs / probs.sum(dim=1, keepdim=True)


def _softmax_of_selected(x32, ids, p):
    return torch.softmax(x32.gather(1, ids), dim=1)


def _raw_logits(x32, ids, p):
    return x32.gather(1, ids)


def _sigmoid(x32, ids, p):
    return torch.sigmoid(x32.gather(1, ids))


def _sigmoid_renorm(x32, ids, p):
    s = torch.sigmoid(x32.gather(1, ids))
    return s / s.sum(dim=1, keepdim=True).clamp_min(EPS)


def _sigmoid_scaled(x32, ids, p):
    s = torch.sigmoid(x32.gather(1, ids))
    return s / (s.sum(dim=1, keepdim=True) + EPS) * p.scale


# Closed-form gradients of the formulas above with respect to x32 at fixed ids, ``g`` = dL/dw [T, K]:
# the same values as autograd of the formula (tests/test_routing.py checks them in float64), in a
# handful of ops instead of a traced vjp (the eager backward's host time matters in training).
def _scatter(x32, ids, d):
    return torch.zeros_like(x32).scatter_add_(1, ids, d)


def _softmax_back(probs, dq):  # d softmax(x) for a cotangent dq on all E columns
    return probs * (dq - (dq * probs).sum(dim=1, keepdim=True))


def _grad_softmax_at(x32, ids, g, p):
    return _softmax_back(torch.softmax(x32, dim=1), _scatter(x32, ids, g))


def _grad_softmax_at_renorm(x32, ids, g, p):
    probs = torch.softmax(x32, dim=1)
    q = probs.gather(1, ids)
    qs = q.sum(dim=1, keepdim=True)
    dq = (g - (g * q).sum(dim=1, keepdim=True) / qs) / qs
    return _softmax_back(probs, _scatter(x32, ids, dq))


def _grad_softmax_of_selected(x32, ids, g, p):
    w = torch.softmax(x32.gather(1, ids), dim=1)
    return _scatter(x32, ids, w * (g - (g * w).sum(dim=1, keepdim=True)))


def _grad_raw_logits(x32, ids, g, p):
    return _scatter(x32, ids, g)


def _grad_sigmoid(x32, ids, g, p):
    s = torch.sigmoid(x32.gather(1, ids))
    return _scatter(x32, ids, g * s * (1 - s))


def _grad_sigmoid_renorm(x32, ids, g, p):
    s = torch.sigmoid(x32.gather(1, ids))
    total = s.sum(dim=1, keepdim=True)
    den = total.clamp_min(EPS)
    # clamp_min passes a gradient where total >= EPS (autograd's rule), none below
    ds = g / den - torch.where(total >= EPS, (g * s).sum(dim=1, keepdim=True) / (den * den), 0.0)
    return _scatter(x32, ids, ds * s * (1 - s))


def _grad_sigmoid_scaled(x32, ids, g, p):
    s = torch.sigmoid(x32.gather(1, ids))
    den = s.sum(dim=1, keepdim=True) + EPS
    ds = (g / den - (g * s).sum(dim=1, keepdim=True) / (den * den)) * p.scale
    return _scatter(x32, ids, ds * s * (1 - s))


# The closed forms that the Triton backward computes in one kernel (``routing/_kernel_grad.py``),
# by its ``KIND`` number; a closed form missing here runs as torch ops.
GRAD_KIND: dict[Callable, int] = {
    _grad_softmax_at: 0,
    _grad_softmax_of_selected: 1,
    _grad_sigmoid_scaled: 2,
    _grad_sigmoid: 3,
    _grad_softmax_at_renorm: 4,
    _grad_raw_logits: 5,
    _grad_sigmoid_renorm: 6,
}


@dataclass(frozen=True)
class MethodSpec:
    """One routing method (see the table in :mod:`replaymoe.routing`'s docstring).

    Attributes
    ----------
    biased : bool
        Selection score ``sigmoid(x) + bias``; takes ``bias`` and ``routed_scaling_factor``.
    grouped : bool
        Takes ``n_group`` / ``topk_group`` (group masking before the top-k).
    single_expert : bool
        Needs ``top_k == 1``.
    weights : callable
        ``(x32 [T, E] fp32, ids [T, K] int64, Params) -> [T, K]`` weights, differentiable in x32.
    grad : callable or None
        ``(x32, ids, g [T, K], Params) -> [T, E]``: the gradient of ``weights`` w.r.t. x32 at fixed
        ids for the cotangent g, in closed form; None = the Triton backward takes a vjp of
        ``weights`` (a new method needs no hand-derived gradient).
    """

    biased: bool
    grouped: bool
    single_expert: bool
    weights: Callable[[torch.Tensor, torch.Tensor, Params], torch.Tensor]
    grad: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Params], torch.Tensor]] = None


METHODS: dict[RoutingMethod, MethodSpec] = {
    RoutingMethod.DEFAULT: MethodSpec(False, False, False, _softmax_at, _grad_softmax_at),
    RoutingMethod.RENORMALIZE: MethodSpec(
        False, False, False, _softmax_of_selected, _grad_softmax_of_selected
    ),
    RoutingMethod.DEEPSEEK_V3: MethodSpec(True, True, False, _sigmoid_scaled, _grad_sigmoid_scaled),
    RoutingMethod.LLAMA4: MethodSpec(False, False, True, _sigmoid, _grad_sigmoid),
    RoutingMethod.RENORMALIZE_NAIVE: MethodSpec(
        False, False, False, _softmax_at_renorm, _grad_softmax_at_renorm
    ),
    RoutingMethod.TOPK: MethodSpec(False, False, False, _raw_logits, _grad_raw_logits),
    RoutingMethod.SIGMOID_RENORM: MethodSpec(False, False, False, _sigmoid_renorm, _grad_sigmoid_renorm),
    RoutingMethod.MINIMAX2: MethodSpec(True, False, False, _sigmoid_scaled, _grad_sigmoid_scaled),
    RoutingMethod.SIGMOID: MethodSpec(False, False, False, _sigmoid, _grad_sigmoid),
    RoutingMethod.TOPK_SIGMOID: MethodSpec(False, False, False, _sigmoid, _grad_sigmoid),
}


def selection_scores(x32: torch.Tensor, p: Params, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 [T, E] selection scores (NaN -> -inf, group masking applied). No grad."""
    spec = METHODS[p.method]
    if spec.biased:
        b = torch.sigmoid(x32)
        if bias is not None:
            b = b + bias.float()
    else:
        b = x32.clone()
    neg_inf = float("-inf")  # a Python scalar: no host->device copy (CUDA-graph capturable)
    b = torch.where(torch.isnan(b), neg_inf, b)
    if spec.grouped and p.n_group > 1:
        t, e = b.shape
        grouped = b.view(t, p.n_group, e // p.n_group)
        top2 = grouped.topk(min(2, e // p.n_group), dim=2).values  # descending
        gscore = top2[:, :, 0] + top2[:, :, 1] if top2.shape[2] == 2 else top2[:, :, 0]
        gscore = torch.where(torch.isnan(gscore), neg_inf, gscore)
        keep_groups = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, : p.topk_group]
        keep = torch.zeros(t, p.n_group, dtype=torch.bool, device=b.device)
        keep.scatter_(1, keep_groups, True)
        b = torch.where(keep.repeat_interleave(e // p.n_group, dim=1), b, neg_inf)
    return b


def select_torch(x32: torch.Tensor, p: Params, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 [T, K] ids: top-k of the selection score, ties to the smaller index."""
    b = selection_scores(x32, p, bias)
    return torch.sort(b, dim=1, descending=True, stable=True).indices[:, : p.top_k]


def weights_torch(x32: torch.Tensor, ids: torch.Tensor, p: Params) -> torch.Tensor:
    """fp32 [T, K] weights of the method at ``ids`` (int64), differentiable w.r.t. ``x32``."""
    return METHODS[p.method].weights(x32, ids, p)

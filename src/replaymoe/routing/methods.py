"""The routing methods in one table: one row per :class:`RoutingMethod`, read by everything else.

Each row (:class:`MethodSpec`) says how the method selects experts (its selection score is the
logits, or ``sigmoid(x) + bias`` with a bias and a ``routed_scaling_factor``; whether it groups
experts; whether it needs ``top_k == 1``) and how it weighs them (:class:`Formula`: the torch math,
its closed-form gradient, the number of the branch the Triton kernels take, whether it needs the
softmax over all experts). The validation of the routing arguments, the torch reference
(:func:`select_torch`, :func:`weights_torch`), the Triton launch (the kernel's constexpr flags,
:data:`KERNEL_FLAGS`) and the backward read the row; no code compares method names.

=====================  ======================  =====================================================
method                 selection score         weights over the selected set S (:class:`Formula`)
=====================  ======================  =====================================================
DEFAULT (0)            x                       softmax(x) over all E experts, at S (no renorm)
RENORMALIZE (1)        x                       softmax over x_S
DEEPSEEK_V3 (2)        b = sigmoid(x) + bias   s_S / (sum s_S + 1e-20) * routed_scaling_factor,
                       (grouped, see below)    s = sigmoid(x) (unbiased)
LLAMA4 (3)             x  (top_k must be 1)    sigmoid(x_S)
RENORMALIZE_NAIVE (4)  x                       p_S / sum p_S with p = softmax(x) over all E
TOPK (5)               x                       x_S (raw logits)
SIGMOID_RENORM (6)     x                       s_S / max(sum s_S, 1e-20), s = sigmoid(x)
MINIMAX2 (7)           b = sigmoid(x) + bias   s_S / (sum s_S + 1e-20) * routed_scaling_factor
SIGMOID (8)            x                       sigmoid(x_S)
TOPK_SIGMOID (9)       x                       sigmoid(x_S)
=====================  ======================  =====================================================

Softmax and sigmoid are monotonic, so the methods that FlashInfer describes as
"top-k of softmax(x)" or "top-k of sigmoid(x)" select on the raw logits here: the same
set, except that values which round to the same probability in fp32 (sigmoid(x) = 1.0
for x > ~17) are still ordered by their logits instead of by index.

DeepSeek-V3 grouping (``n_group > 1``): the E experts form ``n_group`` contiguous
groups; a group's score is the sum of its two largest ``b`` (fp32, largest + second;
the single value when a group has one expert; NaN counts as ``-inf``); the
``topk_group`` best groups are kept (ties to the smaller group index) and every
expert of another group gets the score ``-inf``; then the top-k of ``b`` is selected.
With ``n_group`` 1 (or None) it is plain top-k of ``b``.

Adding a method (docs/ADDING_A_ROUTING_METHOD.md): a number in :class:`RoutingMethod` and one row
in :data:`METHODS`, both here (with a line in the table above); a :class:`Formula` here and one
branch in ``_kernel.py`` only if its weights formula is new (the backward then takes a vjp of the
torch formula unless the formula gives a closed form); one row in the tests' method table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple, Optional

import torch

__all__ = [
    "EPS",
    "KERNEL_FLAGS",
    "METHODS",
    "Formula",
    "MethodSpec",
    "Params",
    "RoutingMethod",
    "nonnegative_weights",
    "weight_bounds",
    "select_torch",
    "selection_scores",
    "weights_torch",
]

EPS = 1e-20


class RoutingMethod(IntEnum):
    """Routing methods, numbered as FlashInfer's ``RoutingMethodType`` (the math: the module docstring)."""

    DEFAULT = 0
    RENORMALIZE = 1
    DEEPSEEK_V3 = 2
    LLAMA4 = 3
    RENORMALIZE_NAIVE = 4
    TOPK = 5
    SIGMOID_RENORM = 6
    MINIMAX2 = 7
    SIGMOID = 8
    TOPK_SIGMOID = 9


class Params(NamedTuple):
    """Validated, normalised routing arguments; ``check_replay``: the replay ids still need their value
    check, which the backend runs (the routing kernel on the device, the torch path on the host)."""

    method: RoutingMethod
    top_k: int
    n_group: int
    topk_group: int
    scale: float
    check_replay: bool = False


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
# handful of ops instead of a traced vjp (the eager backward's host time matters in training);
# ``_kernel_grad.py`` computes each in one launch (the branch :attr:`Formula.kernel`).
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


@dataclass(frozen=True, eq=False)
class Formula:
    """A weights formula: the torch math, its closed-form gradient and its branch in the kernels.

    Attributes
    ----------
    kernel : int
        The branch that computes it: ``WEIGHTS`` in ``_kernel.py`` (the forward) and, with
        ``grad_kernel``, ``KIND`` in ``_kernel_grad.py`` (the backward's closed form).
    weights : callable
        ``(x32 [T, E] fp32, ids [T, K] int64, Params) -> [T, K]`` weights, differentiable in x32.
    grad : callable or None
        ``(x32, ids, g [T, K], Params) -> [T, E]``: the gradient of ``weights`` w.r.t. x32 at fixed
        ids for the cotangent g, in closed form; None = the backward takes a vjp of ``weights`` (a new
        formula needs no hand-derived gradient).
    grad_kernel : bool
        ``_kernel_grad.py`` computes ``grad`` in one launch (branch ``kernel``); otherwise torch ops.
    full_softmax : bool
        The weights need the softmax over all E experts (computed before the selection), not only
        at the selected ids.
    """

    kernel: int
    weights: Callable[[torch.Tensor, torch.Tensor, Params], torch.Tensor]
    grad: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Params], torch.Tensor]] = None
    grad_kernel: bool = False
    full_softmax: bool = False


# The weights formulas, with the branch numbers of the kernels (``WEIGHTS`` / ``KIND``); every
# closed form here also runs in the backward kernel
W_SOFTMAX_ALL = Formula(0, _softmax_at, _grad_softmax_at, grad_kernel=True, full_softmax=True)
W_SOFTMAX_SELECTED = Formula(1, _softmax_of_selected, _grad_softmax_of_selected, grad_kernel=True)
W_SIGMOID_SCALED = Formula(2, _sigmoid_scaled, _grad_sigmoid_scaled, grad_kernel=True)
W_SIGMOID = Formula(3, _sigmoid, _grad_sigmoid, grad_kernel=True)
W_SOFTMAX_ALL_RENORM = Formula(4, _softmax_at_renorm, _grad_softmax_at_renorm, grad_kernel=True,
                               full_softmax=True)  # fmt: skip
W_LOGITS = Formula(5, _raw_logits, _grad_raw_logits, grad_kernel=True)
W_SIGMOID_RENORM = Formula(6, _sigmoid_renorm, _grad_sigmoid_renorm, grad_kernel=True)


@dataclass(frozen=True)
class MethodSpec:
    """One routing method: a row of :data:`METHODS` (see the table in the module docstring).

    Attributes
    ----------
    biased : bool
        Selection score ``sigmoid(x) + bias``; takes ``bias`` and ``routed_scaling_factor``.
    grouped : bool
        Takes ``n_group`` / ``topk_group`` (group masking before the top-k).
    single_expert : bool
        Needs ``top_k == 1``.
    formula : Formula
        How the weights are computed from the logits at the selected ids.
    """

    biased: bool
    grouped: bool
    single_expert: bool
    formula: Formula

    @property
    def weights(self) -> Callable[[torch.Tensor, torch.Tensor, Params], torch.Tensor]:
        """The formula's torch math (:attr:`Formula.weights`)."""
        return self.formula.weights

    @property
    def grad(self) -> Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Params], torch.Tensor]]:
        """The formula's closed-form gradient, or None (:attr:`Formula.grad`)."""
        return self.formula.grad

    def kernel_flags(self) -> dict[str, object]:
        """The constexprs of ``route_kernel`` that this row sets (the kernel never reads a method's name)."""
        return {
            "BIASED": self.biased,
            "GROUPED": self.grouped,
            "WEIGHTS": self.formula.kernel,
            "FULL_SOFTMAX": self.formula.full_softmax,
        }


# One row per method: (biased, grouped, single_expert, weights formula).
METHODS: dict[RoutingMethod, MethodSpec] = {
    RoutingMethod.DEFAULT: MethodSpec(False, False, False, W_SOFTMAX_ALL),
    RoutingMethod.RENORMALIZE: MethodSpec(False, False, False, W_SOFTMAX_SELECTED),
    RoutingMethod.DEEPSEEK_V3: MethodSpec(True, True, False, W_SIGMOID_SCALED),
    RoutingMethod.LLAMA4: MethodSpec(False, False, True, W_SIGMOID),
    RoutingMethod.RENORMALIZE_NAIVE: MethodSpec(False, False, False, W_SOFTMAX_ALL_RENORM),
    RoutingMethod.TOPK: MethodSpec(False, False, False, W_LOGITS),
    RoutingMethod.SIGMOID_RENORM: MethodSpec(False, False, False, W_SIGMOID_RENORM),
    RoutingMethod.MINIMAX2: MethodSpec(True, False, False, W_SIGMOID_SCALED),
    RoutingMethod.SIGMOID: MethodSpec(False, False, False, W_SIGMOID),
    RoutingMethod.TOPK_SIGMOID: MethodSpec(False, False, False, W_SIGMOID),
}

# ``route_kernel``'s method constexprs per method, built once (looked up on every launch, by the int
# that the custom op ``replaymoe::route`` carries)
KERNEL_FLAGS: dict[int, dict[str, object]] = {m: spec.kernel_flags() for m, spec in METHODS.items()}


def methods_where(attribute: str) -> str:
    """The names of the methods whose row has ``attribute`` set, for error messages (``"A and B"``)."""
    names = [m.name for m, spec in METHODS.items() if getattr(spec, attribute)]
    return " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]


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


def weight_bounds(
    method: RoutingMethod | int, scale: float, top_k: int
) -> Optional[tuple[float, float, float]]:
    """What ``method``'s weights of one row can be: ``(each weight's maximum, the row sum's minimum,
    its maximum)`` (every weight is >= 0 where this is not None), or None where the weights are not
    bounded (TOPK: raw logits; a negative ``scale``). ``scale`` applies to DEEPSEEK_V3 and MINIMAX2
    (their rows sum to it), ``top_k`` bounds the sum of the sigmoid methods."""
    method = RoutingMethod(method)
    if method == RoutingMethod.TOPK or scale < 0:
        return None
    if method in (RoutingMethod.DEEPSEEK_V3, RoutingMethod.MINIMAX2):
        return scale, scale, scale
    if method in (RoutingMethod.RENORMALIZE, RoutingMethod.RENORMALIZE_NAIVE, RoutingMethod.SIGMOID_RENORM):
        return 1.0, 1.0, 1.0
    if method == RoutingMethod.DEFAULT:  # softmax over all experts, at the selected ones
        return 1.0, 0.0, 1.0
    return 1.0, 0.0, float(top_k)  # sigmoid of each selected logit


def nonnegative_weights(method: RoutingMethod | int, scale: float) -> bool:
    """Whether every weight of ``method`` (a :class:`RoutingMethod` or its int) scaled by ``scale``
    is >= 0: all methods but TOPK (whose weights are the raw logits), with ``scale >= 0``."""
    return method != RoutingMethod.TOPK and scale >= 0

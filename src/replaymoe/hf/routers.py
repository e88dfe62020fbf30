"""How each supported transformers router class maps onto :func:`replaymoe.routing.route`.

A :class:`RouterSpec` is per router *class* (one per architecture family); :meth:`RouterSpec.plan`
binds it to one router *module* once, at :func:`replaymoe.hf.enable` time, so that a forward pays
no per-call lookups: a :class:`RouterPlan` holds the routing (one
:class:`~replaymoe.routing.RoutingConfig`, passed to ``route`` as ``routing=``) and the
post-processing of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replaymoe.routing import RoutingConfig, RoutingMethod

__all__ = ["SUPPORTED_ROUTERS", "RouterPlan", "RouterSpec"]


@dataclass(frozen=True)
class RouterPlan:
    """One router module's routing, resolved once.

    Attributes
    ----------
    family : str
        ``"softmax"`` (Qwen3/Qwen2/OLMoE), ``"mixtral"``, ``"deepseek"`` (DeepSeek-V3, GLM4-MoE) or
        ``"gptoss"``.
    routing : RoutingConfig
        What ``route`` computes for this router (method, top-k, DeepSeek's bias, grouping and
        scale), validated once; passed as ``route(..., routing=...)``.
    sigmoid_scale : float or None
        DeepSeek/GLM4 with ``norm_topk_prob=False``: weights are ``sigmoid(logits)[ids] * scale``
        instead of route's renormalised ones. None otherwise.
    """

    family: str
    routing: RoutingConfig
    sigmoid_scale: float | None

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def logits(self, router: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` router logits exactly as the model's own router computes them."""
        h = hidden_states.reshape(-1, router.hidden_dim)
        if self.family == "deepseek":
            return F.linear(h.type(torch.float32), router.weight.type(torch.float32))
        if self.family == "gptoss":
            return F.linear(h, router.weight, router.bias)
        return F.linear(h, router.weight)

    def weights(
        self, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, fused: bool
    ) -> torch.Tensor:
        """The weights the model's own router would return for ``ids``.

        In the router's dtype, except for ``fused`` experts: those take fp32 weights, so the
        rounding to a bf16 router's dtype (and the cast back) is skipped.
        """
        if self.sigmoid_scale is not None:
            return torch.sigmoid(logits.float()).gather(1, ids.long()) * self.sigmoid_scale
        if fused or self.family in ("deepseek", "mixtral"):
            return weights
        return weights.to(logits.dtype)


@dataclass(frozen=True)
class RouterSpec:
    """How one transformers router class maps onto ``route`` (see :meth:`plan`)."""

    family: str  # "softmax" | "mixtral" | "deepseek" | "gptoss"

    def plan(self, router: nn.Module) -> RouterPlan:
        """Bind this spec to ``router`` (reads its config attributes once)."""
        kwargs: dict[str, Any] = {}
        sigmoid_scale = None
        if self.family == "softmax":
            method = RoutingMethod.RENORMALIZE if router.norm_topk_prob else RoutingMethod.DEFAULT
        elif self.family == "deepseek":
            method = RoutingMethod.DEEPSEEK_V3
            n_group = int(router.num_group or 1)
            kwargs = {
                "bias": router.e_score_correction_bias,
                "n_group": n_group,
                "topk_group": int(router.topk_group or 1) if n_group > 1 else None,
                "routed_scaling_factor": float(router.routed_scaling_factor),
            }
            if not router.norm_topk_prob:
                sigmoid_scale = float(router.routed_scaling_factor)
        else:
            method = RoutingMethod.RENORMALIZE
        return RouterPlan(self.family, RoutingConfig(int(router.top_k), method, **kwargs), sigmoid_scale)


SUPPORTED_ROUTERS: dict[str, RouterSpec] = {
    "Qwen3MoeTopKRouter": RouterSpec("softmax"),
    "Qwen2MoeTopKRouter": RouterSpec("softmax"),
    "OlmoeTopKRouter": RouterSpec("softmax"),
    "MixtralTopKRouter": RouterSpec("mixtral"),
    "DeepseekV3TopkRouter": RouterSpec("deepseek"),
    "Glm4MoeTopkRouter": RouterSpec("deepseek"),
    "GptOssTopKRouter": RouterSpec("gptoss"),
}

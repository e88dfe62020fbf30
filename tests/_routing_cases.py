"""The routing keywords of a plausible model for each method, for the routing tests (CPU, interpreter, GPU).

What a method takes comes from its row in :data:`replaymoe.routing.methods.METHODS` (a bias and a scale
when it is biased, groups when it groups, ``top_k = 1`` when it routes to one expert), so a new method
needs no change here: only its textbook formula in ``test_routing.py``.
"""

from __future__ import annotations

import torch

from replaymoe.routing.methods import METHODS, RoutingMethod


def routing_kwargs(
    method: RoutingMethod,
    num_experts: int,
    generator: torch.Generator | None,
    *,
    top_k: int = 4,
    bias_dtype: torch.dtype = torch.float32,
    bias_scale: float = 0.5,
    device: str = "cpu",
    groups: tuple[int, int] = (8, 3),
) -> dict:
    """``route``'s keywords for ``method`` over ``num_experts``: ``top_k`` (1 for single-expert methods;
    at most what group masking leaves), a bias uniform in ``±bias_scale / 2`` and a routed scaling
    factor of 2.5 for biased methods, ``(n_group, topk_group) = groups`` for grouped ones."""
    spec = METHODS[method]
    kw: dict = {"top_k": 1 if spec.single_expert else top_k}
    if spec.biased:
        bias = (torch.rand(num_experts, generator=generator) - 0.5) * bias_scale
        kw["bias"] = bias.to(bias_dtype).to(device)
        kw["routed_scaling_factor"] = 2.5
    if spec.grouped:
        kw["n_group"], kw["topk_group"] = groups
        kw["top_k"] = min(kw["top_k"], groups[1] * (num_experts // groups[0]))
    return kw

"""Finding the MoE blocks of a transformers model."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from replaymoe._validation import fail

from .routers import SUPPORTED_ROUTERS, RouterPlan

__all__ = ["MoELayerInfo", "find_moe_layers"]


@dataclass
class MoELayerInfo:
    """One MoE block of a model.

    Attributes
    ----------
    index : int
        MoE-layer index (0-based over the model's MoE blocks, in forward order).
    layer_number : int
        The decoder layer number in the model (``model.layers.{n}``): trace ``layer_ids`` use it.
    name : str
        Module path of the block.
    router, experts : nn.Module
        The block's router (gate) and experts modules.
    plan : RouterPlan
        How the router maps onto :func:`replaymoe.routing.route`.
    block : nn.Module
        The MoE block itself (the module holding ``router`` and ``experts``).
    """

    index: int
    layer_number: int
    name: str
    router: nn.Module
    experts: nn.Module
    plan: RouterPlan = field(repr=False)
    block: nn.Module = field(default=None, repr=False)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_moe_layers(model: nn.Module) -> list[MoELayerInfo]:
    """The supported MoE blocks of ``model`` (sorted by layer number).

    Raises
    ------
    ValueError
        When the model has no supported MoE router (the message lists the supported classes).
    """
    found = []
    for name, module in model.named_modules():
        for attr in ("gate", "router"):
            router = getattr(module, attr, None)
            experts = getattr(module, "experts", None)
            if router is None or experts is None or type(router).__name__ not in SUPPORTED_ROUTERS:
                continue
            m = _LAYER_RE.search(name + ".")
            number = int(m.group(1)) if m else len(found)
            found.append((number, name, module, router, experts, SUPPORTED_ROUTERS[type(router).__name__]))
    if not found:
        routers = sorted({type(m).__name__ for m in model.modules() if "Router" in type(m).__name__})
        fail(
            "model",
            "a transformers MoE model with one of the routers " + ", ".join(SUPPORTED_ROUTERS),
            f"{type(model).__name__} (router classes found: {routers or 'none'})",
            what="architecture",
        )
    found.sort(key=lambda x: x[0])
    return [
        MoELayerInfo(i, n, name, r, e, s.plan(r), block) for i, (n, name, block, r, e, s) in enumerate(found)
    ]

"""The routing-method numbers, shared by the routing op and its Triton kernel.

:class:`RoutingMethod` lives below both (the kernel module holds only Triton code and may not
import the op), so the kernel's method constants come from this enum rather than literals. It is
public as :class:`replaymoe.routing.RoutingMethod`.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["RoutingMethod"]


class RoutingMethod(IntEnum):
    """Routing methods, numbered as FlashInfer's ``RoutingMethodType`` (see the module docstring)."""

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

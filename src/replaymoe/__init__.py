"""replaymoe: fused Mixture-of-Experts kernels for PyTorch with routing capture and replay.

The public names are resolved lazily (``replaymoe.route`` imports ``replaymoe.routing``
on first use), so ``import replaymoe`` stays cheap and optional parts (transformers,
matplotlib) are only imported when used.
"""

from __future__ import annotations

from ._lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # routing
    "RoutingMethod": "routing",
    "RoutingOutput": "routing",
    "RoutingConfig": "routing",
    "route": "routing",
    "route_torch": "routing",
    # token layout
    "ExpertLayout": "moe.layout",
    "expert_layout": "moe.layout",
    "layout_torch": "moe.layout",
    # fused MoE
    "fused_moe": "moe",
    "fused_moe_torch": "moe",
    "MoELayer": "moe",
    "ClampedSwiGLU": "moe",
    # fp8 helpers
    "quantize_fp8_block": "moe.quant",
    "dequantize_fp8_block": "moe.quant",
    # record and replay: capture, trace, replay, stats
    "RoutedExpertsCapturer": "record.capture",
    "RoutingTrace": "record.trace",
    "RoutingFingerprint": "record.trace",
    "TraceFormatError": "record.trace",
    "ReplaySource": "record.replay",
    "expert_load": "record.stats",
    "balance": "record.stats",
    "agreement": "record.stats",
    "AgreementReport": "record.stats",
    "plot_heatmap": "record.stats",
    # expert parallelism
    "MoeAlltoAll": "ep",
    "ep_moe": "ep",
}

__all__ = ["__version__", *_EXPORTS]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(__all__)

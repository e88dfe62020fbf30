"""Record and replay MoE routing: capture the experts a rollout chose, keep them, replay them.

The layer above the ops (``routing``, ``moe``, ``ep``) and below the transformers integration
(``hf``), the trainer integrations and the applications; it imports none of those.

* :mod:`~replaymoe.record.capture`: :class:`RoutedExpertsCapturer`, routing capture for a serving
  loop (one device buffer per step, per-request host storage); :mod:`~replaymoe.record.transfer`:
  its device-to-host copies (CUDA streams and pinned memory, or a plain copy on the CPU).
* :mod:`~replaymoe.record.trace`: :class:`RoutingTrace` (``core``, its constructor's checks in
  ``checks``), its file format (``file``) and the vLLM/SGLang wire formats (``wire``).
* :mod:`~replaymoe.record.replay`: :class:`ReplayTable` (``table``: the one device replay table, by
  batch row or by content, and its prefix hashes in ``hashes``, its host arrays in ``packing``) and
  :class:`ReplaySource` (``source``: per-layer ``replay_ids`` for a batch of traces).
* :mod:`~replaymoe.record.stats`: expert load, balance, agreement and heatmaps of traces.
* :mod:`~replaymoe.record.engine_routes`: :class:`EngineRoutes`, an engine's routes as sent, and
  their readers (vLLM, SGLang, trace files); :mod:`~replaymoe.record.route_check`:
  :class:`RouteCheckReport`, the report of :func:`replaymoe.hf.conformance.check_routes`.

The names below are resolved lazily (``replaymoe.record.ReplaySource`` imports
``replaymoe.record.replay`` on first use), so importing one module of the package (the trace, say:
numpy only) does not import torch or Triton for the others.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "RoutedExpertsCapturer": "capture",
    "CaptureMemoryError": "capture",
    "RoutingTrace": "trace",
    "RoutingFingerprint": "trace",
    "TraceFormatError": "trace",
    "ReplaySource": "replay",
    "ReplayReport": "replay",
    "ReplayTable": "replay",
    "expert_load": "stats",
    "balance": "stats",
    "agreement": "stats",
    "AgreementReport": "stats",
    "plot_heatmap": "stats",
    "EngineRoutes": "engine_routes",
    "load_routes": "engine_routes",
    "routes_from_sglang": "engine_routes",
    "routes_from_trace": "engine_routes",
    "routes_from_vllm": "engine_routes",
    "RouteCheckReport": "route_check",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

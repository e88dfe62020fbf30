"""Recorded MoE routing: :class:`RoutingTrace`, its file format, and vLLM/SGLang wire formats.

This package's one job is the public face of recorded routing (``from replaymoe.record.trace import
RoutingTrace``). The work is split in four modules that import one way only (``core`` -> ``wire`` ->
``file``, ``core`` and ``wire`` -> ``checks``): :mod:`~replaymoe.record.trace.core` is the data model
(``RoutingTrace``, concat/merge), :mod:`~replaymoe.record.trace.checks` the checks of its constructor's
arguments, :mod:`~replaymoe.record.trace.file` the on-disk format (``FORMAT_NAME``, ``FORMAT_VERSION``,
atomic save, checked load, ``TraceFormatError``, ``read_input`` of the command line's input files)
and :mod:`~replaymoe.record.trace.wire` the vLLM/SGLang payloads.
"""

from __future__ import annotations

from .core import RoutingFingerprint, RoutingTrace
from .file import FORMAT_NAME, FORMAT_VERSION, TraceFormatError

__all__ = ["RoutingFingerprint", "RoutingTrace", "TraceFormatError", "FORMAT_NAME", "FORMAT_VERSION"]

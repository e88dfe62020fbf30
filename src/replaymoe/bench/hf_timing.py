"""Timing pieces of ``replaymoe bench hf``: one timed ``generate`` call with its decode steps, a count
of the CUDA graphs captured, a percentile, and the shared-weight model copies each implementation runs
on. GPU only where a function says so."""

from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

__all__ = ["GraphCaptureCount", "StepClock", "quantile", "shared_copy", "timed_generate"]


class GraphCaptureCount:
    """Counts every CUDA graph captured in the process while installed (``torch.cuda.CUDAGraph``'s
    ``capture_begin`` wrapped): replaymoe's block graphs and inductor's cudagraph trees alike. In a
    steady state a timed ``generate`` captures none; a cudagraph tree that re-records the compiled
    decode step (its static inputs moved) shows up here."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = None

    def __enter__(self) -> GraphCaptureCount:
        orig = self._orig = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(graph, *args, **kwargs):
            self.count += 1
            return orig(graph, *args, **kwargs)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.CUDAGraph.capture_begin = self._orig


class StepClock:
    """A logits processor that changes nothing and stamps the host clock each time ``generate``
    calls it: once per generated token, after the step's forward. ``generate`` reads each step's
    token on the host before the next step starts, so the gaps between stamps are the wall times of
    the decode steps (the next forward plus ``generate``'s own work around it)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def steps(self) -> list[float]:
        """Seconds of each decode step (``new - 1`` of them)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def timed_generate(model, ids, mask, new, mode, **kw):
    """(seconds, output, decode-step seconds) of one greedy ``generate`` call (CUDA: it synchronizes
    the device before and after).

    ``ids`` / ``mask`` are ``[B, P]``; exactly ``new`` tokens are generated; ``mode`` is ``"eager"``
    (transformers' dynamic cache) or ``"static"`` (``cache_implementation="static"``); ``kw`` goes to
    ``generate``. Python's garbage collector is run before and held off during the call, so that a
    collection does not land inside a timed run. The step times come from a :class:`StepClock`."""
    from transformers import LogitsProcessorList

    extra = {"cache_implementation": "static"} if mode == "static" else {}
    clock = StepClock()
    gc.collect()
    gc.disable()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
                **extra,
                **kw,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out, clock.steps()
    finally:
        gc.enable()


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (``q`` in whole percents, 0.01 to 0.99; linear interpolation,
    ``statistics.quantiles``' inclusive method)."""
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[round(q * 100) - 1]


def shared_copy(model):
    """A copy of ``model`` whose modules are its own but whose parameters and buffers are the
    original's (so each implementation gets its own patched routers, experts implementation,
    caches and compiled graphs, at no extra weight memory)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)

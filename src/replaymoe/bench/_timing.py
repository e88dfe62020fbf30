"""Timing helpers shared by the benchmarks (GPU only).

Serving runs under CUDA graphs, so the headline figure is the median of CUDA-graph
replays with the L2 flushed before each replay (:func:`time_graph`); eager medians are reported
too (:func:`time_eager`). Both time the device with ``triton.testing.do_bench``; :func:`host_us`
times the host side of a call, which ``do_bench`` cannot.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

NO_CUDA_EXIT = 2  # the documented exit code of a benchmark started without a GPU (replaymoe.apps.cli)

HBM_BYTES_PER_S = 4.27e12  # measured device-to-device copy on the H200 (read + write)
BF16_FLOPS_PER_S = 700e12  # measured dense bf16 matmul on the H200


def no_cuda(prog: str) -> bool:
    """True, after one error line on stderr, when there is no CUDA GPU (the same wording for every
    benchmark; the caller then exits with :data:`NO_CUDA_EXIT`)."""
    if torch.cuda.is_available():
        return False
    print(
        f"{prog}: error: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)",
        file=sys.stderr,
    )
    return True


def time_eager(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median device time of one eager ``fn()`` call, in microseconds.

    A thin use of :func:`triton.testing.do_bench` (``return_mode="median"``, its milliseconds turned
    into µs). ``do_bench`` flushes the L2 before every timed call itself: it zeroes a 256 MiB buffer
    (``triton.runtime.driver.active.get_empty_cache_for_benchmark()``, ``clear_cache()`` =
    ``buffer.zero_()`` on NVIDIA; the H200's L2 is 60 MiB) between the end event of one call and the
    start event of the next, so the flush is not timed and every call starts with a cold L2. It
    sizes its loops by time, after timing 5 calls: about ``warmup_ms`` of warm-up calls, then about
    ``rep_ms`` of timed calls (at least one of each).

    Parameters
    ----------
    fn : callable
        The call to time (its result is dropped).
    warmup_ms, rep_ms : float
        Warm-up and measurement budgets in milliseconds (``do_bench``'s ``warmup`` and ``rep``).

    Returns
    -------
    float
        The median over the timed calls of the CUDA-event time from just before ``fn()`` is
        launched to just after, in µs. ``do_bench`` does not wait for the GPU between calls, so the
        host launches the next call while the GPU still flushes: the figure holds the host's launch
        time only where launching takes longer than the flush and the previous call's device work.
    """
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def time_graph(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of one CUDA-graph replay of ``fn()`` in microseconds, the L2 flushed before each.

    ``fn`` runs 3 times on a side stream (compilation, allocator warm-up), is captured into a CUDA
    graph, and the replay is timed by :func:`time_eager` (``do_bench``: L2 flushed before every
    replay, ``warmup_ms`` / ``rep_ms`` as there). ``triton.testing.do_bench_cudagraph`` is not used:
    it captures many calls into one graph and flushes nothing between them, so every call but the
    first would find its weights in the L2, which serving (one replay per step, other layers' weights
    in between) does not.

    Parameters
    ----------
    fn : callable
        The call to capture; it must be CUDA-graph capturable (no host synchronisation).
    warmup_ms, rep_ms : float
        As in :func:`time_eager`.

    Returns
    -------
    float
        The median replay time in µs.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return time_eager(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms)
    finally:
        del graph


def host_us(
    fn: Callable[[], object], *, calls: int = 100, warmup: int = 1, before: Callable[[], object] | None = None
) -> float:
    """Median host time of one ``fn()`` call in microseconds (``time.perf_counter`` around each call).

    This is not :func:`time_eager` on purpose: ``do_bench`` and CUDA events time the GPU, while this
    times the CPU thread that makes the call (Python, argument checks, kernel launches), which is
    what bounds an eager decode step and what a host profile asks for. Nothing here waits for the
    GPU unless ``before`` does.

    Parameters
    ----------
    fn : callable
        The call to time (its result is dropped).
    calls : int
        Timed calls.
    warmup : int
        Untimed calls first.
    before : callable, optional
        Run before every call (warm-up and timed) outside the timed span, e.g. a
        ``torch.cuda.synchronize`` so that each call starts with the GPU idle.

    Returns
    -------
    float
        The median over the timed calls, in µs.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def interleaved_us(
    fns: dict[str, Callable[[], object]], *, clock: str, calls: int = 1000, warmup: int = 20
) -> dict[str, list[float]]:
    """Per-call times in µs of several calls timed in turn, one call of each per turn.

    :func:`time_eager` and :func:`host_us` time one function for a while, then the next: a drift of
    the host (another process, frequency steps) between the two stretches reads as a difference of
    a few percent. Here every turn calls each function once, in an order rotated every turn, so the
    drift touches all of them alike and a cost of a fraction of a percent can be read from the
    medians.

    Parameters
    ----------
    fns : dict[str, callable]
        The calls to compare, by name.
    clock : {"host", "device"}
        ``"host"``: ``time.perf_counter`` around each call (the CPU thread's Python, checks and
        launches; nothing waits for the GPU: the device is synchronized, untimed, before each call,
        so that a call the GPU is slower at than the host never finds the launch queue full).
        ``"device"``: CUDA events around each call, the L2
        flushed before each as ``do_bench`` does (the flush is not timed); the host launches ahead
        while the flush runs, so a call bound by its launches reads its host time, as in
        :func:`time_eager`.
    calls : int
        Timed turns (each function is called ``calls`` times).
    warmup : int
        Untimed turns first.

    Returns
    -------
    dict[str, list[float]]
        Each name's ``calls`` times, in µs.
    """
    if clock not in ("host", "device"):
        raise ValueError(f"clock must be 'host' or 'device', got {clock!r}")
    names = list(fns)
    flush = triton.runtime.driver.active.get_empty_cache_for_benchmark() if clock == "device" else None
    cuda = torch.cuda.is_available()
    events: dict[str, list] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for turn in range(warmup + calls):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            if flush is not None:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                if turn >= warmup:
                    events[name].append((start, end))
            else:
                if cuda:  # (untimed) an empty queue: a call never waits for a launch slot
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fns[name]()
                t = time.perf_counter() - t0
                if turn >= warmup:
                    times[name].append(t * 1e6)
    if flush is not None:
        torch.cuda.synchronize()
        times = {n: [s.elapsed_time(e) * 1e3 for s, e in events[n]] for n in names}
    return times


def profile_calls(fn: Callable[[], object], calls: int):
    """``fn`` once unprofiled (compilation, first-call allocations), then ``calls`` times under
    :func:`torch.profiler.profile` with CUDA activity, synchronized at the end; returns the profiler
    (its ``events()`` and ``key_averages()`` hold the device's kernels, memsets and memcpys)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def environment() -> dict[str, str]:
    """GPU, versions and commit recorded with every benchmark row."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:  # best effort
        commit = ""
    from replaymoe import __version__

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "replaymoe": __version__,
        "commit": commit,
        "host": platform.node(),
    }


def write_results(rows: list[dict], out: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``rows`` to ``out/name.csv`` and ``out/name.json`` (with the environment)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{name}.csv", out_dir / f"{name}.json"
    env = environment()
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + list(env))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env})
    json_path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return csv_path, json_path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as a fixed-width table with the given columns."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))

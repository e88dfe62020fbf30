"""Distributed timing primitives of ``replaymoe bench ep``: CUDA events (or a host stand-in for the
gloo CPU dry run), :func:`time_phases` (per phase, the median over iterations of the maximum over
ranks, for the device and optionally the host time), :func:`time_replays` (the same for CUDA-graph
replays), CUDA-graph capture, and the short error text a
failed point leaves in its result row. Whether the ranks line up on the device before each timed
iteration (:func:`align_ranks`; ``bench ep --no-align`` turns it off) is the ``align`` argument of the
timing functions.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event`` (the gloo dry run of this script)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def on_cuda() -> bool:
    return torch.cuda.is_available()


def event():
    return torch.cuda.Event(enable_timing=True) if on_cuda() else HostEvent()


def sync():
    if on_cuda():
        torch.cuda.synchronize()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda() else torch.device("cpu")


# device cycles that a timed CUDA-graph replay waits between the two aligning all-reduces (about 200 µs
# at 2 GHz): longer than any rank's host takes to enqueue the second all-reduce, the event and the replay
# (a shorter wait and one all-reduce left the last rank's replays late, and the second all-reduce evens
# out the cards' clocks, at which each rank's wait runs: docs/TUNING.md, "Benchmarks and timing")
SETTLE_CYCLES = 400_000
_ONE: dict = {}  # device index -> the one-element tensor align_ranks all-reduces (made on first use)


def align_ranks(*, settle: bool) -> None:
    """Line the ranks up on the device before a timed iteration (after the host barrier): a one-element
    all-reduce on the current stream, which ends on every rank within a few µs of the last rank's
    arrival. With ``settle`` (graph replays) a device-side wait of :data:`SETTLE_CYCLES` follows, long
    enough for every host to enqueue what comes next, then a second all-reduce, so that the replays
    start together whatever each card's clock made of the wait. Without ``settle`` (eager calls) a rank
    whose host is slower to issue the call still shows that in its time, as it should. A host barrier
    alone leaves the ranks as far apart as their hosts leave it (tens of µs), and a rank's first
    exchange then also times its wait for the slowest peer. No-op off CUDA (the gloo dry run); not
    called at all with ``align`` off (:func:`phase_samples`)."""
    if not on_cuda():
        return
    one = _ONE.get(torch.cuda.current_device())
    if one is None:
        one = _ONE[torch.cuda.current_device()] = torch.zeros(1, device=device())
    dist.all_reduce(one)
    if settle:
        torch.cuda._sleep(SETTLE_CYCLES)
        dist.all_reduce(one)


def time_phases(run_iter, n_phases: int, iters: int, warmup: int, *, align: bool, settle: bool = False):
    """``run_iter(events)`` records ``n_phases + 1`` events and may return the host seconds of each
    phase; returns (per phase the median over iterations of the max over ranks of the device time,
    the same for the host time or None), in microseconds.

    Not ``triton.testing.do_bench`` (which the one-GPU benchmarks use, ``bench._timing``): every
    rank must run the same number of iterations, start each one after a barrier and time several
    phases of it, and the figure is the max over ranks per iteration; ``do_bench`` picks its
    iteration count from a local estimate (ranks would disagree and hang in a collective), times
    one span, and flushes the L2 between calls (a peer's flush would overlap this rank's call).
    ``align``: line the ranks up on the device before each iteration, :func:`align_ranks` (bench ep's
    default; ``--no-align`` passes False: the host barrier alone). ``settle``: see :func:`align_ranks`
    (graph replays)."""
    times, host = phase_samples(run_iter, n_phases, iters, warmup, align=align, settle=settle)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    med = [statistics.median(times[:, p].tolist()) for p in range(2 * n_phases)]
    return med[:n_phases], (med[n_phases:] if host else None)


def phase_samples(
    run_iter, n_phases: int, iters: int, warmup: int, *, align: bool, settle: bool = False
) -> tuple[torch.Tensor, bool]:
    """This rank's samples for :func:`time_phases`: ``[iters, 2 * n_phases]`` float64 on :func:`device`
    (device µs per phase, then host µs per phase), and whether ``run_iter`` returned host times. Every
    iteration starts after a sync, a barrier and (with ``align``) :func:`align_ranks`, so that the ranks'
    iterations line up on the devices."""
    for _ in range(warmup):
        ev = [event() for _ in range(n_phases + 1)]
        run_iter(ev)
    sync()
    times = torch.zeros(iters, 2 * n_phases, dtype=torch.float64, device=device())
    host = False
    for i in range(iters):
        ev = [event() for _ in range(n_phases + 1)]
        sync()
        dist.barrier()
        if align:
            align_ranks(settle=settle)
        h = run_iter(ev)
        ev[-1].synchronize()
        for p in range(n_phases):
            times[i, p] = ev[p].elapsed_time(ev[p + 1]) * 1e3
        if h is not None:
            host = True
            for p in range(n_phases):
                times[i, n_phases + p] = h[p] * 1e6
    return times, host


def time_replays(graphs, iters: int, warmup: int, *, align: bool) -> tuple[float, ...]:
    """Per CUDA graph, the median over iterations of the max over ranks of its replay time (µs): the
    graphs replay back to back, an event before the first and after each (:func:`time_phases`; the
    replays start together on every rank with ``align``, :func:`align_ranks` with ``settle``)."""

    def run_iter(ev):
        ev[0].record()
        for i, g in enumerate(graphs):
            g.replay()
            ev[i + 1].record()

    return tuple(time_phases(run_iter, len(graphs), iters, warmup, align=align, settle=True)[0])


def graph(fn, pool=None):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]

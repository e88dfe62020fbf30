"""What the forward and backward sweeps of ``replaymoe bench tune`` share: the confirmation of a winner."""

from __future__ import annotations

from ._timing import time_graph

CONFIRM_ROUNDS = 6


def _time_config(config, fn) -> float:
    return time_graph(fn, warmup_ms=5, rep_ms=20)


def confirm(run, current, best, rounds: int = CONFIRM_ROUNDS, *, timer=_time_config) -> float:
    """The sweep's winner against the current choice again, in ``rounds`` rounds of alternating order
    (a card's clock drifts with power and heat over a sweep, by 10 % at large T): the median of the
    paired ratios, minus one (the gain). ``timer(config, fn)``: µs of one ``fn()`` running ``config``."""
    import statistics

    ratios = []
    for r in range(rounds):
        pair = (current, best) if r % 2 == 0 else (best, current)
        t = {c: timer(c, lambda c=c: run(c)) for c in pair}
        ratios.append(t[current] / t[best])
    return statistics.median(ratios) - 1

"""What the forward and backward sweeps of ``replaymoe bench tune`` share: timing one token count's
candidates (:func:`sweep`) and confirming a winner (:func:`confirm`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ._timing import time_graph

CONFIRM_ROUNDS = 6


def _time_config(config, fn) -> float:
    return time_graph(fn, warmup_ms=5, rep_ms=20)


def random_routing(T: int, E: int, K: int, device, seed: int = 1):
    """``(ids int32 [T, K], weights fp32 [T, K])``: the top-K of random logits and their softmax."""
    g = torch.Generator(device=device).manual_seed(seed + T)
    vals, ids = torch.randn(T, E, generator=g, device=device).topk(K, dim=1)
    return ids.to(torch.int32), torch.softmax(vals, dim=1)


def confirm(run, current, best, rounds: int = CONFIRM_ROUNDS, *, timer=None) -> float:
    """The sweep's winner against the current choice again, in ``rounds`` rounds of alternating order
    (a card's clock drifts with power and heat over a sweep, by 10 % at large T): the median of the
    paired ratios, minus one (the gain). ``timer(config, fn)``: µs of one ``fn()`` running ``config``."""
    import statistics

    timer = timer or _time_config
    ratios = []
    for r in range(rounds):
        pair = (current, best) if r % 2 == 0 else (best, current)
        t = {c: timer(c, lambda c=c: run(c)) for c in pair}
        ratios.append(t[current] / t[best])
    return statistics.median(ratios) - 1


def sweep(
    T: int,
    cands: list,
    current,
    heuristic,
    run: Callable,
    check: Callable,
    row: Callable,
    *,
    min_gain: float,
    deadline: float,
    log: Callable,
    label: str,
    timer: Callable | None = None,
    neighbours: Callable | None = None,
    refine_rounds: int = 0,
):
    """Time ``cands`` (``run(c)`` runs one) at one token count; returns (rows, winner or None).

    ``check(run(c))`` gives a reason to skip a candidate (wrong bits) or None; ``row(c)`` the row's own
    fields (shape, T, ...), to which each timed candidate adds ``us``, ``current``, ``heuristic``,
    ``config`` and ``vs_current``. The winner is the fastest, where it beats ``current`` by at least
    ``min_gain`` in the sweep and again in :func:`confirm`'s alternating rounds. A candidate that fails
    (shared memory over the card's limit, ...) is logged and skipped; past ``deadline``
    (``time.monotonic()``) the rest are not timed. ``timer(config, fn)``: µs of one ``fn()`` (default: a
    short CUDA-graph timing, :func:`replaymoe.bench._timing.time_graph`).

    ``neighbours(config)``, with ``refine_rounds`` > 0: a local search after the grid. Each round times
    the neighbours of the fastest configuration so far that were not tried yet (warps and stages one
    step away, say: what a fixed grid misses on a new card), and stops early when the fastest stays the
    same or the deadline passes. Its rows carry ``refined`` True.
    """
    timer = timer or _time_config
    rows, timed, tried = [], {}, set()

    def time_all(configs: list, refined: bool) -> None:
        for i, c in enumerate(configs):
            if time.monotonic() > deadline:
                log(f"time budget spent at T={T}: {len(configs) - i} candidates not timed")
                return
            tried.add(c)
            try:
                reason = check(run(c))
                if reason is not None:
                    log(f"T={T} {c}: {reason}: skipped")
                    continue
                timed[c] = timer(c, lambda c=c: run(c))
            except Exception as exc:  # noqa: BLE001 (shared memory over the card's limit, ...)
                log(f"T={T} {c}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({**row(c), "us": timed[c], "current": c == current, "heuristic": c == heuristic,
                         "refined": refined, "config": str(c)})  # fmt: skip

    time_all(list(cands), refined=False)
    for _ in range(refine_rounds if neighbours is not None and timed else 0):
        lead = min(timed, key=timed.get)
        fresh = [n for n in dict.fromkeys(neighbours(lead)) if n not in tried]
        if not fresh or time.monotonic() > deadline:
            break
        time_all(fresh, refined=True)
        if min(timed, key=timed.get) == lead:
            break
    if current not in timed:
        return rows, None
    best = min(timed, key=timed.get)
    gain = timed[current] / timed[best] - 1
    for r in rows:
        r["vs_current"] = timed[current] / r["us"]
    verdict, winner = "the current choice stays", None
    if best != current and gain >= min_gain:  # confirm against the clock's drift (power, heat)
        confirmed = confirm(run, current, best, timer=timer)
        verdict = f"{confirmed:+.1%} in {CONFIRM_ROUNDS} alternating rounds"
        if confirmed >= min_gain:
            winner = best
    log(f"{label} T={T}: current {timed[current]:.1f} us, best {timed[best]:.1f} us "
        f"({gain:+.1%} in the sweep; {verdict}) of {len(timed)} timed")  # fmt: skip
    return rows, winner

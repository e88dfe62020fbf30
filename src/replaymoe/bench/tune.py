"""``replaymoe bench tune``: time the fused MoE's kernel configurations on this card, write its table.

For each token count of one shape, the configurations of a candidate grid (direct decode tiles where
the batch is small; tile heights, GEMM tiles, warps and stages around the heuristics' choice
elsewhere) run the experts of a routed layer, each checked against the heuristics' output (the same
bits, as every configuration gives; ``--fast`` fp8 tiles round by height: 2 % relative) and timed
as the median of CUDA-graph replays with the L2 flushed (``bench._timing.time_graph``). After the grid,
up to ``--refine-rounds`` (default 2) rounds time the fastest's :func:`neighbours` (each GEMM's warps
and stages one step away: what the grid, tuned on other cards, misses on this one). Where the
fastest beats the configuration the card uses today (its current table, else the heuristics) by at
least ``--min-gain``, both in the sweep and in 6 more rounds of the two alone in alternating order (the
card's clock drifts with power and heat), it becomes the entry of that problem (keyed by T rounded up
to a power of two: tune at powers of two). The result is the card's current table with these entries
merged, written to ``--out``/``tuned_<name>.json`` with every timing in ``tune.csv``/``tune.json``.

Use it with ``replaymoe.moe.set_tuned_table(path)``, or copy it over
``src/replaymoe/moe/tables/<name>.json`` to ship it. fp8 entries keep the batch-invariance guarantee
(64-row tiles) unless ``--fast`` (``batch_invariant=False`` entries).

One shape fits the 10-minute device limit: each distinct configuration is one Triton compile (seconds),
so ``--max-minutes`` (default 8) stops the sweep in time, keeping what it measured.

``--backward`` tunes the training backward's kernel tiles instead (bf16; :mod:`replaymoe.bench.tune_bwd`),
written to the table's ``backward`` section.

Usage: ``replaymoe bench tune --shape qwen3 [--tokens 1,8,64,256,1024,4096,16384] [--dtype bf16|fp8]
[--fast] [--backward] [--table PATH] [--name h100] [--min-gain 0.02] [--max-minutes 8] [--refine-rounds 2]
[--out DIR]``. ``--table`` chains runs: each starts from the last one's ``tuned_<name>.json``, so one table
gathers the entries of several shapes (one shape per run fits the device's 10-minute limit).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from replaymoe.bench._text import strip_rest

from ._timing import NO_CUDA_EXIT, no_cuda, print_table, write_results
from ._tuning import random_routing, sweep
from .moe import SHAPES, TOKENS, make_weights, routing_inputs

# direct (decode) mode: (block_n1, block_k1, warps1, stages1, block_n2, block_k2, warps2, stages2)
DIRECT_GRID = [
    (32, 128, 4, 4, 32, 128, 4, 4),
    (32, 128, 4, 5, 64, 128, 4, 4),  # fp8: the swapped decode kernels' H100 winners
    (64, 128, 4, 4, 128, 128, 8, 4),
    (64, 128, 4, 4, 64, 128, 4, 4),
    (32, 256, 4, 3, 64, 128, 4, 3),
    (64, 128, 4, 6, 128, 128, 8, 4),
    (128, 128, 4, 3, 128, 128, 4, 3),
    (128, 128, 8, 4, 128, 128, 8, 4),
]
# tile mode, per tile height: (block_n1, block_k1, warps1, stages1, block_n2, block_k2, warps2, stages2,
# group_m)
# fp8 batch-invariant tile mode with swapped operands (16- and 32-row tiles): GEMM1 on 32 (gate and up
# stacked) or 128 columns, GEMM2 on 64 or 128 (H100 winners; docs/TUNING.md, "fp8 decode with swapped
# operands")
SWAPPED_TILE_GRID = [
    (32, 128, 4, 3, 64, 128, 4, 3),
    (128, 128, 4, 3, 64, 128, 4, 3),
    (32, 128, 4, 3, 128, 128, 8, 3),
]
TILE_GRID = {
    16: [(32, 256, 4, 3, 64, 128, 4, 3, 8), (64, 256, 4, 3, 64, 256, 4, 3, 8),
         (128, 128, 4, 3, 128, 128, 4, 3, 8)],
    32: [(64, 128, 4, 4, 64, 128, 4, 4, 8), (128, 128, 4, 3, 128, 128, 4, 3, 8),
         (64, 256, 4, 3, 64, 256, 4, 3, 8)],
    64: [(128, 64, 4, 4, 128, 64, 4, 4, 8), (128, 128, 8, 3, 128, 128, 8, 3, 8),
         (128, 128, 8, 4, 128, 128, 4, 4, 8), (64, 128, 4, 4, 64, 128, 4, 4, 8)],
    128: [(128, 64, 8, 4, 256, 64, 8, 4, 4), (128, 64, 8, 4, 256, 64, 8, 4, 8),
          (128, 64, 8, 4, 256, 64, 8, 4, 16), (128, 32, 8, 6, 256, 64, 8, 4, 4),
          (128, 64, 8, 3, 128, 64, 4, 4, 8), (64, 64, 4, 4, 128, 64, 4, 4, 8)],
}  # fmt: skip


def candidates(T: int, K: int, H: int, I: int, E: int, *, fp8: bool, fast: bool, tma: bool):  # noqa: E741
    """The configurations tried for one problem: the heuristics' first, then the grid (deduplicated).
    fp8 keeps batch invariance unless ``fast`` (64-row tiles, or 16- / 32-row tiles on the swapped
    kernels' N side below 48 rows per expert) and 128-deep K tiles (the block scales')."""
    from replaymoe.moe.configs import FP8_BLOCK_M, MoEConfig, moe_config

    base = moe_config(T, K, H, I, E, fp8=fp8, batch_invariant=not fast, tma=tma)
    out = [base]
    slots = T * K
    m_avg = slots / min(E, slots)
    heights = [FP8_BLOCK_M] if fp8 and not fast else [16, 32] if m_avg < 48 else [64, 128]
    if slots <= 256:  # decode-sized: the direct mode, one tile per slot
        direct_bm = FP8_BLOCK_M if fp8 and not fast else 16
        out += [MoEConfig(True, direct_bm, *g) for g in DIRECT_GRID if not fp8 or g[1] == g[5] == 128]
    for bm in heights:
        for g in TILE_GRID[bm]:
            if fp8 and (g[1] != 128 or g[5] != 128):
                g = (g[0], 128, g[2], min(g[3], 4), g[4], 128, g[6], min(g[7], 4), g[8])
            out.append(MoEConfig(False, bm, *g[:8], group_m=g[8], tma=tma and not fp8 and bm >= 64))
    if fp8 and not fast and m_avg < 48:  # a small batch's rows on the swapped kernels' N side
        out += [MoEConfig(False, bm, *g, swap_ab=True) for bm in (16, 32) for g in SWAPPED_TILE_GRID]
    return list(dict.fromkeys(out))  # without repeats, in order (configurations compare by value)


# the local search after the grid: each GEMM's warps and pipeline stages one step from the fastest
REFINE_WARPS = (4, 8)
REFINE_STAGES = (2, 6)  # inclusive


def neighbours(c):
    """The configurations one step from ``c`` in one GEMM's pipeline stages (±1 within
    :data:`REFINE_STAGES`) or warps (the other of :data:`REFINE_WARPS`), and in the direct mode with the
    top-k sum moved between GEMM2 and the reduce kernel (``fused_reduce``): the same tiles and the same
    arithmetic, so the same batch-invariance class (``sweep`` checks the bits of each anyway).
    ``c``: a ``MoEConfig``."""
    lo, hi = REFINE_STAGES
    fused = c.fused_reduce is None or c.fused_reduce  # (None: on in the direct mode)
    out = [dataclasses.replace(c, fused_reduce=not fused)] if c.direct else []
    for gemm in ("1", "2"):
        stages = getattr(c, "stages" + gemm)
        out += [
            dataclasses.replace(c, **{"stages" + gemm: s}) for s in (stages - 1, stages + 1) if lo <= s <= hi
        ]
        warps = getattr(c, "warps" + gemm)
        if warps in REFINE_WARPS:
            out += [dataclasses.replace(c, **{"warps" + gemm: w}) for w in REFINE_WARPS if w != warps]
    return out


def tune(
    shape: str,
    tokens: list[int],
    *,
    fp8: bool,
    fast: bool,
    min_gain: float,
    deadline: float,
    log=print,
    device: str | torch.device = "cuda",
    dims: tuple[int, int, int, int] | None = None,
    refine_rounds: int = 2,
    table=None,
):
    """Sweep ``candidates`` for every T of ``shape``, then up to ``refine_rounds`` rounds of
    :func:`neighbours` around the fastest; returns (rows, winners {table key: MoEConfig}).
    ``dims`` = (H, I, E, K): another layer than the bench's ``shape`` (random top-K routing).
    ``table``: the :class:`~replaymoe.moe.tuned.TunedTable` whose choice is "current" (default: the
    device's, ``table_for``)."""
    from replaymoe.moe._forward import experts_triton
    from replaymoe.moe.configs import moe_config, tma_ok
    from replaymoe.moe.tuned import table_for, table_key

    H, I, E, K = SHAPES[shape][:4] if dims is None else dims  # noqa: E741
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    current_table = table if table is not None else table_for(dev)
    tma = tma_ok(dev, torch.bfloat16)
    w13, w2, s13, s2 = make_weights(H, I, E, fp8=fp8, device=dev)
    rows, winners = [], {}
    for T in tokens:
        if time.monotonic() > deadline:
            log(f"time budget spent: T={T} and later not tuned")
            break
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        if dims is None:
            *_, ids, wts = routing_inputs(shape, T, device=dev)
        else:
            ids, wts = random_routing(T, E, K, dev)

        def run(c, x=x, ids=ids, wts=wts):
            return experts_triton(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=0,
                                  out=None, config=c, batch_invariant=not fast)  # fmt: skip

        current = moe_config(T, K, H, I, E, fp8=fp8, batch_invariant=not fast, tma=tma, table=current_table)
        cands = candidates(T, K, H, I, E, fp8=fp8, fast=fast, tma=tma)
        heuristic = cands[0]
        ref = run(heuristic).float()
        # bf16 and batch-invariant fp8: every configuration gives the same bits; fp8 --fast rounds by tile
        exact = not fast
        if current not in cands:
            cands.insert(0, current)

        def check(y, ref=ref, exact=exact):
            y = y.float()
            if exact and torch.equal(y, ref):  # every configuration gives the same bits (DESIGN)
                return None
            err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if exact:
                return f"not the heuristics' bits (rel. error {err:.2e})"
            # fp8 --fast: a wrong configuration (or NaN) never wins
            return None if err < 2e-2 else f"rel. error {err:.2e} against the heuristics' output"

        point_rows, best = sweep(T, cands, current, heuristic, run, check,
                                 lambda c, T=T: {"shape": shape, "T": T, "fp8": fp8, "fast": fast},
                                 min_gain=min_gain, deadline=deadline, log=log, label=f"{shape} fp8={fp8}",
                                 neighbours=neighbours, refine_rounds=refine_rounds)  # fmt: skip
        rows += point_rows
        if best is not None:
            winners[table_key(H, I, E, K, fp8, T)] = best
    return rows, winners


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench tune", description=strip_rest(__doc__.split("\n")[0]))
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the layer shape to tune")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts")
    p.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp8"), help="weights: bf16 or fp8 block-scale"
    )
    p.add_argument("--fast", action="store_true", help="fp8: tune batch_invariant=False (fp8_fast) entries")
    p.add_argument(
        "--backward",
        action="store_true",
        help="tune the training backward's kernel tiles (bf16; the table's backward section) instead",
    )
    p.add_argument(
        "--table",
        default=None,
        metavar="PATH",
        help="start from this table (a tuned_<name>.json, e.g. an earlier run's) instead of the card's "
        "shipped one: its choices are the current ones, and the new entries merge into it",
    )
    p.add_argument("--name", default=None, help="the table's name (default: the current table's)")
    p.add_argument("--min-gain", type=float, default=0.02, help="least gain over the current choice to keep")
    p.add_argument("--max-minutes", type=float, default=8.0, help="time budget of the sweep")
    p.add_argument(
        "--refine-rounds",
        type=int,
        default=2,
        help="rounds of the fastest's neighbours after the grid (forward: warps, stages, the top-k sum's "
        "kernel; backward: one kernel group at a time); 0: the grid only",
    )
    p.add_argument("--out", default="bench_results", help="output directory")
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens: expected a comma list of positive ints, got {a.tokens!r}")
    if not tokens or min(tokens) < 1:
        p.error(f"--tokens: expected a comma list of positive ints, got {a.tokens!r}")
    if a.fast and a.dtype != "fp8":
        p.error("--fast: only with --dtype fp8 (bf16 is batch-invariant in every configuration)")
    if a.backward and a.dtype != "bf16":
        p.error("--backward: only with --dtype bf16 (the fp8 block-scale path is inference-only)")
    if a.refine_rounds < 0:
        p.error(f"--refine-rounds: expected an int >= 0, got {a.refine_rounds}")
    if not (0 <= a.min_gain < 1) or a.max_minutes <= 0:
        p.error(f"--min-gain in [0, 1) and --max-minutes > 0, got {a.min_gain} and {a.max_minutes}")
    start = None
    if a.table is not None:
        from replaymoe.moe.tuned import TunedTable

        try:
            start = TunedTable.load(a.table)
        except ValueError as exc:
            p.error(f"--table: {exc}")
    if no_cuda("replaymoe bench tune"):
        return NO_CUDA_EXIT
    from replaymoe.moe.tuned import table_for

    dev = torch.device("cuda", torch.cuda.current_device())
    current = start if start is not None else table_for(dev)
    device_name = torch.cuda.get_device_name(dev)
    source = f"{a.table}, " if a.table is not None else ""
    tuned_on = current.tuned_on or "nothing"
    print(f"card: {device_name}; current table: {current.name} ({source}tuned on {tuned_on})")
    deadline = time.monotonic() + a.max_minutes * 60
    if a.backward:
        from .tune_bwd import tune_backward

        H, I, E, K, _ = SHAPES[a.shape]  # noqa: E741
        rows, winners = tune_backward(a.shape, (H, I, E, K), tokens, min_gain=a.min_gain, deadline=deadline,
                                      refine_rounds=a.refine_rounds, table=current)  # fmt: skip
    else:
        rows, winners = tune(a.shape, tokens, fp8=a.dtype == "fp8", fast=a.fast, min_gain=a.min_gain,
                             deadline=deadline, refine_rounds=a.refine_rounds, table=current)  # fmt: skip
    name = a.name or current.name
    flags = (" --fast" if a.fast else "") + (" --backward" if a.backward else "")
    note = f"bench tune --shape {a.shape} --tokens {a.tokens} --dtype {a.dtype}{flags} on {device_name}: "
    kind = "backward " if a.backward else ""
    note += f"{len(winners)} {kind}{'entry' if len(winners) == 1 else 'entries'}."
    notes = f"{current.notes} {note}" if current.notes else note
    # a table re-tuned under its own name keeps its base; a new name records where it started from
    base = current.base if name == current.name else (current.base or current.name)
    table = current.with_entries(winners, fp8_fast=a.fast, backward=a.backward, name=name,
                                 tuned_on=device_name, base=base, notes=notes)  # fmt: skip
    out = Path(a.out)
    write_results(rows, out, "tune")
    out.mkdir(parents=True, exist_ok=True)
    table.save(out / f"tuned_{name}.json")
    print_table([r for r in rows if r.get("vs_current", 0) >= 1.0 or r["current"]],
                ["shape", "T", "fp8", "pass", "us", "current", "vs_current", "config"])  # fmt: skip
    for key, c in winners.items():
        print(f"new entry {key}: {c}")
    print(f"wrote {out / f'tuned_{name}.json'} ({len(winners)} new entries over {current.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

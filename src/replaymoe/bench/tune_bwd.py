"""The backward half of ``replaymoe bench tune`` (``--backward``): the training backward's kernel tiles.

For each token count of one shape (bf16), one training forward of a routed layer
(``replaymoe::moe_experts_train``), then the backward (:func:`replaymoe.moe._backward.launch_bwd`) under
each configuration of :func:`backward_candidates`: the heuristics' first, then one kernel group varied
at a time (each GEMM's stages and warps, the dA / dX column tiles, the dW tiles and grid, ``group_m``),
then rounds of the same variations around the fastest (``--refine-rounds``), where two changes may add up.
Each must give the heuristics' gradients bit for bit (DESIGN, "Fused MoE": the tiles change time only)
and is timed as the median of CUDA-graph replays with the L2 flushed (``bench._timing.time_graph``).
A winner by at least ``--min-gain`` over the configuration the card uses today, in the sweep and again
in alternating rounds (:func:`replaymoe.bench._tuning.confirm`), becomes the problem's ``backward`` entry
of the card's table (its kernel tiles, :data:`replaymoe.moe.configs.BWD_TILE_FIELDS`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from ._timing import time_graph
from ._tuning import random_routing, sweep

# the dW GEMMs' (bm_w, bn_w, bk_w, warps_w, stages_w) around the heuristics' (Hopper shared memory: 228 KB)
DW_TILES = [(128, 128, 32, 4, 4), (128, 256, 32, 8, 6), (128, 256, 32, 8, 4), (128, 128, 64, 8, 4),
            (128, 256, 64, 8, 3)]  # fmt: skip


def backward_candidates(T: int, K: int, H: int, I: int, E: int, *, tma: bool) -> list:  # noqa: E741
    """The backward configurations tried for one problem: the heuristics' first, then
    :func:`variations` of it (deduplicated)."""
    from replaymoe.moe.configs import moe_bwd_config

    base = moe_bwd_config(T, K, H, I, E, tma=tma)
    return [base, *variations(base)]  # (variations: without repeats, base not among them)


def variations(c) -> list:
    """``c`` (a ``MoEBwdConfig``) with one kernel group varied at a time: each GEMM's stages and warps,
    the dA / dX column tiles, the dW tiles (long segments only: ``block_m`` >= 64) and grid (with the dW
    TMA kernel), ``group_m``. The sweep's grid around the heuristics, and its local search's neighbours
    around the fastest so far (where two groups' changes may add up)."""
    R = dataclasses.replace
    out = []
    for s in (2, 3, 4, 5):
        out += [R(c, stages_a=s), R(c, stages_x=s)]
    for w in (4, 8):
        out += [R(c, warps_a=w), R(c, warps_x=w)]
    for bn in (128, 256):
        out += [R(c, bn_a=bn), R(c, bn_x=bn)]
    for bm, bn, bk, w, s in DW_TILES:
        if c.block_m >= 64:  # the long-segment tiles; short segments keep the heuristics' small dW tiles
            out.append(R(c, bm_w=bm, bn_w=bn, bk_w=bk, warps_w=w, stages_w=s, maxnreg_w=0))
    if c.dw_tma:
        out += [R(c, dw_progs=p) for p in (0, -1)]
    out += [R(c, group_m=g) for g in (4, 8, 16)]
    return [v for v in dict.fromkeys(out) if v != c]


def time_config(config, fn: Callable[[], object], timer: Callable = time_graph) -> float:
    """µs of one ``fn()`` (which runs ``config``): ``timer(fn)`` on a short budget (a sweep times dozens)."""
    return timer(fn, warmup_ms=5, rep_ms=20)


def _layer(H: int, I: int, E: int, K: int, T: int, device: torch.device, seed: int = 0):  # noqa: E741
    """bf16 weights, activations and output gradient, distinct random top-K ids and softmax weights."""
    g = torch.Generator(device=device).manual_seed(seed + T)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=device).mul_(H**-0.5).bfloat16()
    w2 = torch.randn(E, H, I, generator=g, device=device).mul_(I**-0.5).bfloat16()
    x = torch.randn(T, H, generator=g, device=device).bfloat16()
    dout = torch.randn(T, H, generator=g, device=device).bfloat16()
    return (w13, w2, x, dout, *random_routing(T, E, K, device, seed))


def tune_backward(
    shape: str,
    dims: tuple[int, int, int, int],
    tokens: list[int],
    *,
    min_gain: float,
    deadline: float,
    log=print,
    device: str | torch.device = "cuda",
    refine_rounds: int = 2,
    table=None,
):
    """Sweep :func:`backward_candidates` for every T of a layer ``dims`` = (H, I, E, K) named ``shape``,
    then up to ``refine_rounds`` rounds of :func:`variations` around the fastest; returns (rows, winners
    {table key: the winner's kernel tiles}). ``table``: the :class:`~replaymoe.moe.tuned.TunedTable` whose
    choice is "current" (default: the device's, ``table_for``)."""
    from replaymoe.moe._backward import launch_bwd
    from replaymoe.moe.configs import (
        BWD_TILE_FIELDS,
        config_tuple,
        dw_tma_ok,
        moe_bwd_config,
        moe_config,
        tma_ok,
    )
    from replaymoe.moe.tuned import table_for, table_key

    H, I, E, K = dims  # noqa: E741
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    table = table if table is not None else table_for(dev)
    tma = dw_tma_ok(dev, torch.bfloat16)
    rows, winners = [], {}
    for T in tokens:
        if time.monotonic() > deadline:
            log(f"time budget spent: T={T} and later not tuned")
            break
        w13, w2, x, dout, ids, wts = _layer(H, I, E, K, T, dev)
        c_fwd = moe_config(T, K, H, I, E, tma=tma_ok(dev, torch.bfloat16), table=table)
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, config_tuple(c_fwd), False)

        def run(c, x=x, w13=w13, w2=w2, ids=ids, wts=wts, dout=dout, saved=saved):
            return launch_bwd(dout, x, w13, w2, ids, wts, saved, 0, False, [True] * 4, c)

        current = moe_bwd_config(T, K, H, I, E, tma=tma, table=table)
        cands = backward_candidates(T, K, H, I, E, tma=tma)
        heuristic = cands[0]
        ref = run(heuristic)
        if current not in cands:
            cands.insert(0, current)

        def check(got, ref=ref):  # the tiles change time only
            return (
                None
                if all(torch.equal(a, b) for a, b in zip(got, ref))
                else "not the heuristics' gradient bits"
            )

        point_rows, best = sweep(T, cands, current, heuristic, run, check,
                                 lambda c, T=T: {"shape": shape, "T": T, "pass": "backward"},
                                 min_gain=min_gain, deadline=deadline, log=log, label=f"{shape} backward",
                                 timer=time_config, neighbours=variations,
                                 refine_rounds=refine_rounds)  # fmt: skip
        rows += point_rows
        if best is not None:
            winners[table_key(H, I, E, K, False, T)] = {f: int(getattr(best, f)) for f in BWD_TILE_FIELDS}
        del saved, ref
    return rows, winners

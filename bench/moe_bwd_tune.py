"""Device script: per-kernel device times of the fused-MoE backward for configuration variants.

PYTHONPATH=src PYTHONUNBUFFERED=1 python3 bench/moe_bwd_tune.py [--vary groups|dx] [shape:T ...]

Routing given (random top-k), bf16, one training forward; then, for the configuration this card runs
(``moe_bwd_config`` with the device's TMA switch and tuned table: ``table``) and the heuristics alone
(``heuristics``) and each variant around the heuristics, one line per (shape, T, variant) with the summed
device time of the backward's kernels and each kernel's (torch profiler, mean of 4 backwards) and the
relative error of its gradients against the first configuration's (0 where the variant keeps the bits).
``--vary groups`` (default) times the candidates of ``replaymoe bench tune --backward`` (one kernel
group varied at a time: each GEMM's stages and warps, dA / dX column tiles, dW tiles and grid,
group_m); ``--vary dx`` only the dX GEMM's stages (the backward entries of
``src/replaymoe/moe/tables/h100.json`` came from it, bench/moe_notes.md, session 20).
Writes ``$OUT/bwd_tune.txt``.
"""

import argparse
import dataclasses
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe.moe.configs as M
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights
from replaymoe.bench.tune_bwd import backward_candidates
from replaymoe.moe._backward import launch_bwd
from replaymoe.moe.tuned import table_for

OUT = os.environ.get("OUT", "/tmp")
KERNELS = ("bwd_da", "bwd_swiglu", "bwd_dx", "bwd_dw", "gather", "reduce", "gemm1")
R = dataclasses.replace


def variants(c0: M.MoEBwdConfig, vary: str, T: int, K: int, H: int, I: int, E: int, tma: bool):  # noqa: E741
    """(name, configuration) around the heuristics ``c0``: ``dx`` the dX GEMM's stages; ``groups`` the
    candidates of ``replaymoe bench tune --backward`` (one kernel group varied at a time), each named by
    the fields it changes."""
    if vary == "dx":
        return [(f"dX stages {s}", R(c0, stages_x=s)) for s in (2, 3, 4, 5) if s != c0.stages_x]
    out = []
    for c in backward_candidates(T, K, H, I, E, tma=tma)[1:]:
        changed = [f"{f}={getattr(c, f)}" for f in M.BWD_TILE_FIELDS if getattr(c, f) != getattr(c0, f)]
        out.append((" ".join(changed), c))
    return out


def time_backward(args: tuple, cfg: M.MoEBwdConfig, ref):
    """(gradients, per-kernel ms, relative error against ``ref``) of ``launch_bwd(*args, cfg)``."""
    got = launch_bwd(*args, 0, False, [True] * 4, cfg)
    torch.cuda.synchronize()
    ref = got if ref is None else ref
    err = max(float((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
              for g, r in zip(got, ref))  # fmt: skip
    for _ in range(2):
        launch_bwd(*args, 0, False, [True] * 4, cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            launch_bwd(*args, 0, False, [True] * 4, cfg)
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.key_averages():
        for k in KERNELS:
            if k in ev.key:
                per[k] = per.get(k, 0.0) + ev.device_time_total / 4 / 1e3
    return ref, per, err


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vary", choices=("groups", "dx"), default="groups")
    p.add_argument("points", nargs="*", default=["qwen3:4096", "qwen3:16384", "mixtral:16384", "dsv3:16384"])
    a = p.parse_args(argv)
    lines = []

    def say(line):
        lines.append(line)
        print(line, flush=True)

    for pt in a.points:
        name, T = pt.split(":")
        T = int(T)
        H, I, E, K = SHAPES[name]  # noqa: E741
        w13, w2 = layer_weights(H, I, E)
        x, ids, wts, dout = layer_inputs(T, H, E, K)
        w13, w2, x, wts = (t.detach() for t in (w13, w2, x, wts))
        c_fwd = M.moe_config(T, K, H, I, E, tma=M.tma_ok(x.device, x.dtype), table=table_for(x.device))
        fwd = (x, w13, w2, ids, wts, 0, M.config_tuple(c_fwd), False)
        out, saved = torch.ops.replaymoe.moe_experts_train(*fwd)
        tma = M.dw_tma_ok(x.device, x.dtype)
        heur = M.moe_bwd_config(T, K, H, I, E, tma=tma)
        card = M.moe_bwd_config(T, K, H, I, E, tma=tma, table=table_for(x.device))
        say(f"{pt} table {table_for(x.device).name}: {card}")
        ref = None
        args = (dout, x, w13, w2, ids, wts, saved)
        around = variants(heur, a.vary, T, K, H, I, E, tma)
        for vname, cfg in [("table", card), ("heuristics", heur)] + around:
            try:
                ref, per, err = time_backward(args, cfg, ref)
            except Exception as exc:  # a variant may not fit (shared memory)
                say(f"{pt} {vname}: FAILED {type(exc).__name__}: {str(exc)[:100]}")
                continue
            desc = " ".join(f"{k}={v:.3f}" for k, v in sorted(per.items()))
            say(f"{pt} {vname:36s} total={sum(per.values()):.3f}ms {desc} err={err:.1e}")
        del args
        del out, saved
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "bwd_tune.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

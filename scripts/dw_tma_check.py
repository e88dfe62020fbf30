"""Device script: the backward's weight-gradient GEMMs with TMA descriptors off / on (A/B, one process).

For each bench shape (qwen3, mixtral, dsv3) × T in {4096, 16384} (routing given, bf16, as
``replaymoe bench train``), the configuration :func:`replaymoe.moe_triton.moe_bwd_config` picks, in
variants: ``ptr`` (pointer dW kernel, ``dw_tma=False``), ``tma`` (the default on Hopper), ``tma+pers``
(a persistent grid of one or two programs per SM), ``tma+ptrC`` (C by pointer stores: fewer registers)
and ``tma+stage`` (one more pipeline stage where it fits shared memory). Rounds alternate the
variants (ptr, tma, ... ptr, tma, ...); per variant: the dW kernels' device time per backward
(torch.profiler, both dW launches, median over rounds) and its TFLOP/s (6·T·K·H·I flops), the whole
backward's CUDA-event time (median), and whether dW13 / dW2 are bitwise equal to ``ptr``'s. Prints
a table and writes it to $OUT/dw_tma_check.txt.

Usage: PYTHONPATH=src python3 scripts/dw_tma_check.py [shape:T ...] [--rounds N]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe.moe_triton as MT
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights

OUT = os.environ.get("OUT", "/tmp")
SMEM_MAX = 232448


def _smem(c) -> int:
    """Shared memory of the TMA dW kernel's pipeline: stages × (A + B blocks), bf16."""
    return c.stages_w * (c.bk_w * c.bm_w + c.bk_w * c.bn_w) * 2


def variants(c, sms: int) -> dict:
    v = {"ptr": dataclasses.replace(c, dw_tma=False), "tma": dataclasses.replace(c, dw_tma=True)}
    per_sm = 2 if 2 * _smem(c) <= SMEM_MAX - 2048 else 1  # small tiles: two resident programs per SM
    v["tma+pers"] = dataclasses.replace(c, dw_tma=True, dw_progs=per_sm * sms)
    v["tma+ptrC"] = dataclasses.replace(c, dw_tma=True, dw_c_desc=False)  # fewer registers (sm_90 compile)
    deeper = dataclasses.replace(c, dw_tma=True, stages_w=c.stages_w + 1)
    if _smem(deeper) <= SMEM_MAX - 1024:  # the epilogue reuses the pipeline's buffers (sm_90 compile)
        v["tma+stage"] = deeper
    return v


def dw_ms(f, iters: int = 3) -> float:
    """Device time of the dW kernels per call of ``f`` (ms), from torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            f()
        torch.cuda.synchronize()
    return sum(ev.device_time_total for ev in prof.key_averages() if "bwd_dw" in ev.key) / iters / 1e3


def event_ms(f) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    f()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def measure(name: str, T: int, sms: int, rounds: int) -> list[str]:
    """The table rows of one (shape, T) point."""
    H, I, E, K = SHAPES[name]  # noqa: E741
    w13, w2 = (t.detach() for t in layer_weights(H, I, E))
    x, ids, wts, dout = (t.detach() for t in layer_inputs(T, H, E, K))
    c0 = MT.config_tuple(MT.moe_config(T, K, H, I, E))
    _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, c0, False)
    picked = MT.moe_bwd_config(T, K, H, I, E, tma=MT.dw_tma_ok(x.device, x.dtype))
    vs = variants(picked, sms)
    flops = 6 * T * K * H * I

    def run(cfg, need=(True, True, True, True)):
        return MT.launch_bwd(dout, x, w13, w2, ids, wts, saved, 0, False, list(need), cfg)

    ref = run(vs["ptr"], (False, True, True, False))[1:3]
    same, failed = {}, []
    for vn, cfg in vs.items():  # also the warm-up (compilation) before the timed rounds
        try:
            got = run(cfg, (False, True, True, False))[1:3]
        except Exception as exc:  # e.g. out of shared memory: reported, not timed
            failed.append(f"{name:8s} {T:6d} {vn:10s} FAILED {type(exc).__name__}: {str(exc)[:100]}")
            print(failed[-1], flush=True)
            continue
        same[vn] = all(torch.equal(a, b) for a, b in zip(got, ref))
        del got
    vs = {vn: cfg for vn, cfg in vs.items() if vn in same}
    del ref
    dw = {vn: [] for vn in vs}
    bwd = {vn: [] for vn in vs}
    for _ in range(rounds):
        for vn, cfg in vs.items():
            dw[vn].append(dw_ms(lambda cfg=cfg: run(cfg)))
            bwd[vn].append(event_ms(lambda cfg=cfg: run(cfg)))
    base = statistics.median(dw["ptr"])
    rows = failed
    for vn, cfg in vs.items():
        m = statistics.median(dw[vn])
        desc = f"{cfg.bm_w}x{cfg.bn_w}x{cfg.bk_w} w{cfg.warps_w} s{cfg.stages_w} progs={cfg.dw_progs}"
        desc += "" if cfg.dw_c_desc else " C-ptr"
        rows.append(f"{name:8s} {T:6d} {vn:10s} {m:8.3f} {flops / m / 1e9:6.0f} {base / m:6.3f}x "
                    f"{statistics.median(bwd[vn]):8.3f}  {str(same[vn]):7s}  {desc}")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(points: list[str], rounds: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [f"device: {torch.cuda.get_device_name(0)}, {sms} SMs; rounds {rounds}; dW = dW13 + dW2 kernels"]
    rows.append(f"{'shape':8s} {'T':>6s} {'variant':10s} {'dW ms':>8s} {'TF/s':>6s} {'vs ptr':>7s} "
                f"{'bwd ms':>8s}  bitwise  config")  # fmt: skip
    print("\n".join(rows), flush=True)
    for pt in points:
        name, T = pt.split(":")
        rows += measure(name, int(T), sms, rounds)
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "dw_tma_check.txt"), "w") as fh:
        fh.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    n_rounds = 5
    if "--rounds" in args:
        i = args.index("--rounds")
        n_rounds = int(args[i + 1])
        del args[i : i + 2]
    default = [f"{s}:{t}" for s in ("qwen3", "mixtral", "dsv3") for t in (4096, 16384)]
    main(args or default, n_rounds)

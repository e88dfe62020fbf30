"""Device script: per-kernel times of the fused-MoE backward for config variants (torch.profiler).

PYTHONPATH=src PYTHONUNBUFFERED=1 python3 bench/moe_bwd_tune.py [shape:T ...]
Routing given (random top-k), bf16; prints one line per (shape, T, variant) with each backward
kernel's mean time and TFLOP/s, and the whole backward's CUDA-event time.
"""

import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe.moe.configs as M
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights
from replaymoe.moe._backward import launch_bwd

OUT = os.environ.get("OUT", "/tmp")

# (block_m, dA: bn bk warps stages, dX: bn bk warps stages, dW: bm bn bk warps stages, group_m, dw_mode)
C = M.MoEBwdConfig
VARIANTS = {
    "w5": C(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 256, 64, 8, 3, 8, 1),
    "s1": C(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 128, 32, 4, 4, 8, 1),
    "s7": C(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 256, 32, 8, 4, 8, 1),
    "s8": C(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 128, 32, 4, 5, 8, 1),
}


def main(points):
    lines = []
    for pt in points:
        name, T = pt.split(":")
        T = int(T)
        H, I, E, K = SHAPES[name]  # noqa: E741
        w13, w2 = layer_weights(H, I, E)
        x, ids, wts, dout = layer_inputs(T, H, E, K)
        w13, w2, x, wts = (t.detach() for t in (w13, w2, x, wts))
        c0 = M.moe_config(T, K, H, I, E)
        out, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, M.config_tuple(c0), False)
        S = T * K
        flops = {"da": 2 * S * H * I, "dx": 4 * S * H * I, "dw": 6 * S * H * I, "gemm1": 4 * S * H * I}
        ref = None
        for vname, cfg in [("default", M.moe_bwd_config(T, K, H, I, E))] + list(VARIANTS.items()):
            for rec in (False, True) if vname == "default" else (False,):

                def f(cfg=cfg, rec=rec, args=(dout, x, w13, w2, ids, wts, saved)):
                    return launch_bwd(*args, 0, rec, [True] * 4, cfg)

                try:
                    got = f()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = got
                    err = max(
                        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                        for a, b in zip(got, ref)
                    )
                    del got
                except Exception as exc:  # a config may not fit
                    lines.append(f"{name} T={T} {vname} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                    print(lines[-1], flush=True)
                    continue
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    f()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        f()
                    torch.cuda.synchronize()
                per = {}
                for ev in prof.key_averages():
                    key = ev.key
                    tag = "other"
                    for t in ("bwd_da", "bwd_swiglu", "bwd_dx", "bwd_dw", "gemm1", "reduce", "layout"):
                        if t in key:
                            tag = t.replace("bwd_", "")
                    per[tag] = per.get(tag, 0.0) + ev.device_time_total / 3 / 1e3  # ms per backward
                desc = " ".join(
                    f"{k}={v:.3f}ms" + (f"({flops[k] / v / 1e9:.0f}TF)" if k in flops else "")
                    for k, v in sorted(per.items())
                )
                line = (f"{name} T={T} {vname}{'+rec' if rec else ''} total={statistics.median(times):.3f}ms "
                        f"err_vs_default={err:.1e} {desc}")  # fmt: skip
                lines.append(line)
                print(line, flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "bwd_tune.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3:4096", "qwen3:16384", "mixtral:16384", "dsv3:16384"])

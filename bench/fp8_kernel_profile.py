"""Device script: fp8 small batches kernel by kernel, ours (several tile configurations) against vLLM's GEMM1
and GEMM2 each on its own.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/fp8_kernel_profile.py
    [--points "q:1,8,64;m:1,8;d:64"] [--iters 30]

For each point (``shape key:token counts``, keys of ``bench/_decode_points.py``'s SHAPES): vLLM 0.33's fp8
GEMM1 and GEMM2 (its configuration for the point, as ``moe_side_by_side.py`` picks it), each timed alone, and
our experts (``experts_triton``, topk given) with the card's configuration and with the swapped kernels on
16-row tiles at several GEMM1 widths. Mean device µs per kernel under the torch profiler; before each call
the L2 is left clean and cold (a 256 MB write, then a 256 MB read), so the first kernel of a call does not
also pay the write-back of a flush's dirty lines, which ``do_bench``'s flush (a write only) leaves to it.
So each kernel's time can be compared with vLLM's kernel of the same role. Bits: each configuration's output
against the card's configuration. Writes ``$OUT/fp8_kernel_profile.json``. Results:
``bench/results/fp8_kernel_profile_h100_s29.txt`` (bench/moe_notes.md, session 29).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from _decode_points import P, S, points
from decode_kernel_profile import kernel_times

from replaymoe.moe.configs import MoEConfig, moe_config
from replaymoe.moe.tuned import table_for


def vllm_gemms(pt, cfg: dict):
    """vLLM's fp8 GEMM1 and GEMM2 as two closures (the activation quantization and SwiGLU between them
    precomputed, as ``moe_side_by_side.py``'s vk8)."""
    w13, s13, w2, s2 = pt.weights
    x, ids, wts, K = pt.x, pt.ids, pt.wts, pt.K
    T, H = x.shape
    N2 = w13.shape[1]
    sid, eid, ntpp = P.expert_assignment(ids, cfg, pt.E)
    c1 = torch.empty(T, K, N2, dtype=torch.bfloat16, device=x.device)
    c3 = torch.empty(T, K, H, dtype=torch.bfloat16, device=x.device)
    xq, xs = S.quant_act_group(x)
    S.launch_fp8(xq, xs, w13, s13, c1, wts, sid, eid, ntpp, False, K, cfg)
    aq, as_ = S.quant_act_group(P.silu_mul(c1.view(-1, N2)).contiguous())
    return (lambda: S.launch_fp8(xq, xs, w13, s13, c1, wts, sid, eid, ntpp, False, K, cfg),
            lambda: S.launch_fp8(aq, as_, w2, s2, c3, wts, sid, eid, ntpp, True, 1, cfg))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="q:1,8,64;m:1,8;d:64")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for part in a.points.split(";"):
        shape, tokens = part.split(":")
        for pt in points(shape, "fp8", tokens, dev):
            c0 = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=True, table=table_for(dev))
            configs = {"card's": c0}
            for n1, s1 in ((32, 3), (32, 4), (64, 3), (128, 3), (128, 4)):
                c = MoEConfig(False, 16, n1, 128, 4, s1, 64, 128, 4, s1, swap_ab=True)
                configs[f"tile16 n1={n1} s{s1}"] = c
            cfg, _ = S.fp8_cfg(pt.T, pt.E, pt.I, pt.H, pt.K)
            g1, g2 = (sum(kernel_times(f, a.iters, clean=True).values()) for f in vllm_gemms(pt, cfg))
            rows.append(dict(shape=pt.name, T=pt.T, config="vLLM", gemm1=round(g1, 2), gemm2=round(g2, 2)))
            head = f"[{time.time() - t0:4.0f}s] {pt.name} T={pt.T}"
            print(f"{head} vLLM  gemm1 {g1:8.2f} gemm2 {g2:8.2f}", flush=True)
            ref = pt.ours(c0)()
            for name, c in configs.items():
                fn = pt.ours(c)
                same = bool(torch.equal(fn(), ref))
                kt = kernel_times(fn, a.iters, clean=True)
                g1 = sum(v for k, v in kt.items() if "gemm1" in k)
                g2 = sum(v for k, v in kt.items() if "gemm2" in k)
                rest = sum(kt.values()) - g1 - g2
                per_kernel = {k: round(v, 2) for k, v in kt.items()}
                rows.append(dict(shape=pt.name, T=pt.T, config=name, gemm1=round(g1, 2), gemm2=round(g2, 2),
                                 rest=round(rest, 2), same=same, kernels=per_kernel))  # fmt: skip
                print(f"    {name:18s} gemm1 {g1:8.2f} gemm2 {g2:8.2f} rest {rest:6.2f}  "
                      f"{'same' if same else 'DIFF'}  {sorted(kt)}", flush=True)  # fmt: skip
    (Path(os.environ.get("OUT", ".")) / "fp8_kernel_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

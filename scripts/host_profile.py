"""Host (CPU) time of one eager MoE block at decode size: transformers' grouped_mm vs replaymoe.

Diagnostic (GPU). The bench-size Qwen3-MoE model; one MoE block of layer 0 fed ``[B, 1, H]``. For
each piece, the host time of one call is the wall time from its start to its return with an empty
launch queue (synchronised before, not after), median of many calls; then a cProfile of the
patched block's forward lists the Python functions with the most own time.

Usage: PYTHONPATH=src python3 scripts/host_profile.py [--batch 8] [--calls 300] [--top 25]
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf.models import build_model
from replaymoe.moe import fused_moe
from replaymoe.routing import route

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--calls", type=int, default=300)
p.add_argument("--top", type=int, default=25)
a = p.parse_args()


def host_us(fn, n=a.calls):
    for _ in range(20):
        fn()
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.set_experts_implementation("grouped_mm")
ours = shared_copy(model)
session = rhf.enable(ours, max_batch_size=a.batch, max_positions=64)
blk0, blk1 = model.model.layers[0].mlp, ours.model.layers[0].mlp
H = model.config.hidden_size
x = torch.randn(a.batch, 1, H, device="cuda", dtype=torch.bfloat16)
x2 = x.reshape(-1, H)
plan = session.layers[0].plan
rows = []
with torch.no_grad():
    logits, w, ids = blk0.gate(x2)
    r = route(plan.logits(blk1.gate, x2), config=plan.routing)
    rows += [
        ("block forward: grouped_mm", host_us(lambda: blk0(x))),
        ("block forward: replaymoe", host_us(lambda: blk1(x))),
        ("router: transformers", host_us(lambda: blk0.gate(x2))),
        ("router: replaymoe (patched)", host_us(lambda: blk1.gate(x2))),
        ("  plan.logits (F.linear)", host_us(lambda: plan.logits(blk1.gate, x2))),
        ("  route(config=)", host_us(lambda: route(logits, config=plan.routing))),
        ("experts: grouped_mm", host_us(lambda: blk0.experts(x2, ids, w))),
        ("experts: replaymoe", host_us(lambda: blk1.experts(x2, r.topk_ids, r.topk_weights))),
        (
            "  fused_moe(topk given)",
            host_us(
                lambda: fused_moe(
                    x2,
                    blk1.experts.gate_up_proj,
                    blk1.experts.down_proj,
                    topk_ids=r.topk_ids,
                    topk_weights=r.topk_weights,
                )
            ),
        ),
        ("torch.empty (reference point)", host_us(lambda: torch.empty(8, 8, device="cuda"))),
    ]
    print(f"host time of one call, B={a.batch} decode tokens (us, median of {a.calls}):")
    for name, v in rows:
        print(f"  {name:40s} {v:8.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        blk1(x)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {a.calls} patched block forwards (own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
session.disable()

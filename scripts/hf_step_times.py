"""Per-step wall times of eager ``generate`` calls: plain replaymoe vs capture (vs replay) (GPU diagnostic).

Each variant runs on its own shared-weight copy of the bench model (as in ``replaymoe bench hf``);
``--rounds`` interleaved rounds of one ``generate`` per variant (order rotated each round). A forward
pre-hook on the decoder stack stamps the host clock at the start of every forward, so each
generate yields its prefill time and its decode-step intervals. Printed per generate: total, median
decode step, slowest step, and how many steps took more than twice the median. This separates a
uniform per-step cost (every step slower) from stalls (a few very slow steps).

Usage: PYTHONPATH=src python3 scripts/hf_step_times.py [--batch 32] [--rounds 10] [--new 64]
"""

import argparse
import gc
import statistics
import time

import torch

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=32)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--new", type=int, default=64)
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--variants", default="replaymoe,replaymoe+capture,replaymoe+replay")
a = p.parse_args()

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
B = a.batch
ids = torch.randint(3, model.config.vocab_size, (B, a.prompt), device="cuda")
mask = torch.ones_like(ids)
cap = dict(max_batch_size=B, max_positions=a.prompt + a.new)


def gen(m, n=a.new):
    with torch.no_grad():
        return m.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )


variants = [v for v in a.variants.split(",") if v]
traces = None
if "replaymoe+replay" in variants:
    roll = shared_copy(model)
    s = rhf.enable(roll, capture=True, **cap)
    gen(roll)
    traces = s.traces()
    s.disable()
copies, sessions, stamps = {}, {}, {}
for v in variants:
    m = copies[v] = shared_copy(model)
    sessions[v] = rhf.enable(
        m, capture=v.endswith("capture"), replay=traces if v.endswith("replay") else None, **cap
    )
    stamps[v] = []
    m.model.register_forward_pre_hook(lambda mod, args, v=v: stamps[v].append(time.perf_counter()))
    gen(m)
    gen(m)
    sessions[v].traces()

rows = {v: [] for v in variants}
for r in range(a.rounds):
    for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
        stamps[v].clear()
        gc.collect()
        gc.disable()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(copies[v])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        gc.enable()
        sessions[v].traces()
        st = stamps[v]
        steps = [(b - c) * 1e3 for c, b in zip(st[1:], st[2:])]  # decode-step intervals
        med = statistics.median(steps)
        slow = [i for i, s in enumerate(steps) if s > 2 * med]
        rows[v].append((t1 - t0) * 1e3)
        print(
            f"round {r:2d} {v:18s} total {(t1 - t0) * 1e3:7.1f} ms  "
            f"prefill->1st {(st[1] - st[0]) * 1e3:6.1f}  "
            f"step median {med:5.2f} max {max(steps):6.2f} (at {steps.index(max(steps))})  "
            f"steps > 2x median: {len(slow)} {slow[:8]}",
            flush=True,
        )
print("\nmedian total per variant (ms):")
for v in variants:
    print(f"  {v:18s} {statistics.median(rows[v]):7.1f}  best {min(rows[v]):7.1f}")

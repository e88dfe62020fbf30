"""Where an eager decode step spends its time: grouped_mm vs replaymoe (plain, capture, replay).

Diagnostic for the transformers path (GPU). For one batch size, each implementation runs on its own
shared-weight copy of the bench model; after a prefill, decode forwards (one token per row, dynamic
cache) are timed in interleaved rounds, and one step of each is profiled with torch.profiler: CUDA
kernels and aten ops launched per step and the ops with the most host (self CPU) time.

Usage: PYTHONPATH=src python3 scripts/hf_step_profile.py [--batch 8] [--steps 40] [--top 12]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe.hf as rhf
from replaymoe.bench.hf import _shared_copy
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--top", type=int, default=12)
a = p.parse_args()

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.set_experts_implementation("grouped_mm")
B, P = a.batch, a.prompt
ids = torch.randint(3, model.config.vocab_size, (B, P), device="cuda")
impls = ["grouped_mm", "replaymoe", "replaymoe+capture", "replaymoe+replay"]
copies = {i: model if i == "grouped_mm" else _shared_copy(model) for i in impls}
cap = dict(max_batch_size=B, max_positions=P + a.steps * (a.rounds + 3) + 8)
m = rhf.enable(copies["replaymoe+replay"], capture=True, **cap)
with torch.no_grad():
    copies["replaymoe+replay"].generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
    )
traces = m.traces()
m.disable()
sessions = {i: rhf.enable(copies[i], capture=i.endswith("capture"), **cap) for i in impls[1:]}
# replay: the rollout's prompt positions; decode positions past it route natively (-1 rows): the
# replay gather runs all the same
sessions["replaymoe+replay"].set_replay(traces)


def prefill(mod):
    from transformers import DynamicCache

    cache = DynamicCache(config=mod.config)
    mask = torch.ones(B, P, dtype=torch.long, device="cuda")
    out = mod(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache, mask, out.logits[:, -1:].argmax(-1)


def steps(mod, state, n):
    cache, mask, tok = state
    for _ in range(n):
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        out = mod(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
    return cache, mask, tok


times = {i: [] for i in impls}
with torch.no_grad():
    states = {i: prefill(copies[i]) for i in impls}
    for i in impls:
        states[i] = steps(copies[i], states[i], 3)
    for _ in range(a.rounds):
        for i in impls:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            states[i] = steps(copies[i], states[i], a.steps)
            torch.cuda.synchronize()
            times[i].append((time.perf_counter() - t0) / a.steps * 1e3)
    for i in impls:
        if sessions.get(i) is not None and i.endswith("capture"):
            sessions[i].traces()
    print(f"B={B} decode step (ms, median of {a.rounds} interleaved rounds of {a.steps} steps):")
    base = statistics.median(times["grouped_mm"])
    for i in impls:
        t = statistics.median(times[i])
        print(f"  {i:18s} {t:7.3f} ms  x{base / t:.2f}  rounds {' '.join(f'{x:.2f}' for x in times[i])}")
    for i in impls:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            states[i] = steps(copies[i], states[i], 1)
            torch.cuda.synchronize()
        ev = prof.key_averages()
        kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
        cpu_ops = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
        n_aten = sum(e.count for e in cpu_ops if e.key.startswith("aten::"))
        print(f"\n== {i}: {kernels} CUDA kernels, {n_aten} aten ops in one step; top host self time:")
        for e in sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[: a.top]:
            print(f"   {e.key[:60]:60s} n={e.count:4d} self {e.self_cpu_time_total:8.0f} us")
for s in sessions.values():
    s.disable()

"""Where an eager ``generate`` spends its time: grouped_mm vs replaymoe (plain, capture, replay).

Diagnostic for the transformers path (GPU). For one batch size, each implementation runs on its own
shared-weight copy of the bench model; ``generate`` calls are timed in interleaved rounds, then one
of each is profiled with torch.profiler: GPU busy time, kernels and aten ops launched, host syncs
and copies, the kernels with the most GPU time and the ops with the most host (self CPU) time.

Usage: PYTHONPATH=src python3 scripts/hf_step_profile.py [--batch 8] [--steps 40] [--top 12]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe._launch as launch
import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--steps", type=int, default=32, help="new tokens per generate")
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--top", type=int, default=12)
p.add_argument("--variants", default="grouped_mm,replaymoe,replaymoe+capture,replaymoe+replay")
p.add_argument("--no-profile", action="store_true")
p.add_argument(
    "--mode", default="eager", choices=["eager", "static"], help="static: cache_implementation='static'"
)
a = p.parse_args()
if a.mode == "static":
    from replaymoe.bench.hf import _raise_recompile_limit

    _raise_recompile_limit(8)

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.set_experts_implementation("grouped_mm")
B, P = a.batch, a.prompt
ids = torch.randint(3, model.config.vocab_size, (B, P), device="cuda")
# variants: the bench's four, and isolating ones (--variants): a second grouped_mm copy (the original vs a
# copy), routers only (experts on grouped_mm), experts only (transformers' routers), plain Triton launches
impls = [v for v in a.variants.split(",") if v]
copies = {i: model if i == "grouped_mm" else shared_copy(model) for i in impls}
cap = dict(max_batch_size=B, max_positions=P + a.steps)
sessions = {}
traces = None
if "replaymoe+replay" in impls:
    m = rhf.enable(copies["replaymoe+replay"], capture=True, **cap)
    with torch.no_grad():
        copies["replaymoe+replay"].generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a.steps,
            min_new_tokens=a.steps,
            do_sample=False,
        )
    traces = m.traces()
    m.disable()
for i in impls:
    if i in (
        "replaymoe",
        "replaymoe+capture",
        "replaymoe+replay",
        "replaymoe/plain-launch",
        "replaymoe/no-graphs",
    ):
        sessions[i] = rhf.enable(
            copies[i],
            capture=i.endswith("capture"),
            replay=traces if i.endswith("replay") else None,
            graphs=i != "replaymoe/no-graphs",
            **cap,
        )
    elif i == "replaymoe/routers-only":
        sessions[i] = rhf.enable(copies[i], experts=False, **cap)
    elif i == "replaymoe/experts-only":
        rhf.register()
        copies[i].set_experts_implementation("replaymoe")


def gen(mod, n):
    launch.ENABLED = mod is not copies.get("replaymoe/plain-launch")
    extra = {"cache_implementation": "static"} if a.mode == "static" else {}
    return mod.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        **extra,
    )


def timed(acc: dict, kind: str):
    """Forward pre/post hooks adding each call's host time to ``acc[kind] = [seconds, calls]``."""

    def pre(mod, args):
        mod._t0 = time.perf_counter()

    def post(mod, args, out):
        d = acc.setdefault(kind, [0.0, 0])
        d[0] += time.perf_counter() - mod._t0
        d[1] += 1

    return pre, post


CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.autograd.DeviceType.CPU
with torch.no_grad():
    for i in impls:
        gen(copies[i], a.steps)
        gen(copies[i], a.steps)
        if i.endswith("capture"):
            sessions[i].traces()
    times = {i: [] for i in impls}
    for _ in range(a.rounds):
        for i in impls:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(copies[i], a.steps)
            torch.cuda.synchronize()
            times[i].append((time.perf_counter() - t0) * 1e3)
            if i.endswith("capture"):
                sessions[i].traces()
    print(f"{a.mode}: B={B} generate of {a.steps} tokens (ms, median of {a.rounds} interleaved rounds):")
    base = statistics.median(times["grouped_mm"])
    for i in impls:
        t = statistics.median(times[i])
        print(f"  {i:18s} {t:8.2f} ms  x{base / t:.2f}  rounds {' '.join(f'{x:.1f}' for x in times[i])}")
    print("\nin-situ host time per module call (forward hooks, us; mean over one generate):")
    for i in [] if a.mode == "static" else impls:
        acc: dict = {}
        hooks = []
        for layer in copies[i].model.layers:
            for kind in ("self_attn", "mlp", "input_layernorm"):
                pre, post = timed(acc, kind)
                mod = getattr(layer, kind)
                hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        pre, post = timed(acc, "model")
        hooks += [copies[i].model.register_forward_pre_hook(pre), copies[i].model.register_forward_hook(post)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(copies[i], a.steps)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        for h in hooks:
            h.remove()
        if i.endswith("capture"):
            sessions[i].traces()
        parts = "  ".join(f"{k} {v[0] / v[1] * 1e6:7.1f}" for k, v in acc.items())
        print(f"  {i:18s} generate {wall:7.1f} ms  {parts}")
    kernels_of = {}
    for i in [] if a.no_profile else impls:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            gen(copies[i], a.steps)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        if i.endswith("capture"):
            sessions[i].traces()
        ev = prof.key_averages()
        kern = [e for e in ev if e.device_type == CUDA]
        gpu_ms = sum(e.self_device_time_total for e in kern) / 1e3
        cpu_ops = [e for e in ev if e.device_type == CPU]
        n_aten = sum(e.count for e in cpu_ops if e.key.startswith("aten::"))
        syncs = {
            e.key: (e.count, e.self_cpu_time_total / 1e3)
            for e in cpu_ops
            if "ynchronize" in e.key or "Memcpy" in e.key
        }
        print(
            f"\n== {i}: profiled generate {wall:.1f} ms; GPU kernels {gpu_ms:.2f} ms busy, "
            f"{sum(e.count for e in kern)} kernels, {n_aten} aten ops; syncs/copies {syncs}"
        )
        print("   top GPU kernels:")
        for e in sorted(kern, key=lambda e: -e.self_device_time_total)[: a.top]:
            print(f"     {e.key[:70]:70s} n={e.count:5d} {e.self_device_time_total / 1e3:7.2f} ms")
        kernels_of[i] = {e.key: (e.count, e.self_device_time_total / 1e3) for e in kern}
        print("   top host self time:")
        for e in sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[: a.top]:
            print(f"     {e.key[:70]:70s} n={e.count:5d} {e.self_cpu_time_total / 1e3:7.2f} ms")
    base_k = kernels_of.get("replaymoe", {})
    for i in kernels_of:
        if not i.startswith("replaymoe+"):
            continue
        print(f"\n== kernels of {i} beyond replaymoe (count, GPU ms):")
        for k, (n, ms) in sorted(kernels_of[i].items(), key=lambda kv: -kv[1][1]):
            n0, ms0 = base_k.get(k, (0, 0.0))
            if n != n0 or ms - ms0 > 0.05:
                print(f"     {k[:70]:70s} n {n0:5d} -> {n:5d}   {ms0:7.2f} -> {ms:7.2f} ms")
for s in sessions.values():
    s.disable()

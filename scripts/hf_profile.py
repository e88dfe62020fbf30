"""Host cost of the transformers path per decode step and per MoE-layer call (GPU; a diagnostic).

Prints, for the bench-size Qwen3-MoE at batch 1: the eager decode-step time of grouped_mm and of
replaymoe (plain / capture / replay), the host time of one route() and one fused_moe() call at T=1
(a loop of calls without synchronising measures the CPU side), and the top host ops of one
replaymoe decode step under torch.profiler. Usage: PYTHONPATH=src python3 scripts/hf_profile.py OUT
"""

import sys
import time

import torch

import replaymoe.hf as rhf
from replaymoe.hf.models import build_model
from replaymoe.moe import fused_moe
from replaymoe.routing import RoutingMethod, route

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.set_experts_implementation("grouped_mm")
ids = torch.randint(3, 1000, (1, 128), device="cuda")


def step_time(n=40):
    """Median ms of one decode step (B=1, 128 cached tokens) over n steps."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        o = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = o.logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = model(input_ids=tok, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
            tok = o.logits[:, -1:].argmax(-1)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


rows = [("grouped_mm", step_time())]
for mode in ("plain", "capture", "replay"):
    moe = rhf.enable(model, capture=mode != "plain")
    if mode == "replay":
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=48, do_sample=False)
        tr = moe.traces()
        moe.set_capture(False)
        moe.set_replay(tr)
    rows.append((f"replaymoe {mode}", step_time()))
    moe.disable()

H, I, E, K = 2048, 768, 128, 8
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
logits = torch.randn(1, E, device="cuda", dtype=torch.bfloat16)
tid = torch.randperm(E, device="cuda")[:K].int().reshape(1, K)
tw = torch.rand(1, K, device="cuda")


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


host = [
    ("route T=1 (host us)", host_us(lambda: route(logits, K, RoutingMethod.RENORMALIZE))),
    ("fused_moe T=1 (host us)", host_us(lambda: fused_moe(x, w13, w2, topk_ids=tid, topk_weights=tw))),
    ("torch.empty (host us)", host_us(lambda: torch.empty(8, device="cuda"))),
    ("one tiny torch op (host us)", host_us(lambda: tw.float())),
]

moe = rhf.enable(model)
from transformers import DynamicCache  # noqa: E402

with torch.no_grad():
    cache = DynamicCache(config=model.config)
    o = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tok = o.logits[:, -1:].argmax(-1)
    for _ in range(3):
        model(input_ids=tok, past_key_values=cache, use_cache=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=tok, past_key_values=cache, use_cache=True)
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
with open(f"{out_dir}/hf_profile.txt", "w") as f:
    f.write(table)
print(table[:6000])
moe.disable()
print("\n== decode step, B=1, eager (ms)")
for name, v in rows:
    print(f"  {name:24s} {v:8.3f}")
print("== host cost per call")
for name, v in host:
    print(f"  {name:30s} {v:8.1f}")

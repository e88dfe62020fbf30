"""Host cost of capture and replay in an eager ``generate``, measured without a profiler (GPU diagnostic).

Plain, capture and replay copies of the bench model generate in rotated rounds. Per copy it prints the
median and best ``generate`` time, the paired median against plain, and the host time of replaymoe's
pre/post-forward hooks per forward (``perf_counter`` around them). The hooks are where capture and
replay spend host time outside the MoE blocks' CUDA graphs; comparing their cost with the step time
tells a real overhead from the host's noise in the paired ratios.
bench/results/diag/s11_hf_hook_time_h200.txt holds its session-11 output on the H200.

Usage: PYTHONPATH=src python3 scripts/hf_hook_time.py [--batch 1] [--rounds 21]
"""

import argparse
import gc
import statistics
import time

import torch

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf import session
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=1)
p.add_argument("--rounds", type=int, default=21)
a = p.parse_args()

hook_s = {"t": 0.0, "n": 0}
_pre, _post = session.ReplayMoE._pre_forward, session.ReplayMoE._post_forward


def timed_pre(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = _pre(self, *args, **kwargs)
    hook_s["t"] += time.perf_counter() - t0
    hook_s["n"] += 1
    return out


def timed_post(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = _post(self, *args, **kwargs)
    hook_s["t"] += time.perf_counter() - t0
    return out


session.ReplayMoE._pre_forward, session.ReplayMoE._post_forward = timed_pre, timed_post

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
B, P, N = a.batch, 128, 64
ids = torch.randint(3, model.config.vocab_size, (B, P), device="cuda")
cap = dict(max_batch_size=B, max_positions=P + N)


def gen(m):
    gc.collect()
    gc.disable()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                   do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    gc.enable()
    return time.perf_counter() - t0


rollout = shared_copy(model)
s = rhf.enable(rollout, capture=True, **cap)
gen(rollout)
traces = s.traces()
s.disable()
copies = {}
for name, kw in (("plain", {}), ("capture", {"capture": True}), ("replay", {"replay": traces})):
    m = shared_copy(model)
    sess = rhf.enable(m, **kw, **cap)
    gen(m)
    gen(m)
    sess.traces()
    copies[name] = (m, sess)
names = list(copies)
times = {n: [] for n in names}
hooks = {n: [] for n in names}
for r in range(a.rounds):
    for n in names[r % 3 :] + names[: r % 3]:
        m, sess = copies[n]
        hook_s.update(t=0.0, n=0)
        times[n].append(gen(m))
        hooks[n].append(hook_s["t"] / max(hook_s["n"], 1))
        sess.traces()
print(f"B={B} rounds={a.rounds}")
for n in names:
    t = times[n]
    paired = statistics.median(x / y for x, y in zip(times["plain"], t))
    print(f"{n:8s} median {statistics.median(t) * 1e3:8.2f} ms  best {min(t) * 1e3:8.2f} ms  paired vs plain "
          f"{paired:.3f}  hooks {statistics.median(hooks[n]) * 1e6:6.1f} us per forward  step "
          f"{statistics.median(t) / N * 1e6:7.1f} us")  # fmt: skip

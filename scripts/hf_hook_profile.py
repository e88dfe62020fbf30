"""Host time of replaymoe's per-forward hooks in an eager ``generate`` (GPU diagnostic).

For plain, capture and replay copies of the bench model: one 32-token ``generate`` under cProfile,
then the cumulative time of replaymoe's functions (pre/post-forward hooks, positions, slots,
gather, router forward, block graphs), per call.

Usage: PYTHONPATH=src python3 scripts/hf_hook_profile.py [--batch 8] [--top 25]
"""

import argparse
import cProfile
import pstats

import torch

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--top", type=int, default=25)
a = p.parse_args()

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
B, P, N = a.batch, 128, 32
ids = torch.randint(3, model.config.vocab_size, (B, P), device="cuda")
cap = dict(max_batch_size=B, max_positions=P + N)


def gen(m):
    with torch.no_grad():
        return m.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
        )


roll = shared_copy(model)
s = rhf.enable(roll, capture=True, **cap)
gen(roll)
traces = s.traces()
s.disable()
for name, kw in (("plain", {}), ("capture", {"capture": True}), ("replay", {"replay": traces})):
    m = shared_copy(model)
    sess = rhf.enable(m, **kw, **cap)
    gen(m)
    gen(m)
    if name == "capture":
        sess.traces()
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    gen(m)
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n===== {name}: cumulative time of replaymoe functions in one generate of {N} tokens")
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats("replaymoe", a.top)
    sess.disable()

"""Whether capture, replay and block graphs change what an eager ``generate`` produces (GPU diagnostic).

Shared-weight copies of the bench model generate greedily from the same prompts: plain replaymoe
with and without block graphs, capture with and without, each twice (run-to-run determinism),
then replay of each capture's traces. Prints, per pair, how many generated tokens differ.

Usage: PYTHONPATH=src python3 scripts/hf_same_tokens.py [--batch 32] [--prompt 128] [--new 64]
"""

import argparse

import torch

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=32)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--new", type=int, default=64)
p.add_argument(
    "--fill-nan", action="store_true", help="torch.empty returns NaN-filled memory (uninitialized reads show)"
)
a = p.parse_args()
if a.fill_nan:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
ids = torch.randint(3, model.config.vocab_size, (a.batch, a.prompt), device="cuda")
cap = dict(max_batch_size=a.batch, max_positions=a.prompt + a.new)
variants = {
    "grouped_mm": None,
    "plain": dict(graphs=True),
    "plain/no-graphs": dict(graphs=False),
    "capture": dict(graphs=True, capture=True),
    "capture/no-graphs": dict(graphs=False, capture=True),
}
model.set_experts_implementation("grouped_mm")
copies = {k: shared_copy(model) for k in variants}
sessions = {k: rhf.enable(copies[k], **v, **cap) for k, v in variants.items() if v is not None}


def gen(m):
    with torch.no_grad():
        out = m.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a.new,
            min_new_tokens=a.new,
            do_sample=False,
        )
    return out[:, a.prompt :]


outs, traces = {}, {}
for k in variants:
    outs[k] = [gen(copies[k]), gen(copies[k])]
    if variants[k] and variants[k].get("capture"):
        traces[k] = sessions[k].traces()[-a.batch :]


for k in variants:
    print(f"  {k}: generated token 0 (NaN logits) {int((outs[k][1] == 0).sum())} times")


def diff(x, y):
    return int((x != y).sum())


print(f"B={a.batch}: generated tokens that differ (of {a.batch * a.new})")
for k in variants:
    print(
        f"  {k:20s} run 1 vs run 2: {diff(*outs[k])}   vs plain run 2: {diff(outs[k][1], outs['plain'][1])}"
    )
for k in ("capture", "capture/no-graphs"):
    for g in (True, False):
        s = sessions["plain" if g else "plain/no-graphs"]
        with s.replaying(traces[k]):
            r = gen(copies["plain" if g else "plain/no-graphs"])
            rep = s.report()
        print(
            f"  replay of {k:18s} graphs={g!s:5s}: vs its rollout {diff(r, outs[k][1])}, "
            f"fallback tokens {int(rep.fallback_tokens_per_layer.sum())}"
        )
for s in sessions.values():
    s.disable()

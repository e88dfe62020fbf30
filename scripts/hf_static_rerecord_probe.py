"""Does a static-cache ``generate`` record its compiled decode step again in a steady state? (GPU diagnostic)

transformers compiles the decode step of ``generate(cache_implementation="static")`` and runs it through
inductor's cudagraph trees, which record a new graph when a static input (the KV cache tensors) moved.
This counts the cudagraph-tree nodes made in each of ``--generates`` calls (the first two warm up: a
short and a full one, as ``replaymoe bench hf`` does) and, for every failed invariant check, the inputs
whose addresses moved (shape, dtype). Variants, each on its own shared-weight copy after a dynamo reset:
replaymoe with capture and plain, each with the kept static cache (``hf.static_cache``, the default) and
without it (``moe._static_cache.uninstall()``), and stock grouped_mm.

Reads cudagraph-tree internals (``CUDAGraphNode``), so it is tied to the torch it was written for (2.11).
Session 12 ran an earlier form of it (before the kept cache landed; outputs in
``bench/results/diag/s12_static_rerecord_probe*_h200.txt``); this form has not run on the GPU yet.

Usage: PYTHONPATH=src python3 scripts/hf_static_rerecord_probe.py [--batch 8] [--generates 8]
"""

import argparse

import torch
import torch._inductor.cudagraph_trees as cgt

import replaymoe.hf as rhf
from replaymoe.bench.hf_timing import shared_copy, timed_generate
from replaymoe.hf.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--generates", type=int, default=8)
a = p.parse_args()

nodes = {"made": 0}
moved: list = []
_init, _check = cgt.CUDAGraphNode.__init__, cgt.CUDAGraphNode.check_invariants


def counting_init(self, *args, **kwargs):
    nodes["made"] += 1
    return _init(self, *args, **kwargs)


def recording_check(self, inputs):
    status, logger = _check(self, inputs)
    if status != cgt.CheckInvariantStatus.SUCCESS:
        bad = [
            (i, tuple(t.shape), str(t.dtype))
            for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor)
            and self.static_input_data_ptrs[i] is not None
            and t.data_ptr() != self.static_input_data_ptrs[i]
        ]
        moved.append(f"{status.name} {bad[:4]}")
    return status, logger


cgt.CUDAGraphNode.__init__ = counting_init
cgt.CUDAGraphNode.check_invariants = recording_check

torch.manual_seed(0)
torch._dynamo.config.recompile_limit = 64
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
B, P, N = a.batch, 128, 64
ids = torch.randint(3, model.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(1)).cuda()
mask = torch.ones_like(ids)
cap = dict(max_batch_size=B, max_positions=P + N)

for name in ("capture", "capture/no-kept-cache", "plain", "plain/no-kept-cache", "grouped_mm"):
    torch._dynamo.reset()
    m = shared_copy(model)
    moe = None
    if name == "grouped_mm":
        m.set_experts_implementation("grouped_mm")
    else:
        moe = rhf.enable(m, capture=name.startswith("capture"), **cap)
        if name.endswith("no-kept-cache"):
            moe._static_cache.uninstall()
    per_call = []
    for i in range(a.generates):
        nodes["made"] = 0
        moved.clear()
        seconds, _, steps = timed_generate(m, ids, mask, N if i else 8, "static")
        if moe is not None and moe._capturing:
            moe.traces()
        slowest = round(max(steps) * 1e3, 2) if steps else 0.0
        per_call.append((nodes["made"], round(seconds * 1e3, 1), slowest))
        if i >= 2 and moved:
            print(f"{name}: generate {i}: {sorted(set(moved))[:2]}", flush=True)
    print(f"{name}: per generate (cudagraph nodes made, ms, slowest step ms): {per_call}", flush=True)
    if moe is not None:
        moe.disable()

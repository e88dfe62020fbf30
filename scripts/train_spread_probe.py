"""Why a Qwen3 T=4096 fwd+bwd times slower inside a full ``bench train`` run than alone (GPU diagnostic).

Session 8 measured 2.63 / 2.81 / 2.78 ms in three full-table runs and 2.65 ms in single-shape runs of the
same code, with grouped_mm's row unchanged (bench/train_notes.md, "Session 8"). This script times that
point in one process, after the rows a full run times first (``--order full``: the Qwen3 T=1024 rows of
every implementation and grouped_mm at T=4096, as ``bench train`` does) or with nothing before it
(``--order alone``), and prints for each repeat:

* ``do_bench``: ``bench train``'s own figure (``time_eager``: median CUDA-event time, L2 flushed);
* ``host``: the host time of each call inside that same ``do_bench`` loop (median and 90th percentile;
  a call is host-bound when its host time nears the kernels' span);
* ``span`` / ``gaps``: one flushed call's kernels under ``torch.profiler`` (first kernel start to last
  kernel end, and the idle time between kernels inside it).

Usage: PYTHONPATH=src python3 scripts/train_spread_probe.py [--order full|alone] [--repeats 3]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import replaymoe.bench.train as bt
from replaymoe.bench._timing import time_eager
from replaymoe.moe import fused_moe

p = argparse.ArgumentParser()
p.add_argument("--order", choices=("full", "alone"), default="full")
p.add_argument("--repeats", type=int, default=3)
a = p.parse_args()

H, I, E, K = bt.SHAPES["qwen3"]  # noqa: E741
w13, w2 = bt.layer_weights(H, I, E)
if a.order == "full":
    bt._layer_point("qwen3", 1024, w13, w2, ("grouped_mm", "rmoe", "rmoe_recompute"))
    torch.cuda.empty_cache()
    bt._layer_point("qwen3", 4096, w13, w2, ("grouped_mm",))
x, ids, wts, dout = bt.layer_inputs(4096, H, E, K)
leaves = (x, w13, w2, wts)
host: list[float] = []


def fwdbwd():
    t0 = time.perf_counter()
    torch.autograd.grad(fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts), leaves, dout)
    host.append(time.perf_counter() - t0)


def kernel_span() -> tuple[float, float]:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        torch.cuda.synchronize()
        fwdbwd()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "elementwise" not in e.name
    )
    span = kernels[-1][1] - kernels[0][0]
    return span, span - sum(end - start for start, end in kernels)


for _ in range(3):
    fwdbwd()
for r in range(a.repeats):
    host.clear()
    t = time_eager(fwdbwd, warmup_ms=10, rep_ms=300) / 1e3
    h = sorted(host)
    span, gaps = kernel_span()
    p90 = h[int(0.9 * (len(h) - 1))] * 1e3
    print(
        f"{a.order} repeat {r}: do_bench {t:.3f} ms | host per call median"
        f" {statistics.median(h) * 1e3:.3f} ms, p90 {p90:.3f} ms ({len(h)} calls) |"
        f" span {span / 1e3:.3f} ms, gaps {gaps:.0f} us",
        flush=True,
    )

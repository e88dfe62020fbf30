"""Device script: where a small-batch fused MoE's device time goes, kernel by kernel, against vLLM's two.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/decode_kernel_profile.py [--shapes q,m,d]
    [--tokens 1,8,64] [--dtypes bf16,fp8] [--iters 50]

For each point: the experts (``experts_triton`` with the card's configuration, topk given) and vLLM 0.33's
two kernels (vk / vk8, as ``moe_side_by_side.py`` times them) run ``--iters`` times under the torch
profiler, each iteration after an L2 flush; the table gives each kernel's mean device time (µs) and the
sum, so the kernels outside vLLM's pair (x quantization, layout, reduce) show with their cost. Device
times only: the gaps between launches are not in them. The points and the peer:
``bench/_decode_points.py``. Writes ``$OUT/decode_kernel_profile.json``.
"""

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from _decode_points import points
from torch.profiler import ProfilerActivity, profile

from replaymoe.moe.configs import moe_config
from replaymoe.moe.tuned import table_for

FLUSH = ("fill", "zero", "memset")  # the flush's write


def kernel_times(fn, iters: int, *, clean: bool = False) -> dict[str, float]:
    """Mean device µs per call of each kernel ``fn`` launches, the L2 flushed before each call: a 256 MB
    write (as ``do_bench`` flushes), and with ``clean`` a 256 MB read after it, so that the L2 is clean
    and cold and the call's first kernel does not also pay the write-back of the flush's dirty lines. The
    flush's own kernels and memsets are left out of the sums."""
    dirty = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    read = torch.ones(64 * 2**20, dtype=torch.float32, device="cuda") if clean else None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dirty.zero_()
            if read is not None:
                read.sum()
            fn()
        torch.cuda.synchronize()
    acc: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.lower()
        if any(f in name for f in FLUSH) or (clean and "reduce_kernel<" in name):  # (torch's sum)
            continue
        acc[ev.name[:60]] += ev.device_time / iters
    return dict(acc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q,m,d")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for pt in points(a.shapes, a.dtypes, a.tokens, dev):
        c = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=pt.fp8, table=table_for(dev))
        r = {"shape": pt.name, "dtype": pt.dtype, "T": pt.T, "config": str(c),
             "ours": kernel_times(pt.ours(c), a.iters), "peer": kernel_times(pt.peer(), a.iters)}  # fmt: skip
        rows.append(r)
        print(f"\n{pt.name} {pt.dtype} T={pt.T} ({'direct' if c.direct else f'tiles of {c.block_m}'})")
        for side in ("ours", "peer"):
            ks = r[side]
            parts = "  ".join(f"{k.split('_kernel')[0][-28:]} {v:.1f}" for k, v in ks.items())
            print(f"  {side}: sum {sum(ks.values()):7.1f} µs | {parts}", flush=True)
    (Path(os.environ.get("OUT", ".")) / "decode_kernel_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Device script: the decode as programmatic dependent launches (``MoEConfig.pdl``) and GEMM2's L2 prefetch.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers:bench python3 bench/pdl_probe.py [--shapes q,m,d]
    [--tokens 1,2,4] [--rounds 2]

For each shape and token count (bf16 weights, direct mode: the only mode with PDL): the configuration this
card runs (``moe_config`` with its tuned table) as plain launches, and with ``pdl=True`` at each GEMM2
prefetch (``moe._forward._PDL_PREFETCH``: 0 none, 1 plain L2 prefetch, 2 prefetch with the ``evict_last``
priority, set back to normal after the lines are read), timed alternately ``--rounds`` times (graph
replay, L2 flushed, median of ``do_bench``), whether each output is bitwise equal to the plain launches'
(eager and after a graph replay), and vLLM 0.33's two kernels (vk) in the same process. The points and the
peer: ``bench/_decode_points.py``. Writes ``$OUT/pdl_probe.json``; bench/moe_notes.md holds the results.
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from _decode_points import bench_graph, points
from fused_reduce_probe import graph_bits

import replaymoe.moe._forward as F
from replaymoe.moe.configs import moe_config
from replaymoe.moe.tuned import table_for

VARIANTS = (("plain", False, 1), ("pdl pf0", True, 0), ("pdl pf1", True, 1), ("pdl pf2", True, 2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q,m,d")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for pt in points(a.shapes, "bf16", a.tokens, dev):
        c0 = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=False, table=table_for(dev))
        if not c0.direct:
            print(f"{pt.name} T={pt.T}: tile mode, skipped", flush=True)
            continue
        r = {"shape": pt.name, "T": pt.T, "config": str(c0), "vk": bench_graph(pt.peer()) * 1e3}
        ref = pt.ours(dataclasses.replace(c0, pdl=False))()
        for name, pdl, pf in VARIANTS:
            F._PDL_PREFETCH = pf
            fn = pt.ours(dataclasses.replace(c0, pdl=pdl))
            r[name] = {
                "us": [],
                "same": bool(torch.equal(fn(), ref)) and bool(torch.equal(graph_bits(fn), ref)),
            }
        for _ in range(a.rounds):
            for name, pdl, pf in VARIANTS:
                F._PDL_PREFETCH = pf
                r[name]["us"].append(round(bench_graph(pt.ours(dataclasses.replace(c0, pdl=pdl))) * 1e3, 2))
        F._PDL_PREFETCH = 2
        print(f"[{time.time() - t0:5.0f}s] {pt.name} T={pt.T} vk {r['vk']:.2f}: "
              + "; ".join(f"{n} {r[n]['us']} {'=' if r[n]['same'] else 'DIFFERS'}" for n, _, _ in VARIANTS),
              flush=True)  # fmt: skip
        rows.append(r)
    print(
        "\nshape    T     vk  "
        + "  ".join(f"{n:>8s}" for n, _, _ in VARIANTS)
        + "  (min µs; ! = bits differ)"
    )
    for r in rows:
        cells = "  ".join(f"{min(r[n]['us']):8.2f}" + ("" if r[n]["same"] else "!") for n, _, _ in VARIANTS)
        print(f"{r['shape']:8s} {r['T']:2d} {r['vk']:7.2f}  {cells}")
    (Path(os.environ.get("OUT", ".")) / "pdl_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Device script: the decode's top-k sum in GEMM2 (``MoEConfig.fused_reduce``) against the reduce kernel.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/fused_reduce_probe.py [--shapes q,m,d]
    [--tokens 1,2,4,8] [--dtypes bf16,fp8] [--rounds 2]

For each shape, token count and weight dtype: the configuration this card runs (``moe_config`` with its
tuned table) with ``fused_reduce=False`` (GEMM2 then the reduce kernel) and ``True`` (the per-token
tickets in GEMM2's epilogue), timed alternately ``--rounds`` times each (graph replay, L2 flushed, median
of ``do_bench``), whether the two outputs are bitwise equal (also after a replay of a captured graph),
and vLLM 0.33's two kernels (vk / vk8) in the same process. Points where the configuration is not the
direct mode are skipped (the switch only applies there). The points and the peer: ``bench/_decode_points.py``.
Writes ``$OUT/fused_reduce_probe.json``; bench/moe_notes.md holds the results.
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from _decode_points import bench_graph, points

from replaymoe.moe.configs import moe_config
from replaymoe.moe.tuned import table_for


def graph_bits(fn) -> torch.Tensor:
    """The output of one replay of ``fn`` captured in a CUDA graph (a copy)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    return out.clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q,m,d")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for pt in points(a.shapes, a.dtypes, a.tokens, dev):
        c0 = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=pt.fp8, table=table_for(dev))
        if not c0.direct:
            print(f"{pt.name} {pt.dtype} T={pt.T}: tile mode, skipped", flush=True)
            continue
        off, on = (dataclasses.replace(c0, fused_reduce=f) for f in (False, True))
        r = {"shape": pt.name, "dtype": pt.dtype, "T": pt.T, "config": str(c0), "off": [], "on": []}
        r["vk"] = bench_graph(pt.peer()) * 1e3
        ref = pt.ours(off)()
        r["eager_same"] = bool(torch.equal(pt.ours(on)(), ref))
        r["graph_same"] = bool(torch.equal(graph_bits(pt.ours(on)), ref))
        for _ in range(a.rounds):
            for k, c in (("off", off), ("on", on)):
                r[k].append(round(bench_graph(pt.ours(c)) * 1e3, 2))
        t_off, t_on = min(r["off"]), min(r["on"])
        print(f"[{time.time() - t0:5.0f}s] {pt.name} {pt.dtype} T={pt.T}: reduce kernel {r['off']} "
              f"fused {r['on']} vk {r['vk']:.2f} | /vk {t_off / r['vk']:.3f} -> {t_on / r['vk']:.3f} "
              f"bits eager={r['eager_same']} graph={r['graph_same']}", flush=True)  # fmt: skip
        rows.append(r)
    print("\nshape    dtype  T   reduce  fused   vk     ratio: reduce  fused  bits")
    for r in rows:
        t_off, t_on = min(r["off"]), min(r["on"])
        same = r["eager_same"] and r["graph_same"]
        print(f"{r['shape']:8s} {r['dtype']:5s} {r['T']:2d} {t_off:7.2f} {t_on:7.2f} {r['vk']:7.2f}  "
              f"{t_off / r['vk']:.3f}  {t_on / r['vk']:.3f}  {same}")  # fmt: skip
    (Path(os.environ.get("OUT", ".")) / "fused_reduce_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Device script: the fp8 decode (direct mode) with and without swapped operands, against vLLM's kernels.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/fp8_decode_probe.py [--shapes q,m,d]
    [--tokens 1,4,8] [--sweep 1]

For each shape and token count: the configuration this card runs (``moe_config`` with its tuned table) with
``swap_ab=False`` (the 64-row-tile direct kernels, or tile mode where the configuration is not direct), the
same configuration swapped, swapped decode configurations at each GEMM1 block width, and at the ``--sweep``
token counts GEMM1 / GEMM2 warps and stages around them. Each line: graph-replay time (L2 flushed, median
of ``do_bench``), whether the output is bitwise equal to the first configuration's, and the ratio to vLLM
0.33's two fp8 kernels (vk8) in the same process. The points and the peer: ``bench/_decode_points.py``.
Writes ``$OUT/fp8_decode_probe.json``. Results: ``bench/results/fp8_decode_swap_h100.txt``
(bench/moe_notes.md, session 22).
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from _decode_points import bench_graph, points

from replaymoe.moe.configs import MoEConfig, moe_config
from replaymoe.moe.tuned import table_for

# the swapped decode configuration the variants start from (GEMM1 block width varied)
BASE = MoEConfig(True, 64, 64, 128, 4, 4, 128, 128, 8, 4, swap_ab=True)
# the swapped tile-mode configuration the tile variants start from (session 29's kernel profile at Qwen3,
# Mixtral and DeepSeek-V3 T = 8-64, H100: GEMM2 on 64 columns, 3 stages, 4 warps)
TILE = MoEConfig(False, 16, 32, 128, 4, 3, 64, 128, 4, 3, swap_ab=True)


def variants(c0: MoEConfig, sweep: bool, full: bool) -> dict:
    v = {"default, unswapped": dataclasses.replace(c0, swap_ab=False)}
    if c0.direct:
        v["default, swapped"] = dataclasses.replace(c0, swap_ab=True)
    for n1 in (32, 64, 128) if c0.direct or sweep else ():
        v[f"swap n1={n1}"] = dataclasses.replace(BASE, block_n1=n1)
    if not c0.direct:  # tile mode: the swapped kernels on 16- and 32-row tiles (TILE varied)
        for bm in (16, 32):
            for n1 in (32, 64, 128):
                v[f"tile{bm} n1={n1}"] = dataclasses.replace(TILE, block_m=bm, block_n1=n1)
            v[f"tile{bm} n1=32 s4"] = dataclasses.replace(TILE, block_m=bm, stages1=4, stages2=4)
            v[f"tile{bm} n2=128 w8"] = dataclasses.replace(TILE, block_m=bm, block_n2=128, warps2=8)
    if sweep:
        for n1 in (32, 64, 128):
            for w1 in (4, 8):
                for s1 in (3, 4, 5) if full else (4,):
                    v[f"g1 n{n1} w{w1} s{s1}"] = dataclasses.replace(BASE, block_n1=n1, warps1=w1, stages1=s1)
        for n2 in (64, 128):
            for w2 in (4, 8):
                for s2 in (3, 4, 5) if full else (4,):
                    v[f"g2 n{n2} w{w2} s{s2}"] = dataclasses.replace(BASE, block_n2=n2, warps2=w2, stages2=s2)
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q,m,d")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--sweep", default="1", help="token counts that get the warps / stages sweep")
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for pt in points(a.shapes, "fp8", a.tokens, dev):
        c0 = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=True, table=table_for(dev))
        vs = variants(c0, str(pt.T) in a.sweep.split(","), pt.name == "qwen3")
        ref = pt.ours(vs["default, unswapped"])()
        r = {"shape": pt.name, "T": pt.T, "default": str(c0)}
        r["vk8"] = bench_graph(pt.peer()) * 1e3
        print(f"[{time.time() - t0:5.0f}s] {pt.name} T={pt.T} vk8={r['vk8']:.2f} us", flush=True)
        for vn, c in vs.items():
            same = bool(torch.equal(pt.ours(c)(), ref))
            t = bench_graph(pt.ours(c)) * 1e3
            r[vn] = [round(t, 2), same]
            bits = "same" if same else "DIFF"
            print(f"    {vn:22s} {t:8.2f}  bits={bits}  /vk8={t / r['vk8']:.3f}", flush=True)
        rows.append(r)
    (Path(os.environ.get("OUT", ".")) / "fp8_decode_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

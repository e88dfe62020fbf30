"""Device script: the direct mode with merged slots (``MoEConfig.merge_slots``) against the tiles this card
runs and the direct mode with one tile per slot.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/merge_slots_probe.py [--shapes q,m,d]
    [--tokens 2,4,8,16,32] [--dtypes bf16,fp8] [--rounds 2]

For each shape, token count and weight dtype, three configurations of the same call, timed alternately
``--rounds`` times each (graph replay, L2 flushed, median of ``do_bench``):
- ``card``: what ``moe_config`` chooses for a CUDA graph on this card (its tuned table, else the
  heuristics): tile mode at these sizes, or the direct mode where it already runs;
- ``slot``: the direct mode's decode tiles (``moe_config(1, ...)``'s, the ``T=1`` bucket's of the table)
  with one tile per slot (``merge_slots=False``);
- ``merge``: the same with the slots that share an expert merged into one tile;
- ``mtile``: ``card``'s tiles (heights, blocks, warps, stages) in the direct mode with merged slots.
Each output is compared bitwise with ``card``'s, eagerly and after replays of a captured graph; vLLM
0.33's two kernels (vk / vk8) are timed in the same process. The points and the peer:
``bench/_decode_points.py``. Writes ``$OUT/merge_slots_probe.json``; bench/moe_notes.md holds the results.
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

from replaymoe.moe.configs import moe_config
from replaymoe.moe.tuned import table_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q,m,d")
    ap.add_argument("--tokens", default="2,4,8,16,32")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for pt in points(a.shapes, a.dtypes, a.tokens, dev):
        card = moe_config(pt.T, pt.K, pt.H, pt.I, pt.E, fp8=pt.fp8, table=table_for(dev))
        decode = moe_config(1, pt.K, pt.H, pt.I, pt.E, fp8=pt.fp8, table=table_for(dev))
        cfgs = {"card": card, "slot": dataclasses.replace(decode, merge_slots=False),
                "merge": dataclasses.replace(decode, merge_slots=True),
                "mtile": dataclasses.replace(card, direct=True, merge_slots=True)}  # fmt: skip
        r = {"shape": pt.name, "dtype": pt.dtype, "T": pt.T, "card_config": str(card), "decode": str(decode)}
        r["vk"] = bench_graph(pt.peer()) * 1e3
        ref = pt.ours(card)()
        for k in ("slot", "merge", "mtile"):
            r[f"{k}_eager_same"] = bool(torch.equal(pt.ours(cfgs[k])(), ref))
            r[f"{k}_graph_same"] = bool(torch.equal(graph_bits(pt.ours(cfgs[k])), ref))
        for k in cfgs:
            r[k] = []
        for _ in range(a.rounds):
            for k, c in cfgs.items():
                r[k].append(round(bench_graph(pt.ours(c)) * 1e3, 2))
        best = {k: min(r[k]) for k in cfgs}
        times = " ".join(f"{k} {r[k]}" for k in cfgs)
        bits = " ".join(
            f"{k}={r[k + '_eager_same']}/{r[k + '_graph_same']}" for k in ("slot", "merge", "mtile")
        )
        mode = "direct" if card.direct else "tiles"
        print(f"[{time.time() - t0:5.0f}s] {pt.name} {pt.dtype} T={pt.T}: {times} vk {r['vk']:.2f} | bits "
              f"{bits} | card {mode} {best['merge'] / best['card']:.3f}", flush=True)  # fmt: skip
        rows.append(r)
    print("\nshape    dtype  T    card    slot   merge   mtile      vk  merge/card mtile/card card/vk bits")
    for r in rows:
        b = {k: min(r[k]) for k in ("card", "slot", "merge", "mtile")}
        same = all(r[f"{k}_{m}_same"] for k in ("slot", "merge", "mtile") for m in ("eager", "graph"))
        t = f"{b['card']:7.2f} {b['slot']:7.2f} {b['merge']:7.2f} {b['mtile']:7.2f} {r['vk']:7.2f}"
        q = f"{b['merge'] / b['card']:.3f}  {b['mtile'] / b['card']:.3f}  {b['card'] / r['vk']:.3f}"
        print(f"{r['shape']:8s} {r['dtype']:5s} {r['T']:2d} {t}  {q}  {same}")
    (Path(os.environ.get("OUT", ".")) / "merge_slots_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

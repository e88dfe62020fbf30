"""Decode kernels with and without programmatic dependent launch (GPU check for the PDL change).

For the bench shapes at decode sizes (the direct mode), the experts (topk given) are timed with
``moe_triton.PDL_ENABLED`` off and on, in alternation, under CUDA-graph replay (L2 flushed) and
eagerly, and the outputs are compared bit for bit. Prints one line per point and the ratio.

Usage: PYTHONPATH=src python3 scripts/pdl_decode_check.py
"""

import torch

import replaymoe.moe_triton as mt
from replaymoe.bench._timing import time_eager, time_graph
from replaymoe.bench.moe import SHAPES, layer_floor_ms, make_weights, routing_inputs

POINTS = (("qwen3", 1), ("qwen3", 2), ("mixtral", 1), ("deepseek", 1), ("deepseek", 8))

for name, T in POINTS:
    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    w13, w2, _, _ = make_weights(H, I, E, fp8=False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, _, _, _, ids, wts = routing_inputs(name, T)
    c = mt.moe_config(T, K, H, I, E)

    def f(c=c, x=x, ids=ids, wts=wts, w13=w13, w2=w2):
        return mt.experts_triton(
            x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0, out=None, config=c
        )

    res = {}
    for _ in range(2):  # off, on, off, on: host or clock drift falls on both alike
        for pdl in (False, True):
            mt.PDL_ENABLED = pdl
            y = f()
            g_us = time_graph(f, rep_ms=50)
            e_us = time_eager(f)
            prev = res.get(pdl)
            res[pdl] = (y, min(g_us, prev[1]) if prev else g_us, min(e_us, prev[2]) if prev else e_us)
    fl, _ = layer_floor_ms(name, T, ids, 2)
    off, on = res[False], res[True]
    print(
        f"{name:8s} T={T:2d} direct={c.direct}  graph off {off[1]:7.1f} on {on[1]:7.1f} us "
        f"(x{off[1] / on[1]:.3f})  "
        f"eager off {off[2]:7.1f} on {on[2]:7.1f} us  floor {fl * 1e3:6.1f} us ({fl * 1e3 / on[1]:.0%} of it "
        f"with PDL)  same bits {torch.equal(off[0], on[0])}",
        flush=True,
    )
    del w13, w2
    torch.cuda.empty_cache()
mt.PDL_ENABLED = True

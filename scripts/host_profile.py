"""Host time of the pieces of one eager decode-size call of route() and fused_moe() (GPU; diagnostic).

A loop of calls without synchronising measures the CPU side per call. Usage:
PYTHONPATH=src python3 scripts/host_profile.py
"""

import time

import torch

import replaymoe.moe as rmoe
import replaymoe.moe_triton as rmoe_triton
import replaymoe.routing as rr
from replaymoe._kernels.routing import route_kernel


def host_us(fn, n=400):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


H, I, E, K = 2048, 768, 128, 8
dev = "cuda"
x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
logits = torch.randn(1, E, device=dev, dtype=torch.bfloat16)
tid = torch.randperm(E, device=dev)[:K].int().reshape(1, K)
tw = torch.rand(1, K, device=dev)
out = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
ids = torch.empty(1, K, dtype=torch.int32, device=dev)
wts = torch.empty(1, K, dtype=torch.float32, device=dev)
M = rr.RoutingMethod.RENORMALIZE

rows = []
rows.append(("route() total", host_us(lambda: rr.route(logits, K, M))))
rows.append(
    ("route _validate", host_us(lambda: rr._validate(logits, K, M, None, None, None, None, None, None)))
)
rows.append(
    (
        "route _launch (2 empty + kernel[grid])",
        host_us(lambda: rr._launch(logits, None, None, None, K, 1, 1, 1, 1.0)),
    )
)


def raw_route():
    route_kernel[(1,)](
        logits, logits.stride(0), logits, logits, ids, wts, logits, 1, 1.0, METHOD=1, K=K, KP=8, NG=1, GS=E,
        NGP=1, GSP=E, TOPK_GROUP=1, HAS_BIAS=False, HAS_REPLAY=False, HAS_CAPTURE=False, BLOCK_T=2, ALGO=3,
        KEY32=True, LOG_EP=7, num_warps=1,
    )  # fmt: skip


rows.append(("route_kernel[grid] alone", host_us(raw_route)))
rows.append(("torch.empty", host_us(lambda: torch.empty(1, K, dtype=torch.int32, device=dev))))
rows.append(("fused_moe() total", host_us(lambda: rmoe.fused_moe(x, w13, w2, topk_ids=tid, topk_weights=tw))))
cfg = rmoe.moe_config(1, K, H, I, E)
rows.append(("moe_config", host_us(lambda: rmoe.moe_config(1, K, H, I, E))))
rows.append(
    (
        "moe _launch direct",
        host_us(lambda: rmoe_triton._launch(x, w13, w2, tid, tw, None, None, 0, out, cfg)),
    )
)
if hasattr(rmoe_triton, "_config_tuple"):
    ct = rmoe_triton._config_tuple(cfg)
    rows.append(
        (
            "torch.ops.replaymoe.moe_experts",
            host_us(lambda: torch.ops.replaymoe.moe_experts(x, w13, w2, tid, tw, None, None, 0, out, ct)),
        )
    )
for name, v in rows:
    print(f"  {name:45s} {v:8.1f} us")

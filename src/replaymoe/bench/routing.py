"""``replaymoe bench routing``: route() against the same routing as plain torch ops.

Median microseconds of CUDA-graph replays with L2 flushed (the serving case) and of eager calls
(``triton.testing.do_bench``: device time; host launch cost shows only where it outlasts the L2
flush before each call, see ``bench._timing.time_eager``) and the host time of an eager call
(``eager_host_us``, ``bench._timing.host_us``), for DeepSeek-V3 routing (E=256, 8
groups / 4 kept, top-8, scale 2.5, fp32 bias) and RENORMALIZE (E=128, top-8), fp32 and bf16
logits, capture (``routing_replay_out``) on and off, T in {1, 16, 128, 1024, 4096, 16384}. The
HBM floor is the bytes of logits read plus outputs written over 4.27 TB/s; FlashInfer's
``fused_topk_deepseek`` time on an H200 (reference/toolchain.md) is shown for the
DeepSeek-V3 rows.
"""

from __future__ import annotations

import argparse

import torch

from replaymoe.bench._text import strip_rest  # plain-text --help when run as python -m
from replaymoe.bench._timing import (
    HBM_BYTES_PER_S,
    NO_CUDA_EXIT,
    host_us,
    no_cuda,
    print_table,
    time_eager,
    time_graph,
    write_results,
)
from replaymoe.routing import RoutingMethod, route, route_torch
from replaymoe.testing import tie_free_logits

TOKENS = (1, 16, 128, 1024, 4096, 16384)
# FlashInfer fused_topk_deepseek on the H200, DeepSeek-V3 shape, graph replay, L2 cold (µs)
FLASHINFER_DSV3_US = {
    torch.float32: {1: 7.0, 16: 7.5, 128: 7.7, 1024: 9.0, 4096: 16.8, 16384: 46.3},
    torch.bfloat16: {1: 7.1, 16: 7.4, 128: 7.6, 1024: 9.0, 4096: 16.8, 16384: 46.2},
}

MODELS = {
    "deepseek_v3": dict(
        num_experts=256,
        top_k=8,
        method=RoutingMethod.DEEPSEEK_V3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
    ),
    "renormalize": dict(num_experts=128, top_k=8, method=RoutingMethod.RENORMALIZE),
}


def _floor_us(t: int, e: int, k: int, logit_bytes: int, capture: bool) -> float:
    nbytes = t * e * logit_bytes + t * k * (4 + 4 + (2 if capture else 0))
    return nbytes / HBM_BYTES_PER_S * 1e6


def _case(name: str, dtype: torch.dtype, t: int, gen: torch.Generator):
    cfg = dict(MODELS[name])
    e = cfg.pop("num_experts")
    x = tie_free_logits(t, e, dtype=dtype, generator=gen, device="cuda")
    if cfg["method"] == RoutingMethod.DEEPSEEK_V3:
        cfg["bias"] = (torch.rand(e, generator=gen) - 0.5).cuda()
    cap = torch.zeros(max(TOKENS), cfg["top_k"], dtype=torch.int16, device="cuda")
    return x, cfg, cap, e


def run_table(tokens=TOKENS, models=tuple(MODELS), dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in models:
        for dtype in dtypes:
            for t in tokens:
                x, cfg, cap, e = _case(name, dtype, t, gen)
                k = cfg["top_k"]
                kern = time_graph(lambda x=x, cfg=cfg: route(x, **cfg))
                kern_cap = time_graph(lambda x=x, cfg=cfg, cap=cap: route(x, routing_replay_out=cap, **cfg))
                eager = time_eager(lambda x=x, cfg=cfg: route(x, **cfg))
                eager_cap = time_eager(lambda x=x, cfg=cfg, cap=cap: route(x, routing_replay_out=cap, **cfg))
                eager_host = host_us(lambda x=x, cfg=cfg: route(x, **cfg), calls=200)
                ref = time_graph(lambda x=x, cfg=cfg: route_torch(x, **cfg))
                floor = _floor_us(t, e, k, x.element_size(), False)
                fi = FLASHINFER_DSV3_US.get(dtype, {}).get(t) if name == "deepseek_v3" else None
                rows.append(
                    {
                        "model": name,
                        "dtype": str(dtype).replace("torch.", ""),
                        "T": t,
                        "graph_us": kern,
                        "graph_cap_us": kern_cap,
                        "eager_us": eager,
                        "eager_cap_us": eager_cap,
                        "eager_host_us": eager_host,
                        "torch_ops_us": ref,
                        "speedup_vs_torch": ref / kern,
                        "flashinfer_us": fi if fi is not None else "",
                        "hbm_floor_us": floor,
                        "x_floor": kern / floor,
                    }
                )
                print(
                    f"{name:12s} {rows[-1]['dtype']:8s} T={t:6d} graph {kern:7.2f} +cap {kern_cap:7.2f} "
                    f"eager {eager:7.2f} torch {ref:8.2f} floor {floor:6.2f}",
                    flush=True,
                )
    return rows


SWEEP_CONFIGS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 4)]


def run_sweep() -> list[dict]:
    """Time launch configurations (ALGO x BLOCK_T x num_warps) at a few shapes (tuning aid), each given
    per call (:func:`replaymoe.routing._triton.route_launched`)."""
    from replaymoe.routing import RoutingConfig
    from replaymoe.routing._triton import LaunchConfig, route_launched

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, dtype in (
        ("deepseek_v3", torch.float32),
        ("renormalize", torch.float32),
        ("renormalize", torch.bfloat16),
    ):
        for algo in (2, 3) if dtype == torch.float32 else (3,):  # 16-bit: one int32-key path
            for block_t, warps in SWEEP_CONFIGS:
                launch = LaunchConfig(algo=algo, block_t=block_t, num_warps=warps)
                try:
                    for t in (1, 4096, 16384):
                        x, cfg, cap, e = _case(name, dtype, t, gen)
                        r = RoutingConfig(**cfg)
                        us = time_graph(lambda x=x, r=r, lc=launch: route_launched(lc, x, r), rep_ms=30)
                        rows.append(
                            {
                                "model": name,
                                "dtype": str(dtype).replace("torch.", ""),
                                "T": t,
                                "ALGO": algo,
                                "BLOCK_T": block_t,
                                "warps": warps,
                                "graph_us": us,
                            }
                        )
                        print(rows[-1], flush=True)
                except Exception as exc:  # a config may not compile; report and go on
                    print(f"config {algo} {block_t} {warps} failed: {exc!r}"[:300], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="replaymoe bench routing", description=strip_rest(__doc__.split("\n")[0])
    )
    parser.add_argument("--out", default="./bench_out", help="directory for routing.csv / routing.json")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="*",
        default=list(TOKENS),
        help="token counts to time, space-separated (default " + " ".join(map(str, TOKENS)) + ")",
    )
    args = parser.parse_args(argv)
    if no_cuda("replaymoe bench routing"):
        return NO_CUDA_EXIT
    if args.sweep:
        sweep = run_sweep()
        write_results(sweep, args.out, "routing_sweep")
        print_table(sweep, ["model", "dtype", "T", "ALGO", "BLOCK_T", "warps", "graph_us"])
    rows = run_table(tokens=tuple(args.tokens))
    write_results(rows, args.out, "routing")
    print_table(
        rows,
        [
            "model",
            "dtype",
            "T",
            "graph_us",
            "graph_cap_us",
            "eager_us",
            "eager_cap_us",
            "eager_host_us",
            "torch_ops_us",
            "flashinfer_us",
            "hbm_floor_us",
            "x_floor",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device script: where a small-batch fused MoE's device time goes, kernel by kernel, against vLLM's two.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/decode_kernel_profile.py [--shapes q,m,d]
    [--tokens 1,8,64] [--dtypes bf16,fp8] [--iters 50]

For each point: the experts (``experts_triton`` with the card's configuration, topk given) and vLLM 0.33's
two kernels (vk / vk8, as ``moe_side_by_side.py`` times them) run ``--iters`` times under the torch
profiler, each iteration after an L2 flush; the table gives each kernel's mean device time (µs) and the
sum, so the kernels outside vLLM's pair (x quantization, layout, reduce) show with their cost. Device
times only: the gaps between launches are not in them. The peer driver is not in this repository:
``../shared/peers/README.md``. Writes ``$OUT/decode_kernel_profile.json``.
"""

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".peers")
import moe_side_by_side as S  # noqa: E402
import vllm_moe_peer as P  # noqa: E402

from replaymoe.moe._forward import experts_triton  # noqa: E402
from replaymoe.moe.configs import moe_config  # noqa: E402
from replaymoe.moe.quant import quantize_fp8_block  # noqa: E402
from replaymoe.moe.tuned import table_for  # noqa: E402

SHAPES = {
    "q": ("qwen3", 2048, 768, 128, 8),
    "m": ("mixtral", 4096, 14336, 8, 2),
    "d": ("dsv3", 7168, 2048, 256, 8),
}
FLUSH = "flush"


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean device µs per call of each kernel ``fn`` launches (L2 flushed before each call)."""
    buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            buf.zero_()
            fn()
        torch.cuda.synchronize()
    acc: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if "fill" not in ev.name.lower() and "zero" not in ev.name.lower() else FLUSH
            acc[name[:60]] += ev.device_time / iters
    acc.pop(FLUSH, None)
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
    for key in a.shapes.split(","):
        name, H, I, E, K = SHAPES[key]  # noqa: E741
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g).mul_(H**-0.5)
        w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g).mul_(I**-0.5)
        for dt in a.dtypes.split(","):
            fp8 = dt == "fp8"
            if fp8:
                (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
                del w13, w2
                torch.cuda.empty_cache()
                weights = (q13, s13, q2, s2)
            else:
                weights = (w13, None, w2, None)
            for T in map(int, a.tokens.split(",")):
                x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
                wts, ids = P.route(T, E, K, dev, g)
                c = moe_config(T, K, H, I, E, fp8=fp8, table=table_for(dev))
                w = weights

                def ours(x=x, ids=ids, wts=wts, c=c, w=w):
                    experts_triton(x, w[0], w[2], ids, wts, w13_scale=w[1], w2_scale=w[3],
                                   local_expert_offset=0, out=None, config=c)  # fmt: skip

                if fp8:
                    cfg8, _ = S.fp8_cfg(T, E, I, H, K)
                    peer = S.vllm_fp8_kernels(x, q13, s13, q2, s2, wts, ids, cfg8, E)
                else:
                    cfg, _ = P.pick_config(H, I, E, K, T)
                    peer, _ = P.vllm_kernels_only(x, w13, w2, wts, ids, cfg)
                r = {"shape": name, "dtype": dt, "T": T, "config": str(c),
                     "ours": kernel_times(ours, a.iters), "peer": kernel_times(peer, a.iters)}  # fmt: skip
                rows.append(r)
                print(f"\n{name} {dt} T={T} ({'direct' if c.direct else f'tiles of {c.block_m}'})")
                for side in ("ours", "peer"):
                    ks = r[side]
                    parts = "  ".join(f"{k.split('_kernel')[0][-28:]} {v:.1f}" for k, v in ks.items())
                    print(f"  {side}: sum {sum(ks.values()):7.1f} µs | {parts}", flush=True)
        weights = q13 = q2 = s13 = s2 = w13 = w2 = None
        torch.cuda.empty_cache()
    (Path(os.environ.get("OUT", ".")) / "decode_kernel_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Device script: the decode's top-k sum in GEMM2 (``MoEConfig.fused_reduce``) against the reduce kernel.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/fused_reduce_probe.py [--shapes q,m,d]
    [--tokens 1,2,4,8] [--dtypes bf16,fp8] [--rounds 2]

For each shape, token count and weight dtype: the configuration this card runs (``moe_config`` with its
tuned table) with ``fused_reduce=False`` (GEMM2 then the reduce kernel) and ``True`` (the per-token
tickets in GEMM2's epilogue), timed alternately ``--rounds`` times each (graph replay, L2 flushed, median
of ``do_bench``), whether the two outputs are bitwise equal (also after a replay of a captured graph),
and vLLM 0.33's two kernels (vk / vk8) in the same process. Points where the configuration is not the
direct mode are skipped (the switch only applies there). The peer driver (``moe_side_by_side.py``,
``vllm_moe_peer.py``) is not in this repository: ``../shared/peers/README.md``. Writes
``$OUT/fused_reduce_probe.json``; bench/moe_notes.md holds the results.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

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
                c0 = moe_config(T, K, H, I, E, fp8=fp8, table=table_for(dev))
                if not c0.direct:
                    print(f"{name} {dt} T={T}: tile mode, skipped", flush=True)
                    continue

                def run(c, x=x, ids=ids, wts=wts, w=weights):
                    return lambda: experts_triton(x, w[0], w[2], ids, wts, w13_scale=w[1], w2_scale=w[3],
                                                  local_expert_offset=0, out=None, config=c)  # fmt: skip

                off, on = (dataclasses.replace(c0, fused_reduce=f) for f in (False, True))
                if fp8:
                    cfg8, _ = S.fp8_cfg(T, E, I, H, K)
                    peer = S.vllm_fp8_kernels(x, q13, s13, q2, s2, wts, ids, cfg8, E)
                else:
                    cfg, _ = P.pick_config(H, I, E, K, T)
                    peer, _ = P.vllm_kernels_only(x, w13, w2, wts, ids, cfg)
                r = {"shape": name, "dtype": dt, "T": T, "config": str(c0), "off": [], "on": []}
                r["vk"] = P.bench_graph(peer) * 1e3
                ref = run(off)()
                r["eager_same"] = bool(torch.equal(run(on)(), ref))
                r["graph_same"] = bool(torch.equal(graph_bits(run(on)), ref))
                for _ in range(a.rounds):
                    for k, c in (("off", off), ("on", on)):
                        r[k].append(round(P.bench_graph(run(c)) * 1e3, 2))
                t_off, t_on = min(r["off"]), min(r["on"])
                print(f"[{time.time() - t0:5.0f}s] {name} {dt} T={T}: reduce kernel {r['off']} "
                      f"fused {r['on']} vk {r['vk']:.2f} | /vk {t_off / r['vk']:.3f} -> {t_on / r['vk']:.3f} "
                      f"bits eager={r['eager_same']} graph={r['graph_same']}", flush=True)  # fmt: skip
                rows.append(r)
        weights = q13 = q2 = s13 = s2 = w13 = w2 = None
        torch.cuda.empty_cache()
    print("\nshape    dtype  T   reduce  fused   vk     ratio: reduce  fused  bits")
    for r in rows:
        t_off, t_on = min(r["off"]), min(r["on"])
        same = r["eager_same"] and r["graph_same"]
        print(f"{r['shape']:8s} {r['dtype']:5s} {r['T']:2d} {t_off:7.2f} {t_on:7.2f} {r['vk']:7.2f}  "
              f"{t_off / r['vk']:.3f}  {t_on / r['vk']:.3f}  {same}")  # fmt: skip
    (Path(os.environ.get("OUT", ".")) / "fused_reduce_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Device script: time the decode points with whichever ``replaymoe`` is first on ``PYTHONPATH``, for an A/B
of two trees in one call (run it once per tree, alternating; compare the lines). One line per point: the
best of three graph-replay medians (µs, L2 flushed, default configuration) and the output's sum (equal
sums: the same outputs to print precision).

    git archive <commit> src | tar -x -C /tmp/old
    REPLAYMOE_PEERS=.peers PYTHONPATH=/tmp/old/src:.peers:bench python3 bench/decode_ab_probe.py old
    REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers:bench python3 bench/decode_ab_probe.py new

``--points`` is ``shape:tokens`` groups (``q``, ``m``, ``d``: Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3), each
timed in bf16 and fp8. The points and vLLM's timing come from ``bench/_decode_points.py``.
"""

import argparse

import torch
from _decode_points import bench_graph, points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag", help="printed first on every line (old / new)")
    ap.add_argument("--points", default="q:1,2,4;m:1,4;d:1,4,8")
    ap.add_argument("--dtypes", default="bf16,fp8")
    a = ap.parse_args()
    for group in a.points.split(";"):
        shape, tokens = group.split(":")
        for pt in points(shape, a.dtypes, tokens, torch.device("cuda")):
            f = pt.ours(None)
            y = f().clone()
            t = [round(bench_graph(f) * 1e3, 2) for _ in range(3)]
            s = y.float().sum().item()
            print(f"{a.tag} {pt.name} {pt.dtype} T={pt.T}: {min(t):.2f} us {t} sum={s:.6e}", flush=True)


if __name__ == "__main__":
    main()

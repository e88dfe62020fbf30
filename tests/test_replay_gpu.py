"""ReplaySource on CUDA: ids_for inside a captured CUDA graph feeding route(replay_ids=...).

Run: PYTHONPATH=src python3 -m pytest -q -m gpu tests/test_replay_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaymoe.record.replay import ReplaySource
from replaymoe.record.trace import RoutingTrace
from replaymoe.routing import RoutingMethod, route

pytestmark = pytest.mark.gpu


def test_ids_for_inside_cuda_graph():
    L, K, E, S = 4, 4, 32, 12
    rng = np.random.default_rng(7)
    ids_a = np.argsort(rng.random((10, L, E)), axis=-1)[..., :K]
    ids_a[3, 1] = -1  # one missing row
    ids_b = np.argsort(rng.random((5, L, E)), axis=-1)[..., :K]
    traces = [
        RoutingTrace(ids_a, num_experts=E, top_k=K),
        RoutingTrace(ids_b, num_experts=E, top_k=K, token_offset=2),
    ]
    src = ReplaySource(traces)
    src.prepare("cuda")
    positions = torch.tensor(
        [list(range(S)), [-1, -1] + list(range(S - 2))], dtype=torch.int64, device="cuda"
    )  # a: positions 10, 11 beyond the trace; b: left padding, 0..1 before its offset, 7..9 beyond
    logits = torch.randn(L, 2 * S, E, device="cuda")

    def step():
        return [
            route(
                logits[layer], K, RoutingMethod.RENORMALIZE, replay_ids=src.ids_for(layer, positions)
            ).topk_ids
            for layer in range(L)
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    src.reset_report()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    src.reset_report()  # capture itself does not run the kernels, but start from zero anyway
    replays = 3
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()

    native = [route(logits[layer], K, RoutingMethod.RENORMALIZE).topk_ids for layer in range(L)]
    pos = positions.cpu().numpy()
    expected_fb = np.zeros(L, dtype=np.int64)
    for layer in range(L):
        got = outs[layer].cpu().numpy().reshape(2, S, K)
        nat = native[layer].cpu().numpy().reshape(2, S, K)
        for b, t in enumerate(traces):
            for j in range(S):
                n = pos[b, j] - t.token_offset
                row = t.ids[n, layer] if pos[b, j] >= 0 and 0 <= n < t.num_tokens else None
                if row is not None and row[0] >= 0:
                    np.testing.assert_array_equal(got[b, j], row)
                else:
                    np.testing.assert_array_equal(got[b, j], nat[b, j])
                    expected_fb[layer] += pos[b, j] >= 0
    rep = src.report()
    assert rep.tokens_seen == replays * (2 * S - 2)
    np.testing.assert_array_equal(rep.fallback_tokens_per_layer, replays * expected_fb)

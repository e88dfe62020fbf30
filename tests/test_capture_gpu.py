"""RoutedExpertsCapturer on CUDA: inside a CUDA-graph-captured decode loop that calls route()
for L layers per step (ids on the host equal the ids routed), the asynchronous copy (end_step
never waits for the GPU; the copy lands while the step's stream is still busy), DP spans with
varying step sizes, and the refusal to run end_step inside graph capture.

Run: PYTHONPATH=src python3 -m pytest -q -m gpu tests/test_capture_gpu.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from replaymoe.record.capture import RoutedExpertsCapturer
from replaymoe.routing import RoutingMethod, route

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _expected_trace(records, request, length, L, K):
    """records: list of (host ids [L, rows, K] of one step, token_requests, token_positions, row0)."""
    out = np.full((length, L, K), -1, dtype=np.int16)
    for ids, reqs, poss, row0 in records:
        for i, (r, p) in enumerate(zip(reqs, poss)):
            if r == request and p < length:
                out[p] = ids[:, row0 + i, :]
    return out


def test_graph_captured_decode_loop():
    L, T, E, K, steps, R = 6, 64, 64, 8, 12, 16
    g = torch.Generator(device=DEV)
    g.manual_seed(1234)
    cap = RoutedExpertsCapturer(L, T, K, device=DEV, num_experts=E, layer_ids=list(range(1, 2 * L, 2)))
    all_logits = torch.randn(steps, L, T, E, device=DEV, generator=g)
    static = torch.empty(L, T, E, device=DEV)
    static.copy_(all_logits[0])

    def step():
        return [
            route(
                static[layer], K, RoutingMethod.RENORMALIZE, routing_replay_out=cap.layer_buffer(layer)
            ).topk_ids
            for layer in range(L)
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    torch.cuda.synchronize()

    # step 0: prefill of 16 requests x 4 tokens; request 0 hits a 4-position prefix cache
    # (computes positions 4..7). Then decode: one token per live request, padding rows None.
    alive = list(range(R))
    length = {r: (8 if r == 0 else 4) for r in range(R)}
    records, expected_dev, finished = [], [], {}
    for s in range(steps):
        static.copy_(all_logits[s])  # device-to-device, no sync
        graph.replay()
        expected_dev.append(torch.stack(outs).clone())  # what route() produced this step
        if s == 0:
            reqs = [r for r in range(R) for _ in range(4)]
            poss = [p + (4 if r == 0 else 0) for r in range(R) for p in range(4)]
        else:
            reqs = list(alive) + [None] * (T - len(alive))
            poss = [length[r] for r in alive] + [0] * (T - len(alive))
            for r in alive:
                length[r] += 1
        records.append((s, reqs, poss))
        cap.end_step(reqs, poss)
        if s == 5:
            cap.abort(3)
            alive.remove(3)
        if s == 7:  # finish while later steps are queued behind it
            finished[5] = cap.finish(5)
            alive.remove(5)
    for r in alive:
        finished[r] = cap.finish(r)
    torch.cuda.synchronize()
    host = [e.cpu().numpy() for e in expected_dev]
    recs = [(host[s], reqs, poss, 0) for s, reqs, poss in records]
    assert sorted(finished) == sorted(set(range(R)) - {3})
    for r, trace in finished.items():
        exp = _expected_trace(recs, r, length[r], L, K)
        assert trace.num_tokens == length[r], r
        np.testing.assert_array_equal(trace.ids, exp, err_msg=f"request {r}")
        assert trace.layer_ids == tuple(range(1, 2 * L, 2))
    assert (finished[0].ids[:4] == -1).all() and not finished[0].missing_mask()[4:].any()
    assert cap.live_requests == [] and cap.memory_stats()["used_page_bytes"] == 0


def test_end_step_never_waits_and_copy_overlaps_the_next_work():
    L, N, K, E = 4, 32, 2, 8
    cap = RoutedExpertsCapturer(L, N, K, device=DEV, num_experts=E)
    # warm-up: first kernel launches, event creation
    for layer in range(L):
        route(torch.randn(16, E, device=DEV), K, routing_replay_out=cap.layer_buffer(layer))
    cap.end_step(["w"] * 16, list(range(16)))
    cap.finish("w")
    torch.cuda.synchronize()
    logits = torch.randn(L, 16, E, device=DEV)
    ids = [route(logits[layer], K, routing_replay_out=cap.layer_buffer(layer)).topk_ids for layer in range(L)]
    expected = torch.stack(ids).cpu().numpy()  # synchronises; the step is done
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued before the gather
    t0 = time.perf_counter()
    cap.end_step(["a"] * 16, list(range(16)))
    enqueue_s = time.perf_counter() - t0
    assert enqueue_s < 0.02, f"end_step took {enqueue_s * 1e3:.1f} ms: it waited for the GPU"
    assert cap.pending_steps == 1
    cap.poll()
    assert cap.pending_steps == 1  # the gather sits behind the sleep: not landed, not waited for
    torch.cuda.synchronize()

    # the copy runs on the side stream while the step's stream keeps working
    logits2 = torch.randn(L, 16, E, device=DEV)
    ids2 = [
        route(logits2[layer], K, routing_replay_out=cap.layer_buffer(layer)).topk_ids for layer in range(L)
    ]
    expected2 = torch.stack(ids2).cpu().numpy()
    cap.end_step(["a"] * 16, list(range(16, 32)))
    torch.cuda._sleep(400_000_000)  # ~0.2 s queued on the step's stream after the gather
    deadline = time.perf_counter() + 5
    while cap.pending_steps and time.perf_counter() < deadline:
        cap.poll()
        time.sleep(0.001)
    assert cap.pending_steps == 0
    assert not torch.cuda.current_stream().query(), "the stream finished first: the test proves nothing"
    trace = cap.finish("a")
    np.testing.assert_array_equal(trace.ids[:16], expected.transpose(1, 0, 2))
    np.testing.assert_array_equal(trace.ids[16:], expected2.transpose(1, 0, 2))
    torch.cuda.synchronize()


def test_dp_span_and_varying_step_sizes():
    L, N, K, E = 3, 64, 4, 32
    cap = RoutedExpertsCapturer(L, N, K, device=DEV, num_experts=E, num_buffers=2)
    records = []
    # (rows routed, dp_span or None, this rank's requests, positions)
    plan = [
        (40, (10, 20), ["x"] * 12 + ["y"] * 8, list(range(12)) + list(range(8))),
        (7, (3, 2), ["x", "y"], [12, 8]),
        (5, None, ["y", None, "x", None, None], [9, 0, 13, 0, 0]),
        (64, (60, 4), ["z"] * 4, [0, 1, 2, 3]),
    ]
    for rows, span, reqs, poss in plan:
        logits = torch.randn(L, rows, E, device=DEV)
        ids = torch.stack(
            [
                route(logits[layer], K, routing_replay_out=cap.layer_buffer(layer)).topk_ids
                for layer in range(L)
            ]
        )
        records.append((ids, reqs, poss, span[0] if span else 0))
        cap.end_step(reqs, poss, dp_span=span)
    recs = [(ids.cpu().numpy(), reqs, poss, row0) for ids, reqs, poss, row0 in records]
    for r, n in (("x", 14), ("y", 10), ("z", 4)):
        np.testing.assert_array_equal(cap.finish(r).ids, _expected_trace(recs, r, n, L, K), err_msg=r)


def test_end_step_refused_inside_graph_capture():
    cap = RoutedExpertsCapturer(2, 8, 2, device=DEV, num_experts=8)
    logits = torch.randn(8, 8, device=DEV)
    route(logits, 2, routing_replay_out=cap.layer_buffer(0))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route(logits, 2, routing_replay_out=cap.layer_buffer(0))
        with pytest.raises(ValueError, match="outside CUDA-graph capture"):
            cap.end_step(["a"], [0])
    graph.replay()
    torch.cuda.synchronize()
    assert cap.pending_steps == 0 and cap.live_requests == []

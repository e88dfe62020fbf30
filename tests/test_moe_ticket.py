"""GEMM2's top-k sum in tile mode (``TICKET``: the last program to count a token sums its rows)
against the separate reduce kernel: the same bits, on every layout edge (interpreter) and at the
bench shapes on the GPU, eager, repeated (a race would show as a changed bit) and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import replaymoe.moe_triton as MT
from replaymoe.moe import fused_moe_torch
from replaymoe.moe_triton import MoEConfig, experts_triton
from replaymoe.testing import assert_close, poison


def _problem(T, H, I, E, K, g, dtype, device="cpu"):  # noqa: E741
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, generator=g)
    return tuple(t.to(device) for t in (x, w13, w2, ids, wts))


def _both(monkeypatch, x, w13, w2, ids, wts, cfg=None, offset=0):
    """(ticket, reduce kernel) outputs of the same call, each into a poisoned buffer."""
    outs = []
    for ticket in (True, False):
        monkeypatch.setattr(MT, "TICKET_ENABLED", ticket)
        out = poison(torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device))
        experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=offset,
                       out=out, config=cfg)  # fmt: skip
        outs.append(out)
    return outs


TILE16 = MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2)
TILE32 = MoEConfig(False, 32, 16, 32, 4, 2, 16, 32, 4, 2)

CASES = [
    # (T, H, I, E, K, dtype, cfg) -- edge each hits
    (6, 64, 32, 4, 2, torch.float16, TILE16),  # tokens whose slots land in different tiles
    (13, 48, 32, 3, 3, torch.float32, TILE32),  # H not a multiple of BLOCK_N2 (masked columns); half tiles
    (9, 64, 32, 4, 1, torch.float16, TILE16),  # top-1: every row completes its token at once
    (40, 32, 32, 8, 8, torch.float32, TILE16),  # top-8: eight programs count each token
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,H,I,E,K,dtype,cfg", CASES)
def test_ticket_sum_bitwise_equals_reduce_kernel(T, H, I, E, K, dtype, cfg, generator, monkeypatch):  # noqa: E741
    x, w13, w2, ids, wts = _problem(T, H, I, E, K, generator, dtype)
    ticket, reduce = _both(monkeypatch, x, w13, w2, ids, wts, cfg)
    assert torch.equal(ticket, reduce)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), topk_ids=ids, topk_weights=wts)
    assert_close(ticket, ref, dtype=dtype)


@pytest.mark.interpret
def test_ticket_ep_slice_padding_and_tokens_without_local_slots(generator, monkeypatch):
    # an EP slice: a token's count is its local slots only; a -1 padding row and a token routed only
    # to other ranks' experts get zeros (no program visits them; the output was poisoned)
    x, w13, w2, ids, wts = _problem(7, 64, 32, 6, 2, generator, torch.float32)
    ids[1] = -1
    ids[4] = torch.tensor([0, 1], dtype=torch.int32)
    ids[5] = torch.tensor([0, 3], dtype=torch.int32)  # one local slot of two
    ticket, reduce = _both(monkeypatch, x, w13[2:], w2[2:], ids, wts, TILE16, offset=2)
    assert torch.equal(ticket, reduce)
    assert (ticket[1] == 0).all() and (ticket[4] == 0).all() and (ticket[5] != 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek"])
def test_gpu_ticket_bitwise_at_bench_shapes_eager_repeated_and_graph(name, monkeypatch):
    from replaymoe.bench.moe import SHAPES, make_weights, routing_inputs

    H, I, E, K, _ = SHAPES[name]  # noqa: E741
    w13, w2, _, _ = make_weights(H, I, E, fp8=False)
    for T in (64, 1024, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        *_, ids, wts = routing_inputs(name, T)
        ticket, reduce = _both(monkeypatch, x, w13, w2, ids, wts)
        assert not MT.moe_config(T, K, H, I, E, eager=True).direct  # tile mode, where the ticket runs
        assert torch.equal(ticket, reduce), T
        monkeypatch.setattr(MT, "TICKET_ENABLED", True)
        for _ in range(5):  # the last-program choice varies from run to run; the bits must not
            again = experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0,
                                   out=None)  # fmt: skip
            assert torch.equal(again, reduce), T
        out = torch.empty_like(reduce)
        kw = dict(w13_scale=None, w2_scale=None, local_expert_offset=0, out=out)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            experts_triton(x, w13, w2, ids, wts, **kw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            experts_triton(x, w13, w2, ids, wts, **kw)
        poison(out)
        g.replay()
        g.replay()  # the counters are zeroed inside the graph, so a second replay counts afresh
        torch.cuda.synchronize()
        assert torch.equal(out, reduce), T

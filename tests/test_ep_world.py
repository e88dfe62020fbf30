"""MoeAlltoAll on gloo (CPU) at world 8, the DeepSeek-V3 deployment size, and its steady state.

One spawn of 8 ranks (spawning is the cost, so every case runs inside it). Every rank builds every
rank's inputs from one seed and checks its results exactly against the single-process references:

* dispatch/combine at ep = 8 (E = 20: ranks own 3 or 2 experts), a rank with zero tokens, skewed
  token counts sized by ``world``, with the torch packing and with the Triton kernels (interpreter);
* the steady state: calls repeating a signature (token count, runtime_max, payload dtypes/shapes)
  reuse the cached launch plan (no second validation or setup) and stay exact on fresh data; a new
  signature builds a new plan; invalid arguments are still rejected after caching; ``num_sms``
  (programs per kernel) is validated and any value gives the same results;
* ep_moe at ep = 8 against single-process ``fused_moe_torch``.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed

WORLD = 8


def _ids(g, T, K, E):
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def _check_round(a2a, rank, world, E, K, H, Ts, rt, seed):
    """One dispatch + combine with fresh data; exact comparison with the references."""
    from replaymoe.ep import combine_torch, dispatch_torch

    g = torch.Generator().manual_seed(seed)
    ids = [_ids(g, T, K, E) for T in Ts]
    pays = [
        [torch.randn(T, H, generator=g), ids[s].clone(), torch.rand(T, K, generator=g)]
        for s, T in enumerate(Ts)
    ]
    views = a2a.dispatch(ids[rank], pays[rank], rt, expert_id_payload_index=1)
    ref, counts = dispatch_torch(ids, pays, E, rt, expert_id_payload_index=1)
    assert torch.equal(a2a.recv_counts, counts[rank]), (seed, a2a.recv_counts, counts[rank])
    for s in range(world):
        n = int(counts[rank, s])
        assert torch.equal(views[0][s, :n], ref[rank][0][s, :n]), (seed, s)
        assert torch.equal(views[2][s, :n], ref[rank][2][s, :n]), (seed, s)
    assert torch.equal(views[1], ref[rank][1]), seed  # sanitized ids, padding included
    pay = views[0] * (rank + 1) + 0.5
    out = a2a.combine(pay, rt)
    expect = combine_torch([ref[r][0] * (r + 1) + 0.5 for r in range(world)], ids, E)[rank]
    assert torch.equal(out, expect), (seed, (out - expect).abs().max())


def _world_worker(rank, world):
    import torch.distributed as dist

    import replaymoe.ep.alltoall as alltoall
    from replaymoe.ep import MoeAlltoAll

    E, K, H, max_tokens = 20, 4, 16, 12
    skewed = [(12, 0, 5, 1)[s % 4] for s in range(world)]  # one entry per rank, whatever the world
    # validation and the plan cache are what this test counts (the steady state): the dispatch's
    # validation counted where MoeAlltoAll calls it (this spawned rank's module; never restored)
    calls = {"validate": 0}

    def counting(*args, _v=alltoall.validate_dispatch, _c=calls):
        _c["validate"] += 1
        return _v(*args)

    alltoall.validate_dispatch = counting
    for backend in ("torch", "triton"):
        a2a = MoeAlltoAll(None, max_tokens, K, E, H, kernel_backend=backend)
        plans = a2a.core.dispatch_plans
        calls["validate"] = 0
        # the same signature three times (fresh data each time): validated and planned once
        for i in range(3):
            _check_round(a2a, rank, world, E, K, H, skewed, 12, seed=10 + i)
        assert calls["validate"] == 1 and len(plans) == 1, (backend, calls, len(plans))
        # a new signature (other runtime_max; equal small counts) builds a second plan
        _check_round(a2a, rank, world, E, K, H, [3] * world, 4, seed=20)
        assert calls["validate"] == 2 and len(plans) == 2, backend
        # the cached signature again, now with fewer programs per kernel than tokens
        a2a.num_sms = 1
        _check_round(a2a, rank, world, E, K, H, skewed, 12, seed=30)
        a2a.num_sms = None
        assert calls["validate"] == 2, backend
        # invalid arguments after caching: still rejected before any communication
        ids = torch.zeros(skewed[rank], K, dtype=torch.int32)
        x = torch.zeros(skewed[rank], H)
        with pytest.raises(ValueError, match="dtype of token_selected_experts"):
            a2a.dispatch(ids.long(), [x, ids, x[:, :K]], 12, expert_id_payload_index=1)
        with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
            a2a.dispatch(ids, [x, ids, x[:, :K]], 13, expert_id_payload_index=1)
        with pytest.raises(ValueError, match="num_sms"):
            a2a.num_sms = 0
        # combine: a runtime_max other than the dispatch's is rejected even on a cached payload shape
        a2a.dispatch(ids, [x, ids, x[:, :K].contiguous()], 12, expert_id_payload_index=1)
        with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
            a2a.combine(torch.zeros(world, 4, H), 4)
        out = a2a.combine(torch.zeros(world, 12, H), 12)
        assert out.shape == (skewed[rank], H)
        dist.barrier()
    with pytest.raises(ValueError, match="num_sms"):
        MoeAlltoAll(None, 4, K, E, H, num_sms=-1)

    # ep_moe at world 8 against the single-process reference
    from replaymoe.ep import ep_moe, expert_partition
    from replaymoe.moe import fused_moe_torch
    from replaymoe.routing import RoutingMethod
    from replaymoe.testing import assert_close, tie_free_logits

    g = torch.Generator().manual_seed(3)
    E, K, H, I = 16, 4, 32, 16  # noqa: E741
    Ts = [(5, 0, 7, 2)[s % 4] for s in range(world)]  # rank 1 (and 5) with zero tokens
    xs = [torch.randn(T, H, generator=g) for T in Ts]
    logits = [tie_free_logits(T, E, generator=g) for T in Ts]
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    kw = {"method": RoutingMethod.DEEPSEEK_V3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    a2a = MoeAlltoAll(None, 8, K, E, H)
    lo, n = expert_partition(E, world)[rank]
    for _ in range(2):  # the second call runs on the cached plan
        out = ep_moe(xs[rank], logits[rank], w13[lo : lo + n], w2[lo : lo + n], a2a, top_k=K, **kw)
        expect = fused_moe_torch(xs[rank], w13, w2, router_logits=logits[rank], top_k=K, **kw)
        assert out.shape == (Ts[rank], H)
        assert_close(out, expect, name=f"ep_moe world {world} rank {rank}")
    dist.barrier()


def test_ep_gloo_world8():
    """Dispatch/combine (torch and Triton-interpreter packing), the steady-state plan cache, num_sms,
    rejections after caching, and ep_moe — at world 8 on gloo."""
    run_distributed(_world_worker, WORLD, timeout_s=120)

"""MoeAlltoAll dispatch/combine and ep_moe on gloo (CPU) in spawned processes.

Spawning is slow, so each test spawns once (4 ranks) and runs many cases inside, over sub-groups
of sizes 1, 2, 3 and 4 of the same world. Every rank builds every rank's inputs from one seed, so
the single-process references (``dispatch_torch``, ``combine_torch``, ``fused_moe_torch``) can be
evaluated locally and compared exactly (integers, copies) or by dtype tolerance (MoE math).
"""

from __future__ import annotations

import time

import pytest
import torch

from _dist import run_distributed

WORLD = 4
# (ep, E): E divisible by ep and not (ep=3, E=10: ranks own 4, 3, 3 experts; ep=4, E=6: 2, 2, 1, 1)
EP_E = [(1, 8), (2, 8), (3, 10), (4, 16), (4, 6)]


def _groups(rank):
    import torch.distributed as dist

    groups = {WORLD: dist.group.WORLD}
    for n in range(1, WORLD):
        groups[n] = dist.new_group(list(range(n)))  # every rank calls new_group for every group
    return groups


def _bytes(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.shape, dtype=t.dtype)  # (contiguous() keeps odd strides of size-1 dims)
    fresh.copy_(t)
    return fresh.view(torch.uint8)


def _make_ids(g, T, K, E, ep, pattern, src_rank):
    from replaymoe.ep import expert_partition

    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    if pattern == "skewed":
        # every token to the experts of one rank (the last); slots beyond its experts are -1 (not sent)
        lo, n = expert_partition(E, ep)[ep - 1]
        rows = []
        for _ in range(T):
            sel = (torch.randperm(n, generator=g)[: min(K, n)] + lo).tolist()
            rows.append(sel + [-1] * (K - len(sel)))
        return torch.tensor(rows, dtype=torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def _make_payloads(g, T, K, ids):
    return [
        torch.randn(T, 24, generator=g),  # hidden fp32
        torch.randn(T, 8, generator=g).to(torch.bfloat16),  # hidden bf16
        ids.clone(),  # topk ids int32 (sanitized)
        torch.rand(T, K, generator=g),  # topk weights fp32
        (torch.randn(T, 3, generator=g) * 50).to(torch.float8_e4m3fn),  # fp8 data, 3 bytes per token
        torch.rand(T, 2, generator=g) + 0.5,  # fp32 scales
        torch.randint(-(2**40), 2**40, (T,), generator=g),  # int64, 1-D payload
    ]


def _dispatch_combine_worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, combine_torch, dispatch_torch
    from replaymoe.testing import poison

    groups = _groups(rank)
    n_cases = 0
    for ep, E in EP_E:
        for K in (1, 2, 4, 8):
            if K > E:
                continue
            # skewed / zero-token patterns at K = 2 and 8 only (spawned CPU time is the budget)
            for pattern in ("random", "skewed", "zero_rank") if K in (2, 8) else ("random",):
                # the Triton packing/reduction kernels (interpreted: slow) in one configuration
                interp = (ep, E, K, pattern) == (3, 10, 2, "random")
                for kernel_backend in ("torch", "triton") if interp else ("torch",):
                    g = torch.Generator().manual_seed(1000 * ep + 10 * K + len(pattern))
                    max_tokens = 6
                    if rank >= ep:
                        continue
                    a2a = MoeAlltoAll(groups[ep], max_tokens, K, E, 24, kernel_backend=kernel_backend)
                    for rnd, rt in enumerate((6, 4)):  # two rounds: stale rows of round 0 must not leak
                        Ts = torch.randint(0, rt + 1, (ep,), generator=g).tolist()
                        if pattern == "zero_rank":
                            Ts[ep - 1] = 0
                        ids = [_make_ids(g, Ts[s], K, E, ep, pattern, s) for s in range(ep)]
                        pays = [_make_payloads(g, Ts[s], K, ids[s]) for s in range(ep)]
                        if rnd == 0:
                            from replaymoe.ep.packing import row_layout

                            # the receive buffer (the transport's, through the shared state): poisoned
                            # so that rows the dispatch does not write show
                            a2a.core.transport.ensure_dispatch(row_layout(pays[rank]).row_bytes)
                            poison(a2a.core.transport.recv)
                        views = a2a.dispatch(ids[rank], pays[rank], rt, expert_id_payload_index=2)
                        ref, counts = dispatch_torch(ids, pays, E, rt, expert_id_payload_index=2)
                        ctx = f"ep={ep} E={E} K={K} {pattern} {kernel_backend} round {rnd} rank {rank}"
                        assert torch.equal(a2a.recv_counts, counts[rank]), (
                            ctx,
                            a2a.recv_counts,
                            counts[rank],
                        )
                        for p, (v, r) in enumerate(zip(views, ref[rank])):
                            assert v.shape == (ep, rt, *pays[rank][p].shape[1:]), ctx
                            for s in range(ep):
                                c = int(counts[rank, s])
                                assert torch.equal(_bytes(v[s, :c]), _bytes(r[s, :c])), (ctx, p, s)
                        # the id payload entirely (padding rows and remote experts = -1)
                        assert torch.equal(views[2], ref[rank][2]), (ctx, views[2], ref[rank][2])
                        # combine: each rank returns f(row) for the rows it received; padding is NaN
                        pay = (views[0] * (rank + 1) + rank).float()
                        for s in range(ep):
                            pay[s, int(counts[rank, s]) :] = float("nan")
                        all_pays = []
                        for r in range(ep):
                            x = ref[r][0] * (r + 1) + r
                            all_pays.append(x)
                        expect = combine_torch(all_pays, ids, E)[rank]
                        if rnd == 0:
                            out = a2a.combine(pay.contiguous(), rt)  # contiguous payload (staged)
                        else:  # the padded [ep, rt + 1, H] layout ep_moe uses (sent as it is)
                            big = torch.full((ep, rt + 1, 24), float("nan"))
                            big[:, :rt] = pay
                            out = a2a.combine(big[:, :rt], rt)
                        assert out.shape == (Ts[rank], 24) and out.dtype == torch.float32, ctx
                        assert torch.equal(out, expect), (ctx, (out - expect).abs().max())
                        n_cases += 1
                    # bf16 combine payload and a custom invalid id
                    rt = 5
                    Ts = [min(3 + s, rt) for s in range(ep)]
                    ids = [_make_ids(g, Ts[s], K, E, ep, "random", s) for s in range(ep)]
                    hid = [torch.randn(Ts[s], 24, generator=g).to(torch.bfloat16) for s in range(ep)]
                    views = a2a.dispatch(
                        ids[rank],
                        [hid[rank], ids[rank]],
                        rt,
                        invalid_token_expert_id=-7,
                        expert_id_payload_index=1,
                    )
                    ref, counts = dispatch_torch(
                        ids,
                        [[h, i] for h, i in zip(hid, ids)],
                        E,
                        rt,
                        invalid_token_expert_id=-7,
                        expert_id_payload_index=1,
                    )
                    assert torch.equal(views[1], ref[rank][1])
                    out = a2a.combine(views[0] * 2, rt)
                    expect = combine_torch([ref[r][0] * 2 for r in range(ep)], ids, E)[rank]
                    assert out.dtype == torch.bfloat16 and torch.equal(out, expect)
    dist.barrier()
    if rank == 0:
        assert n_cases >= 60, n_cases


def test_dispatch_combine_gloo():
    """Dispatch invariants exactly and combine against the per-token sum: ep 1-4, E divisible or not,
    top_k 1/2/4/8, random / skewed (-1 padded) / one rank with zero tokens, 7 mixed-dtype payloads,
    two rounds with different runtime_max, both combine payload layouts, Triton packing under the
    interpreter for one configuration."""
    run_distributed(_dispatch_combine_worker, WORLD)


# ----------------------------------------------------------------------------------------------


def _moe_worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, ep_moe, expert_partition
    from replaymoe.moe import fused_moe_torch
    from replaymoe.moe.quant import quantize_fp8_block
    from replaymoe.routing import RoutingConfig, RoutingMethod
    from replaymoe.testing import assert_close, tie_free_logits

    groups = _groups(rank)
    cases = [
        # (ep, E, K, method kwargs, dtype, fp8)
        (1, 8, 2, {"method": RoutingMethod.RENORMALIZE}, torch.float32, False),
        (
            2,
            8,
            4,
            {
                "method": RoutingMethod.DEEPSEEK_V3,
                "n_group": 2,
                "topk_group": 1,
                "routed_scaling_factor": 2.5,
            },
            torch.float32,
            False,
        ),  # noqa: E501
        (3, 10, 2, {"method": RoutingMethod.RENORMALIZE}, torch.float32, False),
        (3, 10, 8, {"method": RoutingMethod.SIGMOID_RENORM}, torch.float32, False),
        (4, 16, 8, {"method": RoutingMethod.RENORMALIZE}, torch.float32, False),
        (4, 6, 1, {"method": RoutingMethod.RENORMALIZE}, torch.bfloat16, False),
        (2, 4, 2, {"method": RoutingMethod.RENORMALIZE}, torch.bfloat16, True),
    ]
    for ep, E, K, kw, dtype, fp8 in cases:
        g = torch.Generator().manual_seed(7 * ep + E + K)
        H, I = (128, 128) if fp8 else (32, 16)  # noqa: E741
        max_tokens = 7
        Ts = torch.randint(1, max_tokens + 1, (ep,), generator=g).tolist()
        Ts[-1] = 0 if ep > 1 else Ts[-1]  # a rank with zero tokens takes part
        xs = [torch.randn(T, H, generator=g).to(dtype) for T in Ts]
        logits = [tie_free_logits(T, E, generator=g) for T in Ts]
        w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
        scales = {}
        if fp8:
            w13, s13 = quantize_fp8_block(w13.float())
            w2, s2 = quantize_fp8_block(w2.float())
            scales = {"w13_scale": s13, "w2_scale": s2}
        replay = [
            torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            if T
            else torch.zeros(0, K, dtype=torch.int64)
            for T in Ts
        ]
        if rank >= ep:
            continue
        a2a = MoeAlltoAll(groups[ep], max_tokens, K, E, H)
        lo, n = expert_partition(E, ep)[rank]
        loc = {k: v[lo : lo + n] for k, v in scales.items()}
        T = Ts[rank]
        ctx = f"ep={ep} E={E} K={K} {kw['method'].name} {dtype} fp8={fp8} rank {rank}"
        cap = torch.full((max_tokens, K), -5, dtype=torch.int16)
        out = ep_moe(
            xs[rank],
            logits[rank],
            w13[lo : lo + n],
            w2[lo : lo + n],
            a2a,
            top_k=K,
            routing_replay_out=cap,
            **kw,
            **loc,
        )
        expect = fused_moe_torch(
            xs[rank],
            w13,
            w2,
            router_logits=logits[rank],
            top_k=K,
            routing_replay_out=(cap_ref := torch.full((max_tokens, K), -5, dtype=torch.int16)),
            **kw,
            **scales,
        )
        assert out.shape == (T, H) and out.dtype == expect.dtype, ctx
        assert_close(out, expect, name=ctx)
        assert torch.equal(cap, cap_ref), ctx  # capture through ep_moe = single-device capture
        # replay: forced ids, weights recomputed from the logits
        out = ep_moe(
            xs[rank],
            logits[rank],
            w13[lo : lo + n],
            w2[lo : lo + n],
            a2a,
            routing=RoutingConfig(K, **kw),  # the routing as one object (the keywords above fold into it)
            replay_ids=replay[rank],
            runtime_max_tokens_per_rank=max(Ts),
            **loc,
        )
        expect = fused_moe_torch(
            xs[rank], w13, w2, router_logits=logits[rank], top_k=K, replay_ids=replay[rank], **kw, **scales
        )
        assert_close(out, expect, name=ctx + " replay")
    dist.barrier()


def test_ep_moe_gloo():
    """ep_moe equals single-process fused_moe_torch on the full weights (fp32, bf16, fp8 block
    scale; ep 1-4, E=10 on 3 ranks; DeepSeek-V3 / renormalize / sigmoid routing), with a zero-token
    rank, capture (routing_replay_out identical) and replay through it."""
    run_distributed(_moe_worker, WORLD)


# ----------------------------------------------------------------------------------------------


def _fused_plan_worker(rank, world):
    import torch.distributed as dist

    E, K, H = 8, 2, 8
    for Ts, rt, num_sms in (
        ([4, 3], 5, None),  # small T, num_sms unset: the dense grid, the pack's scan
        ([300, 4], 300, None),  # rank 0: > 256 tokens, num_sms unset: the wide grid, the look-back (3 blocks)
        ([300, 260], 300, 2),  # a persistent grid: the pack's look-back (3 / 3 blocks)
        ([0, 5], 5, 2),  # no tokens on rank 0, a persistent grid: its look-back still writes zero counts
    ):
        _fused_plan_case(rank, world, E, K, H, Ts, rt, num_sms)
    dist.barrier()


def _fused_plan_case(rank, world, E, K, H, Ts, rt, num_sms):
    import dataclasses

    from replaymoe import _switches
    from replaymoe.ep import MoeAlltoAll, combine_torch, dispatch_torch

    g = torch.Generator().manual_seed(7)
    ids = [_make_ids(g, Ts[s], K, E, world, "random", s) for s in range(world)]
    # 4-byte payloads only (int32 units): the first pack group may compute the plan itself
    pays = [[torch.randn(Ts[s], H, generator=g), ids[s].clone(), torch.rand(Ts[s], K, generator=g)]
            for s in range(world)]  # fmt: skip
    ref, counts = dispatch_torch(ids, pays, E, rt, expert_id_payload_index=1)
    got = {}
    for fused in (True, False):
        # the process default (this spawned rank's; REPLAYMOE_EP_FUSED), overridden by the argument
        _switches.DEFAULTS = dataclasses.replace(_switches.DEFAULTS, ep_fused=not fused)
        a2a = MoeAlltoAll(None, rt, K, E, H, kernel_backend="triton", fused_plan=fused, num_sms=num_sms)
        assert a2a.fused_plan is fused
        views = a2a.dispatch(ids[rank], pays[rank], rt, expert_id_payload_index=1)
        # which launch plan the dispatch took (the scan on the dense grid, the look-back on the persistent
        # ones): the dispatch in flight, in the shared state
        assert a2a.core.in_flight.fused_plan is (fused and Ts[rank] <= 256)
        assert a2a.core.in_flight.lookback is fused
        grid = a2a.core.pack_grid(Ts[rank])
        assert grid == ("narrow" if num_sms else "dense" if Ts[rank] <= 256 else "wide")
        assert torch.equal(a2a.recv_counts, counts[rank])
        for v, r in zip(views, ref[rank]):
            for s in range(world):
                c = int(counts[rank, s])
                assert torch.equal(_bytes(v[s, :c]), _bytes(r[s, :c])), (fused, s)
        assert torch.equal(views[1], ref[rank][1])
        slots = a2a.send_counts.clone()
        out = a2a.combine((views[0] * (rank + 1)).contiguous(), rt)
        got[fused] = (a2a.recv_counts.clone(), slots, out)
    expect = combine_torch([ref[r][0] * (r + 1) for r in range(world)], ids, E)[rank]
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)  # the same bits either way
    assert torch.equal(got[True][2], expect)


@pytest.mark.interpret
def test_fused_plan_argument_same_results_gloo():
    """MoeAlltoAll(fused_plan=True / False) with the Triton packing (interpreter): the pack kernel
    computes the plan or the plan kernel does, against the opposite process default; identical
    receive views, counts and combined outputs."""
    run_distributed(_fused_plan_worker, 2)


def _errors_worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, ep_moe
    from replaymoe.routing import RoutingConfig

    E, K, H = 8, 2, 16
    with pytest.raises(ValueError, match="num_experts"):
        MoeAlltoAll(None, 4, K, 1, H)
    with pytest.raises(ValueError, match="transport"):
        MoeAlltoAll(None, 4, K, E, H, transport="mpi")
    with pytest.raises(ValueError, match="transport"):
        MoeAlltoAll(None, 4, K, E, H, transport="symm")  # CPU device
    with pytest.raises(ValueError, match="timeout"):
        MoeAlltoAll(None, 4, K, E, H, timeout=-1)
    import datetime

    with pytest.raises(ValueError, match="timeout"):  # a negative timedelta as a negative number
        MoeAlltoAll(None, 4, K, E, H, timeout=datetime.timedelta(seconds=-5))
    with pytest.raises(ValueError, match="type of group"):  # a name is no process group
        MoeAlltoAll("world", 4, K, E, H)
    with pytest.raises(ValueError, match="device"):  # no transport on the meta device
        MoeAlltoAll(None, 4, K, E, H, device="meta")
    from replaymoe.ep import expert_owner

    with pytest.raises(ValueError, match="dtype of ids"):  # float ids were truncated
        expert_owner(torch.tensor([[0.9, 3.7]]), E, 2)
    with pytest.raises(ValueError, match="num_experts"):  # more ranks than experts: ZeroDivisionError
        expert_owner(torch.tensor([[0, 1]]), 2, 3)
    with pytest.raises(ValueError, match="top_k"):
        MoeAlltoAll(None, 4, 9, E, H)
    with pytest.raises(ValueError, match="type of fused_plan"):
        MoeAlltoAll(None, 4, K, E, H, fused_plan=1)
    with pytest.raises(ValueError, match="type of fused_barrier"):
        MoeAlltoAll(None, 4, K, E, H, fused_barrier="off")
    with pytest.raises(ValueError, match="type of pipelined_combine"):
        MoeAlltoAll(None, 4, K, E, H, pipelined_combine="on")
    # the nccl transport never pipelines its combine (symm only), whatever the argument
    a = MoeAlltoAll(None, 4, K, E, H, num_sms=8, pipelined_combine=True)
    assert a.pipelined_combine is True and a.combine_pipelines(4) is False
    from replaymoe import _switches

    # None: the process default (REPLAYMOE_EP_FUSED, _switches.DEFAULTS.ep_fused; the barrier's is
    # resolved by the symm transport, so nccl keeps what it was given)
    assert MoeAlltoAll(None, 4, K, E, H).fused_plan is _switches.DEFAULTS.ep_fused
    assert MoeAlltoAll(None, 4, K, E, H).fused_barrier is None
    for v in (False, True):
        b = MoeAlltoAll(None, 4, K, E, H, fused_plan=v, fused_barrier=v)
        assert b.fused_plan is v and b.fused_barrier is v
    a2a = MoeAlltoAll(None, 4, K, E, H)
    ids = torch.tensor([[0, 5], [7, 1]], dtype=torch.int32)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="before dispatch"):
        a2a.combine(torch.zeros(2, 4, H), 4)
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
        a2a.dispatch(ids, [x], 5)  # above the construction max
    with pytest.raises(ValueError, match="token_selected_experts"):
        a2a.dispatch(ids, [x], 1)  # T_local above runtime_max
    with pytest.raises(ValueError, match="dtype of token_selected_experts"):
        a2a.dispatch(ids.long(), [x], 4)
    with pytest.raises(ValueError, match="shape of token_selected_experts"):
        a2a.dispatch(ids[:, :1], [x], 4)
    with pytest.raises(ValueError, match=r"payloads\[1\]"):
        a2a.dispatch(ids, [x, x[:1]], 4)
    with pytest.raises(ValueError, match="payloads"):
        a2a.dispatch(ids, [], 4)
    with pytest.raises(ValueError, match=r"payloads\[0\]"):
        a2a.dispatch(ids, [x], 4, expert_id_payload_index=0)  # not an int32 [T, K] payload
    with pytest.raises(ValueError, match="expert_id_payload_index"):
        a2a.dispatch(ids, [x], 4, expert_id_payload_index=3)
    # none of the above entered a collective: the ranks are still in lockstep
    a2a.dispatch(ids, [x], 4)
    with pytest.raises(RuntimeError, match="twice"):
        a2a.dispatch(ids, [x], 4)
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
        a2a.combine(torch.zeros(2, 3, H), 3)  # not the dispatch's runtime_max
    with pytest.raises(ValueError, match="shape of payload"):
        a2a.combine(torch.zeros(2, 4, H + 1), 4)
    with pytest.raises(ValueError, match="dtype of payload"):
        a2a.combine(torch.zeros(2, 4, H, dtype=torch.int32), 4)
    out = a2a.combine(torch.zeros(2, 4, H), 4)
    assert out.shape == (2, H)
    w13 = torch.randn(4, 8, H)
    w2 = torch.randn(4, H, 4)
    logits = torch.randn(2, E)
    with pytest.raises(ValueError, match="top_k"):
        ep_moe(x, logits, w13, w2, a2a, top_k=3)
    with pytest.raises(ValueError, match="top_k.*not given together with routing"):
        ep_moe(x, logits, w13, w2, a2a, top_k=K, routing=RoutingConfig(K))
    with pytest.raises(ValueError, match="w13_local"):
        ep_moe(x, logits, w13[:3], w2, a2a, top_k=K)
    with pytest.raises(ValueError, match="router_logits"):
        ep_moe(x, logits[:, :7], w13, w2, a2a, top_k=K)
    # the local experts' arguments, under ep_moe's names, before routing writes routing_replay_out or
    # dispatch starts a collective (a late error left the all-to-all between dispatch and combine)
    cap = torch.full((4, K), -1, dtype=torch.int16)
    fp8w = (
        torch.zeros(4, 256, 128).to(torch.float8_e4m3fn),
        torch.zeros(4, 128, 128).to(torch.float8_e4m3fn),
    )
    for args, kw, match in [
        ((x, logits, w13, torch.randn(4, H, 5)), {}, r"shape of w2_local"),  # I of w2 != w13's
        ((x, logits, torch.randn(4, 8, H + 1), w2), {}, r"shape of w13_local"),  # H of w13 != hidden's
        ((x, logits, w13, w2.half()), {}, r"dtype of w2_local"),  # another dtype than hidden_states
        (
            (x.double(), logits, w13.double(), w2.double()),
            {},
            r"dtype of hidden_states",
        ),  # fp64: torch ref only
        ((x, logits, w13, w2), dict(w13_scale=torch.ones(4, 2, 1)), r"w2_scale"),  # one scale of two
        ((x, logits, w13, w2), dict(runtime_max_tokens_per_rank=1), "runtime_max_tokens_per_rank"),  # < T
        (
            (torch.randn(2, 128, requires_grad=True), torch.randn(2, E), *fp8w),  # fp8 is inference-only
            dict(w13_scale=torch.ones(4, 2, 1), w2_scale=torch.ones(4, 1, 1)),
            r"w13_scale.*gradients",
        ),
    ]:
        a = a2a if args[0].shape[1] == H else MoeAlltoAll(None, 4, K, E, 128)
        with pytest.raises(ValueError, match=match):
            ep_moe(*args, a, top_k=K, routing_replay_out=cap, **kw)
        assert (cap == -1).all() and a.core.phase == "idle"  # nothing written, nothing dispatched
    # caller ids: ep_moe takes replay_ids (no topk_ids), global in [0, E = 8) of the whole model; route
    # rejects bad ones before any collective, naming replay_ids and the row
    rng = r"replay_ids: expected expert ids in \[0, 8\) \(or a row of all -1\)"
    for rows, match in [
        ([[0, 10**6], [7, 1]], rng + r", got row 0 = \[0, 1000000\]"),  # out of range high
        ([[0, 5], [-3, 1]], rng + r", got row 1 = \[-3, 1\]"),  # negative
        ([[0, 5], [7, 8]], rng + r", got row 1 = \[7, 8\]"),  # E itself (rank 1's slice ends at 8)
        ([[0, -1], [7, 1]], r"replay_ids: expected each row either all -1"),  # -1 mixed into a row
        ([[5, 5], [7, 1]], r"replay_ids: expected distinct expert ids within each row, got row 0 = \[5, 5\]"),
    ]:
        for dt in (torch.int32, torch.int64):
            with pytest.raises(ValueError, match=match):
                ep_moe(x, logits, w13, w2, a2a, top_k=K, replay_ids=torch.tensor(rows, dtype=dt))
    with pytest.raises(ValueError, match="type of check_ids"):
        ep_moe(x, logits, w13, w2, a2a, top_k=K, check_ids=1)
    # valid replay ids, some of the other rank's experts (legal: that rank computes them): checked once
    # (route's check; the local fused_moe gets route's ids and skips it), or not at all with
    # check_ids=False, the same bits either way
    import replaymoe.routing._checks as checks

    real, calls = checks.check_id_values, []
    checks.check_id_values = lambda *a, **k: (calls.append(k.get("minus_one", "rows")), real(*a, **k))[1]
    try:
        replay = torch.tensor([[0, 5], [7, 1]], dtype=torch.int64)
        on = ep_moe(x, logits, w13, w2, a2a, top_k=K, replay_ids=replay)
        assert calls == ["rows"], calls
        off = ep_moe(x, logits, w13, w2, a2a, top_k=K, replay_ids=replay, check_ids=False)
        assert calls == ["rows"], calls
        plain = ep_moe(x, logits, w13, w2, a2a, top_k=K)  # no caller ids: no value check at all
        assert calls == ["rows"] and torch.equal(on, off) and on.shape == plain.shape == (2, H), calls
    finally:
        checks.check_id_values = real
    dist.barrier()
    # a peer that never arrives: a timeout error naming this rank, not a hang
    t = MoeAlltoAll(None, 4, K, E, H, timeout=5.0)  # (sub-group created right after a barrier)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 of 2"):
            t.dispatch(ids, [x], 4)
        assert time.monotonic() - start < 30
    else:
        time.sleep(8.0)
    dist.barrier()
    only_rank1 = dist.new_group([1])  # collective: every rank creates it
    if rank == 0:
        with pytest.raises(ValueError, match="group"):
            MoeAlltoAll(only_rank1, 4, K, E, H)  # a group this rank is not in
    dist.barrier()


def test_errors_gloo():
    """Rejections raise ValueError/RuntimeError on the calling rank before any collective (the ranks
    stay in lockstep afterwards), bad replay ids of ep_moe included (checked once, by route; not with
    check_ids=False); a missing peer raises a timeout error naming the rank."""
    run_distributed(_errors_worker, 2)

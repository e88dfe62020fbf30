"""MoeAlltoAll and ep_moe on 2 and 4 GPUs with NCCL (one spawned process per GPU).

Run: ``PYTHONPATH=src python3 -m pytest -m multigpu tests/test_ep_multigpu.py`` (scripts/gpu_ep.sh
does, with NVLink multicast disabled). Checks: the ``nccl`` and ``symm`` transports against each
other (bit-identical) and against the single-process references, many back-to-back rounds without a
host sync in between (buffer-reuse hazards), ep_moe against single-GPU fused_moe on the full
weights, and CUDA-graph capture of dispatch + combine with the nccl transport.
"""

from __future__ import annotations

import os

import pytest
import torch

from _dist import run_distributed

pytestmark = pytest.mark.multigpu

_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)


def _ids(g, T, K, E):
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    return torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.shape, dtype=t.dtype)  # CPU, contiguous (size-1 dims keep odd strides otherwise)
    fresh.copy_(t)
    return fresh.view(torch.uint8)


def _transports_worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, combine_torch, dispatch_torch

    dev = torch.device("cuda", rank)
    E, K, H, max_tokens = 64, 8, 1024, 1024
    # symm with a barrier timeout: a lost signal traps (naming both ranks) instead of hanging;
    # symm_unfused: torch's barrier kernel and the plan kernel by argument (the same bits)
    symm = dict(transport="symm", timeout=60)
    # symm: the defaults (dense grids; the combine by size: one object switches between the two-kernel
    # combine, runtime_max 128 and below, and the pipelined launch on every SM, 256, from call to call);
    # symm_2k: always the two kernels; symm_pipe: 4 programs per kernel and always the pipelined launch
    # (2 senders, 2 reducers: several chunks per sender and per reducer at the larger sizes); symm_auto:
    # 4 programs, by size
    kinds = {"nccl": dict(transport="nccl"), "symm": symm,
             "symm_2k": dict(symm, pipelined_combine=False),
             "symm_unfused": dict(symm, fused_barrier=False, fused_plan=False),
             "symm_pipe": dict(symm, num_sms=4, pipelined_combine=True),
             "symm_auto": dict(symm, num_sms=4)}  # fmt: skip
    a2a = {t: MoeAlltoAll(None, max_tokens, K, E, H, **kw) for t, kw in kinds.items()}
    assert a2a["symm_unfused"].fused_barrier is False and a2a["symm_unfused"].fused_plan is False
    assert a2a["symm_pipe"].combine_pipelines(1) and not a2a["symm_2k"].combine_pipelines(max_tokens)
    for t in ("symm", "symm_auto"):  # eager: the one launch at every size (the graph worker captures)
        assert a2a[t].combine_pipelines(256) and a2a[t].combine_pipelines(128), t
    g = torch.Generator().manual_seed(11)
    # --- exactness over several shapes: T per rank incl. 0, skew, fp8 + scales payloads
    for case, (Ts, rt) in enumerate(
        [
            ([5] * world, 8),  # equal small counts
            ([0] + [7] * (world - 1), 7),  # rank 0 sends nothing and receives nothing
            ([(200, 3, 256, 1)[s % 4] for s in range(world)], 256),  # skewed, one rank at the max (any world)
            ([1] * world, 1),  # runtime_max 1
            # > 256 tokens: the pack's look-back plan (8 / 5 / 3 blocks of 128), a rank without tokens
            ([(1000, 0, 513, 257)[s % 4] for s in range(world)], 1000),
        ]
    ):
        ids = [_ids(g, T, K, E) for T in Ts]
        if case == 1:
            ids = [torch.where(i < E // world, i + E // world, i) for i in ids]  # nothing to rank 0
        pays = [
            [
                torch.randn(T, H, generator=g).to(torch.bfloat16),
                (torch.randn(T, H, generator=g) * 10).to(torch.float8_e4m3fn),
                torch.rand(T, H // 128, generator=g),
                ids[s].clone(),
                torch.rand(T, K, generator=g),
            ]
            for s, T in enumerate(Ts)
        ]
        ref, counts = dispatch_torch(ids, pays, E, rt, expert_id_payload_index=3)
        outs = {}
        for t, a in a2a.items():
            views = a.dispatch(
                ids[rank].to(dev), [p.to(dev) for p in pays[rank]], rt, expert_id_payload_index=3
            )
            assert torch.equal(a.recv_counts.cpu(), counts[rank]), (t, case)
            for p, v in enumerate(views):
                for s in range(world):
                    n = int(counts[rank, s])
                    assert torch.equal(_bytes(v[s, :n]), _bytes(ref[rank][p][s, :n])), (t, case, p, s)
            assert torch.equal(views[3].cpu(), ref[rank][3]), (t, case)
            pay = views[0].float() * (rank + 1)
            outs[t] = a.combine(pay.to(torch.bfloat16), rt)
        expect = combine_torch(
            [(ref[r][0].float() * (r + 1)).to(torch.bfloat16) for r in range(world)], ids, E
        )
        assert all(torch.equal(outs["nccl"], o) for o in outs.values()), case
        torch.testing.assert_close(outs["nccl"].cpu(), expect[rank], atol=0, rtol=0)
    # --- steady state: one signature repeated with fresh data (the cached plan and the direct
    # launches of the compiled kernels), then with fewer programs per kernel than tokens (num_sms)
    from replaymoe.ep import expert_owner

    Ts = [(96, 0, 33, 5)[s % 4] for s in range(world)]
    for t, a in a2a.items():
        base = a.num_sms
        for it, n_sms in enumerate((base, base, base, 3)):
            a.num_sms = n_sms
            gi = torch.Generator().manual_seed(500 + it)
            all_ids = [_ids(gi, T, K, E) for T in Ts]
            x = torch.randn(Ts[rank], H, generator=torch.Generator().manual_seed(50 * it + rank))
            x = x.to(torch.bfloat16)
            views = a.dispatch(all_ids[rank].to(dev), [x.to(dev), all_ids[rank].to(dev)], 96,
                               expert_id_payload_index=1)  # fmt: skip
            out = a.combine(views[0] * 2, 96)
            owners = expert_owner(all_ids[rank], E, world)
            n_dest = torch.stack([(owners == r).any(1) for r in range(world)], 1).sum(1)
            expect = (x.float() * 2 * n_dest[:, None]).to(torch.bfloat16)
            assert torch.equal(out.cpu(), expect), (t, it, n_sms)
        a.num_sms = base
        assert len(a.core.dispatch_plans) >= 1  # the steady-state plan cache is what is checked
    # --- back-to-back rounds, no host sync in between (buffer reuse), then check every round; the
    # runtime_max alternates between 128 and 256, and symm_auto alternates between its two combines
    # (forced from call to call through the shared state, core.pipelined_combine: eager calls pipeline at
    # every size)

    rounds = []
    for it in range(12):
        gi = torch.Generator().manual_seed(100 + it)
        all_ids = [_ids(gi, (it * 37 + s * 11) % 129, K, E) for s in range(world)]
        T = all_ids[rank].shape[0]
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(1000 * it + rank)).to(torch.bfloat16)
        rounds.append((x, all_ids[rank], x.to(dev), all_ids[rank].to(dev), (128, 256)[it % 2]))
    torch.cuda.synchronize()
    for t, a in a2a.items():
        results = []
        for i, (_, _, xd, idd, rt) in enumerate(rounds):  # launches only: the ranks race ahead of each other
            if t == "symm_auto":
                a.core.pipelined_combine = i % 2 == 0
            views = a.dispatch(idd, [xd], rt)
            results.append(a.combine(views[0] * 2, rt))  # out = 2 * x * (number of ranks sent to)
        torch.cuda.synchronize()
        for it, (out, (x, ids, *_)) in enumerate(zip(results, rounds)):
            if len(ids) == 0:
                assert out.shape == (0, H)
                continue
            owners = expert_owner(ids, E, world)
            n_dest = torch.stack([(owners == r).any(1) for r in range(world)], 1).sum(1)
            expect = (x.float() * 2 * n_dest[:, None]).to(torch.bfloat16)
            assert torch.equal(out.cpu(), expect), (t, it)
    dist.barrier()


def _moe_worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, ep_moe, expert_partition
    from replaymoe.moe import fused_moe
    from replaymoe.routing import RoutingMethod
    from replaymoe.testing import assert_close, tie_free_logits

    dev = torch.device("cuda", rank)
    E, K, H, I, max_tokens = 32, 4, 512, 256, 64  # noqa: E741
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).to(dev)
    lo, n = expert_partition(E, world)[rank]
    kw = {"method": RoutingMethod.DEEPSEEK_V3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    outs = {}
    for t in ("nccl", "symm"):
        a2a = MoeAlltoAll(None, max_tokens, K, E, H, transport=t, timeout=60 if t == "symm" else None)
        for T in (0 if rank == world - 1 else 9, 64):
            gi = torch.Generator().manual_seed(1000 + 10 * rank + T)
            x = torch.randn(T, H, generator=gi).to(torch.bfloat16).to(dev)
            logits = tie_free_logits(T, E, generator=gi).to(dev)
            out = ep_moe(x, logits, w13[lo : lo + n], w2[lo : lo + n], a2a, top_k=K, **kw)
            ref = fused_moe(x, w13, w2, router_logits=logits, top_k=K, **kw)
            assert_close(out, ref, name=f"{t} T={T} rank {rank}")
            outs[(t, T)] = out
    for T in (0 if rank == world - 1 else 9, 64):
        assert torch.equal(outs[("nccl", T)], outs[("symm", T)]), T
    dist.barrier()


def _graph_worker(rank, world, **kw):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, expert_owner

    dev = torch.device("cuda", rank)
    E, K, H, rt = 64, 8, 1024, 32
    a2a = MoeAlltoAll(None, rt, K, E, H, **(kw or dict(transport="nccl")))
    ids = torch.zeros(rt, K, dtype=torch.int32, device=dev)
    x = torch.zeros(rt, H, dtype=torch.bfloat16, device=dev)

    def step():
        views = a2a.dispatch(ids, [x], rt)
        return a2a.combine(views[0] * 2, rt)

    def fill(seed):
        gi = torch.Generator().manual_seed(seed)
        ids.copy_(_ids(gi, rt, K, E))
        x.copy_(torch.randn(rt, H, generator=gi).to(torch.bfloat16))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fill(rank)
        step()  # warm-up: buffers allocated outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if kw.get("transport") == "symm":  # eager warm-up pipelined; captured by size (or forced)
            assert a2a.combine_pipelines(rt) is bool(kw.get("pipelined_combine")), kw
        out = step()
    for it in range(3):
        fill(1000 * it + rank)
        graph.replay()
        torch.cuda.synchronize()
        owners = expert_owner(ids, E, world)
        n_dest = torch.stack([(owners == r).any(1) for r in range(world)], 1).sum(1)
        assert torch.equal(out, (x.float() * 2 * n_dest[:, None]).to(torch.bfloat16)), it
    dist.barrier()


def _all_worker(rank, world):
    # nccl-only first, so a symm failure cannot hide them; PASS lines show how far it got
    import functools

    symm = dict(transport="symm", timeout=60)
    _pipe_graph = functools.partial(_graph_worker, **symm, num_sms=4, pipelined_combine=True)
    _symm_graph = functools.partial(_graph_worker, **symm)
    for name, fn in (
        ("nccl CUDA graph", _graph_worker),
        ("transports", _transports_worker),
        ("ep_moe", _moe_worker),
        # the pipelined combine replayed: its epochs and chunk flags live on the device
        ("symm pipelined CUDA graph", _pipe_graph),
        # the defaults: the eager warm-up pipelines, the capture (32 tokens/rank) runs the two kernels
        ("symm CUDA graph", _symm_graph),
    ):
        fn(rank, world)
        if rank == 0:
            print(f"PASS {name} on {world} GPUs", flush=True)


@pytest.mark.parametrize("world", [2, 4, 8])  # 8: the DeepSeek-V3 deployment size (issue 7)
def test_ep_multigpu(world):
    """CUDA-graph capture of dispatch+combine (nccl); nccl vs symm vs the references, including
    back-to-back rounds; ep_moe vs single-GPU fused_moe — on ``world`` GPUs, in one spawn (fail-fast:
    a failure on any rank terminates the others)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_distributed(_all_worker, world, backend="nccl", env=_ENV, timeout_s=120)

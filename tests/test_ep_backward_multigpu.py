"""ep_moe backward on 2 (and 4) GPUs, bf16 Triton kernels, ``nccl`` and ``symm`` transports.

Run: ``PYTHONPATH=src python3 -m pytest -m multigpu tests/test_ep_backward_multigpu.py`` (NVLink
multicast disabled, as in test_ep_multigpu.py). Every rank builds every rank's inputs from one seed,
differentiates its term of ``sum_s <ep_moe(x_s), g_s>`` and compares with fp64 autograd of the
single-GPU reference (``fused_moe_torch``) over all ranks' tokens: its rows of ``d hidden_states`` and
``d router_logits``, its expert slice of ``d w13``/``d w2``. Also: the two transports give bitwise
equal gradients (symm with either combine), two backward passes are bitwise equal, replay_ids,
recompute, a rank with no tokens.
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

E, H, I, MAX_TOKENS = 32, 512, 256, 128  # noqa: E741


def _problem(seed, Ts, K, replay, dev):
    from replaymoe.testing import tie_free_logits

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev) for T in Ts]
    logits = [tie_free_logits(T, E, generator=g).to(dev) for T in Ts]
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).to(dev)
    dout = [torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev) for T in Ts]
    rids = None
    if replay:  # forced selections, distinct per token
        rids = [torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32).to(dev) for T in Ts]
    return xs, logits, w13, w2, dout, rids


def _reference(xs, logits, w13, w2, dout, rids, K):
    """fp64 autograd of fused_moe_torch over all ranks' tokens (routing in fp32, route's dtype)."""
    from replaymoe.moe import fused_moe_torch
    from replaymoe.routing import route

    X = torch.cat(xs).double().requires_grad_()
    L = torch.cat(logits).requires_grad_()
    A, B = w13.double().requires_grad_(), w2.double().requires_grad_()
    r = route(L, top_k=K, replay_ids=None if rids is None else torch.cat(rids), backend="torch")
    out = fused_moe_torch(X, A, B, topk_ids=r.topk_ids, topk_weights=r.topk_weights.double())
    out.backward(torch.cat(dout).double())
    return out.detach(), X.grad, L.grad, A.grad, B.grad


def _ep(a2a, rank, xs, logits, w13, w2, dout, rids, K, lo, n, recompute):
    from replaymoe.ep import ep_moe

    leaves = [t.clone().requires_grad_() for t in (xs[rank], logits[rank], w13[lo : lo + n], w2[lo : lo + n])]
    rid = None if rids is None else rids[rank]
    out = ep_moe(*leaves, a2a, top_k=K, replay_ids=rid, recompute=recompute)
    out.backward(dout[rank])
    return [out.detach()] + [t.grad for t in leaves]


def _worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import MoeAlltoAll, ep_moe, expert_partition

    dev = torch.device("cuda", rank)
    lo, n = expert_partition(E, world)[rank]
    cases = [  # (top_k, tokens per rank, replay_ids, recompute)
        (8, [(100, 0, 37, 128)[s % 4] for s in range(world)], False, False),  # rank 1 without tokens
        (2, [(64, 3, 0, 90)[s % 4] for s in range(world)], True, False),  # replay; a rank without tokens
        (4, [(128, 17, 5, 1)[s % 4] for s in range(world)], False, True),  # recompute, one rank at the max
    ]
    a2as = {}
    for seed, (K, Ts, replay, recompute) in enumerate(cases):
        prob = _problem(seed, Ts, K, replay, dev)
        ref = _reference(*prob, K)
        s0, T = sum(Ts[:rank]), Ts[rank]
        want = [
            ref[0][s0 : s0 + T],
            ref[1][s0 : s0 + T],
            ref[2][s0 : s0 + T],
            ref[3][lo : lo + n],
            ref[4][lo : lo + n],
        ]
        grads = {}
        # symm_pipe: the combines (the forward's bf16 rows, the backward's fp32 [dX | d weights] rows) as
        # the pipelined launch on every SM, which the default reaches only at more rows than these
        for t in ("nccl", "symm", "symm_pipe"):
            key = (t, K)
            if key not in a2as:
                kw = dict(transport="nccl") if t == "nccl" else dict(transport="symm", timeout=60)
                if t == "symm_pipe":
                    kw["pipelined_combine"] = True
                a2as[key] = MoeAlltoAll(None, MAX_TOKENS, K, E, H, **kw)
            a2a = a2as[key]
            got = _ep(a2a, rank, *prob, K, lo, n, recompute)
            with torch.no_grad():  # the inference path gives the training forward's output bitwise
                plain = ep_moe(prob[0][rank], prob[1][rank], prob[2][lo : lo + n], prob[3][lo : lo + n], a2a,
                               top_k=K, replay_ids=prob[5][rank] if replay else None)  # fmt: skip
            assert torch.equal(plain, got[0]), f"{t} case {seed} rank {rank}: forward differs with grad"
            again = _ep(a2a, rank, *prob, K, lo, n, recompute)
            for what, a, b in zip(("out", "d hidden", "d logits", "d w13", "d w2"), got, again):
                assert torch.equal(a, b), f"{t} case {seed} rank {rank}: two backward passes differ in {what}"
            for what, a, e in zip(("out", "d hidden", "d logits", "d w13", "d w2"), got, want):
                if e.numel() == 0:
                    assert a.shape == e.shape, (t, seed, what)
                    continue
                err = float((a.double() - e).norm() / e.norm().clamp_min(1e-30))
                assert err < 1.5e-2, f"{t} case {seed} rank {rank}: {what} relative error {err:.3g}"
            assert got[1].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
            grads[t] = got
        for t in ("symm", "symm_pipe"):
            for what, a, b in zip(("out", "d hidden", "d logits", "d w13", "d w2"), grads["nccl"], grads[t]):
                assert torch.equal(a, b), f"case {seed} rank {rank}: nccl and {t} differ in {what}"
        if rank == 0:
            print(f"PASS ep_moe backward case {seed} on {world} GPUs", flush=True)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4, 8])  # 8: the DeepSeek-V3 deployment size (issue 38)
def test_ep_moe_backward_multigpu(world):
    """ep_moe gradients (bf16, Triton) against fp64 single-GPU autograd on ``world`` GPUs, both
    transports bitwise equal, deterministic backward."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_distributed(_worker, world, backend="nccl", env=_ENV, timeout_s=300)

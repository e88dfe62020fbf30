"""Gradients of ep_moe on gloo (CPU) against fp64 autograd of single-device fused_moe on the full weights.

One spawn per world size (spawning is the cost, so every case runs inside it). Every rank builds every
rank's inputs from one seed, differentiates ``sum_s <ep_moe(x_s), g_s>`` (its own term; the backward
is collective) and compares its gradients with the reference over *all* ranks' tokens: its own rows of
``d hidden_states`` and ``d router_logits``, and its expert slice of ``d w13`` / ``d w2`` (which
collect every rank's tokens). Also: two backward passes bitwise equal, ``combine(width=)`` and the
rejections. The torch backend on CPU (fused_moe's torch autograd; torch-op packing), plus one small
case with the Triton kernels in the interpreter (all-to-all kernels and fused_moe's Triton backward).
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed

E, H, I = 8, 32, 16  # noqa: E741


def _problem(seed, world, K, Ts, replay):
    g = torch.Generator().manual_seed(seed)
    from replaymoe.testing import tie_free_logits

    xs = [torch.randn(T, H, generator=g) for T in Ts]
    logits = [tie_free_logits(T, E, generator=g) for T in Ts]
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    dout = [torch.randn(T, H, generator=g) for T in Ts]
    rids = None
    if replay:  # forced selections (not the logits' top-k), distinct per token
        rids = [torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32) for T in Ts]
    return xs, logits, w13, w2, dout, rids


def _reference(xs, logits, w13, w2, dout, rids, K, kw):
    """fp64 autograd of fused_moe_torch on all ranks' tokens (routing in fp32: route's dtypes)."""
    from replaymoe.moe import fused_moe_torch
    from replaymoe.routing import route

    X = torch.cat(xs).double().requires_grad_()
    L = torch.cat(logits).requires_grad_()
    A, B = w13.double().requires_grad_(), w2.double().requires_grad_()
    r = route(L, top_k=K, replay_ids=None if rids is None else torch.cat(rids), backend="torch", **kw)
    out = fused_moe_torch(X, A, B, topk_ids=r.topk_ids, topk_weights=r.topk_weights.double())
    out.backward(torch.cat(dout).double())
    return out.detach(), X.grad, L.grad, A.grad, B.grad


def _ep_grads(a2a, rank, xs, logits, w13, w2, dout, rids, K, kw, backend, twice=False):
    """ep_moe forward + backward on this rank; with ``twice``, a second backward through the same graph."""
    from replaymoe.ep import ep_moe, expert_partition

    lo, n = expert_partition(E, a2a.ep)[rank]
    leaves = [t.clone().requires_grad_() for t in (xs[rank], logits[rank], w13[lo : lo + n], w2[lo : lo + n])]
    rid = None if rids is None else rids[rank]
    out = ep_moe(
        leaves[0], leaves[1], leaves[2], leaves[3], a2a, top_k=K, replay_ids=rid, backend=backend, **kw
    )
    out.backward(dout[rank], retain_graph=twice)
    grads = [t.grad.clone() for t in leaves]
    if twice:
        for t in leaves:
            t.grad = None
        out.backward(dout[rank])
        for a, t in zip(grads, leaves):
            assert torch.equal(a, t.grad), "two backward passes differ"
    return [out.detach()] + grads


def _check(got, ref, rank, Ts, lo, n, name, skip=()):
    from replaymoe.testing import assert_close

    s0, T = sum(Ts[:rank]), Ts[rank]
    want = [
        ref[0][s0 : s0 + T],
        ref[1][s0 : s0 + T],
        ref[2][s0 : s0 + T],
        ref[3][lo : lo + n],
        ref[4][lo : lo + n],
    ]
    for i, (what, a, e) in enumerate(zip(("out", "d hidden", "d logits", "d w13", "d w2"), got, want)):
        if i in skip:
            continue
        # gradients are sums over tokens and features: tolerance at the reference's scale
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        assert_close(a.float(), e.float(), atol=2e-5 * scale, rtol=2e-5, name=f"{name} rank {rank}: {what}")


def _cases(rank, world, group, cases, triton_case):
    from replaymoe.ep import MoeAlltoAll, expert_partition
    from replaymoe.routing import RoutingMethod

    lo, n = expert_partition(E, world)[rank]
    a2as = {}
    for seed, (K, Ts, replay, method) in enumerate(cases):
        kw = {}
        if method == "ds":
            kw = {
                "method": RoutingMethod.DEEPSEEK_V3,
                "n_group": 4,
                "topk_group": 2,
                "routed_scaling_factor": 2.5,
            }
        a2a = a2as.setdefault(K, MoeAlltoAll(group, 8, K, E, H))  # one per top_k, reused across cases
        prob = _problem(seed, world, K, Ts, replay)
        ref = _reference(*prob, K, kw)
        got = _ep_grads(a2a, rank, *prob, K, kw, "torch", twice=seed == 0)
        _check(
            got, ref, rank, Ts, lo, n, f"world {world} case {seed} (K={K}, T={Ts}, replay={replay}, {method})"
        )
    if triton_case:
        # the Triton kernels (interpreter): all-to-all packing/reduce and fused_moe's Triton backward
        K, Ts = 2, [3, 0, 2, 1][:world]
        a2a = MoeAlltoAll(group, 4, K, E, H, kernel_backend="triton")
        prob = _problem(99, world, K, Ts, False)
        ref = _reference(*prob, K, {})
        got = _ep_grads(a2a, rank, *prob, K, {}, "triton", twice=True)
        _check(got, ref, rank, Ts, lo, n, f"world {world} triton")
    return a2as


def _mixed_needs(rank, group):
    """Ranks that need different gradients (rank 0: only its experts, frozen inputs; rank 1: only its
    hidden states, frozen experts and router) still exchange alike: each gets what it asked for."""
    from replaymoe.ep import MoeAlltoAll, ep_moe, expert_partition

    K, Ts = 2, [4, 3]
    lo, n = expert_partition(E, 2)[rank]
    prob = _problem(7, 2, K, Ts, False)
    ref = _reference(*prob, K, {})
    xs, logits, w13, w2, dout, _ = prob
    a2a = MoeAlltoAll(group, 8, K, E, H)
    x, lg = xs[rank].clone(), logits[rank].clone()
    a, b = w13[lo : lo + n].clone(), w2[lo : lo + n].clone()
    for t in (a, b) if rank == 0 else (x,):
        t.requires_grad_()
    out = ep_moe(x, lg, a, b, a2a, top_k=K)
    out.backward(dout[rank])
    got = [None, x.grad, lg.grad, a.grad, b.grad]
    _check(got, ref, rank, Ts, lo, n, "mixed needs", skip=(0, 1, 2) if rank == 0 else (0, 2, 3, 4))
    assert all(got[i] is None for i in ((1, 2) if rank == 0 else (2, 3, 4)))
    with torch.no_grad():  # grad mode off: the inference path, no autograd node, the same output
        x.requires_grad_()
        plain = ep_moe(x, lg, a, b, a2a, top_k=K)
    assert plain.grad_fn is None and out.grad_fn is not None
    assert torch.equal(plain, out)


def _worker(rank, world):
    import torch.distributed as dist

    from replaymoe.ep import ep_moe, expert_partition

    # world 2 on a sub-group of ranks 0 and 1 (the others wait), then world 4: one spawn for both
    pair = dist.new_group([0, 1])
    if rank < 2:
        _cases(rank, 2, pair, CASES_2, True)
        _mixed_needs(rank, pair)
    dist.barrier()
    a2as = _cases(rank, world, None, CASES_4, False)
    lo, n = expert_partition(E, world)[rank]

    # rejections (before any communication, so every rank raises alike)
    a2a = a2as[2]
    x = torch.zeros(2, H, requires_grad=True)
    logits = torch.randn(2, E)
    w13, w2 = torch.zeros(n, 2 * I, H), torch.zeros(n, H, I)
    with pytest.raises(ValueError, match="recompute"):
        ep_moe(x, logits, w13, w2, a2a, top_k=2, recompute=1)
    with pytest.raises(ValueError, match="w13_scale"):  # fp8 block scales are inference-only
        ep_moe(x, logits, w13, w2, a2a, top_k=2, w13_scale=torch.ones(n, 1, 1), w2_scale=torch.ones(n, 1, 1))
    # combine(width=): a payload of another width is accepted only when announced
    ids = torch.zeros(2, 2, dtype=torch.int32)
    a2a.dispatch(ids, [ids], 4)
    with pytest.raises(ValueError, match="width"):
        a2a.combine(torch.zeros(world, 4, 5), 4, width=0)
    with pytest.raises(ValueError, match="payload"):
        a2a.combine(torch.zeros(world, 4, 5), 4)  # width defaults to hidden_size
    pay = torch.arange(world * 4 * 5, dtype=torch.float32).view(world, 4, 5)
    out = a2a.combine(pay, 4, width=5)  # every rank's two tokens went to rank 0 only (expert 0)
    assert torch.equal(out, pay[rank, :2])  # rank 0's rows [rank, 0:2], the same values on every rank
    dist.barrier()


# (top_k, tokens per rank, replay_ids, routing); every case has a rank with zero tokens
CASES_2 = [
    (2, [5, 0], False, "renorm"),  # rank 1 sends nothing (still receives and computes)
    (1, [0, 6], False, "renorm"),  # top-1: every token on exactly one rank
    (8, [4, 0], False, "renorm"),  # top-8 = E: every token on every rank
    (4, [3, 0], True, "ds"),  # replay_ids with DeepSeek-V3 grouped routing and scaling
]
CASES_4 = [
    (2, [5, 0, 3, 2], False, "renorm"),  # E_local = 2: tokens split over up to two ranks
    (8, [0, 3, 1, 2], True, "renorm"),  # top-8 with replay: every token on all four ranks
]


def test_ep_moe_gradients_gloo():
    """ep_moe's gradients (hidden_states, router_logits, w13_local, w2_local) equal single-device
    fused_moe's on the full weights at world 2 (torch and Triton-interpreter kernels) and 4; two
    backward passes are bitwise equal; combine(width=); rejections."""
    run_distributed(_worker, 4, timeout_s=120)


# world 8 (the DeepSeek-V3 deployment size): one expert per rank (E_local = 1)
CASES_8 = [
    (2, [3, 0, 2, 1, 0, 4, 1, 2], False, "renorm"),  # tokens split over two of eight ranks; two idle ranks
    (8, [1, 2, 0, 1, 3, 0, 0, 1], True, "renorm"),  # top-8 = E with replay: every token on every rank
]


def _worker8(rank, world):
    import torch.distributed as dist

    _cases(rank, world, None, CASES_8, False)
    dist.barrier()


def test_ep_moe_gradients_gloo_world8():
    """ep_moe's gradients at world 8 (one expert per rank, idle ranks, top-8 over all ranks with replay)
    equal single-device fused_moe's, two backward passes bitwise equal."""
    run_distributed(_worker8, 8, timeout_s=180)

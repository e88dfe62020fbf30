"""GPU tests of the routing kernel: real sizes against the torch reference, capture, CUDA graphs,
torch.compile. Run with ``PYTHONPATH=src python3 -m pytest -m gpu tests/test_routing_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from _routing_cases import routing_kwargs
from replaymoe.routing import RoutingMethod, route, route_torch
from replaymoe.routing.methods import METHODS
from replaymoe.testing import assert_close, poison, tie_free_logits

pytestmark = pytest.mark.gpu

M = RoutingMethod
DEV = "cuda"


def _kwargs(method: RoutingMethod, num_experts: int, bias_dtype=torch.float32, gen=None) -> dict:
    """Routing arguments of a realistic model for ``method`` at ``num_experts``."""
    ng = {8: 4, 64: 8, 128: 8, 256: 8, 384: 8, 512: 16}.get(num_experts, 1)
    return routing_kwargs(method, num_experts, gen, top_k=min(8, num_experts), bias_dtype=bias_dtype,
                          bias_scale=1.0, device=DEV, groups=(ng, max(1, ng // 2)))  # fmt: skip


def _assert_eps_optimal(x, ids, method, kw, eps=1e-5):
    """The kernel's choice on rows that differ from the reference is optimal up to ``eps`` in
    float64 scores (groups and experts), i.e. the difference is a last-ulp sigmoid near-tie."""
    b = torch.sigmoid(x.double())
    if kw.get("bias") is not None:
        b = b + kw["bias"].double()
    t, e = b.shape
    allowed = torch.ones_like(b, dtype=torch.bool)
    ng = kw.get("n_group") or 1
    if METHODS[method].grouped and ng > 1:
        gs = e // ng
        gscore = b.view(t, ng, gs).topk(min(2, gs), dim=2).values.sum(dim=2)
        chosen_groups = torch.zeros(t, ng, dtype=torch.bool, device=b.device)
        chosen_groups.scatter_(1, ids.long() // gs, True)
        assert bool((chosen_groups.sum(dim=1) <= kw["topk_group"]).all()), "too many groups used"
        worst_kept = torch.where(chosen_groups, gscore, float("inf")).min(dim=1).values
        best_dropped = torch.where(chosen_groups, float("-inf"), gscore).max(dim=1).values
        # a dropped group may beat a kept one only by eps (unless the kept set is forced by top_k)
        full = chosen_groups.sum(dim=1) == kw["topk_group"]
        assert bool((~full | (best_dropped <= worst_kept + eps)).all()), "group choice not eps-optimal"
        allowed = chosen_groups.repeat_interleave(gs, dim=1)
    sel = b.gather(1, ids.long())
    unsel = b.scatter(1, ids.long(), float("-inf"))
    unsel = torch.where(allowed, unsel, float("-inf"))
    assert bool((unsel.max(dim=1).values <= sel.min(dim=1).values + eps).all()), (
        "expert choice not eps-optimal"
    )
    assert bool((sel[:, 1:] <= sel[:, :-1] + eps).all()), "columns not in descending order"


def _check_against_reference(x: torch.Tensor, method: RoutingMethod, kw: dict, out) -> None:
    """ids equal to route_torch's; for sigmoid+bias selection, rows may differ only where the
    kernel's choice is optimal to 1e-5 in float64 (a last-ulp sigmoid near-tie)."""
    ref = route_torch(x, method=method, **kw)
    k = kw["top_k"]
    ids, rids = out.topk_ids, ref.topk_ids
    assert ids.dtype == torch.int32 and out.topk_weights.dtype == torch.float32
    assert ids.shape == rids.shape == (x.shape[0], k)
    srt = ids.long().sort(dim=1).values
    assert bool(((srt >= 0) & (srt < x.shape[1])).all()) and not bool((srt[:, 1:] == srt[:, :-1]).any())
    same = (ids == rids).all(dim=1)
    if METHODS[method].biased:  # sigmoid + bias: last-ulp near-ties
        bad = (~same).nonzero().flatten()
        assert bad.numel() <= max(2, x.shape[0] // 1000), f"{bad.numel()} rows differ"
        if bad.numel():
            _assert_eps_optimal(x[bad], ids[bad], method, kw)
    else:
        assert bool(same.all()), f"{int((~same).sum())} rows differ, first {int((~same).nonzero()[0])}"
    assert_close(out.topk_weights[same], ref.topk_weights[same], dtype=torch.float32, name="weights")


@pytest.mark.parametrize("num_experts", [8, 64, 128, 256, 384, 512])
@pytest.mark.parametrize("method", [M.RENORMALIZE, M.DEEPSEEK_V3])
def test_kernel_matches_reference_over_sizes(num_experts, method, generator):
    # every expert count (non-power-of-2 384; grouped DeepSeek with 16 groups at 512) and token
    # counts from decode (1) through odd (7) to prefill (16384) in one kernel build per E
    kw = _kwargs(method, num_experts, gen=generator)
    for t in (1, 7, 128, 4096, 16384):
        x = tie_free_logits(t, num_experts, generator=generator, device=DEV)
        out = route(x, method=method, **kw)
        _check_against_reference(x, method, kw, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_every_method_and_dtype(method, dtype, generator):
    # all ten methods x logit dtypes (16-bit logits take the int32-key path where it applies)
    for num_experts in (128, 256):
        kw = _kwargs(method, num_experts, gen=generator)
        x = tie_free_logits(4099, num_experts, dtype=dtype, generator=generator, device=DEV)
        _check_against_reference(x, method, kw, route(x, method=method, **kw))


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
def test_deepseek_bias_dtypes(logit_dtype, bias_dtype, generator):
    # the bias dtype is independent of the logits' (all pairs)
    kw = _kwargs(M.DEEPSEEK_V3, 256, bias_dtype=bias_dtype, gen=generator)
    x = tie_free_logits(2048, 256, dtype=logit_dtype, generator=generator, device=DEV)
    _check_against_reference(x, M.DEEPSEEK_V3, kw, route(x, method=M.DEEPSEEK_V3, **kw))


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE, M.DEFAULT])
def test_capture_bit_identical_and_rows_beyond_t_untouched(method, generator):
    kw = _kwargs(method, 256, gen=generator)
    k = kw["top_k"]
    x = tie_free_logits(1000, 256, generator=generator, device=DEV)
    cap = poison(torch.empty(4096, k, dtype=torch.int16, device=DEV))
    off = route(x, method=method, **kw)
    on = route(x, method=method, routing_replay_out=cap, **kw)
    assert torch.equal(on.topk_ids, off.topk_ids)
    assert torch.equal(on.topk_weights.view(torch.int32), off.topk_weights.view(torch.int32))  # bitwise
    assert torch.equal(cap[:1000].int(), on.topk_ids)
    assert bool((cap[1000:] == poison(cap[1000:].clone())).all())


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE, M.SIGMOID_RENORM])
@pytest.mark.parametrize("id_dtype", [torch.int16, torch.int64])
def test_replay_matches_reference(method, id_dtype, generator):
    # forced ids in arbitrary column order, plus rows of all -1 routed natively in the kernel
    kw = _kwargs(method, 256, gen=generator)
    k = kw["top_k"]
    x = tie_free_logits(3000, 256, generator=generator, device=DEV)
    forced = torch.stack([torch.randperm(256, generator=generator)[:k] for _ in range(3000)]).to(DEV)
    forced[::7] = -1
    forced = forced.to(id_dtype)
    cap = poison(torch.empty(3000, k, dtype=torch.int16, device=DEV))
    out = route(x, method=method, replay_ids=forced, routing_replay_out=cap, **kw)
    ref = route_torch(x, method=method, replay_ids=forced, **kw)
    assert torch.equal(out.topk_ids[1::7], forced[1::7].int())
    assert torch.equal(cap.int(), out.topk_ids)
    if method != M.DEEPSEEK_V3:  # DeepSeek native rows may differ by a last-ulp near-tie (checked above)
        assert torch.equal(out.topk_ids, ref.topk_ids)
    rows = torch.ones(3000, dtype=torch.bool, device=DEV)
    rows[::7] = False
    assert_close(out.topk_weights[rows], ref.topk_weights[rows], dtype=torch.float32)


def test_nan_rows_give_valid_distinct_ids(generator):
    x = tie_free_logits(512, 256, generator=generator, device=DEV)
    x[::3] = float("nan")
    x[1::3, ::5] = float("nan")
    for method in (M.RENORMALIZE, M.DEEPSEEK_V3, M.TOPK_SIGMOID):
        out = route(x, method=method, **_kwargs(method, 256, gen=generator))
        ids = out.topk_ids.long()
        assert bool(((ids >= 0) & (ids < 256)).all())
        srt = ids.sort(dim=1).values
        assert not bool((srt[:, 1:] == srt[:, :-1]).any())


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE])
def test_cuda_graph_capture_and_replay(method, generator):
    # one graph per step size, all writing into one max-size capture buffer; replay ids are
    # not validated during capture (no host sync), and the graph replays with new logits
    kw = _kwargs(method, 256, gen=generator)
    k = kw["top_k"]
    t = 64
    x = tie_free_logits(t, 256, generator=generator, device=DEV)
    forced = torch.full((t, k), -1, dtype=torch.int32, device=DEV)
    cap = poison(torch.empty(1024, k, dtype=torch.int16, device=DEV))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route(x, method=method, routing_replay_out=cap, replay_ids=forced, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(x, method=method, routing_replay_out=cap, replay_ids=forced, **kw)
    for _ in range(3):
        x.copy_(tie_free_logits(t, 256, generator=generator, device=DEV))
        forced[: t // 2] = -1
        forced[t // 2 :] = torch.stack(
            [torch.randperm(256, generator=generator)[:k] for _ in range(t // 2)]
        ).to(DEV, torch.int32)
        graph.replay()
        torch.cuda.synchronize()
        ref = route_torch(x, method=method, replay_ids=forced, **kw)
        _check_against_reference(
            x[: t // 2], method, kw, type(out)(out.topk_ids[: t // 2], out.topk_weights[: t // 2])
        )
        assert torch.equal(out.topk_ids[t // 2 :], ref.topk_ids[t // 2 :])
        assert torch.equal(cap[:t].int(), out.topk_ids)
        assert bool((cap[t:] == poison(cap[t:].clone())).all())


def test_torch_compile_fullgraph_forward_and_backward(generator):
    kw = _kwargs(M.DEEPSEEK_V3, 256, gen=generator)
    x = tie_free_logits(300, 256, generator=generator, device=DEV)
    cap = poison(torch.empty(512, 8, dtype=torch.int16, device=DEV))

    @torch.compile(fullgraph=True)
    def fwd(x, cap):
        return route(x, method=M.DEEPSEEK_V3, routing_replay_out=cap, **kw)

    out = fwd(x, cap)
    _check_against_reference(x, M.DEEPSEEK_V3, kw, out)
    assert torch.equal(cap[:300].int(), out.topk_ids)

    coef = torch.randn(8, device=DEV)

    @torch.compile(fullgraph=True)
    def loss(x):
        return (route(x, 8, M.RENORMALIZE).topk_weights * coef).sum()

    xa = x.clone().requires_grad_()
    loss(xa).backward()
    xb = x.clone().requires_grad_()
    (route_torch(xb, 8, M.RENORMALIZE).topk_weights * coef).sum().backward()
    assert_close(xa.grad, xb.grad, dtype=torch.float32, name="grad")


@pytest.mark.parametrize("method", list(RoutingMethod))
def test_gradients_match_reference(method, generator):
    kw = _kwargs(method, 64, gen=generator)
    x = tie_free_logits(100, 64, generator=generator, device=DEV)
    forced = torch.stack([torch.randperm(64, generator=generator)[: kw["top_k"]] for _ in range(100)]).to(DEV)
    forced[::5] = -1
    coef = torch.randn(kw["top_k"], device=DEV)
    for replay in (None, forced):
        grads = []
        for fn in (route, route_torch):
            xr = x.clone().requires_grad_()
            (fn(xr, method=method, replay_ids=replay, **kw).topk_weights * coef).sum().backward()
            grads.append(xr.grad)
        assert_close(grads[0], grads[1], dtype=torch.float32, atol=1e-5, name="grad")

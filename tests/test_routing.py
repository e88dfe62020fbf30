"""CPU tests of routing: the torch reference against formulas written out here, capture and replay
semantics, gradients, validation. The Triton kernel under the interpreter: test_routing_interpret.py."""

from __future__ import annotations

import math

import pytest
import torch

import replaymoe.routing as routing_mod
from _routing_cases import routing_kwargs
from replaymoe.routing import RoutingConfig, RoutingMethod, RoutingOutput, route, route_torch
from replaymoe.routing._triton import weights_backward
from replaymoe.routing.methods import METHODS, weights_torch
from replaymoe.routing.methods import Params as _Params
from replaymoe.testing import POISON_INT, assert_close, poison, tie_free_logits

M = RoutingMethod


# --------------------------------------------------------------------------------------------------
# an independent per-row formula (python loops over float64; FlashInfer's definitions, §1)
# --------------------------------------------------------------------------------------------------


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def formula(x, top_k, method, bias=None, n_group=1, topk_group=1, scale=1.0):
    """ids (list of lists) and weights (float64 tensor) by the textbook definition of each method."""
    x = x.double()
    e = x.shape[1]
    bias_l = [0.0] * e if bias is None else bias.double().tolist()
    all_ids, all_w = [], []
    for row in x.tolist():
        if method in (M.DEEPSEEK_V3, M.MINIMAX2):
            s = [_sig(v) for v in row]
            score = [s[i] + bias_l[i] for i in range(e)]
        elif method in (M.SIGMOID, M.SIGMOID_RENORM):
            score = [_sig(v) for v in row]
        elif method in (M.DEFAULT, M.RENORMALIZE_NAIVE):
            mx = max(row)
            z = sum(math.exp(v - mx) for v in row)
            score = [math.exp(v - mx) / z for v in row]
        else:
            score = list(row)
        cand = list(range(e))
        if method == M.DEEPSEEK_V3 and n_group > 1:
            gs = e // n_group
            gscore = [sum(sorted(score[g * gs : (g + 1) * gs], reverse=True)[:2]) for g in range(n_group)]
            keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            cand = [i for i in cand if i // gs in keep]
        ids = sorted(cand, key=lambda i: -score[i])[:top_k]
        w = _formula_weights_at(row, ids, method, scale)
        all_ids.append(ids)
        all_w.append(w)
    return all_ids, torch.tensor(all_w, dtype=torch.float64).reshape(x.shape[0], top_k)


def method_kwargs(method, num_experts, generator, bias_dtype=torch.float32):
    """Arguments of a plausible model for ``method`` with ``num_experts`` experts."""
    return routing_kwargs(method, num_experts, generator, bias_dtype=bias_dtype)


def formula_kwargs(kw):
    return {
        "bias": kw.get("bias"),
        "n_group": kw.get("n_group") or 1,
        "topk_group": kw.get("topk_group") or 1,
        "scale": kw.get("routed_scaling_factor") or 1.0,
    }


# --------------------------------------------------------------------------------------------------
# the reference against the formula
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_reference_matches_formula(method, dtype, generator):
    # every method x logit dtype; 48 experts = 8 groups of 6 (a non-power-of-2 group size)
    kw = method_kwargs(method, 48, generator)
    x = tie_free_logits(13, 48, dtype=dtype, generator=generator)
    out = route_torch(x, method=method, **kw)
    ids, w = formula(x, kw["top_k"], method, **formula_kwargs(kw))
    assert isinstance(out, RoutingOutput)
    assert out.topk_ids.dtype == torch.int32 and out.topk_weights.dtype == torch.float32
    assert out.topk_ids.tolist() == ids
    assert_close(out.topk_weights, w, dtype=torch.float32)


@pytest.mark.parametrize(
    "num_experts, n_group, topk_group, top_k",
    [
        (64, 1, None, 8),  # n_group 1: plain sigmoid+bias top-k, any top_k (no FlashInfer limit)
        (64, 1, 1, 64),  # top_k = E
        (32, 32, 5, 5),  # groups of one expert (group score = that expert)
        (24, 8, 8, 24),  # all groups kept, every expert selected
        (256, 8, 4, 8),  # DeepSeek-V3's own shape
        (512, 16, 2, 32),  # top_k = 32 = all experts of the kept groups
    ],
)
def test_deepseek_grouping_matches_formula(num_experts, n_group, topk_group, top_k, generator):
    bias = (torch.rand(num_experts, generator=generator) - 0.5) * 0.5
    x = tie_free_logits(9, num_experts, generator=generator)
    out = route_torch(
        x, top_k, M.DEEPSEEK_V3, bias=bias, n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.5
    )
    ids, w = formula(x, top_k, M.DEEPSEEK_V3, bias, n_group, topk_group or 1, 1.5)
    assert out.topk_ids.tolist() == ids
    assert_close(out.topk_weights, w, dtype=torch.float32)


def test_ties_go_to_the_smaller_index_and_columns_descend():
    x = torch.tensor(
        [[0.0] * 8, [1.0, 3.0, 3.0, 2.0, 3.0, -1.0, 2.0, 0.0], [-0.0, 0.0, -0.0, 0.0, -1, -1, -1, -1]]
    )
    out = route_torch(x, 4, M.TOPK)
    assert out.topk_ids.tolist() == [[0, 1, 2, 3], [1, 2, 4, 3], [0, 1, 2, 3]]
    assert torch.all(out.topk_weights[:, :-1] >= out.topk_weights[:, 1:])


def test_deepseek_group_ties_and_repeated_group_maximum():
    # equal scores everywhere: groups tie (smaller group wins), experts tie (smaller id wins);
    # a group whose maximum appears twice scores 2 * max
    x = torch.zeros(2, 16)
    x[1, 12] = x[1, 13] = 2.0  # group 3 (experts 12..15) has a repeated maximum
    x[1, 0] = 2.5  # group 0 has one larger value but a smaller top-2 sum
    out = route_torch(x, 4, M.DEEPSEEK_V3, n_group=4, topk_group=1)
    assert out.topk_ids.tolist() == [[0, 1, 2, 3], [12, 13, 14, 15]]


# --------------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE, M.LLAMA4])
def test_capture_writes_rows_below_t_only_and_changes_nothing(method, generator):
    kw = method_kwargs(method, 64, generator)
    x = tie_free_logits(10, 64, generator=generator)
    cap = poison(torch.empty(16, kw["top_k"], dtype=torch.int16))
    off = route_torch(x, method=method, **kw)
    on = route(x, method=method, routing_replay_out=cap, backend="torch", **kw)
    assert torch.equal(on.topk_ids, off.topk_ids)
    assert torch.equal(on.topk_weights, off.topk_weights)
    assert torch.equal(cap[:10].int(), on.topk_ids)
    assert bool((cap[10:] == POISON_INT).all())


# --------------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("id_dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_replay_forces_ids_and_recomputes_weights(method, id_dtype, generator):
    kw = method_kwargs(method, 32, generator)
    k = kw["top_k"]
    x = tie_free_logits(7, 32, generator=generator)
    forced = torch.stack([torch.randperm(32, generator=generator)[:k] for _ in range(7)])
    forced[3] = -1  # a token without recorded routing: routed natively
    out = route_torch(x, method=method, replay_ids=forced.to(id_dtype), **kw)
    native = route_torch(x, method=method, **kw)
    expect_ids = forced.clone()
    expect_ids[3] = native.topk_ids[3].long()
    assert torch.equal(out.topk_ids, expect_ids.int())
    # the weights of the forced set by the formula: the forced row's weights for DEFAULT are the
    # full softmax at those ids, for the renormalising methods the renormalised ones, ...
    for r in range(7):
        xr = x[r : r + 1].double()
        fid = expect_ids[r].tolist()
        w = _formula_weights_at(xr[0].tolist(), fid, method, kw.get("routed_scaling_factor") or 1.0)
        assert_close(out.topk_weights[r], torch.tensor(w), dtype=torch.float32)


def _formula_weights_at(row, ids, method, scale):
    """The weights of ``method`` at ``ids`` for one row of logits (float64 lists), by the textbook."""
    xs = [row[i] for i in ids]
    if method in (M.DEFAULT, M.RENORMALIZE_NAIVE):
        mx = max(row)
        z = sum(math.exp(v - mx) for v in row)
        p = [math.exp(v - mx) / z for v in xs]
        return p if method == M.DEFAULT else [v / sum(p) for v in p]
    if method == M.RENORMALIZE:
        mx = max(xs)
        z = sum(math.exp(v - mx) for v in xs)
        return [math.exp(v - mx) / z for v in xs]
    if method == M.TOPK:
        return xs
    s = [_sig(v) for v in xs]
    if method == M.SIGMOID_RENORM:
        return [v / max(sum(s), 1e-20) for v in s]
    if method in (M.DEEPSEEK_V3, M.MINIMAX2):  # unbiased sigmoid, renormalised, scaled
        return [v / (sum(s) + 1e-20) * scale for v in s]
    if method in (M.LLAMA4, M.SIGMOID, M.TOPK_SIGMOID):
        return s
    raise AssertionError(f"no textbook weights for {method!r}: add them here")


@pytest.mark.parametrize("method", list(RoutingMethod))
def test_weights_gradcheck_float64(method, generator):
    # the torch formula is differentiable (gradcheck in float64), and the Triton op's backward (the
    # table's closed-form gradient) agrees with autograd of it, as does the vjp fallback
    k = 1 if METHODS[method].single_expert else 4
    p = _Params(method, k, 1, 1, 2.5)
    x = torch.randn(5, 12, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.stack([torch.randperm(12, generator=generator)[:k] for _ in range(5)])
    assert torch.autograd.gradcheck(lambda t: weights_torch(t, ids, p), (x,))
    g = torch.randn(5, k, dtype=torch.float64, generator=generator)
    (auto,) = torch.autograd.grad(weights_torch(x, ids, p), x, g)
    closed = weights_backward(x.detach(), ids.int(), g, int(method), 2.5)
    torch.testing.assert_close(closed, auto, rtol=1e-10, atol=1e-12)
    _, vjp = torch.func.vjp(lambda t: weights_torch(t, ids, p), x.detach())
    torch.testing.assert_close(vjp(g)[0], auto, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE, M.DEFAULT, M.SIGMOID_RENORM])
def test_route_torch_gradient_with_and_without_replay(method, generator):
    kw = method_kwargs(method, 32, generator)
    k = kw["top_k"]
    x0 = tie_free_logits(6, 32, generator=generator)
    forced = torch.stack([torch.randperm(32, generator=generator)[:k] for _ in range(6)])
    forced[0] = -1
    coef = torch.randn(k, generator=generator)
    for replay in (None, forced):
        x = x0.clone().requires_grad_()
        out = route_torch(x, method=method, replay_ids=replay, **kw)
        (out.topk_weights * coef).sum().backward()
        xd = x0.double().requires_grad_()
        p = _Params(method, k, 1, 1, kw.get("routed_scaling_factor") or 1.0)
        (weights_torch(xd, out.topk_ids.long(), p) * coef.double()).sum().backward()
        assert x.grad is not None and bool(x.grad.abs().sum() > 0)
        assert_close(x.grad, xd.grad, dtype=torch.float32)
        # only the logits of the used experts get gradient (except the full-softmax DEFAULT)
        if method != M.DEFAULT:
            unused = torch.ones_like(x0, dtype=torch.bool).scatter_(1, out.topk_ids.long(), False)
            assert bool((x.grad[unused] == 0).all())


# --------------------------------------------------------------------------------------------------
# edges: T = 0, NaN, bf16 logits gradient dtype
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE])
def test_zero_tokens(method, generator):
    kw = method_kwargs(method, 64, generator)
    x = torch.empty(0, 64)
    cap = poison(torch.empty(4, kw["top_k"], dtype=torch.int16))
    out = route(x, method=method, routing_replay_out=cap, replay_ids=torch.empty(0, kw["top_k"]).long(), **kw)
    assert out.topk_ids.shape == (0, kw["top_k"]) and out.topk_ids.dtype == torch.int32
    assert out.topk_weights.shape == (0, kw["top_k"]) and out.topk_weights.dtype == torch.float32
    assert bool((cap == POISON_INT).all())


@pytest.mark.parametrize("method", list(RoutingMethod))
def test_nan_logits_give_valid_distinct_ids(method, generator):
    kw = method_kwargs(method, 32, generator)
    x = tie_free_logits(4, 32, generator=generator)
    x[0] = float("nan")  # a whole NaN row
    x[1, ::2] = float("nan")  # half NaN
    x[2, :5] = float("nan")
    out = route_torch(x, method=method, **kw)
    ids = out.topk_ids.long()
    assert bool(((ids >= 0) & (ids < 32)).all())
    srt = ids.sort(dim=1).values
    assert not bool((srt[:, 1:] == srt[:, :-1]).any())
    assert not bool(torch.isnan(out.topk_weights[3]).any())  # the clean row is unaffected


def test_bf16_logits_gradient_has_logit_dtype(generator):
    x = tie_free_logits(5, 16, dtype=torch.bfloat16, generator=generator).requires_grad_()
    route_torch(x, 2).topk_weights.sum().backward()
    assert x.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# validation: every rejection names its argument
# --------------------------------------------------------------------------------------------------

X = torch.zeros(4, 16)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((X.long(), 2), {}, "dtype of router_logits"),  # integer logits
        ((X.double(), 2), {}, "dtype of router_logits"),  # float64 logits
        ((torch.zeros(4, 2, 8), 2), {}, "shape of router_logits"),  # 3-D
        ((torch.zeros(16), 2), {}, "shape of router_logits"),  # 1-D
        ((torch.zeros(16, 4).t(), 2), {}, "layout of router_logits"),  # experts not unit-stride
        (("logits", 2), {}, "type of router_logits"),
        ((X, 0), {}, "top_k"),  # top_k < 1
        ((X, 17), {}, "top_k"),  # top_k > E
        ((X, 2.0), {}, "type of top_k"),
        ((X, 2, 10), {}, "method"),  # unknown method number
        ((X, 2, M.LLAMA4), {}, "top_k.*LLAMA4"),
        ((X, 2), {"bias": torch.zeros(16)}, "bias"),  # bias on a method without bias
        ((X, 2), {"routed_scaling_factor": 2.0}, "routed_scaling_factor"),
        ((X, 2), {"n_group": 4, "topk_group": 2}, "n_group"),  # grouping on a non-DeepSeek method
        ((X, 2, M.DEEPSEEK_V3), {"bias": torch.zeros(15)}, "shape of bias"),
        ((X, 2, M.DEEPSEEK_V3), {"bias": torch.zeros(16).long()}, "dtype of bias"),
        ((X, 2, M.DEEPSEEK_V3), {"bias": torch.zeros(16, 2)[:, 0]}, "layout of bias"),
        ((X, 2, M.DEEPSEEK_V3), {"n_group": 3, "topk_group": 1}, "n_group.*divisor"),  # E % n_group
        ((X, 2, M.DEEPSEEK_V3), {"n_group": 0, "topk_group": 1}, "n_group"),
        ((torch.zeros(4, 64), 2, M.DEEPSEEK_V3), {"n_group": 64, "topk_group": 1}, "n_group"),  # > 32
        ((X, 2, M.DEEPSEEK_V3), {"n_group": 4, "topk_group": 5}, "topk_group"),  # > n_group
        ((X, 2, M.DEEPSEEK_V3), {"n_group": 4}, "topk_group"),  # missing with n_group > 1
        ((X, 5, M.DEEPSEEK_V3), {"n_group": 4, "topk_group": 1}, "top_k.*group masking"),  # 5 > 4 left
        ((X, 2, M.MINIMAX2), {"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
        ((X, 2), {"routing_replay_out": torch.zeros(4, 2, dtype=torch.int32)}, "dtype of routing_replay_out"),
        ((X, 2), {"routing_replay_out": torch.zeros(3, 2, dtype=torch.int16)}, "shape of routing_replay_out"),
        ((X, 2), {"routing_replay_out": torch.zeros(8, 3, dtype=torch.int16)}, "shape of routing_replay_out"),
        ((X, 2), {"routing_replay_out": torch.zeros(8, dtype=torch.int16)}, "shape of routing_replay_out"),
        (
            (X, 2),
            {"routing_replay_out": torch.zeros(2, 8, dtype=torch.int16).t()},
            "layout of routing_replay_out",
        ),
        ((X, 2), {"replay_ids": torch.zeros(4, 2)}, "dtype of replay_ids"),
        ((X, 2), {"replay_ids": torch.zeros(3, 2).long()}, "shape of replay_ids"),
        ((X, 2), {"replay_ids": torch.tensor([[0, 1], [2, 3], [4, 5], [6, 16]])}, "replay_ids.*\\[0, 16\\)"),
        ((X, 2), {"replay_ids": torch.tensor([[0, 1], [2, 3], [-2, 5], [6, 7]])}, "replay_ids.*\\[0, 16\\)"),
        ((X, 2), {"replay_ids": torch.tensor([[0, 1], [2, 2], [4, 5], [6, 7]])}, "replay_ids.*distinct"),
        ((X, 2), {"replay_ids": torch.tensor([[0, 1], [-1, 3], [4, 5], [6, 7]])}, "replay_ids.*all -1"),
        (
            (X,),
            {"method": M.RENORMALIZE, "routing": RoutingConfig(2, M.DEFAULT)},
            "method.*together",
        ),  # never dropped
    ],
)
@pytest.mark.parametrize("fn", ["route", "route_torch"])
def test_rejections(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        getattr(routing_mod, fn)(*args, **kwargs)


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.interpret)],  # reference; kernel reads unit strides
)
@pytest.mark.parametrize(
    "layout",
    [
        "layer_slice",  # trace.ids[:, l] of an [N, L, K] trace: row stride L*K
        "transposed",  # a [K, T] tensor's .t(): column-major
        "every_other_row",  # ids[::2]: row stride 2K
    ],
)
def test_replay_ids_any_strides(backend, layout, generator):
    # DESIGN asks contiguity only of routing_replay_out: replay ids of any layout give the same result
    T, E, K, L = 6, 16, 2, 3
    x = tie_free_logits(T, E, generator=generator)
    full = torch.stack([torch.randperm(E, generator=generator)[: L * K] for _ in range(2 * T)])
    full = full.view(2 * T, L, K).to(torch.int16)
    full[4] = -1  # a token without recorded routing keeps falling back natively
    if layout == "layer_slice":
        ids = full[:T, 1]
    elif layout == "transposed":
        ids = full[:T, 1].t().contiguous().t()
    else:
        ids = full[::2, 1]
    assert not ids.is_contiguous()
    before = ids.clone()
    got = route(x, K, replay_ids=ids, backend=backend)
    want = route_torch(x, K, replay_ids=ids.contiguous())
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert_close(got.topk_weights, want.topk_weights, dtype=torch.float32)
    assert torch.equal(ids, before)  # the caller's tensor is not written


def test_rejects_tensors_on_another_device():
    meta_bias = torch.zeros(16, device="meta")
    with pytest.raises(ValueError, match="device of bias"):
        route(X, 2, M.DEEPSEEK_V3, bias=meta_bias)
    with pytest.raises(ValueError, match="device of routing_replay_out"):
        route(X, 2, routing_replay_out=torch.zeros(4, 2, dtype=torch.int16, device="meta"))
    with pytest.raises(ValueError, match="device of replay_ids"):
        route(X, 2, replay_ids=torch.zeros(4, 2, dtype=torch.long, device="meta"))


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        route(X, 2, backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    import replaymoe._backend as backend_mod  # private: the resolver's interpreter flag, faked off

    monkeypatch.setattr(backend_mod, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        route(X, 2, backend="triton")


def test_auto_backend_on_cpu_is_the_reference(generator):
    x = tie_free_logits(5, 16, generator=generator)
    a = route(x, 3, M.SIGMOID_RENORM)
    b = route_torch(x, 3, M.SIGMOID_RENORM)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_weights, b.topk_weights)


def test_method_accepts_plain_ints(generator):
    x = tie_free_logits(3, 16, generator=generator)
    assert torch.equal(route(x, 2, 5).topk_ids, route(x, 2, M.TOPK).topk_ids)


def test_triton_backend_expert_limit():
    # the kernel keeps a token's experts in registers: explicit 'triton' beyond 4096 is refused
    with pytest.raises(ValueError, match="router_logits.*4096"):
        route(torch.zeros(1, 4097), 2, backend="triton")


# --------------------------------------------------------------------------------------------------
# the routing object: one name (routing=), the loose keywords folded into it
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(M))
@pytest.mark.parametrize("fn", ["route", "route_torch"])
def test_routing_object_equals_the_keywords(fn, method, generator):
    x = tie_free_logits(6, 16, generator=generator)
    kw = routing_kwargs(method, 16, generator, groups=(4, 2))
    f = getattr(routing_mod, fn)
    got = f(x, routing=routing_mod.RoutingConfig(method=method, **kw))
    want = f(x, method=method, **kw)
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)


@pytest.mark.parametrize("fn", ["route", "route_torch"])
def test_config_is_not_a_keyword(fn):
    # routing= is the one name of the routing object (config=, an unreleased old name, is gone)
    with pytest.raises(TypeError, match="config"):
        getattr(routing_mod, fn)(X, config=routing_mod.RoutingConfig(2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_k": 2}, "top_k.*not given together with routing"),
        ({"method": M.TOPK}, "method.*not given together with routing"),
        ({"bias": torch.zeros(16)}, "bias.*not given together with routing"),
        ({"n_group": 2}, "n_group.*not given together with routing"),
        ({"topk_group": 1}, "topk_group.*not given together with routing"),
        ({"routed_scaling_factor": 1.0}, "routed_scaling_factor.*not given together with routing"),
        ({"routing": "renormalize"}, "type of routing: expected a RoutingConfig, got str"),
        ({"routing": None}, r"top_k: expected an int \(or routing=RoutingConfig"),  # neither given
    ],
)
@pytest.mark.parametrize("fn", ["route", "route_torch"])
def test_routing_and_its_keywords_are_one_or_the_other(fn, kwargs, match):
    kwargs = {"routing": routing_mod.RoutingConfig(2), **kwargs}
    with pytest.raises(ValueError, match=match):
        getattr(routing_mod, fn)(X, **kwargs)


def test_a_method_beside_the_routing_object_is_refused_even_the_default(generator):
    # the signatures' default is None: RENORMALIZE given beside a routing object of another method was
    # dropped in silence (and beside one of the same method it says the same thing twice)
    x = tie_free_logits(4, 16, generator=generator)
    for cfg in (routing_mod.RoutingConfig(2, M.DEFAULT), routing_mod.RoutingConfig(2)):
        with pytest.raises(ValueError, match="method.*not given together with routing"):
            route(x, routing=cfg, method=M.RENORMALIZE)


def test_route_torch_is_route_on_the_torch_backend():
    with pytest.raises(ValueError, match="backend.*route_torch"):
        route_torch(X, 2, backend="torch")


def test_routing_object_under_torch_compile_fullgraph(generator):
    # the object (a frozen dataclass holding the bias tensor) traces without a graph break, through
    # route and route_torch alike
    x = tie_free_logits(6, 32, generator=generator)
    kw = routing_kwargs(M.DEEPSEEK_V3, 32, generator, groups=(4, 2))
    cfg = routing_mod.RoutingConfig(method=M.DEEPSEEK_V3, **kw)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fwd(x):
        return route(x, routing=cfg, backend="torch"), route_torch(x, routing=cfg)

    want = route_torch(x, method=M.DEEPSEEK_V3, **kw)
    for got in fwd(x):
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)


@pytest.mark.parametrize("value", [None, 0, 1, "no"])  # a falsy non-bool used to turn the check off
def test_check_replay_must_be_a_bool(value):
    with pytest.raises(ValueError, match="type of check_replay"):
        route(X, 2, replay_ids=torch.tensor([[3, 3], [1, 2], [0, 1], [4, 5]]), check_replay=value)


def test_routing_weights_out_may_not_be_the_logits():
    # the weights written over the logits they come from (and their autograd record) in silence
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    with pytest.raises(ValueError, match="memory of routing_weights_out.*router_logits"):
        route(x, 2, routing_weights_out=x)
    assert x.tolist() == [[0.0, 1.0], [2.0, 0.0]]

"""The routing Triton kernel under TRITON_INTERPRET=1 (CPU): small shapes, fp16/fp32 logits,
every method, every top-k algorithm, capture and replay, against the torch reference."""

from __future__ import annotations

import pytest
import torch

import replaymoe.routing._triton as routing_triton
from _routing_cases import routing_kwargs
from replaymoe.routing import RoutingConfig, RoutingMethod, route, route_torch
from replaymoe.routing._triton import LaunchConfig, route_launched
from replaymoe.testing import POISON_INT, assert_close, poison, tie_free_logits

pytestmark = pytest.mark.interpret

M = RoutingMethod


def kwargs_for(method, num_experts, generator, top_k=3):
    return routing_kwargs(method, num_experts, generator, top_k=top_k, bias_dtype=torch.float16)


def launched(launch, x, top_k=None, method=None, **kw):
    """:func:`route_launched` called as ``route`` is: the routing keywords folded into a RoutingConfig,
    the rest (``routing_replay_out``, ``replay_ids``, ``check_replay``) passed on."""
    run = {k: kw.pop(k) for k in ("routing_replay_out", "replay_ids", "check_replay") if k in kw}
    routing = RoutingConfig(top_k, M.RENORMALIZE if method is None else method, **kw)
    return route_launched(launch, x, routing, **run)


@pytest.fixture(params=[1, 2, 3])
def route_algo(request):
    """``route`` on the Triton backend with its kernel launched per call (:class:`LaunchConfig`): iterative
    top-k on int64 keys (1), on two int32 reductions (2), on truncated int32 keys with verification and
    fallback (3, the default); 4 tokens per program."""
    launch = LaunchConfig(algo=request.param, block_t=4)
    return lambda *args, backend="triton", **kw: launched(launch, *args, **kw)


def check(out, ref, t, cap=None):
    assert out.topk_ids.dtype == torch.int32 and out.topk_weights.dtype == torch.float32
    assert torch.equal(out.topk_ids, ref.topk_ids)
    assert_close(out.topk_weights, ref.topk_weights, dtype=torch.float32)
    if cap is not None:
        assert torch.equal(cap[:t].int(), out.topk_ids)
        assert bool((cap[t:] == POISON_INT).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the int32-key path
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_kernel_matches_reference(method, dtype, route_algo, generator):
    # 48 experts: padded to 64 columns; DeepSeek: 8 groups of 6 (padded to 8); top_k 3 -> 4 columns;
    # T = 9 leaves a partial last block; capture on, with 3 spare rows that must stay untouched
    kw = kwargs_for(method, 48, generator)
    x = tie_free_logits(9, 48, dtype=dtype, generator=generator)
    cap = poison(torch.empty(12, kw["top_k"], dtype=torch.int16))
    out = route_algo(x, method=method, routing_replay_out=cap, backend="triton", **kw)
    check(out, route_torch(x, method=method, **kw), 9, cap)


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.RENORMALIZE, M.SIGMOID])
def test_bitonic_topk(method, generator):
    # ALGO 0 (tl.topk on packed keys): slow under the interpreter, so a few cases only
    launch = LaunchConfig(algo=0, block_t=8)
    kw = kwargs_for(method, 40, generator, top_k=5)
    for dtype in (torch.float32, torch.float16):
        x = tie_free_logits(8, 40, dtype=dtype, generator=generator)
        check(launched(launch, x, method=method, **kw), route_torch(x, method=method, **kw), 8)


@pytest.mark.parametrize(
    "num_experts, n_group, topk_group, top_k",
    [
        (32, 32, 5, 5),  # groups of one expert
        (24, 8, 3, 9),  # group size 3 (padded to 4), all experts of the kept groups
        (64, 1, None, 17),  # no grouping, top_k 17 (32 columns)
        (256, 8, 4, 8),  # DeepSeek-V3's shape
        (384, 4, 2, 8),  # non-power-of-2 E, groups of 96 (padded to 128)
    ],
)
def test_kernel_deepseek_grouping(num_experts, n_group, topk_group, top_k, route_algo, generator):
    bias = (torch.rand(num_experts, generator=generator) - 0.5).float()
    x = tie_free_logits(5, num_experts, generator=generator)
    kw = dict(bias=bias, n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.5)
    out = route_algo(x, top_k, M.DEEPSEEK_V3, backend="triton", **kw)
    check(out, route_torch(x, top_k, M.DEEPSEEK_V3, **kw), 5)


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.TOPK, M.RENORMALIZE_NAIVE])
def test_kernel_ties_nan_and_negative_zero(method, route_algo):
    # exact ties (smaller index first), -0.0 == +0.0, NaN rows: same ids as the reference
    x = torch.zeros(6, 16)
    x[1] = torch.tensor([1.0, 3, 3, 2, 3, -1, 2, 0] * 2)
    x[2, ::2] = -0.0
    x[3] = float("nan")
    x[4, 3:9] = float("nan")
    x[5, 5] = float("-inf")
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        kw = {"n_group": 4, "topk_group": 2} if method == M.DEEPSEEK_V3 else {}
        out = route_algo(xd, 4, method, backend="triton", **kw)
        ref = route_torch(xd, 4, method, **kw)
        assert torch.equal(out.topk_ids, ref.topk_ids)
        ok = ~torch.isnan(ref.topk_weights)
        assert torch.equal(ok, ~torch.isnan(out.topk_weights))
        assert_close(out.topk_weights[ok], ref.topk_weights[ok], dtype=torch.float32)


@pytest.mark.parametrize("method", list(RoutingMethod))
def test_kernel_replay(method, generator):
    # forced ids (int16) in arbitrary order, one row of all -1 routed natively in the kernel,
    # capture records the ids actually used
    kw = kwargs_for(method, 40, generator)
    k = kw["top_k"]
    x = tie_free_logits(6, 40, generator=generator)
    forced = torch.stack([torch.randperm(40, generator=generator)[:k] for _ in range(6)]).short()
    forced[2] = -1
    cap = poison(torch.empty(8, k, dtype=torch.int16))
    out = route(x, method=method, replay_ids=forced, routing_replay_out=cap, backend="triton", **kw)
    check(out, route_torch(x, method=method, replay_ids=forced, **kw), 6, cap)
    assert torch.equal(out.topk_ids[forced[:, 0] >= 0], forced[forced[:, 0] >= 0].int())


def test_kernel_replay_block_without_native_rows_skips_selection(generator):
    # every row forced: the in-kernel selection branch is not taken, results still exact
    x = tie_free_logits(4, 16, generator=generator)
    forced = torch.tensor([[3, 1], [0, 15], [7, 8], [2, 9]], dtype=torch.int64)
    out = route_launched(LaunchConfig(block_t=2), x, RoutingConfig(2, M.RENORMALIZE), replay_ids=forced)
    check(out, route_torch(x, 2, M.RENORMALIZE, replay_ids=forced), 4)


def test_kernel_capture_is_bit_identical(generator):
    kw = kwargs_for(M.DEEPSEEK_V3, 48, generator)
    x = tie_free_logits(7, 48, generator=generator)
    cap = poison(torch.empty(7, 3, dtype=torch.int16))
    a = route(x, method=M.DEEPSEEK_V3, backend="triton", **kw)
    b = route(x, method=M.DEEPSEEK_V3, routing_replay_out=cap, backend="triton", **kw)
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.equal(a.topk_weights.view(torch.int32), b.topk_weights.view(torch.int32))


def test_kernel_edges(generator):
    # T = 0 launches nothing; one expert; row-strided logits (a slice of a wider tensor)
    out = route(torch.empty(0, 8), 2, backend="triton")
    assert out.topk_ids.shape == (0, 2) and out.topk_weights.shape == (0, 2)
    one = route(torch.randn(3, 1, generator=generator), 1, backend="triton")
    assert one.topk_ids.tolist() == [[0]] * 3 and one.topk_weights.tolist() == [[1.0]] * 3
    wide = tie_free_logits(5, 24, generator=generator)
    x = wide[:, 4:20]
    assert x.stride(0) == 24
    check(route(x, 3, M.RENORMALIZE, backend="triton"), route_torch(x.contiguous(), 3, M.RENORMALIZE), 5)


@pytest.mark.parametrize("method", [M.DEEPSEEK_V3, M.DEFAULT, M.RENORMALIZE, M.SIGMOID_RENORM, M.TOPK])
def test_kernel_gradients_match_reference(method, generator):
    kw = kwargs_for(method, 24, generator)
    kw.pop("n_group", None), kw.pop("topk_group", None)
    k = kw["top_k"]
    x0 = tie_free_logits(5, 24, generator=generator)
    forced = torch.stack([torch.randperm(24, generator=generator)[:k] for _ in range(5)])
    forced[1] = -1
    coef = torch.randn(k, generator=generator)
    for replay in (None, forced):
        grads = []
        for backend in ("triton", "torch"):
            x = x0.clone().requires_grad_()
            (
                route(x, method=method, replay_ids=replay, backend=backend, **kw).topk_weights * coef
            ).sum().backward()
            grads.append(x.grad)
        assert_close(grads[0], grads[1], dtype=torch.float32)


def test_custom_op_under_torch_compile_fullgraph(generator):
    # the custom op and its fake traced by dynamo (aot_eager: no C++ compiler needed on CPU)
    x = tie_free_logits(6, 32, generator=generator)
    cap = poison(torch.empty(8, 4, dtype=torch.int16))
    kw = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fwd(x, cap):
        return route(x, 4, M.DEEPSEEK_V3, routing_replay_out=cap, backend="triton", **kw)

    out = fwd(x, cap)
    check(out, route_torch(x, 4, M.DEEPSEEK_V3, **kw), 6, cap)


@pytest.mark.parametrize("algo_id", [2, 3])
def test_kernel_exact_when_scores_differ_in_the_last_bits(algo_id):
    # scores 1 ulp apart, increasing with the index: a key truncated to its top bits cannot order
    # them, so ALGO 3 must detect it and fall back to the exact pass (row 0); row 1 is ordinary,
    # row 2 mixes exact duplicates with 1-ulp neighbours
    launch = LaunchConfig(algo=algo_id, block_t=4)
    one = torch.tensor(1.0)
    ulps = torch.arange(48, dtype=torch.int32) + one.view(torch.int32)
    x = torch.stack(
        [ulps.view(torch.float32), torch.linspace(-1, 1, 48), (ulps // 2 * 2).view(torch.float32)]
    )
    for method in (M.TOPK, M.RENORMALIZE, M.SIGMOID):  # selecting on the logits themselves
        out = route_launched(launch, x, RoutingConfig(6, method))
        ref = route_torch(x, 6, method)
        assert torch.equal(out.topk_ids, ref.topk_ids)
    top = route_launched(launch, x, RoutingConfig(6, M.TOPK)).topk_ids
    assert top[0].tolist() == [47, 46, 45, 44, 43, 42]
    assert top[2].tolist() == [46, 47, 44, 45, 42, 43]


def test_gradient_with_capture_eager_and_compiled(generator):
    # a trainer capturing while backpropagating: the mutated capture buffer and the backward coexist
    x0 = tie_free_logits(6, 32, generator=generator)
    coef = torch.randn(4, generator=generator)
    xr = x0.clone().requires_grad_()
    (route_torch(xr, 4).topk_weights * coef).sum().backward()

    def loss(x, cap):
        out = route(x, 4, M.RENORMALIZE, routing_replay_out=cap, backend="triton")
        return (out.topk_weights * coef).sum(), out.topk_ids

    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        x = x0.clone().requires_grad_()
        cap = poison(torch.empty(8, 4, dtype=torch.int16))
        value, ids = fn(x, cap)
        value.backward()
        assert torch.equal(cap[:6].int(), ids) and bool((cap[6:] == POISON_INT).all())
        assert_close(x.grad, xr.grad, dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_ids_checked_under_torch_compile(backend, generator):
    # eager validation cannot run inside a compiled graph (it syncs); the check op runs there instead,
    # so a compiled trainer step rejects bad replay ids with the same ValueError
    x = tie_free_logits(3, 16, generator=generator)
    good = torch.tensor([[1, 4], [-1, -1], [7, 0]], dtype=torch.int32)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fwd(x, r):
        return route(x, 2, RoutingMethod.RENORMALIZE, replay_ids=r, backend=backend)

    out = fwd(x, good)
    ref = route_torch(x, 2, RoutingMethod.RENORMALIZE, replay_ids=good)
    assert torch.equal(out.topk_ids, ref.topk_ids)
    for bad, match in [
        ([[1, 1], [2, 3], [0, 5]], "distinct"),  # duplicate
        ([[1, 16], [2, 3], [0, 5]], r"in \[0, 16\)"),  # out of range
        ([[1, -1], [2, 3], [0, 5]], "all -1"),  # mixed row
    ]:
        with pytest.raises(ValueError, match=match):
            fwd(x, torch.tensor(bad, dtype=torch.int32))


@pytest.mark.parametrize("method", list(RoutingMethod))
@pytest.mark.parametrize(
    "t, e, k, dtype",
    [
        (5, 24, 3, torch.float32),  # experts and slots not powers of two
        (13, 12, 8, torch.float32),  # several programs, the last partial; K = 8
        (3, 16, 1, torch.float16),  # 16-bit logits (gradient in fp16), one slot
        (0, 16, 4, torch.float32),  # no tokens
    ],
)
def test_weights_gradient_kernel_matches_closed_form(method, t, e, k, dtype, generator, monkeypatch):
    # the one-launch routing backward against the table's closed form in torch (fp32), every method;
    # row 0 repeats an id, which both add up (scatter_add_ semantics); the output is allocated NaN, so
    # an element the kernel leaves unwritten fails
    from replaymoe.routing.methods import METHODS, Params

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))

    k = 1 if METHODS[method].single_expert else k
    x = tie_free_logits(t, e, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=generator)[:k] for _ in range(t)] or [torch.zeros(0, k)])
    ids = ids.reshape(t, k).long()
    if t and k > 1:
        ids[0, 1] = ids[0, 0]
    g = torch.randn(t, k, generator=generator)
    got = routing_triton.weights_backward(x, ids.int(), g, int(method), 2.5)
    ref = METHODS[method].grad(x.float(), ids.long(), g, Params(method, k, 1, 1, 2.5)).to(dtype)
    assert got.dtype == dtype and got.shape == (t, e)
    assert_close(got, ref, dtype=dtype)

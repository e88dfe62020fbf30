"""Fused MoE: reference vs an independent per-token formula, Triton (interpreter / GPU) vs reference,
expert-parallel partial sums, routing passthrough, MoELayer, every rejection."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import replaymoe.moe._backward as moe_bwd
import replaymoe.moe._forward as moe_fwd
import replaymoe.moe.configs as cfgs
import replaymoe.moe.layout as layout_mod
from _scripts import run_script
from replaymoe import _switches
from replaymoe.moe import MoELayer, fused_moe, fused_moe_torch, swap_gate_up
from replaymoe.moe._forward import experts_triton
from replaymoe.moe._kernel_common import _merged_slots
from replaymoe.moe.configs import MoEConfig
from replaymoe.moe.quant import quantize_fp8_block
from replaymoe.routing import RoutingConfig, RoutingMethod, route_torch
from replaymoe.testing import assert_close, poison, tie_free_logits


def _defaults(monkeypatch, **fields: bool) -> None:
    """Process defaults (``replaymoe._switches.DEFAULTS``, a ``dataclasses.replace`` copy) for the rest
    of the test."""
    monkeypatch.setattr(_switches, "DEFAULTS", dataclasses.replace(_switches.DEFAULTS, **fields))


def _ids(T, K, E, g):
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def _problem(T, H, I, E, K, g, dtype=torch.float32):  # noqa: E741
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = _ids(T, K, E, g)
    wts = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, wts


def _exact_problem(T, H, I, E, K, g, dtype=torch.float32):  # noqa: E741
    """A problem whose every ``tl.dot`` is exact in any summation order, for bitwise comparisons of two
    kernel paths under the interpreter (where ``tl.dot`` is a numpy matmul whose order depends on the
    CPU's OpenBLAS kernel and the operands' memory layout).

    x and w13 hold small integers (w13 scaled by 1/32, a power of two): every GEMM1 partial sum is a
    multiple of 1/32 below 2^9 in magnitude, exact in fp16 and fp32. w2 has a single nonzero (+-1 or
    +-1/2) per row, so every GEMM2 output is one product: no sum to reorder. What follows the dots
    (SwiGLU, the top-k weighted sum) is elementwise, in the kernel's own fixed order.
    """
    x = torch.randint(-2, 3, (T, H), generator=g).to(dtype)
    w13 = (torch.randint(-1, 2, (E, 2 * I, H), generator=g) / 32).to(dtype)
    pick = torch.randint(0, I, (E, H), generator=g)
    value = torch.tensor([-1.0, -0.5, 0.5, 1.0])[torch.randint(0, 4, (E, H), generator=g)]
    w2 = torch.zeros(E, H, I).scatter_(2, pick[..., None], value[..., None]).to(dtype)
    ids = _ids(T, K, E, g)
    wts = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, wts


def per_token_formula(x, w13, w2, ids, wts, offset=0):
    """out[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x) * up_e x) in float64, token by token."""
    T, K = ids.shape
    E_local, two_i, _ = w13.shape
    i = two_i // 2
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        xt = x[t].double()
        for k in range(K):
            e = int(ids[t, k]) - offset
            if 0 <= e < E_local:
                gate = w13[e, :i].double() @ xt
                up = w13[e, i:].double() @ xt
                out[t] += float(wts[t, k].detach()) * (w2[e].double() @ (gate * torch.sigmoid(gate) * up))
    return out


# ---------------------------------------------------------------- reference (torch backend)


@pytest.mark.parametrize(
    "T,K,E,E_local,offset",
    [
        (7, 2, 4, 4, 0),  # all experts local
        (9, 3, 8, 3, 2),  # EP slice: tokens routed elsewhere contribute nothing
        (1, 4, 6, 6, 0),  # decode, single token
    ],
)
def test_reference_matches_per_token_formula(T, K, E, E_local, offset, generator):
    x, w13, w2, ids, wts = _problem(T, 32, 16, E, K, generator)
    out = fused_moe_torch(x, w13[offset : offset + E_local], w2[offset : offset + E_local], topk_ids=ids,
                          topk_weights=wts, local_expert_offset=offset, num_experts=E)  # fmt: skip
    ref = per_token_formula(
        x, w13[offset : offset + E_local], w2[offset : offset + E_local], ids, wts, offset
    )
    assert_close(out, ref.float(), dtype=torch.float32)


def test_reference_fp8_matches_dequantized_formula(generator):
    # fp8 spec: weights dequantized per 128x128 block, activations through 1x128 fake quantization
    from replaymoe.moe.quant import dequantize_fp8_block, fake_quant_fp8_per_token_group

    x, w13, w2, ids, wts = _problem(5, 128, 128, 3, 2, generator)
    q13, s13 = quantize_fp8_block(w13)
    q2, s2 = quantize_fp8_block(w2)
    out = fused_moe_torch(x.bfloat16(), q13, q2, topk_ids=ids, topk_weights=wts, w13_scale=s13, w2_scale=s2)
    assert out.dtype == torch.bfloat16
    d13, d2 = dequantize_fp8_block(q13, s13), dequantize_fp8_block(q2, s2)
    xq = fake_quant_fp8_per_token_group(x.bfloat16())
    ref = torch.zeros(5, 128)
    for t in range(5):
        for k in range(2):
            e = int(ids[t, k])
            h = d13[e] @ xq[t]
            a = (F.silu(h[:128]) * h[128:]).bfloat16()
            ref[t] += wts[t, k] * (d2[e] @ fake_quant_fp8_per_token_group(a[None])[0])
    assert_close(out, ref, dtype=torch.bfloat16)
    # and it is close to the unquantized layer (fp8 keeps 3 mantissa bits)
    exact = per_token_formula(x, w13, w2, ids, wts).float()
    assert ((out.float() - exact).norm() / exact.norm()) < 0.08


def test_ep_partial_sums_add_up(generator):
    # three ranks with uneven slices (3, 3, 2 of E=8): partial sums add up to the full layer
    x, w13, w2, ids, wts = _problem(11, 32, 16, 8, 3, generator)
    full = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="torch")
    parts = [fused_moe(x, w13[a:b], w2[a:b], topk_ids=ids, topk_weights=wts, local_expert_offset=a,
                       num_experts=8, backend="torch") for a, b in ((0, 3), (3, 6), (6, 8))]  # fmt: skip
    assert_close(sum(parts), full, dtype=torch.float32)


def test_negative_padding_ids_contribute_nothing(generator):
    # EP dispatch marks padding rows with -1: those rows give zeros
    x, w13, w2, ids, wts = _problem(4, 32, 16, 4, 2, generator)
    ids[2] = -1
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="torch")
    assert (out[2] == 0).all() and (out[[0, 1, 3]] != 0).any()


def test_routing_inside_equals_given_routing_and_captures(generator):
    T, E, K = 6, 8, 2
    x, w13, w2, _, _ = _problem(T, 32, 16, E, K, generator)
    logits = tie_free_logits(T, E, generator=generator)
    cap = poison(torch.empty(10, K, dtype=torch.int16))
    out = fused_moe(x, w13, w2, router_logits=logits, top_k=K, routing_replay_out=cap, backend="torch")
    r = route_torch(logits, K, RoutingMethod.RENORMALIZE)
    given = fused_moe(x, w13, w2, topk_ids=r.topk_ids, topk_weights=r.topk_weights, backend="torch")
    assert torch.equal(out, given)
    assert (
        torch.equal(cap[:T].int(), r.topk_ids)
        and (cap[T:] == poison(torch.empty(1, dtype=torch.int16))).all()
    )
    # replay: forcing the recorded ids reproduces the output exactly
    replayed = fused_moe(x, w13, w2, router_logits=logits, top_k=K, replay_ids=cap[:T], backend="torch")
    assert torch.equal(replayed, out)


def test_routing_inside_deepseek_method(generator):
    T, E, K = 5, 16, 4
    x, w13, w2, _, _ = _problem(T, 32, 16, E, K, generator)
    logits = tie_free_logits(T, E, generator=generator)
    bias = torch.randn(E, generator=generator) * 0.1
    kw = dict(top_k=K, method=RoutingMethod.DEEPSEEK_V3, bias=bias, n_group=4, topk_group=2,
              routed_scaling_factor=2.5)  # fmt: skip
    out = fused_moe(x, w13, w2, router_logits=logits, backend="torch", **kw)
    r = route_torch(logits, **kw)
    assert torch.equal(
        out, fused_moe(x, w13, w2, topk_ids=r.topk_ids, topk_weights=r.topk_weights, backend="torch")
    )
    # the same routing as one object (routing=): the keywords are folded into exactly this
    routing = RoutingConfig(**kw)
    assert torch.equal(out, fused_moe(x, w13, w2, router_logits=logits, routing=routing, backend="torch"))
    with pytest.raises(ValueError, match="top_k.*not given together with routing"):
        fused_moe(x, w13, w2, router_logits=logits, routing=routing, top_k=K, backend="torch")


def test_empty_batch_and_out_param(generator):
    x, w13, w2, ids, wts = _problem(0, 32, 16, 4, 2, generator)
    assert fused_moe(x, w13, w2, topk_ids=ids.reshape(0, 2), topk_weights=wts, backend="torch").shape == (
        0,
        32,
    )
    x, w13, w2, ids, wts = _problem(3, 32, 16, 4, 2, generator)
    out = poison(torch.empty(3, 32))
    res = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, out=out, backend="torch")
    assert res is out and not torch.isnan(out).any()


def test_swap_gate_up_roundtrip_and_semantics(generator):
    x, w13, w2, ids, wts = _problem(4, 128, 128, 2, 1, generator)
    sw = swap_gate_up(w13)
    assert torch.equal(sw[:, :128], w13[:, 128:]) and torch.equal(swap_gate_up(sw), w13)
    q, s = quantize_fp8_block(w13)
    q2, s2 = swap_gate_up(q.view(torch.uint8), s)
    assert torch.equal(s2[:, 0], s[:, 1]) and torch.equal(q2[:, :128], q.view(torch.uint8)[:, 128:])


def test_moelayer_forward_matches_reference(generator):
    torch.manual_seed(0)
    layer = MoELayer(32, 16, 6, 2, backend="torch")
    x = torch.randn(2, 3, 32, generator=generator)
    cap = torch.empty(6, 2, dtype=torch.int16)
    y = layer(x, routing_replay_out=cap)
    assert y.shape == (2, 3, 32)
    logits = layer.router(x.reshape(6, 32))
    r = route_torch(logits, 2)
    ref = per_token_formula(
        x.reshape(6, 32), layer.w13.detach(), layer.w2.detach(), r.topk_ids, r.topk_weights
    )
    assert_close(y.reshape(6, 32), ref.float(), dtype=torch.float32)
    assert torch.equal(cap.int(), r.topk_ids)
    # EP slice of the same layer gives the partial sum
    part = MoELayer(32, 16, 6, 2, num_local_experts=2, local_expert_offset=4, backend="torch")
    part.router.load_state_dict(layer.router.state_dict())
    with torch.no_grad():
        part.w13.copy_(layer.w13[4:])
        part.w2.copy_(layer.w2[4:])
    ref_part = per_token_formula(x.reshape(6, 32), layer.w13[4:].detach(), layer.w2[4:].detach(), r.topk_ids,
                                 r.topk_weights, offset=4)  # fmt: skip
    assert_close(part(x).reshape(6, 32), ref_part.float(), dtype=torch.float32)
    # the layer's routing object: its keywords folded once (method None = RENORMALIZE)
    assert layer.routing == RoutingConfig(2, RoutingMethod.RENORMALIZE)


def test_moelayer_takes_the_routing_object(generator):
    # MoELayer(routing=RoutingConfig(...)) is the keyword layer: same object, same output; a routing
    # bias becomes the router_bias buffer (fp32 copy); the object and a loose keyword together fail
    ds = dict(method=RoutingMethod.DEEPSEEK_V3, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    bias = torch.randn(8, generator=generator).to(torch.bfloat16)
    by_keywords = MoELayer(32, 16, 8, 2, router_bias=True, backend="torch", **ds)
    torch.manual_seed(0)
    by_object = MoELayer(32, 16, 8, routing=RoutingConfig(2, bias=bias, **ds), backend="torch")
    by_keywords.load_state_dict(by_object.state_dict())
    assert by_object.router_bias.dtype == torch.float32 and torch.equal(by_object.router_bias, bias.float())
    assert by_object.routing == by_keywords.routing and by_object.routing.bias is by_object.router_bias
    x = torch.randn(5, 32, generator=generator)
    assert torch.equal(by_object(x), by_keywords(x))
    with pytest.raises(ValueError, match="top_k"):  # both
        MoELayer(32, 16, 8, 2, routing=RoutingConfig(2))
    with pytest.raises(ValueError, match="n_group"):  # the object and a loose keyword
        MoELayer(32, 16, 8, routing=RoutingConfig(2, **ds), n_group=2)
    with pytest.raises(ValueError, match="top_k"):  # neither
        MoELayer(32, 16, 8)
    with pytest.raises(ValueError, match=r"routing\.top_k"):  # K over E
        MoELayer(32, 16, 2, routing=RoutingConfig(4))
    with pytest.raises(ValueError, match=r"routing\.bias.*\(8,\)"):  # a bias of another E
        MoELayer(32, 16, 8, routing=RoutingConfig(2, bias=torch.zeros(6), **ds))


# ---------------------------------------------------------------- rejections


def _base(g):
    x, w13, w2, ids, wts = _problem(3, 128, 128, 4, 2, g)
    return dict(hidden_states=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=wts)


REJECT = [
    (lambda a: a.update(w13=a["w13"][:, :, :64]), "shape of w13"),  # H mismatch
    (lambda a: a.update(w13=a["w13"][:, :255]), "shape of w13"),  # odd 2I
    (lambda a: a.update(w2=a["w2"][:3]), "shape of w2"),  # E_local mismatch
    (lambda a: a.update(w2=a["w2"][:, :, :64]), "shape of w2"),  # I mismatch
    (lambda a: a.update(w2=a["w2"].double()), "dtype of w2"),
    (lambda a: a.update(hidden_states=a["hidden_states"].int()), "dtype of hidden_states"),
    (lambda a: a.update(hidden_states=a["hidden_states"][None]), "shape of hidden_states"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), "dtype of topk_ids"),
    (lambda a: a.update(topk_ids=a["topk_ids"].to(torch.int16)), "dtype of topk_ids"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:2]), "shape of topk_ids"),
    (lambda a: a.update(topk_weights=a["topk_weights"].int()), "dtype of topk_weights"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), "shape of topk_weights"),
    (lambda a: a.update(topk_weights=None), "topk_weights"),  # half the routing
    (lambda a: a.update(topk_ids=None, topk_weights=None), "topk_ids"),  # no routing at all
    (lambda a: a.update(top_k=2), "top_k"),  # routing args with topk tensors
    (lambda a: a.update(n_group=2), "n_group"),
    (lambda a: a.update(routing=RoutingConfig(2)), "routing"),
    (lambda a: a.update(routing_replay_out=torch.zeros(3, 2, dtype=torch.int16)), "routing_replay_out"),
    (lambda a: a.update(router_logits=torch.zeros(3, 4)), "topk_ids"),  # logits and topk tensors together
    (lambda a: a.update(activation="gelu"), "activation"),
    (lambda a: a.update(local_expert_offset=-1), "local_expert_offset"),
    (lambda a: a.update(local_expert_offset=2, num_experts=5), "local_expert_offset"),  # slice past E
    (lambda a: a.update(out=torch.zeros(3, 64)), "shape of out"),
    (lambda a: a.update(out=torch.zeros(3, 128, dtype=torch.float16)), "dtype of out"),
    (lambda a: a.update(backend="cuda"), "backend"),
    (lambda a: a.update(w13_scale=torch.ones(4, 2, 1)), "w2_scale"),  # one scale only
    (lambda a: a.update(batch_invariant=1), "batch_invariant"),  # a bool, not a truthy int
    (
        lambda a: a.update(out=torch.zeros(3, 128, requires_grad=True)),
        "value of out.*leaf",
    ),  # written in place
]


@pytest.mark.parametrize("mutate,match", REJECT)
def test_fused_moe_rejects(mutate, match, generator):
    a = _base(generator)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        fused_moe(a.pop("hidden_states"), a.pop("w13"), a.pop("w2"), **a)


def _fp8_base(g, H=128, I=128):  # noqa: E741
    x, w13, w2, ids, wts = _problem(3, H, I, 4, 2, g)
    q13, s13 = quantize_fp8_block(w13)
    q2, s2 = quantize_fp8_block(w2)
    return dict(hidden_states=x.bfloat16(), w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, topk_ids=ids,
                topk_weights=wts)  # fmt: skip


REJECT_FP8 = [
    (lambda a: a.update(w13_scale=a["w13_scale"][:, :1]), "shape of w13_scale"),
    (lambda a: a.update(w2_scale=a["w2_scale"][:3]), "shape of w2_scale"),
    (lambda a: a.update(w2_scale=a["w2_scale"].double()), "dtype of w2_scale"),
    # same values and shape, strided storage: the kernels step through scale blocks with unit stride
    (lambda a: a.update(w13_scale=torch.cat([a["w13_scale"]] * 2, dim=2)[..., :1]), "layout of w13_scale"),
    (lambda a: a.update(w13=a["w13"].float()), "dtype of w13"),  # scales with non-fp8 weights
    (lambda a: a.update(out=torch.zeros(3, 128, dtype=torch.float32)), "dtype of out"),  # fp8 path gives bf16
]


@pytest.mark.parametrize("mutate,match", REJECT_FP8)
def test_fused_moe_fp8_rejects(mutate, match, generator):
    a = _fp8_base(generator)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        fused_moe(a.pop("hidden_states"), a.pop("w13"), a.pop("w2"), **a)


def test_fused_moe_refuses_before_writing_capture_buffers(generator):
    # fp8 weights are inference-only: with logits that require grad the call is refused before routing
    # writes the caller's capture buffers (they were filled, then the error came)
    a = _fp8_base(generator)
    a.pop("topk_ids"), a.pop("topk_weights")
    logits = torch.randn(3, 4, requires_grad=True)
    cap = torch.full((4, 2), -1, dtype=torch.int16)
    wcap = torch.full((4, 2), -1.0)
    with pytest.raises(ValueError, match="w13_scale.*gradients"):
        fused_moe(a.pop("hidden_states"), a.pop("w13"), a.pop("w2"), router_logits=logits, top_k=2,
                  routing_replay_out=cap, routing_weights_out=wcap, **a)  # fmt: skip
    assert (cap == -1).all() and (wcap == -1).all()


def test_fused_moe_fp8_rejects_dims_not_multiple_of_128():
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 256, 96).to(torch.float8_e4m3fn)
    w2 = torch.zeros(2, 96, 128).to(torch.float8_e4m3fn)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        fused_moe(x, w13, w2, topk_ids=ids, topk_weights=torch.ones(2, 1), w13_scale=torch.ones(2, 2, 1),
                  w2_scale=torch.ones(2, 1, 1))  # fmt: skip


def test_routing_inside_needs_top_k(generator):
    a = _base(generator)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(a["hidden_states"], a["w13"], a["w2"], router_logits=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="router_logits"):
        fused_moe(a["hidden_states"], a["w13"], a["w2"], router_logits=torch.zeros(2, 4), top_k=2)
    with pytest.raises(ValueError, match="num_experts"):
        fused_moe(
            a["hidden_states"], a["w13"], a["w2"], router_logits=torch.zeros(3, 4), top_k=2, num_experts=8
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routing_inside_expert_count_mismatch(backend, generator):
    # logits over 5 experts, weights for 4, no expert-parallel arguments: was expert 4's share silently
    # dropped; now an error naming both arguments and both counts (before any routing or kernel)
    a = _base(generator)  # w13 / w2 for 4 experts
    x, w13, w2 = a["hidden_states"], a["w13"], a["w2"]
    for E in (5, 3):  # more experts in the logits than weights, and fewer
        with pytest.raises(ValueError, match=rf"router_logits over {E} experts and w13 for 4"):
            fused_moe(x, w13, w2, router_logits=torch.randn(3, E), top_k=2, backend=backend)
    # a rank's slice is legitimate with the expert-parallel arguments: experts 1..4 of 5 here
    logits = torch.randn(3, 5, generator=generator)
    for kw in ({"num_experts": 5}, {"local_expert_offset": 1}, {"local_expert_offset": 1, "num_experts": 5}):
        assert fused_moe(x, w13, w2, router_logits=logits, top_k=2, backend="torch", **kw).shape == x.shape


# ---------------------------------------------------------------- caller ids (topk_ids) checked by value

# E = 8 experts in all; rank slice [2, 5) (E_local = 3) with num_experts = 8. Valid rows: distinct
# global ids in [0, 8) or -1 (a slot with no expert); anything else names topk_ids, the rule and the row.
_RANGE = r"Invalid value of topk_ids: expected expert ids in \[0, 8\) \(or -1: a slot with no expert\)"
_DISTINCT = r"Invalid value of topk_ids: expected distinct expert ids within each row"
BAD_IDS = [
    pytest.param([[0, 1], [2, 10**6], [4, 5]], _RANGE + r", got row 1 = \[2, 1000000\]", id="high"),  # 10**6
    pytest.param([[0, 1], [2, 3], [-3, 5]], _RANGE + r", got row 2 = \[-3, 5\]", id="negative"),  # -3
    pytest.param([[0, 1], [2, 8], [4, 5]], _RANGE + r", got row 1 = \[2, 8\]", id="E"),  # one past the end
    pytest.param([[0, 1], [6, 6], [4, 5]], _DISTINCT + r", got row 1 = \[6, 6\]", id="duplicate"),
    # several -1 in a row are no duplicate (row 0), a repeated id is
    pytest.param([[-1, -1], [7, -1], [3, 3]], _DISTINCT + r", got row 2 = \[3, 3\]", id="dup-after-minus-1"),
]


def _slice_problem(g, id_rows, dtype=torch.float32):
    """A rank's slice: experts [2, 5) of E = 8 (T = 3, K = 2), with the given global ids."""
    x, w13, w2, _, wts = _problem(3, 32, 16, 8, 2, g, dtype)
    ids = torch.tensor(id_rows, dtype=torch.int32)
    kw = dict(topk_ids=ids, topk_weights=wts, local_expert_offset=2, num_experts=8)
    return x, w13[2:5], w2[2:5], kw


def _call(backend, x, w13, w2, **kw):
    if backend == "reference":  # the executable spec rejects the same values
        return fused_moe_torch(x, w13, w2, **kw)
    return fused_moe(x, w13, w2, backend=backend, **kw)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])  # triton: raises before any launch
@pytest.mark.parametrize("rows,match", BAD_IDS)
def test_topk_ids_rejected_by_value(rows, match, backend, id_dtype, generator):
    x, w13, w2, kw = _slice_problem(generator, rows)
    kw["topk_ids"] = kw["topk_ids"].to(id_dtype)
    with pytest.raises(ValueError, match=match):
        _call(backend, x, w13, w2, **kw)


def test_topk_ids_range_is_the_whole_model(generator):
    # num_experts defaults to local_expert_offset + E_local (here 5): id 5 is past it; with
    # num_experts = 8 the same id is legal though outside the slice [2, 5) (another rank owns it)
    x, w13, w2, kw = _slice_problem(generator, [[0, 1], [2, 5], [4, 7]])
    fused_moe(x, w13, w2, backend="torch", **kw)
    del kw["num_experts"]
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 5\).*row 1 = \[2, 5\]"):
        fused_moe(x, w13, w2, backend="torch", **kw)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "rows",
    [
        [[0, 1], [3, 4], [7, 2]],  # every id in [0, E), some outside the slice [2, 5)
        [[-1, 3], [7, -1], [4, 2]],  # -1 mixed into rows (other ranks' slots, as the dispatch marks them)
        [[-1, -1], [3, -1], [-1, 4]],  # a whole -1 row (EP padding) and -1 beside ids
    ],
)
def test_valid_topk_ids_same_bits_as_without_the_check(rows, id_dtype, generator):
    # the check changes nothing on valid ids: bitwise the unchecked call (the code path before the
    # check) and the reference loop itself; -1 slots contribute nothing (the per-token formula)
    from replaymoe.moe._reference import experts_torch

    x, w13, w2, kw = _slice_problem(generator, rows)
    kw["topk_ids"] = kw["topk_ids"].to(id_dtype)
    out = fused_moe(x, w13, w2, backend="torch", **kw)
    assert torch.equal(out, fused_moe(x, w13, w2, backend="torch", check_ids=False, **kw))
    loop = experts_torch(x, w13, w2, kw["topk_ids"], kw["topk_weights"], w13_scale=None, w2_scale=None,
                         local_expert_offset=2, out_dtype=x.dtype)  # fmt: skip
    assert torch.equal(out, loop)
    assert_close(out, per_token_formula(x, w13, w2, kw["topk_ids"], kw["topk_weights"], 2).float(),
                 dtype=torch.float32)  # fmt: skip


@pytest.mark.interpret
@pytest.mark.parametrize("rows", [[[-1, 3], [7, -1], [4, 2]], [[-1, -1], [3, -1], [-1, 4]]])  # as above
def test_valid_topk_ids_with_minus_one_on_triton(rows, generator):
    # the Triton path (interpreter, fp32) accepts the same -1 slots and matches the reference
    x, w13, w2, kw = _slice_problem(generator, rows)
    out = fused_moe(x, w13, w2, backend="triton", **kw)
    assert_close(out, fused_moe_torch(x, w13, w2, **kw), dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_check_ids_false_skips_the_check(backend, generator):
    # trusted ids are not checked: an id past E is dropped, a duplicate counted twice, as the loop does
    x, w13, w2, kw = _slice_problem(generator, [[3, 3], [2, 10**6], [-3, 4]])
    out = _call(backend, x, w13, w2, check_ids=False, **kw)
    assert_close(out, per_token_formula(x, w13, w2, kw["topk_ids"], kw["topk_weights"], 2).float(),
                 dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="check_ids"):  # a bool, not a truthy int
        _call(backend, x, w13, w2, check_ids=1, **kw)


def test_cpu_ids_are_checked_even_when_route_made_them(generator):
    # on the CPU the check costs no host sync, so route()'s marked output is checked by value too:
    # writes that bypass the version counter (.data, .numpy()) cannot slip through
    from replaymoe import route

    x, w13, w2, _, _ = _problem(3, 32, 16, 8, 2, generator)
    ids, wts = route(torch.randn(3, 8, generator=generator), 2)
    fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="torch")  # valid: accepted
    ids.data[0, 0] = 99  # the version counter does not move
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 8\).*row 0 = \[99, "):
        fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="torch")
    ids2, _ = route(torch.randn(3, 8, generator=generator), 2)
    ids2.numpy()[1, 1] = ids2[1, 0]  # a duplicate through numpy's view of the same memory
    with pytest.raises(ValueError, match="topk_ids: expected distinct expert ids.*row 1"):
        fused_moe(x, w13, w2, topk_ids=ids2, topk_weights=wts, backend="torch")


def test_valid_mark_follows_the_version_counter(generator):
    # the mark that lets CUDA ids from route() skip the check: kept while the tensor is unmodified,
    # gone after an in-place write (through a view too) or for a smaller model; inference tensors,
    # which have no version counter, are not marked (route() under inference_mode works)
    from replaymoe import route
    from replaymoe.routing._checks import _marked_valid

    ids, _ = route(torch.randn(3, 8, generator=generator), 2)
    assert _marked_valid(ids, 8) and _marked_valid(ids, 16)  # a larger model: still valid
    assert not _marked_valid(ids, 4) and not _marked_valid(ids.clone(), 8)
    ids[0, 1] = ids[0, 0]
    assert not _marked_valid(ids, 8)
    ids2, _ = route(torch.randn(3, 8, generator=generator), 2)
    ids2.view(-1)[0] = 5
    assert not _marked_valid(ids2, 8)
    x, w13, w2, _, _ = _problem(3, 32, 16, 8, 2, generator)
    with torch.inference_mode():
        ids3, wts3 = route(torch.randn(3, 8, generator=generator), 2)
        assert not _marked_valid(ids3, 8)
        fused_moe(x, w13, w2, topk_ids=ids3, topk_weights=wts3, backend="torch")


@pytest.mark.interpret
def test_check_ids_false_skips_the_check_on_triton(generator):
    # the kernels drop an id past E as any id outside the slice (interpreter, fp32)
    x, w13, w2, kw = _slice_problem(generator, [[3, 2], [2, 10**6], [-3, 4]])
    out = fused_moe(x, w13, w2, backend="triton", check_ids=False, **kw)
    assert_close(out, per_token_formula(x, w13, w2, kw["topk_ids"], kw["topk_weights"], 2).float(),
                 dtype=torch.float32)  # fmt: skip


def test_replay_ids_through_fused_moe_keep_route_messages(generator):
    # with router_logits the caller ids are replay_ids: route's check and messages, unchanged;
    # check_ids=False skips it there too (route's check_replay=False)
    x, w13, w2, _, _ = _problem(3, 32, 16, 8, 2, generator)
    logits = tie_free_logits(3, 8, generator=generator)
    bad = torch.tensor([[1, 4], [-1, -1], [7, 7]])
    msg = r"Invalid value of replay_ids: expected distinct expert ids within each row, got row 2 = \[7, 7\]"
    with pytest.raises(ValueError, match=msg):
        fused_moe(x, w13, w2, router_logits=logits, top_k=2, replay_ids=bad, backend="torch")
    mixed = torch.tensor([[1, -1], [2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"replay_ids: expected each row either all -1"):
        fused_moe(x, w13, w2, router_logits=logits, top_k=2, replay_ids=mixed, backend="torch")
    good = torch.tensor([[1, 4], [-1, -1], [7, 0]])
    ref = fused_moe(x, w13, w2, router_logits=logits, top_k=2, replay_ids=good, backend="torch")
    unchecked = fused_moe(x, w13, w2, router_logits=logits, top_k=2, replay_ids=good, backend="torch",
                          check_ids=False)  # fmt: skip
    assert torch.equal(ref, unchecked)


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.interpret)],  # triton: the kernels interpreted
)
def test_topk_ids_checked_under_torch_compile(backend, generator):
    # eager validation cannot run inside a compiled graph (it syncs): the op replaymoe::check_topk_ids
    # runs there instead, so a compiled step rejects bad ids with the same ValueError; check_ids=False
    # leaves it out (aot_eager: no C++ compiler needed on CPU)
    torch._dynamo.reset()
    x, w13, w2, kw = _slice_problem(generator, [[0, 1], [3, -1], [4, 7]])
    ids, wts = kw.pop("topk_ids"), kw.pop("topk_weights")

    def layer(x, ids, wts, check):
        return fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend=backend, check_ids=check, **kw)

    checked = torch.compile(lambda x, i, w: layer(x, i, w, True), fullgraph=True, backend="aot_eager")
    unchecked = torch.compile(lambda x, i, w: layer(x, i, w, False), fullgraph=True, backend="aot_eager")
    out = checked(x, ids, wts)
    assert torch.equal(out, unchecked(x, ids, wts))  # the op's copy changes no value
    assert_close(out, layer(x, ids, wts, True), dtype=torch.float32)
    for rows, match in [
        ([[0, 1], [3, 10**6], [4, 7]], r"topk_ids: expected expert ids in \[0, 8\).*row 1 = \[3, 1000000\]"),
        ([[0, 1], [3, -1], [-3, 7]], r"topk_ids: expected expert ids in \[0, 8\).*row 2 = \[-3, 7\]"),
        ([[0, 1], [3, 3], [4, 7]], r"topk_ids: expected distinct expert ids.*row 1 = \[3, 3\]"),
    ]:
        bad = torch.tensor(rows, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            checked(x, bad, wts)
        unchecked(x, bad, wts)  # not checked: no error
    torch._dynamo.reset()


def test_bench_moe_check_ids_arguments(tmp_path, capsys):
    # --check-ids times replaymoe alone: with --peer-dir an argument error before anything runs;
    # without a GPU the documented exit code, nothing written
    from replaymoe.bench import moe as bench_moe
    from replaymoe.bench._timing import NO_CUDA_EXIT

    with pytest.raises(SystemExit) as exc:
        bench_moe.main(["--check-ids", "--peer-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "--peer-dir does not apply" in capsys.readouterr().err
    for extra in (
        ["--read-floors", "--peer-dir", str(tmp_path)],
        ["--launches", "--peer-dir", str(tmp_path)],
        ["--read-floors", "--check-ids"],
        ["--launches", "--check-ids"],
    ):
        with pytest.raises(SystemExit) as exc:  # one measurement at a time, replaymoe alone
            bench_moe.main([*extra, "--out", str(tmp_path / "out")])
        assert exc.value.code == 2
    for bad in (["--tokens", "x"], ["--tokens", "0"], ["--shapes", "nope"]):  # named on any machine
        with pytest.raises(SystemExit) as exc:
            bench_moe.main([*bad, "--out", str(tmp_path / "out")])
        assert exc.value.code == 2 and bad[0] in capsys.readouterr().err
    if not torch.cuda.is_available():
        for mode in ("--check-ids", "--launches"):
            assert bench_moe.main([mode, "--out", str(tmp_path / "out")]) == NO_CUDA_EXIT
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_bench_device_ops_counts_each_operation_of_a_call():
    # bench moe --launches' counter: two kernels per call, over three profiled calls, is 2 per call,
    # each named once; a kernel run twice per call is named once with its count
    from replaymoe.bench.launches import device_ops

    a = torch.zeros(1024, device="cuda")
    b = torch.zeros(1024, device="cuda")
    count, names = device_ops(lambda: (a.add_(1), b.mul_(2)))
    assert count == 2 and len(names) == 2
    count, names = device_ops(lambda: (a.add_(1), a.add_(1)))
    assert count == 2 and len(names) == 1 and names[0].endswith("×2")


# ---------------------------------------------------------------- Triton under the interpreter

INTERP_CASES = [
    # (T, H, I, E, K, dtype, config or None) -- edge each hits
    (1, 64, 32, 4, 2, torch.float32, None),  # decode mode (one tile per slot), chosen by shape
    (6, 64, 32, 4, 2, torch.float16, None),  # layout mode, BM=16 tiles with padding
    (
        13,
        64,
        48,
        3,
        2,
        torch.float16,
        MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2),
    ),  # I not /BN, ragged K
    (
        10,
        80,
        32,
        4,
        3,
        torch.float32,
        MoEConfig(False, 32, 16, 32, 4, 2, 32, 32, 4, 2),
    ),  # H not /BK (mask path)
    (3, 64, 32, 5, 2, torch.float16, MoEConfig(True, 16, 16, 32, 4, 2, 32, 32, 4, 2)),  # decode mode forced
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,H,I,E,K,dtype,cfg", INTERP_CASES)
def test_triton_interpreter_matches_reference(T, H, I, E, K, dtype, cfg, generator):  # noqa: E741
    x, w13, w2, ids, wts = _problem(T, H, I, E, K, generator, dtype)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), topk_ids=ids, topk_weights=wts)
    out = poison(torch.empty(T, H, dtype=dtype))
    if cfg is None:
        res = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, out=out, backend="triton")
    else:
        res = experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0,
                              out=out, config=cfg)  # fmt: skip
    assert res is out
    assert_close(out, ref, dtype=dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("direct", [True, False])
def test_triton_interpreter_ep_partial_sums(direct, generator):
    # EP slices on the Triton path (both modes): partial sums add up; -1 padding ids ignored
    x, w13, w2, ids, wts = _problem(5, 64, 32, 6, 2, generator, torch.float32)
    ids[4] = -1
    cfg = MoEConfig(direct, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    full = fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts)
    kw = dict(w13_scale=None, w2_scale=None, out=None, config=cfg)
    parts = [
        experts_triton(x, w13[a:b], w2[a:b], ids, wts, local_expert_offset=a, **kw)
        for a, b in ((0, 4), (4, 6))
    ]
    assert_close(parts[0] + parts[1], full, dtype=torch.float32)
    assert (parts[0][4] == 0).all()


@pytest.mark.interpret
def test_triton_interpreter_routing_inside_and_empty(generator):
    x, w13, w2, _, _ = _problem(4, 64, 32, 4, 2, generator, torch.float16)
    logits = tie_free_logits(4, 4, generator=generator)
    out = fused_moe(x, w13, w2, router_logits=logits, top_k=2, backend="triton")
    ref = fused_moe(x.float(), w13.float(), w2.float(), router_logits=logits, top_k=2, backend="torch")
    assert_close(out, ref, dtype=torch.float16)
    e = fused_moe(x[:0], w13, w2, router_logits=logits[:0], top_k=2, backend="triton")
    assert e.shape == (0, 64) and e.dtype == torch.float16


def test_custom_op_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16)
        out = torch.empty(4, 64, dtype=torch.bfloat16)
        torch.ops.replaymoe.moe_experts(
            x, torch.empty(2, 64, 64, dtype=torch.bfloat16), torch.empty(2, 64, 32, dtype=torch.bfloat16),
            torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 2), None, None, 0, out,
            [0, 16, 32, 32, 4, 2, 32, 32, 4, 2, 8],
        )  # fmt: skip
        assert out.shape == (4, 64)


# ---------------------------------------------------------------- TMA descriptors (tile mode)

TMA_CASES = [
    # (T, H, I, E, K, dtype, config without tma) -- edge each hits
    pytest.param(1, 64, 32, 4, 2, torch.float32, MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2),
                 id="T1-tile"),  # one token in tile mode: one tile, 15 padding rows read by TMA
    pytest.param(13, 64, 48, 3, 2, torch.float16, MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2),
                 id="I-ragged"),  # I not /BN1 (gate tile reads up rows), GEMM2's last K chunk zero-filled
    pytest.param(10, 80, 40, 4, 3, torch.float32, MoEConfig(False, 32, 16, 32, 4, 2, 32, 32, 4, 2),
                 id="H-ragged"),  # GEMM1's K ragged (zero fill past H), w2 tile rows past H: next expert
    pytest.param(200, 64, 32, 8, 2, torch.float16, MoEConfig(False, 64, 32, 32, 4, 2, 64, 32, 4, 2),
                 id="T200-empty-experts"),  # several tiles per expert; experts 3, 4, 6, 7 get no token
    pytest.param(40, 320, 192, 4, 2, torch.float16, MoEConfig(False, 128, 128, 64, 8, 4, 256, 64, 8, 4, 4),
                 id="prefill-blocks"),  # the wrapper's prefill tiles; H not /BN2, I not /BN1
]  # fmt: skip


# The TMA kernels read the padding rows of GEMM2's input (never written: torch.empty garbage, NaN at
# times); they only feed output rows that are not stored, but numpy warns about them in the interpreter.
_GARBAGE_ROWS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _count_descs(monkeypatch):
    """Record the TMA descriptors ``_launch`` makes (None where it falls back to pointer loads)."""

    made = []
    real = moe_fwd.rows_desc

    def spy(*a):
        d = real(*a)
        made.append(d)
        return d

    monkeypatch.setattr(moe_fwd, "rows_desc", spy)
    return made


def _descs_expected(cfg) -> int:
    """Descriptors a TMA tile-mode ``_launch`` makes: w13, w2 and the SwiGLU rows, plus those rows with
    half-height blocks where half tiles apply (configs.uses_half_tiles)."""

    return 3 + cfgs.uses_half_tiles(cfg, False)


def _tma_pair(x, w13, w2, ids, wts, cfg, monkeypatch, *, offset=0, variant=None):
    """Outputs (pointer loads, TMA) of the same configuration, and the TMA run's descriptors."""
    from dataclasses import replace

    from replaymoe.moe._forward import STANDARD

    outs = []
    for tma in (False, True):
        _defaults(monkeypatch, tma=not tma)  # the configuration's tma wins either way
        made = _count_descs(monkeypatch)
        out = poison(torch.empty(x.shape[0], x.shape[1], dtype=x.dtype))
        experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=offset,
                       out=out, config=replace(cfg, tma=tma), variant=variant or STANDARD)  # fmt: skip
        outs.append(out)
    return outs[0], outs[1], made


@pytest.mark.interpret
@_GARBAGE_ROWS
@pytest.mark.parametrize("T,H,I,E,K,dtype,cfg", TMA_CASES)
def test_tma_tile_mode_bitwise_equals_pointer_loads(T, H, I, E, K, dtype, cfg, generator, monkeypatch):  # noqa: E741
    # bitwise only because the problem is exact in any order (_exact_problem); on the GPU,
    # test_gpu_tma_prefill_bitwise_equals_pointer_loads makes the claim for random inputs
    x, w13, w2, ids, wts = _exact_problem(T, H, I, E, K, generator, dtype)
    if E == 8:  # skewed: only experts 0, 1, 2, 5 are routed to
        pick = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
        ids = torch.stack([pick[torch.randperm(4, generator=generator)[:K]] for _ in range(T)])
    plain, tma, made = _tma_pair(x, w13, w2, ids, wts, cfg, monkeypatch)
    assert len(made) == _descs_expected(cfg) and all(d is not None for d in made)  # w13, w2, inter
    assert torch.equal(tma, plain)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), topk_ids=ids, topk_weights=wts)
    assert_close(tma, ref, dtype=dtype)


@pytest.mark.interpret
@_GARBAGE_ROWS
def test_tma_ep_slice_bitwise(generator, monkeypatch):
    # EP: local experts 2..5 of 8 (weights are slices at an offset: descriptors over views), ids
    # outside the local range and -1 padding ids skipped
    T, H, I, E, K = 21, 64, 32, 8, 3  # noqa: E741
    x, w13, w2, ids, wts = _exact_problem(T, H, I, E, K, generator, torch.float16)  # exact in any order
    ids[3] = -1
    cfg = MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    plain, tma, made = _tma_pair(x, w13[2:6], w2[2:6], ids, wts, cfg, monkeypatch, offset=2)
    assert len(made) == _descs_expected(cfg) and all(d is not None for d in made)
    assert torch.equal(tma, plain)
    ref = fused_moe_torch(x.float(), w13[2:6].float(), w2[2:6].float(), topk_ids=ids, topk_weights=wts,
                          local_expert_offset=2, num_experts=E)  # fmt: skip
    assert_close(tma, ref, dtype=torch.float16)
    assert (tma[3] == 0).all()


@pytest.mark.interpret
@_GARBAGE_ROWS
def test_tma_interleaved_bias_and_strided_fallback(generator, monkeypatch):
    # gpt-oss variant with contiguous interleaved weights: one [2 BN, BK] descriptor block for gate+up;
    # transformers' transposed views (stride along K != 1) must fall back to pointer loads
    from replaymoe.moe._forward import ExpertsVariant

    T, H, I, E, K = 11, 64, 48, 4, 2  # noqa: E741
    x, w13, w2, ids, wts = _exact_problem(T, H, I, E, K, generator, torch.float16)  # exact in any order
    b13 = torch.randn(E, 2 * I, generator=generator).to(torch.float16)
    b2 = torch.randn(E, H, generator=generator).to(torch.float16)
    v = ExpertsVariant(b13, b2, act=1, alpha=1.702, limit=7.0, interleaved=True)
    cfg = MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    plain, tma, made = _tma_pair(x, w13, w2, ids, wts, cfg, monkeypatch, variant=v)
    assert [tuple(d.block_shape) for d in made] == [(64, 32), (32, 32), (16, 32)]
    assert torch.equal(tma, plain)
    w13_t, w2_t = (
        w13.transpose(1, 2).contiguous().transpose(1, 2),
        w2.transpose(1, 2).contiguous().transpose(1, 2),
    )
    plain_t, tma_t, made = _tma_pair(x, w13_t, w2_t, ids, wts, cfg, monkeypatch, variant=v)
    assert made == [None, None]  # no descriptor for strided weights (nor for inter without w2's)
    assert torch.equal(tma_t, plain) and torch.equal(plain_t, plain)


@pytest.mark.interpret
@_GARBAGE_ROWS
def test_tma_training_forward_bitwise(generator):
    # the training forward (GEMM1 also stores the gate/up rows per slot) with and without TMA
    from dataclasses import replace

    from replaymoe.moe.configs import config_tuple

    x, w13, w2, ids, wts = _exact_problem(9, 64, 32, 4, 2, generator, torch.float32)  # exact in any order
    cfg = MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    res = [torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, config_tuple(replace(cfg, tma=t)),
                                                 False) for t in (False, True)]  # fmt: skip
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_tma_config_selection_and_config_lists():
    from replaymoe.moe.configs import config_from_list, config_tuple, moe_config, tma_ok

    qwen = (4096, 8, 2048, 768, 128)
    assert moe_config(*qwen, tma=True).tma  # prefill tiles on a TMA device
    assert not moe_config(*qwen).tma  # the default: pointer loads
    assert not moe_config(*qwen, fp8=True, tma=True).tma  # fp8 keeps pointer loads
    assert not moe_config(1, 8, 2048, 768, 128, tma=True).tma  # decode (direct mode)
    assert not moe_config(64, 8, 2048, 768, 128, tma=True).tma  # mid-size 16/32-row tiles: unchanged
    c = moe_config(*qwen, tma=True)
    assert config_from_list(config_tuple(c)) == c and config_tuple(c)[11:] == [1, -1, -1, -1, -1, -1]  # None
    old = [0, 16, 32, 32, 4, 2, 32, 32, 4, 2, 8]  # a config list from before the tma field
    assert config_from_list(old) == MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2, 8, False)
    assert config_from_list(old + [1]) == MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2, 8, True)
    for half in (None, False, True):  # the optional switches cross the custom ops as -1 / 0 / 1
        for pdl in (None, False, True):
            for swap in (None, False, True):
                for fused in (None, False, True):
                    for merge in (None, False, True):
                        c = MoEConfig(True, 16, 32, 32, 4, 2, 32, 32, 4, 2, half_tiles=half, pdl=pdl,
                                      swap_ab=swap, fused_reduce=fused, merge_slots=merge)  # fmt: skip
                        assert config_from_list(config_tuple(c)) == c
    # 14-, 15- and 16-entry lists from before swap_ab, fused_reduce and merge_slots
    none_after = dict(swap_ab=None, fused_reduce=None, merge_slots=None)
    assert config_from_list(config_tuple(c)[:14]) == dataclasses.replace(c, **none_after)
    none_after.pop("swap_ab")
    assert config_from_list(config_tuple(c)[:15]) == dataclasses.replace(c, **none_after)
    assert config_from_list(config_tuple(c)[:16]) == dataclasses.replace(c, merge_slots=None)
    assert not tma_ok(torch.device("cpu"))  # never chosen on CPU / in the interpreter
    assert not tma_ok(torch.device("cuda"), torch.float32)  # fp32: pointer loads (TMA tiles spill)


def test_tma_process_default_reaches_the_configuration(monkeypatch):
    # the process default DEFAULTS.tma (REPLAYMOE_TMA) is what the wrapper's choice follows (tma_ok ->
    # moe_config), on a device that allows TMA; a configuration given with the call says it itself; the
    # backward's dw_tma and gemm_tma follow the same default (dw_tma_ok -> moe_bwd_config)
    from replaymoe.moe.configs import moe_config, tma_ok

    dev = torch.device("cuda", 7)
    monkeypatch.setitem(cfgs._HOPPER_DEVICES, dev, True)  # as a Hopper GPU would
    qwen = (4096, 8, 2048, 768, 128)
    for default in (False, True):
        _defaults(monkeypatch, tma=default)
        assert tma_ok(dev) is default
        assert moe_config(*qwen, tma=tma_ok(dev)).tma is default
        assert cfgs.dw_tma_ok(dev, torch.bfloat16) is default
        bwd = cfgs.moe_bwd_config(4096, 8, 2048, 768, 128, tma=cfgs.dw_tma_ok(dev, torch.bfloat16))
        assert bwd.dw_tma is default and bwd.gemm_tma is default


# ---------------------------------------------------------------- GPU

MODELS = {
    # name: (H, I, E, K)
    "deepseek": (7168, 2048, 256, 8),
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
_WEIGHTS: dict = {}


def _gpu_weights(name, fp8):
    from replaymoe.bench.moe import make_weights

    if (name, fp8) not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        H, I, E, _ = MODELS[name]  # noqa: E741
        _WEIGHTS[(name, fp8)] = make_weights(H, I, E, fp8=fp8)
    return _WEIGHTS[(name, fp8)]


def _gpu_routing(T, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    r = route_torch(logits, K)
    return logits, r.topk_ids, r.topk_weights


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("T", [1, 8, 64, 256, 4096])
def test_gpu_model_shapes_vs_reference(name, T, fp8):
    H, I, E, K = MODELS[name]  # noqa: E741
    w13, w2, s13, s2 = _gpu_weights(name, fp8)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(T, E, K, T)
    out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
    fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, w13_scale=s13, w2_scale=s2, out=out)
    # the reference loops over experts and upcasts only the active ones
    ref = fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts, w13_scale=s13, w2_scale=s2)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert not torch.isnan(out).any()
    assert rel < (2e-2 if fp8 else 6e-3), rel


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("T", [1, 64, 256, 4096])  # direct mode; 4-8, then 32 and more rows per expert
def test_gpu_fp32_every_mode_fits_and_matches_reference(T, train):
    # fp32 tiles take twice bf16's shared memory: the bf16 choice at 64+ rows per expert asked for
    # 288 KiB (out of resource on Hopper) before moe_config fitted it (fit_shared_memory)
    H, I, E, K = 256, 128, 8, 2  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(5)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).requires_grad_(train)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.05).requires_grad_(train)
    x = torch.randn(T, H, device="cuda", generator=g, requires_grad=train)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    wts = torch.rand(T, K, device="cuda", generator=g)
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts)
    # the reference in fp64, so the comparison holds the kernels' fp32 error alone
    leaves = [t.detach().double().requires_grad_(train) for t in (x, w13, w2)]
    ref = fused_moe_torch(*leaves, topk_ids=ids, topk_weights=wts.double())
    assert_close(out, ref.float(), dtype=torch.float32)
    if train:
        # one upstream gradient for both (a loss of `out` would carry the forwards' own difference
        # into every gradient, summed over an expert's rows)
        dout = torch.randn(T, H, device="cuda", generator=g)
        grads = torch.autograd.grad(out, (x, w13, w2), dout)
        refs = torch.autograd.grad(ref, leaves, dout.double())
        # norm-relative: a weight gradient sums up to T*K/E = 1024 rows in fp32 and an element may cancel
        # far below its terms (fp32 lands near 3e-7 here; a TF32 dot would read about 1e-4)
        for name, a, b in zip(("dx", "dw13", "dw2"), grads, refs):
            err = float((a.double() - b).norm() / b.norm())
            assert err < 1e-5, f"{name}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,offset,E_local,batch_invariant",
    [
        (1, 0, 64, True),  # one token: direct mode, GEMM1 writes e4m3 SwiGLU rows (128-column blocks)
        (4, 0, 64, True),  # several tokens (eager: the direct mode, its extra expert reads are cheap)
        (1, 16, 24, True),  # EP slice: some slots are not local (their tiles do nothing)
        (1, 0, 64, False),  # 16-row decode tiles (mma.sync) with the same e4m3 rows
        (4, 16, 24, False),  # both: several tokens, an EP slice and 16-row tiles
    ],
)
def test_gpu_fp8_decode_vs_reference(T, offset, E_local, batch_invariant):
    # the fp8 decode path (direct mode) against the fp8 reference, whole and as an EP slice
    H, I, E, K = 1024, 512, 64, 8  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(11)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.03
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    wts = torch.rand(T, K, device="cuda", generator=g)
    sl = slice(offset, offset + E_local)
    kw = dict(topk_ids=ids, topk_weights=wts, w13_scale=s13[sl], w2_scale=s2[sl], local_expert_offset=offset,
              num_experts=E)  # fmt: skip
    out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
    fused_moe(x, q13[sl], q2[sl], out=out, batch_invariant=batch_invariant, **kw)
    ref = fused_moe_torch(x, q13[sl], q2[sl], **kw)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert not torch.isnan(out).any()
    assert rel < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gpu_graph_determinism_and_capture_bit_identity(T):
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits, _, _ = _gpu_routing(T, E, K, 7)
    cap = torch.empty(T, K, device="cuda", dtype=torch.int16)
    eager = fused_moe(x, w13, w2, router_logits=logits, top_k=K)
    again = fused_moe(x, w13, w2, router_logits=logits, top_k=K)
    with_cap = fused_moe(x, w13, w2, router_logits=logits, top_k=K, routing_replay_out=cap)
    assert torch.equal(eager, again)  # run to run
    assert torch.equal(eager, with_cap)  # capture on/off
    out = poison(torch.empty_like(eager))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, w13, w2, router_logits=logits, top_k=K, routing_replay_out=cap, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(x, w13, w2, router_logits=logits, top_k=K, routing_replay_out=cap, out=out)
    poison(out)
    cap.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # graph replay bit-identical to eager
    r = route_torch(logits, K)
    assert torch.equal(cap.int(), r.topk_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 4096])
def test_gpu_skewed_and_empty_experts(T):
    # every token's first choice is expert 5, the others 6..12: 115 experts get nothing
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = (torch.arange(K, device="cuda", dtype=torch.int32) + 5).repeat(T, 1)
    ids[:, 1:] += torch.randint(0, 6, (T, 1), device="cuda", dtype=torch.int32)
    ids[:, 1:] = torch.where(ids[:, 1:] <= 5, ids[:, 1:] + 20, ids[:, 1:])
    wts = torch.rand(T, K, device="cuda")
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts)
    ref = fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 6e-3


@pytest.mark.gpu
def test_gpu_ep_partial_sums():
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    x = torch.randn(300, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(300, E, K, 3)
    full = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts).float()
    parts = sum(fused_moe(x, w13[a : a + 32], w2[a : a + 32], topk_ids=ids, topk_weights=wts,
                          local_expert_offset=a, num_experts=E).float() for a in range(0, E, 32))  # fmt: skip
    assert ((parts - full).norm() / full.norm()).item() < 6e-3


def _graph_output(x, w13, w2, kw, like):
    """fused_moe(x, w13, w2, **kw) captured in a CUDA graph (after a warm-up on a side stream) and
    replayed into a poisoned buffer shaped like ``like``."""
    out = poison(torch.empty_like(like))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, w13, w2, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(x, w13, w2, out=out, **kw)
    poison(out)
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 32], ids=["all-local", "ep-slice"])  # ep-slice: some slots skip
@pytest.mark.parametrize("T", [1, 2])  # the decode (direct) mode: routing inside, eager and graph
def test_gpu_decode_pdl_same_bits_eager_and_graph(T, offset, monkeypatch):

    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    w13, w2 = w13[offset : offset + 96], w2[offset : offset + 96]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits, _, _ = _gpu_routing(T, E, K, 11)
    kw = dict(router_logits=logits, top_k=K, local_expert_offset=offset, num_experts=E)

    def run(pdl):
        _defaults(monkeypatch, pdl=pdl)
        eager = fused_moe(x, w13, w2, **kw)
        return eager, _graph_output(x, w13, w2, kw, eager)

    plain_eager, plain_graph = run(False)
    pdl_eager, pdl_graph = run(True)
    assert torch.equal(plain_eager, plain_graph)
    assert torch.equal(pdl_eager, plain_eager)  # PDL changes launches, never bits
    assert torch.equal(pdl_graph, plain_eager)
    r = route_torch(logits, K)
    ref = fused_moe_torch(x, w13, w2, topk_ids=r.topk_ids, topk_weights=r.topk_weights,
                          local_expert_offset=offset, num_experts=E)  # fmt: skip
    rel = ((pdl_graph.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert rel < 6e-3, rel


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_decode_pdl_argument_overrides_default(T, monkeypatch):
    # MoEConfig.pdl against the opposite process default (DEFAULTS.pdl): the decode kernels launch as
    # programmatic dependent launches exactly when the argument says so, with the same bits
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(T, E, K, 11)
    base = cfgs.moe_config(T, K, H, I, E)
    assert base.direct and base.pdl is None
    outs = []
    for pdl in (False, True):
        _defaults(monkeypatch, pdl=not pdl)
        seen = _record_launches(monkeypatch)
        out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
        experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0, out=out,
                       config=dataclasses.replace(base, pdl=pdl))  # fmt: skip
        assert len(seen) == 2 and {kw["launch_pdl"] for _, kw in seen} == {pdl}  # GEMM1, GEMM2 + sum
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])  # fp8: the swapped decode kernels
@pytest.mark.parametrize("offset", [0, 32], ids=["all-local", "ep-slice"])  # ep-slice: a token with none
@pytest.mark.parametrize("T", [1, 3, 8])
def test_gpu_fused_reduce_same_bits_eager_and_graph(T, offset, fp8):
    # MoEConfig.fused_reduce (the top-k sum by tickets in GEMM2's epilogue, the decode's default) gives the
    # reduce kernel's bits, eagerly and over repeated graph replays (the tickets zeroed by GEMM1 each time)
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, s13, s2 = _gpu_weights("qwen3", fp8)
    sl = slice(offset, offset + 48 if offset else E)
    w13, w2 = w13[sl], w2[sl]
    s13, s2 = (None, None) if s13 is None else (s13[sl], s2[sl])
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(T, E, K, 5)
    if offset:
        ids[0] = torch.arange(E - K, E, device="cuda", dtype=ids.dtype)  # token 0: no local slot
    base = dataclasses.replace(cfgs.moe_config(T, K, H, I, w13.shape[0], fp8=fp8), direct=True)
    outs = {}
    for fused in (False, True):
        c = dataclasses.replace(base, fused_reduce=fused)
        out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))

        def call(c=c, out=out):
            experts_triton(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=offset,
                           out=out, config=c)  # fmt: skip

        call()
        outs[fused] = out.clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        for _ in range(3):
            poison(out)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, outs[fused])
    assert torch.equal(outs[True], outs[False])
    if offset:
        assert (outs[True][0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])  # fp8: the swapped kernels
@pytest.mark.parametrize("offset", [0, 32], ids=["all-local", "ep-slice"])  # ep-slice: a token with none
@pytest.mark.parametrize("T", [3, 8, 24, 40])  # 40 tokens: 320 slots, past MERGE_MAX_SLOTS (not merged)
def test_gpu_merged_direct_tiles_same_bits(T, offset, fp8):
    # MoEConfig.merge_slots (an expert's slots as the rows of one direct tile) gives the bits of one tile
    # per slot and of the layout's tiles, eagerly and over repeated graph replays, with and without the
    # top-k sum in GEMM2
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, s13, s2 = _gpu_weights("qwen3", fp8)
    sl = slice(offset, offset + 48 if offset else E)
    w13, w2 = w13[sl], w2[sl]
    s13, s2 = (None, None) if s13 is None else (s13[sl], s2[sl])
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(T, E, K, 7)
    # every token's first slot on one expert (its top-k stays distinct): a tile of T rows, two past 16
    hot, first = offset + 1, ids[:, :1].clone()
    ids[:, 1:] = torch.where(ids[:, 1:] == hot, first, ids[:, 1:])
    ids[:, 0] = hot
    if offset:
        ids[0] = torch.arange(E - K, E, device="cuda", dtype=ids.dtype)  # token 0: no local slot
    E_local = w13.shape[0]
    tiles = dataclasses.replace(cfgs.moe_config(64, K, H, I, E_local, fp8=fp8), merge_slots=None)
    assert not tiles.direct
    decode = cfgs.moe_config(1, K, H, I, E_local, fp8=fp8)
    configs = [tiles] + [dataclasses.replace(decode, merge_slots=m, fused_reduce=f)
                         for m in (False, True) for f in (False, True)]  # fmt: skip
    outs = []
    for c in configs:
        out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))

        def call(c=c, out=out):
            experts_triton(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, local_expert_offset=offset,
                           out=out, config=c)  # fmt: skip

        call()
        outs.append(out.clone())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        for _ in range(2):
            poison(out)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, outs[-1])
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    if offset:
        assert (outs[0][0] == 0).all()


PREFILL = MoEConfig(False, 128, 128, 64, 8, 4, 256, 64, 8, 4, 4)  # moe_config's bf16 prefill tiles


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("T", [1024, 4096])
def test_gpu_tma_prefill_bitwise_equals_pointer_loads(name, T, monkeypatch):
    # the prefill configuration with and without TMA descriptors at the bench shapes: same bits
    from dataclasses import replace

    H, I, E, K = MODELS[name]  # noqa: E741
    w13, w2, _, _ = _gpu_weights(name, False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, ids, wts = _gpu_routing(T, E, K, 5)
    outs = []
    for tma in (False, True):
        made = _count_descs(monkeypatch)
        out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
        experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0, out=out,
                       config=replace(PREFILL, tma=tma))  # fmt: skip
        outs.append(out)
    assert len(made) == _descs_expected(PREFILL) and all(d is not None for d in made)
    assert torch.equal(outs[0], outs[1])
    ref = fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts)
    rel = ((outs[1].float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 6e-3, rel


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 32], ids=["all-local", "ep-slice"])  # ep-slice: weights at an offset
def test_gpu_tma_selected_and_graph_capture_bitwise(offset, monkeypatch):
    # the wrapper's own choice (TMA on a Hopper GPU for prefill) eager and in a CUDA graph, against
    # the process default DEFAULTS.tma = False: the same bits

    T = 4096
    H, I, E, K = MODELS["qwen3"]  # noqa: E741
    w13, w2, _, _ = _gpu_weights("qwen3", False)
    w13, w2 = w13[offset : offset + 96], w2[offset : offset + 96]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits, _, _ = _gpu_routing(T, E, K, 13)
    kw = dict(router_logits=logits, top_k=K, local_expert_offset=offset, num_experts=E)
    assert cfgs.moe_config(T, K, H, I, 96, tma=cfgs.tma_ok(x.device)).tma == _switches.DEFAULTS.tma

    def run(tma):
        _defaults(monkeypatch, tma=tma)
        made = _count_descs(monkeypatch)
        eager = fused_moe(x, w13, w2, **kw)
        assert len(made) == (_descs_expected(cfgs.moe_config(T, K, H, I, 96, tma=True)) if tma else 0)
        return eager, _graph_output(x, w13, w2, kw, eager)

    plain_eager, plain_graph = run(False)
    tma_eager, tma_graph = run(True)
    assert torch.equal(plain_eager, plain_graph)
    assert torch.equal(tma_eager, plain_eager)  # TMA changes how data moves, never bits
    assert torch.equal(tma_graph, plain_eager)


@pytest.mark.parametrize("kernel", ["gemm1", "gemm2", "reduce"])
def test_decode_pdl_kernels_compile_for_sm90(kernel):
    # the PDL path never runs in the interpreter: compile it for Hopper (no GPU needed) and check the
    # instructions; a separate process, since this one runs the kernels in Triton's interpreter
    run = run_script("pdl_ptx_check.py", kernel)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("kernel", ["gemm1", "gemm2"])
def test_tile_tma_kernels_compile_for_sm90(kernel):
    # the TMA kernels compiled for Hopper (no GPU needed): TMA copies emitted (GEMM2: no other async
    # copies), none without TMA, no spills in the prefill configuration; a separate process, since this
    # one runs the kernels in Triton's interpreter
    run = run_script("fwd_tma_ptx_check.py", kernel)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.stdout.splitlines()[1:]  # after the header: one row per case and TMA setting
    assert len(rows) == (14 if kernel == "gemm1" else 8) and all(r.endswith(" ok") for r in rows), run.stdout


def _counted_ids(counts, g):
    """Top-1 ids [T, 1] with ``counts[e]`` tokens on expert e, in a random token order."""
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    return ids[torch.randperm(len(ids), generator=g)][:, None].contiguous()


# per-expert row counts around a 32-row tile's half: 16 (a half tile), 17 (a full one), 48 (a full tile,
# then a half), 1, 0 (no tile), 33 (a full tile, then a one-row half tile)
_HALF_COUNTS = [16, 17, 48, 1, 0, 33]


class _LaunchSpy:
    """``fast(kernel)`` that records ``(kernel name, launch keywords)`` before launching."""

    def __init__(self, fn, real, seen):
        self.fn, self.real, self.seen = fn, real, seen

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append((self.fn.fn.__name__, kwargs))
            self.real(self.fn)[grid](*args, **kwargs)

        return run


def _record_launches(monkeypatch) -> list:
    """Record every kernel launch of the forward and backward launchers (``_LaunchSpy``)."""
    seen = []
    for mod in (moe_fwd, moe_bwd):
        monkeypatch.setattr(mod, "fast", lambda fn, real=mod.fast: _LaunchSpy(fn, real, seen))
    return seen


def _flags(seen, name: str) -> set:
    """The values of launch keyword ``name`` over the recorded GEMM launches that take it."""
    return {
        kw[name] for k, kw in seen if name in kw and ("gemm" in k or k.endswith(("_da_kernel", "_dx_kernel")))
    }


def _half_tiles_pair(dtype, device, generator, monkeypatch, tma=False):
    """(with HALF_TILES, without, reference): (out, dx, dw13, dw2, dtopk_weights) of the forward and of
    the backward with GEMM1 recomputed, on experts whose row counts straddle a 32-row tile's half;
    ``tma``: GEMM2's SwiGLU rows and dX's dh rows through descriptors (half-height ones for half tiles).
    The configurations' ``half_tiles`` chooses, against the opposite process default."""

    E, H, I = len(_HALF_COUNTS), 64, 32  # noqa: E741
    ids = _counted_ids(_HALF_COUNTS, generator)
    T = ids.shape[0]
    x, w13, w2, _, wts = _problem(T, H, I, E, 1, generator, dtype)
    dout = torch.randn(T, H, generator=generator).to(dtype)
    x, w13, w2, ids, wts, dout = (t.to(device) for t in (x, w13, w2, ids, wts, dout))
    cfg = MoEConfig(False, 32, 16, 32, 4, 2, 32, 32, 4, 2, tma=tma)
    bwd = dataclasses.replace(
        cfgs.moe_bwd_config(T, 1, H, I, E), block_m=32, dw_mode=1, gemm_tma=tma, bk_x=32
    )
    got = []
    for half in (True, False):
        _defaults(monkeypatch, half_tiles=not half)  # the argument wins either way
        seen = _record_launches(monkeypatch)
        out = poison(torch.empty(T, H, dtype=dtype, device=device))
        experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0, out=out,
                       config=dataclasses.replace(cfg, half_tiles=half))  # fmt: skip
        c = dataclasses.replace(bwd, half_tiles=half)
        got.append((out, *moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, None, 0, True, [True] * 4, c)))
        # GEMM1, GEMM2, GEMM1 recomputed, dA, dX: each took the argument's HALF_TILES
        assert _flags(seen, "HALF_TILES") == {half} and sum("HALF_TILES" in kw for _, kw in seen) == 5
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), topk_ids=ids, topk_weights=wts)
    return got[0], got[1], ref


_GRAD_NAMES = ("out", "dx", "dw13", "dw2", "dtopk_weights")


@pytest.mark.interpret
@_GARBAGE_ROWS
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_half_tiles_match_full_tiles(dtype, tma, generator, monkeypatch):
    # a tile with at most half its rows real computes only that half (HALF_TILES), in the forward and in
    # the backward's GEMM1 recomputation: the full tiles' results (numpy's matmul may round a 16-row
    # block apart from a 32-row one, so not bitwise here; bitwise on the GPU below) and the reference's
    half, full, ref = _half_tiles_pair(dtype, "cpu", generator, monkeypatch, tma)
    for name, a, b in zip(_GRAD_NAMES, half, full):
        assert_close(a, b, dtype=dtype, name=name)  # fp16: 1 ulp where numpy's fp32 sums differ
    assert_close(half[0], ref, dtype=dtype)


@pytest.mark.interpret
@_GARBAGE_ROWS
@pytest.mark.parametrize("default", [False, True], ids=["default-off", "default-on"])
@pytest.mark.parametrize("half", [None, False, True], ids=["none", "off", "on"])
def test_half_tiles_argument_overrides_process_default(half, default, generator, monkeypatch):
    # MoEConfig.half_tiles through the custom op (the config list torch.compile passes): True / False
    # win over DEFAULTS.half_tiles (REPLAYMOE_HALF_TILES) in both directions, None follows it
    from replaymoe.moe.configs import config_tuple

    _defaults(monkeypatch, half_tiles=default)
    E, H, I = len(_HALF_COUNTS), 64, 32  # noqa: E741
    ids = _counted_ids(_HALF_COUNTS, generator)
    T = ids.shape[0]
    x, w13, w2, _, wts = _problem(T, H, I, E, 1, generator, torch.float32)
    cfg = MoEConfig(False, 32, 16, 32, 4, 2, 32, 32, 4, 2, half_tiles=half)
    seen = _record_launches(monkeypatch)
    out = poison(torch.empty(T, H))
    torch.ops.replaymoe.moe_experts(x, w13, w2, ids, wts, None, None, 0, out, config_tuple(cfg))
    assert _flags(seen, "HALF_TILES") == {default if half is None else half}
    assert_close(out, fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts), dtype=torch.float32)
    if half is None:  # the backward's configuration the same way
        c = dataclasses.replace(cfgs.moe_bwd_config(T, 1, H, I, E), block_m=32)
        assert cfgs.uses_half_tiles(c, False) is default
        assert cfgs.uses_half_tiles(dataclasses.replace(c, half_tiles=not default), False) is (not default)


@pytest.mark.interpret
@_GARBAGE_ROWS
def test_switch_arguments_under_torch_compile_fullgraph(generator, monkeypatch):
    # a configuration with its switches traced by dynamo (fullgraph: no graph break; aot_eager: no C++
    # compiler needed on CPU): it crosses the custom op as its int list, and its half_tiles still wins
    # over the process default inside the op
    torch._dynamo.reset()
    _defaults(monkeypatch, half_tiles=False)
    E, H, I = len(_HALF_COUNTS), 64, 32  # noqa: E741
    ids = _counted_ids(_HALF_COUNTS, generator)
    T = ids.shape[0]
    x, w13, w2, _, wts = _problem(T, H, I, E, 1, generator, torch.float32)
    cfg = MoEConfig(False, 32, 16, 32, 4, 2, 32, 32, 4, 2, half_tiles=True, pdl=False)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def run(x, w13, w2, ids, wts):
        return experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0,
                              out=None, config=cfg)  # fmt: skip

    seen = _record_launches(monkeypatch)
    out = run(x, w13, w2, ids, wts)
    torch._dynamo.reset()
    assert _flags(seen, "HALF_TILES") == {True}
    eager = experts_triton(x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0,
                           out=None, config=cfg)  # fmt: skip
    assert torch.equal(out, eager)


@pytest.mark.parametrize("default", [False, True], ids=["default-off", "default-on"])
@pytest.mark.parametrize("pdl", [None, False, True], ids=["none", "off", "on"])
def test_pdl_argument_overrides_process_default(pdl, default, monkeypatch):
    # MoEConfig.pdl: True / False win over DEFAULTS.pdl (REPLAYMOE_PDL) in both directions, None follows
    # it; only the direct mode, not fp8, on a Hopper device outside the interpreter takes it
    _defaults(monkeypatch, pdl=default)
    hopper = torch.device("cuda", 7)
    monkeypatch.setitem(cfgs._HOPPER_DEVICES, hopper, True)  # as a Hopper GPU would
    direct = MoEConfig(True, 16, 32, 128, 4, 4, 32, 128, 4, 4, pdl=pdl)
    want = default if pdl is None else pdl
    assert cfgs.uses_pdl(direct, False, hopper) is want
    assert not cfgs.uses_pdl(direct, True, hopper)  # fp8
    assert not cfgs.uses_pdl(direct, False, torch.device("cpu"))  # no PDL in the interpreter / on CPU
    assert not cfgs.uses_pdl(dataclasses.replace(direct, direct=False), False, hopper)  # tile mode


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),  # the fp8 decode default
        ({"swap_ab": False}, False),  # turned off by the call's configuration
        ({"direct": False}, False),  # tile mode: only when asked for
        ({"direct": False, "swap_ab": True, "block_m": 16}, True),  # 16-row tiles on the MMA's N side
        ({"direct": False, "swap_ab": True, "block_m": 128}, False),  # wider than the swapped kernels take
        ({"block_m": 16}, False),  # batch_invariant=False's decode tiles keep their mma.sync kernels
        ({"block_m": 16, "swap_ab": True}, True),  # ... unless the configuration asks
        ({"block_n1": 64}, True),  # bf16 SwiGLU rows, GEMM2 quantizes them
        ({"block_n1": 128}, True),  # e4m3 SwiGLU rows
        ({"block_n1": 16}, False),  # gate + up = 32 weight rows: a narrower MMA kind, other bits
        ({"block_n2": 32}, False),  # the same for GEMM2
        ({"block_k1": 64}, False),  # one weight scale per 128-deep chunk
    ],
)
def test_swap_ab_applies_where_the_bits_stay(change, takes):
    # MoEConfig.swap_ab (None: on for the invariant decode) takes the swapped kernels only where each
    # dot keeps >= 64 weight rows and 128-deep K chunks; never for bf16
    c = dataclasses.replace(cfgs.moe_config(1, 8, 2048, 768, 128, fp8=True), **change)
    assert cfgs.swaps_ab(c, True) is takes
    assert not cfgs.swaps_ab(c, False)


SWAP_CASES = [
    # (T, E_local slice, block_m (0: direct), block_n1, block_n2) -- edge each hits
    (1, (0, 4), 0, 128, 128),  # decode: e4m3 SwiGLU rows, one token
    (3, (0, 4), 0, 64, 64),  # decode: bf16 SwiGLU rows quantized in GEMM2, several tokens
    (2, (0, 4), 0, 32, 128),  # decode: gate and up rows stacked in one dot
    (3, (1, 3), 0, 32, 64),  # decode, an EP slice: slots outside it write nothing
    (9, (0, 4), 16, 128, 128),  # tile mode, 16-row tiles: several tiles per expert, padding columns
    (6, (0, 4), 16, 32, 64),  # tile mode, the small-batch default: gate and up stacked, bf16 SwiGLU rows
    (40, (1, 3), 32, 32, 64),  # tile mode, 32-row tiles, an EP slice
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,sl,bm,n1,n2", SWAP_CASES)
def test_triton_interpreter_fp8_swapped_matches_unswapped(T, sl, bm, n1, n2, generator, monkeypatch):
    # the swapped fp8 kernels (decode and tile mode) against the unswapped 64-row tiles on the
    # interpreter (its dot order is numpy's, so closeness; the GPU test checks the bits); each call
    # builds its layout once (tile mode) or not at all (decode)
    layouts = []
    build = layout_mod.build_layout
    counted = lambda *a, **k: layouts.append(1) or build(*a, **k)  # noqa: E731
    monkeypatch.setattr(layout_mod, "build_layout", counted)
    H, I, E, K = 256, 256, 4, 2  # noqa: E741
    x = torch.randn(T, H, generator=generator).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=generator) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=generator) * I**-0.5).bfloat16()
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).int()
    wts = torch.rand(T, K, generator=generator)
    lo, hi = sl
    configs = (MoEConfig(bm == 0, 64, 128, 128, 4, 2, 128, 128, 4, 2, swap_ab=False),
               MoEConfig(bm == 0, bm or 64, n1, 128, 4, 2, n2, 128, 4, 2, swap_ab=True))  # fmt: skip
    assert cfgs.swaps_ab(configs[1], True)
    outs = []
    for c in configs:
        out = poison(torch.empty(T, H, dtype=torch.bfloat16))
        experts_triton(x, q13[lo:hi], q2[lo:hi], ids, wts, w13_scale=s13[lo:hi], w2_scale=s2[lo:hi],
                       local_expert_offset=lo, out=out, config=c)  # fmt: skip
        outs.append(out)
        assert len(layouts) == (0 if c.direct else 1)
        layouts.clear()
    assert torch.isfinite(outs[1].float()).all()
    assert_close(outs[1], outs[0], dtype=torch.bfloat16)
    # a token none of whose slots fall in the slice gets zeros, not poison
    local = ((ids >= lo) & (ids < hi)).any(dim=1)
    assert (outs[1][~local] == 0).all()


@pytest.mark.interpret
@pytest.mark.parametrize("T,H", [(5, 256), (3, 1152)])  # 1152: 9 groups, a partial block of 8 per program
def test_triton_interpreter_layout_launch_quantizes_x(T, H, generator, monkeypatch):
    # fp8 tile mode: the layout's scatter launch also quantizes x (quant_x), with quant_groups_kernel's
    # arithmetic (elementwise: the same bits on any CPU), so no separate quantization launch runs; the
    # direct mode keeps its own
    x = torch.randn(T, H, generator=generator).bfloat16() * 3
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(T)]).int()
    xq, xs = moe_fwd._x_buffers(x)
    xq.view(torch.uint8).fill_(0x7F)  # poisoned (e4m3 NaN)
    xs.fill_(float("nan"))
    lay = layout_mod.build_layout(ids, 4, 16, 0, 1, False, (x, xq, xs))
    ref_q, ref_s = moe_fwd._quantize_x(x)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(xs, ref_s)
    assert torch.equal(lay.sorted_slots, layout_mod.build_layout(ids, 4, 16).sorted_slots)
    w13 = (torch.randn(4, 256, H, generator=generator) * H**-0.5).bfloat16()
    w2 = (torch.randn(4, H, 128, generator=generator) * 128**-0.5).bfloat16()
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    for direct in (False, True):
        seen = _record_launches(monkeypatch)
        c = MoEConfig(direct, 16 if not direct else 64, 32, 128, 4, 2, 64, 128, 4, 2, swap_ab=True)
        experts_triton(x, q13, q2, ids, torch.rand(T, 2, generator=generator), w13_scale=s13, w2_scale=s2,
                       local_expert_offset=0, out=None, config=c)  # fmt: skip
        assert ("quant_groups_kernel" in [k for k, _ in seen]) is direct


FUSED_REDUCE_CASES = [
    # (dtype, T, H, K, E slice, block_n2, swap) -- edge each hits
    (torch.float16, 1, 64, 2, (0, 4), 32, False),  # one token, two H blocks
    (torch.float16, 5, 96, 3, (0, 4), 64, False),  # K = 3 (a padded 4-slot read), a partial H block
    (torch.float32, 6, 64, 2, (1, 3), 32, False),  # an EP slice: tokens with one or no local slot
    (torch.float16, 4, 64, 4, (0, 4), 16, False),  # padding ids (-1) among the slots, many H blocks
    (torch.bfloat16, 3, 256, 2, (0, 4), 128, True),  # fp8, the swapped decode kernels
    (torch.bfloat16, 5, 256, 2, (1, 3), 64, True),  # fp8 swapped, an EP slice, two H blocks
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,T,H,K,sl,n2,swap", FUSED_REDUCE_CASES)
def test_triton_interpreter_fused_reduce_matches_reduce_kernel(dtype, T, H, K, sl, n2, swap, generator,
                                                              monkeypatch):  # fmt: skip
    # MoEConfig.fused_reduce (the top-k sum in GEMM2's epilogue, by per-token tickets) gives the reduce
    # kernel's bits (the same fp32 sum of the same rows in k order), zeroes its own tickets (poisoned
    # here), and writes zeros for a token with no local slot
    fp8 = swap
    I, E = (256 if fp8 else 32), 4  # noqa: E741
    x, w13, w2, ids, wts = _problem(T, H, I, E, K, generator, torch.float32 if fp8 else dtype)
    if T >= 4:
        ids[T - 1, 0] = -1  # a padding slot
    kw: dict = dict(w13_scale=None, w2_scale=None)
    if fp8:
        x = x.bfloat16()
        (w13, kw["w13_scale"]), (w2, kw["w2_scale"]) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    lo, hi = sl
    if hi - lo < E:
        kw = {k: None if v is None else v[lo:hi] for k, v in kw.items()}
        ids[0] = torch.tensor([0, E - 1])  # token 0: no slot in the slice (1, 3)
    tickets = moe_fwd._tickets

    def poisoned_tickets(*a):
        on, cnt, n = tickets(*a)
        if on:
            cnt.fill_(123)
        return on, cnt, n

    monkeypatch.setattr(moe_fwd, "_tickets", poisoned_tickets)
    block = (64, 128, 128) if fp8 else (16, 32, 32)
    base = MoEConfig(True, block[0], block[1], block[2], 4, 2, n2, block[2], 4, 2, swap_ab=swap or None)
    assert cfgs.uses_fused_reduce(base) and cfgs.swaps_ab(base, fp8) is swap
    outs = []
    for fused in (False, True):
        out = poison(torch.empty(T, H, dtype=torch.bfloat16 if fp8 else dtype))
        experts_triton(x, w13[lo:hi], w2[lo:hi], ids, wts, local_expert_offset=lo, out=out,
                       config=dataclasses.replace(base, fused_reduce=fused), **kw)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[1], outs[0])
    local = ((ids >= lo) & (ids < hi)).any(dim=1)
    assert (outs[1][~local] == 0).all() and torch.isfinite(outs[1].float()).all()


MERGE_CASES = [
    # (dtype, T, E, K, E slice, fused reduce, fp8 swapped) -- edge each hits
    (torch.float16, 6, 4, 2, (0, 4), True, False),  # 2-4 slots per expert in one tile, tickets per row
    (torch.float32, 40, 4, 2, (0, 4), True, False),  # ~20 slots per expert: two tiles, a second leader
    (torch.float16, 7, 4, 2, (1, 3), True, False),  # an EP slice: a token with no local slot gets zeros
    (torch.float16, 9, 4, 3, (0, 4), False, False),  # the reduce kernel instead of tickets; K = 3
    (torch.bfloat16, 20, 4, 2, (0, 4), True, True),  # fp8, the swapped kernels' 16 columns: two tiles
    (torch.bfloat16, 5, 4, 2, (1, 3), True, True),  # fp8 swapped, an EP slice
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,T,E,K,sl,fused,fp8", MERGE_CASES)
def test_triton_interpreter_merged_direct_tiles(dtype, T, E, K, sl, fused, fp8, generator, monkeypatch):
    # MoEConfig.merge_slots: the direct mode's slots of one expert as the rows of one tile give what one
    # tile per slot gives (bitwise on a problem whose dots are exact in any order; fp8 by closeness),
    # with padding ids among the slots, and zeros for a token with no local slot
    H, I = (256, 256) if fp8 else (64, 32)  # noqa: E741
    make = _problem if fp8 else _exact_problem
    x, w13, w2, ids, wts = make(T, H, I, E, K, generator, torch.float32 if fp8 else dtype)
    ids[T - 1, K - 1] = -1  # a padding slot
    kw: dict = dict(w13_scale=None, w2_scale=None)
    if fp8:
        x = x.bfloat16()
        (w13, kw["w13_scale"]), (w2, kw["w2_scale"]) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    lo, hi = sl
    if hi - lo < E:
        kw = {k: None if v is None else v[lo:hi] for k, v in kw.items()}
        ids[0, :2] = torch.tensor([0, E - 1])  # token 0: no slot in the slice (1, 3)
    block = (64, 128, 128) if fp8 else (16, 32, 32)
    base = MoEConfig(True, block[0], block[1], block[2], 4, 2, 64 if fp8 else 32, block[2], 4, 2,
                     swap_ab=fp8 or None, fused_reduce=fused)  # fmt: skip
    outs, merged = [], []
    for merge in (False, True):
        seen = _record_launches(monkeypatch)
        out = poison(torch.empty(T, H, dtype=torch.bfloat16 if fp8 else dtype))
        experts_triton(x, w13[lo:hi], w2[lo:hi], ids, wts, local_expert_offset=lo, out=out,
                       config=dataclasses.replace(base, merge_slots=merge), **kw)  # fmt: skip
        outs.append(out)
        merged.append(_flags(seen, "MERGE"))
    assert merged == [{False}, {True}]  # the switch reached both GEMMs
    local = ((ids >= lo) & (ids < hi)).any(dim=1)
    assert (outs[1][~local] == 0).all() and torch.isfinite(outs[1].float()).all()
    if fp8:
        assert_close(outs[1], outs[0], dtype=torch.bfloat16)
    else:
        assert torch.equal(outs[1], outs[0])


@triton.jit
def _merged_slots_probe(ids_ptr, lead_ptr, slots_ptr, num_slots, ROWS: tl.constexpr, SCAN: tl.constexpr):
    """Each program stores ``_merged_slots``'s (lead, slots) of its slot."""
    pid = tl.program_id(0)
    lead, slots = _merged_slots(pid, ids_ptr, num_slots, ROWS, SCAN)
    tl.store(lead_ptr + pid, lead.to(tl.int32))
    tl.store(slots_ptr + pid * ROWS + tl.arange(0, ROWS), slots)


@pytest.mark.interpret
def test_triton_interpreter_merged_slots_leaders():
    # _merged_slots: an expert's slots in slot order, ROWS to a tile; only each tile's first slot leads,
    # and its rows are exactly the tile's slots (padding = num_slots past the expert's last)
    ids = torch.tensor([3, 1, 3, 3, 0, 3, 3, -1, 3], dtype=torch.int32)  # expert 3: 6 slots, 2 tiles of 4
    n, rows = ids.numel(), 4
    lead = torch.full((n,), -1, dtype=torch.int32)
    slots = torch.full((n, rows), -7, dtype=torch.int32)
    _merged_slots_probe[(n,)](ids, lead, slots, n, ROWS=rows, SCAN=16)
    assert lead.tolist() == [1, 1, 0, 0, 1, 0, 1, 1, 0]  # (-1, a padding id, is its own: the kernels skip it)
    assert slots[0].tolist() == [0, 2, 3, 5] and slots[6].tolist() == [6, 8, n, n]
    assert slots[1].tolist() == [1, n, n, n] and slots[4].tolist() == [4, n, n, n]


@pytest.mark.parametrize(
    "T,K,dims,fp8,want",
    [
        (2, 8, (2048, 768, 128), False, False),  # Qwen3 T=2: 0.9 repeated experts expected, off
        (4, 8, (2048, 768, 128), False, True),  # Qwen3 T=4 bf16: 3.6 repeats, 7.9 us of reads saved
        (4, 8, (2048, 768, 128), True, False),  # the same in fp8: 4.0 us, less than the scan costs
        (2, 8, (7168, 2048, 256), False, False),  # DeepSeek-V3 T=2: 0.46 repeats expected
        (8, 8, (7168, 2048, 256), True, True),  # DeepSeek-V3 T=8 fp8 (measured 978 -> 863 us)
        (4, 2, (4096, 14336, 8), True, True),  # Mixtral T=4: 2.75 repeats of 176 MB experts
        (1, 8, (2048, 768, 128), False, False),  # one token: its top-k experts are distinct
        (64, 8, (2048, 768, 128), False, False),  # 512 slots: past MERGE_MAX_SLOTS
    ],
)
def test_merge_slots_rule(T, K, dims, fp8, want):
    H, I, E = dims  # noqa: E741
    c = MoEConfig(True, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    assert cfgs.merges_slots(c, T, K, H, I, E, fp8) is want
    assert not cfgs.merges_slots(dataclasses.replace(c, merge_slots=False), T, K, H, I, E, fp8)
    forced = cfgs.merges_slots(dataclasses.replace(c, merge_slots=True), T, K, H, I, E, fp8)
    assert forced is (T >= 2 and T * K <= cfgs.MERGE_MAX_SLOTS)  # the switch, within the mode's reach
    assert not cfgs.merges_slots(dataclasses.replace(c, direct=False, merge_slots=True), T, K, H, I, E, fp8)


def test_fused_reduce_only_in_direct_mode():
    c = MoEConfig(True, 16, 32, 32, 4, 2, 32, 32, 4, 2)
    assert cfgs.uses_fused_reduce(c)
    assert not cfgs.uses_fused_reduce(dataclasses.replace(c, fused_reduce=False))
    assert not cfgs.uses_fused_reduce(dataclasses.replace(c, direct=False, fused_reduce=True))  # tile mode


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_tiles_bitwise_equal_full_tiles(dtype, tma, generator, monkeypatch):
    # on the GPU a row's dot does not depend on the tile height: the same bits
    half, full, ref = _half_tiles_pair(dtype, "cuda", generator, monkeypatch, tma)
    for name, a, b in zip(_GRAD_NAMES, half, full):
        assert torch.equal(a, b), name
    assert_close(half[0], ref, dtype=dtype)

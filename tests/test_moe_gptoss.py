"""gpt-oss experts in fused_moe: biases on both projections, interleaved gate/up rows, the clamped
SwiGLU (``ClampedSwiGLU``) and transposed weight views.

The torch reference is checked against a direct transcription of transformers' ``GptOssExperts``
math; the Triton kernels (interpreter on CPU, fp32/fp16, both kernel modes) against the reference,
with inputs scaled so that every clamp is hit on both sides; gradients against fp64 autograd of the
reference; the transformers experts module against its own forward. bf16 and batch invariance run
on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import replaymoe.moe._backward as moe_bwd
import replaymoe.moe.configs as cfgs
from replaymoe.moe import ClampedSwiGLU, MoELayer, fused_moe, fused_moe_torch
from replaymoe.moe._forward import ExpertsVariant, experts_triton
from replaymoe.moe.configs import MoEConfig
from replaymoe.moe.quant import quantize_fp8_block
from replaymoe.testing import assert_close, poison

ALPHA, LIMIT = 1.702, 7.0
ACT = ClampedSwiGLU(ALPHA, LIMIT)


def _ids(T, K, E, g):
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def _gptoss(T, H, I, E_local, E, K, g, dtype=torch.float32, scale=5.0):  # noqa: E741
    """gpt-oss's parameters as transformers stores them (gate_up_proj [E, H, 2I] interleaved,
    down_proj [E, I, H], biases) and a routing. ``scale``: std of the gate/up pre-activations, so
    that |gate|, |up| > limit for a good share of the entries."""
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E_local, H, 2 * I, generator=g) * scale / H**0.5).to(dtype)
    gate_up_b = torch.randn(E_local, 2 * I, generator=g).to(dtype)
    down = (torch.randn(E_local, I, H, generator=g) / (4 * I**0.5)).to(dtype)
    down_b = torch.randn(E_local, H, generator=g).to(dtype)
    ids = _ids(T, K, E, g)
    wts = torch.rand(T, K, generator=g)
    return x, gate_up, gate_up_b, down, down_b, ids, wts


def transformers_gptoss_math(x, gate_up, gate_up_b, down, down_b, ids, wts, offset=0):
    """transformers' GptOssExperts.forward, transcribed (float64, token by token, local experts only)."""
    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k]) - offset
            if not 0 <= e < gate_up.shape[0]:
                continue
            gu = x[t].double() @ gate_up[e].double() + gate_up_b[e].double()
            gate, up = gu[..., ::2], gu[..., 1::2]
            gate = gate.clamp(min=None, max=LIMIT)
            up = up.clamp(min=-LIMIT, max=LIMIT)
            glu = gate * torch.sigmoid(gate * ALPHA)
            o = ((up + 1) * glu) @ down[e].double() + down_b[e].double()
            out[t] += o * float(wts[t, k])
    return out


def _kw(gate_up_b, down_b, ids, wts, offset=0, E=None):
    return dict(topk_ids=ids, topk_weights=wts, w13_bias=gate_up_b, w2_bias=down_b, activation=ACT,
                gate_up_layout="interleaved", local_expert_offset=offset, num_experts=E)  # fmt: skip


def _clamps_hit(x, gate_up, gate_up_b, ids, offset=0):
    """(gate > limit, up > limit, up < -limit) each hit somewhere among the routed (token, expert) pairs."""
    h = torch.einsum("th,eho->teo", x.double(), gate_up.double()) + gate_up_b.double()
    local = ids.long() - offset
    ok = (local >= 0) & (local < gate_up.shape[0])
    rows = h[torch.nonzero(ok, as_tuple=True)[0], local[ok]]
    g, u = rows[:, ::2], rows[:, 1::2]
    return bool((g > LIMIT).any()), bool((u > LIMIT).any()), bool((u < -LIMIT).any())


# ---------------------------------------------------------------- the reference is transformers' math


@pytest.mark.parametrize(
    "T,E,E_local,offset,K,dtype",
    [
        (7, 4, 4, 0, 2, torch.float64),  # every expert local, fp64: the math exactly
        (7, 4, 4, 0, 2, torch.float32),  # fp32 accumulation
        (9, 8, 3, 2, 3, torch.float32),  # EP slice: ids outside [2, 5) contribute nothing
        (2, 8, 8, 0, 1, torch.float32),  # top-1, most experts without tokens
    ],
)
def test_reference_matches_transformers_math(T, E, E_local, offset, K, dtype, generator):
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, 32, 16, E_local, E, K, generator, dtype)
    out = fused_moe_torch(x, gu.transpose(1, 2), dn.transpose(1, 2), **_kw(gub, dnb, ids, wts, offset, E))
    ref = transformers_gptoss_math(x, gu, gub, dn, dnb, ids, wts, offset)
    assert out.dtype == dtype
    assert_close(out, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


def test_reference_hits_every_clamp(generator):
    # the inputs of these tests do exercise the clamps (else a missing clamp could pass)
    x, gu, gub, dn, dnb, ids, wts = _gptoss(16, 32, 16, 4, 4, 2, generator)
    assert _clamps_hit(x, gu, gub, ids) == (True, True, True)
    unclamped = ClampedSwiGLU(ALPHA, 1e6)  # the clamps change the result
    kw = _kw(gub, dnb, ids, wts)
    a = fused_moe_torch(x, gu.transpose(1, 2), dn.transpose(1, 2), **kw)
    b = fused_moe_torch(x, gu.transpose(1, 2), dn.transpose(1, 2), **{**kw, "activation": unclamped})
    assert (a - b).abs().max() > 1.0


def test_clamped_swiglu_is_the_reference_activation():
    g = torch.tensor([-9.0, -1.0, 0.5, 6.9, 7.0, 12.0], dtype=torch.float64)
    u = torch.tensor([-8.0, -7.0, 0.0, 3.0, 7.5, 1.0], dtype=torch.float64)
    gc, uc = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    assert torch.equal(ACT(g, u), (uc + 1) * gc * torch.sigmoid(gc * ALPHA))
    assert ClampedSwiGLU() == ClampedSwiGLU(1.702, 7.0)  # gpt-oss's constants are the defaults


# ---------------------------------------------------------------- Triton (interpreter) vs the reference

MODES = [
    pytest.param(MoEConfig(True, 16, 32, 32, 4, 2, 32, 32, 4, 2), id="direct"),  # decode: a tile per slot
    pytest.param(MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2), id="layout"),  # expert tiles
]


@pytest.mark.interpret
@pytest.mark.parametrize("cfg", MODES)
@pytest.mark.parametrize(
    "T,E,E_local,offset,K,dtype",
    [
        (6, 4, 4, 0, 2, torch.float32),  # clamps hit on both sides, every expert local
        (6, 4, 4, 0, 2, torch.float16),  # fp16 activations and weights, fp16 biases
        (5, 8, 3, 2, 3, torch.float32),  # EP slice with a -1 padding row; experts without tokens
    ],
)
def test_triton_matches_reference(cfg, T, E, E_local, offset, K, dtype, generator):
    H, I = 40, 24  # noqa: E741  # not multiples of the 32-wide tiles: masked edges
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, H, I, E_local, E, K, generator, dtype)
    if offset:
        ids[1] = -1  # EP dispatch padding row
    assert _clamps_hit(x, gu, gub, ids, offset) == (True, True, True)
    v = ExpertsVariant(gub, dnb, 1, ALPHA, LIMIT, True)
    out = poison(torch.empty(T, H, dtype=dtype))
    experts_triton(x, gu.transpose(1, 2), dn.transpose(1, 2), ids, wts, w13_scale=None, w2_scale=None,
                   local_expert_offset=offset, out=out, config=cfg, variant=v)  # fmt: skip
    ref = fused_moe_torch(x, gu.transpose(1, 2), dn.transpose(1, 2), **_kw(gub, dnb, ids, wts, offset, E))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert_close(out, ref, atol=tol * float(ref.abs().max()), rtol=tol)


@pytest.mark.interpret
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])  # fp32 or the weights' dtype
def test_triton_public_wrapper_fp16(bias_dtype, generator):
    # fused_moe(backend="triton") with the configuration it picks, fp32 biases beside fp16 weights
    x, gu, gub, dn, dnb, ids, wts = _gptoss(5, 32, 16, 4, 4, 2, generator, torch.float16)
    kw = _kw(gub.to(bias_dtype), dnb.to(bias_dtype), ids, wts)
    out = fused_moe(x, gu.transpose(1, 2), dn.transpose(1, 2), backend="triton", **kw)
    ref = fused_moe_torch(x, gu.transpose(1, 2), dn.transpose(1, 2), **kw)
    assert out.dtype == torch.float16
    assert_close(out, ref, atol=2e-3 * float(ref.abs().max()), rtol=2e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("cfg", MODES)
def test_layouts_and_strides_agree(cfg, generator):
    # the same experts as transposed views (gpt-oss), as contiguous interleaved copies (the same
    # arithmetic on other addresses: bitwise the same output) and rearranged into gate/up halves (two
    # dots instead of one wide one: the same values within fp32 rounding)
    x, gu, gub, dn, dnb, ids, wts = _gptoss(6, 32, 16, 4, 4, 2, generator)
    I = 16  # noqa: E741
    views = (gu.transpose(1, 2), dn.transpose(1, 2))
    copies = (views[0].contiguous(), views[1].contiguous())
    perm = torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)])  # interleaved -> halves
    halves = (copies[0][:, perm], copies[1])
    assert views[0].stride(2) != 1 and views[1].stride(2) != 1  # the views really are strided

    def run(w, b13, interleaved):
        out = poison(torch.empty(6, 32))
        v = ExpertsVariant(b13, dnb, 1, ALPHA, LIMIT, interleaved)
        experts_triton(x, w[0], w[1], ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0,
                       out=out, config=cfg, variant=v)  # fmt: skip
        return out

    a = run(views, gub, True)
    assert torch.equal(a, run(copies, gub, True))
    assert_close(run(halves, gub[:, perm], False), a, atol=1e-5 * float(a.abs().max()), rtol=1e-5)


@pytest.mark.interpret
def test_triton_empty_batch_and_no_local_token(generator):
    x, gu, gub, dn, dnb, ids, wts = _gptoss(0, 32, 16, 4, 4, 2, generator)  # T = 0
    out = fused_moe(x, gu.transpose(1, 2), dn.transpose(1, 2), backend="triton", **_kw(gub, dnb, ids, wts))
    assert out.shape == (0, 32)
    x, gu, gub, dn, dnb, ids, wts = _gptoss(3, 32, 16, 2, 8, 2, generator)
    ids = torch.full_like(ids, 5)  # every id outside this rank's [0, 2): a zero partial sum (no bias)
    ids[:, 1] = 6  # (distinct within a row: a repeated id is refused)
    out = fused_moe(
        x, gu.transpose(1, 2), dn.transpose(1, 2), backend="triton", **_kw(gub, dnb, ids, wts, E=8)
    )
    assert torch.equal(out, torch.zeros_like(out))


# ---------------------------------------------------------------- gradients


def _grads(x, gu, gub, dn, dnb, ids, wts, dout, *, backend, dtype, recompute=False):
    """(out, and the gradients of x, gate_up_proj, down_proj, topk_weights and the two biases), the
    weights given to fused_moe as gpt-oss's transposed views."""
    xl, gul, dnl, gubl, dnbl = (t.detach().to(dtype).requires_grad_() for t in (x, gu, dn, gub, dnb))
    wl = wts.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    out = fused_moe(xl, gul.transpose(1, 2), dnl.transpose(1, 2), backend=backend, recompute=recompute,
                    **_kw(gubl, dnbl, ids, wl))  # fmt: skip
    out.backward(dout.to(out.dtype))
    return [out.detach(), xl.grad, gul.grad, dnl.grad, wl.grad, gubl.grad, dnbl.grad]


GRAD_CASES = [
    pytest.param(6, 4, 2, False, torch.float32, id="saved-fp32"),  # forward's gate/up rows saved
    pytest.param(6, 4, 2, True, torch.float32, id="recompute-fp32"),  # GEMM1 recomputed in the backward
    pytest.param(3, 8, 2, False, torch.float16, id="empty-experts-fp16"),  # 6 slots over 8 experts
    pytest.param(0, 4, 2, False, torch.float32, id="T0"),  # no tokens: zero gradients, biases included
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,E,K,recompute,dtype", GRAD_CASES)
def test_triton_gradients_match_fp64(T, E, K, recompute, dtype, generator):
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, 40, 24, E, E, K, generator, dtype)
    dout = torch.randn(T, 40, generator=generator)
    if T:
        assert _clamps_hit(x, gu, gub, ids) == (True, True, True)  # zero derivative where clamped
    got = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend="triton", dtype=dtype, recompute=recompute)
    ref = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend="torch", dtype=torch.float64)
    names = ("out", "dx", "dgate_up_proj", "ddown_proj", "dtopk_weights", "dgate_up_bias", "ddown_bias")
    tol = {torch.float32: 1e-5, torch.float16: 4e-3}[dtype]
    for name, a, e in zip(names, got, ref):
        assert a is not None, name
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        assert_close(a.float(), e.float(), atol=tol * scale, rtol=tol, name=name)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "dw_mode,block_m",
    [(0, 32), (1, 16), (2, 32)],
    ids=["gather-in-loop", "pre-gathered", "transposed"],  # every weight-gradient mode, two tile heights
)
def test_triton_backward_configs_match_fp64(dw_mode, block_m, generator):
    # the backward launcher with each configuration on the gpt-oss variant, EP slice with a -1 row:
    # the gradients of fp64 autograd of the reference (dW13 comes in w13's [E, 2I, H] order)
    import dataclasses

    T, H, I, E, E_local, offset, K = 13, 40, 24, 8, 3, 2, 3  # noqa: E741
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, H, I, E_local, E, K, generator)
    ids[1] = -1
    dout = torch.randn(T, H, generator=generator)
    v = ExpertsVariant(gub, dnb, 1, ALPHA, LIMIT, True)
    w13, w2 = gu.transpose(1, 2), dn.transpose(1, 2)
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, I, E_local))
    _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False, *v.op_args())
    cfg = dataclasses.replace(cfgs.moe_bwd_config(T, K, H, I, E_local), dw_mode=dw_mode, block_m=block_m)
    got = moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, [True] * 6, cfg, v=v)
    leaves = [t.double().requires_grad_() for t in (x, gu, dn, wts, gub, dnb)]
    out = fused_moe_torch(leaves[0], leaves[1].transpose(1, 2), leaves[2].transpose(1, 2),
                          **_kw(leaves[4], leaves[5], ids, leaves[3], offset, E))  # fmt: skip
    out.backward(dout.double())
    ref = [leaves[0].grad, leaves[1].grad.transpose(1, 2), leaves[2].grad.transpose(1, 2), leaves[3].grad,
           leaves[4].grad, leaves[5].grad]  # fmt: skip
    for name, a, e in zip(("dx", "dw13", "dw2", "dtopk_weights", "dw13_bias", "dw2_bias"), got, ref):
        assert_close(a, e, atol=1e-5 * max(1.0, float(e.abs().max())), rtol=1e-5, name=name)


@pytest.mark.interpret
def test_torch_compile_training_step_matches_eager(generator):
    # the custom ops with the variant's arguments (optional bias tensors, floats, flags), their fakes
    # and the registered autograd traced by dynamo / AOTAutograd (aot_eager: no C++ compiler on CPU)
    x, gu, gub, dn, dnb, ids, wts = _gptoss(5, 32, 16, 4, 4, 2, generator)
    leaves = [t.clone().requires_grad_() for t in (x, gu, dn, wts, gub, dnb)]

    def step(xl, gul, dnl, wl, gubl, dnbl):
        out = fused_moe(
            xl, gul.transpose(1, 2), dnl.transpose(1, 2), backend="triton", **_kw(gubl, dnbl, ids, wl)
        )
        loss = out.square().sum()
        loss.backward()
        return loss.detach()

    eager_loss = step(*leaves)
    eager = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    compiled_loss = torch.compile(step, fullgraph=False, backend="aot_eager")(*leaves)
    assert torch.equal(eager_loss, compiled_loss)
    for a, t in zip(eager, leaves):
        assert torch.equal(a, t.grad)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_closed_form_backward_matches_autograd(layout, generator):
    # experts_backward_torch (the Triton backward's spec) with biases and the clamped activation, in
    # both gate/up layouts, EP slice with a -1 row: fp64 autograd of the reference
    from replaymoe.moe import experts_backward_torch

    T, H, I, E, E_local, offset, K = 9, 32, 16, 8, 3, 2, 3  # noqa: E741
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, H, I, E_local, E, K, generator, torch.float64)
    ids[1] = -1
    w13 = gu.transpose(1, 2)
    if layout == "halves":
        perm = torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)])
        w13, gub = w13[:, perm], gub[:, perm]
    dout = torch.randn(T, H, generator=generator, dtype=torch.float64)
    kw = dict(w13_bias=gub, w2_bias=dnb, activation=ACT, gate_up_layout=layout)
    got = experts_backward_torch(
        dout, x, w13, dn.transpose(1, 2), ids, wts.double(), offset, [True] * 6, **kw
    )
    leaves = [
        t.detach().clone().requires_grad_() for t in (x, w13, dn.transpose(1, 2), wts.double(), gub, dnb)
    ]
    out = fused_moe_torch(leaves[0], leaves[1], leaves[2], topk_ids=ids, topk_weights=leaves[3],
                          local_expert_offset=offset, num_experts=E, **{**kw, "w13_bias": leaves[4],
                                                                        "w2_bias": leaves[5]})  # fmt: skip
    out.backward(dout)
    for name, a, t in zip(("dx", "dw13", "dw2", "dtopk_weights", "dw13_bias", "dw2_bias"), got, leaves):
        assert_close(a, t.grad, atol=1e-10 * max(1.0, float(t.grad.abs().max())), rtol=1e-10, name=name)


def test_torch_backend_gradients_match_fp64(generator):
    # the torch backend in fp32 (autograd of the reference through the clamps) vs fp64
    x, gu, gub, dn, dnb, ids, wts = _gptoss(7, 32, 16, 4, 4, 2, generator)
    dout = torch.randn(7, 32, generator=generator)
    got = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend="torch", dtype=torch.float32)
    ref = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend="torch", dtype=torch.float64)
    for a, e in zip(got, ref):
        assert_close(a.float(), e.float(), atol=1e-5 * max(1.0, float(e.abs().max())), rtol=1e-5)


def test_moelayer_with_expert_bias_and_clamped_activation(generator):
    # MoELayer(activation=ClampedSwiGLU(), expert_bias=True): fused_moe with its parameters; the
    # biases are trainable parameters (zeros at init) that get gradients
    torch.manual_seed(0)
    layer = MoELayer(32, 16, 4, 2, activation=ACT, expert_bias=True, backend="torch")
    assert not layer.w13_bias.detach().any() and not layer.w2_bias.detach().any()
    with torch.no_grad():
        layer.w13.mul_(5.0)  # pre-activations past the clamps
        layer.w13_bias.normal_(generator=generator)
        layer.w2_bias.normal_(generator=generator)
    x = torch.randn(2, 3, 32, generator=generator)
    y = layer(x)
    logits = layer.router(x.reshape(-1, 32))
    ref = fused_moe_torch(x.reshape(-1, 32), layer.w13, layer.w2, router_logits=logits, top_k=2,
                          activation=ACT, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)  # fmt: skip
    assert torch.equal(y.reshape(-1, 32), ref)
    y.square().sum().backward()
    assert layer.w13_bias.grad.abs().sum() > 0 and layer.w2_bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="activation"):
        MoELayer(32, 16, 4, 2, activation="relu")
    with pytest.raises(ValueError, match="expert_bias"):
        MoELayer(32, 16, 4, 2, expert_bias=1)


# ---------------------------------------------------------------- the transformers experts module


def test_transformers_gptoss_experts_module(generator):
    # replaymoe's experts implementation on transformers' own GptOssExperts equals its forward
    transformers = pytest.importorskip("transformers")
    from replaymoe.hf.experts import fused_compatible, replaymoe_experts_forward

    cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                    num_experts_per_tok=2)  # fmt: skip
    cfg._experts_implementation = "eager"
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(cfg)
    x, gu, gub, dn, dnb, ids, wts = _gptoss(6, 32, 16, 4, 4, 2, generator)
    with torch.no_grad():
        for p, v in zip((experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                         experts.down_proj_bias), (gu, gub, dn, dnb)):  # fmt: skip
            p.copy_(v)
    assert fused_compatible(experts)
    with torch.no_grad():
        ref = experts(x, ids.long(), wts)
        out = replaymoe_experts_forward(experts, x, ids, wts)
    assert_close(out, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


# ---------------------------------------------------------------- rejections


def _base(generator):
    x, gu, gub, dn, dnb, ids, wts = _gptoss(3, 32, 16, 2, 2, 1, generator)
    return dict(hidden_states=x, w13=gu.transpose(1, 2), w2=dn.transpose(1, 2), **_kw(gub, dnb, ids, wts))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda k: k.update(w13_bias=k["w13_bias"][:, :-1]), "shape of w13_bias"),  # 2I - 1 columns
        (lambda k: k.update(w2_bias=k["w2_bias"][:1]), "shape of w2_bias"),  # one expert short
        (lambda k: k.update(w13_bias=k["w13_bias"].double()), "dtype of w13_bias"),  # not fp32 / weights'
        (lambda k: k.update(w2_bias=k["w2_bias"].half()), "dtype of w2_bias"),
        (lambda k: k.update(w2_bias=[0.0]), "type of w2_bias"),  # not a tensor
        (lambda k: k.update(gate_up_layout="alternating"), "gate_up_layout"),  # unknown layout
        (lambda k: k.update(activation="gelu"), "activation"),  # unknown activation name
        (lambda k: k.update(activation=(1.702, 7.0)), "activation"),  # loose numbers, not the config
    ],
)
def test_rejects(mutate, match, generator):
    kw = _base(generator)
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        fused_moe(**kw)


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(limit=-1.0), "limit"),  # a clamp bound must be > 0
        (dict(limit=0.0), "limit"),
        (dict(alpha="1.7"), "alpha"),  # not a number
        (dict(alpha=float("nan")), "alpha"),  # not finite
        (dict(limit=True), "limit"),  # a bool is not a float here
    ],
)
def test_clamped_swiglu_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        ClampedSwiGLU(**args)


@pytest.mark.parametrize(
    "option,match",
    [
        ("w13_bias", "w13_bias"),  # fp8 takes no biases
        ("w2_bias", "w2_bias"),
        ("gate_up_layout", "gate_up_layout"),  # nor interleaved rows
        ("activation", "activation"),  # nor the clamped activation
    ],
)
def test_fp8_rejects_gptoss_options(option, match, generator):
    x = torch.randn(2, 128, generator=generator).bfloat16()
    q13, s13 = quantize_fp8_block(torch.randn(2, 256, 128, generator=generator) / 12)
    q2, s2 = quantize_fp8_block(torch.randn(2, 128, 128, generator=generator) / 12)
    extra = {
        "w13_bias": torch.zeros(2, 256),
        "w2_bias": torch.zeros(2, 128),
        "gate_up_layout": "interleaved",
        "activation": ACT,
    }
    with pytest.raises(ValueError, match=match):
        fused_moe(x, q13, q2, topk_ids=torch.zeros(2, 1, dtype=torch.int32), topk_weights=torch.ones(2, 1),
                  w13_scale=s13, w2_scale=s2, **{option: extra[option]})  # fmt: skip


# ---------------------------------------------------------------- fp16 (interpreter), bf16 (GPU)


def _grid_gptoss(T, H, I, E, K, g, dtype):  # noqa: E741
    """gpt-oss inputs on a grid: x multiples of 1/2, gate_up_proj and its bias multiples of 1/16, so
    every gate/up pre-activation is a multiple of 1/32, summed exactly in fp32 and held exactly in
    bf16/fp16 below 8: the kernels' rounded pre-activations and the fp64 reference's fall on the same
    side of every clamp (elsewhere a value within half an ulp of ±limit may flip a clamp's derivative
    between 0 and its full value). Pre-activation std about 5, so the clamps are hit."""
    k = max(1, round((38400 / H) ** 0.5))
    x = torch.randint(-2, 3, (T, H), generator=g) / 2
    gu = torch.randint(-k, k + 1, (E, H, 2 * I), generator=g) / 16
    gub = torch.randint(-16, 17, (E, 2 * I), generator=g) / 16
    dn = torch.randn(E, I, H, generator=g) / (4 * I**0.5)
    dnb = torch.randn(E, H, generator=g)
    ids, wts = _ids(T, K, E, g), torch.rand(T, K, generator=g)
    return tuple(t.to(dtype) for t in (x, gu, gub, dn, dnb)) + (ids, wts)


def _check_low_precision(T, H, I, E, K, dtype, device, tol, generator):  # noqa: E741
    x, gu, gub, dn, dnb, ids, wts = _grid_gptoss(T, H, I, E, K, generator, dtype)
    if T >= 8:
        assert _clamps_hit(x, gu, gub, ids) == (True, True, True)
    dout = torch.randn(T, H, generator=generator)
    x, gu, gub, dn, dnb, ids, wts, dout = (t.to(device) for t in (x, gu, gub, dn, dnb, ids, wts, dout))
    backend = "triton" if device == "cpu" else "auto"
    got = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend=backend, dtype=dtype)
    ref = _grads(x, gu, gub, dn, dnb, ids, wts, dout, backend="torch", dtype=torch.float64)
    names = ("out", "dx", "dgate_up_proj", "ddown_proj", "dtopk_weights", "dgate_up_bias", "ddown_bias")
    for name, a, e in zip(names, got, ref):
        assert a.dtype == (torch.float32 if name == "dtopk_weights" else dtype), name
        # low-precision products rounded between the GEMMs: relative to the tensor's scale
        assert_close(a.float(), e.float(), atol=tol * float(e.abs().max()), rtol=tol, name=name)


@pytest.mark.interpret
def test_fp16_forward_backward_on_exact_grid(generator):
    # fp16 in the interpreter, clamps hit: every output and gradient within fp16 tolerance
    _check_low_precision(16, 64, 32, 4, 2, torch.float16, "cpu", 5e-3, generator)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 256])  # eager direct decode mode (small T) and expert tiles
def test_gpu_bf16_forward_backward_vs_reference(T, generator):
    _check_low_precision(T, 256, 128, 8, 2, torch.bfloat16, "cuda", 2e-2, generator)


@pytest.mark.gpu
def test_gpu_batch_invariance(generator):
    # a token's output alone equals, bitwise, its row inside a batch of 256 (the decode and the
    # prefill kernel modes), eager and inference
    H, I, E, K, T = 256, 128, 8, 2, 256  # noqa: E741
    x, gu, gub, dn, dnb, ids, wts = _gptoss(T, H, I, E, E, K, generator, torch.bfloat16)
    x, gu, gub, dn, dnb, ids, wts = (t.cuda() for t in (x, gu, gub, dn, dnb, ids, wts))
    w13, w2 = gu.transpose(1, 2), dn.transpose(1, 2)
    full = fused_moe(x, w13, w2, **_kw(gub, dnb, ids, wts))
    for t in (0, 17, 255):
        alone = fused_moe(x[t : t + 1], w13, w2, **_kw(gub, dnb, ids[t : t + 1], wts[t : t + 1]))
        assert torch.equal(alone[0], full[t]), t

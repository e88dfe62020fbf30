"""replaymoe.hf.aux_loss: transformers' load-balancing aux loss on the expert ids actually used.

* formula parity: with ``selected = topk(softmax(logits))`` the result is bitwise transformers' own
  ``load_balancing_loss_func`` of every architecture that has one (with and without padding);
* other ids: the result follows them, and equals an independent float64 computation;
* install/uninstall: one wrapper per module, providers stacked, the original function object back
  at the end in any uninstall order, ``None`` falls through to the original;
* model level: ``out.aux_loss`` of tiny models is the formula on their ``router_logits``, and an
  installed provider's ids reach it -- through the model's own forward and TRL's fused LM head.
"""

from __future__ import annotations

import importlib
import inspect
import types
import zlib

import pytest
import torch

pytest.importorskip("transformers")

from replaymoe.hf.aux_loss import FUNC_NAME, install, load_balancing_loss, target_modules  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# architectures with a load-balancing aux loss (all five copies are byte-identical in transformers
# 5.17; the test checks each copy anyway, since they could diverge in a later release)
WITH_AUX = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss")
WITHOUT_AUX = ("deepseek_v3", "glm4_moe")  # sigmoid routers with bias balancing: no such function


def _modeling(arch: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")


def _native_ids(gate_logits, top_k):
    """What transformers' function selects: topk of the softmax in the logits' own dtype."""
    return [torch.topk(torch.softmax(g, dim=-1), top_k, dim=-1).indices for g in gate_logits]


def _distinct_ids(generator, rows, num_experts, top_k):
    """Random ids, distinct within a row (as a replayed router's are)."""
    return torch.rand(rows, num_experts, generator=generator).argsort(dim=-1)[:, :top_k]


def _reference(gate_logits, selected, num_experts, attention_mask=None):
    """Independent float64 formula: E * sum_e f_e * P_e, with f_e (token-slots of expert e) and P_e
    (router probability of e) averaged over the (mask-weighted) rows of *all* layers pooled."""
    L = len(gate_logits)
    w = (
        torch.ones(gate_logits[0].shape[0], dtype=torch.float64)
        if attention_mask is None
        else attention_mask.reshape(-1).double()
    )
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    for g, ids in zip(gate_logits, selected):
        p = torch.softmax(g.to(torch.float32), dim=-1).double()  # the softmax in fp32 (reference rounding)
        onehot = torch.zeros(g.shape[0], num_experts, dtype=torch.float64)
        for t in range(g.shape[0]):
            for e in ids[t].tolist():
                if e >= 0:
                    onehot[t, e] += 1.0
        counts += (onehot * w[:, None]).sum(0)
        probs += (p * w[:, None]).sum(0)
    rows = L * w.sum()
    return float(num_experts * ((counts / rows) * (probs / rows)).sum())


def _logits(generator, layers, rows, num_experts, dtype, *, ties=False):
    out = []
    for _ in range(layers):
        g = torch.randn(rows, num_experts, generator=generator) * 2
        if ties:
            g = (g * 2).round() / 2  # coarse grid: many equal logits in a row, topk's tie order matters
        out.append(g.to(dtype))
    return tuple(out)


# one dtype/shape edge per architecture (the function is shared, so every edge is checked on one
# of the copies; all copies also see fp32 via the model-level test)
ARCH_CASE = {
    "qwen3_moe": dict(dtype=torch.float32, E=8, K=2),  # plain fp32
    "qwen2_moe": dict(dtype=torch.float16, E=8, K=4),  # fp16 softmax, wider top-k
    "olmoe": dict(dtype=torch.float64, E=16, K=8),  # fp64 logits (softmax in fp64, then .float())
    "mixtral": dict(dtype=torch.bfloat16, E=8, K=2),  # bf16 softmax: the loss's probabilities are bf16
    "gpt_oss": dict(dtype=torch.float32, E=8, K=2, ties=True),  # tied logits: topk tie order
}


@pytest.mark.parametrize("mask", ["none", "left_pad", "right_pad", "empty_row"])
@pytest.mark.parametrize("arch", WITH_AUX)
def test_native_routing_equals_transformers(arch, mask):
    case = ARCH_CASE[arch]
    E, K = case["E"], case["K"]
    B, S, L = 3, 5, 3
    g = torch.Generator().manual_seed(zlib.crc32(f"{arch}-{mask}".encode()))
    gate_logits = _logits(g, L, B * S, E, case["dtype"], ties=case.get("ties", False))
    attention_mask = None
    if mask != "none":
        attention_mask = torch.ones(B, S, dtype=torch.long)
        attention_mask[1, :2] = 0 if mask == "left_pad" else 1
        if mask == "right_pad":
            attention_mask[1, 3:] = 0
            attention_mask[2, 4:] = 0
        if mask == "empty_row":  # a row entirely padding
            attention_mask[0] = 0
    theirs = getattr(_modeling(arch), FUNC_NAME)(gate_logits, E, K, attention_mask)
    ours = load_balancing_loss(gate_logits, _native_ids(gate_logits, K), E, K, attention_mask)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == ()
    assert torch.equal(ours, theirs), (ours.item(), theirs.item())


def test_copies_are_identical_and_absent_where_expected():
    """The transformers copies are the same source; DeepSeek-V3 and GLM4-MoE have none."""
    src = {arch: inspect.getsource(getattr(_modeling(arch), FUNC_NAME)) for arch in WITH_AUX}
    assert len(set(src.values())) == 1
    for arch in WITHOUT_AUX:
        assert not hasattr(_modeling(arch), FUNC_NAME)


@pytest.mark.parametrize("masked", [False, True])
def test_replayed_ids_follow_and_match_independent_formula(masked):
    E, K, B, S, L = 8, 2, 2, 6, 3
    g = torch.Generator().manual_seed(7)
    gate_logits = _logits(g, L, B * S, E, torch.float32)
    attention_mask = None
    if masked:
        attention_mask = torch.ones(B, S, dtype=torch.long)
        attention_mask[0, :3] = 0
    native = _native_ids(gate_logits, K)
    replayed = [_distinct_ids(g, B * S, E, K).to(torch.int32) for _ in range(L)]  # int32, as the fused path's
    assert not all(torch.equal(a.sort(-1).values, b.long().sort(-1).values) for a, b in zip(native, replayed))
    ours = load_balancing_loss(gate_logits, replayed, E, K, attention_mask)
    theirs = getattr(_modeling("qwen3_moe"), FUNC_NAME)(gate_logits, E, K, attention_mask)
    assert not torch.equal(ours, theirs)
    assert ours.item() == pytest.approx(_reference(gate_logits, replayed, E, attention_mask), rel=2e-6)
    # and the native ids against the same reference (the reference is right, not just different)
    assert theirs.item() == pytest.approx(_reference(gate_logits, native, E, attention_mask), rel=2e-6)


def test_pooled_over_layers_not_a_sum_of_layer_losses():
    """The loss is the product of layer-pooled means, not sum_l (E * f_l . P_l)."""
    E, K, T, L = 8, 2, 10, 3
    g = torch.Generator().manual_seed(3)
    gate_logits = _logits(g, L, T, E, torch.float32)
    ids = [_distinct_ids(g, T, E, K) for _ in range(L)]
    pooled = load_balancing_loss(gate_logits, ids, E, K).item()
    per_layer_sum = sum(load_balancing_loss([gl], [i], E, K).item() for gl, i in zip(gate_logits, ids))
    assert pooled == pytest.approx(_reference(gate_logits, ids, E), rel=2e-6)
    assert pooled != pytest.approx(per_layer_sum, rel=1e-3)


def test_empty_slots_count_for_no_expert():
    E, K, T = 8, 2, 6
    g = torch.Generator().manual_seed(5)
    gate_logits = _logits(g, 2, T, E, torch.float32)
    ids = [_distinct_ids(g, T, E, K) for _ in range(2)]
    ids[0][1, 1] = -1
    ids[1][4, 0] = -1
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    for m in (None, mask):
        assert load_balancing_loss(gate_logits, ids, E, K, m).item() == pytest.approx(
            _reference(gate_logits, ids, E, m), rel=2e-6
        )


def test_gradient_reaches_logits_through_probabilities():
    """Counts are constants; the gradient is the router-probability term's, as in transformers."""
    E, K, T = 8, 2, 6
    g = torch.Generator().manual_seed(9)
    gate_logits = tuple(x.requires_grad_() for x in _logits(g, 2, T, E, torch.float32))
    ids = _native_ids(gate_logits, K)
    load_balancing_loss(gate_logits, ids, E, K).backward()
    theirs = tuple(x.detach().clone().requires_grad_() for x in gate_logits)
    getattr(_modeling("qwen3_moe"), FUNC_NAME)(theirs, E, K).backward()
    for a, b in zip(gate_logits, theirs):
        assert a.grad.abs().sum() > 0 and torch.equal(a.grad, b.grad)


def test_bad_inputs_raise():
    E, K, T = 8, 2, 4
    gl = (torch.randn(T, E),)
    ok = torch.zeros(T, K, dtype=torch.long)
    with pytest.raises(ValueError, match="no gate logits"):
        load_balancing_loss((), (), E, K)
    with pytest.raises(ValueError, match="2 selected-id tensors for 1 layers"):
        load_balancing_loss(gl, (ok, ok), E, K)
    with pytest.raises(ValueError, match=r"expected \[4, 2\]"):
        load_balancing_loss(gl, (ok[:, :1],), E, K)
    with pytest.raises(ValueError, match=r"expected \[4, 2\]"):
        load_balancing_loss(gl, (ok[:3],), E, K)
    with pytest.raises(ValueError, match="must be integers"):
        load_balancing_loss(gl, (ok.float(),), E, K)
    with pytest.raises(ValueError, match="expert id 8 >= num_experts=8"):
        load_balancing_loss(gl, (ok + 8,), E, K)


# ------------------------------------------------------------------------------------- patching


def _fake_module():
    """A stand-in modeling module whose original function records its calls."""
    mod = types.ModuleType("fake_modeling")
    calls = []

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        calls.append((gate_logits, num_experts, top_k, attention_mask))
        return "original"

    mod.load_balancing_loss_func = load_balancing_loss_func
    return mod, load_balancing_loss_func, calls


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_install_nests_and_restores_the_original_object(order):
    mod, original, _ = _fake_module()
    u1 = install(mod, lambda gl: None)
    wrapper = mod.load_balancing_loss_func
    assert wrapper is not original and wrapper.__wrapped__ is original
    assert inspect.signature(wrapper) == inspect.signature(original)
    u2 = install(mod, lambda gl: None)
    assert mod.load_balancing_loss_func is wrapper  # one wrapper, not a wrapper of a wrapper
    first, second = (u1, u2) if order == "fifo" else (u2, u1)
    first()
    assert mod.load_balancing_loss_func is wrapper
    first()  # idempotent: does not remove the other provider
    assert mod.load_balancing_loss_func is wrapper
    second()
    assert mod.load_balancing_loss_func is original
    second()
    assert mod.load_balancing_loss_func is original
    # a fresh install after a full uninstall patches again
    u3 = install(mod, lambda gl: None)
    assert mod.load_balancing_loss_func is not original
    u3()
    assert mod.load_balancing_loss_func is original


def test_install_on_real_module_restores_it():
    # (a model enabled elsewhere in this process and still alive may have installed the wrapper
    # already: then the module keeps it, and ours only adds and removes providers)
    mod = _modeling("qwen3_moe")
    before = mod.load_balancing_loss_func
    original = getattr(before, "__wrapped__", before)
    uninstalls = [install(mod, lambda gl: None) for _ in range(3)]
    assert mod.load_balancing_loss_func is not original
    assert mod.load_balancing_loss_func.__wrapped__ is original
    for u in (uninstalls[1], uninstalls[2], uninstalls[0]):
        u()
    assert mod.load_balancing_loss_func is before


def test_provider_none_falls_through_and_first_answer_wins():
    mod, original, calls = _fake_module()
    E, K, T = 8, 2, 4
    gl = (torch.randn(T, E), torch.randn(T, E))
    asked = []
    ids_a = [torch.zeros(T, K, dtype=torch.long) + torch.tensor([0, 1])] * 2
    ids_b = [torch.zeros(T, K, dtype=torch.long) + torch.tensor([2, 3])] * 2

    def none_provider(x):
        asked.append("none")
        return None

    u0 = install(mod, none_provider)
    mask = torch.ones(2, 2)
    assert mod.load_balancing_loss_func(gl, E, K, mask) == "original"
    assert calls == [(gl, E, K, mask)] and asked == ["none"]
    u1 = install(mod, lambda x: ids_a if x is gl else None)
    u2 = install(mod, lambda x: ids_b if x is gl else None)
    out = mod.load_balancing_loss_func(gl, E, K)
    assert torch.equal(out, load_balancing_loss(gl, ids_a, E, K)) and len(calls) == 1
    u1()
    out = mod.load_balancing_loss_func(gl, num_experts=E, top_k=K)
    assert torch.equal(out, load_balancing_loss(gl, ids_b, E, K)) and len(calls) == 1
    other = (torch.randn(T, E),)
    assert mod.load_balancing_loss_func(other, E, K) == "original" and len(calls) == 2
    # what the original answers with 0 (no tuple of logits) goes to it without asking
    n = len(asked)
    assert mod.load_balancing_loss_func(None, E, K) == "original" and len(asked) == n
    u2()
    u0()
    assert mod.load_balancing_loss_func is original


def test_provider_none_on_real_module_is_bitwise_the_original():
    mod = _modeling("mixtral")
    original = mod.load_balancing_loss_func
    g = torch.Generator().manual_seed(1)
    gl = _logits(g, 2, 6, 8, torch.bfloat16)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    want = original(gl, 8, 2, mask)
    u = install(mod, lambda x: None)
    try:
        assert torch.equal(mod.load_balancing_loss_func(gl, 8, 2, mask), want)
    finally:
        u()
    assert mod.load_balancing_loss_func is original


def test_foreign_patch_over_ours_is_respected():
    mod, original, _ = _fake_module()
    u1 = install(mod, lambda gl: None)
    ours = mod.load_balancing_loss_func

    def theirs(*a, **k):  # someone else wraps our wrapper (functools.wraps-style link)
        return ours(*a, **k)

    theirs.__wrapped__ = ours
    mod.load_balancing_loss_func = theirs
    u2 = install(mod, lambda gl: None)  # still reachable through theirs: allowed
    u1()
    u2()
    assert mod.load_balancing_loss_func is theirs  # not clobbered
    mod.load_balancing_loss_func = original


def test_replaced_behind_our_back_raises():
    mod, original, _ = _fake_module()
    u = install(mod, lambda gl: None)
    mod.load_balancing_loss_func = original  # e.g. a reload put the original back
    with pytest.raises(RuntimeError, match="does not call replaymoe's wrapper"):
        install(mod, lambda gl: None)
    u()
    assert mod.load_balancing_loss_func is original


def test_install_without_function_raises():
    with pytest.raises(ValueError, match="has no load_balancing_loss_func"):
        install(_modeling("deepseek_v3"), lambda gl: None)
    with pytest.raises(TypeError):
        install(_fake_module()[0], None)


# ------------------------------------------------------------------------------------ model level


def _padded_batch(vocab, B=2, S=6):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    ids[0, :2] = 0
    return ids, mask


@pytest.mark.parametrize("arch", WITH_AUX)
def test_model_aux_loss_is_the_formula(arch):
    """out.aux_loss of the model's own forward is load_balancing_loss on its router_logits with topk ids
    (qwen3_moe is the case the session wires first; the others check their copy and router output)."""
    model = build_model(arch, "tiny", device="cpu", dtype=torch.float32)
    cfg = model.config
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    input_ids, attention_mask = _padded_batch(cfg.vocab_size)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
    assert len(out.router_logits) == cfg.num_hidden_layers
    ours = load_balancing_loss(out.router_logits, _native_ids(out.router_logits, K), E, K, attention_mask)
    assert torch.equal(out.aux_loss, ours), (out.aux_loss.item(), ours.item())


def test_model_forward_uses_installed_provider_ids():
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    cfg = model.config
    E, K, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    input_ids, attention_mask = _padded_batch(cfg.vocab_size)
    g = torch.Generator().manual_seed(2)
    replayed = [_distinct_ids(g, input_ids.numel(), E, K) for _ in range(L)]
    seen = []

    def provider(gate_logits):
        seen.append(gate_logits)
        return replayed

    (mod,) = [m for m in target_modules(model) if m.__name__.endswith("qwen3_moe")]
    original = mod.load_balancing_loss_func
    u = install(mod, provider)
    try:
        with torch.no_grad():
            out = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
    finally:
        u()
    assert mod.load_balancing_loss_func is original
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], out.router_logits, strict=True))
    want = load_balancing_loss(out.router_logits, replayed, E, K, attention_mask)
    assert torch.equal(out.aux_loss, want)
    native = load_balancing_loss(out.router_logits, _native_ids(out.router_logits, K), E, K, attention_mask)
    assert not torch.equal(out.aux_loss, native)


def test_target_modules():
    names = lambda model: [m.__name__.rsplit(".", 1)[-1] for m in target_modules(model)]  # noqa: E731
    assert names(build_model("qwen3_moe", "tiny")) == ["modeling_qwen3_moe", "modeling_mixtral"]
    assert names(build_model("mixtral", "tiny")) == ["modeling_mixtral"]
    assert names(build_model("deepseek_v3", "tiny")) == []


def test_trl_fused_lm_head_uses_mixtral_module_at_call_time():
    """TRL 1.16's fused LM head (every TRL trainer's forward) computes the aux loss with
    modeling_mixtral.load_balancing_loss_func, imported inside the forward: an install on that
    module reaches it, for a Qwen3-MoE model too; an install on modeling_qwen3_moe alone does not."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    cfg = model.config
    E, K, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    trl_utils.add_fused_lm_head(model)
    input_ids, attention_mask = _padded_batch(cfg.vocab_size)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    g = torch.Generator().manual_seed(4)
    replayed = [_distinct_ids(g, input_ids.numel(), E, K) for _ in range(L)]
    captured = []

    def run():
        with torch.no_grad():
            return model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                labels=labels,
                output_router_logits=True,
                fused_lm_head=True,
            ).aux_loss

    def provider(gate_logits):
        captured.append(gate_logits)
        return replayed

    native = run()
    own, trl_mod = target_modules(model)
    u = install(own, provider)
    try:
        assert torch.equal(run(), native) and not captured  # the model's module is not TRL's path
    finally:
        u()
    u = install(trl_mod, provider)
    try:
        got = run()
    finally:
        u()
    assert len(captured) == 1
    assert torch.equal(got, load_balancing_loss(captured[0], replayed, E, K, attention_mask))
    assert torch.equal(
        native, load_balancing_loss(captured[0], _native_ids(captured[0], K), E, K, attention_mask)
    )
    assert not torch.equal(got, native)

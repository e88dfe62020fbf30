"""transformers' own experts behind replaymoe's routers (CPU, tiny random models).

``enable(model, experts=False)`` keeps the model's experts implementation, and
``model.set_experts_implementation(...)`` after ``enable()`` switches the experts back: either way
transformers' experts code runs on the ids the patched router returns. It must get what
transformers' own router returns (int64 ids: OLMoE's eager experts ``one_hot`` them, which takes
int64 only), give the unpatched model's outputs and gradients, and still see the forced ids under
replay; replaymoe's own experts keep getting ``route``'s int32 ids with no cast.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402
from replaymoe.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# fp32 whole-model logits and gradients: routing weights and the experts' sums in another order
TOL = dict(atol=1e-4, rtol=1e-4)

# the architectures whose experts transformers' own eager / batched_mm code runs (OLMoE: the
# one_hot of the reported failure; Qwen3-MoE: renormalised softmax; Mixtral: its own router family)
ARCHS = ("olmoe", "qwen3_moe", "mixtral")


class _SeenIds:
    """Forward pre-hooks on every experts module: the ids each call was handed."""

    def __init__(self, model):
        self.ids: list[torch.Tensor] = []
        self.handles = [
            info.experts.register_forward_pre_hook(self._hook) for info in rhf.find_moe_layers(model)
        ]

    def _hook(self, module, args):
        self.ids.append(args[1].detach().clone())

    def dtypes(self) -> set[torch.dtype]:
        return {t.dtype for t in self.ids}

    def remove(self):
        for h in self.handles:
            h.remove()


def _batch(model, generator):
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    return ids, mask


def _step(model, ids, mask):
    """One forward and backward: logits and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _enable(model, impl, how, **kw):
    if how == "experts=False":  # the model keeps its experts implementation
        model.set_experts_implementation(impl)
        return rhf.enable(model, experts=False, **kw)
    moe = rhf.enable(model, **kw)  # switches the experts to "replaymoe" ...
    model.set_experts_implementation(impl)  # ... and the user switches them back
    return moe


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "impl, how, dtype",
    [
        ("eager", "experts=False", torch.int64),  # the loop over experts: one_hot(ids)
        ("eager", "switched back", torch.int64),  # enable() switched to replaymoe, then back
        ("batched_mm", "experts=False", torch.int64),  # gathers the weights by ids
        ("batched_mm", "switched back", torch.int64),
        ("replaymoe", "enable()", torch.int32),  # the fused hot path: route's ids as they are
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_own_experts_get_int64_ids_and_unpatched_outputs(arch, impl, how, dtype, generator):
    ref_model = build_model(arch)
    ref_model.set_experts_implementation("eager" if impl == "replaymoe" else impl)
    ids, mask = _batch(ref_model, generator)
    seen = _SeenIds(ref_model)
    ref, ref_grads = _step(ref_model, ids, mask)
    assert seen.dtypes() == {torch.int64}  # transformers' own router

    model = build_model(arch)
    moe = rhf.enable(model) if impl == "replaymoe" else _enable(model, impl, how)
    assert model.config._experts_implementation == impl
    seen = _SeenIds(model)
    out, grads = _step(model, ids, mask)
    assert seen.dtypes() == {dtype}, f"{arch} {impl}: the experts got {seen.dtypes()}"
    assert len(seen.ids) == len(moe.layers)
    assert_close(out, ref, **TOL, name=f"{arch} {impl} logits")
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_close(grads[name], g, **TOL, name=f"{arch} {impl} grad {name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "impl, how",
    [
        ("eager", "experts=False"),  # one_hot of the forced ids
        ("eager", "switched back"),
        ("batched_mm", "switched back"),  # gathers by the forced ids
    ],
)
def test_own_experts_under_capture_and_replay(arch, impl, how, generator):
    model = build_model(arch)
    moe = _enable(model, impl, how, capture=True)
    ids, mask = _batch(model, generator)
    seen = _SeenIds(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    rollout, rollout_ids = moe.traces(), seen.ids
    # move the routers so that native routing differs from the rollout's
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for info in moe.layers:
            w = info.router.weight
            w.add_(torch.randn(w.shape, generator=g) * 0.5 * w.std())
    seen.ids = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    native_ids = seen.ids
    assert any(not torch.equal(a, b) for a, b in zip(native_ids, rollout_ids))

    seen.ids = []
    model.zero_grad(set_to_none=True)
    with moe.replaying(rollout):
        out = model(input_ids=ids, attention_mask=mask).logits
    assert seen.dtypes() == {torch.int64}
    real = mask.reshape(-1).bool()  # padding rows route natively (nothing recorded for them)
    for layer, (got, want) in enumerate(zip(seen.ids, rollout_ids)):
        assert torch.equal(got[real], want[real]), f"{arch} {impl}: layer {layer} not forced"
    (out * mask[..., None]).square().mean().backward()
    for info in moe.layers:
        grad = info.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, info.name


@pytest.mark.parametrize("arch", ARCHS)
def test_own_experts_in_generate_with_capture(arch, generator):
    # generate (prefill, then one-token decode steps with a cache) on switched-back eager experts:
    # the unpatched model's greedy tokens, and one trace per sequence
    ref_model = build_model(arch)
    ref_model.set_experts_implementation("eager")
    ids, mask = _batch(ref_model, generator)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        ref = ref_model.generate(**kw)
    model = build_model(arch)
    moe = _enable(model, "eager", "switched back", capture=True)
    seen = _SeenIds(model)
    with torch.no_grad():
        out = model.generate(**kw)
    assert torch.equal(out, ref)
    assert seen.dtypes() == {torch.int64}
    assert len(moe.traces()) == ids.shape[0]

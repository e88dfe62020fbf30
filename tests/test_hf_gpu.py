"""transformers integration on the GPU: medium bf16 models through the Triton routing and fused-MoE
kernels (``PYTHONPATH=src python3 -m pytest -q -m gpu tests/test_hf_gpu.py``).

bf16 router logits can tie exactly; transformers' ``torch.topk`` and replaymoe (ties to the smaller
index) may then pick different experts, so id comparisons with the model's own router accept a
mismatch only where the k-th and (k+1)-th selection scores are equal.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu

ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe", "gpt_oss"]


def _batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, P - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, P - n :] = 1
    return ids.cuda(), mask.cuda()


def _model(arch):
    return build_model(arch, "medium", dtype=torch.bfloat16, device="cuda")


def _selection_scores(router, logits):
    """The score transformers' router ranks on (for the tie check)."""
    x = logits.float()
    if hasattr(router, "e_score_correction_bias"):
        return x.sigmoid() + router.e_score_correction_bias.float()
    return x


class _OwnRouter:
    """Forward hooks recording the router class's own top-k and selection scores per call."""

    def __init__(self, moe):
        self.calls = {}
        self.handles = [info.router.register_forward_hook(self._hook(info.index)) for info in moe.layers]

    def _hook(self, i):
        def hook(router, args, output):
            with torch.no_grad():
                logits, _, own = type(router).forward(router, args[0])
            scores = _selection_scores(router, logits)
            self.calls.setdefault(i, []).append((own.reshape(-1, own.shape[-1]), scores, output[2]))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _check_ids_vs_own(own_ids, scores, got_ids, K):
    """Sets equal except where the k-th and (k+1)-th selection scores tie."""
    a = torch.sort(own_ids.long(), -1).values
    b = torch.sort(got_ids.long(), -1).values
    bad = (a != b).any(-1)
    if bad.any():
        top = torch.topk(scores[bad], K + 1, dim=-1).values
        assert torch.equal(top[:, K - 1], top[:, K]), f"{int(bad.sum())} rows differ without a tie"
    return float(bad.float().mean())


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_patched_vs_unpatched_and_capture(arch, monkeypatch):
    # fp32 eager model = the truth; the bf16 model is its copy. bf16 noise in a random 4-layer model
    # is large (DeepSeek-V3's MLA: ~16% relative logit error for transformers' own bf16 path), so the
    # patched model must be as close to the truth as the unpatched bf16 model, not equal to it.
    truth_model = build_model(arch, "medium", dtype=torch.float32, device="cuda")
    truth_model.set_experts_implementation("eager")
    ids, mask = _batch(truth_model.config.vocab_size, [96, 64, 17, 1])
    with torch.no_grad():
        truth = truth_model(input_ids=ids, attention_mask=mask).logits.float()
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    model.set_experts_implementation("grouped_mm")  # transformers' default: the unpatched reference
    del truth_model
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits.float()
    import replaymoe.moe as rmoe
    import replaymoe.moe._backward as rmoe_bwd
    import replaymoe.moe._forward as rmoe_fwd

    calls = {"fused": 0}
    real = rmoe.fused_moe

    def spy(*a, **k):
        calls["fused"] += 1
        assert k.get("backend") == "auto" and a[0].is_cuda  # -> the Triton kernels
        return real(*a, **k)

    def spy_direct(executor):  # the standard experts past fused_moe's checks (always the Triton kernels)
        def f(*a, **k):
            calls["fused"] += 1
            assert a[0].is_cuda
            return executor(*a, **k)

        return f

    monkeypatch.setattr(rmoe, "fused_moe", spy)
    monkeypatch.setattr(rmoe_fwd, "experts_triton", spy_direct(rmoe_fwd.experts_triton))
    monkeypatch.setattr(rmoe_bwd, "experts_triton_train", spy_direct(rmoe_bwd.experts_triton_train))
    moe = rhf.enable(model, capture=True)
    own = _OwnRouter(moe)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits.float()
    own.remove()
    traces = moe.traces()
    assert calls["fused"] == len(moe.layers)  # gpt-oss included (its own layout, biases, clamps)
    # whole-model logits: bf16 expert sums in another order; later layers may flip near-tie tokens
    keep = mask.bool()

    def rel(x):
        return float((x[keep] - truth[keep]).norm() / truth[keep].norm())

    assert rel(out) <= 1.5 * rel(ref) + 0.01, (
        f"patched {rel(out):.3g} vs unpatched {rel(ref):.3g} (bf16 vs fp32)"
    )
    # layer by layer, the patched router picked what the class's own router picks on the same input
    K = moe.top_k
    for i, calls_i in own.calls.items():
        ((own_ids, scores, got),) = calls_i
        flat_keep = keep.reshape(-1)
        # (with bf16 logits ~N(0, 2) over 64 experts the k-th/(k+1)-th scores tie for several % of
        # tokens, so only the per-row tie check is asserted, not a mismatch rate)
        _check_ids_vs_own(own_ids[flat_keep], scores[flat_keep], got[flat_keep], K)
        # and the trace holds exactly the ids the patched router returned, padding excluded
        got_b = got.reshape(ids.shape[0], ids.shape[1], K).cpu().numpy()
        for b, tr in enumerate(traces):
            np.testing.assert_array_equal(tr.ids[:, i], got_b[b][keep[b].cpu().numpy()])
    assert [t.num_tokens for t in traces] == [96, 64, 17, 1]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_gpu_generate_capture_replay_and_grads(arch):
    model = _model(arch)
    lengths, new = [40, 25, 7], 12
    ids, mask = _batch(model.config.vocab_size, lengths, seed=1)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    rollout = moe.traces()
    assert [t.num_tokens for t in rollout] == [n + new - 1 for n in lengths]
    assert all(t.missing_fraction() == 0.0 for t in rollout)
    full_mask = torch.cat([mask, torch.ones(len(lengths), new, dtype=mask.dtype, device="cuda")], 1)

    # replay at the same weights: every recorded id forced, logits as the native forward's
    with torch.no_grad():
        native = model(input_ids=gen, attention_mask=full_mask).logits.float()
    native_tr = moe.traces()
    with torch.no_grad(), moe.replaying(native_tr):
        again = model(input_ids=gen, attention_mask=full_mask).logits.float()
        rep = moe.report()
    assert rep.layers_with_fallback == 0
    for a, b in zip(native_tr, moe.traces()):
        np.testing.assert_array_equal(a.ids, b.ids)
    keep = full_mask.bool()
    assert torch.allclose(again[keep], native[keep], atol=2e-2, rtol=2e-2)

    # perturb the routers, replay the rollout in a training forward: ids kept, grads reach routers
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for info in moe.layers:
            w = info.router.weight
            w.add_(torch.randn(w.shape, generator=g, device="cuda").to(w.dtype) * 0.3 * w.float().std())
    with torch.no_grad():
        model(input_ids=gen, attention_mask=full_mask)
    perturbed_native = moe.traces()
    assert any(
        not np.array_equal(np.sort(a.ids, -1), np.sort(b.ids[: a.num_tokens], -1))
        for a, b in zip(rollout, perturbed_native)
    )
    model.train()
    model.zero_grad(set_to_none=True)
    with moe.replaying(rollout):
        logits = model(input_ids=gen, attention_mask=full_mask).logits
        rep = moe.report()
    replayed = moe.traces()
    for a, b in zip(rollout, replayed):
        np.testing.assert_array_equal(b.ids[: a.num_tokens], a.ids)  # forced, column order kept
    # the only fallback is each sequence's last token (never fed back during generate)
    assert rep.fallback_tokens_per_layer.tolist() == [len(lengths)] * len(moe.layers)
    lp = torch.log_softmax(logits[:, -new - 1 : -1].float(), -1)
    lp.gather(-1, gen[:, -new:, None]).mean().backward()
    for info in moe.layers:
        grad = info.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.float().abs().sum() > 0
    model.eval()


def test_gpu_minus_one_rows_fall_back():
    model = _model("qwen3_moe")
    ids, mask = _batch(model.config.vocab_size, [32, 32], seed=2)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    rollout = moe.traces()
    holes = []
    for t in rollout:
        x = t.ids.copy()
        x[::2] = -1
        holes.append(t.replace(ids=x))
    with torch.no_grad(), moe.replaying(holes, missing="native"):  # (the default raises: below)
        model(input_ids=ids, attention_mask=mask)
        rep = moe.report()
    got = moe.traces()
    assert rep.fallback_tokens_per_layer.tolist() == [32] * len(moe.layers)
    for h, g, r in zip(holes, got, rollout):
        miss = h.ids[..., 0] < 0
        np.testing.assert_array_equal(g.ids[~miss], h.ids[~miss])
        # same weights: native routing of the holes gives (up to bf16 near-ties) the rollout's ids
        same = (np.sort(g.ids[miss], -1) == np.sort(r.ids[miss], -1)).all(-1).mean()
        assert same > 0.98


@pytest.mark.parametrize("graphs", [True, False], ids=["block-graphs", "eager-blocks"])
def test_gpu_uncovered_tokens_raise_without_a_sync_in_the_forward(graphs):
    # strict coverage on the GPU: a forward counts uncovered lookups on the device and copies the
    # counters to the host asynchronously; the next forward's start raises once the copy is done,
    # naming row, position and layer. Without a mask (transformers' own mask builder reads a mask on
    # the host) CUDA's sync debug mode checks that the counting waits for nothing; with a 2-D mask the
    # step bookkeeping kernel counts them itself
    model = _model("qwen3_moe")
    ids, mask = _batch(model.config.vocab_size, [16, 16], seed=3)
    moe = rhf.enable(model, capture=True, graphs=graphs)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    # by batch row (no tokens: the masked forward takes the kernel); position 5 is one past the trace
    cut = [t.replace(ids=t.ids[:5], token_ids=None) for t in moe.traces()]
    moe.set_capture(False)
    moe.set_replay(cut)
    with torch.no_grad():
        for masked in (False, True):
            kw = dict(attention_mask=mask) if masked else {}
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default" if masked else "error")
            try:
                model(input_ids=ids, **kw)  # no wait, no error yet
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            with pytest.raises(ValueError, match="batch row 0, position 6, MoE layer 0"):
                model(input_ids=ids, **kw)
        model(input_ids=ids, attention_mask=mask)  # the counters start again: this one raises
        with pytest.raises(ValueError, match="coverage of replay"):
            moe.report()  # at the latest at a check point (one host sync)
        moe.set_replay(None)
    moe.disable()


def test_gpu_demo_runs(tmp_path):
    from replaymoe.apps.demo import main

    assert main(["--device", "cuda", "--fast", "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "heatmap.png").exists() and len(list((tmp_path / "traces").glob("*.rmtrace"))) == 4


def test_gpu_static_cache_generate_capture_and_replay():
    # transformers compiles the decode step (inductor, CUDA graphs) with a static cache
    model = _model("qwen3_moe")
    lengths, new = [40, 25, 7], 12
    ids, mask = _batch(model.config.vocab_size, lengths, seed=4)

    def generate(**kw):
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation="static",
                **kw,
            )

    moe = rhf.enable(model, capture=True)
    torch._dynamo.utils.counters.clear()
    out = generate()
    rollout = moe.traces()
    assert [t.num_tokens for t in rollout] == [n + new - 1 for n in lengths]
    assert all(t.missing_fraction() == 0.0 for t in rollout)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    again = generate()
    assert torch.equal(again, out)
    for a, b in zip(rollout, moe.traces()):
        np.testing.assert_array_equal(a.ids, b.ids)
    # replay with capture on: the captured ids are exactly the forced ones, tokens unchanged
    with moe.replaying(rollout):
        replayed = generate()
        rep = moe.report()
    assert torch.equal(replayed, out)
    assert rep.fallback_tokens_per_layer.tolist() == [0] * len(moe.layers)
    for a, b in zip(rollout, moe.traces()):
        np.testing.assert_array_equal(a.ids, b.ids)
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) <= 1  # replay is one new graph
    moe.disable()


def test_gpu_reduce_overhead_replayed_training_forward():
    # the trainer side under CUDA graphs: new traces of the same shape each step, no re-record
    model = _model("qwen3_moe")
    ids, mask = _batch(model.config.vocab_size, [48, 48], seed=5)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        eager_native = model(input_ids=ids, attention_mask=mask).logits.float()
    traces = moe.traces()
    moe.set_capture(True)  # capture and replay together: the captured ids must be the forced ones
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for step in range(3):
        with torch.no_grad(), moe.replaying(traces):
            got = compiled(input_ids=ids, attention_mask=mask).logits.float()
            rep = moe.report()
        assert rep.layers_with_fallback == 0
        for a, b in zip(traces, moe.traces()):
            np.testing.assert_array_equal(a.ids, b.ids)
        rel = float((got - eager_native).norm() / eager_native.norm())
        assert rel < 2e-2, (step, rel)  # inductor's bf16 arithmetic differs from eager's in rounding
    # with a gradient: the replayed training step reaches the routers
    moe.set_capture(False)
    model.train()
    with moe.replaying(traces):
        loss = compiled(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean()
    loss.backward()
    for info in moe.layers:
        grad = info.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.float().abs().sum() > 0
    model.eval()
    moe.disable()


@pytest.mark.parametrize("mode", ["plain", "capture", "replay"])
def test_gpu_forward_has_no_host_sync(mode):
    # a prefill and decode steps with the patched model: CUDA's sync debug mode turns any
    # device-to-host wait (.item(), .tolist(), nonzero, a blocking copy) into an error. No
    # attention mask: transformers' own mask builder reads the mask on the host.
    from transformers import DynamicCache

    model = _model("qwen3_moe")
    ids, mask = _batch(model.config.vocab_size, [24, 24], seed=6)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    traces = moe.traces()
    moe.set_capture(mode == "capture")
    if mode == "replay":
        moe.set_replay(traces)

    def run():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)

    with torch.no_grad():
        run()  # warm-up: kernels compiled, capture buffer sized
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if mode == "capture":
        assert [t.num_tokens for t in moe.traces()][-2:] == [24 + 3, 24 + 3]
    moe.disable()


# each case: (what the call changes, whether it still goes straight to the Triton executors)
_EXPERT_CALLS = [
    ("as the router gives it", True),
    ("int64 ids and bf16 weights (converted first)", True),
    ("fp32 activations (cast to the weights' dtype)", True),
    ("no tokens (T = 0)", False),
    ("ids of another batch (T mismatch: fused_moe's error)", False),
]


@pytest.mark.parametrize("case, direct", _EXPERT_CALLS, ids=[c for c, _ in _EXPERT_CALLS])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_gpu_experts_past_checks_match_fused_moe(case, direct, grad, monkeypatch):
    # the "replaymoe" experts function skips fused_moe's checks only where the call's metadata is one
    # fused_moe accepts; there it returns fused_moe's bits and gradients, elsewhere fused_moe runs (and
    # raises)
    import replaymoe.moe as rmoe
    import replaymoe.moe._backward as rmoe_bwd
    import replaymoe.moe._forward as rmoe_fwd
    from replaymoe.hf import experts as hx

    model = _model("qwen3_moe")
    exp = model.model.layers[0].mlp.experts
    T, K, E = 48, model.config.num_experts_per_tok, exp.gate_up_proj.shape[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, exp.gate_up_proj.shape[2], device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, device="cuda", generator=g).softmax(1)
    if case.startswith("int64"):
        ids, w = ids.long(), w.bfloat16()
    elif case.startswith("fp32"):
        x = x.float()
    elif case.startswith("no tokens"):
        x, ids, w = x[:0], ids[:0], w[:0]
    calls = {"direct": 0}

    def spy(executor):  # the experts past fused_moe's checks: its Triton executors, called directly
        def f(*a, **k):
            calls["direct"] += 1
            return executor(*a, **k)

        return f

    monkeypatch.setattr(rmoe_fwd, "experts_triton", spy(rmoe_fwd.experts_triton))
    monkeypatch.setattr(rmoe_bwd, "experts_triton_train", spy(rmoe_bwd.experts_triton_train))
    if case.startswith("ids of another batch"):
        with pytest.raises(ValueError, match="topk"):
            hx.replaymoe_experts_forward(exp, x, ids[1:], w[1:])
        return
    exp.requires_grad_(grad)
    xs = x.detach().requires_grad_(grad)
    out = hx.replaymoe_experts_forward(exp, xs, ids, w)
    assert calls["direct"] == int(direct)
    ref_x = x.detach().requires_grad_(grad)
    ref = rmoe.fused_moe(ref_x.to(torch.bfloat16), exp.gate_up_proj, exp.down_proj, topk_ids=ids.int(),
                         topk_weights=w.float()).to(x.dtype)  # fmt: skip
    assert out.dtype == x.dtype and torch.equal(out, ref)
    if grad and T:
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (xs, exp.gate_up_proj, exp.down_proj), dout)
        want = torch.autograd.grad(ref, (ref_x, exp.gate_up_proj, exp.down_proj), dout)
        for a, b in zip(got, want):
            assert torch.equal(a, b)

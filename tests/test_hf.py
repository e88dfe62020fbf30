"""transformers integration (CPU, tiny random models of every supported architecture).

Each architecture is checked for: outputs equal to the unpatched model, captured ids equal to the
model's own router (computed independently from the router's inputs with the original class
forward), generate capture (one trace per sequence, padding excluded), exact replay at the same
weights, replay after a router perturbation (keeps the captured ids, differs from native routing),
gradients reaching the router, -1 fallback, and clear errors on mismatches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import ARCHITECTURES, build_model  # noqa: E402
from replaymoe.record.trace import RoutingTrace  # noqa: E402
from replaymoe.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # every test here: one intra-op thread (conftest)


# the fp32 tolerance for whole-model logits: experts/routing are summed in another order than
# transformers' grouped_mm, a few ulps of the logits' magnitude
LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)


def _batch(generator, vocab, lengths, *, left=True):
    """Padded batch: ids [B, P], mask [B, P] (left or right padding), and the unpadded rows."""
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    rows = []
    for b, n in enumerate(lengths):
        row = torch.randint(3, vocab, (n,), generator=generator)
        sl = slice(P - n, P) if left else slice(0, n)
        ids[b, sl], mask[b, sl] = row, 1
        rows.append(row)
    return ids, mask, rows


def _model(arch, seed=0, **kw):
    return build_model(arch, "tiny", seed=seed, **kw)


def _perturb_routers(moe, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for info in moe.layers:
            w = info.router.weight
            w.add_(torch.randn(w.shape, generator=g) * scale * w.std())


def _sets(ids):
    return np.sort(np.asarray(ids), axis=-1)


class _OwnRouter:
    """Forward hooks that recompute every router call with the router class's own forward."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for i, info in enumerate(rhf.find_moe_layers(model)):
            self.handles.append(info.router.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def hook(router, args, output):
            with torch.no_grad():
                _, _, own = type(router).forward(router, args[0])  # the class forward, not the patch
            self.calls.setdefault(i, []).append(own.reshape(-1, own.shape[-1]).clone())

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# patched == unpatched; the registry switch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_patched_outputs_equal_unpatched(arch, generator, monkeypatch):
    model = _model(arch)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [7, 4, 2])  # left padding, ragged
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    calls = {"route": 0, "fused": 0}
    import replaymoe.hf.patches as rsession
    import replaymoe.moe as rmoe
    import replaymoe.moe._backward as rmoe_bwd
    import replaymoe.moe._forward as rmoe_fwd

    def spy(key, real):
        def f(*a, **k):
            calls[key] += 1
            return real(*a, **k)

        return f

    # a router routes through route(), or past its checks once they passed (run_route); the experts
    # through fused_moe(), or on CUDA past its checks (the executors experts_triton, experts_triton_train)
    for mod, name, key in ((rsession, "route", "route"), (rsession, "run_route", "route"),
                           (rmoe, "fused_moe", "fused"), (rmoe_fwd, "experts_triton", "fused"),
                           (rmoe_bwd, "experts_triton_train", "fused")):  # fmt: skip
        monkeypatch.setattr(mod, name, spy(key, getattr(mod, name)))
    moe = rhf.enable(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    n_moe = len(moe.layers)
    assert calls["route"] == n_moe
    # every architecture's experts run fused_moe (gpt-oss's transposed, interleaved, biased,
    # clamped experts through views, biases, gate_up_layout and ClampedSwiGLU)
    assert calls["fused"] == n_moe and model.config._experts_implementation == "replaymoe"
    assert_close(out, ref, **LOGIT_TOL, name=f"{arch} logits")
    moe.disable()
    with torch.no_grad():
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, ref)  # disable() restores the model exactly


def test_experts_implementation_switch(generator):
    # the user-facing switch: from_config(..., experts_implementation="replaymoe")
    import transformers

    from replaymoe.hf.models import build_config

    rhf.register()  # importing replaymoe.hf registers nothing; enable() registers by itself
    cfg = build_config("qwen3_moe", "tiny")
    torch.manual_seed(0)
    native = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="replaymoe").eval()
    assert ours.config._experts_implementation == "replaymoe"
    ids, mask, _ = _batch(generator, cfg.vocab_size, [5, 3])
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        ref = native(input_ids=ids, attention_mask=mask).logits
    assert_close(got, ref, **LOGIT_TOL)


# --------------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_capture_matches_own_router(arch, generator):
    model = _model(arch)
    lengths, new = [6, 3, 1], 4
    ids, mask, rows = _batch(generator, model.config.vocab_size, lengths)
    own = _OwnRouter(model)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    traces = moe.traces()
    own.remove()
    assert len(traces) == len(lengths)  # one per sequence
    P, L, K = ids.shape[1], len(moe.layers), moe.top_k
    for b, (n, tr) in enumerate(zip(lengths, traces)):
        assert tr.num_tokens == n + new - 1  # prompt + completion; padding excluded
        assert tr.ids.shape == (n + new - 1, L, K)
        assert tr.num_experts == moe.num_experts and tr.top_k == K
        assert list(tr.layer_ids) == moe.layer_ids
        assert tr.missing_fraction() == 0.0
        for li in range(L):
            calls = own.calls[li]
            assert len(calls) == new  # prefill + (new - 1) decode steps
            prefill = calls[0].reshape(len(lengths), P, K)[b, P - n :]
            decode = torch.stack([c.reshape(len(lengths), 1, K)[b, 0] for c in calls[1:]])
            expected = torch.cat([prefill, decode])
            np.testing.assert_array_equal(_sets(tr.ids[:, li]), _sets(expected.numpy()))
    if arch in ("deepseek_v3", "glm4_moe"):
        assert moe.layer_ids[0] == 1  # dense first layer: real layer numbers, not MoE indices


def test_capture_right_padding_and_two_batches(generator):
    model = _model("qwen3_moe")
    moe = rhf.enable(model, capture=True)
    ids, mask, rows = _batch(generator, model.config.vocab_size, [5, 2], left=False)
    ids2, mask2, _ = _batch(generator, model.config.vocab_size, [3], left=False)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids2, attention_mask=mask2)
    traces = moe.traces()
    assert [t.num_tokens for t in traces] == [5, 2, 3]  # forward order, then row order
    assert moe.traces() == []  # handed over once
    moe.set_capture(False)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert moe.traces() == []


def test_capture_all_padding_row_and_trimming(generator):
    # a row that is padding only still yields a (empty) trace, so traces()[b] is row b
    model = _model("qwen3_moe")
    moe = rhf.enable(model, capture=True)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [4, 1, 3], left=True)
    mask[1] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    traces = moe.traces()
    assert [t.num_tokens for t in traces] == [4, 0, 3]
    # trimming (e.g. pad tokens fed after EOS in generate) and padding with -1
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(mask))
    full = moe.traces()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(mask))
    with pytest.raises(ValueError, match="num_positions"):
        moe.traces(num_positions=[1, 2])
    cut = moe.traces(num_positions=[2, 4, 6])  # the bad call above lost nothing
    assert [t.num_tokens for t in cut] == [2, 4, 6]
    np.testing.assert_array_equal(cut[0].ids, full[0].ids[:2])
    np.testing.assert_array_equal(cut[1].ids, full[1].ids)
    assert (cut[2].ids[4:] == -1).all() and np.array_equal(cut[2].ids[:4], full[2].ids)


def test_token_positions():
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    got = rhf.token_positions(2, 5, attention_mask=m, past_length=0, device="cpu")
    assert got.tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 3, -1]]
    # decode step: the mask covers the cache and the new token
    m2 = torch.cat([m, torch.ones(2, 1, dtype=torch.long)], 1)
    assert rhf.token_positions(2, 1, attention_mask=m2, past_length=5, device="cpu").tolist() == [[3], [4]]
    # mask shorter than cache + new tokens: the missing left columns count as kept
    assert rhf.token_positions(
        1, 2, attention_mask=torch.ones(1, 2), past_length=3, device="cpu"
    ).tolist() == [[3, 4]]
    # no (2-D) mask
    assert rhf.token_positions(2, 2, attention_mask=None, past_length=4, device="cpu").tolist() == [
        [4, 5],
        [4, 5],
    ]


# --------------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_replay_same_weights_is_exact(arch, generator):
    model = _model(arch)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [6, 4, 2])
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    traces = moe.traces()
    with torch.no_grad(), moe.replaying(traces):
        out = model(input_ids=ids, attention_mask=mask).logits
        rep = moe.report()
    assert rep.layers_with_fallback == 0 and rep.tokens_seen == 12
    again = moe.traces()
    assert torch.equal(out, ref)  # same ids, same weights formula: bit-identical
    for a, b in zip(traces, again):
        np.testing.assert_array_equal(a.ids, b.ids)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_replay_after_perturbation_keeps_ids_and_grads_reach_router(arch, generator):
    model = _model(arch)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [8, 5])
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    rollout = moe.traces()
    _perturb_routers(moe, 0.5, seed=3)
    with torch.no_grad():
        native = model(input_ids=ids, attention_mask=mask).logits
    native_tr = moe.traces()
    # the perturbation changed the routing somewhere (else the test could not tell replay from native)
    assert any(not np.array_equal(_sets(a.ids), _sets(b.ids)) for a, b in zip(rollout, native_tr))

    model.train()
    model.zero_grad(set_to_none=True)
    with moe.replaying(rollout):
        out = model(input_ids=ids, attention_mask=mask).logits
    replay_tr = moe.traces()
    for a, b in zip(rollout, replay_tr):
        np.testing.assert_array_equal(a.ids, b.ids)  # forced ids, column order kept
    assert not torch.allclose(out.detach(), native, atol=1e-4)
    (out.float() * mask[..., None]).square().mean().backward()
    for info in moe.layers:
        grad = info.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, info.name


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_replay_gradient_equals_native_gradient(arch, generator):
    # replaying a model's own routing must give the router the gradient the unpatched model gives
    model = _model(arch)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [6, 3])
    model.train()
    model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    ref = [info.router.weight.grad.clone() for info in rhf.find_moe_layers(model)]
    model.zero_grad(set_to_none=True)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with moe.replaying(moe.traces()):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    for info, g in zip(moe.layers, ref):
        assert_close(info.router.weight.grad, g, atol=1e-6, rtol=1e-4, name=f"grad {info.name}")


def test_minus_one_rows_fall_back_to_native(generator):
    model = _model("qwen3_moe")
    ids, mask, _ = _batch(generator, model.config.vocab_size, [8, 8])
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    rollout = moe.traces()
    _perturb_routers(moe, 0.5, seed=5)
    holes = []
    for t in rollout:
        x = t.ids.copy()
        x[::2] = -1  # even positions: no recorded routing
        x[1, 0] = -1  # and one (token, layer) row
        holes.append(t.replace(ids=x))
    own = _OwnRouter(model)  # the perturbed router's own choice on this forward's inputs
    with (
        torch.no_grad(),
        moe.replaying(holes, missing="native"),
    ):  # (the default raises: test_replay_boundaries)
        model(input_ids=ids, attention_mask=mask)
        rep = moe.report()
    own.remove()
    got = moe.traces()
    for b, (h, g) in enumerate(zip(holes, got)):
        native = np.stack([own.calls[li][0].reshape(2, 8, -1)[b].numpy() for li in range(3)], axis=1)
        miss = h.ids[..., 0] < 0
        np.testing.assert_array_equal(g.ids[~miss], h.ids[~miss])  # replayed
        np.testing.assert_array_equal(_sets(g.ids[miss]), _sets(native[miss]))  # routed natively
        assert not np.array_equal(_sets(g.ids), _sets(native))  # and the replayed rows were forced
    assert rep.fallback_tokens_per_layer.tolist() == [8 + 2, 8, 8]


def test_replay_in_generate_prompt_only_trace(generator):
    # a trace covering only the prompt, with missing="native": prompt tokens replayed, generated
    # tokens routed natively (the default raises: test_replay_boundaries)
    model = _model("mixtral")
    ids, mask, _ = _batch(generator, model.config.vocab_size, [5, 3])
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    prompt_tr = moe.traces()
    _perturb_routers(moe, 0.5, seed=7)
    with torch.no_grad(), moe.replaying(prompt_tr, missing="native"):
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False
        )
        rep = moe.report()
    got = moe.traces()
    for p, g in zip(prompt_tr, got):
        np.testing.assert_array_equal(g.ids[: p.num_tokens], p.ids)
    assert rep.fallback_tokens_per_layer.tolist() == [2 * 2] * len(moe.layers)  # 2 decode steps x 2 rows


def test_gradient_checkpointing_recompute_uses_replayed_ids(generator):
    model = _model("qwen3_moe")
    ids, mask, _ = _batch(generator, model.config.vocab_size, [6, 6])
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    rollout = moe.traces()
    _perturb_routers(moe, 0.5, seed=9)
    moe.set_capture(False)
    model.train()
    with moe.replaying(rollout):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    ref = [info.router.weight.grad.clone() for info in moe.layers]
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with moe.replaying(rollout):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    for info, g in zip(moe.layers, ref):
        assert_close(info.router.weight.grad, g, atol=1e-6, rtol=1e-4, name=info.name)


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


def _trace_for(moe, n=4, *, layers=None, top_k=None, num_experts=None, layer_ids="model"):
    L = len(moe.layers) if layers is None else layers
    K = moe.top_k if top_k is None else top_k
    E = moe.num_experts if num_experts is None else num_experts
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((n, L, E)), axis=-1)[..., :K]
    lids = moe.layer_ids[:L] if layer_ids == "model" else layer_ids
    if lids is not None and len(lids) != L:
        lids = list(range(L))
    return RoutingTrace(ids, num_experts=E, top_k=K, layer_ids=lids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layers=2), "num_layers"),  # trace of another depth (model has 3 MoE layers)
        (dict(top_k=3), "top_k"),  # trace of another top_k
        (dict(num_experts=16), "num_experts"),  # trace of a model with more experts
        (dict(layer_ids=[4, 5, 6]), "layer_ids"),  # same count, other layer numbers
    ],
)
def test_replay_mismatch_raises(kwargs, match):
    model = _model("qwen3_moe")
    moe = rhf.enable(model)
    with pytest.raises(ValueError, match=match):
        moe.set_replay(_trace_for(moe, **kwargs))
    moe.disable()
    with pytest.raises(ValueError, match=match):  # also at enable(), which then leaves the model unpatched
        rhf.enable(model, replay=_trace_for(moe, **kwargs))
    assert getattr(model, "_replaymoe", None) is None


def test_replay_batch_mismatch_and_other_errors(generator):
    model = _model("deepseek_v3")
    moe = rhf.enable(model)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [4, 4, 4])
    with moe.replaying([_trace_for(moe), _trace_for(moe)]):  # 2 traces, batch of 3
        with pytest.raises(ValueError, match="one trace per batch row"):
            model(input_ids=ids, attention_mask=mask)
    # a trace without layer_ids is matched in MoE order (DeepSeek: MoE layers 1, 2 = indices 0, 1)
    moe.set_replay(_trace_for(moe, layer_ids=None))
    moe.set_replay(None)
    with pytest.raises(ValueError, match="already enabled"):
        rhf.enable(model)
    moe.disable()
    with pytest.raises(ValueError, match="backend"):
        rhf.enable(model, backend="cuda")
    with pytest.raises(ValueError, match="architecture"):
        rhf.enable(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="capture"):
        rhf.enable(model, capture="yes")
    with pytest.raises(ValueError, match="graphs"):
        rhf.enable(model, graphs=1)
    assert getattr(model, "_replaymoe", None) is None  # a rejected enable leaves the model as it was


def test_block_graphs_usable_tracks_hooks_and_structure():
    # the per-block conditions of replaying a captured graph (checked on the CPU: capture is GPU-only)
    model = _model("deepseek_v3").eval()
    moe = rhf.enable(model)
    g = moe._engine.patch.block_graphs[0]
    block = g.block
    assert g.usable()
    g.graphs["shape"] = "a captured graph"
    h = block.gate.register_forward_hook(lambda *a: None)  # a hook would fire at capture only
    assert not g.usable() and g.graphs
    h.remove()
    assert g.usable() and g.graphs
    model.train()  # training mode, no randomness in the block (TRL's rollouts): graphed too, own key
    assert g.usable()
    block.noise = torch.nn.Dropout(0.1)  # a module added: the graphs go, the block is surveyed again
    assert not g.usable()
    assert not g.usable()  # a dropout draws random numbers in training mode: eager
    model.eval()
    assert g.usable()  # not in eval mode
    del block.noise
    assert not g.usable() and g.usable()  # the structure changed back
    w0 = g._weights()
    block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj.detach().clone())
    assert g.usable() and g._weights() != w0  # a replaced parameter: same structure, new address
    # structure changes drop the graphs once, then the new structure is the reference
    for change in (
        lambda: setattr(block.shared_experts, "extra", torch.nn.Identity()),  # a module added
        lambda: setattr(block.shared_experts, "up_proj", torch.nn.Linear(2, 2)),  # a module replaced
        lambda: setattr(block.shared_experts.down_proj, "forward", lambda x: x),  # a forward overridden
        lambda: block.shared_experts.down_proj.__dict__.pop("forward"),  # and restored
        lambda: block.experts.register_buffer("scale", torch.ones(1)),  # a buffer added
    ):
        g.graphs["shape"] = "a captured graph"
        change()
        assert not g.usable() and not g.graphs
        assert g.usable()
    moe.disable()


def test_block_graphs_patched_and_restored():
    model = _model("qwen3_moe")
    moe = rhf.enable(model)
    # fused experts: each MoE block's forward goes through its graphs wrapper (eager on the CPU)
    assert len(moe._engine.patch.block_graphs) == len(moe.layers)
    assert all("forward" in info.block.__dict__ for info in moe.layers)
    assert not any(g.captured() for g in moe._engine.patch.block_graphs)
    moe.disable()
    assert not any("forward" in info.block.__dict__ for info in moe.layers)
    # graphs=False, or the torch backend (no kernels worth graphing): blocks stay unpatched
    for kw in ({"graphs": False}, {"backend": "torch"}):
        moe = rhf.enable(model, **kw)
        assert not moe._engine.patch.block_graphs and not any(
            "forward" in i.block.__dict__ for i in moe.layers
        )
        moe.disable()


# --------------------------------------------------------------------------------------------------
# the Triton kernels through the integration (interpreted on the CPU)
# --------------------------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # softmax family; grouped sigmoid + bias
def test_triton_backend_through_the_model(arch, generator):
    model = _model(arch)
    ids, mask, _ = _batch(generator, model.config.vocab_size, [6, 3])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    moe = rhf.enable(model, capture=True, backend="triton")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    traces = moe.traces()
    assert_close(out, ref, **LOGIT_TOL)
    with torch.no_grad(), moe.replaying(traces):
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, out)
    model.train()
    with moe.replaying(traces):
        model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
    for info in moe.layers:
        assert info.router.weight.grad.abs().sum() > 0


@pytest.mark.interpret
def test_deferred_commit_through_generate(generator, monkeypatch):
    # eager generate with the Triton backend takes step_rows, which writes each forward's captured ids
    # in the next forward's launch: the traces equal those written by an index_copy_ per forward
    from replaymoe.hf.state import CaptureBuffer

    model = _model("qwen3_moe")
    ids, mask, _ = _batch(generator, model.config.vocab_size, [5, 3])
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, attention_mask=mask)

    def run():
        moe = rhf.enable(model, capture=True, backend="triton")
        with torch.no_grad():
            model.generate(input_ids=ids, **kw)
        assert (
            moe._engine.capture.buffer.pending is None
        )  # generate writes its last forward's ids before returning
        traces = moe.traces()
        moe.disable()
        return traces

    deferred = run()
    monkeypatch.setattr(CaptureBuffer, "defer", CaptureBuffer.commit)
    immediate = run()
    assert [t.num_tokens for t in deferred] == [5 + 3 - 1, 3 + 3 - 1]
    for a, b in zip(deferred, immediate):
        np.testing.assert_array_equal(a.ids, b.ids)


def test_interleaved_dense_layers_keep_model_layer_numbers(generator):
    # Qwen3-MoE with decoder_sparse_step=2: MoE blocks only in layers 1 and 3
    model = _model("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2)
    moe = rhf.enable(model, capture=True)
    assert moe.layer_ids == [1, 3]
    ids, mask, _ = _batch(generator, model.config.vocab_size, [5, 4])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    traces = moe.traces()
    assert all(list(t.layer_ids) == [1, 3] and t.num_layers == 2 for t in traces)
    with torch.no_grad(), moe.replaying(traces):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, ref)
    # a trace of the same depth recorded on other layer numbers is refused
    with pytest.raises(ValueError, match="layer_ids"):
        moe.set_replay([t.replace(layer_ids=[0, 1]) for t in traces])


# each case: (what this call changes after a first, validated call; validated again?; error's argument)
_ROUTER_CALLS = [
    ("nothing", False, None),
    ("replay ids of the right shape", False, None),
    ("int64 replay ids (converted by the checks)", True, None),
    ("non-contiguous replay ids (copied by the checks)", True, None),
    ("replay ids of another shape", True, "replay_ids"),
    ("float32 logits after bfloat16 ones", True, None),
    ("a capture slab with too few rows", True, "routing_replay_out"),
]


@pytest.mark.parametrize("case, validated, error", _ROUTER_CALLS, ids=[c for c, _, _ in _ROUTER_CALLS])
def test_patched_router_checks_once_then_per_call_metadata(case, validated, error, monkeypatch):
    # a patched router validates its routing once per logits dtype, device and expert count, and per
    # call compares only what can change (replay ids, capture slab); anything else goes through the
    # full checks again, which name the wrong argument; results always equal route()'s
    from replaymoe.hf import patches
    from replaymoe.routing import RoutingConfig, RoutingMethod, route

    T, E, K = 6, 8, 2
    routing = RoutingConfig(K, RoutingMethod.RENORMALIZE)
    checked = patches._CheckedRouting(routing)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g).bfloat16()
    checked.route(logits, None, None, "torch")  # the first call: validated
    counts = {"validate": 0}
    real = patches.validate

    def spy(*a, **k):
        counts["validate"] += 1
        return real(*a, **k)

    monkeypatch.setattr(patches, "validate", spy)
    replay = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32)
    slab = None
    if case == "nothing":
        replay = None
    elif case.startswith("int64"):
        replay = replay.long()
    elif case.startswith("non-contiguous"):
        replay = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(torch.int32).t().contiguous().t()
    elif case.startswith("replay ids of another"):
        replay = replay[1:]
    elif case.startswith("float32"):
        logits = logits.float()
    elif case.startswith("a capture slab"):
        slab = torch.zeros(T - 1, K, dtype=torch.int16)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            checked.route(logits, slab, replay, "torch")
        return
    out = checked.route(logits, slab, replay, "torch")
    assert counts["validate"] == int(validated)
    ref = route(logits, routing=routing, replay_ids=replay, backend="torch")
    assert torch.equal(out.topk_ids, ref.topk_ids) and torch.equal(out.topk_weights, ref.topk_weights)


@pytest.mark.parametrize(
    "arch, overrides, dropout, random",
    [
        ("qwen3_moe", {}, 0.0, False),  # no noise: graphed in training mode too
        ("mixtral", {"router_jitter_noise": 0.1}, 0.0, True),  # Mixtral's input jitter
        ("mixtral", {"router_jitter_noise": 0.0}, 0.0, False),  # the attribute, zero
        ("qwen3_moe", {}, 0.1, True),  # a dropout module inside the block
        ("qwen3_moe", {}, 0.0, False),  # a dropout module with p = 0
    ],
)
def test_blocks_random_in_training(arch, overrides, dropout, random):
    from replaymoe.hf.graphs import random_in_training

    model = build_model(arch, "tiny", **overrides)
    block = rhf.find_moe_layers(model)[0].block
    block.extra = torch.nn.Dropout(dropout)
    assert random_in_training(block) is random


def test_traces_keep_their_tokens_after_the_next_generate(generator):
    # on the CPU the capture buffer's tokens reach the host as a numpy view: the traces of one generate
    # must own their arrays, or the next generate's batch start (tokens filled with -1) rewrites them
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", capture=True)
    prompts = [torch.randint(3, model.config.vocab_size, (2, 5), generator=generator) for _ in range(2)]
    kept = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 min_new_tokens=3, do_sample=False)  # fmt: skip
        traces = moe.traces()
        kept.append((traces, out[:, :-1].numpy(), [t.ids.copy() for t in traces]))
    moe.disable()
    for traces, fed, ids in kept:  # every fed token, and the ids, as they were when returned
        assert [t.token_ids.tolist() for t in traces] == fed.tolist()
        for t, i in zip(traces, ids):
            np.testing.assert_array_equal(t.ids, i)

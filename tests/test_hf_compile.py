"""transformers integration under torch.compile and with a static cache (CPU, tiny random models).

Every architecture x mode (plain, capture, replay) must trace with ``fullgraph=True`` (a graph
break raises), give the eager logits and the eager traces, and keep replaying the captured ids.
Static-cache ``generate`` — with the decode step compiled, as transformers does on a GPU — must
capture the same ids as dynamic-cache ``generate``, replay them, and not recompile on the next
``generate`` call.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import ARCHITECTURES, build_model  # noqa: E402
from replaymoe.testing import assert_close  # noqa: E402

MODES = ("plain", "capture", "replay")
LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)  # the compiled torch experts sum in a dense order


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    torch._dynamo.reset()


def _captured(seed: int, batch_seed: int | None = None):
    """A tiny model, its handle, a padded batch and the traces of one eager forward over it (capture
    then off)."""
    model = build_model("qwen3_moe", "tiny", seed=seed)
    ids, mask = _padded_batch(seed if batch_seed is None else batch_seed, model.config.vocab_size)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    traces = moe.traces()
    moe.set_capture(False)
    return model, moe, ids, mask, traces


def _padded_batch(seed: int, vocab: int):
    """[3, 7] ids with left padding of 0, 3 and 5 tokens (row 2 keeps only 2 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _same_traces(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.ids.shape == b.ids.shape and (a.ids == b.ids).all()
        assert list(a.layer_ids) == list(b.layer_ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fullgraph_forward_matches_eager(arch, mode):
    # every router family (softmax, mixtral, deepseek grouping+bias, gpt-oss biased clamped experts) and
    # every state the hook can be in; fullgraph=True turns any graph break into an error
    model = build_model(arch, "tiny", seed=3)
    ids, mask = _padded_batch(4, model.config.vocab_size)
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    ref_traces = moe.traces()
    moe.disable()

    moe = rhf.enable(
        model,
        capture=mode == "capture",
        replay=ref_traces if mode == "replay" else None,
        max_batch_size=4,
        max_positions=16,
    )
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask).logits
    assert_close(out, ref, **LOGIT_TOL, name=f"{arch}/{mode} compiled logits")
    if mode == "capture":
        _same_traces(moe.traces(), ref_traces)
    if mode == "replay":
        report = moe.report()
        assert report.tokens_seen == int(mask.sum())  # padding is not looked up
        assert report.fallback_tokens_per_layer.sum() == 0
    moe.disable()


def test_fullgraph_training_forward_with_replay_and_grad():
    # a compiled trainer forward: replayed ids, gradient through the router weights
    model, moe, ids, mask, traces = _captured(5, 6)
    moe.set_replay(traces)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, attention_mask=mask).logits.float().square().mean()
    loss.backward()
    grad = model.model.layers[0].mlp.gate.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    moe.disable()


@pytest.mark.parametrize(
    "cap",
    [
        dict(max_batch_size=4, max_positions=4),  # rows hold 7 tokens
        # 3 rows in a buffer of 1 (enable's default): was a dynamo error deep in the buffer's growth
        # ("Observed exception"; without fullgraph "Attempt to trace forbidden callable")
        dict(max_batch_size=1, max_positions=16),
    ],
    ids=["positions", "rows"],
)
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_capture_beyond_capacity_raises_at_traces(cap, fullgraph):
    # a compiled forward cannot grow the buffer: tokens outside it are reported, not silently lost
    model = build_model("qwen3_moe", "tiny", seed=1)
    ids, mask = _padded_batch(3, model.config.vocab_size)
    moe = rhf.enable(model, capture=True, **cap)
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"Invalid capacity of max_batch_size / max_positions: .*now "):
        moe.traces()
    kept = moe.traces()  # what fitted is still there (the rest was recorded as missing)
    assert len(kept) == min(3, cap["max_batch_size"])
    moe.disable()


def test_compiled_batches_not_harvested_warn():
    # two compiled no-cache forwards without traces() in between: the first batch is overwritten
    model = build_model("qwen3_moe", "tiny", seed=1)
    ids, mask = _padded_batch(2, model.config.vocab_size)
    moe = rhf.enable(model, capture=True, max_batch_size=4, max_positions=8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)
        compiled(input_ids=ids, attention_mask=mask)
    with pytest.warns(RuntimeWarning, match="1 captured batch"):
        traces = moe.traces()
    assert len(traces) == 3  # the second batch's rows
    moe.disable()


def _compile_config():
    from transformers import CompileConfig

    cfg = CompileConfig(backend="eager", fullgraph=True, mode=None)
    cfg._compile_all_devices = True  # transformers compiles the decode step on GPUs only otherwise
    return cfg


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_static_cache_generate_capture_replay_no_recompile(arch):
    # the configuration users pick for speed: static cache, compiled decode (fullgraph), left padding
    model = build_model(arch, "tiny", seed=2)
    ids, mask = _padded_batch(7, model.config.vocab_size)

    def generate(**kw):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kw)

    moe = rhf.enable(model, capture=True)
    dyn_out = generate()
    dyn_traces = moe.traces()
    assert [t.num_tokens for t in dyn_traces] == [7 + 4, 4 + 4, 2 + 4]  # padding excluded

    cfg = _compile_config()
    torch._dynamo.utils.counters.clear()
    static_out = generate(cache_implementation="static", compile_config=cfg)
    assert torch.equal(static_out, dyn_out)
    _same_traces(moe.traces(), dyn_traces)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the decode step was compiled

    again = generate(cache_implementation="static", compile_config=cfg)  # a new generate call
    assert torch.equal(again, dyn_out)
    _same_traces(moe.traces(), dyn_traces)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile

    moe.set_capture(False)
    with moe.replaying(dyn_traces):
        replayed = generate(cache_implementation="static", compile_config=cfg)
        report = moe.report()
    assert torch.equal(replayed, dyn_out)
    assert report.fallback_tokens_per_layer.sum() == 0
    moe.disable()


def test_plain_generate_does_not_recompile_across_calls():
    # no Python counter of the hook may become a guard: a second generate reuses the graph
    model = build_model("qwen3_moe", "tiny", seed=2)
    ids, mask = _padded_batch(8, model.config.vocab_size)
    moe = rhf.enable(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for _ in range(3):
            compiled(input_ids=ids, attention_mask=mask)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    moe.disable()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_training_step_replays_through_checkpointing(checkpointing):
    # a compiled training step (the bench's `--compile`): routers moved after the rollout so that
    # native routing differs; under replay the compiled loss and every gradient equal the eager
    # uncheckpointed replayed step's, with the recompute of each checkpointed layer inside the
    # compiled backward (no session bindings there)
    def step(ckpt: bool, compiled: bool):
        torch._dynamo.reset()
        model = build_model("qwen3_moe", "tiny", seed=5)
        model.train()
        ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
        moe = rhf.enable(model, capture=True)
        with torch.no_grad():
            model(input_ids=ids)
        traces = moe.traces()
        moe.disable()
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in model.model.layers:
                w = layer.mlp.gate.weight
                w.add_(torch.randn(w.shape, generator=g) * 0.5)
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        moe = rhf.enable(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        with moe.replaying(traces):
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        moe.disable()
        native = model(input_ids=ids, labels=ids, use_cache=False).loss.detach()
        return loss.detach(), native, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_native, ref_grads = step(False, False)
    assert (ref_native - ref_loss).abs() > 1e-4  # the moved routers route otherwise: replay matters
    loss, _, grads = step(checkpointing, True)
    assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, name="compiled replayed loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, name=name)


def test_mismatch_is_counted_in_compiled_forwards():
    # track_mismatch() counted nothing under torch.compile: mismatch() read 0 tokens and 0.0, and TRL's
    # r3/* metrics went missing with torch_compile=True
    model, moe, ids, mask, traces = _captured(1)
    with torch.no_grad():
        for info in moe.layers:  # routers moved, as an optimizer step moves them
            info.router.weight.add_(torch.randn_like(info.router.weight))
    moe.track_mismatch()
    counts = []
    for run in (model, torch.compile(model, backend="eager", fullgraph=True)):
        with moe.replaying(traces), torch.no_grad():
            run(input_ids=ids, attention_mask=mask)
        counts.append(moe.mismatch())
    assert counts[1] == counts[0] and counts[0]["tokens"] == 3 * int(mask.sum())  # every real token-layer
    assert counts[0]["native_vs_rollout"] > 0 and counts[0]["replayed_vs_rollout"] == 0.0
    moe.disable()

"""Where routes enter replay in a transformers model, nothing passes in silence (CPU, tiny models).

* a handle turned off by ``disable()`` refuses to capture, replay or hand out traces;
* every token of a replayed forward needs a recorded route, except padding and each sequence's last
  sampled token: anything else raises naming the batch row, position and layer, unless the caller
  asked for native fallback (``missing="native"``, counted in the report), eagerly and compiled;
* traces of another model (its fingerprint: model id, MoE layers, experts, top-k) are refused.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402
from replaymoe.record.trace import RoutingFingerprint, RoutingTrace  # noqa: E402

COVERAGE = "coverage of replay"


def _batch(seed: int, vocab: int, rows: int = 2, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    return ids, torch.ones_like(ids)


def _captured(arch: str = "qwen3_moe", seed: int = 0, **enable):
    """A tiny model, its handle with capture on, a batch and the traces of one forward over it."""
    model = build_model(arch, "tiny", seed=seed)
    moe = rhf.enable(model, capture=True, **enable)
    ids, mask = _batch(seed + 1, model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    traces = moe.traces()
    moe.set_capture(False)
    return model, moe, ids, mask, traces


# ------------------------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize(
    "call",
    [
        lambda moe, tr: moe.set_capture(True),  # capture on a handle whose hooks are gone
        lambda moe, tr: moe.set_replay(tr),  # replay that no router would read
        lambda moe, tr: moe.replaying(tr).__enter__(),  # the context manager form
        lambda moe, tr: moe.traces(),  # traces() would return [] as if nothing were captured
        lambda moe, tr: moe.set_rollout_replay(True),  # rollout mode's capture and replay
        lambda moe, tr: moe.attach(build_model("qwen3_moe", "tiny", seed=0)),  # a reference model
    ],
    ids=["set_capture", "set_replay", "replaying", "traces", "set_rollout_replay", "attach"],
)
def test_disabled_handle_refuses(call):
    model, moe, ids, mask, traces = _captured()
    moe.disable()
    with pytest.raises(ValueError, match=r"disable\(\)"):
        call(moe, traces)
    assert getattr(model, "_replaymoe", None) is None  # nothing was patched again
    moe.set_capture(False)  # turning things off stays harmless
    moe.set_replay(None)
    moe.disable()  # and so does a second disable()


def test_disable_warns_before_dropping_unread_traces():
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, capture=True)
    ids, mask = _batch(1, model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with pytest.warns(RuntimeWarning, match="drops 2 captured trace"):
        moe.disable()
    # read first: nothing to warn about
    moe = rhf.enable(model, capture=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(moe.traces()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe.disable()


# -------------------------------------------------------------------------------------- coverage
def _cut(traces, keep):
    """Traces covering positions [0, keep) only."""
    return [t.replace(ids=t.ids[:keep]) for t in traces]


def _holed(traces, position, layer=None):
    """Traces with the row at ``position`` recorded as missing (all layers, or one)."""
    out = []
    for t in traces:
        ids = t.ids.copy()
        if layer is None:
            ids[position] = -1
        else:
            ids[position, layer] = -1
        out.append(t.replace(ids=ids))
    return out


@pytest.mark.parametrize(
    "make, position, layer",
    [
        # 3 of a row's 12 positions covered (the case): position 3 is the first without a route
        # by content; by batch row, position 3 is one past the trace (a last sampled token's place)
        (lambda tr: _cut(tr, 3), {"by-content": 3, "by-row": 4}, 0),
        # a row recorded as missing in the middle (e.g. a prefix-cache sentinel), every layer
        (lambda tr: _holed(tr, 5), 5, 0),
        # one (token, layer) row missing, in the last MoE layer only
        (lambda tr: _holed(tr, 4, layer=2), 4, 2),
        # a trace that starts late (vLLM's routed_experts_prompt_start): the prompt's head is uncovered
        (lambda tr: [t.replace(ids=t.ids[2:], token_offset=2, token_ids=None) for t in tr], 0, 0),
    ],
    ids=["cut-to-3", "missing-row", "missing-layer-row", "late-start"],
)
@pytest.mark.parametrize("mode", ["by-content", "by-row"])
def test_uncovered_tokens_raise_naming_row_position_layer(make, position, layer, mode):
    model, moe, ids, mask, traces = _captured()
    bad = make(traces)
    if mode == "by-row":
        bad = [t.replace(token_ids=None) for t in bad]
    with pytest.raises(ValueError, match=COVERAGE) as err, moe.replaying(bad), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    position = position[mode] if isinstance(position, dict) else position
    assert f"batch row 0, position {position}, MoE layer {layer}" in str(err.value)
    assert "missing='native'" in str(err.value)  # the way out is named
    # opted in: the same forward routes those tokens natively and counts them
    with moe.replaying(bad, missing="native"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        report = moe.report()
        moe.reset_report()  # counts start again
        assert moe.report().fallback_tokens_per_layer.sum() == 0
    assert report.fallback_tokens_per_layer.sum() > 0


@pytest.mark.parametrize("tokens", [True, False], ids=["by-content", "by-row"])
def test_last_sampled_token_and_padding_need_no_route(tokens):
    # a rollout's trace covers prompt + completion - 1 positions: the trainer's forward over the
    # whole sequence (right-padded rows of different lengths) replays with no error, and only each
    # row's last token routes natively
    model, moe, ids, mask, traces = _captured()
    mask[1, 9:] = 0  # row 1: 9 real tokens, then padding
    lengths = [11, 8]  # one less than each row's real tokens
    rollout = [t.replace(ids=t.ids[:n], token_ids=t.token_ids[:n]) for t, n in zip(traces, lengths)]
    if not tokens:
        rollout = [t.replace(token_ids=None) for t in rollout]
    with moe.replaying(rollout), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        report = moe.report()
    assert report.fallback_tokens_per_layer.tolist() == [2] * len(moe.layers)  # one per row


def test_last_token_allowance_is_one_token_only():
    # the allowance is the one position past the trace; the position after it is uncovered
    model, moe, ids, mask, traces = _captured()
    short = _cut(traces, 10)  # positions 10 and 11 of 12 uncovered
    with pytest.raises(ValueError, match="position 10"), moe.replaying(short), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)


def test_uncovered_raises_before_backward_with_checkpointing():
    # a training forward (gradient checkpointing on) fails at its end: no step learns from it
    model, moe, ids, mask, traces = _captured()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match=COVERAGE), moe.replaying(_cut(traces, 6)):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters())


def test_uncovered_decode_steps_raise_in_generate():
    # replay into generate: the prompt's trace covers the prefill and excuses the first generated
    # token (the prompt's last sampled token); the second decode step has no route
    model, moe, ids, mask, traces = _captured("mixtral")
    with pytest.raises(ValueError, match="position 13"), moe.replaying(traces), torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False
        )


def test_attached_model_replays_under_the_same_rule():
    # the reference model attached to the policy replays the same traces with the same coverage rule
    model, moe, ids, mask, traces = _captured()
    ref_model = build_model("qwen3_moe", "tiny", seed=0)
    ref = moe.attach(ref_model)
    with moe.replaying(_cut(traces, 4)), torch.no_grad():
        with pytest.raises(ValueError, match=COVERAGE):
            ref_model(input_ids=ids, attention_mask=mask)
    with moe.replaying(_cut(traces, 4), missing="native"), torch.no_grad():
        ref_model(input_ids=ids, attention_mask=mask)
        assert ref.report().fallback_tokens_per_layer.sum() > 0


def test_rollout_mode_missing_native_is_an_opt_in():
    model, moe, ids, mask, traces = _captured()
    with pytest.raises(ValueError, match="missing"):
        moe.set_rollout_replay(True, missing="skip")
    moe.set_rollout_replay(True, missing="native")
    moe.add_rollout_traces(_cut(traces, 4))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert moe.report().fallback_tokens_per_layer.sum() > 0
    moe.set_rollout_replay(True)  # back to the default: the same round raises
    moe.add_rollout_traces(_cut(traces, 4))
    with pytest.raises(ValueError, match=COVERAGE), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("check", ["replaying-exit", "report", "traces"])
def test_compiled_forward_counts_on_device_and_raises_at_next_check(check):
    # a forward compiled with fullgraph=True cannot sync: it counts the uncovered lookups on the
    # device, and the next eager check point raises with the per-layer counts
    model, moe, ids, mask, traces = _captured()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=COVERAGE) as err:
        with moe.replaying(_cut(traces, 6)), torch.no_grad():
            compiled(input_ids=ids, attention_mask=mask)
            if check == "report":
                moe.report()
            if check == "traces":
                moe.traces()
    msg = str(err.value)
    assert "batch row 0, position 6, MoE layer 0" in msg and "MoE layer 0 (model layer 0): 10" in msg
    with moe.replaying(traces), torch.no_grad():  # a covered compiled forward passes every check
        compiled(input_ids=ids, attention_mask=mask)
        moe.report()


# -------------------------------------------------------------------------------------- identity
def test_traces_of_another_model_are_refused():
    # Mixtral's routes replayed into a Qwen3-MoE of the same shapes (3 MoE layers, top-2 of 8)
    _, _, _, _, mixtral = _captured("mixtral")
    model, moe, ids, mask, _ = _captured("qwen3_moe")
    assert mixtral[0].fingerprint.differences(moe.fingerprint) == ["model_id 'mixtral' vs 'qwen3_moe'"]
    with pytest.raises(ValueError, match=r"model of replay.*model_id 'mixtral' vs 'qwen3_moe'"):
        moe.set_replay(mixtral)
    with pytest.raises(ValueError, match="model_id"):
        moe.replaying(mixtral).__enter__()
    # the caller vouches for them (e.g. a served model's alias): accepted
    with moe.replaying(mixtral, check_model_id=False), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    # a trace whose model is unknown (a bare engine payload) is not refused for it
    with moe.replaying([t.replace(model_id=None) for t in mixtral]), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize(
    "change, phrase",
    [
        (dict(model_id="other/model"), "model_id"),  # another model's name
        (dict(layer_ids=(0, 2, 3)), "MoE layers"),  # another set of MoE layer numbers
        (dict(num_experts=16), "experts"),  # another expert count
        (dict(top_k=4), "top-"),  # another top-k
        (dict(num_layers=4), "MoE layers"),  # another depth
    ],
    ids=["model_id", "layer_ids", "num_experts", "top_k", "num_layers"],
)
def test_fingerprint_differences_name_the_field(change, phrase):
    base = RoutingFingerprint("m", (0, 1, 2), 3, 8, 2)
    other = RoutingFingerprint(**{**base.__dict__, **change})
    diff = base.differences(other)
    assert len(diff) == 1 and phrase in diff[0]
    if "model_id" in change:
        assert base.differences(other, model_id=False) == []
    # unknown fields match anything
    assert RoutingFingerprint(None, None, 3, None, 2).differences(base) == []


def test_trace_fingerprint_is_its_metadata():
    ids = np.zeros((2, 3, 2), dtype=np.int16)
    ids[..., 1] = 1
    t = RoutingTrace(ids, num_experts=8, top_k=2, layer_ids=[1, 2, 3], model_id="x")
    assert t.fingerprint == RoutingFingerprint("x", (1, 2, 3), 3, 8, 2)


@pytest.mark.interpret
def test_step_bookkeeping_kernel_counts_uncovered_tokens():
    # the eager Triton path (one bookkeeping launch per forward, under the interpreter here) counts
    # uncovered lookups in its kernel: the same error as the torch path, naming row, position, layer
    model, moe, ids, mask, traces = _captured(backend="triton")
    bare = [t.replace(ids=t.ids[:3], token_ids=None) for t in traces]  # by batch row
    with pytest.raises(ValueError, match="batch row 0, position 4, MoE layer 0"), moe.replaying(bare):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    with moe.replaying(bare, missing="native"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        assert moe.report().fallback_tokens_per_layer.tolist() == [2 * 9] * len(moe.layers)


# ---------------------------------------------------------------------------------- handle state
def _routed(model, moe, ids, mask):
    """The ids the routers used in one forward (capture on while it runs)."""
    moe.set_capture(True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    out = moe.traces()
    moe.set_capture(False)
    return [t.ids for t in out]


@pytest.mark.parametrize("outer", ["replaying", "set_replay"])  # the outermost replay: a block or set
def test_nested_replaying_restores_each_level(outer):
    # three levels: each block's end must bring back the enclosing replay's own traces (a pooled
    # table held by an outer block was once reloaded by the innermost one: the outer replayed C)
    ids, mask = _batch(1, 64)
    runs = []
    for seed in (1, 2, 3):  # three models' routes over the same tokens, matched by batch row
        model = build_model("qwen3_moe", "tiny", seed=seed)
        moe = rhf.enable(model, capture=True)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        runs.append([t.replace(token_ids=None) for t in moe.traces()])
        moe.disable()
    a, b, c = runs
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model)

    def replays(traces):
        return all(np.array_equal(got, t.ids) for got, t in zip(_routed(model, moe, ids, mask), traces))

    with moe.replaying(a) if outer == "replaying" else _set(moe, a):
        assert replays(a)
        with moe.replaying(b):
            with moe.replaying(c):
                assert replays(c)
            assert replays(b)
        assert replays(a)
    assert moe.report() is None if outer == "replaying" else replays(a)


class _set:
    """``set_replay`` as a context for the test above (left set on exit)."""

    def __init__(self, moe, traces):
        self.moe, self.traces = moe, traces

    def __enter__(self):
        self.moe.set_replay(self.traces)

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("bad", [[-1, 3], [2.5, 3], 3, "12", [12]])  # negative, float, int, str, too few
def test_traces_with_bad_lengths_loses_nothing(bad):
    model, moe, ids, mask, _ = _captured()
    moe.set_capture(True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="num_positions"):
        moe.traces(bad)
    kept = moe.traces()
    assert len(kept) == 2 and all(t.ids.shape[0] == 12 for t in kept)


def test_refused_rollout_traces_leave_the_round_as_it_was():
    # a refused add (another model's traces) after a forward keeps the round and its replay
    model, moe, ids, mask, traces = _captured()
    moe.set_rollout_replay(True)
    moe.add_rollout_traces(traces)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # the round's forward: the next add starts a new one
    other = [t.replace(model_id="mixtral") for t in traces]
    with pytest.raises(ValueError, match="another model"):
        moe.add_rollout_traces(other)
    assert len(moe.rollout_traces()) == 2
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert moe.report().fallback_tokens_per_layer.sum() == 0


def test_replay_set_on_a_meta_model_follows_it():
    # set_replay / replaying on a meta-device model (the FSDP2 recipe) before to_empty: the handle's
    # checks read no meta counters, and the first forward replays on the real device
    real, _, ids, mask, traces = _captured()
    meta = build_model("qwen3_moe", "tiny", seed=0, device="meta")
    moe = rhf.enable(meta, replay=traces)
    with moe.replaying(traces):  # an empty block: its end checks the (meta) counters
        pass
    assert moe.report().tokens_seen == 0
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    for name, buf in real.named_buffers():
        meta.get_buffer(name).copy_(buf)
    with torch.no_grad():
        meta(input_ids=ids, attention_mask=mask)
    report = moe.report()
    assert report.tokens_seen == 24 and report.fallback_tokens_per_layer.sum() == 0
    moe.set_replay(None)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda moe, m: rhf.enable(None), "type of model.*NoneType"),  # not a module at all
        (lambda moe, m: rhf.enable(m, missing="bogus"), "missing.*'bogus'"),  # checked without a replay
        (lambda moe, m: moe.replaying(5).__enter__(), "type of traces.*int"),  # not a sequence
        (lambda moe, m: moe.set_replay("abc"), "type of traces.*str"),  # a string is no trace list
        (lambda moe, m: (moe.set_rollout_replay(True), moe.add_rollout_traces(5)), "type of traces.*int"),
        (lambda moe, m: rhf.enable(m, experts="yes"), "type of experts"),  # a truthy string was taken
        (lambda moe, m: moe.attach(None), "type of model.*NoneType"),  # AttributeError before
    ],
    ids=[
        "enable-none",
        "enable-missing",
        "replaying-int",
        "set_replay-str",
        "add_rollout-int",
        "experts-str",
        "attach-none",
    ],  # fmt: skip
)
def test_handle_arguments_are_named(call, match):
    model, moe, _, _, _ = _captured()
    other = build_model("qwen3_moe", "tiny", seed=0)
    with pytest.raises(ValueError, match=match):
        call(moe, other)
    assert getattr(other, "_replaymoe", None) is None  # a refused enable() patches nothing


# ------------------------------------------------------------------- tokens of forwards by batch row
def _generated(backend: str, new: int = 3):
    """A tiny model, a greedy generate over two different prompts with capture on, its traces."""
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, capture=True, backend=backend)
    ids, mask = _batch(5, model.config.vocab_size, length=6)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **gen)
    traces = moe.traces()
    moe.set_capture(False)
    return model, moe, ids, mask, traces, gen


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.interpret)],  # triton: the step kernel's rows
)
@pytest.mark.parametrize("missing", ["error", "native"])  # another sequence's routes are never "missing"
def test_generate_refuses_traces_of_other_rows(backend, missing):
    # generate's prefill (no cache) is matched by content, its decode steps by batch row: traces in
    # the other order pass the prefill, then the first decode step's token is not the one traces[0]
    # recorded at position 6 (they would replay the other row's routes)
    model, moe, ids, mask, traces, gen = _generated(backend)
    with pytest.raises(ValueError, match=r"Invalid tokens of replay: .*batch row 0, position 6: traces\[0\]"):
        with moe.replaying(traces[::-1], missing=missing), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, **gen)
    with moe.replaying(traces), torch.no_grad():  # the batch's own order replays
        out = model.generate(input_ids=ids, attention_mask=mask, **gen)
    # the rollout's tokens again (a trace holds the fed tokens: not the last sampled one)
    assert torch.equal(out[:, 6:8], torch.tensor(np.stack([t.token_ids[6:] for t in traces])))


def test_generate_refuses_a_trace_whose_tokens_diverge():
    # a trace whose recorded token at a decode position differs from what generate feeds there (a
    # sampled continuation that went elsewhere): its later routes belong to another sequence
    model, moe, ids, mask, traces, gen = _generated("torch")
    tok = traces[1].token_ids.copy()
    tok[7] = (tok[7] + 1) % model.config.vocab_size
    with pytest.raises(ValueError, match=r"batch row 1, position 7: traces\[1\] recorded token"):
        with moe.replaying([traces[0], traces[1].replace(token_ids=tok)]), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, **gen)
    untokened = [t.replace(token_ids=None) for t in traces[::-1]]  # no tokens: nothing to compare
    with moe.replaying(untokened, missing="native"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **gen)


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("between", ["compiled-forward", "set_rollout_replay"])
def test_each_rollout_is_a_round_of_its_own(between):
    # rollout mode: a round is the generate calls since the last forward outside generate; a compiled
    # training forward (seen by Python only while tracing) ends it too, and so does a second
    # set_rollout_replay(True) (which also applies its settings to the round in replay); rounds used to
    # grow, and a repeated prompt then replayed the first round's routes
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model)
    moe.set_rollout_replay(True)
    prompt = torch.tensor([[5, 9, 17, 33, 41, 12]] * 2)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for step in range(3):
        with torch.no_grad():
            seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                  min_new_tokens=3, do_sample=True)  # fmt: skip
        assert len(moe.rollout_traces()) == 2, step
        if between == "compiled-forward":
            with torch.no_grad():
                compiled(input_ids=seqs[:, :-1], attention_mask=torch.ones_like(seqs[:, :-1]))
        else:
            moe.set_rollout_replay(True, missing="native")
            assert moe.report() is not None and moe._engine.replay.table.missing == "native"


@pytest.mark.parametrize(
    "setup",
    [
        lambda moe, tr: moe.set_capture(True),  # beam search captured: each trace mixed several beams
        lambda moe, tr: moe.set_replay(tr),  # replayed: the cache's rows reorder under the traces
        lambda moe, tr: moe.set_rollout_replay(True),  # rollout mode captures inside generate
    ],
    ids=["capture", "replay", "rollout"],
)
@pytest.mark.parametrize("how", ["keyword", "generation_config"])  # transformers resolves either
def test_beam_search_is_refused_while_capturing_or_replaying(setup, how):
    from transformers import GenerationConfig

    model, moe, ids, mask, traces, gen = _generated("torch")
    setup(moe, traces)
    beams = {"num_beams": 3} if how == "keyword" else {"generation_config": GenerationConfig(num_beams=3)}
    with pytest.raises(ValueError, match=r"Invalid value of num_beams: expected 1 while replaymoe captures"):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **beams)
    moe.set_replay(None)
    moe.set_capture(False)
    moe.set_rollout_replay(False)
    with torch.no_grad():  # neither on: beam search runs (replaymoe's kernels, native routing)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=3)


def test_generate_with_more_traces_than_rows_is_named():
    # traces that carry their tokens, one more than generate's rows: the token check used to fail
    # inside torch ("The size of tensor a (2) must match the size of tensor b (3)")
    model, moe, ids, mask, traces, gen = _generated("torch")
    with pytest.raises(ValueError, match=r"one trace per batch row \(2 rows in this forward\).*got 3 trace"):
        with moe.replaying([*traces, traces[0]]), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, **gen)


def test_row_matched_forward_without_input_ids_is_refused():
    # inputs_embeds alone with traces that carry tokens: no tokens to match by content or to check
    # rows against, and rows fed in another order replayed the other sequence's routes without a word
    model, moe, ids, mask, traces = _captured()
    emb = model.get_input_embeddings()(ids.flip(0))
    with pytest.raises(ValueError, match=r"expected input_ids in a forward that replays traces which carry"):
        with moe.replaying(traces), torch.no_grad():
            model(inputs_embeds=emb, attention_mask=mask)
    untokened = [t.replace(token_ids=None) for t in traces]  # the opt-out the message names: by row
    with moe.replaying(untokened), torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask)


@pytest.mark.parametrize("reentrant", [True, False])
def test_disable_before_a_replayed_checkpointed_backward_raises_in_the_recompute(reentrant):
    # disable() between a replayed checkpointed forward and its backward: the recompute ran the
    # restored model natively (reentrant: other experts than the forward's, silently; non-reentrant:
    # torch's CheckpointError about saved tensors)
    model, moe, ids, mask, traces = _captured()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with moe.replaying(traces):
        loss = model(input_ids=ids, attention_mask=mask).logits.float().square().mean()
    moe.disable()
    with pytest.raises(
        ValueError, match=r"Invalid order of disable: .*got a recompute of model\.layers\.\d+\.mlp"
    ):
        loss.backward()
    del loss
    import gc

    gc.collect()
    loss = model(input_ids=ids, attention_mask=mask).logits.float().square().mean()  # native now
    loss.backward()  # no replayed forward alive: the guard is gone
    assert "_replaymoe_recompute_guard" not in model.__dict__
    moe2 = rhf.enable(model)  # a new session on the model: nothing of the old one's guard stays
    with moe2.replaying(traces):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()


def test_capture_of_packed_rows_is_refused_and_drops_the_mixed_batch():
    # two sequences packed in one row, position ids restarting at 0: the second was recorded over
    # the first's positions, one trace of mixed tokens and routes, without a word
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, capture=True)
    ids, _ = _batch(3, model.config.vocab_size, rows=1)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]))
    with pytest.raises(ValueError, match=r"Invalid value of position_ids: .*increase along each row"):
        moe.traces()
    assert moe.traces() == []  # the mixed trace is never handed out
    with torch.no_grad():  # given positions that increase (a late start): captured
        model(input_ids=ids, position_ids=torch.arange(3, 15)[None])
    (t,) = moe.traces()
    assert t.num_tokens == 15 and (t.ids[:3] == -1).all() and (t.ids[3:] >= 0).all()  # 0..2 never fed

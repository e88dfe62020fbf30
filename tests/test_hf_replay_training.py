"""Rollout routing replay in training setups: activation checkpointing (reentrant, non-reentrant,
around the decoder layer or the MoE block alone), backward after the ``replaying`` block, micro-batches
whose recomputes run after other forwards, and a recompute that cannot find its forward's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _rollout(seed: int = 0, rows: int = 2, prompt_len: int = 5, new: int = 6):
    """A tiny Qwen3-MoE, a sampled rollout with capture, and routers moved afterwards (as an optimizer
    step moves them) so that native routing now differs from the rollout's."""
    torch.manual_seed(seed)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True)
    prompt = torch.randint(3, model.config.vocab_size, (rows, prompt_len))
    with torch.no_grad():
        seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              min_new_tokens=new, do_sample=True)  # fmt: skip
    traces = moe.traces()
    moe.set_capture(False)
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    model.train()
    return model, moe, seqs, traces


def _loss(model, seqs):
    logits = model(input_ids=seqs, attention_mask=torch.ones_like(seqs)).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs[:, 1:, None]).mean().neg()


def _grads(model):
    out = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out


def _checkpoint(model, moe, how: str):
    if how == "hf-nonreentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif how == "hf-reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif (
        how == "block"
    ):  # torch's checkpoint_wrapper (FSDP's) around the MoE block alone: its input is the key
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for info in moe.layers:
            parent = model.get_submodule(info.name.rsplit(".", 1)[0])
            setattr(parent, info.name.rsplit(".", 1)[1], checkpoint_wrapper(info.block))


def _native_differs(model, moe, seqs, traces) -> bool:
    with torch.no_grad():
        model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
    moe.set_capture(True)
    with torch.no_grad():
        model(input_ids=seqs[:, :-1], attention_mask=torch.ones_like(seqs[:, :-1]))
    native = moe.traces()
    moe.set_capture(False)
    return any((a.ids != b.ids).any() for a, b in zip(native, traces))


@pytest.mark.parametrize(
    "how",
    [
        "hf-nonreentrant",  # transformers' default: the recompute gets the same input tensors
        "hf-reentrant",  # the recompute gets detached copies (same storage); its forward ran under no_grad
        "block",  # a checkpoint around the MoE block only: the block's input is the key
    ],
)
@pytest.mark.parametrize("backward_after_block", [False, True], ids=["bwd-inside", "bwd-after"])
def test_checkpoint_recompute_routes_as_the_forward(how, backward_after_block):
    # gradients with checkpointing equal those without, whether backward runs inside or after the
    # replaying block; the routers were moved, so a native recompute would give other gradients
    model, moe, seqs, traces = _rollout()
    assert _native_differs(model, moe, seqs, traces)
    with moe.replaying(traces):
        _loss(model, seqs).backward()
    ref = _grads(model)
    _checkpoint(model, moe, how)
    with moe.replaying(traces):
        loss = _loss(model, seqs)
        if not backward_after_block:
            loss.backward()
    if backward_after_block:
        loss.backward()
    got = _grads(model)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_micro_batches_recompute_after_other_forwards():
    # gradient accumulation: two micro-batches (each its own traces) run forward before either
    # backward; each recompute must use its own forward's ids, not the last forward's
    model, moe, seqs, traces = _rollout(rows=4)
    halves = [(seqs[:2], traces[:2]), (seqs[2:], traces[2:])]
    for s, t in halves:
        with moe.replaying(t):
            _loss(model, s).backward()
    ref = _grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = []
    for s, t in halves:
        with moe.replaying(t):
            losses.append(_loss(model, s))
    (losses[1] + losses[0]).backward()  # the second micro-batch's graph first
    got = _grads(model)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_call_outside_the_forward_raises_while_a_replayed_graph_lives():
    # a MoE layer run outside the model's forward that matches no bound forward cannot know its ids:
    # while a replayed forward's graph is alive (its backward may still recompute) that is an error,
    # never a silent native routing
    model, moe, seqs, traces = _rollout()
    with moe.replaying(traces):
        loss = _loss(model, seqs)
    block = moe.layers[0].block
    stray = torch.randn(1, seqs.numel(), model.config.hidden_size)
    with pytest.raises(ValueError, match="outside the model's forward"):
        block(stray)
    loss.backward()
    del loss
    block(stray)  # nothing replayed is alive any more: a direct call routes natively


def _replayed_ids(model, moe, traces, seqs, mask, chunks, missing="error"):
    """Capture what a replayed forward over each chunk of rows (indices into seqs) used."""
    moe.set_capture(True)
    with moe.replaying(traces, missing=missing), torch.no_grad():
        for rows in chunks:
            model(input_ids=seqs[rows], attention_mask=mask[rows])
        report = moe.report()
    used = moe.traces()
    moe.set_capture(False)
    return used, report


@pytest.mark.parametrize(
    "chunks",
    [
        [[0, 1, 2, 3]],  # the rollout's own batch order
        [[2, 0], [3, 1]],  # shuffled, then split into micro-batches (TRL's buffered inputs)
        [[3]],  # a subset: one row alone
        [[1, 1, 0]],  # a row twice in one forward
    ],
    ids=["same-order", "shuffled-chunks", "subset", "duplicate-row"],
)
def test_rows_matched_by_content(chunks):
    # the rollout left-pads its prompts; the trainer right-pads (a shorter completion row) and feeds
    # rows in any order, subset or chunking: every token replays the rollout's ids of its own prefix,
    # and only each row's last token (never fed back in the rollout) routes natively
    torch.manual_seed(1)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True)
    prompt = torch.randint(3, model.config.vocab_size, (4, 5))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # row 0: a shorter prompt, left-padded
    with torch.no_grad():
        seqs = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                              do_sample=True)  # fmt: skip
    traces = moe.traces()
    moe.set_capture(False)
    assert all(t.token_ids is not None and (t.token_ids >= 0).all() for t in traces)
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    # the trainer's layout: row 0's padding moved to the right
    full_mask = torch.cat([mask, torch.ones(4, 4, dtype=mask.dtype)], 1)
    seqs = seqs.clone()
    seqs[0] = torch.cat([seqs[0, 2:], seqs[0, :2]])
    full_mask[0] = torch.cat([full_mask[0, 2:], full_mask[0, :2]])
    used, report = _replayed_ids(model, moe, traces, seqs, full_mask, chunks)
    order = [b for rows in chunks for b in rows]
    assert len(used) == len(order)
    for trace, b in zip(used, order):
        n = traces[b].num_tokens
        assert trace.num_tokens == n + 1
        assert (trace.ids[:n] == traces[b].ids).all(), b
        assert (trace.token_ids[: n + 1] == seqs[b][full_mask[b].bool()].numpy()).all()
    assert (report.fallback_tokens_per_layer == len(order)).all()  # each row's last token only
    # the same traces without their tokens replay by batch row: shuffled rows get others' routing
    # (and positions the other row's trace does not cover: refused by default, native here)
    bare = [t.replace(token_ids=None) for t in traces]
    with pytest.raises(ValueError, match="coverage of replay.*batch row 0, position"):
        _replayed_ids(model, moe, bare, seqs, full_mask, [[1, 0, 2, 3]])
    shuffled, _ = _replayed_ids(model, moe, bare, seqs, full_mask, [[1, 0, 2, 3]], missing="native")
    assert any((u.ids[: traces[b].num_tokens] != traces[b].ids).any() for u, b in zip(shuffled, [1, 0]))


def test_rows_by_batch_order_need_one_trace_per_row():
    # traces without their tokens (e.g. from an engine that returned only routed experts) are
    # matched by batch row: a forward of another batch size is an error that says why
    model, moe, seqs, traces = _rollout()
    bare = [t.replace(token_ids=None) for t in traces]
    with moe.replaying(bare), pytest.raises(ValueError, match="matched to rows by content"):
        model(input_ids=seqs[:1], attention_mask=torch.ones_like(seqs[:1]))


def test_rollout_replay_mode_reference_model_and_mismatch():
    # set_rollout_replay: generate() captures, later forwards (any rows, checkpointed) replay the
    # round's traces; an attached reference model replays them too; the mismatch counters see the
    # moved routers (native differs) and a replay that holds (replayed differs: exactly 0)
    torch.manual_seed(2)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    ref_model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    ref_model.load_state_dict(model.state_dict())
    moe = replaymoe.hf.enable(model)
    moe.set_rollout_replay(True)
    moe.track_mismatch()
    ref = moe.attach(ref_model)
    native_ref = moe.attach(build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32), replay=False)
    prompt = torch.randint(3, model.config.vocab_size, (4, 5))
    with torch.no_grad():
        seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                              min_new_tokens=4, do_sample=True)  # fmt: skip
    rollout = moe.rollout_traces()
    assert len(rollout) == 4 and moe.traces() == []  # the round's traces are not the user's captures
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    model.train()
    model.gradient_checkpointing_enable()
    rows = seqs[[3, 1]]
    model(input_ids=rows, attention_mask=torch.ones_like(rows)).logits.sum().backward()
    stats = moe.mismatch()
    assert stats["tokens"] == 2 * 8 * len(moe.layers)  # replayed lookups of the forward, not the recompute
    assert stats["native_vs_rollout"] > 0 and stats["replayed_vs_rollout"] == 0.0
    with torch.no_grad():
        ref_model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
        native_ref.model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
    assert (ref.report().fallback_tokens_per_layer == 4).all()  # only each row's last token
    assert native_ref.report() is None  # replay=False: routes natively
    # a new generate after a training forward starts a new round (checkpointing off, as TRL does
    # around generation: with it on, transformers drops the KV cache)
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        model.generate(input_ids=prompt[:2], attention_mask=torch.ones_like(prompt[:2]), max_new_tokens=2,
                       min_new_tokens=2, do_sample=True)  # fmt: skip
    assert len(moe.rollout_traces()) == 2
    moe.disable()
    assert getattr(ref_model, "_replaymoe", None) is None


def test_add_rollout_traces_from_another_engine():
    # traces another engine recorded (here: this model's own capture, copied without the session)
    # join the rollout round: later forwards over any rows replay them; a forward ends the round
    model, moe, seqs, traces = _rollout(seed=3, rows=3)
    moe.set_rollout_replay(True)
    moe.track_mismatch()
    moe.add_rollout_traces([t.replace() for t in traces[:2]])
    moe.add_rollout_traces([traces[2].replace()])  # the same round: no forward in between
    assert len(moe.rollout_traces()) == 3
    rows = seqs[[2, 0]]
    with torch.no_grad():
        model(input_ids=rows, attention_mask=torch.ones_like(rows))
    stats = moe.mismatch()
    assert stats["native_vs_rollout"] > 0 and stats["replayed_vs_rollout"] == 0.0
    assert (moe.report().fallback_tokens_per_layer == 2).all()  # each row's last token only
    moe.add_rollout_traces([traces[1].replace()])  # after a forward: a new round
    assert len(moe.rollout_traces()) == 1


@pytest.mark.parametrize(
    "case, match",
    [
        ("mode_off", "set_rollout_replay"),  # rollout mode off: nothing to add to
        ("no_tokens", r"traces\[0\].*token_ids"),  # cannot be matched by content
        ("offset", r"traces\[0\].*position 0"),  # a continuation without its prefix
        ("not_a_trace", r"traces\[0\].*RoutingTrace"),
        ("wrong_top_k", "top_k"),  # checked against the model before it is kept
    ],
)
def test_add_rollout_traces_refuses_what_it_cannot_replay(case, match):
    model, moe, seqs, traces = _rollout(seed=4, rows=1, new=2)
    trace = traces[0]
    if case != "mode_off":
        moe.set_rollout_replay(True)
    bad = {
        "mode_off": trace,
        "no_tokens": trace.replace(token_ids=None),
        "offset": trace.replace(token_offset=1),
        "not_a_trace": trace.ids,
        "wrong_top_k": trace.replace(ids=trace.ids[..., :1], top_k=1),
    }[case]
    with pytest.raises(ValueError, match=match):
        moe.add_rollout_traces([bad])
    assert moe.rollout_traces() == []


@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "deepseek_v3"]
)  # deepseek: the router's bias buffer is replaced
def test_state_follows_the_model_meta_to_empty_and_to(arch, tmp_path):
    # enable() on a meta-device model (the FSDP2 recipe), then to_empty + load: capture and replay
    # work and give the same routing as a model enabled after loading; state_dict is untouched;
    # save_pretrained / from_pretrained round trip while enabled
    torch.manual_seed(3)
    real = build_model(arch, "tiny", device="cpu", dtype=torch.float32)
    with torch.device("meta"):
        meta = build_model(arch, "tiny", device="meta", dtype=torch.float32)
    moe = replaymoe.hf.enable(meta, capture=True)
    assert set(meta.state_dict()) == set(real.state_dict())
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    for name, buf in real.named_buffers():  # non-persistent buffers (rotary) are not in state_dict
        meta.get_buffer(name).copy_(buf)
    ids = torch.randint(3, real.config.vocab_size, (2, 6))
    with torch.no_grad():
        out = meta(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    traces = moe.traces()
    ref_moe = replaymoe.hf.enable(real, capture=True)
    with torch.no_grad():
        ref_out = real(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert all(a == b for a, b in zip(traces, ref_moe.traces()))
    torch.testing.assert_close(out, ref_out)
    meta.to(torch.bfloat16)  # .to() after enable(): the state follows
    with moe.replaying(traces), torch.no_grad():
        meta(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert moe.report().fallback_tokens_per_layer.sum() == 0
    real.save_pretrained(tmp_path)  # while enabled: the checkpoint holds the model's own tensors only
    again = type(real).from_pretrained(tmp_path, device_map="cpu")
    assert set(again.state_dict()) == set(real.state_dict())
    again_moe = replaymoe.hf.enable(again, capture=True)  # enable() on a model loaded with a device_map
    with torch.no_grad():
        again(input_ids=ids, attention_mask=torch.ones_like(ids))
    loaded = again_moe.traces()  # (model_id is now the checkpoint's path)
    assert all((a.ids == b.ids).all() and (a.token_ids == b.token_ids).all() for a, b in zip(loaded, traces))


def test_aux_loss_counts_the_replayed_ids():
    # output_router_logits=True under replay: the aux loss counts the ids the routers used (the
    # rollout's), not a top-k of the moved routers' logits; without replay it is transformers' own
    from replaymoe.hf.aux_loss import load_balancing_loss

    model, moe, seqs, traces = _rollout()
    mask = torch.ones_like(seqs)
    cfg = model.config
    native = model(input_ids=seqs, attention_mask=mask, output_router_logits=True)
    top = [torch.topk(g.softmax(-1), cfg.num_experts_per_tok, dim=-1).indices for g in native.router_logits]
    assert torch.equal(native.aux_loss, load_balancing_loss(native.router_logits, top, cfg.num_experts,
                                                            cfg.num_experts_per_tok, mask))  # fmt: skip
    moe.set_capture(True)
    with moe.replaying(traces):
        out = model(input_ids=seqs, attention_mask=mask, output_router_logits=True)
    used = moe.traces()[0]  # row 0's ids as used, to check the loss took them
    moe.set_capture(False)
    n = traces[0].num_tokens
    assert (used.ids[:n] == traces[0].ids).all()
    ids = [torch.from_numpy(np.stack([t.ids[:, layer] for t in moe_traces_full(moe, model, seqs, traces)]))
           for layer in range(len(moe.layers))]  # fmt: skip
    want = load_balancing_loss(out.router_logits, [i.reshape(-1, cfg.num_experts_per_tok) for i in ids],
                               cfg.num_experts, cfg.num_experts_per_tok, mask)  # fmt: skip
    assert torch.equal(out.aux_loss, want)
    assert not torch.equal(out.aux_loss, native.aux_loss)


def moe_traces_full(moe, model, seqs, traces):
    """The ids a replayed forward used at every position of every row (captured while replaying)."""
    moe.set_capture(True)
    with moe.replaying(traces), torch.no_grad():
        model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
    used = moe.traces()
    moe.set_capture(False)
    return used


@pytest.mark.parametrize("mode", ["capture", "rollout", "replay"])
def test_continuous_batching_with_capture_or_replay(mode):
    # generate_batch packs requests into paged rows: capture returned wrong traces silently before it was
    # refused; now capture and rollout mode map each packed token to its request (tests/test_hf_paged.py)
    # and replay, which matches whole sequences, stays refused
    from transformers.generation import ContinuousBatchingConfig

    torch.manual_seed(4)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=mode == "capture")
    if mode == "rollout":
        moe.set_rollout_replay(True)
    if mode == "replay":
        moe.set_replay(
            replaymoe.RoutingTrace(
                np.zeros((3, len(moe.layers), 2), dtype=np.int16) + np.int16([0, 1]), num_experts=8, top_k=2
            )
        )
    cfg = ContinuousBatchingConfig(block_size=8, num_blocks=8, max_batch_tokens=8)  # (default: host-sized)
    model.generation_config.max_new_tokens = 2
    if mode == "replay":
        with pytest.raises(ValueError, match="continuous batching"):
            model.generate_batch(inputs=[[5, 6, 7]], continuous_batching_config=cfg)
    else:
        (out,) = model.generate_batch(inputs=[[5, 6, 7]], continuous_batching_config=cfg).values()
        (trace,) = moe.traces() if mode == "capture" else moe.rollout_traces()
        assert trace.token_ids.tolist() == [5, 6, 7, *out.generated_tokens][:-1]
    moe.disable()
    assert "init_continuous_batching" not in model.__dict__ and "generate_batch" not in model.__dict__


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "gpt_oss"])
def test_no_tensor_outside_parameters_and_buffers(arch):
    # transformers' test_all_tensors_are_parameter_or_buffer: replaymoe keeps its device state in the
    # session (it follows the forward's device), never as plain tensor attributes of the model's modules,
    # and adds nothing to state_dict, through capture, generate and replay
    model = build_model(arch, "tiny", device="cpu", dtype=torch.float32)
    keys = set(model.state_dict())
    moe = replaymoe.hf.enable(model, capture=True)
    ids = torch.randint(4, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)
    with moe.replaying(moe.traces()), torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    stray = [
        (n, k) for n, m in model.named_modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)
    ]
    assert stray == []
    assert set(model.state_dict()) == keys


def test_replaying_the_same_traces_again_loads_no_table(monkeypatch):
    # replaying(traces) around every training step: the policy's and an attached model's tables are
    # loaded once and reused (set_replay of the very traces a pooled table holds), still replaying
    from replaymoe.record.replay import ReplayTable

    model, moe, seqs, traces = _rollout()
    ref = moe.attach(build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32))
    loads = []
    real = ReplayTable.load
    monkeypatch.setattr(ReplayTable, "load", lambda self, *a, **k: (loads.append(self), real(self, *a, **k)))
    for _ in range(3):
        with moe.replaying(traces), torch.no_grad():
            model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
            ref.model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
            assert (moe.report().fallback_tokens_per_layer == len(traces)).all()
            assert (ref.report().fallback_tokens_per_layer == len(traces)).all()
    assert len(loads) == 2  # one per session

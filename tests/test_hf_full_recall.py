"""Full recall in transformers models and TRL (CPU): capture with ``set_capture(True, weights=True)``,
replay with ``replay="ids+weights"`` gives bitwise the captured forward's output, with no gradient to
the router through the weights while the experts train; checkpoint recomputes replay the weights too;
rollout mode and ``R3Config(replay="ids+weights")``; weightless traces (vLLM, SGLang) are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _captured(arch="qwen3_moe", backend="auto", rows=2, length=7, **overrides):
    """A tiny model, one captured forward with weights (its logits and traces), then routers moved
    (as an optimizer step moves them) so that neither native routing nor R3's recomputed weights give
    the captured output again."""
    torch.manual_seed(0)
    model = build_model(arch, "tiny", device="cpu", dtype=torch.float32, **overrides)
    moe = replaymoe.hf.enable(model, backend=backend)
    moe.set_capture(True, weights=True)
    seqs = torch.randint(3, model.config.vocab_size, (rows, length))
    with torch.no_grad():
        ref = model(input_ids=seqs, attention_mask=torch.ones_like(seqs)).logits
    traces = moe.traces()
    moe.set_capture(False)
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    model.train()
    return model, moe, seqs, ref, traces


def _loss(model, seqs):
    logits = model(input_ids=seqs, attention_mask=torch.ones_like(seqs)).logits
    return logits, logits.float().pow(2).mean()


@pytest.mark.parametrize(
    "arch, backend, overrides",
    [
        ("qwen3_moe", "auto", {}),  # softmax + renormalize: the routing kernel's weights
        ("mixtral", "auto", {}),
        ("gpt_oss", "auto", {}),  # biased router
        ("deepseek_v3", "auto", {}),  # grouped sigmoid + bias, routed scaling
        ("deepseek_v3", "auto", dict(norm_topk_prob=False)),  # the router's own sigmoid weights (no kernel)
        pytest.param("qwen3_moe", "triton", {}, marks=pytest.mark.interpret),  # the Triton kernels
    ],
)
def test_ids_and_weights_replay_the_captured_forward_bitwise(arch, backend, overrides):
    model, moe, seqs, ref, traces = _captured(arch, backend, **overrides)
    assert all(t.has_weights and t.weights.shape == t.ids.shape for t in traces)
    with moe.replaying(traces, replay="ids"):  # R3: the moved routers' weights
        r3, _ = _loss(model, seqs)
    assert not torch.equal(r3, ref)
    with moe.replaying(traces, replay="ids+weights"):
        out, loss = _loss(model, seqs)
    if backend == "triton":
        # the captured forward ran the inference kernels and this one the training kernels, whose
        # tl.dot is a numpy matmul under the interpreter, summed in an order that depends on the CPU's
        # OpenBLAS kernel: equal to fp32 rounding (bit for bit only where the arithmetic is exact in any
        # order; the torch backend's cases run the same ops both times)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, ref)  # same ids, same weights: same output, bit for bit
    loss.backward()
    for info in moe.layers:  # no gradient reaches the router through the replayed weights...
        g = info.router.weight.grad
        assert g is None or bool((g == 0).all()), info.name
    experts = [p.grad for n, p in model.named_parameters() if ".experts." in n and p.grad is not None]
    assert experts and any(bool((g != 0).any()) for g in experts)  # ...while the experts train


def test_capture_without_weights_keeps_none():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True)
    assert moe._engine.capture.buffer.weights is None  # nothing allocated, nothing written
    seqs = torch.randint(3, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        model(input_ids=seqs)
    (trace,) = moe.traces()
    assert not trace.has_weights
    with pytest.raises(ValueError, match=r"traces\[0\].*ids only.*vLLM or SGLang"):
        moe.set_replay([trace], replay="ids+weights")
    with pytest.raises(ValueError, match="replay"):
        moe.set_replay([trace], replay="weights")


def test_negative_weights_are_refused_where_the_routing_makes_none():
    # route() refuses negative replay_weights for a renormalized softmax; the HF forwards skip that
    # check (the table is checked once), so set_replay must apply it: naming the trace, the layer and
    # the position; a sign flip in a row of -1 ids (nothing replayed there) is no error
    model, moe, seqs, _, traces = _captured()
    w = traces[1].weights.copy()
    w[3, 2, 1] = -0.25
    bad = traces[1].replace(weights=w)
    with pytest.raises(
        ValueError, match=r"weights of traces\[1\].*MoE layer 2.*got -0.25 at position 3, slot 1"
    ):
        moe.set_replay([traces[0], bad], replay="ids+weights")
    ids = bad.ids.copy()
    ids[3, 2] = -1
    moe.set_replay([traces[0], bad.replace(ids=ids)], replay="ids+weights", missing="native")


@pytest.mark.parametrize(
    "arch, edit, match",
    [
        (
            "qwen3_moe",
            lambda w: w * 2,
            r".* summing to 1 per row for MoE layer 0 .*got 1\.\d+ at position \d+, slot",
        ),  # a doubled row
        (
            "qwen3_moe",
            lambda w: w * 0,
            r".* summing to 1 per row for MoE layer 0 .*got a row summing to 0 at position 0",
        ),  # zeroed
        (
            "qwen3_moe",
            lambda w: w * 1e6,
            r"\[0, 1\] .*MoE layer 0 .*got 5\d+\.\d+ at position 0",
        ),  # past the maximum
        # rows scaled to sum 1.5, each weight still below 1 at some rows: the row sum names them
        ("qwen3_moe", lambda w: w * 1.5, r".* summing to 1 per row for MoE layer 0 .*got "),
        # DeepSeek-V3's rows sum to routed_scaling_factor; traces of a model with another scale
        (
            "deepseek_v3",
            lambda w: w * 0.5,
            r".* summing to 2\.5 per row for MoE layer 0 .*\(deepseek_v3\) makes them, got a row",
        ),
    ],
    ids=["doubled", "zeroed", "huge", "scaled", "deepseek-scale"],
)
def test_replayed_weights_must_be_what_the_routing_makes(arch, edit, match):
    # full recall replayed weights that the layer's routing can never make, without a word (logits off
    # by up to 1.09); each is refused at set_replay naming the trace, the layer and the position
    model, moe, seqs, _, traces = _captured(arch)
    w = traces[1].weights.copy()
    real = traces[1].ids[:, :, :1] >= 0
    w = np.where(real, edit(w).astype(np.float32), w)
    with pytest.raises(ValueError, match=r"Invalid weights of traces\[1\]: expected weights in " + match):
        moe.set_replay([traces[0], traces[1].replace(weights=w)], replay="ids+weights")
    moe.set_replay(traces, replay="ids+weights")  # the captured weights themselves pass


def test_trace_arrays_are_read_only_copies():
    # an edit in place after a replay was ignored (the device table is kept for the same trace
    # objects) and skipped every check (a duplicate id replayed, an id of 10000 an IndexError)
    model, moe, seqs, _, traces = _captured()
    t = traces[0]
    for arr in (t.ids, t.weights, t.token_ids):
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = arr[0]
    given = np.zeros((3, 2, 2), dtype=np.int16)
    given[:, :, 1] = 1
    made = type(t)(given, num_experts=8, top_k=2)
    given[0, 0] = 5  # the caller's array is theirs: the trace keeps its own copy
    assert made.ids[0, 0].tolist() == [0, 1] and given.flags.writeable


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_recomputes_replay_the_weights_too(reentrant):
    # the same gradients with and without activation checkpointing: the recompute finds the ids and
    # the weights its forward used (bound to the layer's input)
    model, moe, seqs, ref, traces = _captured(rows=2, length=6)
    traces = [t.replace(token_ids=None) for t in traces]  # inputs_embeds: matched by row, no tokens
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with moe.replaying(traces, replay="ids+weights"):
            inputs = model.get_input_embeddings()(seqs).detach().requires_grad_(True)
            out = model(inputs_embeds=inputs, input_ids=None, attention_mask=torch.ones_like(seqs)).logits
        out.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_rollout_mode_captures_and_replays_weights():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model)
    moe.set_rollout_replay(True, replay="ids+weights")
    moe.track_mismatch()
    prompt = torch.randint(3, model.config.vocab_size, (2, 4))
    with torch.no_grad():
        seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                              min_new_tokens=4, do_sample=True)  # fmt: skip
    traces = moe.rollout_traces()
    assert len(traces) == 2 and all(t.has_weights for t in traces)
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    model.train()
    _, loss = _loss(model, seqs)
    loss.backward()
    assert moe.mismatch()["replayed_vs_rollout"] == 0.0
    # the replayed rows take the rollout's weights: only each row's last token (never fed back in the
    # rollout, routed natively) passes the router a gradient; without those rows it would get none
    assert any(info.router.weight.grad is not None for info in moe.layers)
    with pytest.raises(ValueError, match=r"traces\[0\].*vLLM or SGLang"):
        moe.add_rollout_traces([traces[0].replace(weights=None)])


# ---------------------------------------------------------------- TRL


def test_trainer_replays_ids_and_weights(tmp_path):
    pytest.importorskip("trl")
    from _trl_harness import train_logs, trainer_factory
    from replaymoe.integrations.trl import R3Config
    from test_trl_r3 import MovedRouters

    with pytest.raises(ValueError, match="replay"):
        R3Config(replay="weights")
    make = trainer_factory(tmp_path, MovedRouters)
    trainer = make(router_aux_loss_coef=0.0, trainer_kwargs={"r3": R3Config(replay="ids+weights")})
    logs = train_logs(trainer)
    assert logs["r3/replayed_vs_rollout"] == 0.0
    assert logs["r3/native_vs_rollout"] > 0.0  # the moved routers would route otherwise
    traces = trainer.r3_session.rollout_traces()
    assert traces and all(t.has_weights for t in traces)


# ---------------------------------------------------------------- GPU (H100 / H200)


@pytest.mark.gpu
def test_route_captures_and_replays_weights_inside_a_cuda_graph():
    # the weights buffer and the replayed weights at fixed addresses: a graph replay reads and writes
    # whatever they hold then (bf16 logits: the kernel's int32 keys)
    from replaymoe.routing import route

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = route(x, 8).topk_ids.clone()
    ids[3] = -1  # routed natively inside the graph
    rw = torch.rand(64, 8, device="cuda", generator=g)
    wout = torch.full((80, 8), float("nan"), device="cuda")
    kw = dict(replay_ids=ids, replay_weights=rw, routing_weights_out=wout)
    route(x, 8, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(x, 8, **kw)
    rw.copy_(torch.rand(64, 8, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    forced = [i for i in range(64) if i != 3]
    assert torch.equal(out.topk_weights[forced], rw[forced])
    assert torch.equal(out.topk_weights[3], route(x[3:4], 8).topk_weights[0])
    assert torch.equal(wout[:64], out.topk_weights) and bool(wout[64:].isnan().all())


@pytest.mark.gpu
def test_graphed_decode_captures_the_weights_eager_decode_does():
    # generate with the MoE blocks as CUDA graphs and the device decode chain (static slabs), against
    # every forward eager: the same traces, ids and weights, bit for bit (batch-invariant kernels)
    traces = {}
    for graphs in (False, True):
        model = build_model("qwen3_moe", "medium", dtype=torch.bfloat16, device="cuda")
        moe = replaymoe.hf.enable(model, graphs=graphs)
        moe.set_capture(True, weights=True)
        prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model.generate(input_ids=prompt.cuda(), attention_mask=torch.ones_like(prompt).cuda(),
                           max_new_tokens=8, do_sample=False)  # fmt: skip
        traces[graphs] = moe.traces()
        assert all(t.has_weights for t in traces[graphs])
        if graphs:
            assert moe.block_graph_captures > 0
    assert traces[False] == traces[True]

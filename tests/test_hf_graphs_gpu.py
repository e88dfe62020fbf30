"""CUDA graphs of MoE blocks in eager decode-size forwards (``replaymoe.hf.graphs``), on the GPU.

The graphed model must be indistinguishable from the eager one: same tokens and bitwise-equal
logits (the kernels are batch-invariant, so the graph's tile mode and eager decode's direct mode
give the same bits), same captured ids, same replay, and a weight replaced after capture is seen.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
import replaymoe.moe as rmoe  # noqa: E402
from replaymoe.bench.hf_timing import shared_copy  # noqa: E402
from replaymoe.hf.graphs import BlockGraphs  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu


def _generate(model, ids, mask, new=6, **kw):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


def _inputs(vocab, batch, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    return ids, mask


def _captured(moe) -> int:
    return sum(g.captured() for g in moe._engine.patch.block_graphs)


@pytest.mark.parametrize(
    "arch,batch",
    [
        ("qwen3_moe", 1),  # decode T=1
        ("qwen3_moe", 5),  # odd batch, left padding in row 0
        ("deepseek_v3", 4),  # grouped routing with bias, shared experts inside the graph
        ("qwen2_moe", 3),  # shared expert and its sigmoid gate inside the graph
        ("gpt_oss", 2),  # biased, interleaved, clamped experts; the block returns a tuple
    ],
)
def test_graphs_match_eager(arch, batch):
    model = build_model(arch, "medium", dtype=torch.bfloat16, device="cuda")
    eager = shared_copy(model)
    launched = shared_copy(model)  # graphs, but every decode step launches step_rows (no device rows)
    ids, mask = _inputs(model.config.vocab_size, batch)
    m_graph = rhf.enable(model, capture=True, max_batch_size=batch, max_positions=32)
    m_eager = rhf.enable(eager, capture=True, max_batch_size=batch, max_positions=32, graphs=False)
    m_launched = rhf.enable(launched, capture=True, max_batch_size=batch, max_positions=32)
    m_launched.device_decode = False
    for _ in range(2):  # the second generate starts on graphs captured by the first
        a = _generate(model, ids, mask)
        b = _generate(eager, ids, mask)
        c = _generate(launched, ids, mask)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, c.sequences)
        for la, lb in zip(a.logits, b.logits):
            assert torch.equal(la, lb)
        ta, tb, tc = m_graph.traces(), m_eager.traces(), m_launched.traces()
        assert len(ta) == len(tb) == len(tc) == batch
        for x, y, z in zip(ta, tb, tc):
            assert (x.ids == y.ids).all() and (x.ids == z.ids).all()
    # the decode steps after the first of each generate took the device rows (DecodeHead)
    assert (
        m_graph._engine.decode.heads == 2 * (6 - 2) and m_launched._engine.decode.heads == 0
    )  # private: the path
    # per block: the decode shape (captured in the first generate) and the prefill's (in the second);
    # the first block also holds the decode step with the head
    assert _captured(m_graph) == 2 * len(m_graph.layers) + 1
    assert _captured(m_launched) == 2 * len(m_launched.layers)
    assert _captured(m_eager) == 0
    m_launched.disable()
    # replay of the rollout through graphs: the same tokens, nothing routed natively
    with m_graph.replaying(ta):
        c = _generate(model, ids, mask)
        c = _generate(model, ids, mask)
        report = m_graph.report()
    assert torch.equal(c.sequences, a.sequences)
    assert int(report.fallback_tokens_per_layer.sum()) == 0
    m_graph.disable()
    m_eager.disable()


def test_graph_replay_skips_python_and_sees_new_weights(monkeypatch):
    model = build_model("qwen3_moe", "medium", dtype=torch.bfloat16, device="cuda")
    ref = shared_copy(model)
    ids, mask = _inputs(model.config.vocab_size, 2)
    moe = rhf.enable(model, max_batch_size=2, max_positions=32)
    ref_moe = rhf.enable(ref, max_batch_size=2, max_positions=32, graphs=False)
    _generate(model, ids, mask)  # captures the decode graphs
    calls = {"fused": 0}
    real = rmoe.fused_moe

    def spy(*a, **k):
        calls["fused"] += 1
        return real(*a, **k)

    monkeypatch.setattr(rmoe, "fused_moe", spy)
    step = ids[:, -1:]
    with torch.no_grad():
        # a decode-shaped forward without a cache: [2, 1] tokens, graphs already captured for it
        model(input_ids=step)
        model(input_ids=step)
    assert calls["fused"] == 0  # replayed: no Python of the experts ran
    # a parameter replaced (not updated in place) after capture: the graph is re-captured
    for info in moe.layers:
        w = info.experts.gate_up_proj
        info.experts.gate_up_proj = torch.nn.Parameter(w.detach() * 1.5)
    for info in ref_moe.layers:
        w = info.experts.gate_up_proj
        info.experts.gate_up_proj = torch.nn.Parameter(w.detach() * 1.5)
    with torch.no_grad():
        got = model(input_ids=step).logits
        want = ref(input_ids=step).logits
    assert torch.equal(got, want)
    # a hook on a router: the block runs eagerly (the hook fires on every call)
    fired = []
    h = moe.layers[0].router.register_forward_hook(lambda *a: fired.append(1))
    with torch.no_grad():
        model(input_ids=step)
        model(input_ids=step)
    h.remove()
    assert len(fired) == 2
    moe.disable()
    ref_moe.disable()


def test_no_graphs_with_grad_or_training_noise():
    model = build_model("qwen3_moe", "medium", dtype=torch.bfloat16, device="cuda")
    moe = rhf.enable(model, max_batch_size=2, max_positions=32)
    ids = torch.randint(3, model.config.vocab_size, (2, 1), device="cuda")
    for _ in range(3):
        model(input_ids=ids).logits.float().sum().backward()  # grad enabled: never graphed
    assert _captured(moe) == 0
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            want = model(input_ids=ids).logits
    assert _captured(moe) == len(moe.layers)
    # training mode under no_grad (TRL's rollouts) without noise in the blocks: graphed too, under
    # their own key, with the same bits
    model.train()
    with torch.no_grad():
        for _ in range(3):
            got = model(input_ids=ids).logits
    assert _captured(moe) == 2 * len(moe.layers)
    assert torch.equal(got, want)
    # a block with router jitter draws random numbers in training mode: eager there
    mixtral = build_model("mixtral", "medium", dtype=torch.bfloat16, device="cuda", router_jitter_noise=0.1)
    moe_mx = rhf.enable(mixtral, max_batch_size=2, max_positions=32)
    mixtral.train()
    with torch.no_grad():
        for _ in range(3):
            mixtral(input_ids=ids)
    assert _captured(moe_mx) == 0
    moe_mx.disable()
    # fp32 experts on CUDA run the torch reference: never graphed (and no capture attempt warns)
    model32 = build_model("qwen3_moe", "medium", dtype=torch.float32, device="cuda")
    moe32 = rhf.enable(model32, max_batch_size=2, max_positions=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(3):
                model32(input_ids=ids)
    assert _captured(moe32) == 0
    assert not [w for w in caught if "CUDA graph" in str(w.message)]
    moe32.disable()
    assert all(isinstance(g, BlockGraphs) for g in moe._engine.patch.block_graphs)
    moe.disable()
    assert "forward" not in moe.layers[0].block.__dict__


def test_no_garbage_collection_inside_block_capture():
    # a collection inside a capture can destroy an unreachable CUDA graph (a dead session's, a
    # user's), which is not permitted while a stream captures: it invalidated block captures (seen
    # in the full GPU suite). Block captures therefore run with the collector off, and restore it.
    import gc

    model = build_model("qwen3_moe", "medium", dtype=torch.bfloat16, device="cuda")
    ids, mask = _inputs(model.config.vocab_size, 2)
    moe = rhf.enable(model, capture=True, max_batch_size=2, max_positions=32)
    seen = []
    graphs = moe._engine.patch.block_graphs[0]
    block_forward = graphs.forward

    def probe(hidden_states):  # the block's own forward, which the captures record
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
        return block_forward(hidden_states)

    graphs.forward = probe
    _generate(model, ids, mask, new=4)
    assert seen and not any(seen)  # the block ran inside a capture, with the collector off
    assert gc.isenabled()
    assert _captured(moe) > 0 and not any(g.failed for g in moe._engine.patch.block_graphs)
    moe.disable()

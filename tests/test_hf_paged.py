"""Capture under transformers' continuous batching (``generate_batch``, the manager API; ``hf._paged``):
each request's trace equals, bitwise, the trace plain ``generate`` records for the same tokens (one
prompt at a time and left-padded together), whatever the packing and prefill chunking; the traces come
in the order the requests were added; what cannot be captured faithfully is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation import ContinuousBatchingConfig  # noqa: E402

import replaymoe.hf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (3, 9, 1, 6)  # one-token prompt; a 9-token one spans two 8-token steps when chunked
NEW = 5


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _configs(max_batch_tokens: int, eos: int = -1, **cb) -> tuple[GenerationConfig, ContinuousBatchingConfig]:
    """Greedy generation; a small paged cache (the default sizes it to the host's memory: seconds)."""
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return gen, ContinuousBatchingConfig(block_size=8, num_blocks=32, max_batch_tokens=max_batch_tokens, **cb)


def _generate_alone(model, moe, prompt: list[int], eos: int | None = None):
    """Plain generate of one prompt: (completion, its trace)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    (trace,) = moe.traces()
    return out[0, len(prompt) :].tolist(), trace


def _generate_padded(model, moe, prompts: list[list[int]]):
    """Plain generate of all prompts in one left-padded batch: (completions, traces)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[:, width:].tolist(), moe.traces()


def _check_equal_to_generate(model, moe, prompts, max_batch_tokens: int, **cb) -> None:
    gen, cfg = _configs(max_batch_tokens, **cb)
    out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cfg)
    paged = moe.traces()
    results = list(out.values())
    assert len(paged) == len(prompts) == len(results)
    for prompt, result, trace in zip(prompts, results, paged):
        tokens = prompt + result.generated_tokens
        assert len(result.generated_tokens) == NEW
        assert trace.num_tokens == len(tokens) - 1  # the last sampled token is never fed back
        assert trace.token_ids.tolist() == tokens[:-1]
        assert trace.missing_fraction() == 0.0
        completion, alone = _generate_alone(model, moe, prompt)
        assert completion == result.generated_tokens
        assert alone == trace  # ids bitwise, token ids, layer ids, model id
    completions, padded = _generate_padded(model, moe, prompts)
    assert padded == paged
    assert completions == [r.generated_tokens for r in results]


@pytest.mark.parametrize(
    "arch,max_batch_tokens",
    [
        ("qwen3_moe", 8),  # 8 tokens a step: the 9-token prefill is chunked, packed with decode tokens
        ("qwen3_moe", 64),  # every prompt in one packed prefill, then packed decode steps
        ("mixtral", 8),
        ("olmoe", 8),  # DEFAULT routing (no renormalisation)
        ("glm4_moe", 8),  # a dense first layer (layer ids shifted), grouped routing with bias
        ("gpt_oss", 8),  # biased router, its own experts layout
    ],
)
def test_generate_batch_traces_equal_generate(arch, max_batch_tokens):
    # DeepSeek-V3 is left out: transformers 5.17's paged cache cannot hold its MLA keys (generate_batch
    # fails in index_copy_ without replaymoe too). On the CPU the dense layers are not batch-invariant
    # (torch's GEMM rounds differently for 3 rows than for 12: hidden states differ by ~1e-7 between
    # packed and unpacked forwards); the ids agree bitwise because no routing margin is that thin here.
    torch.manual_seed(0)
    model = build_model(arch, "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True, backend="torch")
    _check_equal_to_generate(model, moe, _prompts(model.config.vocab_size), max_batch_tokens)
    moe.disable()


def test_eos_ends_a_request_and_its_trace():
    # a request that samples EOS stops there while the others go on: its trace ends before the EOS
    # token (never fed back), as generate's trace of that prompt alone does
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True)
    prompts = _prompts(model.config.vocab_size)
    # the first (request, step > 0) whose greedy token is new to its completion: EOS there
    i, j, eos = next((i, j, c[j]) for i, c in enumerate(_generate_alone(model, moe, p)[0] for p in prompts)
                     for j in range(1, NEW) if c[j] not in c[:j])  # fmt: skip
    gen, cfg = _configs(8, eos=eos)
    out = list(model.generate_batch(prompts, gen, cfg).values())
    paged = moe.traces()
    assert len(out[i].generated_tokens) == j + 1 and out[i].generated_tokens[-1] == eos
    assert paged[i].num_tokens == len(prompts[i]) + j
    assert paged[i] == _generate_alone(model, moe, prompts[i], eos=eos)[1]
    for prompt, result, trace in zip(prompts, out, paged):
        assert trace.token_ids.tolist() == (prompt + result.generated_tokens)[:-1]


def test_manager_api_traces_in_the_order_added():
    # the manager API: requests added with their own ids, in another order than the prompts'; traces()
    # after stop() has one trace per request, in the order added
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True)
    prompts = _prompts(model.config.vocab_size)
    gen, cfg = _configs(8)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    order = [2, 0, 3, 1]
    for i in order:
        manager.add_request(prompts[i], request_id=f"prompt{i}", max_new_tokens=NEW)
    done = {}
    while len(done) < len(order):
        result = manager.get_result(timeout=30)
        assert result is not None, "the generation loop stopped early"
        if result.is_finished():
            done[result.request_id] = result
    manager.stop(block=True, timeout=30)
    traces = moe.traces()
    assert len(traces) == len(order)
    for i, trace in zip(order, traces):
        assert trace.token_ids.tolist() == (prompts[i] + done[f"prompt{i}"].generated_tokens)[:-1]
        assert trace == _generate_alone(model, moe, prompts[i])[1]


def test_rollout_round_from_generate_batch_replays():
    # rollout mode: generate_batch is a round (replay paused inside, traces into the round), and a
    # training forward over the rows after it replays them, matched by content: 0 replayed mismatch
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    moe = replaymoe.hf.enable(model)
    moe.set_rollout_replay(True)
    moe.track_mismatch()
    prompts = _prompts(model.config.vocab_size)
    gen, cfg = _configs(8)
    out = list(model.generate_batch(prompts, gen, cfg).values())
    assert moe.traces() == []  # the round's traces are the session's, not the user's
    rows = [p + r.generated_tokens for p, r in zip(prompts, out)]
    assert [t.token_ids.tolist() for t in moe.rollout_traces()] == [r[:-1] for r in rows]
    with torch.no_grad():  # routers moved (an optimizer step): native routing now differs
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows[::-1]])  # right-padded, reordered
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows[::-1]])
    model(input_ids=ids, attention_mask=mask)
    stats = moe.mismatch()
    assert stats["tokens"] == len(moe.layers) * (int(mask.sum()) - len(rows))  # all but each row's last
    assert stats["replayed_vs_rollout"] == 0.0
    assert stats["native_vs_rollout"] > 0.0
    report = moe.report()
    assert report.fallback_fraction == pytest.approx(len(rows) / int(mask.sum()))  # each row's last token


@pytest.mark.parametrize(
    "mode",
    [
        "replay",  # replay matches whole sequences: a packed, chunked forward holds none
        "rollout_manager",  # a rollout round is one generate_batch call, not a manager's lifetime
        "num_return_sequences",  # forked children never compute their prompt
        "manager_made_before",  # a manager made without capture, capture turned on while it runs
        "weights",  # full recall: this path records ids only
        "rollout_weights",
    ],
)
def test_refused(mode):
    torch.manual_seed(4)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    gen, cfg = _configs(8)
    if mode == "manager_made_before":
        moe = replaymoe.hf.enable(model)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        manager.start()
        moe.set_capture(True)
        with pytest.raises(ValueError, match="made without capture"):
            manager.add_request([5, 6, 7], max_new_tokens=2)
        manager.stop(block=True, timeout=30)
        moe.disable()
        return
    moe = replaymoe.hf.enable(model, capture=mode == "num_return_sequences")
    if mode in ("weights", "rollout_weights"):
        if mode == "weights":
            moe.set_capture(True, weights=True)
        else:
            moe.set_rollout_replay(True, replay="ids+weights")
        with pytest.raises(ValueError, match="combine weights"):
            model.generate_batch(inputs=[[5, 6, 7]], generation_config=gen, continuous_batching_config=cfg)
    elif mode == "replay":
        moe.set_replay(
            replaymoe.RoutingTrace(
                np.zeros((3, len(moe.layers), 2), dtype=np.int16) + np.int16([0, 1]), num_experts=8, top_k=2
            )
        )
        with pytest.raises(ValueError, match="continuous batching"):
            model.generate_batch(inputs=[[5, 6, 7]], generation_config=gen, continuous_batching_config=cfg)
    elif mode == "rollout_manager":
        moe.set_rollout_replay(True)
        with pytest.raises(ValueError, match="generate_batch in rollout mode"):
            model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    else:
        gen.num_return_sequences = 2
        with pytest.raises(ValueError, match="num_return_sequences"):
            model.generate_batch(inputs=[[5, 6, 7]], generation_config=gen, continuous_batching_config=cfg)
    moe.disable()
    assert "init_continuous_batching" not in model.__dict__ and "generate_batch" not in model.__dict__


def test_capture_off_records_nothing():
    # the wrappers stay out of the way without capture: same completions as the unpatched model
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cpu", dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size)
    gen, cfg = _configs(8)
    native = [r.generated_tokens for r in model.generate_batch(prompts, gen, cfg).values()]
    moe = replaymoe.hf.enable(model)
    _, cfg = _configs(8)
    assert [r.generated_tokens for r in model.generate_batch(prompts, gen, cfg).values()] == native
    assert moe.traces() == []
    moe.disable()


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cb",
    [
        {},  # sync batching, eager forwards, on the manager's compute stream
        {"use_cuda_graph": True},  # the manager's CUDA graphs write the capture buffer at replay
        {"use_cuda_graph": True, "use_async_batching": True},  # next step prepared while this one runs
    ],
)
def test_generate_batch_traces_equal_generate_gpu(cb):
    # fp32 (Triton routing, experts on the torch reference): cuBLAS's fp32 GEMMs round differently
    # for different row counts by ~1e-7, far below any routing margin here (bf16 noise, ~4e-3, is not:
    # see the replay test below)
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", device="cuda", dtype=torch.float32)
    moe = replaymoe.hf.enable(model, capture=True, backend="triton")
    _check_equal_to_generate(model, moe, _prompts(model.config.vocab_size), 16, **cb)
    moe.disable()


@pytest.mark.gpu
def test_generate_batch_bf16_rollout_replays_gpu():
    # bf16, Triton routing and fused experts: a generate_batch round replays with 0 mismatch, and no
    # step's capture synchronises the host
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "medium", device="cuda", dtype=torch.bfloat16)
    moe = replaymoe.hf.enable(model, backend="triton")
    moe.set_rollout_replay(True)
    moe.track_mismatch()
    prompts = _prompts(model.config.vocab_size)
    gen, cfg = _configs(16)
    steps = []
    init = model.init_continuous_batching

    def init_checking_syncs(*args, **kwargs):  # the capturer's end_step under the sync debugger
        manager = init(*args, **kwargs)
        paged, create = manager._replaymoe_paged, manager._create_batch_processor

        def create_checked():
            bp = create()
            end_step = paged.capturer.end_step

            def checked(*a, **k):
                torch.cuda.set_sync_debug_mode("error")  # any host sync raises
                try:
                    return end_step(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    steps.append(1)

            paged.capturer.end_step = checked
            return bp

        manager._create_batch_processor = create_checked
        return manager

    model.init_continuous_batching = init_checking_syncs
    out = list(model.generate_batch(prompts, gen, cfg).values())
    model.init_continuous_batching = init
    assert steps
    rows = [p + r.generated_tokens for p, r in zip(prompts, out)]
    assert [t.token_ids.tolist() for t in moe.rollout_traces()] == [r[:-1] for r in rows]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device="cuda")
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device="cuda")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    stats = moe.mismatch()
    assert stats["tokens"] > 0 and stats["replayed_vs_rollout"] == 0.0
    moe.disable()

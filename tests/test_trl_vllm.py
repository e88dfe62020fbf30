"""R3 with vLLM generation: ``traces_from_vllm_outputs`` on both payload forms, and ``R3GRPOTrainer``
through TRL's own colocate-mode code (``VLLMGeneration``) driving an in-process stand-in engine
(``_vllm_standin``: no vLLM here), whose ``routed_experts`` are its own native routing."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from replaymoe.integrations.vllm_outputs import traces_from_vllm_outputs

E, L, K = 8, 2, 2


def _rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(n)]).astype(np.int32)


def _request(prompt, completion, rows, form, *, start=0):
    choice = SimpleNamespace(token_ids=completion, routed_experts=None)
    request = SimpleNamespace(prompt_token_ids=prompt, outputs=[choice])
    if form == "whole":
        choice.routed_experts = rows
    elif form == "split":
        request.prompt_routed_experts = rows[start : len(prompt)]
        request.routed_experts_prompt_start = start
        choice.routed_experts = rows[len(prompt) :]
    elif form == "completion_only":
        choice.routed_experts = rows[len(prompt) :]
    return request


@pytest.mark.parametrize(
    "form, start, rows_extra",
    [
        ("whole", 0, 0),  # vLLM's first design: one array over prompt + completion, N - 1 rows
        ("whole", 0, 1),  # an engine that also reports the last sampled token's row: trimmed
        ("split", 0, 0),  # prompt_routed_experts per request + the completion's rows per choice
        ("split", 2, 0),  # routed_experts_prompt_start: the skipped prefix is missing (native)
        ("completion_only", 0, 0),  # no prompt rows at all: the prompt positions are missing
    ],
)
def test_traces_from_vllm_outputs_cover_every_fed_position(form, start, rows_extra):
    prompt, completion = [5, 9, 11, 4], [7, 8, 2]
    n = len(prompt) + len(completion) - 1 + rows_extra
    rows = _rows(n)
    (trace,) = traces_from_vllm_outputs(
        [_request(prompt, completion, rows, form, start=start)], num_experts=E
    )
    assert trace.token_offset == 0 and trace.num_experts == E and trace.top_k == K
    assert trace.token_ids.tolist() == (prompt + completion)[:-1]
    missing = len(prompt) if form == "completion_only" else start
    assert trace.missing_mask()[:missing].all() and not trace.missing_mask()[missing:].any()
    np.testing.assert_array_equal(trace.ids[missing:], rows[missing : len(prompt) + len(completion) - 1])


def test_traces_follow_the_engine_order_and_keep_sentinel_rows_missing():
    rows = _rows(5, seed=1)
    rows[1, 0, 1] = -1  # vLLM's prefix-cache sentinel in one column: the whole [K] row is missing
    a = _request([4, 5, 6], [7, 2], rows, "whole")
    b = SimpleNamespace(prompt_token_ids=[9, 10], outputs=[])  # n=0 completions: nothing
    c = _request([4, 5], [8, 8, 2], _rows(4, seed=2), "split")
    c.prompt_token_ids = np.array(c.prompt_token_ids)  # arrays as well as lists
    traces = traces_from_vllm_outputs([a, b, c], num_experts=E, layer_ids=[1, 3], model_id="m")
    assert [t.token_ids.tolist() for t in traces] == [[4, 5, 6, 7], [4, 5, 8, 8]]
    assert traces[0].missing_mask()[:, 0].tolist() == [False, True, False, False]
    assert not traces[0].missing_mask()[:, 1].any()  # the other layer of that position is kept
    assert traces[0].layer_ids == (1, 3) and traces[1].model_id == "m"


@pytest.mark.parametrize(
    "request_, match",
    [
        (
            _request([4, 5], [6], None, "none"),
            r"routed_experts.*enable_return_routed_experts",
        ),  # engine without it
        (_request([4, 5], [6, 7], _rows(9), "whole"), r"routed_experts.*at most"),  # more rows than tokens
        (_request([4, 5, 6], [7], _rows(3)[:, :, :1].repeat(3, 0)[:1], "split"), "prompt_routed_experts"),
        (SimpleNamespace(prompt_token_ids=[], outputs=[]), "prompt_token_ids"),  # no prompt
        (
            SimpleNamespace(
                prompt_token_ids=[4],
                outputs=[SimpleNamespace(token_ids=[5], routed_experts=np.zeros((1, 2)))],
            ),
            r"integer array \[positions, layers, top_k\]",  # not [N, L, K]
        ),
    ],
)
def test_bad_engine_outputs_fail_clearly(request_, match):
    with pytest.raises(ValueError, match=match):
        traces_from_vllm_outputs([request_], num_experts=E)


# ---------------------------------------------------------------- the trainer through TRL's colocate path
trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

import trl.generation.vllm_generation as trl_vllm  # noqa: E402

from _trl_harness import make_trainer as _make_trainer  # noqa: E402
from _vllm_standin import SamplingParams, StandInLLM  # noqa: E402
from replaymoe.integrations.trl import R3GRPOTrainer  # noqa: E402
from test_trl_r3 import MovedRouters  # noqa: E402


@pytest.fixture
def standin_vllm(monkeypatch):
    """TRL's vllm_generation module sees the stand-in engine as vLLM; the environment TRL's colocate
    set-up writes (RANK, MASTER_PORT, ...) is restored afterwards."""
    env = dict(os.environ)
    StandInLLM.instances.clear()
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(trl_vllm, "LLM", StandInLLM, raising=False)
    monkeypatch.setattr(trl_vllm, "SamplingParams", SamplingParams, raising=False)
    yield StandInLLM
    os.environ.clear()
    os.environ.update(env)


def _vllm_trainer(tmp_path, trainer_cls=MovedRouters, **overrides):
    from _trl_harness import make_model

    model = make_model()
    path = tmp_path / "model"  # the engine loads the policy from its path, as vLLM does
    model.save_pretrained(path)
    model.config._name_or_path = model.name_or_path = str(path)
    config = {"use_vllm": True, "vllm_mode": "colocate", **overrides}
    return _make_trainer(trainer_cls, tmp_path, model=model, **config)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "form, overrides",
    [
        ("split", {}),  # vLLM's later payload; routers moved after scoring: native routing differs
        ("whole", {}),  # vLLM's first payload
        (
            "split",
            dict(gradient_checkpointing=True, gradient_accumulation_steps=2),
        ),  # recompute + shuffled halves
        ("split", dict(beta=0.1, max_steps=2)),  # a reference model replays the engine's routing too
    ],
)
def test_vllm_colocate_generation_replays_the_engines_routing(
    form, overrides, standin_vllm, tmp_path, monkeypatch
):
    monkeypatch.setattr(StandInLLM, "form", form)
    trainer = _vllm_trainer(tmp_path, **overrides)
    (engine,) = standin_vllm.instances
    assert engine.returns_routing  # the trainer started TRL's engine with enable_return_routed_experts=True
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert engine.generate_calls >= 1
    traces = trainer.r3_session.rollout_traces()
    assert len(traces) == trainer.args.generation_batch_size
    for trace in traces:  # each trace holds the experts the engine routed its positions to
        np.testing.assert_array_equal(trace.ids, engine.routes[tuple(trace.token_ids.tolist())])
    assert logs["r3/replayed_vs_rollout"] == 0.0  # and the loss forwards used exactly those
    assert logs["r3/native_vs_rollout"] > 0.0  # moved routers would have routed otherwise
    assert 0.0 < logs["r3/fallback"] < 0.5  # each row's last token only
    if trainer.args.beta:
        assert trainer.r3_reference.report() is not None


def test_vllm_engine_without_routing_fails_at_generation(standin_vllm, tmp_path, monkeypatch):
    # an engine that ignores enable_return_routed_experts (old vLLM): a clear error, no silent native replay
    original = StandInLLM.__init__

    def without_routing(self, *args, enable_return_routed_experts=False, **kwargs):
        original(self, *args, **kwargs)

    monkeypatch.setattr(StandInLLM, "__init__", without_routing)
    trainer = _vllm_trainer(tmp_path, trainer_cls=R3GRPOTrainer)
    with pytest.raises(ValueError, match=r"routed_experts.*enable_return_routed_experts"):
        trainer.train()


def test_vllm_server_mode_is_refused_before_any_engine(standin_vllm, tmp_path):
    with pytest.raises(ValueError, match=r"args.vllm_mode.*vllm-serve returns token ids"):
        _vllm_trainer(tmp_path, trainer_cls=R3GRPOTrainer, vllm_mode="server")
    assert not standin_vllm.instances

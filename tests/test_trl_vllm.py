"""R3 with vLLM generation: ``traces_from_vllm_outputs`` on vLLM 0.33's payload (one column per decoder
layer, dense layers zero, uint8/uint16, rows from the prompt start) and on the legacy MoE-only int32
layout, and ``R3GRPOTrainer`` through TRL's own colocate-mode code (``VLLMGeneration``) driving an
in-process stand-in engine (``_vllm_standin``: no vLLM here), whose ``routed_experts`` are its own
native routing, on a Qwen3-MoE and on a DeepSeek-V3 whose first layer is dense."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from replaymoe.integrations.vllm_outputs import moe_layer_ids, traces_from_vllm_outputs

E, K = 8, 2
NUM_LAYERS, MOE = 3, [1, 2]  # a DeepSeek-V3-like model: layer 0 dense (first_k_dense_replace=1)


def _rows(n: int, seed: int = 0, num_experts: int = E, layers: int = len(MOE)) -> np.ndarray:
    """[n, layers, K] int64: distinct experts per row (the MoE layers' routing)."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(num_experts, K, replace=False) for _ in range(layers)] for _ in range(n)])


def _payload(rows: np.ndarray, layout: str, start: int = 0, *, num_layers: int = NUM_LAYERS, moe=MOE):
    """What an engine puts in ``CompletionOutput.routed_experts`` for positions ``0 ..`` of ``rows``."""
    if layout == "legacy_moe_columns_int32":  # the first engines: MoE columns only, int32, from 0
        return rows.astype(np.int32)
    assert layout == "vllm_0_33"
    dtype = np.uint8 if rows.max() < 256 else np.uint16
    out = np.zeros((len(rows), num_layers, rows.shape[2]), dtype)  # every decoder layer; dense = 0
    out[:, moe] = rows
    return out[start:]


def _request(prompt, completion, routed_experts):
    choice = SimpleNamespace(token_ids=completion, routed_experts=routed_experts)
    return SimpleNamespace(prompt_token_ids=prompt, outputs=[choice])  # no routing field on the request


@pytest.mark.parametrize(
    "layout, start, num_experts",
    [
        ("vllm_0_33", 0, E),  # all-layer columns, dense layer 0 zero, uint8, from position 0
        ("vllm_0_33", 2, E),  # routed_experts_prompt_start=2: positions 0, 1 missing (native)
        ("vllm_0_33", 4, E),  # s = prompt_len: only the completion's fed positions
        ("vllm_0_33", 0, 300),  # E > 256: uint16
        ("legacy_moe_columns_int32", 0, E),  # the old layout: one column per MoE layer, int32
    ],
)
def test_traces_from_vllm_outputs_cover_every_fed_position(layout, start, num_experts):
    prompt, completion = [5, 9, 11, 4], [7, 8, 2]
    n = len(prompt) + len(completion) - 1  # the last sampled token was never fed
    rows = _rows(n, num_experts=num_experts)
    payload = _payload(rows, layout, start)
    assert len(payload) == n - start
    (trace,) = traces_from_vllm_outputs(
        [_request(prompt, completion, payload)], num_experts=num_experts, layer_ids=MOE, prompt_starts=start
    )
    assert trace.token_offset == 0 and trace.num_experts == num_experts and trace.top_k == K
    assert trace.layer_ids == tuple(MOE) and trace.num_layers == len(MOE)
    assert trace.token_ids.tolist() == (prompt + completion)[:-1]
    assert trace.missing_mask()[:start].all() and not trace.missing_mask()[start:].any()
    np.testing.assert_array_equal(trace.ids[start:], rows[start:])


def test_a_model_whose_every_layer_is_moe():
    # num_hidden_layers == number of MoE layers: both layouts coincide, nothing to drop
    prompt, completion = [3, 4], [5, 6]
    rows = _rows(3, layers=3)
    (trace,) = traces_from_vllm_outputs(
        [_request(prompt, completion, rows.astype(np.uint8))], num_experts=E, layer_ids=[0, 1, 2]
    )
    np.testing.assert_array_equal(trace.ids, rows)


def test_traces_follow_the_engine_order_with_a_prompt_start_per_request():
    a = _request([4, 5, 6], [7, 2], _payload(_rows(4, seed=1), "vllm_0_33", 1))
    b = SimpleNamespace(prompt_token_ids=[9, 10], outputs=[])  # n=0 completions: nothing
    c = _request(np.array([4, 5]), [8, 8, 2], _payload(_rows(4, seed=2), "vllm_0_33"))  # arrays too
    traces = traces_from_vllm_outputs(
        [a, b, c], num_experts=E, layer_ids=MOE, model_id="m", prompt_starts=[1, 0, 0]
    )
    assert [t.token_ids.tolist() for t in traces] == [[4, 5, 6, 7], [4, 5, 8, 8]]
    assert traces[0].missing_mask()[:, 0].tolist() == [True, False, False, False]
    assert not traces[1].missing_mask().any()
    assert traces[1].model_id == "m"


def test_legacy_sentinel_rows_stay_missing():
    rows = _rows(5, seed=1).astype(np.int32)
    rows[1, 0, 1] = -1  # an old engine's prefix-cache sentinel in one column: the whole [K] row is missing
    (trace,) = traces_from_vllm_outputs([_request([4, 5, 6], [7, 2, 3], rows)], num_experts=E, layer_ids=MOE)
    assert trace.missing_mask()[:, 0].tolist() == [False, True, False, False, False]
    assert not trace.missing_mask()[:, 1].any()  # the other layer of that position is kept


def _dense_nonzero():
    payload = _payload(_rows(4), "vllm_0_33")
    payload[2, 0] = [3, 5]  # the dense layer 0 holds ids: the layer numbers are wrong
    return _request([4, 5, 6], [7, 2], payload)


@pytest.mark.parametrize(
    "request_, kwargs, match",
    [
        (_request([4, 5], [6], None), {}, r"routed_experts.*enable_return_routed_experts"),  # engine without
        (  # one row more than P + C - 1: an engine that also routed the last sampled token
            _request([4, 5], [6, 7], _payload(_rows(4), "vllm_0_33")),
            {},
            r"outputs\[0\]\.outputs\[0\]\.routed_experts: 4 rows, expected 3",
        ),
        (  # rows from position 0, but the request asked for a prompt start of 2
            _request([4, 5, 6], [7, 2], _payload(_rows(4), "vllm_0_33")),
            dict(prompt_starts=2),
            r"4 rows, expected 2 .*routed_experts_prompt_start=0 gives 4 rows",
        ),
        (  # rows from 2, prompt start not passed: the hint names the start that fits
            _request([4, 5, 6], [7, 2], _payload(_rows(4), "vllm_0_33", 2)),
            {},
            r"2 rows, expected 4 .*routed_experts_prompt_start=2 gives 2 rows.*prompt_starts",
        ),
        (_dense_nonzero(), {}, r"layer column 0 is not in layer_ids \[1, 2\].*\[3, 5\] at row 2"),
        (  # a zero column and no layer_ids: never guessed
            _request([4, 5, 6], [7, 2], _payload(_rows(4), "vllm_0_33")),
            dict(layer_ids=None),
            r"layer column\(s\) 0 of 3 are all zero.*dense.*pass layer_ids",
        ),
        (  # layer numbers past the payload's columns
            _request([4, 5, 6], [7, 2], _payload(_rows(4), "vllm_0_33")),
            dict(layer_ids=[1, 2, 5, 7]),
            r"3 layer columns, but layer_ids \[1, 2, 5, 7\]",
        ),
        (  # a prompt start past the prompt
            _request([4, 5], [7, 2], _payload(_rows(3), "vllm_0_33")),
            dict(prompt_starts=3),
            r"prompt_starts\[0\].*at most the prompt's 2 tokens",
        ),
        (  # one start per request
            _request([4, 5], [7, 2], _payload(_rows(3), "vllm_0_33")),
            dict(prompt_starts=[0, 0]),
            r"prompt_starts.*1 entries",
        ),
        (SimpleNamespace(prompt_token_ids=[], outputs=[]), {}, "prompt_token_ids"),  # no prompt
        (
            _request([4], [5], np.zeros((1, 2))),
            {},
            r"integer array \[positions, layers, top_k\]",  # not [N, L, K]
        ),
    ],
)
def test_bad_engine_outputs_fail_clearly(request_, kwargs, match):
    kwargs = {"layer_ids": MOE, **kwargs}
    with pytest.raises(ValueError, match=match):
        traces_from_vllm_outputs([request_], num_experts=E, **kwargs)


@pytest.mark.parametrize(
    "bad_row, got",
    [
        ([0, 0], r"got \[0, 0\]"),  # an all-zero MoE row (routing never written): a repeated id 0
        ([3, 200], r"got 200 in \[3, 200\]"),  # an id past num_experts (E = 8)
        ([5, 5], r"got \[5, 5\]"),  # the same expert twice in one row
    ],
)
def test_bad_expert_ids_name_the_request_position_and_layers(bad_row, got):
    # three requests, request 2 with routed_experts_prompt_start=2: its payload row 4 is position 6;
    # the bad row is in MoE layer 1, model layer 2 (layer 0 is dense)
    starts = [0, 1, 2]
    outputs = [
        _request(
            list(range(4, 4 + p)), list(range(20, 20 + c)), _payload(_rows(p + c - 1, seed=r), "vllm_0_33", s)
        )
        for r, (p, c, s) in enumerate(zip([4, 5, 3], [3, 2, 6], starts))
    ]
    outputs[2].outputs[0].routed_experts[4, 2] = bad_row
    expected = "distinct expert ids in a row" if bad_row[0] == bad_row[1] else r"expert ids in \[0, 7\]"
    match = (
        rf"Invalid value of outputs\[2\]\.outputs\[0\]\.routed_experts: expected {expected}.*, "
        rf"{got} at position 6 \(row 4\), MoE layer 1 \(model layer 2\)$"
    )
    with pytest.raises(ValueError, match=match):
        traces_from_vllm_outputs(outputs, num_experts=E, layer_ids=MOE, prompt_starts=starts)


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("deepseek_v3", [1, 2]),  # first_k_dense_replace=1: layer 0 dense
        ("glm4_moe", [1, 2]),  # the same field on GLM4-MoE
        ("qwen3_moe", [0, 1, 2]),  # every layer MoE
    ],
)
def test_moe_layer_ids_from_a_config_and_a_model(arch, expected):
    pytest.importorskip("transformers")
    from replaymoe.hf.models import build_config, build_model

    assert moe_layer_ids(build_config(arch, "tiny")) == expected  # built on the meta device
    assert moe_layer_ids(build_model(arch, "tiny")) == expected
    with pytest.raises(ValueError, match="a transformers MoE model"):  # no MoE layer at all
        moe_layer_ids(build_config(arch, "tiny", **_dense_overrides(arch)))


def _dense_overrides(arch):
    """Config fields that leave the model without MoE layers."""
    if arch == "qwen3_moe":
        return dict(mlp_only_layers=[0, 1, 2])
    return dict(first_k_dense_replace=3)


_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {blocked!r} or name.startswith({blocked!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
try:
    import replaymoe.integrations.trl
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
"""


@pytest.mark.parametrize(
    "blocked, says",
    [
        ("trl", "needs trl, which is not installed: pip install 'replaymoe[trl]'"),  # no trl at all
        ("trl.generation", "needs trl >= 1.7.1 (trl.generation is missing"),  # a trl too old for it
    ],
)
def test_importing_the_trl_integration_without_trl_says_how_to_install_it(blocked, says):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK.format(blocked=blocked)], capture_output=True, text=True, timeout=300
    )
    name, message = proc.stdout.strip().splitlines()
    assert name == blocked  # the missing module's name is kept (the CLI's missing-extra handling reads it)
    assert says in message and "pip install 'replaymoe[trl]'" in message


# ---------------------------------------------------------------- the trainer through TRL's colocate path
trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

import trl.generation.vllm_generation as trl_vllm  # noqa: E402

from _trl_harness import make_trainer as _make_trainer  # noqa: E402
from _vllm_standin import SamplingParams, StandInLLM  # noqa: E402
from replaymoe.integrations.trl import R3Config, R3GRPOTrainer  # noqa: E402
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


def _vllm_trainer(tmp_path, trainer_cls=MovedRouters, arch="qwen3_moe", r3=None, **overrides):
    from replaymoe.hf.models import build_model

    model = build_model(arch, "tiny", seed=0)  # the harness's tiny model, or another architecture
    path = tmp_path / "model"  # the engine loads the policy from its path, as vLLM does
    model.save_pretrained(path)
    model.config._name_or_path = model.name_or_path = str(path)
    config = {"use_vllm": True, "vllm_mode": "colocate", **overrides}
    kwargs = {} if r3 is None else {"r3": r3}
    return _make_trainer(trainer_cls, tmp_path, model=model, trainer_kwargs=kwargs, **config)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "arch, form, overrides",
    [
        ("qwen3_moe", "vllm_0_33", {}),  # vLLM 0.33's payload; routers moved after scoring
        ("deepseek_v3", "vllm_0_33", {}),  # a dense first layer: its column is zero and dropped
        (  # a prompt start set through the sampling parameters: positions below it replay natively
            "deepseek_v3",
            "vllm_0_33",
            dict(generation_kwargs={"routed_experts_prompt_start": 1}, r3=R3Config(missing="native")),
        ),
        ("qwen3_moe", "legacy_moe_columns_int32", {}),  # the first engines' layout
        (
            "qwen3_moe",
            "vllm_0_33",
            dict(gradient_checkpointing=True, gradient_accumulation_steps=2),
        ),  # recompute + shuffled halves
        ("qwen3_moe", "vllm_0_33", dict(beta=0.1, max_steps=2)),  # a reference model replays it too
    ],
)
def test_vllm_colocate_generation_replays_the_engines_routing(
    arch, form, overrides, standin_vllm, tmp_path, monkeypatch
):
    monkeypatch.setattr(StandInLLM, "form", form)
    trainer = _vllm_trainer(tmp_path, arch=arch, **overrides)
    (engine,) = standin_vllm.instances
    assert engine.returns_routing  # the trainer started TRL's engine with enable_return_routed_experts=True
    assert engine.moe_layers == trainer.r3_session.layer_ids
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert engine.generate_calls >= 1
    start = (trainer.args.generation_kwargs or {}).get("routed_experts_prompt_start", 0)
    assert set(engine.starts) == {start}  # TRL passed it to the engine in its SamplingParams
    traces = trainer.r3_session.rollout_traces()
    assert len(traces) == trainer.args.generation_batch_size
    for trace in traces:  # each trace holds the experts the engine routed its positions to
        routes = engine.routes[tuple(trace.token_ids.tolist())]
        np.testing.assert_array_equal(trace.ids[start:], routes[start:])
        assert trace.missing_mask()[:start].all() and trace.layer_ids == tuple(engine.moe_layers)
    assert logs["r3/replayed_vs_rollout"] == 0.0  # and the loss forwards used exactly those
    assert logs["r3/native_vs_rollout"] > 0.0  # moved routers would have routed otherwise
    assert 0.0 < logs["r3/fallback"] < 0.5  # each row's last token (and positions below the start)
    if trainer.args.beta:
        assert trainer.r3_reference.report() is not None


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "call",
    [
        "positional_list",  # generate(prompts, [SamplingParams, ...]): one start per request
        "keyword_single",  # generate(prompts, sampling_params=SamplingParams(...)): one start for all
        "older_vllm",  # SamplingParams without the attribute (vLLM before it): 0
        "none",  # generate(prompts): vLLM's default sampling parameters, start 0
    ],
)
def test_watched_engine_reads_the_prompt_start_from_the_sampling_params(call, standin_vllm, tmp_path):
    trainer = _vllm_trainer(
        tmp_path, trainer_cls=R3GRPOTrainer, arch="deepseek_v3", r3=R3Config(missing="native")
    )
    (engine,) = standin_vllm.instances  # watched at construction
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    if call == "positional_list":
        starts = [2, 3]
        params = [SamplingParams(max_tokens=3, routed_experts_prompt_start=s) for s in starts]
        engine.generate(prompts, params)
    elif call == "keyword_single":
        starts = [1, 1]
        engine.generate(prompts, sampling_params=SamplingParams(max_tokens=3, routed_experts_prompt_start=1))
    elif call == "older_vllm":
        starts = [0, 0]
        engine.generate(prompts, sampling_params=SamplingParams(max_tokens=3))
    else:
        starts = [0, 0]
        engine.generate(prompts)
    assert engine.starts == starts
    traces = trainer.r3_session.rollout_traces()
    for trace, p in zip(traces, prompts, strict=True):
        assert trace.token_ids[: len(p["prompt_token_ids"])].tolist() == p["prompt_token_ids"]
    for trace, s in zip(traces, starts):
        assert trace.missing_mask()[:s].all() and not trace.missing_mask()[s:].any()


def test_prompt_start_without_native_fallback_is_refused_at_generation(standin_vllm, tmp_path):
    # R3Config(missing="error") (the default) cannot replay positions the engine did not route
    trainer = _vllm_trainer(
        tmp_path, trainer_cls=R3GRPOTrainer, generation_kwargs={"routed_experts_prompt_start": 1}
    )
    (engine,) = standin_vllm.instances
    with pytest.raises(
        ValueError, match=r"sampling_params.routed_experts_prompt_start.*missing='native'.*got 1"
    ):
        trainer.train()
    assert engine.generate_calls == 0  # refused before generating


def test_vllm_engine_without_routing_fails_at_generation(standin_vllm, tmp_path, monkeypatch):
    # an engine that ignores enable_return_routed_experts (old vLLM): a clear error, no silent native replay
    original = StandInLLM.__init__

    def without_routing(self, *args, enable_return_routed_experts=False, **kwargs):
        original(self, *args, **kwargs)

    monkeypatch.setattr(StandInLLM, "__init__", without_routing)
    trainer = _vllm_trainer(tmp_path, trainer_cls=R3GRPOTrainer)
    with pytest.raises(ValueError, match=r"routed_experts.*enable_return_routed_experts"):
        trainer.train()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(vllm_mode="server"), r"args.vllm_mode.*vllm-serve returns token ids"),  # no routing in replies
        (  # vLLM 0.33 keeps the routing buffer on the first TP rank only: not run, refused
            dict(vllm_tensor_parallel_size=2),
            r"args.vllm_tensor_parallel_size: expected 1 with R3.*first tensor-parallel rank.*got 2",
        ),
        (  # full recall needs the combine weights, which vLLM does not return
            dict(r3=R3Config(replay="ids+weights")),
            r"r3.replay: expected 'ids' with use_vllm=True.*return expert ids only",
        ),
    ],
)
def test_vllm_setups_without_routing_are_refused_before_any_engine(overrides, match, standin_vllm, tmp_path):
    with pytest.raises(ValueError, match=match):
        _vllm_trainer(tmp_path, trainer_cls=R3GRPOTrainer, **overrides)
    assert not standin_vllm.instances

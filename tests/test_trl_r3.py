"""``replaymoe.integrations.trl.R3GRPOTrainer`` on the tiny TRL harness (CPU): replay holds in every
training setup TRL runs (checkpointing in both modes, bf16 autocast, several iterations per
generation, gradient accumulation, a reference model), with routers moved between the rollout and the
loss so that native routing differs; checkpointed gradients equal uncheckpointed ones."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

from _trl_harness import (  # noqa: E402
    CONFIGS,
    make_dataset,
    params,
    train_logs,
    trainer_factory,  # noqa: E402
)
from replaymoe.integrations.trl import R3Config, R3GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class MovedRouters(R3GRPOTrainer):
    """R3GRPOTrainer whose routers move right after each rollout is scored (as several optimizer steps
    per generation would move them), so that the loss forward's native routing differs."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for info in self.r3_session.layers:
                w = info.router.weight
                w.add_(0.5 * torch.randn(w.shape, generator=g).to(w.dtype))
        return out


@pytest.fixture
def make_trainer(tmp_path):
    return trainer_factory(tmp_path, MovedRouters)


@pytest.mark.parametrize("name", list(CONFIGS))  # each setup's edge: see _trl_harness.CONFIGS
def test_replay_holds_in_every_setup(name, make_trainer):
    trainer = make_trainer(**CONFIGS[name])
    logs = train_logs(trainer)
    assert logs["r3/replayed_vs_rollout"] == 0.0  # every replayed lookup used the rollout's ids
    assert logs["r3/native_vs_rollout"] > 0.0  # the moved routers would have routed otherwise
    assert 0.0 < logs["r3/fallback"] < 0.5  # only each row's last (never fed back) token
    assert len(trainer.r3_session.rollout_traces()) == trainer.args.generation_batch_size
    if trainer.args.beta:
        assert trainer.r3_reference is not None and trainer.r3_reference.report() is not None


def test_evaluation_between_steps_keeps_the_training_round(make_trainer):
    # num_iterations=2: the second optimizer step reuses the buffered rollout; an evaluation in
    # between runs rollouts (rounds) of its own, and the training round must be the one replayed
    # after it (it was replaced: the step's forwards found no routes and raised)
    eval_set = make_dataset(["t40 t41", "t42 t43 t44"] * 2)
    evaluation = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    kwargs = {"eval_dataset": eval_set}
    trainer = make_trainer(num_iterations=2, max_steps=2, trainer_kwargs=kwargs, **evaluation)
    logs = train_logs(trainer)
    assert logs["step"] == 2 and logs["r3/replayed_vs_rollout"] == 0.0
    assert 0.0 < logs["r3/fallback"] < 0.5  # only each row's last token: the buffered round replayed
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_compiled_loss_forward_replays_its_own_round(make_trainer):
    # GRPOConfig(torch_compile=True): the loss forward runs compiled, which the round bookkeeping saw
    # only while tracing; each rollout must still be a round of its own (rounds grew and repeated
    # prompts replayed the first round's routes)
    trainer = make_trainer(torch_compile=True, torch_compile_backend="aot_eager", max_steps=3)
    logs = train_logs(trainer)
    assert len(trainer.r3_session.rollout_traces()) == trainer.args.generation_batch_size
    # the agreement metrics are counted in compiled forwards too (they used to be missing from the logs)
    assert logs["r3/replayed_vs_rollout"] == 0.0 and logs["r3/native_vs_rollout"] > 0.0


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpointed_gradients_equal_uncheckpointed(reentrant, make_trainer):
    # fp32: the weights after one step with checkpointing equal those without (the recompute routes as
    # the forward did); the aux loss is off because transformers records reentrant checkpoints' router
    # logits under no_grad (its gradient is dropped with or without replaymoe)
    plain = make_trainer(router_aux_loss_coef=0.0)
    train_logs(plain)
    ckpt = make_trainer(router_aux_loss_coef=0.0, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": reentrant})  # fmt: skip
    train_logs(ckpt)
    a, b = params(plain.model), params(ckpt.model)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointing"])
def test_continuous_batching_generation(gc, make_trainer):
    # TRL's generation through transformers' continuous batching (generate_batch, paged cache): each
    # request is captured (hf._paged) into the round, and the training forwards replay it by content.
    # Two steps: the second generation starts a new round. A small paged cache (the default is sized
    # to the host's memory); prefill chunked at 16 tokens a step.
    import trl

    if "use_transformers_continuous_batching" not in trl.GRPOConfig.__dataclass_fields__:
        pytest.skip(f"trl {trl.__version__} has no use_transformers_continuous_batching")
    cb = {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 16}
    trainer = make_trainer(use_transformers_continuous_batching=True, max_steps=2, gradient_checkpointing=gc,
                           transformers_continuous_batching_config=cb)  # fmt: skip
    logs = train_logs(trainer)
    assert logs["r3/replayed_vs_rollout"] == 0.0  # every replayed lookup used the rollout's ids
    assert logs["r3/native_vs_rollout"] > 0.0  # the moved routers would have routed otherwise
    assert 0.0 < logs["r3/fallback"] < 0.5  # only each row's last (never fed back) token
    traces = trainer.r3_session.rollout_traces()
    assert len(traces) == trainer.args.generation_batch_size
    assert all(t.token_ids is not None and t.missing_fraction() == 0.0 for t in traces)


def test_reference_model_native_on_request(make_trainer):
    trainer = make_trainer(beta=0.1, max_steps=1, trainer_kwargs={"r3": R3Config(replay_reference=False)})
    train_logs(trainer)
    assert trainer.r3_reference is not None and trainer.r3_reference.report() is None


def test_bad_settings_fail_clearly(make_trainer):
    with pytest.raises(ValueError, match="r3"):
        make_trainer(trainer_kwargs={"r3": {"replay_reference": False}})
    with pytest.raises(ValueError, match="backend"):
        R3Config(backend="cuda")
    with pytest.raises(ValueError, match=r"replay: expected one of"):
        R3Config(replay="weights")
    # full recall under continuous batching: refused when the trainer is built, not at generation
    with pytest.raises(ValueError, match=r"r3.replay: expected .ids. with use_transformers_continuous"):
        make_trainer(
            use_transformers_continuous_batching=True, trainer_kwargs={"r3": R3Config(replay="ids+weights")}
        )
    # compile_generate: transformers compiles generate's decoding steps with a static cache only
    with pytest.raises(ValueError, match=r"compile_generate: expected a bool"):
        R3Config(compile_generate=1)
    with pytest.raises(
        ValueError, match=r"r3.compile_generate: expected GRPOConfig\(cache_implementation='static'\)"
    ):
        make_trainer(trainer_kwargs={"r3": R3Config(compile_generate=True)})
    with pytest.raises(
        ValueError, match=r"r3.compile_generate: expected False with use_vllm=True or use_transformers"
    ):
        make_trainer(
            use_transformers_continuous_batching=True, trainer_kwargs={"r3": R3Config(compile_generate=True)}
        )


def test_compile_generate_turns_trl_s_disable_compile_off(make_trainer):
    # TRL builds its GenerationConfig with disable_compile=True; the option turns it off (transformers
    # compiles on CUDA only, so here the static-cache steps run as they are) and replay still holds
    kw = {**CONFIGS["static_cache"], "trainer_kwargs": {"r3": R3Config(compile_generate=True)}}
    trainer = make_trainer(**kw)
    assert trainer.generation_config.disable_compile is False
    assert make_trainer(**CONFIGS["static_cache"]).generation_config.disable_compile is True  # TRL's own
    logs = train_logs(trainer)
    assert logs["r3/replayed_vs_rollout"] == 0.0


def test_compiled_generate_captures_what_eager_generate_captures(make_trainer):
    # transformers compiles generate's decoding steps on CUDA only; told to compile on every device
    # (dynamo with its eager backend: the same ops, so the same bits on the CPU), the decode forward runs
    # as one dynamo graph with no break, and the rollout's traces equal the uncompiled run's bitwise
    import torch._dynamo.utils as dynamo_utils
    from transformers import CompileConfig

    traces = {}
    for compiled in (False, True):
        trainer = make_trainer(
            **{**CONFIGS["static_cache"], "max_steps": 1},
            trainer_kwargs={"r3": R3Config(compile_generate=compiled)} if compiled else None,
        )
        if compiled:
            config = CompileConfig(backend="eager", mode=None)
            config._compile_all_devices = True
            trainer.generation_config.compile_config = config
            torch._dynamo.reset()
            dynamo_utils.counters.clear()
        logs = train_logs(trainer)
        assert logs["r3/replayed_vs_rollout"] == 0.0
        traces[compiled] = trainer.r3_session.rollout_traces()
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1 and not dynamo_utils.counters["graph_break"]
    assert len(traces[True]) == len(traces[False]) > 0
    for a, b in zip(traces[False], traces[True]):
        assert a == b


# every setup on a static cache, but bf16: autocast over fp32 weights writes bf16 keys into an fp32 static
# cache, which stock GRPOTrainer fails on the same way (transformers' StaticCache.update)
@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in ("bf16", "static_cache")])
def test_compiled_generate_in_every_setup(name, make_trainer):
    # checkpointing, several iterations, accumulation, a reference model: generate's decoding steps
    # compile into dynamo graphs with no break, and the training forwards replay the rollout
    import torch._dynamo.utils as dynamo_utils
    from transformers import CompileConfig

    trainer = make_trainer(
        **{**CONFIGS[name], "cache_implementation": "static"},
        trainer_kwargs={"r3": R3Config(compile_generate=True)},
    )
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only
    trainer.generation_config.compile_config = config
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    logs = train_logs(trainer)
    assert logs["r3/replayed_vs_rollout"] == 0.0 and logs["r3/native_vs_rollout"] > 0.0
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1 and not dynamo_utils.counters["graph_break"]


def test_demo_trl_prints_the_mismatch_table():
    # `replaymoe demo --trl`: R3 GRPO steps with checkpointing; the second pass over each generation
    # sees moved routers (native differs), the replayed routing never does; exit 0
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "replaymoe", "demo", "--trl", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4
    assert all(float(r[3]) == 0.0 for r in rows)  # replayed_vs_rollout
    assert any(float(r[2]) > 0.0 for r in rows)  # native_vs_rollout

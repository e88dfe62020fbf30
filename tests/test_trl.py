"""TRL integration groundwork (CPU): ``trl.GRPOTrainer`` on a tiny Qwen3-MoE, stock and through replaymoe.

The harness (tiny model, in-memory tokenizer and dataset, reward, tiny ``GRPOConfig``) lives in
``tests/_trl_harness.py``; the ``make_trainer`` fixture here builds a trainer of any
``GRPOTrainer`` subclass on it, each in its own output directory, with ``GRPOConfig`` overrides::

    def test_something(make_trainer):
        trainer = make_trainer(R3GRPOTrainer, gradient_checkpointing=True, beta=0.1)
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

import trl  # noqa: E402

import replaymoe.hf as rhf  # noqa: E402
from _trl_harness import (  # noqa: E402
    make_model,
    params,
    train_logs,
    trainer_factory,  # noqa: E402
)
from replaymoe.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (conftest)

# metrics that depend on the model's forwards (and so must agree between stock and replaymoe runs)
MODEL_METRICS = ("loss", "grad_norm", "entropy", "aux_loss")


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(trainer_cls=trl.GRPOTrainer, *, model=None, reward=None, trainer_kwargs=None,
    **config_overrides)``: a trainer on the tiny harness, in a fresh ``tmp_path`` subdirectory."""
    return trainer_factory(tmp_path)


def test_grpo_trains_one_step(make_trainer):
    trainer = make_trainer(trl.GRPOTrainer)
    assert type(trainer) is trl.GRPOTrainer
    assert trainer.ref_model is None  # beta = 0
    assert trainer.aux_loss_enabled  # Qwen3-MoE declares router_aux_loss_coef = 0.001
    before = params(trainer.model)
    logs = train_logs(trainer)

    assert trainer.state.global_step == 1
    for name in MODEL_METRICS:
        assert math.isfinite(logs[name]), (name, logs)
    assert logs["grad_norm"] > 0
    assert "rewards/CountLowTokens/mean" in logs

    # one generation batch: per_device_train_batch_size rows (2 prompts x num_generations=2)
    (completions,) = trainer.reward_funcs[0].calls
    assert len(completions) == 4
    assert all(1 <= len(c) <= 6 for c in completions)

    after = params(trainer.model)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert any(".mlp.gate." in n for n in moved), "the routers got no update"
    assert any(".mlp.experts." in n for n in moved), "the experts got no update"


def test_enable_matches_stock(make_trainer):
    """``replaymoe.hf.enable`` (routers and experts through replaymoe's torch references on CPU) trains
    the same step as stock transformers: same completions (same seed), same loss, gradients and
    updated weights up to fp32 summation order."""
    stock = make_trainer(trl.GRPOTrainer)
    stock_logs = train_logs(stock)
    stock_after = params(stock.model)

    model = make_model()
    trainer = make_trainer(trl.GRPOTrainer, model=model)
    moe = rhf.enable(trainer.model)
    assert len(moe.layers) == model.config.num_hidden_layers
    assert model.config._experts_implementation == rhf.IMPLEMENTATION_NAME
    try:
        logs = train_logs(trainer)
    finally:
        moe.disable()

    assert trainer.reward_funcs[0].calls == stock.reward_funcs[0].calls  # same sampled completions
    for name in MODEL_METRICS:
        assert logs[name] == pytest.approx(stock_logs[name], rel=1e-4, abs=1e-5), name
    after = params(model)
    assert after.keys() == stock_after.keys()
    for name in after:
        assert_close(after[name], stock_after[name], atol=1e-6, rtol=1e-5, name=name)

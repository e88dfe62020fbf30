"""A tiny, download-free TRL GRPO setup for CPU tests (imported by ``tests/test_trl*.py``).

Everything is built in memory: a tiny Qwen3-MoE from :func:`replaymoe.hf.models.build_model`, a
word-level tokenizer whose vocabulary matches the model's ``vocab_size``, a plain-text prompt
dataset (no chat template) and a reward function that counts "low" tokens and records what it saw.

:func:`make_trainer` builds a trainer of any ``GRPOTrainer`` subclass with tiny settings that
config overrides can change (``gradient_checkpointing``, ``num_iterations``,
``gradient_accumulation_steps``, ``beta``, ``bf16``, ...). With ``beta != 0`` TRL builds its
reference model with ``from_pretrained(model.config._name_or_path)``, so the policy is saved to
``tmp_path / "model"`` first and its ``_name_or_path`` pointed there (TRL's reference is then a
separate copy, loaded from disk, that nothing patched).

Call with trl importable only (the test modules ``pytest.importorskip("trl")`` first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ARCH = "qwen3_moe"
SIZE = "tiny"
SEED = 0

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"  # ids 0, 1, 2, 3 (as the tiny configs say)

# tokens t4 .. t{vocab-1}; prompts of different lengths so generation left-pads
PROMPTS = [
    "t4 t9 t17",
    "t33 t5",
    "t60 t12 t41 t8 t22",
    "t7",
    "t50 t51 t52 t53",
    "t10 t20",
    "t30 t31 t32",
    "t44 t45 t46 t47 t48 t49",
]

# the defaults every trainer here gets (overridable): small, fast, deterministic, nothing written
BASE_CONFIG: dict[str, Any] = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    max_steps=1,
    optim="sgd",  # update = -lr * clipped grad: runs compare weights without Adam's 1/|g| amplification
    learning_rate=1e-2,
    beta=0.0,
    bf16=False,
    fp16=False,
    use_cpu=True,
    gradient_checkpointing=False,  # GRPOConfig's default is True; tests opt in
    report_to=[],
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=SEED,
    data_seed=SEED,
)

# named GRPOConfig overrides for the training setups R3 must survive (``pytest.mark.parametrize``
# over ``CONFIGS.items()``; each trains in well under a second once the process is warm). Notes:
# * reentrant checkpointing drops the load-balancing aux loss's gradient in stock transformers
#   (the router logits are recorded inside a no-grad reentrant forward), so its grad_norm differs
#   from the other modes unless router_aux_loss_coef=0.0; compare like with like;
# * num_iterations=2 needs max_steps=2 to reach the second pass over the buffered batch, and makes
#   TRL compute old_per_token_logps (gradient_accumulation_steps % (steps_per_generation *
#   num_iterations) != 0);
# * gradient_accumulation_steps=2 makes steps_per_generation=2: one generate of 8 rows, two
#   shuffled micro-batches of 4;
# * bf16=True on CPU: the scoring forwards run under accelerate's bf16 autocast, fp32 weights;
#   generation does not autocast.
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "gc_reentrant": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
    "gc_nonreentrant": dict(
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    ),
    "iterations2": dict(num_iterations=2, max_steps=2),
    "accumulation2": dict(gradient_accumulation_steps=2),
    "beta": dict(beta=0.1, max_steps=2),  # kl is 0 at step 1 (policy == reference); step 2 has a real one
    "bf16": dict(bf16=True),
    # generation on a static KV cache (TRL's fast setting; the cache enable() keeps between calls)
    "static_cache": dict(cache_implementation="static", max_steps=2),
}


def make_tokenizer(vocab_size: int):
    """A word-level ``PreTrainedTokenizerFast`` (whitespace split): ``<pad> <bos> <eos> <unk> t4 ...``."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    vocab.update({f"t{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word-level tokens with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def make_dataset(prompts: list[str] = PROMPTS):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(prompts)})


def make_model(*, dtype: torch.dtype = torch.float32, **overrides: Any):
    """The tiny Qwen3-MoE (seeded, eval mode; the trainer puts it in train mode)."""
    from replaymoe.hf.models import build_model

    return build_model(ARCH, SIZE, seed=SEED, device="cpu", dtype=dtype, **overrides)


@dataclass
class CountLowTokens:
    """Reward = number of completion tokens with an id below ``threshold`` (half the vocab), so the
    rewards within a group differ and the advantages are non-zero. Records every call's
    ``completion_ids`` (lists of ints, batch order) in ``calls``. TRL names its metrics after the
    class: ``rewards/CountLowTokens/mean``."""

    threshold: int = 32
    calls: list[list[list[int]]] = field(default_factory=list)
    __name__ = "CountLowTokens"  # trl < 1.9 names a reward function's metrics by its __name__

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        self.calls.append([list(c) for c in completion_ids])
        return [float(sum(t < self.threshold for t in c)) for c in completion_ids]


def make_config(tmp_path, **overrides: Any):
    from trl import GRPOConfig

    kw = {**BASE_CONFIG, **overrides}
    return GRPOConfig(output_dir=str(tmp_path), **kw)


def make_trainer(
    trainer_cls=None, tmp_path=None, *, model=None, reward=None, trainer_kwargs=None, **overrides
):
    """A ``trainer_cls`` (default ``trl.GRPOTrainer``) on the tiny model, tokenizer, dataset and reward.

    ``overrides`` go to ``GRPOConfig``; ``trainer_kwargs`` to the trainer. ``model`` defaults to a
    fresh :func:`make_model`; ``reward`` to a fresh :class:`CountLowTokens` (the trainer keeps it in
    ``trainer.reward_funcs[0]``). With ``beta != 0`` the model is saved under ``tmp_path / "model"``
    so that TRL can load its reference copy.
    """
    import trl

    if trainer_cls is None:
        trainer_cls = trl.GRPOTrainer
    if tmp_path is None:
        raise TypeError("make_trainer needs tmp_path (the trainer's output_dir)")
    model = make_model() if model is None else model
    reward = CountLowTokens() if reward is None else reward
    args = make_config(tmp_path, **overrides)
    if args.beta != 0.0:
        path = tmp_path / "model"
        model.save_pretrained(path)
        model.config._name_or_path = str(path)
    tokenizer = make_tokenizer(model.config.vocab_size)
    return trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        **(trainer_kwargs or {}),
    )


def train_logs(trainer) -> dict[str, float]:
    """Train and return the merged per-step logs of the last step (``loss``, ``grad_norm``,
    ``entropy``, ``reward``, ``aux_loss``, ...), without the run summary."""
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs, trainer.state.log_history
    return logs[-1]


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_factory(tmp_path, default_cls=None):
    """``make(trainer_cls=default_cls, **kwargs)``: :func:`make_trainer` in a fresh ``tmp_path``
    subdirectory per call (what the test modules' ``make_trainer`` fixtures return)."""
    import itertools

    counter = itertools.count()

    def make(trainer_cls=None, **kwargs):
        out = tmp_path / f"run{next(counter)}"
        out.mkdir()
        return make_trainer(trainer_cls or default_cls, out, **kwargs)

    return make

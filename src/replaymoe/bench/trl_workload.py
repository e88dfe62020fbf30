"""The GRPO workload of ``replaymoe bench trl`` (and of ``replaymoe demo --trl`` and the README's TRL
example): download-free, built in memory.

Everything is built in memory: a word-level tokenizer whose vocabulary matches the model's
``vocab_size`` (``<pad> <bos> <eos> <unk> t4 t5 ...``), plain-text prompts of different lengths (so
generation left-pads) and a reward that counts "low" tokens (so a group's rewards differ and the
advantages are non-zero). The model is one of :func:`replaymoe.hf.models.build_model`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CountLowTokens", "make_dataset", "make_tokenizer", "make_trainer"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"  # ids 0, 1, 2, 3 (as build_model's configs say)


def make_tokenizer(vocab_size: int):
    """A word-level ``PreTrainedTokenizerFast`` (whitespace split), left padding."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    vocab.update({f"t{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def make_dataset(num_prompts: int, vocab_size: int, *, seed: int = 0, max_len: int = 6):
    """``num_prompts`` prompts of 1..``max_len`` random tokens (a ``datasets.Dataset``, column "prompt")."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [
        " ".join(f"t{rng.randrange(4, vocab_size)}" for _ in range(rng.randint(1, max_len)))
        for _ in range(num_prompts)
    ]
    return Dataset.from_dict({"prompt": prompts})


@dataclass
class CountLowTokens:
    """Reward: completion tokens with an id below ``threshold``. TRL names its metrics after the class."""

    threshold: int = 32
    calls: int = field(default=0)
    __name__ = "CountLowTokens"  # trl < 1.9 names a reward function's metrics by its __name__

    def __call__(self, prompts: Any, completions: Any, completion_ids: Any, **kwargs: Any) -> list[float]:
        self.calls += 1
        return [float(sum(t < self.threshold for t in c)) for c in completion_ids]


def make_trainer(trainer_cls: Any, model: Any, output_dir: str, *, trainer_kwargs: Any = None, **config: Any):
    """``trainer_cls`` (``trl.GRPOTrainer`` or a subclass) on ``model`` with the toy tokenizer, data and
    reward; ``config`` overrides the ``GRPOConfig`` defaults here (small, deterministic, nothing saved)."""
    from trl import GRPOConfig

    vocab = model.config.vocab_size
    batch = config.get("per_device_train_batch_size", 4)
    defaults: dict[str, Any] = dict(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        optim="sgd",
        beta=0.0,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
        gradient_checkpointing=False,
    )
    args = GRPOConfig(output_dir=output_dir, **{**defaults, **config})
    return trainer_cls(
        model=model,
        reward_funcs=CountLowTokens(threshold=vocab // 2),
        args=args,
        train_dataset=make_dataset(max(8, 4 * batch), vocab),
        processing_class=make_tokenizer(vocab),
        **(trainer_kwargs or {}),
    )

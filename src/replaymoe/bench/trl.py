"""``replaymoe bench trl``: one TRL GRPO training step, stock against replaymoe and R3, on the GPU.

Three trainers on the same :func:`replaymoe.hf.models.build_model` model (bf16, ``--size``), the
same in-memory prompts, tokenizer and reward (:mod:`replaymoe.integrations.trl_toy`) and the same
``GRPOConfig`` (one generation and one optimizer step per training step: generation, scoring,
loss forward and backward, AdamW):

* ``grouped_mm``  ``trl.GRPOTrainer`` with transformers' ``grouped_mm`` experts (stock);
* ``replaymoe``   ``trl.GRPOTrainer`` after :func:`replaymoe.hf.enable` (fused routing and experts,
  no capture, no replay);
* ``r3``          :class:`replaymoe.integrations.trl.R3GRPOTrainer` (capture in generate, replay in
  every scoring and loss forward and their recomputes, mismatch counters on).

Each trainer runs ``--warmup`` untimed steps then ``--steps`` timed ones; the figure is the median of
TRL's own ``step_time`` metric. ``r3_overhead`` is r3 over replaymoe minus 1 (the goal: <= 5 %),
``speedup_vs_stock`` grouped_mm over each. Needs CUDA and the ``trl`` extra.

Usage: ``replaymoe bench trl [--out DIR] [--arch qwen3_moe] [--size bench] [--batch 16]
[--generations 4] [--completion 64] [--steps 5] [--warmup 2] [--checkpointing]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile

import torch

from ._text import choice_list
from ._timing import print_table, write_results

IMPLS = ("grouped_mm", "replaymoe", "r3")


def _step_times(impl: str, a: argparse.Namespace) -> list[float]:
    import trl
    from transformers.trainer_callback import PrinterCallback

    from replaymoe.hf import enable
    from replaymoe.hf.models import build_model
    from replaymoe.integrations.trl import R3GRPOTrainer
    from replaymoe.integrations.trl_toy import make_trainer

    model = build_model(a.arch, a.size, device=a.device, dtype=torch.bfloat16)
    if impl == "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    cls = R3GRPOTrainer if impl == "r3" else trl.GRPOTrainer
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(
            cls,
            model,
            out,
            max_steps=a.warmup + a.steps,
            per_device_train_batch_size=a.batch,
            num_generations=a.generations,
            max_completion_length=a.completion,
            optim="adamw_torch",
            learning_rate=1e-6,
            bf16=True,
            gradient_checkpointing=a.checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=a.device == "cpu",
        )
        trainer.remove_callback(PrinterCallback)
        moe = enable(trainer.model) if impl == "replaymoe" else None
        trainer.train()
    if moe is not None:
        moe.disable()
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times[a.warmup :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench trl", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory for trl.csv / trl.json")
    p.add_argument("--arch", default="qwen3_moe", help="model architecture (replaymoe.hf.models)")
    p.add_argument("--size", default="bench", help="model size (replaymoe.hf.models.SIZES; default bench)")
    p.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (rows per step)")
    p.add_argument("--generations", type=int, default=4, help="num_generations (completions per prompt)")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--steps", type=int, default=5, help="timed steps per trainer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (cpu: a smoke run only)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("replaymoe bench trl needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = choice_list(p, a.impls, IMPLS, "impls")
    rows: list[dict] = []
    med: dict[str, float] = {}
    for impl in impls:
        times = _step_times(impl, a)
        med[impl] = statistics.median(times) if times else float("nan")
        rows.append({"impl": impl, "step_s": med[impl], "steps": len(times), "min_s": min(times, default=0.0),
                     "checkpointing": a.checkpointing,
                     "card": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"})  # fmt: skip
    for row in rows:
        if "grouped_mm" in med:
            row["speedup_vs_stock"] = med["grouped_mm"] / row["step_s"]
        if row["impl"] == "r3" and "replaymoe" in med:
            row["r3_overhead"] = row["step_s"] / med["replaymoe"] - 1
    write_results(rows, a.out, "trl")
    print_table(
        rows, ["impl", "step_s", "min_s", "steps", "speedup_vs_stock", "r3_overhead", "checkpointing"]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``replaymoe demo --trl``: GRPO steps of TRL with rollout routing replay, and the mismatch table.

A tiny Qwen3-MoE (random weights, no download) trains with
:class:`replaymoe.integrations.trl.R3GRPOTrainer` for a few steps, two optimizer steps per
generation (``num_iterations=2``) with gradient checkpointing on, so that the routers move between
the rollout and the loss forwards. Each step prints how often the native routing now differs from
the rollout's (``native_vs_rollout``), how often the replayed routing does (``replayed_vs_rollout``:
must be 0) and the lookups routed natively (each row's last token). Exit 1 if replay ever disagreed.
"""

from __future__ import annotations

import sys
import tempfile

import torch

__all__ = ["run_trl"]


def run_trl(*, device: str, seed: int, steps: int = 4, quiet: bool = False) -> int:
    """Train ``steps`` GRPO steps with R3 and print the table; returns the exit code (0 or 1)."""
    from replaymoe.bench.trl_workload import make_trainer
    from replaymoe.hf.models import build_model
    from replaymoe.integrations.trl import R3GRPOTrainer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model("qwen3_moe", "demo", seed=seed, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(
            R3GRPOTrainer,
            model,
            out,
            max_steps=steps,
            num_iterations=2,
            learning_rate=0.05,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=device == "cpu",
            seed=seed,
            bf16=device == "cuda",
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the table below says it once
        trainer.train()
    rows = [h for h in trainer.state.log_history if "r3/replayed_vs_rollout" in h]
    print("R3 with TRL GRPO (tiny Qwen3-MoE, 2 optimizer steps per generation, gradient checkpointing)")
    print(
        f"{'step':>4}  {'loss':>9}  {'native_vs_rollout':>17}  {'replayed_vs_rollout':>19}  {'fallback':>8}"
    )
    for h in rows:
        print(
            f"{h['step']:>4}  {h['loss']:>9.4f}  {h['r3/native_vs_rollout']:>17.4f}  "
            f"{h['r3/replayed_vs_rollout']:>19.4f}  {h.get('r3/fallback', float('nan')):>8.4f}"
        )
    bad = [h["step"] for h in rows if h["r3/replayed_vs_rollout"] != 0.0]
    if not rows or bad:
        print(
            f"replaymoe demo --trl: replayed routing differed from the rollout's at steps {bad}",
            file=sys.stderr,
        )
        return 1
    return 0

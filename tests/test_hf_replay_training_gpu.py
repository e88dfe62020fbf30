"""Rollout routing replay in training on the GPU (bf16, Triton kernels, decode CUDA graphs): the
checkpoint recompute routes as its forward, rows match by content, rollout mode through a captured
generate with CUDA-graph decode steps, and TRL's R3 trainer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu


def _rollout(rows=4, prompt_len=6, new=10, size="demo"):
    torch.manual_seed(0)
    model = build_model("qwen3_moe", size, device="cuda", dtype=torch.bfloat16)
    moe = replaymoe.hf.enable(model)
    moe.set_rollout_replay(True)
    moe.track_mismatch()
    prompt = torch.randint(3, model.config.vocab_size, (rows, prompt_len), device="cuda")
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    with torch.no_grad():
        seqs = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=True)  # fmt: skip
    full = torch.cat([mask, torch.ones(rows, new, dtype=mask.dtype, device="cuda")], 1)
    with torch.no_grad():
        for info in moe.layers:
            info.router.weight.add_(0.5 * torch.randn_like(info.router.weight))
    model.train()
    return model, moe, seqs, full


def _grads(model, moe, seqs, mask, rows_list):
    for rows in rows_list:
        logits = model(input_ids=seqs[rows], attention_mask=mask[rows]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs[rows][:, 1:, None])
        (-(logp.squeeze(-1) * mask[rows][:, 1:]).sum() / mask[rows].sum()).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_gpu_checkpoint_and_shuffled_micro_batches_replay_the_rollout(reentrant):
    # the rollout ran CUDA-graph decode steps with capture; the trainer's shuffled micro-batches with
    # checkpointing give the gradients of the uncheckpointed run, and replay never disagreed
    model, moe, seqs, mask = _rollout()
    assert len(moe.rollout_traces()) == 4
    ref = _grads(model, moe, seqs, mask, [[2, 0], [3, 1]])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    got = _grads(model, moe, seqs, mask, [[2, 0], [3, 1]])
    for name in ref:  # (attention's backward may reduce in another order: not bitwise)
        scale = float(ref[name].abs().max())
        torch.testing.assert_close(got[name], ref[name], rtol=2e-2, atol=2e-2 * scale, msg=name)
    stats = moe.mismatch()
    assert stats["replayed_vs_rollout"] == 0.0 and stats["native_vs_rollout"] > 0.0


def test_gpu_trl_r3_step():
    pytest.importorskip("trl")
    from replaymoe.bench.trl_workload import make_trainer
    from replaymoe.integrations.trl import R3GRPOTrainer

    model = build_model("qwen3_moe", "demo", device="cuda", dtype=torch.bfloat16)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(R3GRPOTrainer, model, out, max_steps=4, num_iterations=2, bf16=True,
                               learning_rate=0.05, gradient_checkpointing=True,
                               gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
        trainer.train()
    rows = [h for h in trainer.state.log_history if "r3/replayed_vs_rollout" in h]
    assert rows and all(h["r3/replayed_vs_rollout"] == 0.0 for h in rows)

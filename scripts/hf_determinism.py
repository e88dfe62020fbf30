"""Run-to-run determinism of an eager forward of the bench model, module by module (GPU diagnostic).

Two forwards of the same batch; forward hooks keep every module's output; prints the first modules
(in call order) whose outputs differ between the two runs, and the fused-MoE kernels alone run
twice at a few token counts.

Usage: PYTHONPATH=src python3 scripts/hf_determinism.py [--batch 32] [--prompt 128] [--impl replaymoe]
"""

import argparse

import torch

import replaymoe.hf as rhf
from replaymoe.hf.models import build_model
from replaymoe.moe import fused_moe
from replaymoe.routing import route

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=32)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--impl", default="replaymoe", choices=["replaymoe", "grouped_mm"])
a = p.parse_args()

torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.set_experts_implementation("grouped_mm")
if a.impl == "replaymoe":
    try:
        rhf.enable(model, graphs=False)
    except TypeError:  # a tree from before block graphs
        rhf.enable(model)
ids = torch.randint(3, model.config.vocab_size, (a.batch, a.prompt), device="cuda")


def run():
    outs = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out, n=n: outs.append((n, out)))
        for n, m in model.named_modules()
        if n
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return [(n, o[0] if isinstance(o, tuple) else o) for n, o in outs if isinstance(o, (torch.Tensor, tuple))]


r1, r2 = run(), run()
bad = [n for (n, x), (_, y) in zip(r1, r2) if isinstance(x, torch.Tensor) and not torch.equal(x, y)]
print(
    f"{a.impl} B={a.batch}x{a.prompt}: {len(bad)} of {len(r1)} module outputs differ run to run; "
    f"first: {bad[:6]}"
)

blk = model.model.layers[0].mlp
H = model.config.hidden_size
for T in (32, 1024, 4096):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, blk.experts.gate_up_proj.shape[0], device="cuda")
    r = route(logits, top_k=8)
    o = [
        fused_moe(
            x,
            blk.experts.gate_up_proj,
            blk.experts.down_proj,
            topk_ids=r.topk_ids,
            topk_weights=r.topk_weights,
        )
        for _ in range(3)
    ]
    r_again = route(logits, top_k=8)
    print(
        f"  T={T}: fused_moe outputs equal run to run: {all(torch.equal(o[0], oi) for oi in o[1:])}; "
        f"route equal: {torch.equal(r.topk_ids, r_again.topk_ids)}"
    )

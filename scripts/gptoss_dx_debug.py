"""Which gpt-oss option breaks dx on the GPU (diagnostic): layout x weight storage x recompute."""

import sys

import torch

sys.path.insert(0, "tests")
from replaymoe.moe import ClampedSwiGLU, fused_moe  # noqa: E402
from test_moe_gptoss import _grid_gptoss  # noqa: E402

T, H, I, E, K = int(sys.argv[1]) if len(sys.argv) > 1 else 256, 256, 128, 8, 2  # noqa: E741
g = torch.Generator().manual_seed(0)
x, gu, gub, dn, dnb, ids, wts = _grid_gptoss(T, H, I, E, K, g, torch.bfloat16)
dout = torch.randn(T, H, generator=g)
x, gu, gub, dn, dnb, ids, wts, dout = (t.cuda() for t in (x, gu, gub, dn, dnb, ids, wts, dout))
w13_il = gu.transpose(1, 2)  # [E, 2I, H] interleaved view
perm = torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)]).cuda()
w13_h = w13_il[:, perm]  # halves, contiguous
b13_h = gub[:, perm]


def run(w13, b13, layout, act, bias, backend, dtype, recompute):
    xl = x.detach().to(dtype).requires_grad_()
    w1 = w13.detach().to(dtype).requires_grad_()
    w2 = dn.transpose(1, 2).detach().to(dtype).requires_grad_()
    kw = dict(topk_ids=ids, topk_weights=wts.float(), gate_up_layout=layout, activation=act)
    if bias:
        kw.update(w13_bias=b13.to(dtype), w2_bias=dnb.to(dtype))
    out = fused_moe(xl, w1, w2, backend=backend, recompute=recompute, **kw)
    out.backward(dout.to(out.dtype))
    return out.float(), xl.grad.float(), w1.grad.float()


act = ClampedSwiGLU()
for a_name, a, bias in (("swiglu+bias", "swiglu", True), ("clamped", act, False), ("clamped+bias", act, True)):
    ref = run(w13_h, b13_h, "halves", a, bias, "torch", torch.float64, False)
    got = run(w13_h, b13_h, "halves", a, bias, "auto", torch.bfloat16, False)
    errs = [float((g_ - r_).abs().max() / r_.abs().max()) for g_, r_ in zip(got, ref)]
    bad = (got[1] - ref[1]).abs() > 0.05 * ref[1].abs().max()
    rows = torch.nonzero(bad.any(1)).flatten().tolist()
    print(f"T={T} {a_name:13s} rel err out {errs[0]:.3f} dx {errs[1]:.3f} dw13 {errs[2]:.3f}; bad dx rows {len(rows)}: {rows[:12]}")

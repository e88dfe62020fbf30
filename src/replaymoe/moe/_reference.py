"""The torch reference of the fused MoE: the executable spec of the kernels, forward and backward.

* :class:`ClampedSwiGLU` — gpt-oss's activation (a config object; its ``__call__`` is the math).
* :func:`experts_torch` — the experts as a naive per-expert loop in fp32 (fp64 for fp64 inputs),
  differentiable by autograd; what ``fused_moe(..., backend="torch")`` and
  :func:`replaymoe.moe.fused_moe_torch` run after routing.
* :func:`experts_backward_torch` — its backward in closed form, the spec of the Triton backward kernels.

Host-synchronizing (loops over experts); for tests and CPU runs, not for speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._validation import fail
from .quant import dequantize_fp8_block, fake_quant_fp8_per_token_group


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's clamped SwiGLU, for ``fused_moe(..., activation=ClampedSwiGLU())``.

    With ``g' = min(gate, limit)`` and ``u' = clamp(up, -limit, limit)`` (gate and up including
    w13's bias): ``act = (u' + 1) * g' * sigmoid(alpha * g')`` (transformers' ``GptOssExperts``).
    Its derivative is zero where a clamp is active.

    Parameters
    ----------
    alpha : float
        Slope inside the sigmoid (gpt-oss: 1.702).
    limit : float
        Clamp bound, > 0 (gpt-oss: 7.0).
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("alpha", "limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(name, "a finite float", repr(v))
            object.__setattr__(self, name, float(v))
        if self.limit <= 0:
            fail("limit", "a float > 0", self.limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of ``gate`` and ``up`` (same shape) in their dtype: the reference math."""
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


def _gate_up_act(h: torch.Tensor, activation, interleaved: bool) -> torch.Tensor:
    """The activation of GEMM1's output rows ``h [n, 2I]`` (gate and up rows as laid out in w13)."""
    if interleaved:
        g, u = h[:, 0::2], h[:, 1::2]
    else:
        g, u = h.chunk(2, dim=1)
    if isinstance(activation, ClampedSwiGLU):
        return activation(g, u)
    return F.silu(g) * u


def experts_torch(
    x: torch.Tensor,
    w13,
    w2,
    topk_ids,
    topk_weights,
    *,
    w13_scale,
    w2_scale,
    local_expert_offset: int,
    out_dtype: torch.dtype,
    w13_bias=None,
    w2_bias=None,
    activation="swiglu",
    gate_up_layout="halves",
) -> torch.Tensor:
    """Naive per-expert loop in fp32 (fp64 for fp64 inputs; the executable spec; host-synchronizing,
    not for speed). Differentiable by plain autograd with respect to ``x``, ``w13``, ``w2``,
    ``topk_weights`` and the biases."""
    T, H = x.shape
    E_local = w13.shape[0]
    opts = (w13_bias, w2_bias, activation, gate_up_layout == "interleaved")
    fp8 = w13_scale is not None
    acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = torch.zeros(T, H, dtype=acc_dt, device=x.device)
    xf = x.to(acc_dt)
    ids = topk_ids.long() - local_expert_offset
    wts = topk_weights.to(acc_dt)
    if torch.compiler.is_compiling():
        return _experts_torch_dense(xf, w13, w2, ids, wts, w13_scale, w2_scale, acc, out_dtype, opts)
    for e in range(E_local):
        tok, kk = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        if fp8:
            a = fake_quant_fp8_per_token_group(xf[tok])
            g13 = dequantize_fp8_block(w13[e], w13_scale[e])
            g2 = dequantize_fp8_block(w2[e], w2_scale[e])
        else:
            a, g13, g2 = xf[tok], w13[e].to(acc_dt), w2[e].to(acc_dt)
        act = _expert_act(a @ g13.T, e, opts)
        if fp8:  # the kernels keep silu(gate)*up in bf16, then quantize it per 1x128 group
            act = fake_quant_fp8_per_token_group(act.to(torch.bfloat16))
        y = _expert_down(act, g2, e, opts)
        acc.index_add_(0, tok, y * wts[tok, kk].unsqueeze(1))
    return acc.to(out_dtype)


def _expert_act(h, e, opts):
    """Expert ``e``'s activation of its GEMM1 rows ``h`` (w13's bias added first, if any)."""
    w13_bias, _, activation, interleaved = opts
    if w13_bias is not None:
        h = h + w13_bias[e].to(h.dtype)
    return _gate_up_act(h, activation, interleaved)


def _expert_down(act, g2, e, opts):
    """Expert ``e``'s down projection ``act @ w2[e]^T`` (+ w2's bias, if any)."""
    y = act @ g2.T
    return y if opts[1] is None else y + opts[1][e].to(y.dtype)


def _experts_torch_dense(xf, w13, w2, ids, wts, w13_scale, w2_scale, acc, out_dtype, opts):
    """:func:`experts_torch` with fixed shapes, for ``torch.compile(fullgraph=True)``: every local
    expert runs over every token and its output is weighted by the token's gate for it (0 when not
    selected), accumulated in the same expert order. E_local times the compute of the sparse loop."""
    acc_dt = acc.dtype
    for e in range(w13.shape[0]):
        gate = (wts * (ids == e)).sum(dim=1, keepdim=True)  # [T, 1]
        if w13_scale is not None:
            a = fake_quant_fp8_per_token_group(xf)
            g13 = dequantize_fp8_block(w13[e], w13_scale[e])
            g2 = dequantize_fp8_block(w2[e], w2_scale[e])
        else:
            a, g13, g2 = xf, w13[e].to(acc_dt), w2[e].to(acc_dt)
        act = _expert_act(a @ g13.T, e, opts)
        if w13_scale is not None:
            act = fake_quant_fp8_per_token_group(act.to(torch.bfloat16))
        acc = acc + _expert_down(act, g2, e, opts) * gate
    return acc.to(out_dtype)


def experts_backward_torch(
    grad_out, x, w13, w2, topk_ids, topk_weights, offset, need, *, w13_bias=None, w2_bias=None,
    activation="swiglu", gate_up_layout="halves",
):  # fmt: skip
    """Closed-form backward of :func:`experts_torch` in fp32 (fp64 for fp64 inputs), per expert.

    Host-synchronizing (a loop over experts); the spec of the Triton backward kernels. Returns
    ``(dx, dw13, dw2, dtopk_weights)`` in the inputs' dtypes, plus ``(dw13_bias, dw2_bias)`` when
    ``need`` has 6 entries, empty where ``need`` is False. The keyword options are
    :func:`fused_moe`'s (the clamped activation's derivative is zero where a clamp is active).
    """
    acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    gate_cols = slice(0, two_i, 2) if gate_up_layout == "interleaved" else slice(0, I)
    up_cols = slice(1, two_i, 2) if gate_up_layout == "interleaved" else slice(I, two_i)
    clamped = isinstance(activation, ClampedSwiGLU)
    xf, do = x.to(acc_dt), grad_out.to(acc_dt)
    dx = torch.zeros_like(xf)
    dw13 = torch.zeros(w13.shape, dtype=acc_dt, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=acc_dt, device=x.device)
    dwts = torch.zeros(topk_weights.shape, dtype=acc_dt, device=x.device)
    db13 = torch.zeros(E_local, two_i, dtype=acc_dt, device=x.device)
    db2 = torch.zeros(E_local, w2.shape[1], dtype=acc_dt, device=x.device)
    ids = topk_ids.long() - offset
    wts = topk_weights.to(acc_dt)
    for e in range(E_local):
        tok, kk = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe, w13e, w2e, doe = xf[tok], w13[e].to(acc_dt), w2[e].to(acc_dt), do[tok]
        h = xe @ w13e.T
        if w13_bias is not None:
            h = h + w13_bias[e].to(acc_dt)
        g, u = h[:, gate_cols], h[:, up_cols]
        if clamped:
            lim, alpha = activation.limit, activation.alpha
            gc, uc = g.clamp(max=lim), u.clamp(-lim, lim)
            sig = torch.sigmoid(alpha * gc)
            a = (uc + 1) * gc * sig
            d_gate = ((uc + 1) * sig * (1 + alpha * gc * (1 - sig))) * (g <= lim)
            d_up = gc * sig * ((u >= -lim) & (u <= lim))
        else:
            sig = torch.sigmoid(g)
            a = g * sig * u
            d_gate, d_up = u * sig * (1 + g * (1 - sig)), g * sig
        w = wts[tok, kk].unsqueeze(1)
        da_unweighted = doe @ w2e  # [n, I]
        dwts[tok, kk] = (da_unweighted * a).sum(1)
        if w2_bias is not None:
            dwts[tok, kk] += doe @ w2_bias[e].to(acc_dt)
        da = w * da_unweighted
        dh = torch.empty_like(h)
        dh[:, gate_cols], dh[:, up_cols] = da * d_gate, da * d_up
        dx.index_add_(0, tok, dh @ w13e)
        dw13[e] = dh.T @ xe
        dw2[e] = doe.T @ (w * a)
        db13[e] = dh.sum(0)
        db2[e] = (w * doe).sum(0)
    res = (dx, dw13, dw2, dwts, db13, db2)
    src = (x, w13, w2, topk_weights, w13_bias, w2_bias)
    return tuple(
        (r.to(t.dtype) if t is not None else r) if n else (x if t is None else t).new_empty((0,))
        for r, t, n in zip(res, src, need)
    )

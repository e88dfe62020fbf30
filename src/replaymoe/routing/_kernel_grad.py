"""Triton kernel of the routing backward: the gradient of the routing weights w.r.t. the logits.

At fixed ids, ``dL/dx [T, E]`` for the cotangent ``g = dL/dw [T, K]``, in the closed forms of
:mod:`replaymoe.routing.methods` (one launch instead of a dozen torch ops per call). Each program
handles ``BLOCK_T`` tokens × all ``E`` experts (padded to ``EP``) × the ``K`` slots (padded to ``KP``);
the scatter of per-slot values onto expert columns is a one-hot sum over the slots, so repeated ids
add up as ``scatter_add_`` does. fp32 arithmetic; the result is stored in the logits' dtype.

``KIND`` (the closed form; :data:`replaymoe.routing.methods.GRAD_KIND` maps each to its methods):

* 0: ``softmax(x)[ids]`` — ``p * (d - sum(d * p))`` with ``d`` the scattered ``g``;
* 1: ``softmax(x[ids])`` over the slots — scattered ``w * (g - sum(g * w))``;
* 2: ``sigmoid(x[ids]) / (sum + EPS) * scale`` — scattered ``ds * s * (1 - s)``;
* 3: ``sigmoid(x[ids])`` — scattered ``g * s * (1 - s)``;
* 4: ``softmax(x)[ids]`` renormalised over the slots — kind 0 with ``d`` from the renormalisation;
* 5: ``x[ids]`` — scattered ``g``;
* 6: ``sigmoid(x[ids]) / max(sum, EPS)`` — scattered ``ds * s * (1 - s)``, the clamp passing a
  gradient only where ``sum >= EPS`` (autograd's rule).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scatter(v, onehot):
    """[BLOCK_T, EP]: the sum over slots of ``v [BLOCK_T, KP]`` at each slot's expert column."""
    return tl.sum(tl.where(onehot, v[:, :, None], 0.0), axis=1)


@triton.jit
def route_weights_grad_kernel(
    x_ptr,
    ids_ptr,
    g_ptr,
    out_ptr,
    T,
    E,
    stride_x,
    stride_o,
    scale,
    eps,
    KIND: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[t, :] = d weights[t, :] / d x[t, :] applied to g[t, :], for BLOCK_T tokens (see module)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    rt64 = rt.to(tl.int64)
    rk = tl.arange(0, KP)
    sel_ok = t_ok[:, None] & (rk < K)[None, :]
    re = tl.arange(0, EP)
    e_ok = re < E
    ids = tl.load(ids_ptr + rt64[:, None] * K + rk[None, :], mask=sel_ok, other=-1)
    g = tl.load(g_ptr + rt64[:, None] * K + rk[None, :], mask=sel_ok, other=0.0).to(tl.float32)
    onehot = ids[:, :, None] == re[None, None, :]  # [BLOCK_T, KP, EP]; padding slots match nothing
    if KIND == 0 or KIND == 4:  # softmax over all experts
        x = tl.load(
            x_ptr + rt64[:, None] * stride_x + re[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
        ).to(tl.float32)
        x = tl.where(e_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        probs = p / tl.sum(p, axis=1)[:, None]
        if KIND == 4:
            q = tl.sum(tl.where(onehot, probs[:, None, :], 0.0), axis=2)  # [BLOCK_T, KP]
            qs = tl.sum(q, axis=1)[:, None]
            g = (g - tl.sum(g * q, axis=1)[:, None] / qs) / qs
        d = _scatter(g, onehot)
        gx = probs * (d - tl.sum(d * probs, axis=1)[:, None])
    else:
        xs = tl.load(x_ptr + rt64[:, None] * stride_x + tl.where(sel_ok, ids, 0), mask=sel_ok, other=0.0)
        xs = xs.to(tl.float32)
        if KIND == 1:
            z = tl.where(sel_ok, xs, float("-inf"))
            w = tl.exp(z - tl.max(z, axis=1)[:, None])
            w = tl.where(sel_ok, w, 0.0)
            w = w / tl.sum(w, axis=1)[:, None]
            v = w * (g - tl.sum(g * w, axis=1)[:, None])
        elif KIND == 5:
            v = g
        else:
            s = tl.where(sel_ok, 1.0 / (1.0 + tl.exp(-xs)), 0.0)
            if KIND == 3:
                ds = g
            elif KIND == 2:
                den = tl.sum(s, axis=1)[:, None] + eps
                ds = (g / den - tl.sum(g * s, axis=1)[:, None] / (den * den)) * scale
            else:  # 6
                total = tl.sum(s, axis=1)[:, None]
                den = tl.maximum(total, eps)
                ds = g / den - tl.where(total >= eps, tl.sum(g * s, axis=1)[:, None] / (den * den), 0.0)
            v = ds * s * (1.0 - s)
        gx = _scatter(v, onehot)
    o_ptrs = out_ptr + rt64[:, None] * stride_o + re[None, :]
    tl.store(o_ptrs, gx.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & e_ok[None, :])

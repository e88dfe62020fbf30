"""Triton kernel of the routing backward: the gradient of the routing weights w.r.t. the logits.

At fixed ids, ``dL/dx [T, E]`` for the cotangent ``g = dL/dw [T, K]``, in the closed forms of
:mod:`replaymoe.routing.methods` (one launch instead of a dozen torch ops per call). Each program
handles ``BLOCK_T`` tokens × all ``E`` experts (padded to ``EP``) × the ``K`` slots (padded to ``KP``);
the scatter of per-slot values onto expert columns is a one-hot sum over the slots, so repeated ids
add up as ``scatter_add_`` does. fp32 arithmetic; the result is stored in the logits' dtype.

``KIND`` (the closed form: :attr:`replaymoe.routing.methods.Formula.kernel` of a formula with
``grad_kernel``; the method table maps each method to its formula):

* 0 ``W_SOFTMAX_ALL``: ``softmax(x)[ids]`` — ``p * (d - sum(d * p))`` with ``d`` the scattered ``g``;
* 1 ``W_SOFTMAX_SELECTED``: ``softmax(x[ids])`` over the slots — scattered ``w * (g - sum(g * w))``;
* 2 ``W_SIGMOID_SCALED``: ``sigmoid(x[ids]) / (sum + EPS) * scale`` — scattered ``ds * s * (1 - s)``;
* 3 ``W_SIGMOID``: ``sigmoid(x[ids])`` — scattered ``g * s * (1 - s)``;
* 4 ``W_SOFTMAX_ALL_RENORM``: ``softmax(x)[ids]`` renormalised over the slots — kind 0 with ``d`` from
  the renormalisation;
* 5 ``W_LOGITS``: ``x[ids]`` — scattered ``g``;
* 6 ``W_SIGMOID_RENORM``: ``sigmoid(x[ids]) / max(sum, EPS)`` — scattered ``ds * s * (1 - s)``, the
  clamp passing a gradient only where ``sum >= EPS`` (autograd's rule).
"""

from __future__ import annotations

import triton
import triton.language as tl

# the closed forms' numbers (``KIND``): the weights formulas' branch numbers, as in the forward kernel
from replaymoe.routing._kernel import (
    KIND_LOGITS,
    KIND_SIGMOID,
    KIND_SIGMOID_RENORM,
    KIND_SIGMOID_SCALED,
    KIND_SOFTMAX_ALL,
    KIND_SOFTMAX_ALL_RENORM,
    KIND_SOFTMAX_SELECTED,
)


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
    if KIND == KIND_SOFTMAX_ALL or KIND == KIND_SOFTMAX_ALL_RENORM:  # softmax over all experts
        x = tl.load(
            x_ptr + rt64[:, None] * stride_x + re[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
        ).to(tl.float32)
        x = tl.where(e_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        probs = p / tl.sum(p, axis=1)[:, None]
        if KIND == KIND_SOFTMAX_ALL_RENORM:
            q = tl.sum(tl.where(onehot, probs[:, None, :], 0.0), axis=2)  # [BLOCK_T, KP]
            qs = tl.sum(q, axis=1)[:, None]
            g = (g - tl.sum(g * q, axis=1)[:, None] / qs) / qs
        d = _scatter(g, onehot)
        gx = probs * (d - tl.sum(d * probs, axis=1)[:, None])
    else:
        # ids outside [0, E) (bad replay ids, reported by the forward's device check) read nothing
        in_range = sel_ok & (ids >= 0) & (ids < E)
        xs = tl.load(x_ptr + rt64[:, None] * stride_x + tl.where(in_range, ids, 0), mask=in_range, other=0.0)
        xs = xs.to(tl.float32)
        if KIND == KIND_SOFTMAX_SELECTED:
            z = tl.where(sel_ok, xs, float("-inf"))
            w = tl.exp(z - tl.max(z, axis=1)[:, None])
            w = tl.where(sel_ok, w, 0.0)
            w = w / tl.sum(w, axis=1)[:, None]
            v = w * (g - tl.sum(g * w, axis=1)[:, None])
        elif KIND == KIND_LOGITS:
            v = g
        else:
            s = tl.where(sel_ok, 1.0 / (1.0 + tl.exp(-xs)), 0.0)
            if KIND == KIND_SIGMOID:
                ds = g
            elif KIND == KIND_SIGMOID_SCALED:
                den = tl.sum(s, axis=1)[:, None] + eps
                ds = (g / den - tl.sum(g * s, axis=1)[:, None] / (den * den)) * scale
            else:
                tl.static_assert(KIND == KIND_SIGMOID_RENORM, "a closed form without a branch here")
                total = tl.sum(s, axis=1)[:, None]
                den = tl.maximum(total, eps)
                ds = g / den - tl.where(total >= eps, tl.sum(g * s, axis=1)[:, None] / (den * den), 0.0)
            v = ds * s * (1.0 - s)
        gx = _scatter(v, onehot)
    o_ptrs = out_ptr + rt64[:, None] * stride_o + re[None, :]
    tl.store(o_ptrs, gx.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & e_ok[None, :])

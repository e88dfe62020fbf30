"""Fused Mixture-of-Experts layer: routing (optional) + grouped-GEMM experts + top-k reduction.

Public entry points
-------------------
* :func:`fused_moe` — validated wrapper; ``backend="auto" | "triton" | "torch"``.
* :func:`fused_moe_torch` — the executable spec: a naive per-expert loop in fp32.
* :class:`MoELayer` — router ``Linear(H, E)`` + experts, for users who build models.
* :func:`swap_gate_up` — convert w13 between our order (gate rows first) and
  FlashInfer TRT-LLM's order (up rows first).

Semantics (DESIGN.md, "Fused MoE")::

    out[t] = sum over k with  local_expert_offset <= topk_ids[t, k] < local_expert_offset + E_local  of
             topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
             e = topk_ids[t, k] - local_expert_offset

Routing is always over all ``num_experts`` experts with global ids; a rank holding only the slice
``[local_expert_offset, +E_local)`` produces a partial sum (expert parallelism). Ids outside the
slice — including negative padding ids such as EP dispatch's ``-1`` — contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import check_choice, check_int, check_tensor, fail
from .quant import dequantize_fp8_block, fake_quant_fp8_per_token_group

__all__ = ["fused_moe", "fused_moe_torch", "MoELayer", "swap_gate_up"]

_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REF_DTYPES = _ACT_DTYPES + (torch.float64,)  # torch backend only: fp64 is the gradient reference
_ID_DTYPES = (torch.int32, torch.int64)
_FP8 = torch.float8_e4m3fn
_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class _Problem:
    """Validated sizes of one call."""

    T: int  # tokens
    H: int  # hidden size
    I: int  # intermediate size (per expert)  # noqa: E741
    E_local: int  # experts held by this rank
    fp8: bool  # fp8 block-scale weights
    out_dtype: torch.dtype


def _validate(
    hidden_states,
    w13,
    w2,
    *,
    router_logits,
    top_k,
    method,
    bias,
    n_group,
    topk_group,
    routed_scaling_factor,
    topk_ids,
    topk_weights,
    routing_replay_out,
    replay_ids,
    activation,
    w13_scale,
    w2_scale,
    local_expert_offset,
    num_experts,
    out,
    act_dtypes=_ACT_DTYPES,
) -> _Problem:
    check_choice("activation", activation, ("swiglu",))
    check_tensor("hidden_states", hidden_states, ndim=2, dtype=act_dtypes)
    dev = hidden_states.device
    T, H = hidden_states.shape
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8 and (w13_scale is None or w2_scale is None):
        fail(
            "w13_scale" if w13_scale is None else "w2_scale",
            "both w13_scale and w2_scale (fp8 block-scale) or neither",
            "only one of them",
            what="value",
        )
    wdt = (_FP8,) if fp8 else (hidden_states.dtype,)
    check_tensor("w13", w13, ndim=3, dtype=wdt, device=dev)
    E_local, two_i, h13 = w13.shape
    if h13 != H:
        fail("w13", f"[E_local, 2I, H={H}] (H from hidden_states)", tuple(w13.shape), what="shape")
    if two_i % 2 or two_i == 0:
        fail(
            "w13",
            "[E_local, 2I, H] with an even, non-zero 2I (gate rows then up rows)",
            tuple(w13.shape),
            what="shape",
        )
    I = two_i // 2  # noqa: E741
    if E_local < 1:
        fail("w13", "at least one local expert", tuple(w13.shape), what="shape")
    check_tensor("w2", w2, shape=(E_local, H, I), dtype=wdt, device=dev)
    if fp8:
        if H % 128 or I % 128:
            fail("w13", "H and I multiples of 128 for fp8 block-scale", f"H={H}, I={I}", what="shape")
        # contiguous: the kernels step through the scale blocks with unit stride along the last dim
        check_tensor(
            "w13_scale",
            w13_scale,
            shape=(E_local, two_i // 128, H // 128),
            dtype=torch.float32,
            device=dev,
            contiguous=True,
        )
        check_tensor(
            "w2_scale",
            w2_scale,
            shape=(E_local, H // 128, I // 128),
            dtype=torch.float32,
            device=dev,
            contiguous=True,
        )
    check_int("local_expert_offset", local_expert_offset, low=0)

    routing_args = {
        "top_k": top_k,
        "method": method,
        "bias": bias,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": routed_scaling_factor,
        "routing_replay_out": routing_replay_out,
        "replay_ids": replay_ids,
    }
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            fail(
                "topk_ids",
                "None when router_logits is given (routing is done inside)",
                "both router_logits and topk tensors",
            )
        check_tensor("router_logits", router_logits, ndim=2, device=dev)
        if router_logits.shape[0] != T:
            fail("router_logits", f"[T={T}, E]", tuple(router_logits.shape), what="shape")
        E = router_logits.shape[1]
        if num_experts is not None and check_int("num_experts", num_experts, low=1) != E:
            fail("num_experts", f"router_logits.shape[1] = {E}", num_experts)
        if top_k is None:
            fail("top_k", "an int when router_logits is given", None)
        check_int("top_k", top_k, low=1, high=E)
    else:
        if topk_ids is None or topk_weights is None:
            fail(
                "topk_ids" if topk_ids is None else "topk_weights",
                "router_logits, or both topk_ids and topk_weights",
                "neither routing given",
            )
        given = [k for k, v in routing_args.items() if v is not None]
        if given:
            fail(
                given[0],
                "None when topk_ids/topk_weights are given (routing arguments apply only with router_logits)",
                f"{given[0]} given",
            )
        check_tensor("topk_ids", topk_ids, ndim=2, dtype=_ID_DTYPES, device=dev)
        if topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
            fail("topk_ids", f"[T={T}, K>=1]", tuple(topk_ids.shape), what="shape")
        check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtype=act_dtypes, device=dev)
        E = (
            local_expert_offset + E_local
            if num_experts is None
            else check_int("num_experts", num_experts, low=1)
        )
    if local_expert_offset + E_local > E:
        fail(
            "local_expert_offset",
            f"local_expert_offset + E_local <= num_experts = {E}",
            f"{local_expert_offset} + {E_local}",
        )
    out_dtype = torch.bfloat16 if fp8 else hidden_states.dtype
    if out is not None:
        check_tensor("out", out, shape=(T, H), dtype=out_dtype, device=dev, contiguous=True)
    return _Problem(T=T, H=H, I=I, E_local=E_local, fp8=fp8, out_dtype=out_dtype)


def _route(router_logits, top_k, method, backend, **kw):
    from .routing import RoutingMethod, route

    method = RoutingMethod.RENORMALIZE if method is None else method
    res = route(router_logits, top_k, method, backend=backend, **kw)
    return res.topk_ids, res.topk_weights


def _experts_torch(
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
) -> torch.Tensor:
    """Naive per-expert loop in fp32 (fp64 for fp64 inputs; the executable spec; host-synchronizing,
    not for speed). Differentiable by plain autograd with respect to ``x``, ``w13``, ``w2`` and
    ``topk_weights``."""
    T, H = x.shape
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    fp8 = w13_scale is not None
    acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = torch.zeros(T, H, dtype=acc_dt, device=x.device)
    xf = x.to(acc_dt)
    ids = topk_ids.long() - local_expert_offset
    wts = topk_weights.to(acc_dt)
    if torch.compiler.is_compiling():
        return _experts_torch_dense(xf, w13, w2, ids, wts, w13_scale, w2_scale, acc, out_dtype)
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
        h = a @ g13.T
        act = F.silu(h[:, :I]) * h[:, I:]
        if fp8:  # the kernels keep silu(gate)*up in bf16, then quantize it per 1x128 group
            act = fake_quant_fp8_per_token_group(act.to(torch.bfloat16))
        y = act @ g2.T
        acc.index_add_(0, tok, y * wts[tok, kk].unsqueeze(1))
    return acc.to(out_dtype)


def _experts_torch_dense(xf, w13, w2, ids, wts, w13_scale, w2_scale, acc, out_dtype):
    """:func:`_experts_torch` with fixed shapes, for ``torch.compile(fullgraph=True)``: every local
    expert runs over every token and its output is weighted by the token's gate for it (0 when not
    selected), accumulated in the same expert order. E_local times the compute of the sparse loop."""
    I = w13.shape[1] // 2  # noqa: E741
    acc_dt = acc.dtype
    for e in range(w13.shape[0]):
        gate = (wts * (ids == e)).sum(dim=1, keepdim=True)  # [T, 1]
        if w13_scale is not None:
            a = fake_quant_fp8_per_token_group(xf)
            g13 = dequantize_fp8_block(w13[e], w13_scale[e])
            g2 = dequantize_fp8_block(w2[e], w2_scale[e])
        else:
            a, g13, g2 = xf, w13[e].to(acc_dt), w2[e].to(acc_dt)
        h = a @ g13.T
        act = F.silu(h[:, :I]) * h[:, I:]
        if w13_scale is not None:
            act = fake_quant_fp8_per_token_group(act.to(torch.bfloat16))
        acc = acc + (act @ g2.T) * gate
    return acc.to(out_dtype)


def fused_moe_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    router_logits: torch.Tensor | None = None,
    top_k: int | None = None,
    method=None,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    routing_replay_out: torch.Tensor | None = None,
    replay_ids: torch.Tensor | None = None,
    activation: str = "swiglu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    local_expert_offset: int = 0,
    num_experts: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference fused MoE: routing through ``route(..., backend="torch")``, then a per-expert loop in fp32.

    Same arguments and semantics as :func:`fused_moe` (minus ``backend``). The fp8 path dequantizes
    the weights per 128×128 block and passes the activations through the same per-1×128-group fp8
    quantization the kernels apply (both GEMM inputs), so it is the exact spec of the fp8 kernels up
    to accumulation order (the SwiGLU rows are rounded to bf16 before their quantization, as in the
    kernels). Runs on any device; host-synchronizing.
    """
    return fused_moe(
        hidden_states,
        w13,
        w2,
        router_logits=router_logits,
        top_k=top_k,
        method=method,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        routing_replay_out=routing_replay_out,
        replay_ids=replay_ids,
        activation=activation,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        local_expert_offset=local_expert_offset,
        num_experts=num_experts,
        out=out,
        backend="torch",
    )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    router_logits: torch.Tensor | None = None,
    top_k: int | None = None,
    method=None,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    routing_replay_out: torch.Tensor | None = None,
    replay_ids: torch.Tensor | None = None,
    activation: str = "swiglu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    local_expert_offset: int = 0,
    num_experts: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    recompute: bool = False,
) -> torch.Tensor:
    """Mixture-of-Experts layer: ``out[t] = Σ_k w[t,k] · w2[e] @ swiglu(w13[e] @ x_t)`` over local experts.

    Parameters
    ----------
    hidden_states : Tensor [T, H], bfloat16 / float16 (float32 on the torch/CPU path)
    w13 : Tensor [E_local, 2I, H]
        Rows [0, I) are the gate half, [I, 2I) the up half (vLLM / transformers order; see
        :func:`swap_gate_up` for FlashInfer TRT-LLM's order). Same dtype as ``hidden_states``, or
        float8_e4m3fn with ``w13_scale``.
    w2 : Tensor [E_local, H, I], same dtype as ``w13``.
    router_logits : Tensor [T, E], optional
        Route inside, exactly as :func:`replaymoe.routing.route` with ``top_k``, ``method`` (default
        ``RoutingMethod.RENORMALIZE``), ``bias``, ``n_group``, ``topk_group``,
        ``routed_scaling_factor``, ``routing_replay_out`` (int16 [>=T, K], capture) and
        ``replay_ids`` ([T, K], forced selection) — all only allowed with ``router_logits``.
    topk_ids : Tensor [T, K], int32 / int64, optional
        Routing given by the caller: global expert ids. Ids outside
        ``[local_expert_offset, +E_local)`` (also negative padding ids) contribute nothing.
    topk_weights : Tensor [T, K], float32 / bfloat16 / float16 — required with ``topk_ids``.
    activation : "swiglu"
        ``silu(gate) * up``.
    w13_scale : Tensor [E_local, 2I/128, H/128], float32, optional
    w2_scale : Tensor [E_local, H/128, I/128], float32, optional
        fp8 block-scale (DeepSeek style) when given: weights are ``fp8 × scale`` per 128×128 block,
        activations are quantized on the fly per 1×128 group; H and I must be multiples of 128;
        the output is bfloat16.
    local_expert_offset : int
        Global id of this rank's first expert (expert parallelism).
    num_experts : int, optional
        Total experts E over all ranks (defaults to ``router_logits.shape[1]``, or
        ``local_expert_offset + E_local`` with given topk tensors).
    out : Tensor [T, H], optional
        Written in place and returned (output dtype, contiguous).
    backend : "auto" | "triton" | "torch"
        ``auto`` = Triton on CUDA tensors, torch elsewhere; ``triton`` on CPU tensors runs the
        kernels in Triton's interpreter (process started with ``TRITON_INTERPRET=1``). The torch
        backend also takes float64 activations (the gradient reference).
    recompute : bool, keyword-only
        Training only (some input requires grad, Triton backend): ``False`` saves the GEMM1 outputs
        (gate and up pre-activations, ``[T*K, 2I]`` in the activation dtype) for the backward;
        ``True`` saves nothing but the inputs and recomputes GEMM1 inside the backward's first
        kernel (less memory, more time). No effect on the forward's values.

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states`` (bfloat16 on the fp8 path). Under expert parallelism a
    partial sum over this rank's experts. ``T = 0`` gives an empty output.

    Gradients
    ---------
    Differentiable (bf16/fp16/fp32, every backend) with respect to ``hidden_states``, ``w13``, ``w2``
    and ``topk_weights``; with routing inside (``router_logits``, also with ``replay_ids``), the
    weights' gradient flows on to ``router_logits`` through :func:`replaymoe.routing.route`'s
    backward (``bias`` and the ids get none). The torch backend differentiates the reference by
    autograd; the Triton backend registers a backward on its custom op
    (``torch.ops.replaymoe.moe_experts_train``, so it works under ``torch.compile``) that runs
    Triton kernels: deterministic (no float atomics, every reduction in a fixed order), bitwise
    equal from run to run. Tokens routed to non-local experts get zero gradient from this rank;
    experts without tokens get zero weight gradients. The fp8 block-scale path is inference-only
    (a ValueError is raised when an input requires grad). The forward's values are the same with
    and without gradients.

    Raises
    ------
    ValueError
        Naming the argument: shape/dtype/device mismatches between hidden_states, w13, w2 and the
        scales; fp8 dims not multiples of 128; wrong topk dtypes; routing arguments together with
        topk tensors; missing routing; bad ``activation``, ``backend`` or ``recompute``; fp8 weights
        with an input that requires grad; float64 on the Triton backend.
    """
    check_choice("backend", backend, _BACKENDS)
    if not isinstance(recompute, bool):
        fail("recompute", "a bool", type(recompute).__name__, what="type")
    on_cuda = isinstance(hidden_states, torch.Tensor) and hidden_states.is_cuda
    use_triton = backend == "triton" or (backend == "auto" and on_cuda)
    p = _validate(
        hidden_states,
        w13,
        w2,
        router_logits=router_logits,
        top_k=top_k,
        method=method,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        routing_replay_out=routing_replay_out,
        replay_ids=replay_ids,
        activation=activation,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        local_expert_offset=local_expert_offset,
        num_experts=num_experts,
        out=out,
        act_dtypes=_ACT_DTYPES if use_triton else _REF_DTYPES,
    )
    if use_triton:
        _check_triton_available(hidden_states)
    if router_logits is not None:
        topk_ids, topk_weights = _route(
            router_logits,
            top_k,
            method,
            "triton" if use_triton else "torch",
            bias=bias,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            routing_replay_out=routing_replay_out,
            # any strides (e.g. trace.ids[:, l]): the small [T, K] tensor is copied when needed
            replay_ids=replay_ids.contiguous() if isinstance(replay_ids, torch.Tensor) else replay_ids,
        )
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, w13, w2, topk_weights)
    )
    if needs_grad and p.fp8:
        fail(
            "w13_scale",
            "None when gradients are required (the fp8 block-scale path is inference-only)",
            "fp8 weights with an input that requires grad",
        )
    if p.T == 0:
        res = hidden_states.new_empty((0, p.H), dtype=p.out_dtype)
        if needs_grad:  # connected to the inputs, so that their gradients are zeros (not None)
            res = res + sum(t.reshape(-1)[:0].sum().to(p.out_dtype)
                            for t in (hidden_states, w13, w2, topk_weights) if t.requires_grad)  # fmt: skip
        return out.copy_(res) if out is not None else res
    if use_triton and needs_grad:
        res = _experts_triton_train(
            hidden_states,
            w13,
            w2,
            topk_ids,
            topk_weights,
            local_expert_offset=local_expert_offset,
            recompute=recompute,
        )
        if out is not None:
            out.copy_(res)
            return out
        return res
    if use_triton:
        res = _experts_triton(
            hidden_states,
            w13,
            w2,
            topk_ids,
            topk_weights,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            local_expert_offset=local_expert_offset,
            out=out,
        )
        return res
    res = _experts_torch(
        hidden_states,
        w13,
        w2,
        topk_ids,
        topk_weights,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        local_expert_offset=local_expert_offset,
        out_dtype=p.out_dtype,
    )
    if out is not None:
        out.copy_(res)
        return out
    return res


def _check_triton_available(x: torch.Tensor) -> None:
    import os

    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        fail(
            "backend",
            "'triton' with CUDA tensors, or a process started with TRITON_INTERPRET=1 for CPU "
            "tensors (Triton reads it at import)",
            "'triton' with CPU tensors and no TRITON_INTERPRET=1",
        )


@dataclass(frozen=True)
class MoEConfig:
    """Kernel configuration of one fused-MoE call (chosen by :func:`moe_config` from the shape).

    ``direct``: decode mode (one tile per slot, no layout, reduction fused into GEMM2); otherwise
    tiles of ``block_m`` rows from :func:`replaymoe.layout.expert_layout`. ``*1`` = GEMM1 (gate/up
    + SwiGLU, its ``block_n1`` is per half), ``*2`` = GEMM2 (down projection).
    """

    direct: bool
    block_m: int
    block_n1: int
    block_k1: int
    warps1: int
    stages1: int
    block_n2: int
    block_k2: int
    warps2: int
    stages2: int
    group_m: int = 8


# Tuned on the H200 (bench/moe_tune.py, bench/moe_notes.md); key (H, I, E_local, K, fp8, token bucket).
_TUNED: dict[tuple, MoEConfig] = {
    (7168, 2048, 256, 8, False, 1): MoEConfig(True, 16, 64, 128, 4, 4, 32, 256, 4, 4),  # DeepSeek-V3 decode
    (2048, 768, 128, 8, True, 1): MoEConfig(True, 16, 64, 128, 4, 4, 64, 128, 4, 4),  # Qwen3 fp8 decode
}


def _bucket(T: int) -> int:
    return 1 << max(0, (T - 1).bit_length())


def moe_config(T: int, K: int, H: int, I: int, E_local: int, *, fp8: bool = False) -> MoEConfig:  # noqa: E741
    """Kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of size H×I."""
    tuned = _TUNED.get((H, I, E_local, K, fp8, _bucket(T)))
    if tuned is not None:
        return tuned
    slots = T * K
    if T == 1 or slots * 4 <= E_local:
        # decode: one tile per slot, each active expert's weights streamed once, split along N
        if fp8:
            return MoEConfig(True, 16, 128, 128, 4, 3, 128, 128, 4, 3)
        return MoEConfig(True, 16, 32, 128, 4, 4, 32, 128, 4, 4)
    m_avg = slots / min(E_local, slots)  # rows per active expert
    if fp8:
        if m_avg < 48:
            return MoEConfig(False, 16 if m_avg < 12 else 32, 128, 128, 4, 3, 128, 128, 4, 3)
        return MoEConfig(False, 64, 128, 128, 8, 3, 128, 128, 8, 3)
    if m_avg < 12:  # H200 sweep (bench/moe_notes.md): memory-bound, deep K tiles
        return MoEConfig(False, 16, 64, 256, 4, 3, 64, 256, 4, 3)
    if m_avg < 48:
        return MoEConfig(False, 32, 64, 128, 4, 4, 64, 128, 4, 4)
    return MoEConfig(False, 128, 128, 64, 8, 4, 256, 64, 8, 4, 4)


def _experts_triton(
    x, w13, w2, topk_ids, topk_weights, *, w13_scale, w2_scale, local_expert_offset, out, config=None
):
    """Run the Triton experts into ``out`` (allocated when None); returns it."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    fp8 = w13_scale is not None
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16 if fp8 else x.dtype, device=x.device)
    c = config or moe_config(T, K, H, I, E_local, fp8=fp8)
    if torch.compiler.is_compiling():
        torch.ops.replaymoe.moe_experts(
            x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            _config_tuple(c),
        )  # fmt: skip
    else:  # eager: the same launches without the custom-op dispatch (tens of microseconds per call)
        _launch(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, c)
    return out


def _experts_triton_train(x, w13, w2, topk_ids, topk_weights, *, local_expert_offset, recompute, config=None):
    """Differentiable Triton experts (``torch.ops.replaymoe.moe_experts_train`` + its backward)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    c = config or moe_config(T, K, H, two_i // 2, E_local)
    out, _ = torch.ops.replaymoe.moe_experts_train(
        x, w13, w2, topk_ids, topk_weights, local_expert_offset, _config_tuple(c), recompute
    )
    return out


@torch.library.custom_op("replaymoe::moe_experts_train", mutates_args=())
def _moe_train_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    local_expert_offset: int,
    config: list[int],
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the differentiable experts: ``(out [T, H], saved)``.

    ``saved`` is the GEMM1 output per slot, ``[T*K, 2I]`` (gate pre-activations in columns [0, I),
    up in [I, 2I)), rows of non-local slots unspecified; empty with ``recompute``. Same kernels and
    configuration as the inference path, so ``out`` is bitwise the inference output.
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    saved = x.new_empty((0 if recompute else T * K, w13.shape[1]))
    _launch(x, w13, w2, topk_ids, topk_weights, None, None, local_expert_offset, out,
            MoEConfig(bool(config[0]), *config[1:]), saved=None if recompute else saved)  # fmt: skip
    return out, saved


@_moe_train_op.register_fake
def _(x, w13, w2, topk_ids, topk_weights, local_expert_offset, config, recompute):
    T, H = x.shape
    return x.new_empty((T, H)), x.new_empty((0 if recompute else T * topk_ids.shape[1], w13.shape[1]))


def _train_setup_context(ctx, inputs, output):
    x, w13, w2, topk_ids, topk_weights, local_expert_offset, _config, recompute = inputs
    ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights, output[1])
    ctx.offset, ctx.recompute = local_expert_offset, recompute
    # the saved gate/up rows are an output only to be saved: no zero gradient [T*K, 2I] for them
    ctx.set_materialize_grads(False)


def _train_backward(ctx, grad_out, _grad_saved):
    x, w13, w2, topk_ids, topk_weights, saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    if grad_out is None:  # out unused by the loss
        grad_out = torch.zeros_like(x)
    dx, dw13, dw2, dwts = torch.ops.replaymoe.moe_experts_bwd(
        grad_out.contiguous(), x, w13, w2, topk_ids, topk_weights, saved, ctx.offset, ctx.recompute,
        [bool(need[0]), bool(need[1]), bool(need[2]), bool(need[4])],
    )  # fmt: skip
    return (dx if need[0] else None, dw13 if need[1] else None, dw2 if need[2] else None, None,
            dwts if need[4] else None, None, None, None)  # fmt: skip


_moe_train_op.register_autograd(_train_backward, setup_context=_train_setup_context)


@torch.library.custom_op("replaymoe::moe_experts_bwd", mutates_args=())
def _moe_bwd_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    saved: torch.Tensor,
    local_expert_offset: int,
    recompute: bool,
    need: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``moe_experts_train``: ``(dx, dw13, dw2, dtopk_weights)``; a gradient not in
    ``need`` (x, w13, w2, topk_weights) comes back empty."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    c = moe_bwd_config(T, K, H, two_i // 2, E_local)
    return _launch_bwd(grad_out, x, w13, w2, topk_ids, topk_weights, saved, local_expert_offset, recompute,
                       need, c)  # fmt: skip


@_moe_bwd_op.register_fake
def _(grad_out, x, w13, w2, topk_ids, topk_weights, saved, local_expert_offset, recompute, need):
    return tuple(t.new_empty(t.shape if n else (0,)) for t, n in zip((x, w13, w2, topk_weights), need))


def _experts_backward_torch(grad_out, x, w13, w2, topk_ids, topk_weights, offset, need):
    """Closed-form backward of :func:`_experts_torch` in fp32 (fp64 for fp64 inputs), per expert.

    Host-synchronizing (a loop over experts); the spec of the Triton backward kernels. Returns
    ``(dx, dw13, dw2, dtopk_weights)`` in the inputs' dtypes, empty where ``need`` is False.
    """
    acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    xf, do = x.to(acc_dt), grad_out.to(acc_dt)
    dx = torch.zeros_like(xf)
    dw13 = torch.zeros(w13.shape, dtype=acc_dt, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=acc_dt, device=x.device)
    dwts = torch.zeros(topk_weights.shape, dtype=acc_dt, device=x.device)
    ids = topk_ids.long() - offset
    wts = topk_weights.to(acc_dt)
    for e in range(E_local):
        tok, kk = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe, w13e, w2e, doe = xf[tok], w13[e].to(acc_dt), w2[e].to(acc_dt), do[tok]
        h = xe @ w13e.T
        g, u = h[:, :I], h[:, I:]
        sig = torch.sigmoid(g)
        a = g * sig * u
        w = wts[tok, kk].unsqueeze(1)
        da_unweighted = doe @ w2e  # [n, I]
        dwts[tok, kk] = (da_unweighted * a).sum(1)
        da = w * da_unweighted
        dh = torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=1)
        dx.index_add_(0, tok, dh @ w13e)
        dw13[e] = dh.T @ xe
        dw2[e] = doe.T @ (w * a)
    res = (dx, dw13, dw2, dwts)
    src = (x, w13, w2, topk_weights)
    return tuple(r.to(t.dtype) if n else t.new_empty((0,)) for r, t, n in zip(res, src, need))


@dataclass(frozen=True)
class MoEBwdConfig:
    """Kernel configuration of one fused-MoE backward (chosen by :func:`moe_bwd_config`).

    ``block_m``: rows per tile of the backward's layout; ``*_a`` = the dA GEMM (``dO @ W2``, N over
    I, K over H), ``*_x`` = the dX GEMM (N over H, K over 2I), ``*_w`` = the weight-gradient GEMMs
    (a ``bm_w × bn_w`` block of one expert's dW, K over its rows). ``dw_mode``: 0 = the token rows
    of x and dO gathered inside the dW loop; 1 = gathered once into layout order first; 2 = gathered
    once, transposed (K-major A operands).
    """

    block_m: int
    bn_a: int
    bk_a: int
    warps_a: int
    stages_a: int
    bn_x: int
    bk_x: int
    warps_x: int
    stages_x: int
    bm_w: int
    bn_w: int
    bk_w: int
    warps_w: int
    stages_w: int
    group_m: int = 8
    dw_mode: int = 0


def moe_bwd_config(T: int, K: int, H: int, I: int, E_local: int) -> MoEBwdConfig:  # noqa: E741
    """Backward kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of H×I."""
    slots = max(T * K, 1)
    m_avg = slots / min(E_local, slots)
    # H200 sweep (bench/moe_bwd_tune.py, bench/results/train_bwd_tune.txt): dW over pre-gathered rows
    if m_avg < 12:
        return MoEBwdConfig(16, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1)
    if m_avg < 40:
        return MoEBwdConfig(32, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1)
    if m_avg <= 256:  # dW's K loop (an expert's rows) is short: 4-warp 128x128x32 tiles, 4 stages
        return MoEBwdConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 128, 32, 4, 4, 8, 1)
    return MoEBwdConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 256, 64, 8, 3, 8, 1)


def _launch_bwd(dout, x, w13, w2, topk_ids, topk_weights, saved, offset, recompute, need, c: MoEBwdConfig):
    """Triton backward: ``(dx, dw13, dw2, dtopk_weights)`` (empty where ``need`` is False).

    Launches: layout (2); GEMM1 again when ``recompute``; dA; SwiGLU backward (elementwise); dX +
    k-ordered reduce; dW13; dW2. Intermediates: dh [rows, 2I] and aw [rows, I] in layout order.
    """
    from ._kernels.moe import _moe_gemm1_kernel, _moe_reduce_kernel
    from ._kernels.moe_bwd import (
        _moe_bwd_da_kernel,
        _moe_bwd_dw_kernel,
        _moe_bwd_dx_kernel,
        _moe_bwd_swiglu_kernel,
    )
    from .layout import expert_layout

    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    dev = x.device
    slots = T * K
    src = (x, w13, w2, topk_weights)
    empty = [t.new_empty((0,)) for t in src]
    if T == 0:
        return tuple(torch.zeros_like(t) if n else z for t, n, z in zip(src, need, empty))
    x = x.contiguous()
    dout = dout.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    lay = expert_layout(ids, E_local, block_m=c.block_m, local_expert_offset=offset)
    num_pid_m = lay.max_tiles
    rows = max(lay.sorted_slots.shape[0], 1)
    bm = c.block_m
    if recompute:  # GEMM1 again, gate/up per slot only
        saved = torch.empty(slots, two_i, dtype=x.dtype, device=dev)
        if num_pid_m:
            bn1, bk1 = (128, 64) if bm >= 64 else (64, 128)
            _moe_gemm1_kernel[(num_pid_m * triton_cdiv(I, bn1),)](
                x, x, w13, w13, saved, saved, saved, ids, lay.sorted_slots, lay.tile_expert, lay.num_tiles,
                num_pid_m, H, I, K, slots, offset, E_local, x.stride(0), w13.stride(0), w13.stride(1), 0, 0,
                saved.stride(0), saved.stride(0), DIRECT=False, FP8=False, PREQ=False, SAVE_H=True,
                STORE_ACT=False, EVEN_K=H % bk1 == 0, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=c.group_m,
                DOT_PREC=prec, num_warps=8 if bm >= 128 else 4, num_stages=4 if bm >= 64 else 3,
            )  # fmt: skip
    dh = torch.empty(rows, two_i, dtype=x.dtype, device=dev)
    aw = torch.empty(rows, I, dtype=x.dtype, device=dev)
    bn_e = 128
    nb = triton_cdiv(I, bn_e)
    dwp = torch.zeros(slots, nb, dtype=torch.float32, device=dev)
    if num_pid_m:
        _moe_bwd_da_kernel[(num_pid_m * triton_cdiv(I, c.bn_a),)](
            dout, w2, dh, lay.sorted_slots, lay.tile_expert, lay.num_tiles, num_pid_m, H, I, K, slots,
            dout.stride(0), w2.stride(0), w2.stride(1), dh.stride(0), EVEN_K=H % c.bk_a == 0, BLOCK_M=bm,
            BLOCK_N=c.bn_a, BLOCK_K=c.bk_a, GROUP_M=c.group_m, DOT_PREC=prec, num_warps=c.warps_a,
            num_stages=c.stages_a,
        )  # fmt: skip
        br = 16
        _moe_bwd_swiglu_kernel[(triton_cdiv(num_pid_m * bm, br), nb)](
            dh, saved, wts, aw, dwp, lay.sorted_slots, lay.num_tiles, I, slots, dh.stride(0), saved.stride(0),
            aw.stride(0), TILE_M=bm, BLOCK_R=br, BLOCK_N=bn_e, num_warps=4,
        )  # fmt: skip
    del saved
    res = list(empty)
    if need[3]:
        res[3] = dwp.sum(dim=1).reshape(T, K).to(topk_weights.dtype)
    del dwp
    mode = c.dw_mode
    if mode and (need[1] or need[2]):  # token rows of x and dO gathered once into layout order
        sl = lay.sorted_slots.long()
        tok = torch.where((sl >= 0) & (sl < slots), sl // K, 0)  # rows past num_tiles: unspecified
        del sl

    def rows_of(t):  # t[tok] in layout order; mode 2: transposed [features, rows]
        g = t.index_select(0, tok)
        return g if mode == 1 else g.t().contiguous()

    def dw_gemm(i, a, b, a_t, a_g, b_g, c_t, m, n):
        dw = torch.empty(src[i].shape, dtype=src[i].dtype, device=dev)
        _moe_bwd_dw_kernel[(E_local * triton_cdiv(m, c.bm_w) * triton_cdiv(n, c.bn_w),)](
            a, b, dw, lay.sorted_slots, lay.expert_offsets, lay.expert_counts, m, n, K, a.stride(0),
            b.stride(0), dw.stride(0), dw.stride(1), A_T=a_t, A_GATHER=a_g, B_GATHER=b_g, C_T=c_t,
            BLOCK_M=c.bm_w, BLOCK_N=c.bn_w, BLOCK_K=c.bk_w, GROUP_M=c.group_m, DOT_PREC=prec,
            num_warps=c.warps_w, num_stages=c.stages_w,
        )  # fmt: skip
        res[i] = dw

    # order: dW2 (then aw is freed), dX (its per-slot rows freed), dW13 (then dh is freed)
    if need[2]:  # dW2 [H, I] = dO_e^T @ aw_e
        if mode == 0:
            dw_gemm(2, dout, aw, False, True, False, False, H, I)
        else:
            dw_gemm(2, rows_of(dout), aw, mode == 2, False, False, False, H, I)
    del aw
    if need[0]:
        dx = (torch.empty if num_pid_m else torch.zeros)(T, H, dtype=x.dtype, device=dev)  # reduce writes all
        if num_pid_m:
            dxs = torch.empty(slots, H, dtype=x.dtype, device=dev)
            _moe_bwd_dx_kernel[(num_pid_m * triton_cdiv(H, c.bn_x),)](
                dh, w13, dxs, lay.sorted_slots, lay.tile_expert, lay.num_tiles, num_pid_m, H, two_i, slots,
                dh.stride(0), w13.stride(0), w13.stride(1), dxs.stride(0), EVEN_K=two_i % c.bk_x == 0,
                BLOCK_M=bm, BLOCK_N=c.bn_x, BLOCK_K=c.bk_x, GROUP_M=c.group_m, DOT_PREC=prec,
                num_warps=c.warps_x, num_stages=c.stages_x,
            )  # fmt: skip
            bh = min(1024, max(16, 1 << (H - 1).bit_length()))
            _moe_reduce_kernel[(T, triton_cdiv(H, bh))](
                dxs, ids, dx, H, K, offset, E_local, dxs.stride(0), dx.stride(0), BLOCK_H=bh, num_warps=4
            )
            del dxs
        res[0] = dx
    if need[1]:  # dW13 [2I, H] = dh_e^T @ x_e  (mode 2: dW13^T = x_e^T @ dh_e, stored transposed)
        if mode == 0:
            dw_gemm(1, dh, x, False, False, True, False, two_i, H)
        elif mode == 1:
            dw_gemm(1, dh, rows_of(x), False, False, False, False, two_i, H)
        else:
            dw_gemm(1, rows_of(x), dh, True, False, False, True, H, two_i)
    return tuple(res)


def _config_tuple(c: MoEConfig) -> list[int]:
    return [int(c.direct), c.block_m, c.block_n1, c.block_k1, c.warps1, c.stages1, c.block_n2, c.block_k2,
            c.warps2, c.stages2, c.group_m]  # fmt: skip


@torch.library.custom_op("replaymoe::moe_experts", mutates_args=("out",))
def _moe_experts_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    local_expert_offset: int,
    out: torch.Tensor,
    config: list[int],
) -> None:
    """Validated-elsewhere Triton experts (custom op so torch.compile treats it as one opaque call)."""
    _launch(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            MoEConfig(bool(config[0]), *config[1:]))  # fmt: skip


@_moe_experts_op.register_fake
def _(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, config) -> None:
    return None


def _launch(
    x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, offset, out, c: MoEConfig, saved=None
) -> None:
    """Launch layout + GEMM1 + GEMM2 + reduce into ``out``; ``saved`` [T*K, 2I] (optional, not fp8)
    receives GEMM1's gate/up outputs per slot for the backward."""
    from ._kernels.moe import _moe_gemm1_kernel, _moe_gemm2_kernel, _moe_reduce_kernel, _quant_groups_kernel
    from ._launch import fast
    from .layout import expert_layout

    T, H = x.shape
    if T == 0:
        return
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    fp8 = w13_scale is not None
    x = x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    slots = T * K
    dev = x.device
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    inter_dt = torch.bfloat16 if fp8 else x.dtype
    s13 = w13_scale if fp8 else w13
    s2 = w2_scale if fp8 else w2
    s13_strides = (s13.stride(0), s13.stride(1)) if fp8 else (0, 0)
    s2_strides = (s2.stride(0), s2.stride(1)) if fp8 else (0, 0)
    if c.direct:
        rows, num_pid_m = slots, slots
        sorted_slots = tile_expert = num_tiles = ids  # unused in DIRECT mode
    else:
        lay = expert_layout(ids, E_local, block_m=c.block_m, local_expert_offset=offset)
        sorted_slots, tile_expert, num_tiles = lay.sorted_slots, lay.tile_expert, lay.num_tiles
        num_pid_m = lay.max_tiles
        rows = max(lay.sorted_slots.shape[0], 1)
    preq = fp8 and not c.direct and c.block_n1 == 128
    if preq:  # quantize x once; GEMM1 writes e4m3 SwiGLU rows + per-128 scales
        xq = torch.empty(T, H, dtype=_FP8, device=dev)
        xs = torch.empty(T, H // 128, dtype=torch.float32, device=dev)
        g = 8
        fast(_quant_groups_kernel)[(T, triton_cdiv(H // 128, g))](
            x, xq, xs, H // 128, x.stride(0), G=g, num_warps=4
        )
        inter = torch.empty(rows, I, dtype=_FP8, device=dev)
        inter_s = torch.empty(rows, I // 128, dtype=torch.float32, device=dev)
    else:
        xq, xs = x, x
        inter = torch.empty(rows, I, dtype=inter_dt, device=dev)
        inter_s = inter
    if num_pid_m == 0:
        out.zero_()
        return
    grid1 = (num_pid_m * triton_cdiv(I, c.block_n1),)
    save = saved is not None and saved.numel() > 0
    h_buf = saved if save else inter
    fast(_moe_gemm1_kernel)[grid1](
        xq, xs, w13, s13, inter, inter_s, h_buf, ids, sorted_slots, tile_expert, num_tiles, num_pid_m, H, I,
        K, slots, offset, E_local, xq.stride(0), w13.stride(0), w13.stride(1), *s13_strides,
        inter.stride(0), h_buf.stride(0), DIRECT=c.direct, FP8=fp8, PREQ=preq, SAVE_H=save,
        STORE_ACT=True, EVEN_K=H % c.block_k1 == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n1, BLOCK_K=c.block_k1,
        GROUP_M=c.group_m, DOT_PREC=prec, num_warps=c.warps1, num_stages=c.stages1,
    )  # fmt: skip
    y = torch.empty(slots, H, dtype=out.dtype, device=dev)
    grid2 = (num_pid_m * triton_cdiv(H, c.block_n2),)
    fast(_moe_gemm2_kernel)[grid2](
        inter, inter_s, w2, s2, y, ids, wts, sorted_slots, tile_expert, num_tiles, num_pid_m, H, I, slots,
        offset, E_local, inter.stride(0), w2.stride(0), w2.stride(1), *s2_strides, y.stride(0),
        DIRECT=c.direct, FP8=fp8, PREQ=preq, EVEN_K=I % c.block_k2 == 0, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n2, BLOCK_K=c.block_k2, GROUP_M=c.group_m, DOT_PREC=prec, num_warps=c.warps2,
        num_stages=c.stages2,
    )  # fmt: skip
    bh = min(1024, max(16, 1 << (H - 1).bit_length()))
    fast(_moe_reduce_kernel)[(T, triton_cdiv(H, bh))](
        y, ids, out, H, K, offset, E_local, y.stride(0), out.stride(0), BLOCK_H=bh, num_warps=4
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swap_gate_up(w13: torch.Tensor, w13_scale: torch.Tensor | None = None):
    """Swap the two halves of w13 [E, 2I, H] (and of its fp8 scale [E, 2I/128, H/128]).

    Converts between replaymoe / vLLM / transformers order (gate rows first) and FlashInfer TRT-LLM
    order (up rows first); the operation is its own inverse. Returns a new contiguous tensor (or a
    ``(w13, w13_scale)`` pair when a scale is given).
    """
    check_tensor("w13", w13, ndim=3)
    if w13.shape[1] % 2:
        fail("w13", "[E, 2I, H] with an even 2I", tuple(w13.shape), what="shape")
    i = w13.shape[1] // 2
    swapped = torch.cat([w13[:, i:], w13[:, :i]], dim=1)
    if w13_scale is None:
        return swapped
    check_tensor("w13_scale", w13_scale, ndim=3)
    if w13_scale.shape[1] % 2 or (i % 128 and w13_scale.shape[1] * 128 != w13.shape[1]):
        fail("w13_scale", "[E, 2I/128, H/128] with I a multiple of 128", tuple(w13_scale.shape), what="shape")
    j = w13_scale.shape[1] // 2
    return swapped, torch.cat([w13_scale[:, j:], w13_scale[:, :j]], dim=1)


class MoELayer(nn.Module):
    """Router + experts: ``forward(x [..., H]) -> [..., H]`` through :func:`fused_moe`.

    Trainable: gradients reach ``router.weight`` (through the routing weights), ``w13`` and ``w2``
    on every backend (see :func:`fused_moe`, "Gradients"); ``recompute`` (keyword) trades the saved
    GEMM1 rows for recomputation in the backward.

    Parameters
    ----------
    hidden_size, intermediate_size, num_experts, top_k : int
        H, I, E (all ranks), K.
    method : RoutingMethod, optional
        Default ``RENORMALIZE`` (softmax, top-k, renormalize).
    n_group, topk_group, routed_scaling_factor : optional
        DeepSeek-V3 style routing arguments, passed to ``route``.
    router_bias : bool
        Keep a per-expert fp32 selection bias (DeepSeek-V3's ``e_score_correction_bias``) as buffer
        ``router_bias`` [E] (zeros at init).
    num_local_experts, local_expert_offset : int, optional
        Expert-parallel slice held by this module (default: all experts); the output is then a partial
        sum over this slice.
    dtype, device : parameter dtype / device.
    backend : "auto" | "triton" | "torch".
    recompute : bool
        Passed to :func:`fused_moe` (training: recompute GEMM1 in the backward instead of saving it).

    Attributes
    ----------
    router : nn.Linear(H, E, bias=False)
    w13 : Parameter [E_local, 2I, H] (gate rows first)
    w2 : Parameter [E_local, H, I]
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        method=None,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float | None = None,
        router_bias: bool = False,
        num_local_experts: int | None = None,
        local_expert_offset: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        recompute: bool = False,
    ) -> None:
        super().__init__()
        H = check_int("hidden_size", hidden_size, low=1)
        I = check_int("intermediate_size", intermediate_size, low=1)  # noqa: E741
        E = check_int("num_experts", num_experts, low=1)
        check_int("top_k", top_k, low=1, high=E)
        check_int("local_expert_offset", local_expert_offset, low=0, high=E - 1)
        E_local = E - local_expert_offset if num_local_experts is None else num_local_experts
        check_int("num_local_experts", E_local, low=1, high=E - local_expert_offset)
        check_choice("backend", backend, _BACKENDS)
        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = H, I, E, top_k
        self.method, self.n_group, self.topk_group = method, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.local_expert_offset, self.num_local_experts, self.backend = local_expert_offset, E_local, backend
        if not isinstance(recompute, bool):
            fail("recompute", "a bool", type(recompute).__name__, what="type")
        self.recompute = recompute
        kw = {"dtype": dtype, "device": device}
        self.router = nn.Linear(H, E, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(E_local, 2 * I, H, **kw))
        self.w2 = nn.Parameter(torch.empty(E_local, H, I, **kw))
        if router_bias:
            self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.router_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init with std 1/sqrt(fan_in) for the experts (router: nn.Linear's default)."""
        self.router.reset_parameters()
        with torch.no_grad():
            self.w13.normal_(0.0, self.hidden_size**-0.5)
            self.w2.normal_(0.0, self.intermediate_size**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        *,
        routing_replay_out: torch.Tensor | None = None,
        replay_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., H] → [..., H]; ``routing_replay_out`` / ``replay_ids`` as in :func:`fused_moe`."""
        check_tensor("x", x)
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            fail("x", f"[..., H={self.hidden_size}]", tuple(x.shape), what="shape")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        logits = self.router(x2)
        y = fused_moe(
            x2,
            self.w13,
            self.w2,
            router_logits=logits,
            top_k=self.top_k,
            method=self.method,
            bias=self.router_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            routing_replay_out=routing_replay_out,
            replay_ids=replay_ids,
            local_expert_offset=self.local_expert_offset,
            num_experts=self.num_experts,
            backend=self.backend,
            recompute=self.recompute,
        )
        return y.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, local=[{self.local_expert_offset}, "
            f"+{self.num_local_experts})"
        )

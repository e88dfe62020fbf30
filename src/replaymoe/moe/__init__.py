"""Fused Mixture-of-Experts layer: routing (optional) + grouped-GEMM experts + top-k reduction.

Public entry points
-------------------
* :func:`fused_moe` — validated wrapper; ``backend="auto" | "triton" | "torch"``.
* :func:`fused_moe_torch` — the executable spec: a naive per-expert loop in fp32.
* :class:`MoELayer` — router ``Linear(H, E)`` + experts, for users who build models.
* :func:`swap_gate_up` — convert w13 between our order (gate rows first) and
  FlashInfer TRT-LLM's order (up rows first).
* :class:`ClampedSwiGLU` — gpt-oss's activation, ``activation=ClampedSwiGLU(alpha, limit)``.
* :func:`raise_id_errors` — wait for the GPU and raise the error of bad caller ``topk_ids`` at once
  (``fused_moe`` checks them on the device and raises at its next call).

Semantics (DESIGN.md, "Fused MoE")::

    out[t] = sum over k with  local_expert_offset <= topk_ids[t, k] < local_expert_offset + E_local  of
             topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
             e = topk_ids[t, k] - local_expert_offset

With the keyword options, ``w13[e] @ x_t`` gains ``w13_bias[e]``, ``w2[e] @ a`` gains ``w2_bias[e]``
(inside the routing weight), the gate and up rows may be interleaved (``gate_up_layout``) and the
activation may be :class:`ClampedSwiGLU` (gpt-oss experts).

Routing is always over all ``num_experts`` experts with global ids; a rank holding only the slice
``[local_expert_offset, +E_local)`` produces a partial sum (expert parallelism). Ids outside the
slice — and ``-1``, a slot with no expert (EP dispatch's padding) — contribute nothing. Caller-given
``topk_ids`` must lie in ``[0, num_experts)`` or be ``-1``, with no id twice in a row (checked unless
``check_ids=False``). On CUDA the Triton experts check them on the device, inside the kernel that
reads them first (no launch, no host sync, CUDA graphs included); the ValueError comes at the next
``fused_moe`` call on that device, or at :func:`raise_id_errors`.

The package, one op: this module (the public entry points and their documentation), ``_validate``
(argument checks, once per call), ``_reference`` (the torch spec: forward loop and closed-form
backward, :class:`ClampedSwiGLU`), ``configs`` (tuned tables, heuristics, hardware switches),
``_forward`` and ``_backward`` (the Triton host side: launchers, ``replaymoe::`` custom ops, autograd),
``layout`` (the expert-sorted token layout) and ``quant`` (fp8 block-scale helpers), and the Triton code
``_kernel_gemm1``, ``_kernel_gemm2``, ``_kernel_common``, ``_kernel_quant``, ``_kernel_swapped``,
``_kernel_bwd_dx``, ``_kernel_bwd_dw`` and ``_kernel_layout`` (the device-side id check they run lives in
``routing``: ``_kernel_ids``, ``_id_mailbox``). ``MoEConfig``, ``moe_config``,
``MoEBwdConfig``, ``moe_bwd_config`` and ``experts_backward_torch`` are re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._backend import BACKENDS, resolve_backend
from .._validation import check_choice, check_int, check_tensor, fail
from ..routing import RoutingConfig, RoutingMethod, as_routing
from ..routing._dispatch import run_route
from ..routing._id_mailbox import raise_id_errors as raise_id_errors  # re-exported here
from ._backward import experts_triton_train
from ._forward import STANDARD, ExpertsVariant, experts_triton
from ._reference import ClampedSwiGLU as ClampedSwiGLU  # re-exported: replaymoe.moe.ClampedSwiGLU
from ._reference import experts_backward_torch as experts_backward_torch  # re-exported
from ._reference import experts_torch
from ._validate import ACT_DTYPES, REF_DTYPES, check_activation, validate_call
from .configs import MoEBwdConfig as MoEBwdConfig  # re-exported: replaymoe.moe.MoEBwdConfig
from .configs import MoEConfig as MoEConfig  # re-exported: replaymoe.moe.MoEConfig
from .configs import moe_bwd_config as moe_bwd_config  # re-exported: replaymoe.moe.moe_bwd_config
from .configs import moe_config as moe_config  # re-exported: replaymoe.moe.moe_config

__all__ = ["fused_moe", "fused_moe_torch", "MoELayer", "swap_gate_up", "ClampedSwiGLU", "raise_id_errors"]


def _variant(w13_bias, w2_bias, activation, gate_up_layout, id_bound: int) -> ExpertsVariant:
    """The Triton side's description of a validated call's expert options (``id_bound``: E when the
    kernels check the caller's ids on the device, else 0)."""
    clamped = isinstance(activation, ClampedSwiGLU)
    if w13_bias is None and w2_bias is None and not clamped and gate_up_layout == "halves":
        return (_CHECKED.get(id_bound) or _checked_standard(id_bound)) if id_bound else STANDARD
    return ExpertsVariant(
        w13_bias,
        w2_bias,
        1 if clamped else 0,
        activation.alpha if clamped else 0.0,
        activation.limit if clamped else 0.0,
        gate_up_layout == "interleaved",
        id_bound,
    )


_CHECKED: dict[int, ExpertsVariant] = {}  # eager: one standard-with-check variant per expert count


def _checked_standard(id_bound: int) -> ExpertsVariant:
    """The standard experts with the device-side id check against ``[-1, id_bound)``: one object per E,
    kept by eager calls (under ``torch.compile`` a new E's is not kept: dynamo would only warn)."""
    v = _CHECKED.get(id_bound)  # (the eager steady state: one dict lookup)
    if v is None:
        v = ExpertsVariant(id_bound=id_bound)
        if not torch.compiler.is_compiling():
            _CHECKED[id_bound] = v
    return v


def fused_moe_torch(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, **kwargs
) -> torch.Tensor:
    """Reference fused MoE: routing through ``route(..., backend="torch")``, then a per-expert loop in fp32.

    Same arguments and semantics as :func:`fused_moe` (minus ``backend``). The fp8 path dequantizes
    the weights per 128×128 block and passes the activations through the same per-1×128-group fp8
    quantization the kernels apply (both GEMM inputs), so it is the exact spec of the fp8 kernels up
    to accumulation order (the SwiGLU rows are rounded to bf16 before their quantization, as in the
    kernels). Runs on any device; host-synchronizing.
    """
    if "backend" in kwargs:
        fail("backend", "not given to fused_moe_torch (it is the torch backend)", kwargs["backend"])
    return fused_moe(hidden_states, w13, w2, backend="torch", **kwargs)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    router_logits: torch.Tensor | None = None,
    top_k: int | None = None,
    method: RoutingMethod | None = None,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    routing: RoutingConfig | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    routing_replay_out: torch.Tensor | None = None,
    replay_ids: torch.Tensor | None = None,
    routing_weights_out: torch.Tensor | None = None,
    replay_weights: torch.Tensor | None = None,
    activation: str | ClampedSwiGLU = "swiglu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gate_up_layout: str = "halves",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    local_expert_offset: int = 0,
    num_experts: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    recompute: bool = False,
    batch_invariant: bool = True,
    check_ids: bool = True,
) -> torch.Tensor:
    """Mixture-of-Experts layer: ``out[t] = Σ_k w[t,k] · w2[e] @ swiglu(w13[e] @ x_t)`` over local experts.

    Parameters
    ----------
    hidden_states : Tensor [T, H], bfloat16 / float16 (float32 on the torch/CPU path)
    w13 : Tensor [E_local, 2I, H]
        Rows [0, I) are the gate half, [I, 2I) the up half (vLLM / transformers order; see
        :func:`swap_gate_up` for FlashInfer TRT-LLM's order; ``gate_up_layout="interleaved"``:
        gate row j is row 2j, up row j is row 2j + 1). Same dtype as ``hidden_states``, or
        float8_e4m3fn with ``w13_scale``. Any strides (bf16 / fp16 / fp32): a transposed view such
        as gpt-oss's ``gate_up_proj.transpose(1, 2)`` is read in place, not copied.
    w2 : Tensor [E_local, H, I], same dtype as ``w13``; any strides (e.g. ``down_proj.transpose(1, 2)``).
    router_logits : Tensor [T, E], optional
        Route inside, exactly as :func:`replaymoe.routing.route` with ``top_k``, ``method`` (default
        ``RoutingMethod.RENORMALIZE``), ``bias``, ``n_group``, ``topk_group``,
        ``routed_scaling_factor``, ``routing_replay_out`` (int16 [>=T, K], capture),
        ``replay_ids`` ([T, K], forced selection), ``routing_weights_out`` (fp32 [>=T, K], the
        weights captured) and ``replay_weights`` (fp32 [T, K], the forced rows' weights: full
        recall) — all only allowed with ``router_logits``.
    routing : RoutingConfig, optional
        The routing arguments above (``top_k`` … ``routed_scaling_factor``) as one object,
        validated once when it was built; give it or them, not both.
    topk_ids : Tensor [T, K], int32 / int64, optional
        Routing given by the caller: global expert ids, each in ``[0, num_experts)`` (the whole
        model's experts, not this rank's slice) or ``-1`` (a slot with no expert: expert-parallel
        padding and the slots of other ranks' experts, as ``MoeAlltoAll.dispatch`` marks them;
        any number per row, whole rows too), no id twice in a row; checked unless ``check_ids`` is
        False. Ids outside ``[local_expert_offset, +E_local)`` contribute nothing.
    topk_weights : Tensor [T, K], float32 / bfloat16 / float16 — required with ``topk_ids``.
    activation : "swiglu" or ClampedSwiGLU
        ``"swiglu"``: ``silu(gate) * up``; :class:`ClampedSwiGLU` ``(alpha, limit)``: gpt-oss's
        ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
    w13_bias : Tensor [E_local, 2I], optional
        Added to GEMM1's output before the activation; rows in w13's row order (so interleaved
        with ``gate_up_layout="interleaved"``). float32 or w13's dtype; any strides.
    w2_bias : Tensor [E_local, H], optional
        Added to GEMM2's output, inside the routing weight: ``w[t,k] * (w2[e] @ a + w2_bias[e])``.
        float32 or w2's dtype; any strides.
    gate_up_layout : "halves" | "interleaved"
        How w13's rows hold gate and up: ``"halves"`` (default) gate rows [0, I), up rows [I, 2I);
        ``"interleaved"`` (gpt-oss) gate row j at 2j, up row j at 2j + 1.
    w13_scale : Tensor [E_local, 2I/128, H/128], float32, optional
    w2_scale : Tensor [E_local, H/128, I/128], float32, optional
        fp8 block-scale (DeepSeek style) when given: weights are ``fp8 × scale`` per 128×128 block,
        activations are quantized on the fly per 1×128 group; H and I must be multiples of 128;
        the output is bfloat16. The standard experts only: no biases, ``"halves"``, ``"swiglu"``.
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
        kernel (less memory, more time). No effect on the forward's values. Eagerly, the backward
        frees the saved rows as soon as it has read them, so a graph through ``fused_moe`` can be
        differentiated once (a second ``backward`` with ``retain_graph=True`` raises
        RuntimeError); ``True`` allows any number.
    batch_invariant : bool, keyword-only
        fp8 only (bf16 and fp16 outputs are batch-invariant in every configuration): ``True`` keeps
        a token's output bitwise the same whatever T is and whichever tokens share the batch (every
        fp8 configuration runs one MMA kind: 64-row tiles, or the swapped kernels with the weights on
        the MMA's 64 rows, ``moe.configs.fp8_invariant``); ``False`` lets decode-size batches use
        16/32-row tiles on Hopper's narrower MMA, faster there (docs/TUNING.md) but rounding
        differently from larger batches.
    check_ids : bool, keyword-only
        ``True`` (default) checks the values of caller-given ids: ``topk_ids`` (above), or
        ``replay_ids`` with ``router_logits`` (as :func:`replaymoe.routing.route` does with
        ``check_replay=True``). ``topk_ids`` on CUDA (Triton backend): checked on the device by the
        kernel that reads them first (the layout, or GEMM1 in direct mode), with no launch and no host
        sync, eagerly, under ``torch.compile`` and in CUDA graphs; a bad id raises at the next
        ``fused_moe`` call on that device once the GPU has run this one (or at
        :func:`raise_id_errors`), and this call's output is unspecified. Elsewhere (the CPU, the
        torch backend, and ``replay_ids``): eagerly on the host (one host sync on a GPU), under
        ``torch.compile`` inside the graph (the ops ``replaymoe::check_topk_ids`` /
        ``check_replay_ids``), skipped while a CUDA graph is being captured. CUDA ids that
        :func:`~replaymoe.routing.route` returned, unmodified, are not checked again (a write
        through ``.data`` is not seen: pass such ids as a copy). ``False``
        skips the check, for callers whose ids come from a trusted producer (a validated trace):
        invalid ids are then silently dropped or counted twice.

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states`` (bfloat16 on the fp8 path). Under expert parallelism a
    partial sum over this rank's experts. ``T = 0`` gives an empty output.

    Gradients
    ---------
    Differentiable (bf16/fp16/fp32, every backend) with respect to ``hidden_states``, ``w13``, ``w2``,
    ``topk_weights``, ``w13_bias`` and ``w2_bias`` (gradients of strided views reach their bases; the
    clamped activation passes none where a clamp is active); with routing inside (``router_logits``, also
    with ``replay_ids``), the weights' gradient flows on to ``router_logits`` through
    :func:`replaymoe.routing.route`'s backward (``bias`` and the ids get none). The torch backend
    differentiates the reference by autograd; the Triton backend registers a backward on its custom op
    (``torch.ops.replaymoe.moe_experts_train``, so it works under ``torch.compile``) that runs Triton
    kernels: deterministic (no float atomics, every reduction in a fixed order), bitwise equal from run to
    run. Tokens routed to non-local experts get zero gradient from this rank; experts without tokens get
    zero weight gradients. The fp8 block-scale path is inference-only (a ValueError is raised when an
    input requires grad). The forward's values are the same with and without gradients.

    Raises
    ------
    ValueError
        Naming the argument: shape/dtype/device mismatches between hidden_states, w13, w2 and the scales
        and biases; fp8 dims not multiples of 128; fp8 with biases, interleaved rows or the clamped
        activation; wrong topk dtypes; ``topk_ids`` values outside ``[0, num_experts)`` other than
        ``-1``, or an id twice in a row (the message gives the row and the id; on CUDA at the next
        call, see ``check_ids``); bad
        ``gate_up_layout``; routing arguments together with topk tensors; missing routing; bad
        ``activation``, ``backend``, ``recompute``, ``batch_invariant`` or ``check_ids``; fp8 weights
        with an input that requires grad; float64 on the Triton backend.
    """
    check_choice("backend", backend, BACKENDS)
    if not isinstance(recompute, bool):
        fail("recompute", "a bool", type(recompute).__name__, what="type")
    if not isinstance(batch_invariant, bool):
        fail("batch_invariant", "a bool", type(batch_invariant).__name__, what="type")
    if not isinstance(check_ids, bool):
        fail("check_ids", "a bool", type(check_ids).__name__, what="type")
    on_cuda = isinstance(hidden_states, torch.Tensor) and hidden_states.is_cuda
    use_triton = backend == "triton" or (backend == "auto" and on_cuda)
    # the routing keywords, once: folded into one RoutingConfig with router_logits (validate_call checks
    # the rest, route()'s per-call checks included), refused beside the caller's topk tensors (logits and
    # topk tensors together: validate_call's error)
    if router_logits is not None and topk_ids is None and topk_weights is None:
        routing = as_routing(routing, top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    elif topk_ids is not None and topk_weights is not None:
        loose = (("top_k", top_k), ("method", method), ("bias", bias), ("n_group", n_group),
                 ("topk_group", topk_group), ("routed_scaling_factor", routed_scaling_factor))  # fmt: skip
        for name, value in loose:
            if value is not None:
                fail(
                    name,
                    "None when topk_ids/topk_weights are given (routing arguments apply only with "
                    "router_logits)",
                    f"{name} given",
                )
    p = validate_call(
        hidden_states,
        w13,
        w2,
        router_logits=router_logits,
        routing=routing,
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
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        gate_up_layout=gate_up_layout,
        act_dtypes=ACT_DTYPES if use_triton else REF_DTYPES,
        check_ids=check_ids,
        triton=use_triton,
        routing_weights_out=routing_weights_out,
        replay_weights=replay_weights,
    )
    if use_triton:
        resolve_backend(backend, hidden_states)  # 'triton' on CPU needs the interpreter
    grad_inputs = [t for t in (hidden_states, w13, w2, topk_weights, w13_bias, w2_bias) if t is not None]
    # (router_logits: the routing weights follow them) decided before routing writes the caller's buffers
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*grad_inputs, router_logits) if t is not None
    )
    if needs_grad and p.fp8:
        fail(
            "w13_scale",
            "None when gradients are required (the fp8 block-scale path is inference-only)",
            "fp8 weights with an input that requires grad",
        )
    if out is not None and out.requires_grad and out.is_leaf and torch.is_grad_enabled():
        fail("out", "no leaf tensor that requires grad (the result is written into it in place)",
             "a leaf that requires grad")  # fmt: skip
    if router_logits is not None:
        # validated in _validate (routing's own checks included): no second pass here
        assert p.route_params is not None and p.routing is not None  # set with router_logits
        topk_ids, topk_weights = run_route(
            router_logits,
            p.routing,
            p.route_params,
            routing_replay_out,
            p.replay_ids,
            "triton" if use_triton else "torch",
            routing_weights_out=routing_weights_out,
            replay_weights=p.replay_weights,
        )
    else:
        topk_ids = p.topk_ids  # as validated (under torch.compile: through the check op)
    if router_logits is not None and topk_weights is not None:
        grad_inputs.append(topk_weights)  # route's weights (the experts' gradient reaches the router)
    if p.T == 0:
        res = hidden_states.new_empty((0, p.H), dtype=p.out_dtype)
        if needs_grad:  # connected to the inputs, so that their gradients are zeros (not None)
            res = res + sum(t.reshape(-1)[:0].sum().to(p.out_dtype)
                            for t in grad_inputs if t.requires_grad)  # fmt: skip
        return out.copy_(res) if out is not None else res
    args = (hidden_states, w13, w2, topk_ids, topk_weights)
    if use_triton:
        variant = _variant(w13_bias, w2_bias, activation, gate_up_layout, p.id_bound)
        if not needs_grad:  # inference: writes into out itself
            return experts_triton(
                *args,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                local_expert_offset=local_expert_offset,
                out=out,
                batch_invariant=batch_invariant,
                variant=variant,
            )
        res = experts_triton_train(
            *args, local_expert_offset=local_expert_offset, recompute=recompute, variant=variant
        )
    else:
        res = experts_torch(
            *args,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            local_expert_offset=local_expert_offset,
            out_dtype=p.out_dtype,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            activation=activation,
            gate_up_layout=gate_up_layout,
        )
    return res if out is None else out.copy_(res)


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
    hidden_size, intermediate_size, num_experts : int
        H, I, E (all ranks).
    top_k : int, optional
        K; or give ``routing``.
    routing : RoutingConfig, optional
        The routing as one object (as :func:`fused_moe` takes it), instead of ``top_k`` and the
        keywords below; its ``bias``, when it has one, becomes the ``router_bias`` buffer (an fp32
        copy, [E]).
    method : RoutingMethod, optional
        Default ``RENORMALIZE`` (softmax, top-k, renormalize).
    n_group, topk_group, routed_scaling_factor : optional
        DeepSeek-V3 style routing arguments, passed to ``route``.
    router_bias : bool
        Keep a per-expert fp32 selection bias (DeepSeek-V3's ``e_score_correction_bias``) as buffer
        ``router_bias`` [E] (zeros at init; implied by a ``routing`` with a bias).
    num_local_experts, local_expert_offset : int, optional
        Expert-parallel slice held by this module (default: all experts); the output is then a partial
        sum over this slice.
    dtype, device : parameter dtype / device.
    backend : "auto" | "triton" | "torch".
    recompute : bool
        Passed to :func:`fused_moe` (training: recompute GEMM1 in the backward instead of saving it).
    activation : "swiglu" or ClampedSwiGLU
        The experts' activation (see :func:`fused_moe`).
    expert_bias : bool
        Give the experts biases on both projections (``w13_bias``, ``w2_bias``; zeros at init).

    Attributes
    ----------
    router : nn.Linear(H, E, bias=False)
    w13 : Parameter [E_local, 2I, H] (gate rows first)
    w2 : Parameter [E_local, H, I]
    w13_bias, w2_bias : Parameter [E_local, 2I] / [E_local, H], or None without ``expert_bias``
    routing : RoutingConfig
        The routing arguments folded into one object (validated once, here), passed to
        :func:`fused_moe` as ``routing=``; its ``bias`` is the ``router_bias`` buffer.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int | None = None,
        *,
        routing: RoutingConfig | None = None,
        method: RoutingMethod | None = None,
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
        activation: str | ClampedSwiGLU = "swiglu",
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        check_activation(activation)
        if not isinstance(expert_bias, bool):
            fail("expert_bias", "a bool", type(expert_bias).__name__, what="type")
        self.activation = activation
        H = check_int("hidden_size", hidden_size, low=1)
        I = check_int("intermediate_size", intermediate_size, low=1)  # noqa: E741
        E = check_int("num_experts", num_experts, low=1)
        # the one fold of the routing keywords (both or neither of routing / top_k: a ValueError)
        folded = as_routing(routing, top_k, method, None, n_group, topk_group, routed_scaling_factor)
        top_k = check_int("top_k" if routing is None else "routing.top_k", folded.top_k, low=1, high=E)
        if folded.bias is not None and tuple(folded.bias.shape) != (E,):
            fail("routing.bias", f"shape ({E},) (num_experts)", tuple(folded.bias.shape), what="shape")
        check_int("local_expert_offset", local_expert_offset, low=0, high=E - 1)
        E_local = E - local_expert_offset if num_local_experts is None else num_local_experts
        check_int("num_local_experts", E_local, low=1, high=E - local_expert_offset)
        check_choice("backend", backend, BACKENDS)
        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = H, I, E, top_k
        self.method, self.n_group, self.topk_group = folded.method, folded.n_group, folded.topk_group
        self.routed_scaling_factor = folded.routed_scaling_factor
        self.local_expert_offset, self.num_local_experts, self.backend = local_expert_offset, E_local, backend
        if not isinstance(recompute, bool):
            fail("recompute", "a bool", type(recompute).__name__, what="type")
        self.recompute = recompute
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.router = nn.Linear(H, E, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(E_local, 2 * I, H, **kw))
        self.w2 = nn.Parameter(torch.empty(E_local, H, I, **kw))
        self.w13_bias = nn.Parameter(torch.empty(E_local, 2 * I, **kw)) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(E_local, H, **kw)) if expert_bias else None
        if folded.bias is not None:
            bias = folded.bias.detach().to(device=device, dtype=torch.float32, copy=True)
            self.register_buffer("router_bias", bias)
        elif router_bias:
            self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.router_bias = None
        # validated once here; rebuilt only when the bias buffer is replaced (.to(), load_state_dict)
        self.routing = dataclasses.replace(folded, bias=self.router_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init with std 1/sqrt(fan_in) for the experts, zero biases (router: nn.Linear's default)."""
        self.router.reset_parameters()
        with torch.no_grad():
            self.w13.normal_(0.0, self.hidden_size**-0.5)
            self.w2.normal_(0.0, self.intermediate_size**-0.5)
            for b in (self.w13_bias, self.w2_bias):
                if b is not None:
                    b.zero_()

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
        if self.routing.bias is not self.router_bias:
            self.routing = dataclasses.replace(self.routing, bias=self.router_bias)
        y = fused_moe(
            x2,
            self.w13,
            self.w2,
            router_logits=logits,
            routing=self.routing,
            routing_replay_out=routing_replay_out,
            replay_ids=replay_ids,
            local_expert_offset=self.local_expert_offset,
            num_experts=self.num_experts,
            backend=self.backend,
            recompute=self.recompute,
            activation=self.activation,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
        )
        return y.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, local=[{self.local_expert_offset}, "
            f"+{self.num_local_experts})"
        )

"""Triton backward of the fused MoE, and the differentiable forward it pairs with.

:func:`experts_triton_train` is the training forward: ``replaymoe::moe_experts_train`` (the inference
launcher :func:`replaymoe.moe._forward.launch_experts`, plus the gate/up rows saved for the backward) with its
registered autograd, or eagerly :class:`_EagerTrain` (the same launches without the op's dispatch, the
forward's expert layout handed to the backward). :func:`launch_bwd` is the backward launcher (dA, SwiGLU
backward, dX, dW13, dW2, bias gradients; kernels in ``_kernel_bwd_dx.py`` and ``_kernel_bwd_dw.py``),
also the custom op
``replaymoe::moe_experts_bwd``. No argument checks here (:func:`replaymoe.moe.fused_moe` validates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._launch import cdiv, fast, next_power_of_2
from ._forward import STANDARD, ExpertsVariant, bias_args, launch_experts, rows_desc, tma_descriptor
from .configs import (
    MoEBwdConfig,
    MoEConfig,
    config_from_list,
    config_tuple,
    dw_tma_ok,
    moe_bwd_config,
    moe_config,
    sm_count,
    tma_ok,
    uses_half_tiles,
)
from .tuned import table_for

if TYPE_CHECKING:
    from .layout import ExpertLayout


def experts_triton_train(
    x, w13, w2, topk_ids, topk_weights, *, local_expert_offset, recompute, config=None, variant=STANDARD
):
    """Differentiable Triton experts (``torch.ops.replaymoe.moe_experts_train`` + its backward);
    ``config``: the forward's :class:`MoEConfig` (as :func:`~replaymoe.moe._forward.experts_triton`'s);
    the backward picks its own (:func:`launch_bwd_config`).

    The training executor that :func:`replaymoe.moe.fused_moe` ends in on the Triton path (an input
    requires grad; ``fused_moe`` copies the result into its ``out``), and that library callers holding
    the checks' results call directly (the transformers integration's experts). No argument checks:
    the caller guarantees the preconditions of :func:`~replaymoe.moe._forward.experts_triton` (for the
    standard experts: ``x`` [T, H], T >= 1, bf16/fp16 on CUDA; ``w13`` [E, 2I, H], ``w2`` [E, H, I] of
    that dtype and device; int32 ``topk_ids`` and float32 ``topk_weights`` [T, K], K <= E, there too;
    ids' values unchecked); then it returns the same tensor, bits and autograd as ``fused_moe(x, w13,
    w2, topk_ids=topk_ids, topk_weights=topk_weights, recompute=recompute)``."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    c = config or moe_config(
        T,
        K,
        H,
        two_i // 2,
        E_local,
        tma=tma_ok(x.device, x.dtype),
        table=table_for(x.device),
        itemsize=x.element_size(),
    )
    args: tuple[Any, ...]  # the op takes the config as an int list, the eager path as the object
    if torch.compiler.is_compiling():
        args = (x, w13, w2, topk_ids, topk_weights, local_expert_offset, config_tuple(c), recompute)
        out, _ = torch.ops.replaymoe.moe_experts_train(*args, *variant.op_args())
    else:  # eager (CUDA-graph capture included): the same forward and backward without op dispatch
        args = (x, w13, w2, topk_ids, topk_weights, local_expert_offset, c, recompute)
        out, _ = _EagerTrain.apply(*args, *variant.op_args())
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
    # ExpertsVariant's fields spelled out: custom_op infers the op's schema from these annotations
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: int = 0,
    alpha: float = 0.0,
    limit: float = 0.0,
    interleaved: bool = False,
    id_bound: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the differentiable experts: ``(out [T, H], saved)``.

    ``saved`` is the GEMM1 output per slot, ``[T*K, 2I]`` (gate pre-activations, bias included, in
    columns [0, I), up in [I, 2I), whatever w13's layout), rows of non-local slots unspecified;
    empty with ``recompute``. Same kernels and configuration as the inference path, so ``out`` is
    bitwise the inference output. The trailing arguments are :class:`ExpertsVariant`'s.
    """
    return _train_forward(x, w13, w2, topk_ids, topk_weights, local_expert_offset, config, recompute,
                          w13_bias, w2_bias, act, alpha, limit, interleaved, id_bound)  # fmt: skip


def _train_forward(
    x,
    w13,
    w2,
    topk_ids,
    topk_weights,
    offset,
    config,
    recompute,
    b13,
    b2,
    act,
    alpha,
    limit,
    interleaved,
    id_bound=0,
    *,
    layout_out=None,
):
    """The body of ``replaymoe::moe_experts_train``; ``layout_out`` (a list) receives the forward's
    expert layout (tile mode) for the backward to reuse."""
    T, H = x.shape
    K = topk_ids.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    saved = x.new_empty((0 if recompute else T * K, w13.shape[1]))
    v = ExpertsVariant(b13, b2, act, alpha, limit, interleaved, id_bound)
    c = config if isinstance(config, MoEConfig) else config_from_list(config)  # eager: the object
    launch_experts(x, w13, w2, topk_ids, topk_weights, None, None, offset, out, c,
            saved=None if recompute else saved, v=v, layout_out=layout_out)  # fmt: skip
    return out, saved


@_moe_train_op.register_fake
def _(x, w13, w2, topk_ids, topk_weights, local_expert_offset, config, recompute, *variant):
    T, H = x.shape
    return x.new_empty((T, H)), x.new_empty((0 if recompute else T * topk_ids.shape[1], w13.shape[1]))


def _saved_tensor_hooks_active() -> bool:
    """Whether saved tensors pass through hooks now (``torch.utils.checkpoint``'s non-reentrant
    checkpoint, ``torch.autograd.graph.save_on_cpu`` ...): those hooks must see every tensor the
    backward needs, or a checkpointed forward would keep it alive to the end of the backward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _train_setup_context(ctx, inputs, output):
    x, w13, w2, topk_ids, topk_weights, local_expert_offset, _config, recompute = inputs[:8]
    b13, b2, act, alpha, limit, interleaved, _id_bound = (
        tuple(inputs[8:]) + _TRAIN_DEFAULTS[len(inputs) - 8 :]
    )
    saved = output[1]
    ctx.offset, ctx.recompute = local_expert_offset, recompute
    ctx.variant = (act, alpha, limit, interleaved)
    ctx.eager = type(saved) is torch.Tensor  # not traced by torch.compile (fake / functional tensors)
    # the saved gate/up rows are an output only to be saved: no zero gradient [T*K, 2I] for them
    ctx.set_materialize_grads(False)
    if ctx.eager and not recompute and not _saved_tensor_hooks_active():
        # eager: the rows are handed to the backward, which frees them once the SwiGLU backward has
        # read them (before the weight gradients are allocated) instead of holding them to the end
        ctx.consumable = [saved]
        ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights, b13, b2)
    else:
        # traced (torch.compile), recompute, or saved-tensor hooks (activation checkpointing drops the
        # rows after the forward and recomputes them for the backward; save_on_cpu moves them): an
        # ordinary saved tensor, so that the hooks see it
        ctx.consumable = None
        ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights, b13, b2, saved)


def _train_backward(ctx, grad_out, _grad_saved):
    need = ctx.needs_input_grad
    flags = [bool(need[0]), bool(need[1]), bool(need[2]), bool(need[4])]
    flags += [bool(need[8]), bool(need[9])] if len(need) > 8 else [False, False]
    # the forward's expert layout (eager; small: int32 rows per slot and tile), built from the ids that
    # the backward reads (a checkpoint's recompute reproduces them)
    layout = getattr(ctx, "layout", None)
    if ctx.consumable is None:
        x, w13, w2, topk_ids, topk_weights, b13, b2, saved = ctx.saved_tensors
        holder = [saved]
        del saved
    else:
        x, w13, w2, topk_ids, topk_weights, b13, b2 = ctx.saved_tensors
        if not ctx.consumable:
            raise RuntimeError(
                "fused_moe: backward ran twice through the same graph (retain_graph=True); the Triton "
                "backward frees the forward's saved gate/up rows as it goes. Use fused_moe(..., "
                "recompute=True) for graphs that are differentiated more than once."
            )
        holder = [ctx.consumable.pop()]  # the only reference left: launch_bwd drops it when done
    if grad_out is None:  # out unused by the loss
        grad_out = torch.zeros_like(x)
    if not ctx.eager:
        dx, dw13, dw2, dwts, db13, db2 = torch.ops.replaymoe.moe_experts_bwd(
            grad_out.contiguous(), x, w13, w2, topk_ids, topk_weights, holder.pop(), ctx.offset,
            ctx.recompute, flags, b13, b2, *ctx.variant,
        )  # fmt: skip
    else:  # eager: the same launches without the op's dispatch
        v = ExpertsVariant(b13, b2, *ctx.variant)
        dx, dw13, dw2, dwts, db13, db2 = launch_bwd_config(
            grad_out.contiguous(), x, w13, w2, topk_ids, topk_weights, holder, ctx.offset, ctx.recompute,
            flags, v=v, layout=layout,
        )  # fmt: skip
    grads: tuple[torch.Tensor | None, ...]
    grads = (dx if need[0] else None, dw13 if need[1] else None, dw2 if need[2] else None, None,
             dwts if need[4] else None, None, None, None)  # fmt: skip
    if len(need) > 8:
        grads += (db13 if need[8] else None, db2 if need[9] else None) + (None,) * (len(need) - 10)
    return grads


_moe_train_op.register_autograd(_train_backward, setup_context=_train_setup_context)


class _EagerTrain(torch.autograd.Function):
    """``replaymoe::moe_experts_train`` with its registered backward, for eager calls: the same
    launches, bits and memory handling without the custom op's dispatch (a few hundred microseconds
    of host time per forward+backward), and the forward's expert layout handed to the backward (two
    launches and their host work fewer). ``torch.compile`` traces the custom op instead."""

    @staticmethod
    def forward(ctx, *inputs):
        layout: list[ExpertLayout] = []
        out, saved = _train_forward(*inputs, *_TRAIN_DEFAULTS[len(inputs) - 8 :], layout_out=layout)
        _train_setup_context(ctx, inputs, (out, saved))
        ctx.layout = layout[0] if layout else None
        ctx.mark_non_differentiable(saved)
        return out, saved

    @staticmethod
    def backward(ctx, grad_out, grad_saved):
        return _train_backward(ctx, grad_out, grad_saved)


_TRAIN_DEFAULTS = (None, None, 0, 0.0, 0.0, False, 0)  # the op's optional trailing arguments


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
    # ExpertsVariant's fields spelled out: custom_op infers the op's schema from these annotations
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: int = 0,
    alpha: float = 0.0,
    limit: float = 0.0,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``moe_experts_train``: ``(dx, dw13, dw2, dtopk_weights, dw13_bias, dw2_bias)``;
    a gradient not in ``need`` (x, w13, w2, topk_weights[, w13_bias, w2_bias]) comes back empty."""
    v = ExpertsVariant(w13_bias, w2_bias, act, alpha, limit, interleaved)
    need6 = list(need) + [False] * (6 - len(need))
    return launch_bwd_config(grad_out, x, w13, w2, topk_ids, topk_weights, saved, local_expert_offset,
                             recompute, need6, v=v)  # fmt: skip


def launch_bwd_config(
    grad_out, x, w13, w2, topk_ids, topk_weights, saved, offset, recompute, need, v=STANDARD, layout=None
):
    """:func:`launch_bwd` with the configuration :func:`moe_bwd_config` picks for the shape (and the
    device's tuned table)."""
    T, H = x.shape
    E_local, two_i, _ = w13.shape
    c = moe_bwd_config(T, topk_ids.shape[1], H, two_i // 2, E_local, tma=dw_tma_ok(x.device, x.dtype),
                       table=table_for(x.device), itemsize=x.element_size())  # fmt: skip
    return launch_bwd(grad_out, x, w13, w2, topk_ids, topk_weights, saved, offset, recompute, need, c, v=v,
                      layout=layout)  # fmt: skip


@_moe_bwd_op.register_fake
def _(grad_out, x, w13, w2, topk_ids, topk_weights, saved, local_expert_offset, recompute, need, b13=None,
      b2=None, *variant):  # fmt: skip
    need6 = list(need) + [False] * (6 - len(need))
    src = (x, w13, w2, topk_weights, b13, b2)
    return tuple(
        x.new_empty((0,)) if t is None or not n else t.new_empty(t.shape) for t, n in zip(src, need6)
    )


DW_TAIL_K = 16  # rows per piece of an expert's partial last chunk in the TMA dW GEMM (the narrowest dot)


def _dw_desc(t: torch.Tensor, rows: int, block: list[int]):
    """A TMA descriptor of the row-major 2-D view ``[rows, t.shape[-1]]`` of ``t`` with blocks
    ``block``, or None where TMA cannot address it: the last dimension not unit-stride, the rows not one
    uniform stride, the base or the row stride not a multiple of 16 bytes, a block dimension over 256
    elements or an innermost block under 16 bytes."""
    item = t.element_size()
    row_stride = t.stride(-2)
    if t.dim() == 3 and t.stride(0) != t.shape[1] * row_stride:
        return None
    if (
        t.stride(-1) != 1
        or (row_stride * item) % 16
        or t.data_ptr() % 16
        or max(block) > 256
        or block[-1] * item < 16
    ):
        return None
    return tma_descriptor(t, [rows, t.shape[-1]], [row_stride, 1], block)


def launch_bwd(
    dout,
    x,
    w13,
    w2,
    topk_ids,
    topk_weights,
    saved,
    offset,
    recompute,
    need,
    c: MoEBwdConfig,
    v=STANDARD,
    layout=None,
):
    """Triton backward: ``(dx, dw13, dw2, dtopk_weights)``, plus ``(dw13_bias, dw2_bias)`` when
    ``need`` has 6 entries (empty where ``need`` is False; a bias gradient in fp32).

    Launches: layout (2) and its compact rows (1); GEMM1 again when ``recompute``; dA; SwiGLU
    backward (elementwise); dX + k-ordered reduce; dW13; dW2; the bias gradients (per-expert row
    sums in row order). ``v``: the experts variant (biases, clamped activation, interleaved gate/up
    rows; weights with any strides). Intermediates, exactly one row per slot in the layout's compact
    order (:func:`replaymoe.moe.layout.compact_layout`, no padding rows): dh [T*K, 2I] (columns in
    w13's row order), aw [T*K, I] and, with ``dw_mode`` 1/2, the token rows of x / dO [T*K, H].
    Order (lowest peak: both weight gradients are alive only at the end): dX (then its per-slot rows
    are freed), dW13 and dB13 (then dh is freed), dW2 (next to aw and, dw_mode 1/2, the dO rows).
    ``saved`` may be a one-element list holding the only reference to the forward's gate/up rows:
    they are then freed right after the SwiGLU backward has read them (eager autograd hands them over
    so, see ``_train_setup_context``), before dX and the weight gradients are allocated.
    ``layout``: the forward's :class:`~replaymoe.moe.layout.ExpertLayout` of the same ids and offset,
    reused where its tiles are ``c.block_m`` rows (else the backward builds its own).
    """
    if isinstance(saved, list):
        saved = saved.pop()
    from ._kernel_bwd_dw import (
        moe_bwd_bias_kernel,
        moe_bwd_dw_kernel,
        moe_bwd_dw_tma_kernel,
        moe_bwd_gather_rows_kernel,
    )
    from ._kernel_bwd_dx import moe_bwd_da_kernel, moe_bwd_dx_kernel, moe_bwd_swiglu_kernel
    from ._kernel_gemm1 import moe_gemm1_kernel
    from ._kernel_gemm2 import moe_reduce_kernel
    from .layout import build_layout, compact_layout

    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    dev = x.device
    slots = T * K
    n_out = len(need)
    need = list(need) + [False] * (6 - n_out)
    b13, b2 = v.w13_bias, v.w2_bias
    src = (x, w13, w2, topk_weights, b13, b2)
    if T == 0:
        return tuple(torch.zeros_like(t) if n else _no_grad(x, t) for t, n in zip(src, need))[:n_out]
    x = x.contiguous()
    dout = dout.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    b13_args = bias_args(b13, w13)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if layout is not None and layout.block_m == c.block_m and layout.cluster == 1:
        lay = layout
    else:
        lay = build_layout(ids, E_local, c.block_m, offset, 1, True)
    cl = compact_layout(lay)  # rows of the intermediates: one per slot, no padding
    num_pid_m = lay.max_tiles
    bm = c.block_m
    if recompute:  # GEMM1 again, gate/up per slot only
        saved = torch.empty(slots, two_i, dtype=x.dtype, device=dev)
        if num_pid_m:
            bn1, bk1 = (128, 64) if bm >= 64 else (64, 128)
            fast(moe_gemm1_kernel)[(num_pid_m * cdiv(I, bn1),)](
                x, x, w13, w13, b13_args[0], saved, saved, saved, ids, lay.sorted_slots, lay.tile_expert,
                lay.num_tiles, num_pid_m, H, I, K, slots, offset, E_local, float(v.alpha), float(v.limit),
                x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), 0, 0, *b13_args[1:],
                saved.stride(0), saved.stride(0), DIRECT=False, FP8=False, PREQ_X=False, PREQ=False,
                SAVE_H=True, STORE_ACT=False, HAS_BIAS=b13 is not None, INTERLEAVED=v.interleaved, ACT=v.act,
                EVEN_K=H % bk1 == 0, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=c.group_m,
                DOT_PREC=prec, HALF_TILES=uses_half_tiles(c, False), num_warps=8 if bm >= 128 else 4,
                num_stages=4 if bm >= 64 else 3,
            )  # fmt: skip
    dh = torch.empty(slots, two_i, dtype=x.dtype, device=dev)
    aw = torch.empty(slots, I, dtype=x.dtype, device=dev)
    bn_e = 128
    nb = cdiv(I, bn_e)
    # per slot: the d topk_weights partials of each I-block (+ dO·b2 in a last column with a w2 bias),
    # summed by moe_reduce_kernel (with dX's reduce, or alone), which reads the local slots' rows only
    dwp = torch.empty(slots, nb + (b2 is not None), dtype=torch.float32, device=dev)
    if b2 is not None:  # dO[t]·b2[e] of each local slot (0 elsewhere), one [T, E_local] matmul
        local = (ids >= offset) & (ids < offset + E_local)
        dob2 = (dout.float() @ b2.float().t()).gather(1, torch.where(local, ids - offset, 0).long())
        dwp[:, nb] = torch.where(local, dob2, 0.0).reshape(-1)
    if num_pid_m:
        w2_desc = rows_desc(w2, c.bk_a, c.bn_a) if c.gemm_tma and H % c.bk_a == 0 else None
        fast(moe_bwd_da_kernel)[(num_pid_m * cdiv(I, c.bn_a),)](
            dout, w2, dh, lay.sorted_slots, lay.tile_expert, cl.expert_shift, lay.num_tiles, num_pid_m, H, I,
            K, slots, dout.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), dh.stride(0),
            INTERLEAVED=v.interleaved, EVEN_K=H % c.bk_a == 0, BLOCK_M=bm, BLOCK_N=c.bn_a, BLOCK_K=c.bk_a,
            GROUP_M=c.group_m, DOT_PREC=prec, TMA=w2_desc is not None, w_desc=w2_desc,
            HALF_TILES=uses_half_tiles(c, False), num_warps=c.warps_a, num_stages=c.stages_a,
        )  # fmt: skip
        br = 16
        fast(moe_bwd_swiglu_kernel)[(cdiv(slots, br), nb)](
            dh, saved, wts, aw, dwp, cl.compact_slots, I, slots, float(v.alpha), float(v.limit),
            dh.stride(0), saved.stride(0), aw.stride(0), dwp.stride(0), INTERLEAVED=v.interleaved,
            ACT=v.act, BLOCK_R=br, BLOCK_N=bn_e, num_warps=4,
        )  # fmt: skip
    del saved
    res: list[torch.Tensor | None] = [None] * 6
    if need[3]:
        res[3] = (torch.empty if num_pid_m else torch.zeros)(T, K, dtype=topk_weights.dtype, device=dev)

    def reduce(parts, dxs, dx):  # dx[t] = sum over k of dxs rows; parts: dwts too (or alone)
        bh = min(1024, max(16, 1 << (H - 1).bit_length()))
        has_dx = dxs is not None
        rows, dst = (dxs, dx) if has_dx else (parts, parts)
        on = parts if parts is not None else rows
        fast(moe_reduce_kernel)[(T, cdiv(H, bh) if has_dx else 1)](
            rows, ids, dst, H, K, offset, E_local, rows.stride(0), dst.stride(0), BLOCK_H=bh, PDL=False,
            dwp_ptr=on, dwts_ptr=res[3] if parts is not None else on, num_parts=on.shape[1],
            stride_dwp=on.stride(0), DWTS=parts is not None, DX=has_dx, num_warps=4,
        )  # fmt: skip

    if need[3] and num_pid_m and not need[0]:
        reduce(dwp, None, None)
    if need[5]:  # dB2 [H] = sum over the expert's rows of w·dO[t]
        res[5] = _bias_grad(moe_bwd_bias_kernel, dout, wts, lay, cl, b2, K, gather=True)
    mode = c.dw_mode

    def rows_of(t):  # t's token rows [T*K, features] in compact order; mode 2: transposed [features, T*K]
        n = t.shape[1]
        g = torch.empty(slots, n, dtype=t.dtype, device=dev)
        # 512-column blocks, 8 warps and streaming stores: the fastest of an H200 sweep (the copies are
        # read only after the rest of the backward has passed through the L2)
        bn_g = min(512, next_power_of_2(n))
        fast(moe_bwd_gather_rows_kernel)[(cdiv(slots, 8), cdiv(n, bn_g))](
            t, g, cl.compact_slots, slots, K, n, t.stride(0), g.stride(0), BLOCK_R=8, BLOCK_N=bn_g,
            num_warps=8,
        )  # fmt: skip
        return g if mode == 1 else g.t().contiguous()

    def dw_gemm(i, a, b, a_t, a_g, b_g, c_t, m, n):
        dw = torch.empty(src[i].shape, dtype=src[i].dtype, device=dev)
        if c.dw_tma and not (a_t or a_g or b_g or c_t) and dw_tma_gemm(a, b, dw, m, n):
            res[i] = dw
            return
        fast(moe_bwd_dw_kernel)[(E_local * cdiv(m, c.bm_w) * cdiv(n, c.bn_w),)](
            a, b, dw, cl.compact_slots, cl.exact_start, lay.expert_counts, m, n, K, a.stride(0),
            b.stride(0), dw.stride(0), dw.stride(1), A_T=a_t, A_GATHER=a_g, B_GATHER=b_g, C_T=c_t,
            BLOCK_M=c.bm_w, BLOCK_N=c.bn_w, BLOCK_K=c.bk_w, GROUP_M=c.group_m, DOT_PREC=prec,
            num_warps=c.warps_w, num_stages=c.stages_w,
        )  # fmt: skip
        res[i] = dw

    def dw_tma_gemm(a, b, dw, m, n):  # False (nothing launched) where a buffer does not suit TMA
        a_desc = _dw_desc(a, slots, [c.bk_w, c.bm_w])
        b_desc = _dw_desc(b, slots, [c.bk_w, c.bn_w])
        c_desc = _dw_desc(dw, E_local * m, [c.bm_w, c.bn_w]) if c.dw_c_desc and m % c.bm_w == 0 else None
        if a_desc is None or b_desc is None:
            return False
        tiles = E_local * cdiv(m, c.bm_w) * cdiv(n, c.bn_w)
        progs = min(sm_count(dev) if c.dw_progs < 0 else c.dw_progs, tiles) if c.dw_progs else 0
        # an expert's partial last chunk in 16-row pieces (the narrowest dot) on the tile grid; the
        # persistent grid keeps one masked full chunk, where the pieces lost (docs/TUNING.md, "The dW
        # tail in 16-row pieces")
        tail_k = DW_TAIL_K if progs == 0 and c.bk_w > DW_TAIL_K else c.bk_w
        a_tail = a_desc if tail_k == c.bk_w else _dw_desc(a, slots, [tail_k, c.bm_w])
        b_tail = b_desc if tail_k == c.bk_w else _dw_desc(b, slots, [tail_k, c.bn_w])
        if a_tail is None or b_tail is None:
            tail_k, a_tail, b_tail = c.bk_w, a_desc, b_desc
        fast(moe_bwd_dw_tma_kernel)[(progs or tiles,)](
            a_desc, b_desc, a_tail, b_tail, c_desc, dw, cl.exact_start, lay.expert_counts, m,
            n, tiles, dw.stride(0), dw.stride(1), C_DESC=c_desc is not None, BLOCK_M=c.bm_w, BLOCK_N=c.bn_w,
            BLOCK_K=c.bk_w, TAIL_K=tail_k, GROUP_M=c.group_m, DOT_PREC=prec, NUM_PROGS=progs,
            num_warps=c.warps_w, num_stages=c.stages_w, maxnreg=c.maxnreg_w or None,
        )  # fmt: skip
        return True

    # order (lowest peak): dX (its per-slot rows freed), dW13 + dB13 (then dh is freed), dW2 last, so
    # that only aw [T*K, I] and the dO rows sit next to both weight gradients
    if need[0]:
        dx = (torch.empty if num_pid_m else torch.zeros)(T, H, dtype=x.dtype, device=dev)  # reduce writes all
        if num_pid_m:
            dxs = torch.empty(slots, H, dtype=x.dtype, device=dev)
            w13_desc = rows_desc(w13, c.bk_x, c.bn_x) if c.gemm_tma and two_i % c.bk_x == 0 else None
            dh_desc = rows_desc(dh, bm, c.bk_x) if w13_desc is not None else None
            half = uses_half_tiles(c, False)
            dh_desc_half = rows_desc(dh, bm // 2, c.bk_x) if half and dh_desc is not None else None
            fast(moe_bwd_dx_kernel)[(num_pid_m * cdiv(H, c.bn_x),)](
                dh, w13, dxs, lay.sorted_slots, lay.tile_expert, cl.expert_shift, lay.num_tiles, num_pid_m,
                H, two_i, slots, dh.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), dxs.stride(0),
                EVEN_K=two_i % c.bk_x == 0, BLOCK_M=bm, BLOCK_N=c.bn_x, BLOCK_K=c.bk_x, GROUP_M=c.group_m,
                DOT_PREC=prec, TMA=dh_desc is not None, a_desc=dh_desc,
                w_desc=w13_desc if dh_desc is not None else None, HALF_TILES=half, a_desc_half=dh_desc_half,
                num_warps=c.warps_x, num_stages=c.stages_x,
            )  # fmt: skip
            # a descriptor holds its tensor: dh must be freed after dW13 (peak)
            del dh_desc, dh_desc_half, w13_desc
            reduce(dwp if need[3] else None, dxs, dx)
            del dxs
        res[0] = dx
    del dwp
    if need[1]:  # dW13 [2I, H] = dh_e^T @ x_e  (mode 2: dW13^T = x_e^T @ dh_e, stored transposed)
        if mode == 0:
            dw_gemm(1, dh, x, False, False, True, False, two_i, H)
        elif mode == 1:
            dw_gemm(1, dh, rows_of(x), False, False, False, False, two_i, H)
        else:
            dw_gemm(1, rows_of(x), dh, True, False, False, True, H, two_i)
    if need[4]:  # dB13 [2I] = sum over the expert's rows of dh (columns in w13's row order)
        res[4] = _bias_grad(moe_bwd_bias_kernel, dh, wts, lay, cl, b13, K, gather=False)
    del dh
    if need[2]:  # dW2 [H, I] = dO_e^T @ aw_e
        if mode == 0:
            dw_gemm(2, dout, aw, False, True, False, False, H, I)
        else:
            dw_gemm(2, rows_of(dout), aw, mode == 2, False, False, False, H, I)
    return tuple(_no_grad(x, t) if r is None else r for r, t in zip(res[:n_out], src))


def _no_grad(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """The empty placeholder of a gradient that was not asked for (the op returns tensors only)."""
    return (x if t is None else t).new_empty((0,))


def _bias_grad(kernel, src, wts, lay, cl, bias, K, *, gather):
    """Per-expert fp32 sum of ``src`` rows (compact rows, or token rows weighted by the slot's routing
    weight with ``gather``) in row order, as ``bias``'s dtype and shape [E_local, N]."""
    E_local, N = bias.shape
    db = torch.empty(E_local, N, dtype=torch.float32, device=src.device)
    bn = min(256, max(16, 1 << (N - 1).bit_length()))
    fast(kernel)[(E_local, cdiv(N, bn))](
        src, wts, db, cl.compact_slots, cl.exact_start, lay.expert_counts, N, K, src.stride(0),
        db.stride(0), GATHER=gather, BLOCK_R=16, BLOCK_N=bn, num_warps=4,
    )  # fmt: skip
    return db.to(bias.dtype)

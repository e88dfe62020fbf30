"""Triton launch side of the fused MoE: kernel configurations, launchers and ``torch.library`` ops.

One job: turn an already validated fused-MoE call into Triton launches. It holds the tuning tables
(:class:`MoEConfig` / :func:`moe_config` for the forward, :class:`MoEBwdConfig` /
:func:`moe_bwd_config` for the backward), the forward launcher (layout + GEMM1 + GEMM2 + reduce)
and the backward launcher, the custom ops ``replaymoe::moe_experts``, ``replaymoe::moe_experts_train``
and ``replaymoe::moe_experts_bwd`` with their fake implementations and autograd registration, and
the ``experts_triton*`` entry points that :mod:`replaymoe.moe` calls. No argument checks here
(:func:`replaymoe.moe.fused_moe` validates); this module never imports :mod:`replaymoe.moe`.

Size: slightly over 450 lines; the forward and backward launchers share the configurations and the
custom-op plumbing, so splitting them would make every op cross modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from .._launch import fast
from .._validation import is_capturing

_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True, eq=False)
class ExpertsVariant:
    """What the experts compute beyond the standard SwiGLU experts (validated by ``fused_moe``).

    ``w13_bias`` [E_local, 2I] (rows as w13's) and ``w2_bias`` [E_local, H]: added in the GEMM
    epilogues; ``act`` 0 = SwiGLU, 1 = clamped SwiGLU with ``alpha`` and ``limit`` (gpt-oss);
    ``interleaved``: w13's gate row j is row 2j, its up row 2j + 1 (otherwise j and I + j).
    """

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    act: int = 0
    alpha: float = 0.0
    limit: float = 0.0
    interleaved: bool = False

    def op_args(self) -> tuple:
        """The trailing arguments of the ``replaymoe::moe_experts*`` custom ops."""
        return (self.w13_bias, self.w2_bias, self.act, self.alpha, self.limit, self.interleaved)


STANDARD = ExpertsVariant()


def _bias_args(b: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(pointer, stride_be, stride_bn) of an optional bias (a dummy pointer and zero strides)."""
    return (dummy, 0, 0) if b is None else (b, b.stride(0), b.stride(1))


@dataclass(frozen=True)
class MoEConfig:
    """Kernel configuration of one fused-MoE call (chosen by :func:`moe_config` from the shape).

    ``direct``: decode mode (one tile per slot, no layout; GEMM2 writes one row per slot and the
    reduce kernel sums each token's rows); otherwise tiles of ``block_m`` rows from
    :func:`replaymoe.moe.layout.expert_layout`. ``*1`` = GEMM1 (gate/up
    + SwiGLU, its ``block_n1`` is per half), ``*2`` = GEMM2 (down projection). ``tma`` (tile mode):
    read the weights (both GEMMs) and GEMM2's SwiGLU rows through TMA tensor descriptors where the
    operands allow it (bf16 / fp16 / fp32, unit stride along K, 16-byte aligned rows; otherwise,
    and for fp8, pointer loads); the same bits either way.
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
    tma: bool = False


def config_from_list(config: list[int]) -> MoEConfig:
    """The inverse of :func:`config_tuple` (11 entries, without ``tma``, are accepted too)."""
    return MoEConfig(bool(config[0]), *config[1:11], *(bool(v) for v in config[11:12]))


# Every fp8 configuration uses tiles of this many rows: Hopper's fp8 dot at >= 64 rows (wgmma) and at
# fewer rows (the mma.sync path, through fp16) round differently, so one tile height for every T is
# what keeps the fp8 path batch-invariant (a token's bits do not depend on T); see DESIGN.
FP8_BLOCK_M = 64

# Tuned on the H200 (bench/moe_tune.py, bench/moe_notes.md); key (H, I, E_local, K, fp8, token bucket).
_TUNED: dict[tuple, MoEConfig] = {
    (7168, 2048, 256, 8, False, 1): MoEConfig(True, 16, 64, 128, 4, 4, 32, 256, 4, 4),  # DeepSeek-V3 decode
    # fp8 decode. Qwen3 T=1: GEMM1 on 64-column blocks (96 programs; 128-column blocks, which let GEMM1
    # write e4m3 rows, give it only 48: 32.4 vs 32.9 us), GEMM2 on 128 (diag/s10_fp8_sweep_h200.txt)
    (2048, 768, 128, 8, True, 1): MoEConfig(True, FP8_BLOCK_M, 64, 128, 4, 6, 128, 128, 8, 4),
    # H200 sweep, session 15 (bench/results/diag/s15/fp8_direct_sweep_h200.log): Qwen3 T=2 / 4
    # 50.1 / 81.6 -> 42.4 / 66.7 us, Mixtral T=1 178.2 -> 124.2 us (DeepSeek-V3 takes the default)
    **{
        (2048, 768, 128, 8, True, b): MoEConfig(True, FP8_BLOCK_M, 128, 128, 8, 4, 64, 128, 4, 3)
        for b in (2, 4)
    },
    (4096, 14336, 8, 2, True, 1): MoEConfig(True, FP8_BLOCK_M, 128, 128, 8, 4, 64, 128, 4, 6),
    # bf16 small batches, H200 sweep, session 15 (bench/results/diag/s15/bf16_mid_sweep_*_h200.log):
    # Mixtral T=64 712.9 -> 654.8 us, T=128 776.2 -> 755.4; Qwen3 T=8 / 32 / 64 143.1 / 266.0 / 301.0 ->
    # 139.8 / 262.0 / 297.8
    (4096, 14336, 8, 2, False, 64): MoEConfig(False, 32, 128, 128, 8, 3, 128, 128, 4, 3),
    (4096, 14336, 8, 2, False, 128): MoEConfig(False, 32, 64, 256, 4, 3, 64, 256, 4, 3),
    (2048, 768, 128, 8, False, 8): MoEConfig(False, 16, 32, 256, 4, 3, 64, 128, 4, 3),
    **{(2048, 768, 128, 8, False, b): MoEConfig(False, 16, 32, 256, 4, 3, 128, 128, 4, 3) for b in (32, 64)},
}
# fp8 entries for batch_invariant=False (16-row tiles)
_TUNED_FP8_FAST: dict[tuple, MoEConfig] = {
    (2048, 768, 128, 8, True, 1): MoEConfig(True, 16, 64, 128, 4, 4, 64, 128, 4, 4),  # Qwen3 fp8 decode
}


def _bucket(T: int) -> int:
    return 1 << max(0, (T - 1).bit_length())


# Eager calls: the host time that the direct mode saves (the 2 layout launches and their buffers),
# measured on the H200 host at decode sizes (scripts/host_profile.py).
EAGER_LAUNCH_SAVING_S = 40e-6
_HBM_BYTES_PER_S = 4.27e12


def _direct_pays_off_eagerly(slots: int, H: int, I: int, E_local: int, fp8: bool) -> bool:  # noqa: E741
    """Eager decode: the direct mode reads an expert once per slot instead of once per expert; take
    it when the expected extra weight reads cost less GPU time than the launches it saves on the host
    (an eager decode step is bound by the host)."""
    if slots > 256:
        return False
    distinct = E_local * (1.0 - (1.0 - 1.0 / E_local) ** slots)  # expected experts hit, random routing
    expert_bytes = 3 * H * I * (1 if fp8 else 2)
    return (slots - distinct) * expert_bytes / _HBM_BYTES_PER_S < EAGER_LAUNCH_SAVING_S


def moe_config(
    T: int,
    K: int,
    H: int,
    I: int,  # noqa: E741
    E_local: int,
    *,
    fp8: bool = False,
    eager: bool = False,
    batch_invariant: bool = True,
    tma: bool = False,
) -> MoEConfig:
    """Kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of size H×I.

    ``eager``: the call launches its kernels one by one from Python (not inside a CUDA graph or a
    compiled graph), so host time counts too: small batches may take the direct (decode) mode,
    which launches 3 kernels instead of 5 (no layout), where its extra weight reads cost less. Every mode
    gives a token the same bits (batch invariance), so this changes time, never results.

    ``batch_invariant`` (fp8 only; bf16/fp16 are invariant in every configuration): every fp8
    configuration uses :data:`FP8_BLOCK_M`-row tiles, so a token's output does not depend on T.
    ``False`` lets small batches take 16/32-row tiles (Hopper's mma.sync path), faster at decode
    (e.g. DeepSeek-V3 T=8) but rounding differently from the prefill tiles.

    ``tma``: the device can use TMA tensor descriptors (``experts_triton`` passes :func:`tma_ok`):
    the bf16/fp16 prefill configuration (128-row tiles) then sets :attr:`MoEConfig.tma` (H200:
    1.04-1.11x at T >= 4096, bench/moe_notes.md session 6); the bits are the same either way.

    Tuned entries (measured on the H200, bench/moe_notes.md) override the heuristics for the shapes
    they name, on any GPU; every one keeps the batch-invariance guarantee (fp8: 64-row tiles). A tuned
    tile-mode entry yields to the eager direct mode where that applies (``eager``).
    """
    table = _TUNED if not fp8 or batch_invariant else _TUNED_FP8_FAST
    tuned = table.get((H, I, E_local, K, fp8, _bucket(T)))
    slots = T * K
    eager_direct = eager and _direct_pays_off_eagerly(slots, H, I, E_local, fp8)
    if tuned is not None and (tuned.direct or not eager_direct):  # an eager decode keeps the direct mode
        return tuned
    if T == 1 or slots * 4 <= E_local or eager_direct:
        # decode: one tile per slot, each active expert's weights streamed once, split along N
        if fp8 and batch_invariant:
            # GEMM1 on 128-column blocks writes e4m3 SwiGLU rows, so GEMM2 reads them as they are instead
            # of quantizing its activation tiles in every program. H200 (bench/moe_notes.md, session 15):
            # DeepSeek-V3 T=1 / 8 146.9 / 908.9 -> 116.3 / 726.0 us
            return MoEConfig(True, FP8_BLOCK_M, 128, 128, 8, 4, 128, 128, 8, 4)
        if fp8:
            return MoEConfig(True, 16, 128, 128, 4, 3, 128, 128, 4, 3)
        return MoEConfig(True, 16, 32, 128, 4, 4, 32, 128, 4, 4)
    m_avg = slots / min(E_local, slots)  # rows per active expert
    if fp8 and batch_invariant and m_avg < 48:  # H200 sweep: 4 stages, GEMM2 on 4 warps (2-8 % faster)
        return MoEConfig(False, FP8_BLOCK_M, 128, 128, 8, 4, 128, 128, 4, 4)
    if fp8 and (batch_invariant or m_avg >= 48):
        return MoEConfig(False, FP8_BLOCK_M, 128, 128, 8, 3, 128, 128, 8, 3)
    if fp8:
        return MoEConfig(False, 16 if m_avg < 12 else 32, 128, 128, 4, 3, 128, 128, 4, 3)
    if m_avg < 12:  # H200 sweep (bench/moe_notes.md): memory-bound, deep K tiles
        return MoEConfig(False, 16, 64, 256, 4, 3, 64, 256, 4, 3)
    if m_avg < 48:
        return MoEConfig(False, 32, 64, 128, 4, 4, 64, 128, 4, 4)
    if tma and m_avg >= 256:
        # Hopper, long expert segments: GEMM1 in 32-deep K chunks, 6 stages (the same shared memory as
        # 64 x 4; the same bits). H200 sweep (bench/moe_notes.md, session 14), GEMM1 with the training
        # rows: Qwen3 T=16384 1490 -> 1454 us, Mixtral T=4096 3313 -> 3243, DSv3 T=4096 3382 -> 3332;
        # at Qwen3 T=1024 (64 rows per expert) 227 -> 231, so not below 256 rows
        return MoEConfig(False, 128, 128, 32, 8, 6, 256, 64, 8, 4, 4, tma=tma)
    return MoEConfig(False, 128, 128, 64, 8, 4, 256, 64, 8, 4, 4, tma=tma)


def experts_triton(
    x,
    w13,
    w2,
    topk_ids,
    topk_weights,
    *,
    w13_scale,
    w2_scale,
    local_expert_offset,
    out,
    config=None,
    batch_invariant=True,
    variant=STANDARD,
):
    """Run the Triton experts into ``out`` (allocated when None); returns it."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    fp8 = w13_scale is not None
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16 if fp8 else x.dtype, device=x.device)
    compiling = torch.compiler.is_compiling()
    eager = not compiling and not is_capturing()
    c = config or moe_config(T, K, H, I, E_local, fp8=fp8, eager=eager, batch_invariant=batch_invariant,
                             tma=tma_ok(x.device, x.dtype))  # fmt: skip
    if compiling:
        torch.ops.replaymoe.moe_experts(
            x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            config_tuple(c), *variant.op_args(),
        )  # fmt: skip
    else:  # eager: the same launches without the custom-op dispatch (tens of microseconds per call)
        _launch(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, c,
                v=variant)  # fmt: skip
    return out


def experts_triton_train(
    x, w13, w2, topk_ids, topk_weights, *, local_expert_offset, recompute, config=None, variant=STANDARD
):
    """Differentiable Triton experts (``torch.ops.replaymoe.moe_experts_train`` + its backward)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E_local, two_i, _ = w13.shape
    c = config or moe_config(T, K, H, two_i // 2, E_local, tma=tma_ok(x.device, x.dtype))
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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: int = 0,
    alpha: float = 0.0,
    limit: float = 0.0,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the differentiable experts: ``(out [T, H], saved)``.

    ``saved`` is the GEMM1 output per slot, ``[T*K, 2I]`` (gate pre-activations, bias included, in
    columns [0, I), up in [I, 2I), whatever w13's layout), rows of non-local slots unspecified;
    empty with ``recompute``. Same kernels and configuration as the inference path, so ``out`` is
    bitwise the inference output. The trailing arguments are :class:`ExpertsVariant`'s.
    """
    return _train_forward(x, w13, w2, topk_ids, topk_weights, local_expert_offset, config, recompute,
                          w13_bias, w2_bias, act, alpha, limit, interleaved)  # fmt: skip


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
    layout_out=None,
):
    """The body of ``replaymoe::moe_experts_train``; ``layout_out`` (a list) receives the forward's
    expert layout (tile mode) for the backward to reuse."""
    T, H = x.shape
    K = topk_ids.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    saved = x.new_empty((0 if recompute else T * K, w13.shape[1]))
    v = ExpertsVariant(b13, b2, act, alpha, limit, interleaved)
    c = config if isinstance(config, MoEConfig) else config_from_list(config)  # eager: the object
    _launch(x, w13, w2, topk_ids, topk_weights, None, None, offset, out, c,
            saved=None if recompute else saved, v=v, layout_out=layout_out)  # fmt: skip
    return out, saved


@_moe_train_op.register_fake
def _(x, w13, w2, topk_ids, topk_weights, local_expert_offset, config, recompute, *variant):
    T, H = x.shape
    return x.new_empty((T, H)), x.new_empty((0 if recompute else T * topk_ids.shape[1], w13.shape[1]))


def _train_setup_context(ctx, inputs, output):
    x, w13, w2, topk_ids, topk_weights, local_expert_offset, _config, recompute = inputs[:8]
    b13, b2, act, alpha, limit, interleaved = (
        tuple(inputs[8:]) + (None, None, 0, 0.0, 0.0, False)[len(inputs) - 8 :]
    )
    saved = output[1]
    ctx.offset, ctx.recompute = local_expert_offset, recompute
    ctx.variant = (act, alpha, limit, interleaved)
    # the saved gate/up rows are an output only to be saved: no zero gradient [T*K, 2I] for them
    ctx.set_materialize_grads(False)
    if type(saved) is torch.Tensor and not recompute:
        # eager: the rows are handed to the backward, which frees them once the SwiGLU backward has
        # read them (before the weight gradients are allocated) instead of holding them to the end
        ctx.consumable = [saved]
        ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights, b13, b2)
    else:  # traced (torch.compile) or recompute: an ordinary saved tensor
        ctx.consumable = None
        ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights, b13, b2, saved)


def _train_backward(ctx, grad_out, _grad_saved):
    need = ctx.needs_input_grad
    flags = [bool(need[0]), bool(need[1]), bool(need[2]), bool(need[4])]
    flags += [bool(need[8]), bool(need[9])] if len(need) > 8 else [False, False]
    if ctx.consumable is None:
        x, w13, w2, topk_ids, topk_weights, b13, b2, saved = ctx.saved_tensors
        if grad_out is None:  # out unused by the loss
            grad_out = torch.zeros_like(x)
        dx, dw13, dw2, dwts, db13, db2 = torch.ops.replaymoe.moe_experts_bwd(
            grad_out.contiguous(), x, w13, w2, topk_ids, topk_weights, saved, ctx.offset, ctx.recompute,
            flags, b13, b2, *ctx.variant,
        )  # fmt: skip
    else:
        x, w13, w2, topk_ids, topk_weights, b13, b2 = ctx.saved_tensors
        if not ctx.consumable:
            raise RuntimeError(
                "fused_moe: backward ran twice through the same graph (retain_graph=True); the Triton "
                "backward frees the forward's saved gate/up rows as it goes. Use fused_moe(..., "
                "recompute=True) for graphs that are differentiated more than once."
            )
        holder = [ctx.consumable.pop()]  # the only reference left: launch_bwd drops it when done
        if grad_out is None:
            grad_out = torch.zeros_like(x)
        v = ExpertsVariant(b13, b2, *ctx.variant)
        dx, dw13, dw2, dwts, db13, db2 = launch_bwd_config(
            grad_out.contiguous(),
            x,
            w13,
            w2,
            topk_ids,
            topk_weights,
            holder,
            ctx.offset,
            False,
            flags,
            v=v,
            layout=getattr(ctx, "layout", None),
        )
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
        layout = []
        out, saved = _train_forward(*inputs, *_TRAIN_DEFAULTS[len(inputs) - 8 :], layout_out=layout)
        _train_setup_context(ctx, inputs, (out, saved))
        ctx.layout = layout[0] if layout else None
        ctx.mark_non_differentiable(saved)
        return out, saved

    @staticmethod
    def backward(ctx, grad_out, grad_saved):
        return _train_backward(ctx, grad_out, grad_saved)


_TRAIN_DEFAULTS = (None, None, 0, 0.0, 0.0, False)  # the op's optional trailing arguments


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
    """:func:`launch_bwd` with the configuration :func:`moe_bwd_config` picks for the shape."""
    T, H = x.shape
    E_local, two_i, _ = w13.shape
    c = moe_bwd_config(T, topk_ids.shape[1], H, two_i // 2, E_local, tma=dw_tma_ok(x.device, x.dtype))
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


@dataclass(frozen=True)
class MoEBwdConfig:
    """Kernel configuration of one fused-MoE backward (chosen by :func:`moe_bwd_config`).

    ``block_m``: rows per tile of the backward's layout; ``*_a`` = the dA GEMM (``dO @ W2``, N over
    I, K over H), ``*_x`` = the dX GEMM (N over H, K over 2I), ``*_w`` = the weight-gradient GEMMs
    (a ``bm_w × bn_w`` block of one expert's dW, K over its rows). ``dw_mode``: 0 = the token rows
    of x and dO gathered inside the dW loop; 1 = gathered once into layout order first; 2 = gathered
    once, transposed (K-major A operands). ``dw_tma`` (``dw_mode`` 1, bf16 / fp16 / fp32): the dW
    GEMMs read their operands through TMA tensor descriptors (``moe_bwd_dw_tma_kernel``; the same
    bits as the pointer kernel); where a buffer does not meet TMA's alignment the pointer kernel runs.
    ``dw_progs`` (with ``dw_tma``): 0 = one program per (expert, block) tile; n > 0 = a persistent
    grid of at most n programs walking the tiles in expert-major order; -1 = that grid with one
    program per SM of the device (every tile is still one program's K loop in row order: same
    bits). ``dw_c_desc`` (with ``dw_tma``): store C through a descriptor where BLOCK_M divides M
    (else pointer stores; on sm_90 the descriptor store takes more registers: 199 vs 172 at
    128×128×32, 4 warps). ``gemm_tma``: the dA GEMM reads W2, and the dX GEMM W13 and dh, through TMA
    descriptors where the weights have unit stride along their last dimension and the K loop has no
    partial step (else pointer loads; the same operand values either way). ``maxnreg_w`` (with
    ``dw_tma``): a cap on the dW kernel's registers per thread (0: the compiler's choice); 168 lets
    three 4-warp programs share an SM (65536 / (3 * 128) = 170) where the compiler's 199 allowed two.
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
    dw_tma: bool = False
    dw_progs: int = 0
    dw_c_desc: bool = True
    gemm_tma: bool = False
    maxnreg_w: int = 0


def moe_bwd_config(T: int, K: int, H: int, I: int, E_local: int, tma: bool = False) -> MoEBwdConfig:  # noqa: E741
    """Backward kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of H×I.

    ``tma``: the device and dtype allow TMA descriptors (:func:`dw_tma_ok`); sets
    :attr:`MoEBwdConfig.dw_tma`, and for the large-expert tiles a persistent dW grid (one program
    per SM). H200, scripts/dw_tma_check.py: dW kernels 1.08-1.42x the pointer kernel's speed
    (Qwen3 T=16384 2.56 -> 2.16 ms, Mixtral 25.2 -> 17.8, DSv3 26.7 -> 19.9), the persistent grid a
    further 1-4 %.
    """
    slots = max(T * K, 1)
    m_avg = slots / min(E_local, slots)
    # H200 sweep (bench/moe_bwd_tune.py, bench/results/train_bwd_tune.txt): dW over pre-gathered rows
    if m_avg < 12:
        return MoEBwdConfig(16, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1, tma)
    if m_avg < 40:
        return MoEBwdConfig(32, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1, tma)
    g = tma and BWD_GEMM_TMA_ENABLED
    if m_avg <= 256:  # dW's K loop (an expert's rows) is short: 4-warp 128x128x32 tiles, 4 stages
        # Hopper (H200, Qwen3 T=4096 / 1024, bitwise the same): dA 128x256 tiles 250 -> 209 / 124 -> 113 us;
        # dW capped at 168 registers (three programs per SM) 939 -> 804 / 664 -> 551 us
        bn_a = 256 if tma else 128
        return MoEBwdConfig(128, bn_a, 64, 8, 4, 256, 64, 8, 4, 128, 128, 32, 4, 4, 8, 1, tma, gemm_tma=g,
                            maxnreg_w=168 if tma else 0)  # fmt: skip
    if tma:  # Hopper (H200 sweep, session 14; bitwise the same): dA 128x256 tiles, Qwen3 T=16384
        # 770 -> 650 us, Mixtral / DSv3 T=4096 1678 -> 1436 / 1788 -> 1527; dW 32-deep K chunks in 6
        # stages, 2029 -> 1958, 4837 -> 4728, 6759 -> 6109 us
        return MoEBwdConfig(128, 256, 64, 8, 4, 256, 64, 8, 4, 128, 256, 32, 8, 6, 8, 1, tma, -1, gemm_tma=g)
    return MoEBwdConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 256, 64, 8, 3, 8, 1, tma, 0, gemm_tma=g)


# The weight-gradient GEMMs through TMA tensor descriptors on Hopper and newer (MoEBwdConfig.dw_tma,
# set by moe_bwd_config where dw_tma_ok); False (or the environment variable REPLAYMOE_DW_TMA=0) keeps
# the pointer kernel. The bits are the same either way (H200 A/B: scripts/dw_tma_check.py).
DW_TMA_ENABLED = os.environ.get("REPLAYMOE_DW_TMA", "1") != "0"
# The dA / dX GEMMs' weight (and dX's dh) tiles through TMA descriptors where dw_tma_ok
# (MoEBwdConfig.gemm_tma; the same bits as the pointer loads, H200 test); REPLAYMOE_BWD_GEMM_TMA=0 turns it
# off. H200, bench train, two A/B runs each: Qwen3 fwd+bwd T=1024 1.51 -> 1.46 ms, T=4096 2.75 -> 2.73,
# T=16384 8.38-8.43 -> 8.27-8.35 (peaks unchanged); DSv3 T=4096 19.5 -> 19.4.
BWD_GEMM_TMA_ENABLED = os.environ.get("REPLAYMOE_BWD_GEMM_TMA", "1") != "0"
# Tile mode, bf16 / fp16 / fp32: a tile with at most half its rows real (an expert's last) computes
# only that half (the kernels' HALF_TILES; the same bits). REPLAYMOE_HALF_TILES=0 turns it off.
HALF_TILES_ENABLED = os.environ.get("REPLAYMOE_HALF_TILES", "1") != "0"


def _half_tiles(c, fp8: bool) -> bool:
    """The tile kernels of configuration ``c`` take HALF_TILES (tile mode, not fp8, >= 32-row tiles)."""
    return HALF_TILES_ENABLED and not fp8 and not getattr(c, "direct", False) and c.block_m >= 32


_HOPPER_DEVICES: dict = {}
_SM_COUNTS: dict = {}


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of CUDA device ``dev`` (cached; 1 elsewhere)."""
    n = _SM_COUNTS.get(dev)
    if n is None:
        n = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        _SM_COUNTS[dev] = n
    return n


def dw_tma_ok(dev: torch.device, dtype: torch.dtype) -> bool:
    """The backward's dW GEMMs may use TMA descriptors: :data:`DW_TMA_ENABLED`, bf16 / fp16, a CUDA
    device of compute capability 9.0 or newer, and not Triton's interpreter (tests that want the TMA
    kernel there pass a configuration with ``dw_tma=True``)."""
    return DW_TMA_ENABLED and dtype in (torch.bfloat16, torch.float16) and _hopper(dev)


def _hopper(dev: torch.device) -> bool:
    """``dev`` is a CUDA device of compute capability 9.0 or newer and the process does not run
    Triton's interpreter (cached per device): where TMA descriptors and PDL may be used."""
    ok = _HOPPER_DEVICES.get(dev)
    if ok is None:
        from .._backend import INTERPRET

        ok = dev.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(dev)[0] >= 9
        _HOPPER_DEVICES[dev] = ok
    return ok


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
    return _descriptor(t, [rows, t.shape[-1]], [row_stride, 1], block)


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
    from ._kernel_bwd import (
        moe_bwd_bias_kernel,
        moe_bwd_da_kernel,
        moe_bwd_dw_kernel,
        moe_bwd_dw_tma_kernel,
        moe_bwd_dx_kernel,
        moe_bwd_gather_rows_kernel,
        moe_bwd_swiglu_kernel,
    )
    from ._kernel_fwd import moe_gemm1_kernel, moe_reduce_kernel
    from .layout import compact_layout, expert_layout_unchecked

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
    b13_args = _bias_args(b13, w13)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if layout is not None and layout.block_m == c.block_m and layout.cluster == 1:
        lay = layout
    else:
        lay = expert_layout_unchecked(ids, E_local, c.block_m, offset, 1, True)
    cl = compact_layout(lay)  # rows of the intermediates: one per slot, no padding
    num_pid_m = lay.max_tiles
    bm = c.block_m
    if recompute:  # GEMM1 again, gate/up per slot only
        saved = torch.empty(slots, two_i, dtype=x.dtype, device=dev)
        if num_pid_m:
            bn1, bk1 = (128, 64) if bm >= 64 else (64, 128)
            fast(moe_gemm1_kernel)[(num_pid_m * triton.cdiv(I, bn1),)](
                x, x, w13, w13, b13_args[0], saved, saved, saved, ids, lay.sorted_slots, lay.tile_expert,
                lay.num_tiles, num_pid_m, H, I, K, slots, offset, E_local, float(v.alpha), float(v.limit),
                x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), 0, 0, *b13_args[1:],
                saved.stride(0), saved.stride(0), DIRECT=False, FP8=False, PREQ_X=False, PREQ=False,
                SAVE_H=True, STORE_ACT=False, HAS_BIAS=b13 is not None, INTERLEAVED=v.interleaved, ACT=v.act,
                EVEN_K=H % bk1 == 0, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=c.group_m,
                DOT_PREC=prec, HALF_TILES=_half_tiles(c, False), num_warps=8 if bm >= 128 else 4,
                num_stages=4 if bm >= 64 else 3,
            )  # fmt: skip
    dh = torch.empty(slots, two_i, dtype=x.dtype, device=dev)
    aw = torch.empty(slots, I, dtype=x.dtype, device=dev)
    bn_e = 128
    nb = triton.cdiv(I, bn_e)
    # per slot: the d topk_weights partials of each I-block (+ dO·b2 in a last column with a w2 bias),
    # summed by moe_reduce_kernel (with dX's reduce, or alone), which reads the local slots' rows only
    dwp = torch.empty(slots, nb + (b2 is not None), dtype=torch.float32, device=dev)
    if b2 is not None:  # dO[t]·b2[e] of each local slot (0 elsewhere), one [T, E_local] matmul
        local = (ids >= offset) & (ids < offset + E_local)
        dob2 = (dout.float() @ b2.float().t()).gather(1, torch.where(local, ids - offset, 0).long())
        dwp[:, nb] = torch.where(local, dob2, 0.0).reshape(-1)
    if num_pid_m:
        w2_desc = _rows_desc(w2, c.bk_a, c.bn_a) if c.gemm_tma and H % c.bk_a == 0 else None
        fast(moe_bwd_da_kernel)[(num_pid_m * triton.cdiv(I, c.bn_a),)](
            dout, w2, dh, lay.sorted_slots, lay.tile_expert, cl.expert_shift, lay.num_tiles, num_pid_m, H, I,
            K, slots, dout.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), dh.stride(0),
            INTERLEAVED=v.interleaved, EVEN_K=H % c.bk_a == 0, BLOCK_M=bm, BLOCK_N=c.bn_a, BLOCK_K=c.bk_a,
            GROUP_M=c.group_m, DOT_PREC=prec, TMA=w2_desc is not None, w_desc=w2_desc,
            HALF_TILES=_half_tiles(c, False), num_warps=c.warps_a, num_stages=c.stages_a,
        )  # fmt: skip
        br = 16
        fast(moe_bwd_swiglu_kernel)[(triton.cdiv(slots, br), nb)](
            dh, saved, wts, aw, dwp, cl.compact_slots, I, slots, float(v.alpha), float(v.limit),
            dh.stride(0), saved.stride(0), aw.stride(0), dwp.stride(0), INTERLEAVED=v.interleaved,
            ACT=v.act, BLOCK_R=br, BLOCK_N=bn_e, num_warps=4,
        )  # fmt: skip
    del saved
    res = [None] * 6
    if need[3]:
        res[3] = (torch.empty if num_pid_m else torch.zeros)(T, K, dtype=topk_weights.dtype, device=dev)

    def reduce(parts, dxs, dx):  # dx[t] = sum over k of dxs rows; parts: dwts too (or alone)
        bh = min(1024, max(16, 1 << (H - 1).bit_length()))
        has_dx = dxs is not None
        rows, dst = (dxs, dx) if has_dx else (parts, parts)
        on = parts if parts is not None else rows
        fast(moe_reduce_kernel)[(T, triton.cdiv(H, bh) if has_dx else 1)](
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
        # H200 sweep (bench/results/diag/s10_gather_rows_sweep_h200.txt): 512-column blocks, 8 warps and
        # streaming stores, Qwen3 T=16384 226 -> 185 us per gather
        bn_g = min(512, triton.next_power_of_2(n))
        fast(moe_bwd_gather_rows_kernel)[(triton.cdiv(slots, 8), triton.cdiv(n, bn_g))](
            t, g, cl.compact_slots, slots, K, n, t.stride(0), g.stride(0), BLOCK_R=8, BLOCK_N=bn_g,
            num_warps=8,
        )  # fmt: skip
        return g if mode == 1 else g.t().contiguous()

    def dw_gemm(i, a, b, a_t, a_g, b_g, c_t, m, n):
        dw = torch.empty(src[i].shape, dtype=src[i].dtype, device=dev)
        if c.dw_tma and not (a_t or a_g or b_g or c_t) and dw_tma_gemm(a, b, dw, m, n):
            res[i] = dw
            return
        fast(moe_bwd_dw_kernel)[(E_local * triton.cdiv(m, c.bm_w) * triton.cdiv(n, c.bn_w),)](
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
        tiles = E_local * triton.cdiv(m, c.bm_w) * triton.cdiv(n, c.bn_w)
        progs = min(_sm_count(dev) if c.dw_progs < 0 else c.dw_progs, tiles) if c.dw_progs else 0
        fast(moe_bwd_dw_tma_kernel)[(progs or tiles,)](
            a_desc, b_desc, c_desc, dw, cl.exact_start, lay.expert_counts, m,
            n, tiles, dw.stride(0), dw.stride(1), C_DESC=c_desc is not None, BLOCK_M=c.bm_w, BLOCK_N=c.bn_w,
            BLOCK_K=c.bk_w, GROUP_M=c.group_m, DOT_PREC=prec, NUM_PROGS=progs, num_warps=c.warps_w,
            num_stages=c.stages_w, maxnreg=c.maxnreg_w or None,
        )  # fmt: skip
        return True

    # order (lowest peak): dX (its per-slot rows freed), dW13 + dB13 (then dh is freed), dW2 last, so
    # that only aw [T*K, I] and the dO rows sit next to both weight gradients
    if need[0]:
        dx = (torch.empty if num_pid_m else torch.zeros)(T, H, dtype=x.dtype, device=dev)  # reduce writes all
        if num_pid_m:
            dxs = torch.empty(slots, H, dtype=x.dtype, device=dev)
            w13_desc = _rows_desc(w13, c.bk_x, c.bn_x) if c.gemm_tma and two_i % c.bk_x == 0 else None
            dh_desc = _rows_desc(dh, bm, c.bk_x) if w13_desc is not None else None
            half = _half_tiles(c, False)
            dh_desc_half = _rows_desc(dh, bm // 2, c.bk_x) if half and dh_desc is not None else None
            fast(moe_bwd_dx_kernel)[(num_pid_m * triton.cdiv(H, c.bn_x),)](
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
    fast(kernel)[(E_local, triton.cdiv(N, bn))](
        src, wts, db, cl.compact_slots, cl.exact_start, lay.expert_counts, N, K, src.stride(0),
        db.stride(0), GATHER=gather, BLOCK_R=16, BLOCK_N=bn, num_warps=4,
    )  # fmt: skip
    return db.to(bias.dtype)


def config_tuple(c: MoEConfig) -> list[int]:
    """``c`` as the int list the ``replaymoe::moe_experts*`` custom ops take (a dataclass cannot
    cross the op boundary)."""
    return [int(c.direct), c.block_m, c.block_n1, c.block_k1, c.warps1, c.stages1, c.block_n2, c.block_k2,
            c.warps2, c.stages2, c.group_m, int(c.tma)]  # fmt: skip


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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: int = 0,
    alpha: float = 0.0,
    limit: float = 0.0,
    interleaved: bool = False,
) -> None:
    """Validated-elsewhere Triton experts (custom op so torch.compile treats it as one opaque call);
    the trailing arguments are :class:`ExpertsVariant`'s."""
    _launch(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            config_from_list(config),
            v=ExpertsVariant(w13_bias, w2_bias, act, alpha, limit, interleaved))  # fmt: skip


@_moe_experts_op.register_fake
def _(
    x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, config, *variant
) -> None:
    return None


# Decode (direct mode) kernels as programmatic dependent launches on Hopper and newer: opt-in (True, or
# the environment variable REPLAYMOE_PDL=1). Results are the same either way. Off by default because it
# measured slower on the H200 at every decode point (scripts/pdl_decode_check.py, graph replay: Qwen3
# T=1 36.7 -> 40.1 us, Mixtral T=1 189 -> 288 us, DSv3 T=8 1278 -> 1549 us): GEMM2's programs sit
# resident while GEMM1 still runs, and its L2 prefetch of weights larger than L2 reads them twice.
PDL_ENABLED = os.environ.get("REPLAYMOE_PDL", "0") == "1"


def _pdl_ok(dev: torch.device) -> bool:
    """Programmatic dependent launch is used on ``dev``: :data:`PDL_ENABLED`, a CUDA device of
    compute capability 9.0 or newer, and not Triton's interpreter."""
    return PDL_ENABLED and _hopper(dev)


# Tile-mode (prefill) GEMM operands through TMA tensor descriptors on Hopper and newer
# (:attr:`MoEConfig.tma`, chosen by :func:`moe_config` where :func:`tma_ok`); False (or the environment
# variable REPLAYMOE_TMA=0) keeps pointer loads. Results are the same either way. H200 A/B
# (scripts/fwd_tma_check.py, graph replay): 1.04-1.11x at T >= 4096 (Mixtral T=16384 22.5 -> 20.3 ms).
TMA_ENABLED = os.environ.get("REPLAYMOE_TMA", "1") != "0"
_TMA_MAX_BOX = 256  # TMA: at most 256 elements along each dimension of a block


def tma_ok(dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Tile mode may read its operands through TMA descriptors on ``dev``: :data:`TMA_ENABLED`, a
    CUDA device of compute capability 9.0 or newer, not Triton's interpreter (tests that want the TMA
    kernels there pass a configuration with ``tma=True``), and bf16 / fp16 activations (fp32's
    ``ieee`` dot, no tensor cores, spills hundreds of bytes once its tiles come from TMA:
    ``scripts/fwd_tma_ptx_check.py``'s notes)."""
    return TMA_ENABLED and dtype in (torch.bfloat16, torch.float16) and _hopper(dev)


def _rows_desc(t: torch.Tensor, block_rows: int, block_k: int):
    """A TMA descriptor of ``t`` ([E, N, K] viewed as [E*N, K], or [R, K]) with blocks
    [block_rows, block_k], or None where TMA cannot read it: not bf16/fp16/fp32, K not unit-stride, the
    rows not one uniform stride, rows or base not 16-byte aligned, or a block over TMA's limits."""
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32) or t.numel() == 0:
        return None
    if t.dim() == 3:
        if t.stride(0) != t.shape[1] * t.stride(1):
            return None
        rows, row_stride = t.shape[0] * t.shape[1], t.stride(1)
    else:
        rows, row_stride = t.shape[0], t.stride(0)
    item = t.element_size()
    if (
        t.stride(-1) != 1
        or (row_stride * item) % 16
        or t.data_ptr() % 16
        or max(block_rows, block_k) > _TMA_MAX_BOX
        or (block_k * item) % 16
    ):
        return None
    return _descriptor(t, [rows, t.shape[-1]], [row_stride, 1], [block_rows, block_k])


def _descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
    """``TensorDescriptor(t, shape, strides, block)`` for arguments the callers have checked (16-byte
    aligned base and rows, unit stride along the last dimension, blocks of at most 256 elements),
    without its constructor's checks where the rest holds (a few microseconds per launch: every eager
    training step builds about a dozen per MoE layer); the checked constructor otherwise."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if all(b > 0 and b & (b - 1) == 0 for b in block) and all(n > 0 for n in shape):
        d = object.__new__(TensorDescriptor)
        d.base, d.shape, d.strides, d.block_shape, d.padding = t, shape, strides, block, "zero"
        return d
    return TensorDescriptor(t, shape, strides, block)


def _launch(
    x,
    w13,
    w2,
    topk_ids,
    topk_weights,
    w13_scale,
    w2_scale,
    offset,
    out,
    c: MoEConfig,
    saved=None,
    v=STANDARD,
    layout_out=None,
) -> None:
    """Launch layout + GEMM1 + GEMM2 + reduce into ``out``; ``saved`` [T*K, 2I] (optional, not fp8)
    receives GEMM1's gate/up outputs per slot for the backward; ``v``: the experts variant (bf16 /
    fp16 / fp32 weights of any strides; fp8 takes the standard variant only); ``layout_out`` (a list)
    receives the expert layout in tile mode."""
    from ._kernel_fwd import moe_gemm1_kernel, moe_gemm2_kernel, moe_reduce_kernel, quant_groups_kernel
    from .layout import expert_layout_unchecked

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
    if fp8:  # the fp8 kernels step through the weights with unit stride along K
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
        # training (layout_out): the backward's compact order is built in the same launches
        lay = expert_layout_unchecked(ids, E_local, c.block_m, offset, 1, layout_out is not None)
        if layout_out is not None:
            layout_out.append(lay)
        sorted_slots, tile_expert, num_tiles = lay.sorted_slots, lay.tile_expert, lay.num_tiles
        num_pid_m = lay.max_tiles
        rows = max(lay.sorted_slots.shape[0], 1)
    # GEMM1 on 128-column blocks writes e4m3 SwiGLU rows + per-128 scales (both modes), so GEMM2 does not
    # quantize its activation tiles again in every N-block program (the same bits)
    preq = fp8 and c.block_n1 == 128
    if fp8:  # x quantized once per 1x128 group (every fp8 mode: the same bits as in-tile quantization)
        xq = torch.empty(T, H, dtype=_FP8, device=dev)
        xs = torch.empty(T, H // 128, dtype=torch.float32, device=dev)
        g = 8
        fast(quant_groups_kernel)[(T, triton.cdiv(H // 128, g))](
            x, xq, xs, H // 128, x.stride(0), G=g, num_warps=4
        )
    else:
        xq, xs = x, x
    if preq:
        inter = torch.empty(rows, I, dtype=_FP8, device=dev)
        inter_s = torch.empty(rows, I // 128, dtype=torch.float32, device=dev)
    else:
        inter = torch.empty(rows, I, dtype=inter_dt, device=dev)
        inter_s = inter
    if num_pid_m == 0:
        out.zero_()
        return
    # decode: GEMM1 -> GEMM2 -> reduce as programmatic dependent launches (Hopper), so that GEMM2
    # prefetches its weights while GEMM1 finishes and no launch gap separates the three
    pdl = c.direct and not fp8 and _pdl_ok(dev)
    grid1 = (num_pid_m * triton.cdiv(I, c.block_n1),)
    save = saved is not None and saved.numel() > 0
    h_buf = saved if save else inter
    b13, b13_se, b13_sn = _bias_args(v.w13_bias, w13)
    tma = c.tma and not c.direct and not fp8
    w13_desc = _rows_desc(w13, c.block_n1 * (2 if v.interleaved else 1), c.block_k1) if tma else None
    fast(moe_gemm1_kernel)[grid1](
        xq, xs, w13, s13, b13, inter, inter_s, h_buf, ids, sorted_slots, tile_expert, num_tiles, num_pid_m, H,
        I, K, slots, offset, E_local, float(v.alpha), float(v.limit), xq.stride(0), w13.stride(0),
        w13.stride(1), w13.stride(2), *s13_strides, b13_se, b13_sn, inter.stride(0), h_buf.stride(0),
        DIRECT=c.direct, FP8=fp8, PREQ_X=fp8, PREQ=preq, SAVE_H=save, STORE_ACT=True,
        HAS_BIAS=v.w13_bias is not None, INTERLEAVED=v.interleaved, ACT=v.act, EVEN_K=H % c.block_k1 == 0,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n1, BLOCK_K=c.block_k1, GROUP_M=c.group_m, DOT_PREC=prec,
        PDL=pdl, TMA=w13_desc is not None, w_desc=w13_desc, HALF_TILES=_half_tiles(c, fp8),
        num_warps=c.warps1, num_stages=c.stages1, launch_pdl=pdl,
    )  # fmt: skip
    y = torch.empty(slots, H, dtype=out.dtype, device=dev)
    grid2 = (num_pid_m * triton.cdiv(H, c.block_n2),)
    b2, b2_se, b2_sn = _bias_args(v.w2_bias, w2)
    w2_desc = _rows_desc(w2, c.block_n2, c.block_k2) if tma else None
    inter_desc = _rows_desc(inter, c.block_m, c.block_k2) if w2_desc is not None else None
    half = _half_tiles(c, fp8)
    inter_desc_half = _rows_desc(inter, c.block_m // 2, c.block_k2) if half and inter_desc else None
    fast(moe_gemm2_kernel)[grid2](
        inter, inter_s, w2, s2, b2, y, ids, wts, sorted_slots, tile_expert, num_tiles, num_pid_m, H, I, slots,
        offset, E_local, inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), *s2_strides, b2_se,
        b2_sn, y.stride(0), DIRECT=c.direct, FP8=fp8, PREQ=preq, HAS_BIAS=v.w2_bias is not None,
        EVEN_K=I % c.block_k2 == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n2, BLOCK_K=c.block_k2,
        GROUP_M=c.group_m, DOT_PREC=prec, PDL=pdl, TMA=inter_desc is not None, a_desc=inter_desc,
        w_desc=w2_desc if inter_desc is not None else None, HALF_TILES=half, a_desc_half=inter_desc_half,
        num_warps=c.warps2, num_stages=c.stages2, launch_pdl=pdl,
    )  # fmt: skip
    bh = min(1024, max(16, 1 << (H - 1).bit_length()))
    fast(moe_reduce_kernel)[(T, triton.cdiv(H, bh))](
        y, ids, out, H, K, offset, E_local, y.stride(0), out.stride(0), BLOCK_H=bh, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip

"""Triton forward of the fused MoE: the experts variant, the forward launcher and its custom op.

:func:`experts_triton` runs an already validated call (:func:`replaymoe.moe.fused_moe` validates; no
argument checks here): layout + GEMM1 + GEMM2 + reduce (:func:`launch_experts`; kernels in
``_kernel_gemm1.py`` / ``_kernel_gemm2.py``,
the layout in :mod:`replaymoe.moe.layout`), eagerly as direct launches and under ``torch.compile`` as the
custom op ``replaymoe::moe_experts``. The differentiable forward (``replaymoe::moe_experts_train``) runs
the same launcher: :mod:`replaymoe.moe._backward`. The configurations: :mod:`replaymoe.moe.configs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._launch import cdiv, fast, next_power_of_2
from .._validation import is_capturing
from ..routing._id_mailbox import mailbox, mailbox_for, raise_pending
from .configs import (
    MoEConfig,
    config_from_list,
    config_tuple,
    merges_slots,
    moe_config,
    swaps_ab,
    tma_ok,
    uses_fused_reduce,
    uses_half_tiles,
    uses_pdl,
)
from .tuned import table_for

_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True, eq=False)
class ExpertsVariant:
    """What the experts compute beyond the standard SwiGLU experts (validated by ``fused_moe``).

    ``w13_bias`` [E_local, 2I] (rows as w13's) and ``w2_bias`` [E_local, H]: added in the GEMM
    epilogues; ``act`` 0 = SwiGLU, 1 = clamped SwiGLU with ``alpha`` and ``limit`` (gpt-oss);
    ``interleaved``: w13's gate row j is row 2j, its up row 2j + 1 (otherwise j and I + j);
    ``id_bound``: E > 0 when the caller's ``topk_ids`` still need their value check, which the kernels
    that read the ids run on the device (:mod:`replaymoe.routing._id_mailbox`); 0: ids known valid.
    """

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    act: int = 0
    alpha: float = 0.0
    limit: float = 0.0
    interleaved: bool = False
    id_bound: int = 0

    def op_args(self) -> tuple:
        """The trailing arguments of the ``replaymoe::moe_experts`` and ``moe_experts_train`` ops."""
        v = self
        return (v.w13_bias, v.w2_bias, v.act, v.alpha, v.limit, v.interleaved, v.id_bound)


STANDARD = ExpertsVariant()


def bias_args(b: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(pointer, stride_be, stride_bn) of an optional bias (a dummy pointer and zero strides)."""
    return (dummy, 0, 0) if b is None else (b, b.stride(0), b.stride(1))


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
    """Run the Triton experts into ``out`` (allocated when None); returns it. ``config``: the
    :class:`MoEConfig` of this call, its data-movement switches (``tma``, ``half_tiles``, ``pdl``,
    ``swap_ab``) included; None: :func:`moe_config`'s choice for the shape, with the process defaults.

    The inference executor that :func:`replaymoe.moe.fused_moe` ends in on the Triton path (no input
    requires grad), and that library callers holding the checks' results call directly (the
    transformers integration's experts, host time per layer call mattering at decode). No argument
    checks: the call must be one that ``fused_moe`` accepts (``variant`` and ``out`` as it builds them).
    For the standard experts (``variant`` STANDARD, ``w13_scale``/``w2_scale`` None, offset 0, ``out``
    None) that is:

    * ``x`` [T, H], T >= 1, bfloat16 or float16, on a CUDA device (or Triton's interpreter);
    * ``w13`` [E, 2I, H] and ``w2`` [E, H, I] of that dtype and device;
    * ``topk_ids`` int32 [T, K] (K <= E) and ``topk_weights`` float32 [T, K] on that device; the
      ids' values are not checked (as ``fused_moe(..., check_ids=False)``).

    Then it returns the same tensor and bits as ``fused_moe(x, w13, w2, topk_ids=topk_ids,
    topk_weights=topk_weights)``."""
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
                             tma=tma_ok(x.device, x.dtype), table=table_for(x.device),
                             itemsize=x.element_size())  # fmt: skip
    if compiling:
        torch.ops.replaymoe.moe_experts(
            x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            config_tuple(c), *variant.op_args(),
        )  # fmt: skip
    else:  # eager: the same launches without the custom-op dispatch (tens of microseconds per call)
        launch_experts(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, c,
                v=variant)  # fmt: skip
    return out


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
    # ExpertsVariant's fields spelled out: custom_op infers the op's schema from these annotations
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: int = 0,
    alpha: float = 0.0,
    limit: float = 0.0,
    interleaved: bool = False,
    id_bound: int = 0,
) -> None:
    """Validated-elsewhere Triton experts (custom op so torch.compile treats it as one opaque call);
    the trailing arguments are :class:`ExpertsVariant`'s."""
    launch_experts(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out,
            config_from_list(config),
            v=ExpertsVariant(w13_bias, w2_bias, act, alpha, limit, interleaved, id_bound))  # fmt: skip


@_moe_experts_op.register_fake
def _(
    x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, local_expert_offset, out, config, *variant
) -> None:
    return None


_TMA_MAX_BOX = 256  # TMA: at most 256 elements along each dimension of a block


def rows_desc(t: torch.Tensor, block_rows: int, block_k: int):
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
    return tma_descriptor(t, [rows, t.shape[-1]], [row_stride, 1], [block_rows, block_k])


def tma_descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
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


def launch_experts(
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
    receives the expert layout in tile mode. With ``v.id_bound`` the kernel that reads the ids first
    (the layout's scatter, or GEMM1 in direct mode) checks them on the device; an error an earlier call
    left in the mailbox is raised first."""
    from ._kernel_gemm1 import moe_gemm1_kernel
    from ._kernel_gemm2 import moe_gemm2_kernel
    from .layout import build_layout

    T, H = x.shape
    if T == 0:
        return
    check = _id_check(topk_ids, v.id_bound) if v.id_bound else None
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
    xq_xs = None
    if c.direct:
        rows, num_pid_m = slots, slots
        sorted_slots = tile_expert = num_tiles = ids  # unused in DIRECT mode
    else:
        # training (layout_out): the backward's compact order is built in the same launches; fp8: x is
        # quantized per 1x128 group in the same launch too
        quant = None
        if fp8:
            xq_xs = _x_buffers(x)
            quant = (x, *xq_xs)
        lay = build_layout(ids, E_local, c.block_m, offset, 1, layout_out is not None, quant, id_check=check)
        if layout_out is not None:
            layout_out.append(lay)
        sorted_slots, tile_expert, num_tiles = lay.sorted_slots, lay.tile_expert, lay.num_tiles
        num_pid_m = lay.max_tiles
        rows = max(lay.sorted_slots.shape[0], 1)
    if swaps_ab(c, fp8):
        tiles = None if c.direct else lay
        direct_check = check if c.direct else None  # tile mode: the layout checked them
        _launch_swapped_fp8(x, w13, w2, ids, wts, w13_scale, w2_scale, offset, out, c, tiles, xq_xs,
                            direct_check)  # fmt: skip
        return
    # GEMM1 on 128-column blocks writes e4m3 SwiGLU rows + per-128 scales (both modes), so GEMM2 does not
    # quantize its activation tiles again in every N-block program (the same bits)
    preq = fp8 and c.block_n1 == 128
    # x quantized once per 1x128 group (every fp8 mode: the same bits as in-tile quantization; tile mode:
    # by the layout's launch)
    xq, xs = (xq_xs or _quantize_x(x)) if fp8 else (x, x)
    if preq:
        inter = torch.empty(rows, I, dtype=_FP8, device=dev)
        inter_s = torch.empty(rows, I // 128, dtype=torch.float32, device=dev)
    else:
        inter = torch.empty(rows, I, dtype=inter_dt, device=dev)
        inter_s = inter
    if num_pid_m == 0:  # tile mode (the layout checked the ids), or an empty direct call
        out.zero_()
        return
    # decode: GEMM1 -> GEMM2 -> reduce as programmatic dependent launches (Hopper; c.pdl, opt-in), so
    # that GEMM2 prefetches its weights while GEMM1 finishes and no launch gap separates the three
    pdl = uses_pdl(c, fp8, dev)
    ticket, cnt, n_cnt = _tickets(c, T, H, ids)
    merge, scan = merges_slots(c, T, K, H, I, E_local, fp8), _scan_width(slots)
    grid1 = (num_pid_m * cdiv(I, c.block_n1),)
    save = saved is not None and saved.numel() > 0
    h_buf = saved if save else inter
    b13, b13_se, b13_sn = bias_args(v.w13_bias, w13)
    tma = c.tma and not c.direct and not fp8
    w13_desc = rows_desc(w13, c.block_n1 * (2 if v.interleaved else 1), c.block_k1) if tma else None
    fast(moe_gemm1_kernel)[grid1](
        xq, xs, w13, s13, b13, inter, inter_s, h_buf, ids, sorted_slots, tile_expert, num_tiles, num_pid_m, H,
        I, K, slots, offset, E_local, float(v.alpha), float(v.limit), xq.stride(0), w13.stride(0),
        w13.stride(1), w13.stride(2), *s13_strides, b13_se, b13_sn, inter.stride(0), h_buf.stride(0),
        DIRECT=c.direct, FP8=fp8, PREQ_X=fp8, PREQ=preq, SAVE_H=save, STORE_ACT=True,
        HAS_BIAS=v.w13_bias is not None, INTERLEAVED=v.interleaved, ACT=v.act, EVEN_K=H % c.block_k1 == 0,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n1, BLOCK_K=c.block_k1, GROUP_M=c.group_m, DOT_PREC=prec,
        PDL=pdl, TMA=w13_desc is not None, w_desc=w13_desc, HALF_TILES=uses_half_tiles(c, fp8),
        num_warps=c.warps1, num_stages=c.stages1, launch_pdl=pdl, cnt_ptr=cnt, num_cnt_n=n_cnt, TICKET=ticket,
        MERGE=merge, SCAN=scan, **(check if check is not None and c.direct else _NO_CHECK),
    )  # fmt: skip
    y = torch.empty(slots, H, dtype=out.dtype, device=dev)
    grid2 = (num_pid_m * cdiv(H, c.block_n2),)
    b2, b2_se, b2_sn = bias_args(v.w2_bias, w2)
    w2_desc = rows_desc(w2, c.block_n2, c.block_k2) if tma else None
    inter_desc = rows_desc(inter, c.block_m, c.block_k2) if w2_desc is not None else None
    half = uses_half_tiles(c, fp8)
    inter_desc_half = rows_desc(inter, c.block_m // 2, c.block_k2) if half and inter_desc else None
    fast(moe_gemm2_kernel)[grid2](
        inter, inter_s, w2, s2, b2, y, ids, wts, sorted_slots, tile_expert, num_tiles, num_pid_m, H, I, slots,
        offset, E_local, inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), *s2_strides, b2_se,
        b2_sn, y.stride(0), DIRECT=c.direct, FP8=fp8, PREQ=preq, HAS_BIAS=v.w2_bias is not None,
        EVEN_K=I % c.block_k2 == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n2, BLOCK_K=c.block_k2,
        GROUP_M=c.group_m, DOT_PREC=prec, PDL=pdl, TMA=inter_desc is not None, a_desc=inter_desc,
        w_desc=w2_desc if inter_desc is not None else None, HALF_TILES=half, a_desc_half=inter_desc_half,
        num_warps=c.warps2, num_stages=c.stages2, launch_pdl=pdl, out_ptr=out, cnt_ptr=cnt, TOP_K=K,
        stride_om=out.stride(0), KP=next_power_of_2(K), TICKET=ticket, MERGE=merge, SCAN=scan,
    )  # fmt: skip
    if not ticket:
        _reduce_slots(y, ids, out, offset, E_local, pdl)


# (device index, id_bound) -> (the check's arguments, the device's mailbox words as the host reads them)
_CHECK_ARGS: dict[tuple[int, int], tuple[dict, Any]] = {}
# the same keywords with the check off: a direct-mode GEMM1 always takes all three, so that calls with
# and without the check launch with the same argument list, only its values differ (the launcher keys
# and converts every argument: three more for the check alone were its main host cost, bench/README.md)
_NO_CHECK: dict = dict(err_addr=None, id_bound=0, CHECK_IDS=False)


def _id_check(ids: torch.Tensor, id_bound: int) -> dict:
    """The kernels' keyword arguments for the device-side check of the caller's ids against
    ``[-1, id_bound)`` (``err_addr``: the device's mailbox, ``id_bound``, ``CHECK_IDS``; one dict per
    device and bound, built once), after raising the error an earlier call left in the mailbox.
    Every eager decode call with caller ids runs this: the steady state is one dict lookup and one
    read of the mailbox word."""
    index = ids.get_device()
    entry = _CHECK_ARGS.get((index, id_bound))
    if entry is None:  # (the mailbox lives for the process)
        args = dict(err_addr=mailbox_for(ids), id_bound=id_bound, CHECK_IDS=True)
        _CHECK_ARGS[(index, id_bound)] = args, mailbox(max(index, 0)).numpy()
        return args
    args, words = entry
    if index >= 0 and words[0]:  # (the steady state reads the word only)
        raise_pending(index)
    return args


def _scan_width(slots: int) -> int:
    """``SCAN`` of the merged direct tiles: the batch's slot count rounded up to a power of two (>= 16)."""
    return max(16, next_power_of_2(slots))


def _tickets(c: MoEConfig, T: int, H: int, ids: torch.Tensor) -> tuple[bool, torch.Tensor, int]:
    """(on, cnt, n): whether GEMM2 sums the top-k itself (:attr:`MoEConfig.fused_reduce`), and its
    tickets, ``cnt`` int32 [T, n] for GEMM2's ``n`` column blocks (left uninitialized: GEMM1 zeroes
    them; ``ids`` as a dummy pointer when off)."""
    if not uses_fused_reduce(c):
        return False, ids, 0
    n = cdiv(H, c.block_n2)
    return True, torch.empty(T, n, dtype=torch.int32, device=ids.device), n


def _x_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized x's buffers: (e4m3 [T, H], fp32 scales [T, H // 128]), uninitialized."""
    T, H = x.shape
    return (torch.empty(T, H, dtype=_FP8, device=x.device),
            torch.empty(T, H // 128, dtype=torch.float32, device=x.device))  # fmt: skip


def _quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H a multiple of 128) quantized per 1×128 group: (e4m3 [T, H], fp32 scales [T, H // 128])."""
    from ._kernel_quant import quant_groups_kernel

    T, H = x.shape
    xq, xs = _x_buffers(x)
    fast(quant_groups_kernel)[(T, cdiv(H // 128, 8))](x, xq, xs, H // 128, x.stride(0), G=8, num_warps=4)
    return xq, xs


def _reduce_slots(y, ids, out, offset: int, E_local: int, pdl: bool = False) -> None:
    """out[t] = the sum in k order of the slot rows y[t * K + k] of the token's local experts
    (``moe_reduce_kernel``; ``pdl``: as a programmatic dependent launch)."""
    from ._kernel_gemm2 import moe_reduce_kernel

    T, K = ids.shape
    H = y.shape[1]
    # 512-column blocks: at decode sizes about 0.3 µs faster than 1024, the same at prefill (docs/TUNING.md,
    # "Small kernels at decode sizes"); each sum keeps its order
    bh = min(512, max(16, 1 << (H - 1).bit_length()))
    fast(moe_reduce_kernel)[(T, cdiv(H, bh))](
        y, ids, out, H, K, offset, E_local, y.stride(0), out.stride(0), BLOCK_H=bh, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip


# token columns of the swapped decode MMA (column 0 real): tl.dot's smallest N
_DECODE_TN = 16


def _launch_swapped_fp8(x, w13, w2, ids, wts, w13_scale, w2_scale, offset, out, c: MoEConfig, lay,
                        xq_xs=None, id_check=None) -> None:  # fmt: skip
    """The fp8 experts with swapped operands (``c.swap_ab``, ``_kernel_swapped.py``): x quantized per
    1×128 group -> GEMM1 -> GEMM2 -> reduce (or the top-k sum in GEMM2, direct mode). Arguments as
    :func:`launch_experts`'s after its normalization (contiguous x, ids, wts; weights with unit stride
    along K); ``lay``: tile mode's layout of ``c.block_m``-row tiles, built by :func:`launch_experts`
    (None in direct mode); ``xq_xs``: x already quantized (tile mode: by the layout's launch), else
    quantized here; ``id_check``: direct mode's keyword arguments for GEMM1's device-side id check
    (:func:`_id_check`)."""
    from ._kernel_swapped import moe_gemm1_swapped_fp8_kernel, moe_gemm2_swapped_fp8_kernel

    T, H = x.shape
    K = ids.shape[1]
    E_local, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    slots = T * K
    dev = x.device
    if c.direct:
        tn, num_pid_m, rows = _DECODE_TN, slots, slots
        sorted_slots = tile_expert = num_tiles = ids  # unused in DIRECT mode
    else:
        sorted_slots, tile_expert, num_tiles = lay.sorted_slots, lay.tile_expert, lay.num_tiles
        tn, num_pid_m, rows = c.block_m, lay.max_tiles, max(lay.sorted_slots.shape[0], 1)
    if num_pid_m == 0:
        out.zero_()
        return
    xq, xs = xq_xs or _quantize_x(x)
    preq = c.block_n1 == 128
    inter = torch.empty(rows, I, dtype=_FP8 if preq else torch.bfloat16, device=dev)
    inter_s = torch.empty(rows, I // 128, dtype=torch.float32, device=dev) if preq else inter
    ticket, cnt, n_cnt = _tickets(c, T, H, ids)
    merge, scan = merges_slots(c, T, K, H, I, E_local, True), _scan_width(slots)
    fast(moe_gemm1_swapped_fp8_kernel)[(num_pid_m * (I // c.block_n1),)](
        xq, xs, w13, w13_scale, inter, inter_s, ids, sorted_slots, tile_expert, num_tiles, num_pid_m, slots,
        H, I, K, offset, E_local, xq.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), inter.stride(0), DIRECT=c.direct, PREQ=preq, BLOCK_N=c.block_n1, BLOCK_K=128,
        TN=tn, GROUP_M=c.group_m, num_warps=c.warps1, num_stages=c.stages1, cnt_ptr=cnt, num_cnt_n=n_cnt,
        TICKET=ticket, MERGE=merge, SCAN=scan, **(id_check or _NO_CHECK),
    )  # fmt: skip
    y = torch.empty(slots, H, dtype=out.dtype, device=dev)
    fast(moe_gemm2_swapped_fp8_kernel)[(num_pid_m * cdiv(H, c.block_n2),)](
        inter, inter_s, w2, w2_scale, y, ids, wts, sorted_slots, tile_expert, num_tiles, num_pid_m, slots, H,
        I, K, offset, E_local, inter.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), y.stride(0), DIRECT=c.direct, PREQ=preq, BLOCK_N=c.block_n2, BLOCK_K=128,
        TN=tn, GROUP_M=c.group_m, num_warps=c.warps2, num_stages=c.stages2, out_ptr=out, cnt_ptr=cnt,
        stride_om=out.stride(0), KP=next_power_of_2(K), TICKET=ticket, MERGE=merge, SCAN=scan,
    )  # fmt: skip
    if not ticket:
        _reduce_slots(y, ids, out, offset, E_local)

"""Triton code of the fp8 block-scale path's activation quantization: e4m3 with one fp32 scale per
1×128 group (``quant_rows``, the arithmetic GEMM1 and GEMM2 run on their tiles), and x quantized once per
call (``quant_groups_kernel``; ``quant_group_block`` is also the layout scatter's ``QUANT`` part,
:mod:`replaymoe.moe._kernel_layout`). Only ``@triton.jit`` code lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def quant_rows(a):
    """Quantize fp32 rows [M, 128] to e4m3 with one scale per row; returns (q, scale [M])."""
    amax = tl.max(tl.abs(a), axis=1)
    s = tl.maximum(amax / FP8_MAX, 1e-12)
    q = tl.clamp(a / s[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return q, s


@triton.jit
def quant_group_block(x_ptr, q_ptr, s_ptr, t, gb, n_groups, stride_xm, G: tl.constexpr):
    """Row ``t`` (int64) of x, its ``G`` 1x128 groups of block ``gb``: q [T, n_groups * 128] = e4m3(x / s),
    s [T, n_groups] = amax / 448 (``quant_rows``)."""
    gi = gb * G + tl.arange(0, G)
    ok = gi < n_groups
    offs = gi[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + t * stride_xm + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    q, s = quant_rows(x)
    tl.store(q_ptr + t * n_groups * 128 + offs, q, mask=ok[:, None])
    tl.store(s_ptr + t * n_groups + gi, s, mask=ok)


@triton.jit
def quant_groups_kernel(x_ptr, q_ptr, s_ptr, n_groups, stride_xm, G: tl.constexpr):
    """Per 1x128 group of each row: q = e4m3(x / s), s = amax / 448 (activations of the fp8 path)."""
    t = tl.program_id(0).to(tl.int64)
    quant_group_block(x_ptr, q_ptr, s_ptr, t, tl.program_id(1), n_groups, stride_xm, G)

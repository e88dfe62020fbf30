"""fp8 block-scale helpers."""

from __future__ import annotations

import pytest
import torch

from replaymoe.quant import (
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)


def test_block_roundtrip_and_scale_layout(generator):
    w = torch.randn(3, 256, 384, generator=generator) * torch.rand(3, 1, 1, generator=generator) * 10
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (3, 2, 3)
    # the scale of block (e, i, j) is that block's amax / 448, computed independently here
    blk = w[1, 128:256, 256:384]
    assert torch.allclose(s[1, 1, 2], blk.abs().max() / FP8_MAX)
    back = dequantize_fp8_block(q, s)
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4 of the block amax scale
    err = (back - w).abs()
    bound = s.repeat_interleave(128, 1).repeat_interleave(128, 2) * FP8_MAX * 2**-4
    assert (err <= bound + 1e-12).all()
    assert q.float().abs().max() <= FP8_MAX


def test_block_zero_block_has_finite_scale():
    # an all-zero block must not divide by zero
    w = torch.zeros(128, 128)
    q, s = quantize_fp8_block(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (dequantize_fp8_block(q, s) == 0).all()


def test_token_group_roundtrip(generator):
    x = torch.randn(5, 256, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    q, s = quantize_fp8_per_token_group(x)
    assert q.shape == x.shape and s.shape == (5, 2)
    assert torch.allclose(s[3, 1], x[3, 128:].float().abs().max() / FP8_MAX)
    back = dequantize_fp8_per_token_group(q, s)
    bound = s.repeat_interleave(128, 1) * FP8_MAX * 2**-4
    assert ((back - x.float()).abs() <= bound + 1e-12).all()


@pytest.mark.parametrize(
    "fn,args,match",
    [
        (
            quantize_fp8_block,
            (torch.zeros(100, 128),),
            "shape of w: .*multiples of the block",
        ),  # rows not a multiple of 128
        (quantize_fp8_block, (torch.zeros(128),), "shape of w: .*at least 2 dims"),  # 1-D
        (quantize_fp8_block, (torch.zeros(128, 128, dtype=torch.int32),), "dtype of w"),
        (quantize_fp8_block, (torch.zeros(128, 128), (128,)), "block"),
        (quantize_fp8_per_token_group, (torch.zeros(2, 100),), "shape of x: .*multiple of 128"),
        (dequantize_fp8_block, (torch.zeros(128, 128), torch.ones(1, 1)), "dtype of w_fp8"),
        (dequantize_fp8_block, (torch.zeros(128, 128).to(torch.float8_e4m3fn), torch.ones(3, 1)), "scale"),
        (
            dequantize_fp8_per_token_group,
            (torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(3, 1)),
            "scale",
        ),
    ],
)
def test_quant_rejects(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)

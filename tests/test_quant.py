"""fp8 block-scale helpers."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replaymoe.moe.quant import (
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)

GiB = 1 << 30


def _quantize_whole(w, block=(128, 128)):
    """The whole-tensor formula quantize_fp8_block used before it worked in chunks (issue 33)."""
    bn, bk = block
    n, k = w.shape[-2], w.shape[-1]
    lead = w.shape[:-2]
    wb = w.float().reshape(*lead, n // bn, bn, k // bk, bk)
    amax = wb.abs().amax(dim=(-3, -1), keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    q = (wb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale.reshape(*lead, n // bn, k // bk).contiguous()


def _dequantize_whole(w_fp8, scale, dtype=torch.float32):
    """The whole-tensor formula of dequantize_fp8_block before issue 33."""
    n, k = w_fp8.shape[-2], w_fp8.shape[-1]
    sn, sk = scale.shape[-2], scale.shape[-1]
    lead = w_fp8.shape[:-2]
    wb = w_fp8.float().reshape(*lead, sn, n // sn, sk, k // sk) * scale.reshape(*lead, sn, 1, sk, 1)
    return wb.reshape(w_fp8.shape).to(dtype)


def _bits(t):
    """The tensor's bytes as integers (NaNs and signed zeros compared bit for bit)."""
    t = t.contiguous()
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    )


def _assert_same_bits(a, b):
    """Bit for bit (signed zeros included), except that a NaN matches any NaN: the sign and payload of a
    NaN cast to bf16 / fp8 depend on the cast kernel's path (vectorized or not, the layout)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = a.float().isnan()
    assert torch.equal(nan, b.float().isnan())
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _weights(shape, dtype, generator, device="cpu"):
    """Random weights with per-block magnitudes from 1e-6 to 1e3 and special values: an all-zero block,
    signed zeros, a block holding +-inf and one holding a NaN (the chunks must treat them as the whole
    tensor does)."""
    w = torch.randn(shape, generator=generator) * 10.0 ** torch.randint(
        -6, 4, (*shape[:-2], 1, 1), generator=generator
    )
    w = w.to(dtype)
    w[..., :128, :128] = 0
    w[..., 0, 128:130] = -0.0
    if shape[-1] >= 384:
        w.view(-1, *shape[-2:])[0, 5, 300] = float("inf")
        w.view(-1, *shape[-2:])[-1, 7, 290] = float("-inf")
        w.view(-1, *shape[-2:])[-1, 100, 200] = float("nan")
    return w.to(device)


def _cases(generator, device="cpu"):
    """(name, w): contiguous 2-D/3-D/4-D weights of every float dtype, a transposed view and a view whose
    leading dims cannot be merged without a copy."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        yield f"3d-{dtype}", _weights((5, 256, 384), dtype, generator, device)
    yield "2d", _weights((384, 256), torch.bfloat16, generator, device)
    yield "4d", _weights((2, 3, 128, 384), torch.bfloat16, generator, device)
    yield "transposed", _weights((3, 384, 256), torch.float32, generator, device).transpose(1, 2)
    yield "unmergeable-lead", _weights((4, 3, 256, 384), torch.bfloat16, generator, device)[:, ::2]
    yield "empty", torch.zeros(0, 256, 128, dtype=torch.bfloat16, device=device)


# temporary budgets: one row of blocks per chunk, a few row blocks, about one expert, the default
_BUDGETS = (1, 3 * 128 * 384 * 8, 256 * 384 * 8 + 1, None)


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


def _check_chunked_equals_whole(w, budget):
    kw = {} if budget is None else {"max_temp_bytes": budget}
    q_ref, s_ref = _quantize_whole(w)
    q, s = quantize_fp8_block(w, **kw)
    assert q.is_contiguous() and s.is_contiguous()
    _assert_same_bits(q, q_ref)
    _assert_same_bits(s, s_ref)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _assert_same_bits(dequantize_fp8_block(q, s, dtype=dtype, **kw), _dequantize_whole(q, s, dtype))


@pytest.mark.parametrize("budget", _BUDGETS)
def test_block_chunks_bitwise_equal_whole_tensor(generator, budget):
    # issue 33: the chunked helpers compute the whole-tensor formula's bits, whatever the chunking
    for name, w in _cases(generator):
        try:
            _check_chunked_equals_whole(w, budget)
        except AssertionError as e:
            raise AssertionError(f"case {name}, max_temp_bytes={budget}") from e


def test_block_dequantize_noncontiguous_inputs(generator):
    # fp8 weights and scales given as views whose leading dims cannot be merged (read in place)
    w = _weights((4, 3, 256, 384), torch.bfloat16, generator)
    q, s = quantize_fp8_block(w)
    qv, sv = q[:, ::2], s[:, ::2]
    _assert_same_bits(dequantize_fp8_block(qv, sv, max_temp_bytes=1), _dequantize_whole(qv, sv))
    qt, st = q[0].transpose(1, 2), s[0].transpose(1, 2)  # [3, 384, 256] with scales [3, 3, 2]
    _assert_same_bits(
        dequantize_fp8_block(qt, st, dtype=torch.bfloat16), _dequantize_whole(qt, st, torch.bfloat16)
    )


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op allocates (outputs with a storage none of its inputs has)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                if func is not torch.ops.aten.empty.memory_format:  # the outputs themselves
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_helpers_temporaries_bounded(generator, dtype):
    # no temporary larger than the budget (here 2 experts' fp32 copy of 8 experts): the old formula
    # allocated the whole tensor in fp32 several times over
    w = torch.randn(8, 256, 384, generator=generator).to(dtype)
    budget = 2 * 256 * 384 * 8
    with _LargestAllocation() as mode:
        q, s = quantize_fp8_block(w, max_temp_bytes=budget)
    assert 0 < mode.largest <= budget // 2  # each temporary is 4 bytes of the budget's 8 per element
    with _LargestAllocation() as mode:
        quantize_fp8_block(w, max_temp_bytes=1)  # one row of blocks per chunk: 128 x 384 fp32
    assert mode.largest <= 128 * 384 * 4
    with _LargestAllocation() as mode:
        dequantize_fp8_block(q, s, dtype=torch.bfloat16, max_temp_bytes=budget)
    assert 0 < mode.largest <= budget


def test_block_rejects_bad_budget():
    for bad in (0, -1, 1.5, "1"):
        with pytest.raises(ValueError, match="max_temp_bytes"):
            quantize_fp8_block(torch.zeros(128, 128), max_temp_bytes=bad)
        with pytest.raises(ValueError, match="max_temp_bytes"):
            dequantize_fp8_block(
                torch.zeros(128, 128).to(torch.float8_e4m3fn), torch.ones(1, 1), max_temp_bytes=bad
            )


@pytest.mark.gpu
@pytest.mark.parametrize("budget", _BUDGETS)
def test_block_chunks_bitwise_equal_whole_tensor_gpu(budget):
    g = torch.Generator().manual_seed(33)
    for name, w in _cases(g, device="cuda"):
        try:
            _check_chunked_equals_whole(w, budget)
        except AssertionError as e:
            raise AssertionError(f"case {name}, max_temp_bytes={budget}") from e


def _peak_above(fn, held_bytes):
    """Run fn(); return (its result, the allocation peak during it minus what was allocated before minus
    ``held_bytes`` (the result's size))."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before - held_bytes


@pytest.mark.gpu
@pytest.mark.gpu_alone  # 37 GiB free, so not beside other tests on one GPU
def test_block_helpers_peak_memory_deepseek_v3_gpu():
    # issue 33: one DeepSeek-V3 layer's w13 [256, 4096, 7168] bf16 (14 GiB). The whole-tensor formula
    # allocated a 28 GiB fp32 copy (and more), running out of memory on an 80 GB H100 holding the layer.
    # Now the peak above input + output stays under 1 GiB, for quantize and for dequantize.
    E, N, K = 256, 4096, 7168
    elems = E * N * K
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    need = elems * (1 + 4) + 2 * GiB  # the largest step: fp8 input + fp32 output of dequantize
    if free < need:
        pytest.skip(f"needs {need / GiB:.1f} GiB of free GPU memory, {free / GiB:.1f} GiB free")
    w = torch.empty(E, N, K, dtype=torch.bfloat16, device="cuda")
    w.normal_(0.0, K**-0.5, generator=torch.Generator("cuda").manual_seed(0))
    w[3] *= 1e3  # experts of different magnitudes
    w[200, :128, :128] = 0  # an all-zero block
    out_bytes = elems + E * (N // 128) * (K // 128) * 4  # fp8 values + fp32 scales
    (q, s), extra = _peak_above(functools.partial(quantize_fp8_block, w), out_bytes)
    assert q.shape == w.shape and s.shape == (E, N // 128, K // 128)
    assert extra <= GiB, f"quantize_fp8_block: {extra / GiB:.2f} GiB above input + output"
    for sl in (slice(0, 4), slice(198, 202), slice(E - 1, E)):  # bitwise the whole-tensor formula
        q_ref, s_ref = _quantize_whole(w[sl])
        _assert_same_bits(q[sl], q_ref)
        _assert_same_bits(s[sl], s_ref)
    del w, q_ref, s_ref
    torch.cuda.empty_cache()
    for dtype in (torch.bfloat16, torch.float32):
        out_bytes = elems * torch.empty((), dtype=dtype).element_size()
        back, extra = _peak_above(functools.partial(dequantize_fp8_block, q, s, dtype=dtype), out_bytes)
        assert back.dtype == dtype and back.shape == q.shape
        assert extra <= GiB, f"dequantize_fp8_block to {dtype}: {extra / GiB:.2f} GiB above input + output"
        for sl in (slice(0, 4), slice(E - 1, E)):
            _assert_same_bits(back[sl], _dequantize_whole(q[sl], s[sl], dtype))
        del back
        torch.cuda.empty_cache()

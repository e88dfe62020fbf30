"""``replaymoe._launch.FastLaunch`` on the GPU: after a key's first call the binder is skipped
(``launch_fixed``'s caller key, ``launch``'s argument key), and the launches still get every call's
own tensors, integers and constexprs, and a call that specializes otherwise gets its own kernel."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from replaymoe._launch import ENABLED, FastLaunch

pytestmark = pytest.mark.gpu


@triton.jit(do_not_specialize=["n", "shift"], do_not_specialize_on_alignment=["src", "dst"])
def _shifted_copy(src, dst, n, shift, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(dst + i, (tl.load(src + i, mask=ok) + shift) * SCALE, mask=ok)


@pytest.mark.parametrize("scale", [1, 3])  # the constexpr is part of the key
def test_launch_fixed_uses_each_calls_arguments(scale):
    fl = FastLaunch(_shifted_copy)
    for n, shift in [(1, 0), (17, 1), (300, -5), (1024, 16), (5, 7)]:  # values 1 and 16 included
        src = torch.randint(-100, 100, (n,), dtype=torch.int32, device="cuda")
        dst = torch.full((n + 3,), 12345, dtype=torch.int32, device="cuda")[1:]  # unaligned
        consts = {"SCALE": scale, "BLOCK": 128}
        fl.launch_fixed(("int32", scale), (triton.cdiv(n, 128),), (src, dst, n, shift), consts)
        torch.testing.assert_close(dst[:n], (src + shift) * scale, rtol=0, atol=0)
        assert (dst[n:] == 12345).all()  # nothing past n
    if ENABLED:
        assert ("int32", scale) in fl._fixed and fl._fixed[("int32", scale)] is not None


@triton.jit
def _strided_axpy(src, dst, n, stride, alpha, BLOCK: tl.constexpr):
    # specializes on everything Triton can: n and stride (== 1, % 16), both pointers' alignment
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    v = tl.load(src + i * stride, mask=ok)
    tl.store(dst + i, (v * alpha).to(dst.dtype.element_ty), mask=ok)


def test_launch_memo_binds_once_per_specialization(monkeypatch):
    fl = FastLaunch(_strided_axpy)
    binds = []
    real = FastLaunch._bind_and_launch
    monkeypatch.setattr(FastLaunch, "_bind_and_launch", lambda self, *a: (binds.append(1), real(self, *a)))
    buf = torch.randn(4096, device="cuda")
    cases = [  # (n, stride, dtype, src offset): 1 and 16 specialize, an odd offset unaligns src
        (16, 1, torch.float32, 0),
        (16, 1, torch.float32, 0),  # a repeat: no binder
        (17, 1, torch.float32, 0),  # n no longer divisible by 16
        (17, 1, torch.float32, 1),  # src unaligned
        (17, 16, torch.float32, 0),  # stride divisible by 16
        (1, 3, torch.bfloat16, 0),  # n == 1, another output dtype
        (17, 1, torch.float32, 1),  # repeats of earlier keys
        (16, 1, torch.float32, 0),
    ]
    for n, stride, dtype, off in cases:
        src = buf[off:]
        dst = torch.full((n,), -7.0, dtype=dtype, device="cuda")
        fl[(triton.cdiv(n, 64),)](src, dst, n, stride, 2.5, BLOCK=64)
        want = (src[: n * stride : stride] * 2.5).to(dtype)
        torch.testing.assert_close(dst, want, rtol=0, atol=0)
    if ENABLED:
        assert len(fl._memo) == 5 and len(binds) == 5 + 1  # each key once (+1: the first launch compiles)


def test_launch_memo_keeps_no_tensor_of_a_call():
    # a tensor passed by keyword is part of the memo's parameter list, not kept in it: its memory
    # (and a CUDA graph's pool) is free once the caller drops it
    import gc
    import weakref

    fl = FastLaunch(_strided_axpy)
    src = torch.randn(64, device="cuda")
    refs = []
    for _ in range(3):  # compile, memoize, hit
        dst = torch.empty(64, device="cuda")
        fl[(1,)](src, n=64, stride=1, alpha=2.0, dst=dst, BLOCK=64)
        torch.testing.assert_close(dst, src * 2.0, rtol=0, atol=0)
        refs.append(weakref.ref(dst))
        del dst
    gc.collect()
    assert all(r() is None for r in refs)


@triton.jit
def _desc_scale(desc, dst, n_cols, alpha, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # one [BLOCK_R, BLOCK_C] block per program, read through a host-side TMA descriptor
    r, c = tl.program_id(0) * BLOCK_R, tl.program_id(1) * BLOCK_C
    v = desc.load([r, c])
    rows = r + tl.arange(0, BLOCK_R)[:, None]
    cols = c + tl.arange(0, BLOCK_C)[None, :]
    tl.store(dst + rows * n_cols + cols, (v.to(tl.float32) * alpha).to(dst.dtype.element_ty))


def test_launch_memo_encodes_each_calls_descriptor():
    # the memo launches descriptor kernels through the native entry with cached encodings: a new
    # tensor, a new shape, or an address reused for another shape must each read what this call gave
    from triton.tools.tensor_descriptor import TensorDescriptor

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host-side TMA descriptors need sm_90")
    fl = FastLaunch(_desc_scale)
    cases = [(64, 64), (64, 64), (128, 64), (64, 128), (64, 64), (128, 64)]  # repeats hit the memo
    for i, (rows, cols) in enumerate(cases):
        src = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
        dst = torch.full((rows, cols), -1.0, device="cuda", dtype=torch.bfloat16)
        d = TensorDescriptor(src, [rows, cols], [cols, 1], [32, 64])
        fl[(rows // 32, cols // 64)](d, dst, cols, 2.0, BLOCK_R=32, BLOCK_C=64)
        torch.testing.assert_close(dst, src * 2.0, rtol=0, atol=0, msg=f"case {i}")
        del src, d  # the next case may land at this address with another shape
    if ENABLED:
        entries = list(fl._memo.values())
        assert entries and all(e.descs for e in entries)  # the cached-encoding path ran


def test_launcher_fast_path_launches_each_calls_addresses():
    # Launcher (the all-to-all's fixed-specialization launcher): the first call compiles through
    # Triton, later calls launch the compiled kernel with integer addresses through the launcher's
    # native entry point (no scratch memory here), on the current stream, with each call's buffers
    from replaymoe._launch import Launcher, addresses

    launcher = Launcher(_shifted_copy, num_warps=4)
    n, shift = 300, 3
    for i in range(4):
        src = torch.randint(-100, 100, (n,), dtype=torch.int32, device="cuda")
        dst = torch.full((n + 3,), 12345, dtype=torch.int32, device="cuda")[1:]  # unaligned
        args = (src, dst, n, shift, 2, 128)
        if i and launcher.ready():
            launcher.fast((triton.cdiv(n, 128),), addresses(args))
        else:
            launcher((triton.cdiv(n, 128),), args)
        torch.testing.assert_close(dst[:n], (src + shift) * 2, rtol=0, atol=0)
        assert (dst[n:] == 12345).all()
    if ENABLED:
        assert launcher.ready() and launcher._native is not launcher.compiled.run  # the native entry

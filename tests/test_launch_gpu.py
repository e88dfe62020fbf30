"""``replaymoe._launch.FastLaunch.launch_fixed`` on the GPU: after a key's first call the binder is
skipped, and the launches still get every call's own tensors, integers and constexprs."""

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

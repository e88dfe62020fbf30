"""Triton code of the benchmarks: measurement kernels, not ops (``replaymoe bench moe --read-floors``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def read_kernel(p, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out[pid] = the fp32 sum of ``ITERS`` blocks of ``BLOCK`` bf16 elements (a read that cannot be
    optimized away)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(p + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))

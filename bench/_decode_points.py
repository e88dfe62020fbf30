"""What the small-batch device probes share: the bench shapes, their weights, one point's inputs and vLLM's
kernels on them.

Used by ``bench/fused_reduce_probe.py``, ``bench/decode_kernel_profile.py`` and ``bench/fp8_decode_probe.py``.
vLLM 0.33's fused-MoE kernel runs through the peer driver (``moe_side_by_side.py``, ``vllm_moe_peer.py``),
which is not in this repository: ``../shared/peers/README.md`` says how to put it in ``.peers``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

sys.path.insert(0, ".peers")
import moe_side_by_side as S  # noqa: E402
import vllm_moe_peer as P  # noqa: E402

from replaymoe.moe._forward import experts_triton  # noqa: E402
from replaymoe.moe.configs import MoEConfig  # noqa: E402
from replaymoe.moe.quant import quantize_fp8_block  # noqa: E402

# key: (name, H, I, E, K)
SHAPES = {
    "q": ("qwen3", 2048, 768, 128, 8),
    "m": ("mixtral", 4096, 14336, 8, 2),
    "d": ("dsv3", 7168, 2048, 256, 8),
}


@dataclass
class Point:
    """One (shape, dtype, T) point: random inputs routed as the peer driver routes them.

    ``x`` [T, H] bf16; ``ids`` [T, K] int32 and ``wts`` [T, K] fp32; ``weights`` = (w13, w13_scale, w2,
    w2_scale): bf16 [E, 2I, H] / [E, H, I] with None scales, or e4m3 with their 128×128 block scales."""

    name: str
    dtype: str
    T: int
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    x: torch.Tensor
    ids: torch.Tensor
    wts: torch.Tensor
    weights: tuple

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    def ours(self, config: MoEConfig | None):
        """A call of the experts (``experts_triton``, topk given) with ``config``; returns its output."""
        w13, s13, w2, s2 = self.weights
        return lambda: experts_triton(self.x, w13, w2, self.ids, self.wts, w13_scale=s13, w2_scale=s2,
                                      local_expert_offset=0, out=None, config=config)  # fmt: skip

    def peer(self):
        """vLLM's two fused-MoE kernels on this point (``vk`` / ``vk8``: the alignment, the activation
        quantization and the SwiGLU between them precomputed, as the side-by-side times them)."""
        w13, s13, w2, s2 = self.weights
        if self.fp8:
            cfg8, _ = S.fp8_cfg(self.T, self.E, self.I, self.H, self.K)
            return S.vllm_fp8_kernels(self.x, w13, s13, w2, s2, self.wts, self.ids, cfg8, self.E)
        cfg, _ = P.pick_config(self.H, self.I, self.E, self.K, self.T)
        return P.vllm_kernels_only(self.x, w13, w2, self.wts, self.ids, cfg)[0]


def points(shapes: str, dtypes: str, tokens: str, dev: torch.device) -> Iterator[Point]:
    """Every point of the comma-separated ``shapes`` (keys of :data:`SHAPES`), ``dtypes`` (bf16, then fp8:
    the fp8 weights are quantized from the bf16 ones, which are then freed) and ``tokens``, one shape's
    weights at a time."""
    for key in shapes.split(","):
        name, H, I, E, K = SHAPES[key]  # noqa: E741
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g).mul_(H**-0.5)
        w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g).mul_(I**-0.5)
        weights: tuple = (w13, None, w2, None)
        for dt in dtypes.split(","):
            if dt == "fp8":
                (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
                weights = w13 = w2 = None
                torch.cuda.empty_cache()
                weights = (q13, s13, q2, s2)
            for T in map(int, tokens.split(",")):
                x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
                wts, ids = P.route(T, E, K, dev, g)
                yield Point(name, dt, T, H, I, E, K, x, ids, wts, weights)
        weights = w13 = w2 = None
        torch.cuda.empty_cache()


bench_graph = P.bench_graph  # graph replay, L2 flushed, median of do_bench (ms)

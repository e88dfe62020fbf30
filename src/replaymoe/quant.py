"""fp8 block-scale helpers (DeepSeek style) for preparing fused-MoE weights.

Format: ``value = fp8 * scale``, ``float8_e4m3fn`` data, fp32 scales.

* Weights: one scale per 128×128 block of the last two dims,
  ``w [..., N, K] -> (w_fp8 [..., N, K], scale [..., N/128, K/128])``.
* Activations: one scale per 1×128 group along the last dim,
  ``x [T, H] -> (x_fp8 [T, H], scale [T, H/128])``.

Scales are ``amax / 448`` (448 = largest finite e4m3 value), so each block's largest
magnitude maps to ±448; an all-zero block gets a tiny positive scale (no division by 0).
"""

from __future__ import annotations

import torch

from ._validation import check_int, check_tensor, fail

__all__ = [
    "FP8_MAX",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_fp8_per_token_group",
    "dequantize_fp8_per_token_group",
]

FP8_MAX = 448.0
_MIN_SCALE = 1e-12
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_block(block: object) -> tuple[int, int]:
    if not (isinstance(block, tuple | list) and len(block) == 2):
        fail("block", "a pair (block_n, block_k)", repr(block))
    return check_int("block[0]", block[0], low=1), check_int("block[1]", block[1], low=1)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to float8_e4m3fn with one fp32 scale per ``block`` of the last two dims.

    Parameters
    ----------
    w : Tensor [..., N, K], float32 / float16 / bfloat16
        E.g. ``w13 [E, 2I, H]`` or ``w2 [E, H, I]``. N and K must be multiples of the block.
    block : (int, int)
        Block size (rows, columns); DeepSeek-V3 and the fused-MoE fp8 path use (128, 128).

    Returns
    -------
    w_fp8 : Tensor [..., N, K], float8_e4m3fn
    scale : Tensor [..., N / block[0], K / block[1]], float32
        ``dequantize_fp8_block(w_fp8, scale) ≈ w``.
    """
    bn, bk = _check_block(block)
    check_tensor("w", w, dtype=_FLOATS)
    if w.dim() < 2:
        fail("w", "at least 2 dims [..., N, K]", f"shape {tuple(w.shape)}", what="shape")
    n, k = w.shape[-2], w.shape[-1]
    if n % bn or k % bk:
        fail("w", f"last two dims multiples of the block {bn}x{bk}", f"shape {tuple(w.shape)}", what="shape")
    lead = w.shape[:-2]
    wb = w.float().reshape(*lead, n // bn, bn, k // bk, bk)
    amax = wb.abs().amax(dim=(-3, -1), keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (wb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale.reshape(*lead, n // bn, k // bk).contiguous()


def dequantize_fp8_block(
    w_fp8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block`: ``w_fp8 [..., N, K] * scale [..., N/bn, K/bk]`` → ``dtype``.

    The block size is inferred from the shapes (N / scale.shape[-2], K / scale.shape[-1]).
    """
    check_tensor("w_fp8", w_fp8, dtype=torch.float8_e4m3fn)
    check_tensor("scale", scale, ndim=w_fp8.dim(), dtype=torch.float32)
    n, k = w_fp8.shape[-2], w_fp8.shape[-1]
    sn, sk = scale.shape[-2], scale.shape[-1]
    if tuple(scale.shape[:-2]) != tuple(w_fp8.shape[:-2]) or sn == 0 or sk == 0 or n % sn or k % sk:
        fail(
            "scale",
            f"[..., N/bn, K/bk] dividing w_fp8 {tuple(w_fp8.shape)}",
            tuple(scale.shape),
            what="shape",
        )
    bn, bk = n // sn, k // sk
    lead = w_fp8.shape[:-2]
    wb = w_fp8.float().reshape(*lead, sn, bn, sk, bk) * scale.reshape(*lead, sn, 1, sk, 1)
    return wb.reshape(w_fp8.shape).to(dtype)


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per 1×``group_size`` group of the last dim.

    Parameters
    ----------
    x : Tensor [..., H], float32 / float16 / bfloat16; H a multiple of ``group_size``.

    Returns
    -------
    x_fp8 : Tensor [..., H], float8_e4m3fn
    scale : Tensor [..., H / group_size], float32
    """
    check_int("group_size", group_size, low=1)
    check_tensor("x", x, dtype=_FLOATS)
    h = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or h % group_size:
        fail("x", f"last dim a multiple of {group_size}", f"shape {tuple(x.shape)}", what="shape")
    xg = x.float().reshape(*x.shape[:-1], h // group_size, group_size)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1).contiguous()


def dequantize_fp8_per_token_group(
    x_fp8: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_per_token_group`: ``x_fp8 [..., H] * scale [..., H/g]``."""
    check_tensor("x_fp8", x_fp8, dtype=torch.float8_e4m3fn)
    check_tensor("scale", scale, ndim=x_fp8.dim(), dtype=torch.float32)
    h, g = x_fp8.shape[-1], scale.shape[-1]
    if tuple(scale.shape[:-1]) != tuple(x_fp8.shape[:-1]) or g == 0 or h % g:
        fail("scale", f"[..., H/group] for x_fp8 {tuple(x_fp8.shape)}", tuple(scale.shape), what="shape")
    xg = x_fp8.float().reshape(*x_fp8.shape[:-1], g, h // g) * scale.unsqueeze(-1)
    return xg.reshape(x_fp8.shape).to(dtype)


def fake_quant_fp8_per_token_group(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """``dequantize(quantize(x))`` in fp32: what the fp8 path's activations look like to the GEMMs."""
    q, s = quantize_fp8_per_token_group(x, group_size)
    return dequantize_fp8_per_token_group(q, s)

"""fp8 block-scale helpers (DeepSeek style) for preparing fused-MoE weights.

Format: ``value = fp8 * scale``, ``float8_e4m3fn`` data, fp32 scales.

* Weights: one scale per 128×128 block of the last two dims,
  ``w [..., N, K] -> (w_fp8 [..., N, K], scale [..., N/128, K/128])``.
* Activations: one scale per 1×128 group along the last dim,
  ``x [T, H] -> (x_fp8 [T, H], scale [T, H/128])``.

Scales are ``amax / 448`` (448 = largest finite e4m3 value), so each block's largest
magnitude maps to ±448; an all-zero block gets a tiny positive scale (no division by 0).

The weight helpers (:func:`quantize_fp8_block`, :func:`dequantize_fp8_block`) work through the
tensor in chunks of whole blocks (several experts at a time, or row blocks of one expert), writing
into preallocated outputs: their fp32 temporaries stay under ``max_temp_bytes`` (default 256 MiB)
whatever the tensor's size, so one DeepSeek-V3 layer (``w13 [256, 4096, 7168]`` bf16, 15 GB) is
quantized on a GPU that holds little more than the layer and its fp8 copy. The chunks compute
exactly what the whole-tensor formula computes (elementwise ops and a max per block), bit for bit.
"""

from __future__ import annotations

import torch

from .._validation import check_int, check_tensor, fail

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
# default bound on the fp32 temporaries of the weight helpers (per chunk)
MAX_TEMP_BYTES = 256 << 20


def _check_block(block: object) -> tuple[int, int]:
    if not (isinstance(block, tuple | list) and len(block) == 2):
        fail("block", "a pair (block_n, block_k)", repr(block))
    return check_int("block[0]", block[0], low=1), check_int("block[1]", block[1], low=1)


def _block_view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t.view(shape)`` or None when its leading dims cannot be merged without a copy."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _chunks(n_lead: int, n_row_blocks: int, block_elems: int, max_elems: int):
    """Index pairs ``(lead slice, row-block slice)`` into ``[L, N/bn, bn, K/bk, bk]`` views, each chunk
    at most ``max_elems`` elements (at least one row block of one expert): whole experts grouped when
    one fits, else row blocks of one expert at a time."""
    per_lead = n_row_blocks * block_elems
    if per_lead <= max_elems:
        g = max(1, max_elems // max(per_lead, 1))
        for l0 in range(0, n_lead, g):
            yield slice(l0, min(l0 + g, n_lead)), slice(None)
    else:
        c = max(1, max_elems // block_elems)
        for lead in range(n_lead):
            for r0 in range(0, n_row_blocks, c):
                yield slice(lead, lead + 1), slice(r0, min(r0 + c, n_row_blocks))


def _check_temp_bytes(max_temp_bytes: object) -> int:
    return check_int("max_temp_bytes", max_temp_bytes, low=1)


def _quantize_block_into(
    w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, max_temp_bytes: int
) -> None:
    """Fill ``q`` (contiguous, fp8) and ``scale`` (contiguous, fp32) from ``w`` chunk by chunk."""
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = n // bn, k // bk
    n_lead = w.numel() // max(n * k, 1)
    w5 = _block_view(w, (n_lead, nb, bn, kb, bk))
    if w5 is None:  # leading dims that cannot be merged without a copy: one index of dim 0 at a time
        for i in range(w.shape[0]):
            _quantize_block_into(w[i], q[i], scale[i], bn, bk, max_temp_bytes)
        return
    q5 = q.view(n_lead, nb, bn, kb, bk)
    s5 = scale.view(n_lead, nb, 1, kb, 1)
    copies = w.dtype != torch.float32  # .float() copies; on fp32 input it returns the input itself
    # per element: the fp32 copy and |x| (freed after the max), then the quotient (in place on a copy)
    for li, ri in _chunks(n_lead, nb, bn * k, max(1, max_temp_bytes // 8)):
        wb = w5[li, ri].float()
        amax = wb.abs().amax(dim=(-3, -1), keepdim=True)
        s = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
        t = wb.div_(s) if copies else wb / s
        q5[li, ri].copy_(t.clamp_(-FP8_MAX, FP8_MAX))  # the fp32 -> e4m3 cast of .to(float8_e4m3fn)
        s5[li, ri].copy_(s)
        del wb, amax, s, t


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), *, max_temp_bytes: int = MAX_TEMP_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to float8_e4m3fn with one fp32 scale per ``block`` of the last two dims.

    Parameters
    ----------
    w : Tensor [..., N, K], float32 / float16 / bfloat16
        E.g. ``w13 [E, 2I, H]`` or ``w2 [E, H, I]``. N and K must be multiples of the block. Any
        strides (a transposed view is read in place).
    block : (int, int)
        Block size (rows, columns); DeepSeek-V3 and the fused-MoE fp8 path use (128, 128).
    max_temp_bytes : int, keyword-only
        Bound on the fp32 temporaries: ``w`` is quantized in chunks of whole blocks (experts, or row
        blocks of one expert) of at most ``max_temp_bytes / 8`` elements, except that a chunk holds at
        least one row of blocks (``block[0] × K`` elements). The result does not depend on it.

    Returns
    -------
    w_fp8 : Tensor [..., N, K], float8_e4m3fn, contiguous
    scale : Tensor [..., N / block[0], K / block[1]], float32, contiguous
        ``dequantize_fp8_block(w_fp8, scale) ≈ w``. No autograd graph is recorded.

    Memory: the outputs (``w.numel()`` bytes plus the scales) and temporaries of at most
    ``max(max_temp_bytes, 8 × block[0] × K)`` bytes; nothing of ``w``'s size in fp32.
    """
    bn, bk = _check_block(block)
    check_tensor("w", w, dtype=_FLOATS)
    max_temp_bytes = _check_temp_bytes(max_temp_bytes)
    if w.dim() < 2:
        fail("w", "at least 2 dims [..., N, K]", f"shape {tuple(w.shape)}", what="shape")
    n, k = w.shape[-2], w.shape[-1]
    if n % bn or k % bk:
        fail("w", f"last two dims multiples of the block {bn}x{bk}", f"shape {tuple(w.shape)}", what="shape")
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((*w.shape[:-2], n // bn, k // bk), dtype=torch.float32, device=w.device)
    if w.numel():
        with torch.no_grad():
            _quantize_block_into(w, q, scale, bn, bk, max_temp_bytes)
    return q, scale


def _dequantize_block_into(
    w_fp8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, max_temp_bytes: int
) -> None:
    """Fill ``out`` (contiguous) with ``w_fp8 * scale`` chunk by chunk."""
    n, k = w_fp8.shape[-2], w_fp8.shape[-1]
    nb, kb = scale.shape[-2], scale.shape[-1]
    bn, bk = n // nb, k // kb
    n_lead = w_fp8.numel() // max(n * k, 1)
    w5 = _block_view(w_fp8, (n_lead, nb, bn, kb, bk))
    s5 = _block_view(scale, (n_lead, nb, 1, kb, 1))
    if w5 is None or s5 is None:  # leading dims that cannot be merged: one index of dim 0 at a time
        for i in range(w_fp8.shape[0]):
            _dequantize_block_into(w_fp8[i], scale[i], out[i], max_temp_bytes)
        return
    o5 = out.view(n_lead, nb, bn, kb, bk)
    # per element: the fp32 copy, multiplied in place, then cast into ``out``
    for li, ri in _chunks(n_lead, nb, bn * k, max(1, max_temp_bytes // 4)):
        t = w5[li, ri].float().mul_(s5[li, ri])
        o5[li, ri].copy_(t)  # the cast of .to(dtype)
        del t


def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    max_temp_bytes: int = MAX_TEMP_BYTES,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block`: ``w_fp8 [..., N, K] * scale [..., N/bn, K/bk]`` → ``dtype``.

    The block size is inferred from the shapes (N / scale.shape[-2], K / scale.shape[-1]). The product
    is formed in fp32, in chunks whose fp32 temporary holds at most ``max_temp_bytes / 4`` elements (at
    least one row of blocks), and written into a new contiguous tensor; the result does not depend on
    ``max_temp_bytes``. No autograd graph is recorded.
    """
    check_tensor("w_fp8", w_fp8, dtype=torch.float8_e4m3fn)
    check_tensor("scale", scale, ndim=w_fp8.dim(), dtype=torch.float32)
    max_temp_bytes = _check_temp_bytes(max_temp_bytes)
    n, k = w_fp8.shape[-2], w_fp8.shape[-1]
    sn, sk = scale.shape[-2], scale.shape[-1]
    if tuple(scale.shape[:-2]) != tuple(w_fp8.shape[:-2]) or sn == 0 or sk == 0 or n % sn or k % sk:
        fail(
            "scale",
            f"[..., N/bn, K/bk] dividing w_fp8 {tuple(w_fp8.shape)}",
            tuple(scale.shape),
            what="shape",
        )
    out = torch.empty(w_fp8.shape, dtype=dtype, device=w_fp8.device)
    if w_fp8.numel():
        with torch.no_grad():
            _dequantize_block_into(w_fp8, scale, out, max_temp_bytes)
    return out


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

"""Row layout and packing shared by the all-to-all and its transports.

A dispatch sends each token as one packed row of bytes: every payload in its own 64-byte aligned
region, then a region for the per-block count (:func:`row_layout`). This module holds that layout,
the typed views of a receive buffer (:func:`recv_views`), where a transport wants rows written
(:class:`Targets`), the copy-unit and tile-size choices of the Triton copies, and the torch-ops
packing used on CPU (:func:`pack_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._launch import cdiv, next_power_of_2

_ALIGN = 64  # bytes: payload regions and rows are aligned so Triton sees 16-unit divisibility
PACK_CHUNK = 4096  # most units one pack program copies per payload row and iteration (any grid)
_REDUCE_CHUNK = 4096  # most columns one reduce / combine-send program handles per iteration
_DENSE_CHUNK = 1024  # the combine kernels without num_sms: one short-lived program per (row, chunk)


def row_tiling(H: int, persistent: bool) -> tuple[int, int, int, int]:
    """``(nb, chunks, tt, warps)`` of the row-copying combine kernels (``ep_combine_send_kernel``,
    ``ep_combine_reduce_kernel``) for rows of ``H`` elements: ``nb`` columns per chunk (a power of
    two), ``chunks`` of them per row, ``tt`` rows per program, ``num_warps``. ``persistent`` (a
    ``num_sms`` cap): longer chunks and programs that loop."""
    nb = min(_REDUCE_CHUNK if persistent else _DENSE_CHUNK, next_power_of_2(H))
    chunks = cdiv(H, nb)
    if persistent:
        tt = 4 if nb >= 2048 else 2 if nb >= 1024 else 8
    else:
        tt = 1 if nb >= 256 else 8
    warps = 16 if tt * nb >= 8192 else 8 if tt * nb >= 2048 else 4
    return nb, chunks, tt, warps


def align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def gcd_all(values: list[int]) -> int:
    import math

    g = 0
    for v in values:
        g = math.gcd(g, v)
    return g


@dataclass
class Targets:
    """Where a transport wants a dispatch of one (row layout, runtime_max) written (bytes).

    recv : the local receive buffer (uint8); block : bytes per source block in it.
    dsts : per destination rank, the uint8 buffer the pack writes into; token row ``j`` of rank
    ``r`` lands at ``dst_base + r * stride_dst_rank + j * row_bytes`` of ``dsts[r]`` (the count in
    the header row ``rt`` of that block). send / recv_out : the nccl exchange's slices (or None).
    """

    recv: torch.Tensor
    block: int
    dsts: list[torch.Tensor]
    stride_dst_rank: int
    dst_base: int
    send: torch.Tensor | None = None
    recv_out: torch.Tensor | None = None
    signal: tuple | None = None  # symm fused barrier: (arrive, epoch, q0..q7, pad_off) for the pack
    wait: tuple | None = None  # symm fused barrier: (epoch, pad, pad_base, timeout_ns, TIMER)


@dataclass(frozen=True)
class _PayloadSpec:
    """One payload's place in a packed row.

    dtype, inner : element dtype and per-token shape; nbytes : bytes per token;
    offset : byte offset of its region in the row (multiple of 64).
    """

    dtype: torch.dtype
    inner: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True)
class RowLayout:
    """Packed row: payload regions, then one 64-byte region no payload covers, where the header row
    (row ``runtime_max`` of each block) keeps the int32 count, so that sanitizing the id payload over
    all rows (header rows included) cannot clobber a count.

    row_bytes : multiple of 64; count_offset : byte offset of the count in the header row.
    """

    specs: tuple[_PayloadSpec, ...]
    row_bytes: int
    count_offset: int


def row_layout(payloads: list[torch.Tensor]) -> RowLayout:
    """The packed row of ``payloads`` (each ``[T, *inner]``): one 64-byte-aligned region per payload
    in order, then the count region (:class:`RowLayout`). Used by the all-to-all and by the tests
    that build receive buffers by hand."""
    specs, off = [], 0
    for p in payloads:
        inner = tuple(p.shape[1:])
        nbytes = math.prod(inner) * p.element_size()
        specs.append(_PayloadSpec(p.dtype, inner, nbytes, off))
        off += align(max(nbytes, 1))
    return RowLayout(tuple(specs), off + _ALIGN, off)


def unit_dtype(nbytes: int, *ptrs: int) -> torch.dtype:
    """Widest integer unit (int32, int16 or uint8) dividing the row width and the addresses."""
    for size, dt in ((4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0 and all(p % size == 0 for p in ptrs):
            return dt
    return torch.uint8


def typed_view(buf: torch.Tensor, dtype: torch.dtype, size, stride, offset_bytes: int) -> torch.Tensor:
    """A strided ``dtype`` view into the uint8 buffer ``buf`` starting ``offset_bytes`` in."""
    es = torch.empty((), dtype=dtype).element_size()
    assert offset_bytes % es == 0 and buf.numel() % es == 0
    return buf.view(dtype).as_strided(size, stride, buf.storage_offset() // es + offset_bytes // es)


def _contig_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def recv_views(
    recv: torch.Tensor, layout: RowLayout, ep: int, rt: int, block_bytes: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-payload views [ep, rt, *inner] of a receive buffer (source s's block at ``s * block_bytes``,
    row j at ``j * row_bytes``) and the int32 [ep] view of the counts (in row ``rt`` of each block)."""
    views = []
    for s in layout.specs:
        es = torch.empty((), dtype=s.dtype).element_size()
        size = (ep, rt, *s.inner)
        stride = (block_bytes // es, layout.row_bytes // es, *_contig_strides(s.inner))
        views.append(typed_view(recv, s.dtype, size, stride, s.offset))
    count_at = rt * layout.row_bytes + layout.count_offset
    counts = typed_view(recv, torch.int32, (ep,), (block_bytes // 4,), count_at)
    return views, counts


def pack_rows(ep: int, plan, payloads, layout, dst: torch.Tensor, *, block_bytes) -> None:
    """Write token rows into the local buffer ``dst`` (uint8) with torch ops, for ``ep`` ranks: rank r,
    slot j, payload p lands at ``r * block_bytes + j * row_bytes + offset_p``; rows not sent go to a trash
    row past the last block."""
    T = plan.slot.shape[0]
    if T == 0:
        return
    RB = layout.row_bytes
    rows_per_block = block_bytes // RB
    trash = ep * rows_per_block
    rows = dst[: (trash + 1) * RB].view(trash + 1, RB)
    r_idx = torch.arange(ep, device=dst.device, dtype=torch.int64)[None, :] * rows_per_block
    idx = torch.where(plan.slot >= 0, r_idx + plan.slot.long(), torch.full_like(r_idx, trash))
    idx = idx.reshape(-1)
    for spec, p in zip(layout.specs, payloads):
        if spec.nbytes == 0:
            continue
        src = p.reshape(T, -1).view(torch.uint8).repeat_interleave(ep, dim=0)
        rows[:, spec.offset : spec.offset + spec.nbytes].index_copy_(0, idx, src)

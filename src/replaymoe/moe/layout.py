"""Token layout (the align step): (token, k) slots sorted by local expert, padded per expert to tiles.

A grouped GEMM over experts walks ``sorted_slots`` tile by tile (``block_m`` rows per tile); every
tile belongs to exactly one local expert, so a tile program reads one expert's weights. Rows past an
expert's real count are padding (slot id ``T*K``), which kernels mask. Buffers are sized by upper
bounds computed on the host from shapes only, so the layout needs no host synchronization and is
CUDA-graph capturable; the device tells how much of them is used (``num_tiles``).

* :func:`expert_layout` — Triton, two launches (one for up to one chunk of slots).
* :func:`layout_torch` — the reference (host-synchronizing), same outputs.
* :func:`compact_layout` / :func:`compact_layout_torch` — the same order without padding (one
  launch), for buffers with exactly one row per slot (the fused-MoE backward's intermediates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._launch import cdiv, next_power_of_2
from .._validation import check_int, check_tensor, fail

__all__ = [
    "CompactLayout",
    "ExpertLayout",
    "compact_layout",
    "compact_layout_torch",
    "expert_layout",
    "layout_torch",
    "layout_sizes",
]

_INT32_MAX = 2**31 - 1


@dataclass
class ExpertLayout:
    """Expert-sorted, tile-padded layout of the T·K (token, k) slots (slot = t*K + k).

    Only the first ``num_tiles[0] * block_m`` entries of ``sorted_slots`` and the first
    ``num_tiles[0]`` entries of the tile arrays are meaningful; the rest of ``sorted_slots`` is
    unspecified and the rest of the tile arrays is ``tile_expert = -1``, ``tile_row_end = 0``.

    Attributes
    ----------
    sorted_slots : int32 [max_padded]
        Slots grouped by local expert in ascending expert order; within an expert in ascending slot
        order. Expert ``e``'s segment is ``[expert_offsets[e], expert_offsets[e+1])``: its
        ``expert_counts[e]`` real slots first, then padding entries equal to ``T*K`` up to a multiple
        of ``block_m * cluster``. Slots routed to non-local experts do not appear.
    tile_expert : int32 [max_tiles]
        Local expert of tile ``i`` (rows ``[i*block_m, (i+1)*block_m)``), ``-1`` for ``i >= num_tiles``.
    tile_row_end : int32 [max_tiles]
        End of the real rows in tile ``i``'s expert segment (``expert_offsets[e] + expert_counts[e]``):
        rows ``>= tile_row_end[i]`` are padding. ``0`` for unused tiles.
    expert_offsets : int32 [E_local + 1]
        Padded segment starts; ``expert_offsets[0] = 0``, ``expert_offsets[E_local] = num_tiles*block_m``;
        every difference is a multiple of ``block_m * cluster``.
    expert_counts : int32 [E_local]
        Real (unpadded) slots per local expert.
    num_tiles : int32 [1]
        Tiles in use (a multiple of ``cluster``), on the device.
    block_m, cluster, num_slots : int
        Tile rows, tiles per group, and T*K (the padding marker).
    compact : CompactLayout or None
        The same order without padding, when :func:`expert_layout` built it alongside
        (``with_compact=True``); :func:`compact_layout` then returns it instead of launching.
    """

    sorted_slots: torch.Tensor
    tile_expert: torch.Tensor
    tile_row_end: torch.Tensor
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int
    cluster: int
    num_slots: int
    compact: CompactLayout | None = None

    @property
    def max_tiles(self) -> int:
        """Upper bound of ``num_tiles`` (the length of the tile arrays)."""
        return self.tile_expert.shape[0]


def layout_sizes(num_slots: int, num_local_experts: int, block_m: int, cluster: int = 1) -> tuple[int, int]:
    """Host-side upper bounds ``(max_padded, max_tiles)`` of a layout (exact integer arithmetic).

    Each non-empty expert adds at most ``seg - 1`` padding rows (``seg = block_m * cluster``) and at
    most ``min(E_local, T*K)`` experts are non-empty. Python integers do not overflow, so T·K·block
    beyond 2^31 is computed exactly; a layout whose positions would not fit int32 is rejected.
    """
    seg = block_m * cluster
    busy = min(num_local_experts, num_slots)
    max_padded = (num_slots + busy * (seg - 1)) // seg * seg
    max_tiles = max_padded // block_m
    if max_padded > _INT32_MAX or num_slots >= _INT32_MAX:
        fail(
            "topk_ids",
            f"T*K and its padded layout below 2^31 (int32 positions); block_m={block_m}",
            f"T*K={num_slots}, padded bound {max_padded}",
            what="size",
        )
    return max_padded, max_tiles


def _check(topk_ids, num_local_experts, block_m, local_expert_offset, cluster):
    check_tensor("topk_ids", topk_ids, ndim=2, dtype=(torch.int32, torch.int64), contiguous=True)
    check_int("num_local_experts", num_local_experts, low=1)
    check_int("block_m", block_m, low=1)
    if block_m & (block_m - 1):
        fail("block_m", "a power of two", block_m)
    check_int("local_expert_offset", local_expert_offset, low=0)
    check_int("cluster", cluster, low=1)


def expert_layout(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    *,
    block_m: int,
    local_expert_offset: int = 0,
    cluster: int = 1,
    with_compact: bool = False,
) -> ExpertLayout:
    """Sort the T·K slots by local expert and pad each expert's segment to ``block_m * cluster``.

    Parameters
    ----------
    topk_ids : int32 / int64 [T, K], contiguous
        Global expert ids. Ids outside ``[local_expert_offset, +num_local_experts)`` (including
        negative padding ids) get no slot and no tile.
    num_local_experts : int
        E_local.
    block_m : int (power of two), keyword-only
        Rows per GEMM tile.
    local_expert_offset : int
        Global id of the first local expert.
    cluster : int
        Segments are padded to ``block_m * cluster`` so tiles come in groups of ``cluster``.
    with_compact : bool
        Also build the :class:`CompactLayout` (in the same launches; ``.compact`` of the result).

    Returns
    -------
    ExpertLayout
        On ``topk_ids``' device. Two Triton launches (Triton's interpreter on CPU tensors when the
        process runs with ``TRITON_INTERPRET=1``), no host synchronization.
    """
    _check(topk_ids, num_local_experts, block_m, local_expert_offset, cluster)
    if not isinstance(with_compact, bool):
        fail("with_compact", "a bool", type(with_compact).__name__, what="type")
    return build_layout(topk_ids, num_local_experts, block_m, local_expert_offset, cluster, with_compact)


@dataclass(frozen=True)
class _HostPlan:
    """What the Triton layout's host side derives from the sizes of a call alone (cached per sizes)."""

    num_slots: int
    max_tiles: int
    e_pad: int  # experts padded to a power of two (one histogram row per chunk)
    ch: int  # slots per chunk
    num_chunks: int
    nc_pad: int
    tile_block: int
    grid: int
    total: int  # int32 elements of the call's one buffer
    rounded: tuple[int, ...]  # each part's length, rounded up to 16 bytes (``buf.split``)
    sizes: tuple[tuple[int, bool], ...]  # each part's length, and whether it equals the rounded one


@functools.lru_cache(maxsize=256)
def _host_plan(num_slots: int, num_local_experts: int, block_m: int, cluster: int, with_compact: bool):
    max_padded, max_tiles = layout_sizes(num_slots, num_local_experts, block_m, cluster)
    e_pad = next_power_of_2(max(num_local_experts, 2))
    nc_max = max(1, 8192 // e_pad)
    ch = max(64, next_power_of_2(-(-num_slots // nc_max)))
    if (e_pad + 1) * ch >= 2**31:  # the kernel's int32 sort key (expert * CH + slot) would wrap
        fail(
            "topk_ids",
            f"fewer (token, k) slots for {num_local_experts} local experts (the Triton layout's int32 "
            "sort key, expert * chunk + slot, must stay below 2**31); split the call",
            f"{num_slots} (token, k) slots",
            what="shape",
        )
    num_chunks = max(1, -(-num_slots // ch))
    tile_block = max(1, min(64, 4096 // e_pad, next_power_of_2(max(max_tiles, 1))))
    n_base = (2 if with_compact else 1) * num_chunks * e_pad
    n_slots_c = max(num_slots, 1) if with_compact else 0
    sizes = (num_chunks * e_pad, n_base, max(max_padded, 1), max_tiles, max_tiles, num_local_experts + 1,
             num_local_experts, 1, n_slots_c, num_local_experts + 1 if with_compact else 0,
             num_local_experts if with_compact else 0)  # fmt: skip
    rounded = tuple(-(-n // 4) * 4 for n in sizes)
    return _HostPlan(
        num_slots=num_slots,
        max_tiles=max_tiles,
        e_pad=e_pad,
        ch=ch,
        num_chunks=num_chunks,
        nc_pad=next_power_of_2(max(num_chunks, 2)),
        tile_block=tile_block,
        grid=max(num_chunks, -(-max_tiles // tile_block)),
        total=sum(rounded),
        rounded=rounded,
        sizes=tuple((n, n == r) for n, r in zip(sizes, rounded)),
    )


# expert_layout's parameters again, positional for the hot path (the public one keeps block_m keyword-only)
def build_layout(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    local_expert_offset: int = 0,
    cluster: int = 1,
    with_compact: bool = False,
    quant_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    id_check: dict | None = None,
) -> ExpertLayout:
    """Build the layout: the executor that :func:`expert_layout` runs after its argument checks, and that
    the fused-MoE launchers (:mod:`replaymoe.moe._forward`, :mod:`replaymoe.moe._backward`) call directly,
    their public entry point having validated the ids already (host work per call matters at decode
    sizes). No argument checks: the caller guarantees what :func:`expert_layout` checks (``topk_ids``
    int32/int64 [T, K], contiguous; ``num_local_experts >= 1``; ``block_m`` a power of two;
    ``local_expert_offset >= 0``; ``cluster >= 1``; ``with_compact`` a bool).

    ``quant_x`` = (x [T, H] contiguous, xq [T, H] e4m3, xs [T, H // 128] fp32), H a multiple of 128: the
    same launch also quantizes x per 1×128 group into xq and xs (the fp8 experts' input; one launch
    fewer than a separate quantization).

    ``id_check`` = the check's keyword arguments (``err_addr``: the error mailbox, ``id_bound``: E,
    ``CHECK_IDS``; ``replaymoe.moe._forward._id_check``): the scatter launch also checks the caller's
    ids against ``[-1, E)`` and for duplicates within a row, on the device
    (:mod:`replaymoe.routing._id_mailbox`)."""
    from .._launch import fast
    from ._kernel_layout import layout_hist_kernel, layout_scatter_kernel

    T, K = topk_ids.shape
    plan = _host_plan(T * K, num_local_experts, block_m, cluster, with_compact)
    num_slots, max_tiles = plan.num_slots, plan.max_tiles
    # every int32 buffer of the call in one allocation (one allocator call instead of ten; each part
    # starts on a 16-byte boundary, as the kernels' pointer specialization expects of fresh tensors)
    buf = torch.empty(plan.total, dtype=torch.int32, device=topk_ids.device)
    parts = buf.split(plan.rounded)
    hist, base, sorted_slots, tile_expert, tile_row_end, offsets, counts, num_tiles, cs, es, sh = (
        parts[i] if exact else parts[i][:n] for i, (n, exact) in enumerate(plan.sizes)
    )
    base = base.view(2 if with_compact else 1, plan.num_chunks, plan.e_pad)
    out = ExpertLayout(
        sorted_slots=sorted_slots,
        tile_expert=tile_expert,
        tile_row_end=tile_row_end,
        expert_offsets=offsets,
        expert_counts=counts,
        num_tiles=num_tiles,
        block_m=block_m,
        cluster=cluster,
        num_slots=num_slots,
    )
    compact_args = {}
    if with_compact:
        out.compact = CompactLayout(compact_slots=cs[:num_slots], exact_start=es, expert_shift=sh)
        compact_args = dict(compact_ptr=out.compact.compact_slots, cbase_ptr=base[1],
                            exact_start_ptr=out.compact.exact_start, shift_ptr=out.compact.expert_shift,
                            COMPACT=True)  # fmt: skip
    ch, e_pad = plan.ch, plan.e_pad
    single = plan.num_chunks == 1  # the scatter counts the one chunk's slots itself: one launch
    # the scatter on 4 warps over 2-16 chunks of 64 slots (decode to mid-size batches), faster there; one
    # chunk keeps 8, and so do prefill's larger chunks, where 8 win (docs/TUNING.md, "Small kernels at
    # decode sizes")
    warps = 4 if ch == 64 and 1 < plan.num_chunks <= 16 else 8
    if not single:
        fast(layout_hist_kernel)[(plan.num_chunks,)](
            topk_ids, hist, num_slots, local_expert_offset, num_local_experts, CH=ch, E_PAD=e_pad, num_warps=4
        )
    quant_args, grid = {}, plan.grid
    if quant_x is not None:  # programs past the layout's grid: one per (token, 8 groups of 128)
        x, xq, xs = quant_x
        n_groups = x.shape[1] // 128
        grid += x.shape[0] * cdiv(n_groups, 8)
        quant_args = dict(layout_grid=plan.grid, x_ptr=x, xq_ptr=xq, xs_ptr=xs, n_groups=n_groups,
                          stride_xm=x.stride(0), QUANT=True, QG=8)  # fmt: skip
    check_args = {} if id_check is None else {"top_k": K, **id_check}
    fast(layout_scatter_kernel)[(grid,)](
        topk_ids, hist, base, out.sorted_slots, out.tile_expert, out.tile_row_end, out.expert_offsets,
        out.expert_counts, out.num_tiles, num_slots, local_expert_offset, num_local_experts, plan.num_chunks,
        max_tiles, CH=ch, E_PAD=e_pad, NC_PAD=plan.nc_pad, BLOCK_M=block_m, SEG=block_m * cluster,
        TILE_BLOCK=plan.tile_block, **compact_args, SINGLE=single, num_warps=warps, **quant_args,
        **check_args,
    )  # fmt: skip
    return out


def layout_torch(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    *,
    block_m: int,
    local_expert_offset: int = 0,
    cluster: int = 1,
) -> ExpertLayout:
    """Reference of :func:`expert_layout` in plain torch (host-synchronizing); identical outputs
    on the meaningful entries (see :class:`ExpertLayout`)."""
    _check(topk_ids, num_local_experts, block_m, local_expert_offset, cluster)
    T, K = topk_ids.shape
    num_slots = T * K
    max_padded, max_tiles = layout_sizes(num_slots, num_local_experts, block_m, cluster)
    seg = block_m * cluster
    dev = topk_ids.device
    e = topk_ids.reshape(-1).long() - local_expert_offset
    local = (e >= 0) & (e < num_local_experts)
    counts = torch.bincount(e[local], minlength=num_local_experts)
    padded = (counts + seg - 1) // seg * seg
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(padded.cpu(), 0)
    sorted_slots = torch.full((max(max_padded, 1),), num_slots, dtype=torch.int32)
    tile_expert = torch.full((max_tiles,), -1, dtype=torch.int32)
    tile_row_end = torch.zeros(max_tiles, dtype=torch.int32)
    slots = torch.arange(num_slots)
    for x in range(num_local_experts):
        mine = slots[(e == x).cpu()]
        s = int(offsets[x])
        sorted_slots[s : s + mine.numel()] = mine.to(torch.int32)
        t0, t1 = s // block_m, int(offsets[x + 1]) // block_m
        tile_expert[t0:t1] = x
        tile_row_end[t0:t1] = s + mine.numel()
    n_tiles = int(offsets[-1]) // block_m
    i32 = torch.int32
    return ExpertLayout(
        sorted_slots=sorted_slots.to(dev),
        tile_expert=tile_expert.to(dev),
        tile_row_end=tile_row_end.to(dev),
        expert_offsets=offsets.to(i32).to(dev),
        expert_counts=counts.to(i32).to(dev),
        num_tiles=torch.tensor([n_tiles], dtype=i32, device=dev),
        block_m=block_m,
        cluster=cluster,
        num_slots=num_slots,
    )


@dataclass
class CompactLayout:
    """A layout's expert-sorted order without padding: exactly one row per local slot.

    Compact row ``exact_start[e] + j`` holds expert ``e``'s ``j``-th real slot, the slot at padded
    row ``expert_offsets[e] + j`` of the :class:`ExpertLayout`; so a tile kernel walking padded
    rows maps a real row ``r`` of a tile of expert ``e`` to compact row ``r - expert_shift[e]``.

    Attributes
    ----------
    compact_slots : int32 [T*K]
        ``sorted_slots`` without the padding: the local slots in layout order, then (rows
        ``>= exact_start[E_local]``, the slots routed to non-local experts) the marker ``T*K``.
        Every entry is defined.
    exact_start : int32 [E_local + 1]
        Exclusive cumulative sum of ``expert_counts``; ``exact_start[E_local]`` = local slots.
    expert_shift : int32 [E_local]
        ``expert_offsets[:-1] - exact_start[:-1]`` (padded minus compact start of each expert).
    """

    compact_slots: torch.Tensor
    exact_start: torch.Tensor
    expert_shift: torch.Tensor


def _check_layout(layout):
    if not isinstance(layout, ExpertLayout):
        fail("layout", "an ExpertLayout (from expert_layout or layout_torch)", type(layout).__name__,
             what="type")  # fmt: skip


def _empty_compact(num_slots: int, num_local: int, dev: torch.device) -> CompactLayout:
    i32 = torch.int32
    return CompactLayout(
        compact_slots=torch.empty(max(num_slots, 1), dtype=i32, device=dev)[:num_slots],
        exact_start=torch.empty(num_local + 1, dtype=i32, device=dev),
        expert_shift=torch.empty(num_local, dtype=i32, device=dev),
    )


def compact_layout(layout: ExpertLayout) -> CompactLayout:
    """Compact (unpadded) row order of ``layout``, on its device: one Triton launch, no host
    synchronization (CUDA-graph capturable); none when ``layout`` was built ``with_compact``.

    Parameters
    ----------
    layout : ExpertLayout
        From :func:`expert_layout` (or :func:`layout_torch`).

    Returns
    -------
    CompactLayout
        ``compact_slots`` [T*K], ``exact_start`` [E_local + 1], ``expert_shift`` [E_local], int32.
    """
    _check_layout(layout)
    if layout.compact is not None:
        return layout.compact
    from .._launch import fast
    from ._kernel_layout import layout_compact_kernel

    num_local = layout.expert_counts.shape[0]
    n = layout.num_slots
    bm = layout.block_m
    out = _empty_compact(n, num_local, layout.sorted_slots.device)
    compact = out.compact_slots
    e_pad = next_power_of_2(max(num_local, 2))
    tile_block = max(1, min(4096 // e_pad, 4096 // bm))
    max_tiles = layout.max_tiles
    fast(layout_compact_kernel)[(max(1, cdiv(max_tiles, tile_block)),)](
        layout.sorted_slots, layout.tile_expert, layout.expert_offsets, layout.expert_counts, compact,
        out.exact_start, out.expert_shift, n, num_local, max_tiles, E_PAD=e_pad, BLOCK_M=bm,
        TILE_BLOCK=tile_block, num_warps=4,
    )  # fmt: skip
    return out


def compact_layout_torch(layout: ExpertLayout) -> CompactLayout:
    """Reference of :func:`compact_layout` in plain torch (host-synchronizing), identical outputs."""
    _check_layout(layout)
    n = layout.num_slots
    counts = layout.expert_counts.long().cpu()
    offsets = layout.expert_offsets.long().cpu()
    sorted_slots = layout.sorted_slots.cpu()
    start = torch.zeros(counts.numel() + 1, dtype=torch.long)
    start[1:] = torch.cumsum(counts, 0)
    compact = torch.full((n,), n, dtype=torch.int32)
    for e, c in enumerate(counts.tolist()):
        s = int(offsets[e])
        compact[int(start[e]) : int(start[e]) + c] = sorted_slots[s : s + c]
    dev = layout.sorted_slots.device
    return CompactLayout(
        compact_slots=compact.to(dev),
        exact_start=start.to(torch.int32).to(dev),
        expert_shift=(offsets[:-1] - start[:-1]).to(torch.int32).to(dev),
    )

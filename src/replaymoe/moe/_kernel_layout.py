"""Triton kernels of the token layout (align step): expert-sorted, tile-padded slots.

Two launches (one where the slots fit one chunk), no host synchronization:

1. ``layout_hist_kernel`` (grid = chunks): per-chunk histogram of local expert ids; with one chunk
   the scatter counts them itself (``SINGLE``) and this launch is skipped.
2. ``layout_scatter_kernel`` (grid = max(chunks, tile blocks)): every program re-derives the
   per-expert totals and padded offsets from the (small) histogram table, then
   * scatters its chunk's slots to their sorted positions (stable: slot order inside an expert),
   * writes the tile metadata and the padding markers of its block of tiles,
   * program 0 writes ``expert_offsets``, ``expert_counts`` and ``num_tiles``;
   * with ``COMPACT``, the compact (unpadded) order as well: the same scatter from the unpadded
     expert starts, the marker in the rows past the local slots, and (program 0) ``exact_start``
     and ``expert_shift`` — :func:`replaymoe.moe.layout.compact_layout`'s outputs, one launch fewer.

With ``QUANT`` (the fp8 tile modes) the scatter launch also quantizes x per 1×128 group
(``quant_groups_kernel``'s arithmetic, so the same bits) in programs past the layout's grid, one per
(token, 8 groups): two independent small jobs in one launch, one launch fewer per fp8 call.

``layout_compact_kernel`` (grid = tile blocks) derives the layout's compact (unpadded) row order
from an existing layout: see :func:`replaymoe.moe.layout.compact_layout`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replaymoe.routing._kernel_ids import check_id_block

from ._kernel_quant import quant_group_block


@triton.jit
def _local_expert(ids_ptr, offs, num_slots, expert_offset, num_local):
    """Local expert id of each slot and whether it is local (and a real slot)."""
    in_range = offs < num_slots
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32) - expert_offset
    local = in_range & (e >= 0) & (e < num_local)
    return tl.where(local, e, 0), local


@triton.jit
def layout_hist_kernel(
    ids_ptr, hist_ptr, num_slots, expert_offset, num_local, CH: tl.constexpr, E_PAD: tl.constexpr
):
    c = tl.program_id(0)
    offs = c * CH + tl.arange(0, CH)
    e, local = _local_expert(ids_ptr, offs, num_slots, expert_offset, num_local)
    h = tl.histogram(e, E_PAD, mask=local)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), h)


@triton.jit
def layout_scatter_kernel(
    ids_ptr,
    hist_ptr,
    base_ptr,
    sorted_ptr,
    tile_expert_ptr,
    tile_row_end_ptr,
    expert_offsets_ptr,
    expert_counts_ptr,
    num_tiles_ptr,
    num_slots,
    expert_offset,
    num_local,
    num_chunks,
    max_tiles,
    CH: tl.constexpr,
    E_PAD: tl.constexpr,
    NC_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEG: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    compact_ptr=None,
    cbase_ptr=None,
    exact_start_ptr=None,
    shift_ptr=None,
    COMPACT: tl.constexpr = False,
    SINGLE: tl.constexpr = False,
    layout_grid=0,
    x_ptr=None,
    xq_ptr=None,
    xs_ptr=None,
    n_groups=0,
    stride_xm=0,
    QUANT: tl.constexpr = False,
    QG: tl.constexpr = 8,
    top_k=1,
    err_addr=None,
    id_bound=0,
    CHECK_IDS: tl.constexpr = False,
):
    """See the module docstring. ``SINGLE`` (one chunk): every program counts the slots itself
    (``layout_hist_kernel``'s histogram, ``hist_ptr`` unused), so the layout is one launch. ``QUANT``:
    the programs from ``layout_grid`` on quantize x [T, H] (``n_groups`` = H // 128 groups per row,
    ``QG`` per program) into ``xq`` [T, H] e4m3 and ``xs`` [T, n_groups] fp32. ``CHECK_IDS``: each
    program also checks its chunk of the caller's ids (rows of ``top_k``) against ``[-1, id_bound)`` and
    for duplicates within a row, into the error mailbox ``err_addr`` (``routing/_kernel_ids.py``)."""
    pid = tl.program_id(0)
    if QUANT:
        if pid >= layout_grid:
            q = pid - layout_grid
            n_gb = tl.cdiv(n_groups, QG)
            t = (q // n_gb).to(tl.int64)
            quant_group_block(x_ptr, xq_ptr, xs_ptr, t, q % n_gb, n_groups, stride_xm, QG)
            return
    ev = tl.arange(0, E_PAD)
    rows = tl.arange(0, NC_PAD)
    if SINGLE:
        e0, local0 = _local_expert(ids_ptr, tl.arange(0, CH), num_slots, expert_offset, num_local)
        h0 = tl.histogram(e0, E_PAD, mask=local0)
        hist = tl.where((rows == 0)[:, None], h0[None, :], 0)
    else:
        hist = tl.load(hist_ptr + rows[:, None] * E_PAD + ev[None, :], mask=(rows < num_chunks)[:, None],
                       other=0)  # fmt: skip
    total = tl.sum(hist, axis=0)  # [E_PAD] tokens per local expert
    padded = (total + SEG - 1) // SEG * SEG
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # ---- scatter this program's chunk of slots (stable within each expert) ----
    if pid < num_chunks:
        prev = tl.sum(tl.where((rows < pid)[:, None], hist, 0), axis=0)
        mine = tl.sum(tl.where((rows == pid)[:, None], hist, 0), axis=0)
        chunk_excl = tl.cumsum(mine, axis=0) - mine
        tl.store(base_ptr + pid * E_PAD + ev, padded_start + prev - chunk_excl)
        if CHECK_IDS:
            check_id_block(ids_ptr, pid * CH + tl.arange(0, CH), num_slots, top_k, id_bound, err_addr)
        tl.debug_barrier()
        i = tl.arange(0, CH)
        e, local = _local_expert(ids_ptr, pid * CH + i, num_slots, expert_offset, num_local)
        key = tl.where(local, e, E_PAD) * CH + i
        skey = tl.sort(key)
        se = skey // CH
        si = skey % CH
        ok = se < E_PAD
        base = tl.load(base_ptr + pid * E_PAD + se, mask=ok, other=0)
        tl.store(sorted_ptr + base + i, pid * CH + si, mask=ok)
        if COMPACT:  # the same order without padding: expert e's slots from exact_start[e]
            exact_start = tl.cumsum(total, axis=0) - total
            tl.store(cbase_ptr + pid * E_PAD + ev, exact_start + prev - chunk_excl)
            tl.debug_barrier()
            cbase = tl.load(cbase_ptr + pid * E_PAD + se, mask=ok, other=0)
            tl.store(compact_ptr + cbase + i, pid * CH + si, mask=ok)
            crow = pid * CH + i  # this chunk's rows past the local slots (EP): the marker
            tail = (crow >= tl.sum(total, axis=0)) & (crow < num_slots)
            tl.store(compact_ptr + crow, tl.full(crow.shape, 0, tl.int32) + num_slots, mask=tail)

    # ---- tile metadata and padding markers for this program's block of tiles ----
    n_tiles = tl.sum(padded, axis=0) // BLOCK_M
    t = pid * TILE_BLOCK + tl.arange(0, TILE_BLOCK)
    row0 = t * BLOCK_M
    te = tl.sum((padded_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # expert of the tile
    onehot = ev[None, :] == te[:, None]
    row_end = tl.sum(tl.where(onehot, (padded_start + total)[None, :], 0), axis=1)
    valid = t < n_tiles
    in_buf = t < max_tiles
    tl.store(tile_expert_ptr + t, tl.where(valid, te, -1), mask=in_buf)
    tl.store(tile_row_end_ptr + t, tl.where(valid, row_end, 0), mask=in_buf)
    r = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad_mask = valid[:, None] & (r >= row_end[:, None])
    tl.store(sorted_ptr + r, tl.full(r.shape, 0, tl.int32) + num_slots, mask=pad_mask)

    if pid == 0:
        tl.store(expert_offsets_ptr, 0)
        tl.store(expert_offsets_ptr + 1 + ev, padded_end, mask=ev < num_local)
        tl.store(expert_counts_ptr + ev, total, mask=ev < num_local)
        tl.store(num_tiles_ptr, n_tiles)
        if COMPACT:
            exact_end = tl.cumsum(total, axis=0)
            tl.store(exact_start_ptr + ev, exact_end - total, mask=ev < num_local)
            tl.store(exact_start_ptr + num_local, tl.sum(total, axis=0))
            tl.store(shift_ptr + ev, padded_start - (exact_end - total), mask=ev < num_local)


@triton.jit
def layout_compact_kernel(
    sorted_ptr,
    tile_expert_ptr,
    expert_offsets_ptr,
    expert_counts_ptr,
    compact_ptr,
    exact_start_ptr,
    shift_ptr,
    num_slots,
    num_local,
    max_tiles,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    """Compact rows of a layout for one block of tiles: every real padded row r of a tile of expert
    e goes to compact row ``r - shift[e]`` (``shift = expert_offsets - exact_start``); compact rows
    past the local slot count, inside this block's row range, get the marker ``num_slots``; program
    0 writes ``exact_start`` [E_local + 1] and ``shift`` [E_local]."""
    pid = tl.program_id(0)
    ev = tl.arange(0, E_PAD)
    e_ok = ev < num_local
    cnt = tl.load(expert_counts_ptr + ev, mask=e_ok, other=0)
    start = tl.cumsum(cnt, axis=0) - cnt  # exclusive: exact_start
    shift = tl.load(expert_offsets_ptr + ev, mask=e_ok, other=0) - start
    total = tl.sum(cnt, axis=0)
    if pid == 0:
        tl.store(exact_start_ptr + ev, start, mask=e_ok)
        tl.store(exact_start_ptr + num_local, total)
        tl.store(shift_ptr + ev, shift, mask=e_ok)
    t = pid * TILE_BLOCK + tl.arange(0, TILE_BLOCK)
    te = tl.load(tile_expert_ptr + t, mask=t < max_tiles, other=-1)  # -1: tile not in use
    sh = tl.sum(tl.where(ev[None, :] == te[:, None], shift[None, :], 0), axis=1)
    r = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    used = (te >= 0)[:, None]
    slot = tl.load(sorted_ptr + r, mask=used, other=num_slots)
    tl.store(compact_ptr + (r - sh[:, None]), slot, mask=used & (slot < num_slots))
    tail = (r >= total) & (r < num_slots)  # compact rows of non-local slots (EP): the marker
    tl.store(compact_ptr + r, tl.full(r.shape, 0, tl.int32) + num_slots, mask=tail)

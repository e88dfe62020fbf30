"""The launch plan of a dispatch: everything a call with one signature needs, built once.

A :meth:`~replaymoe.ep.MoeAlltoAll.dispatch` call with a new signature (:func:`find_dispatch`) is
validated (:func:`validate_dispatch`), then :func:`build_dispatch` builds its :class:`DispatchState`:
the receive views, the plan kernel's arguments, one ``ep_pack_kernel`` launch per group of up to four
payloads on each grid it may run on (:func:`pack_grid`, :func:`pack_tiles`), and the receive side's
sanitize. :mod:`~replaymoe.ep._dispatch` runs it; every later call with the same signature reuses it
(:func:`keep_dispatch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._launch import cdiv, next_power_of_2
from .._validation import check_int, check_tensor, fail
from .packing import PACK_CHUNK, RowLayout, gcd_all, recv_views, row_layout, unit_dtype
from .partition import PLAN_BLOCKS, plan_grid

CACHE_SIZE = 64  # steady-state plans kept per MoeAlltoAll, per phase (oldest dropped first)

# ep_pack_kernel's grids, chosen per call (pack_grid):
#   "dense"  num_sms unset, up to _DENSE_PACK_MAX_T tokens: one short-lived program per (token, 4096-unit
#            chunk), many resident per SM; the plan by a scan of the earlier ids in every tile;
#   "narrow" num_sms below _WIDE_MIN_PROGRAMS: num_sms persistent programs, 2 tokens x 4096 units per
#            iteration below 2048 tokens, 4 from there;
#   "wide"   num_sms from _WIDE_MIN_PROGRAMS, or unset above _DENSE_PACK_MAX_T tokens: one persistent
#            program per SM (at most num_sms), one token per iteration.
# The persistent grids compute the plan by look-back at every size (the scan re-reads every earlier id in
# each of a program's iterations, slower than the look-back on persistent grids). The grids, tokens per
# iteration and the dense grid's whole-row chunks were chosen from measurements on 4 x H200 and 2 x H200
# at DeepSeek-V3's rows (docs/DESIGN.md, "Expert parallelism", "The pack's grid").
_DENSE_PACK_MAX_T = 256
_WIDE_MIN_PROGRAMS = 64
# the persistent grids whose pack loads a program's next rows before it stores the current ones (PREFETCH):
# a little faster where the stores are not the limit, the same where they are (4 x H100; docs/DESIGN.md,
# "The pack's grid")
_PACK_PREFETCH_GRIDS = ("narrow", "wide")
# the pack's stores of a tile go to the ranks from this rank + 1 on, its own block last (True), or from
# rank 0 on (False): peers first is 1-4 µs faster at ep = 4 (4 x H100; docs/DESIGN.md, "The pack's store
# order")
PACK_PEERS_FIRST = True


def pack_tiles(Ns: list[int], grid: str, T: int) -> tuple[list[int], int, int, int]:
    """``(NBs, chunks, TT, warps)`` of ``ep_pack_kernel`` on ``grid`` (``"dense"``, ``"narrow"`` or
    ``"wide"``, see above) for ``T`` tokens whose payload rows have ``Ns`` units: the column chunk of
    each payload (a power of two), chunks per row, tokens per iteration and ``num_warps``."""
    NBs = [min(next_power_of_2(n), PACK_CHUNK) for n in Ns]
    chunks = max(cdiv(n, b) for n, b in zip(Ns, NBs))
    nb = max(NBs)
    if grid == "dense":
        TT = 1 if nb >= 256 else 16
    elif grid == "wide" and nb >= 1024:
        TT = 1
    else:
        TT = 4 if nb >= 2048 else 2 if nb >= 1024 else 16
        if TT == 4 and T < 2048:
            TT = 2
    elems = TT * nb
    warps = 16 if elems >= 8192 else 8 if elems >= 2048 else 4
    return NBs, chunks, TT, warps


# the receive side's sanitize inside the pack (no sanitize launch): up to _FUSED_SANITIZERS of the pack's
# last programs to arrive (one in the interpreter, which runs programs one after another) share the
# received rows in blocks of _FUSED_SANITIZE_BLOCK; None: at every size (a number: up to that many
# received rows, ep * (runtime_max + 1), the larger ones in a sanitize launch). 16 sanitizers are as fast
# as 32 and faster than the last program alone or a sanitize launch (4 x H100; docs/DESIGN.md, "The receive
# side of a dispatch")
_FUSED_SANITIZE_MAX_ROWS: int | None = None
_FUSED_SANITIZE_BLOCK = 512
_FUSED_SANITIZERS = 16


def pack_grid(num_sms: int | None, device_sms: int, T: int) -> str:
    """The pack's grid for ``T`` tokens on this rank: ``"dense"``, ``"narrow"`` or ``"wide"`` (see
    :func:`pack_tiles`), under a ``num_sms`` cap (``None``: none) on a device of ``device_sms`` SMs. A
    local choice: the peers never see the pack's grid."""
    if num_sms is None:
        return "dense" if T <= _DENSE_PACK_MAX_T else "wide"
    return "wide" if min(num_sms, device_sms) >= _WIDE_MIN_PROGRAMS else "narrow"


@dataclass
class _PackGroup:
    """Launch plan of one :func:`ep_pack_kernel` call (up to four payloads in one unit dtype)."""

    idx: list[int]
    unit: torch.dtype
    dsts: list[torch.Tensor]
    chunks: int
    TT: int
    warps: int
    consts: tuple
    consts_b: tuple = ()  # after the ids argument
    launch: object = None
    tail_i: tuple = ()  # (dsts..., T, consts...) with addresses, for direct launches
    tail_b_i: tuple = ()


@dataclass
class DispatchState:
    """Everything a dispatch with one signature needs, built once (see ``MoeAlltoAll`` Notes)."""

    T: int
    rt: int
    layout: RowLayout
    triton: bool
    targets: object
    views: list[torch.Tensor]
    counts: torch.Tensor
    slot: torch.Tensor | None = None
    send_counts: torch.Tensor | None = None
    plan_args: tuple = ()
    plan_args_i: tuple = ()  # the same with addresses for tensors (direct launches)
    plan_launch: object = None
    plan_programs: int = 1
    packs: list = field(default_factory=list)
    sanitize: tuple | None = None
    reduce: dict = field(default_factory=dict)  # reduce launch plans per returned-rows layout
    slot_i: int = 0
    fused_plan: bool = False  # the first pack on the dense grid computes the plan by a scan
    lookback: bool = False  # ... on the persistent grids by look-back
    fused_sanitize: bool = False  # the pack's last programs wait and sanitize (no sanitize launch)


def validate_dispatch(core, ids, payloads, rt, invalid, idx) -> tuple[int, int]:
    """Check a dispatch's arguments against ``core`` (:class:`~replaymoe.ep._core.AlltoAllCore`; not
    annotated: that module imports this one) before any communication (``ValueError``); returns
    ``(T_local, top_k)``."""
    check_tensor("token_selected_experts", ids, ndim=2, dtype=torch.int32, device=core.device)
    T, K = ids.shape
    if K != core.top_k:
        fail("token_selected_experts", f"[T_local, top_k={core.top_k}]", tuple(ids.shape), what="shape")
    check_int("runtime_max_tokens_per_rank", rt, low=1, high=core.max_num_tokens)
    if T > rt:
        fail(
            "token_selected_experts",
            f"at most runtime_max_tokens_per_rank={rt} tokens",
            f"{T} tokens",
            what="shape",
        )
    if not isinstance(payloads, (list, tuple)) or len(payloads) == 0:
        fail("payloads", "a non-empty list of [T_local, *] tensors", type(payloads).__name__)
    for i, p in enumerate(payloads):
        check_tensor(f"payloads[{i}]", p, device=core.device)
        if p.dim() < 1 or p.shape[0] != T:
            fail(f"payloads[{i}]", f"[T_local={T}, *]", tuple(p.shape), what="shape")
        if p.element_size() > 8:
            fail(f"payloads[{i}]", "an element size of at most 8 bytes", p.dtype, what="dtype")
    check_int("invalid_token_expert_id", invalid, low=-(2**31), high=2**31 - 1)
    if idx is not None:
        check_int("expert_id_payload_index", idx, low=0, high=len(payloads) - 1)
        check_tensor(f"payloads[{idx}]", payloads[idx], shape=(T, K), dtype=torch.int32)
    return T, K


def build_dispatch(core, T: int, K: int, payloads, rt, invalid, idx) -> DispatchState:
    """The launch plan (buffers, views, kernel arguments) of a validated call with a new signature, of
    ``T`` tokens of ``K`` experts each, on ``core``'s transport and buffers; every later call with the same
    signature reuses it."""
    layout = row_layout(list(payloads))
    use_triton = core.use_triton()
    core.transport.ensure_dispatch(layout.row_bytes)
    tg = core.transport.dispatch_targets(layout, rt)
    views, counts = recv_views(tg.recv, layout, core.ep, rt, tg.block)
    st = DispatchState(T=T, rt=rt, layout=layout, triton=use_triton, targets=tg, views=views, counts=counts)
    st.slot = torch.empty(T, core.ep, dtype=torch.int32, device=core.device)
    st.send_counts = torch.empty(core.ep, dtype=torch.int32, device=core.device)
    if not use_triton:
        return st

    from .._launch import Launcher
    from ._kernel_pack import ep_pack_kernel
    from ._kernel_plan import ep_plan_kernel
    from ._kernel_sanitize import ep_sanitize_kernel

    st.plan_launch = Launcher(ep_plan_kernel, num_warps=4)
    # plan kernel (+ the counts into every destination's header row)
    base, rem = divmod(core.num_experts, core.ep)
    ep_p2 = max(2, next_power_of_2(core.ep))
    hdrs = [h.view(torch.int32) for h in tg.dsts]
    hdrs = hdrs + [hdrs[0]] * (8 - len(hdrs))
    hdr_off = tg.dst_base + rt * layout.row_bytes + layout.count_offset
    bt, st.plan_programs = plan_grid(T)
    st.plan_args = (
        st.slot, st.send_counts, *hdrs, tg.stride_dst_rank // 4, hdr_off // 4, T, core.num_experts,
        base, rem, core.plan_scratch, K, core.ep, ep_p2, bt, PLAN_BLOCKS, True,
    )  # fmt: skip
    # the receive side: sanitize the ids (if any) and copy the counts; with the fused barrier, wait for
    # the peers' dispatch signals first. With one pack launch its last programs to arrive do it (one
    # launch less; see _FUSED_SANITIZERS)
    hdr = tg.recv.view(torch.int32)
    blk = 128
    if idx is not None:
        v = views[idx]
        n = core.ep * (rt + 1) - 1
        flat = torch.as_strided(v, (n, K), v.stride()[1:])
    else:
        n, flat = 0, core.recv_counts
    wait = tg.wait if tg.wait is not None else (core.recv_counts, core.recv_counts, 0, 0, False)
    san = (flat, hdr, core.recv_counts, n, flat.stride(0), rt + 1, counts.stride(0),
           counts.storage_offset() - hdr.storage_offset(), core.local_expert_offset,
           core.local_expert_offset + core.num_local_experts, invalid)  # fmt: skip
    k_p2 = max(2, next_power_of_2(K))
    specs = layout.specs
    live = [i for i, sp in enumerate(specs) if sp.nbytes > 0]
    st.fused_sanitize = (
        tg.wait is not None and core.fused_sanitize and 1 <= len(live) <= 4
        and (_FUSED_SANITIZE_MAX_ROWS is None or core.ep * (rt + 1) <= _FUSED_SANITIZE_MAX_ROWS)
    )  # fmt: skip
    if st.fused_sanitize:
        nz = _FUSED_SANITIZERS if core.device.type == "cuda" else 1
        zs = (*san, *wait[1:4], k_p2, _FUSED_SANITIZE_BLOCK, idx is not None, True, wait[4], nz)
    else:
        zs = (st.send_counts,) * 3 + (0,) * 8 + (st.send_counts, 0, 0, 2, 2, False, False, False, 1)
    if not st.fused_sanitize and (idx is not None or tg.wait is not None):
        st.sanitize = (
            Launcher(ep_sanitize_kernel, num_warps=4),
            max(1, cdiv(n, blk)),
            (*san, *wait[:4], K, k_p2, core.ep, ep_p2, blk, core.rank, idx is not None,
             tg.wait is not None, wait[4]),
        )  # fmt: skip
    # pack kernel: payloads in groups of four, each group in one unit dtype
    for g0 in range(0, len(live), 4):
        grp = live[g0 : g0 + 4]
        ptrs = [payloads[i].data_ptr() for i in grp]
        unit = unit_dtype(gcd_all([specs[i].nbytes for i in grp]), *ptrs)
        u = torch.empty((), dtype=unit).element_size()
        Ns = [specs[i].nbytes // u for i in grp]
        Os = [specs[i].offset // u for i in grp]
        pad = 4 - len(grp)
        dsts = [d.view(unit) for d in tg.dsts]
        dsts = dsts + [dsts[0]] * (8 - len(dsts))
        last = g0 + 4 >= len(live)
        # the first group's pack computes the plan itself (one launch less; int32 units so that it
        # can store the counts into the headers): on the dense grid by a scan of the earlier ids in
        # every tile, on the persistent ones by the plan kernel's look-back over 128-token blocks
        own_plan = g0 == 0 and unit == torch.int32 and core.fused_plan
        st.fused_plan = st.fused_plan or (own_plan and T <= _DENSE_PACK_MAX_T)
        st.lookback = st.lookback or own_plan
        hdr_units = (rt * layout.row_bytes + layout.count_offset) // 4
        plan_b = (st.send_counts, core.num_experts, base, rem, hdr_units)
        if not own_plan:
            plan_b = (st.send_counts, 1, 1, 0, 0)
        if tg.signal is not None and last:
            sig, signal = tg.signal, True
        else:
            sig, signal = (st.send_counts,) * 10 + (0,), False
        variants = {}
        for grid in ("dense", "narrow", "wide") if T <= _DENSE_PACK_MAX_T else ("narrow", "wide"):
            fplan = own_plan and grid == "dense"
            lookback = own_plan and grid != "dense"
            NBs, chunks, TT, warps = pack_tiles(Ns, grid, T)
            variants[grid] = _PackGroup(
                idx=grp, unit=unit, dsts=dsts, chunks=chunks, TT=TT, warps=warps,
                consts=(tg.stride_dst_rank // u, tg.dst_base // u, *sig),
                consts_b=(*plan_b, layout.row_bytes // u, *(Ns + [1] * pad), *(NBs + [1] * pad),
                          *(Os + [0] * pad), len(grp), core.ep, ep_p2, TT, core.rank, signal, fplan, K,
                          64, *zs, core.plan_scratch, bt, PLAN_BLOCKS, lookback,
                          core.device.type == "cuda", grid in _PACK_PREFETCH_GRIDS and not fplan,
                          (core.rank + 1) % core.ep if PACK_PEERS_FIRST else 0),
                launch=Launcher(ep_pack_kernel, num_warps=warps),
            )  # fmt: skip
        st.packs.append(variants)
    from .._launch import addresses

    st.plan_args_i = addresses(st.plan_args)
    for variants in st.packs:
        for g in variants.values():
            g.tail_i = addresses((*g.dsts, T, *g.consts))
            g.tail_b_i = addresses(g.consts_b)
    if st.sanitize is not None:
        st.sanitize = (*st.sanitize, addresses(st.sanitize[2]))
    st.slot_i = st.slot.data_ptr()
    return st


def find_dispatch(cache: dict, ids, payloads, rt, invalid, idx) -> tuple[tuple | None, DispatchState | None]:
    """``(key, state)``: the call's signature and the launch plan ``cache`` holds for it (``None``: none
    yet; a ``None`` key: arguments that are not tensors or not hashable, left to validation)."""
    try:  # the call's signature: everything validation and the launch plan depend on
        pkey = tuple((p.dtype, p.shape, p.get_device(), p.is_contiguous(), p.data_ptr() & 15)
                     for p in payloads)  # fmt: skip
        ikey = (ids.shape, ids.dtype, ids.get_device(), ids.data_ptr() & 15)
        key = (ikey, rt, invalid, idx, pkey)
        st = cache.get(key) if isinstance(payloads, (list, tuple)) else None
    except (AttributeError, TypeError):  # not tensors / unhashable: validation says what is wrong
        key, st = None, None
    return key, st


def keep_dispatch(cache: dict, key: tuple, st: DispatchState) -> None:
    """Keep a new launch plan in ``cache``, dropping the oldest beyond :data:`CACHE_SIZE`."""
    if len(cache) >= CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = st

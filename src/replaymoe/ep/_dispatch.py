"""A dispatch's launches, from its :class:`~replaymoe.ep._dispatch_plan.DispatchState`: the plan and the
pack (:func:`send`), the receive side after the exchange (:func:`receive`), and the torch-ops path of
CPU/gloo groups (:func:`dispatch_torch_ops`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._launch import cdiv
from ._dispatch_plan import DispatchState
from .partition import make_plan

if TYPE_CHECKING:
    from ._core import AlltoAllCore


def send(core: AlltoAllCore, st: DispatchState, ids: torch.Tensor, payloads) -> None:
    """Plan + pack (with the fused barrier, the pack's last program signals the peers)."""
    if not ids.is_contiguous():
        ids = ids.contiguous()
    grid_kind = core.pack_grid(st.T)
    own_plan = st.fused_plan if grid_kind == "dense" else st.lookback
    if own_plan:
        pass  # the first pack computes it
    elif st.plan_launch.ready():
        st.plan_launch.fast((st.plan_programs,), (ids.data_ptr(), *st.plan_args_i))
    else:
        st.plan_launch((st.plan_programs,), (ids, *st.plan_args))
    T = st.T
    if T > 0 or st.targets.signal is not None or own_plan:  # (signal / counts need the launch)
        for variants in st.packs:
            g = variants[grid_kind]
            work = cdiv(T, g.TT)
            if grid_kind == "dense":
                grid = (core.dense_programs(work, g.chunks), g.chunks)
            else:
                grid = (core.programs(work * g.chunks, g.chunks), g.chunks)
            if g.launch.ready():  # addresses only: no views, no per-pointer driver queries
                keep = [payloads[i] for i in g.idx]
                keep = [p if p.is_contiguous() else p.contiguous() for p in keep]
                ptrs = [p.data_ptr() for p in keep]
                ptrs = ptrs + [ptrs[0]] * (4 - len(ptrs))
                g.launch.fast(grid, (st.slot_i, *ptrs, *g.tail_i, ids.data_ptr(), *g.tail_b_i))
                continue
            srcs = []
            for i in g.idx:
                p = payloads[i]
                if not p.is_contiguous():
                    p = p.contiguous()
                srcs.append(p if p.dtype == g.unit else p.view(torch.uint8).view(g.unit))
            srcs = srcs + [srcs[0]] * (4 - len(srcs))
            g.launch(grid, (st.slot, *srcs, *g.dsts, T, *g.consts, ids, *g.consts_b))


def receive(core: AlltoAllCore, st: DispatchState) -> None:
    """After the exchange: (wait for the peers,) sanitize the ids, copy the counts."""
    if st.fused_sanitize:  # the pack's last programs to arrive did it
        return
    if st.sanitize is None:
        core.recv_counts.copy_(st.counts)
    else:
        launch, work, args, args_i = st.sanitize
        grid = (core.programs(work) if core.num_sms is not None else core.dense_programs(work),)
        if launch.ready():
            launch.fast(grid, args_i)
        else:
            launch(grid, args)


def dispatch_torch_ops(core: AlltoAllCore, st: DispatchState, ids, payloads, invalid, idx) -> None:
    """The torch-ops path (CPU/gloo): plan, pack by index_copy, exchange, sanitize."""
    plan = make_plan(ids, core.num_experts, core.ep)
    st.slot, st.send_counts = plan.slot, plan.send_counts
    payloads = [p.contiguous() for p in payloads]
    core.transport.dispatch_torch(plan, payloads, st.layout, st.rt, st.targets)
    if idx is None:
        core.recv_counts.copy_(st.counts)
        return
    rt, K = st.rt, core.top_k
    v = st.views[idx]
    n = core.ep * (rt + 1) - 1
    flat = torch.as_strided(v, (n, K), v.stride()[1:])
    lo, hi = core.local_expert_offset, core.local_expert_offset + core.num_local_experts
    core.recv_counts.copy_(st.counts)
    i = torch.arange(n, device=core.device, dtype=torch.int64)
    pad = (i % (rt + 1)) >= core.recv_counts[i // (rt + 1)]
    drop = pad[:, None] | (flat < lo) | (flat >= hi)
    flat.copy_(torch.where(drop, torch.full_like(flat, invalid), flat))

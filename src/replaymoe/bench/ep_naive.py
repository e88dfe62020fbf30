"""The naive expert-parallel reference of ``replaymoe bench ep``: the usual first NCCL recipe
(exchange the counts, host sync, variable-size ``all_to_all_single``, ``index_add``) as
:class:`NaiveEP`, the whole layer built on it (:func:`naive_layer`), and its eager timing
(:func:`time_naive`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .ep_shape import Shape
from .ep_timing import time_phases


class NaiveEP:
    """Counts exchange + host sync + variable-size ``all_to_all_single`` (the common first recipe), for
    the layer ``shape``."""

    def __init__(self, ep: int, rank: int, shape: Shape):
        self.ep, self.rank, self.shape = ep, rank, shape

    def dispatch(self, ids: torch.Tensor, payloads: list[torch.Tensor]):
        from ..ep import expert_owner

        T = ids.shape[0]
        owner = expert_owner(ids, self.shape.E, self.ep)
        mask = torch.zeros(T, self.ep + 1, dtype=torch.bool, device=ids.device)
        mask.scatter_(1, owner, True)
        mask = mask[:, : self.ep]
        dest_tok = [torch.nonzero(mask[:, r]).flatten() for r in range(self.ep)]  # host syncs
        order = torch.cat(dest_tok)
        send_counts = torch.tensor([len(d) for d in dest_tok], dtype=torch.int64, device=ids.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        rc = recv_counts.tolist()  # host sync
        sc = send_counts.tolist()
        rows = torch.cat([p.reshape(T, -1).view(torch.uint8) for p in payloads], dim=1)
        send = rows[order]
        recv = torch.empty(sum(rc), rows.shape[1], dtype=torch.uint8, device=ids.device)
        dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)
        self.state = (order, sc, rc, T)
        return recv

    def combine(self, back: torch.Tensor) -> torch.Tensor:
        order, sc, rc, T = self.state
        ret = torch.empty(sum(sc), back.shape[1], dtype=back.dtype, device=back.device)
        dist.all_to_all_single(ret, back.contiguous(), output_split_sizes=sc, input_split_sizes=rc)
        out = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
        out.index_add_(0, order, ret.float())
        return out.to(back.dtype)


def naive_layer(naive, x, logits, w13, w2, lo, n, route_kw):
    """route -> naive dispatch -> fused_moe on the local experts -> naive combine (``naive.shape``)."""
    from ..moe import fused_moe
    from ..routing import route

    H, E, K = naive.shape.H, naive.shape.E, naive.shape.K
    r = route(logits, K, **route_kw)
    recv = naive.dispatch(r.topk_ids, [x, r.topk_ids, r.topk_weights])
    hb = H * 2
    hid = recv[:, :hb].view(torch.bfloat16)
    ids = recv[:, hb : hb + 4 * K].contiguous().view(torch.int32)
    wts = recv[:, hb + 4 * K : hb + 8 * K].contiguous().view(torch.float32)
    ids = torch.where((ids >= lo) & (ids < lo + n), ids, torch.full_like(ids, -1))
    y = fused_moe(
        hid, w13, w2, topk_ids=ids, topk_weights=wts, local_expert_offset=lo, num_experts=E, check_ids=False
    )
    return naive.combine(y)


def time_naive(naive, ids, pays, iters, warmup, *, align: bool):
    """((dispatch µs, combine µs), (host µs per call)): eager, median over iterations of the max
    over ranks (``align``: :func:`~replaymoe.bench.ep_timing.time_phases`)."""
    H = naive.shape.H
    back = {}

    def it(ev):
        t0 = time.perf_counter()
        ev[0].record()
        recv = naive.dispatch(ids, pays)
        if "y" not in back or back["y"].shape[0] != recv.shape[0]:
            back["y"] = torch.randn(recv.shape[0], H, device=recv.device, dtype=torch.bfloat16)
        ev[1].record()
        t1 = time.perf_counter()
        naive.combine(back["y"])
        ev[2].record()
        return (t1 - t0, time.perf_counter() - t1)

    dev, host = time_phases(it, 2, iters, warmup, align=align)
    return (tuple(dev), tuple(host))

"""The ``nccl`` transport: fixed-size padded ``all_to_all_single`` on byte buffers.

Dispatch send/receive buffers are uint8 ``[ep, runtime_max + 1, row_bytes]`` (block ``r`` of the send
buffer goes to rank ``r``; rows ``j < runtime_max`` hold the tokens, the last row of a block is a
header holding the row count in the row's reserved last 64 bytes). Every byte of every block is
exchanged (padding included), which costs bandwidth but needs no host synchronization: the whole
exchange is CUDA-graph capturable and works across nodes. With a gloo group the same code runs on
CPU tensors (CPU tests).

Combine sends the ``[ep, runtime_max + 1, H]`` blocks (``ep_moe``'s output layout, sent as it is;
any other payload is staged into it) and receives the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._errors import collective_error, guard_growth
from .packing import Targets, pack_rows, typed_view

if TYPE_CHECKING:
    from ._core import AlltoAllCore


class NcclTransport:
    """Buffers and exchange of :class:`~replaymoe.ep.MoeAlltoAll` over ``all_to_all_single``, on the
    all-to-all's shared state ``core`` (:class:`~replaymoe.ep._core.AlltoAllCore`)."""

    def __init__(self, core: AlltoAllCore) -> None:
        self.core = core
        self.pg = core.group
        if core.timeout is not None and core.ep > 1:
            ranks = dist.get_process_group_ranks(core.group)
            self.pg = dist.new_group(
                ranks,
                timeout=core.timeout,
                backend=str(dist.get_backend(core.group)),
                use_local_synchronization=True,
            )
        self.row_cap = 0
        self.send: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self.csend: torch.Tensor | None = None
        self.crecv: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------
    def ensure_dispatch(self, row_bytes: int) -> None:
        if row_bytes <= self.row_cap:
            return
        core = self.core
        guard_growth(core, "dispatch")
        n = core.ep * (core.max_num_tokens + 1) * row_bytes + row_bytes  # + one trash row (torch packing)
        self.recv = torch.empty(n, dtype=torch.uint8, device=core.device)
        self.send = self.recv if core.ep == 1 else torch.empty(n, dtype=torch.uint8, device=core.device)
        self.row_cap = row_bytes
        core.dispatch_plans.clear()  # cached views alias the old buffers

    def drop_combine_plans(self) -> None:
        """Nothing to forget: this transport keeps no combine launch plans (the symm one does)."""

    def _exchange(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        try:
            dist.all_to_all_single(out, inp, group=self.pg)
        except Exception as e:  # re-raised with the rank named
            raise collective_error(self.core, op, e) from e

    # ------------------------------------------------------------------------------------------
    def dispatch_targets(self, layout, rt: int) -> Targets:
        core = self.core
        send, recv = self.send, self.recv
        assert send is not None and recv is not None
        block = (rt + 1) * layout.row_bytes
        return Targets(
            recv=recv, block=block, dsts=[send] * core.ep, stride_dst_rank=block, dst_base=0,
            send=send[: core.ep * block], recv_out=recv[: core.ep * block],
        )  # fmt: skip

    def exchange_dispatch(self, tg: Targets) -> None:
        if self.core.ep > 1:
            self._exchange("dispatch", tg.recv_out, tg.send)

    def dispatch_torch(self, plan, payloads, layout, rt: int, tg: Targets) -> None:
        """Pack with torch ops (CPU/gloo path), write the counts, exchange."""
        core = self.core
        RB = layout.row_bytes
        pack_rows(core.ep, plan, payloads, layout, tg.dsts[0], block_bytes=tg.block)
        at = rt * RB + layout.count_offset
        cnt = typed_view(tg.dsts[0], torch.int32, (core.ep,), (tg.block // 4,), at)
        cnt.copy_(plan.send_counts)
        self.exchange_dispatch(tg)

    def combine(self, payload: torch.Tensor, rt: int) -> tuple[torch.Tensor, int, None, None]:
        """Exchange ``[ep, rt + 1, W]`` blocks (the extra row keeps ``ep_moe``'s output copy-free;
        ``W`` is the payload's row width, ``hidden_size`` unless ``combine(width=...)``)."""
        core = self.core
        H = payload.shape[2]
        es = payload.element_size()
        block = (rt + 1) * H
        if core.ep == 1 and payload.stride(1) == H:
            return payload[0], payload.stride(0), None, None
        if _spans_blocks(payload, block):
            send = torch.as_strided(payload, (core.ep * block,), (1,))
        else:
            cap = core.ep * (core.max_num_tokens + 1) * H * es
            if self.csend is None or self.csend.numel() < core.ep * block * es:
                guard_growth(core, "combine")
                self.csend = torch.empty(cap, dtype=torch.uint8, device=core.device)
            send = self.csend[: core.ep * block * es].view(payload.dtype)
            send.view(core.ep, rt + 1, H)[:, :rt].copy_(payload)
        if core.ep == 1:
            return send.view(rt + 1, H), block, None, None
        if self.crecv is None or self.crecv.numel() < core.ep * block * es:
            guard_growth(core, "combine")
            self.crecv = torch.empty(
                core.ep * (core.max_num_tokens + 1) * H * es, dtype=torch.uint8, device=core.device
            )
        out = self.crecv[: core.ep * block * es]
        self._exchange("combine", out, send.view(torch.uint8))
        return out.view(payload.dtype).view(core.ep * (rt + 1), H), block, None, None


def _spans_blocks(payload: torch.Tensor, block: int) -> bool:
    """True when ``payload`` [ep, rt, H] is laid out as rows of ``ep`` contiguous ``block``-element
    blocks (row stride H, block stride ``block``) inside its storage."""
    ep, _, H = payload.shape
    if payload.stride() != (block, H, 1):
        return False
    end = (payload.storage_offset() + ep * block) * payload.element_size()
    return end <= payload.untyped_storage().nbytes()

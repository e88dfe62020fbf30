"""The state that :class:`~replaymoe.ep.MoeAlltoAll` and its collaborators share: :class:`AlltoAllCore`.

One object per all-to-all (``MoeAlltoAll.core``), handed to every part that does the work: the dispatch's
launch plan and launches (:mod:`~replaymoe.ep._dispatch_plan`, :mod:`~replaymoe.ep._dispatch`), the
combine's steps (:mod:`~replaymoe.ep._combine`), the receive side (:mod:`~replaymoe.ep.receive`), the
errors (:mod:`~replaymoe.ep._errors`) and the transports (:mod:`~replaymoe.ep.transport_nccl`,
:mod:`~replaymoe.ep.transport_symm`), which read and update it through its public attributes and methods
only. The front door (argument checks, the phases' order, the public attributes users read) stays in
:class:`~replaymoe.ep.MoeAlltoAll`. Tests build an :class:`AlltoAllCore` alone (no process group) to
drive the parts one rank and one phase at a time; benchmarks read a ``MoeAlltoAll``'s (its plan cache,
transport and pack grid are what some of them time).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _switches
from .._backend import resolve_backend
from ._dispatch_plan import DispatchState, pack_grid
from .partition import PLAN_SCRATCH, expert_partition

CPU_PROGRAMS = 4  # the "SMs" of a CPU device (interpreter): a few programs, so the persistent loops iterate


@dataclass(eq=False)
class AlltoAllCore:
    """The shared state of one all-to-all: its group and sizes, switches, buffers, caches, transport and
    phase, with the grid-size helpers every launch uses.

    Built by :class:`~replaymoe.ep.MoeAlltoAll` from its validated arguments (it checks nothing itself).
    The fields down to ``fused_sanitize`` are fixed for the object's life, except ``num_sms`` (the
    ``MoeAlltoAll.num_sms`` setter; tests also switch ``pipelined_combine`` between calls); the others
    change as calls run. Not frozen: the phase, the caches and ``num_sms`` change, and the transport,
    built from the core, is attached after it.

    Parameters
    ----------
    group : ProcessGroup or None
        The expert-parallel group (``None`` only where no transport sets up a group of its own: tests).
    ep, rank : int
        Ranks in the group and this rank's index.
    device : torch.device
        Device of every buffer.
    max_num_tokens, top_k, num_experts, hidden_size : int
        As given to :class:`~replaymoe.ep.MoeAlltoAll`.
    transport_name : {"nccl", "symm"}
        The ``transport`` argument (``"symm"`` always packs with Triton, see :meth:`use_triton`).
    kernel_backend : {"auto", "triton", "torch"}
        The packing/reduction backend argument.
    timeout : datetime.timedelta or None
        Bound on waiting for peers (``None``: the group's own, or the symm default).
    device_sms : int, optional
        SMs of ``device``; default: the CUDA device's count, :data:`CPU_PROGRAMS` on a CPU.
    num_sms : int or None
        Most programs per kernel (``None``: every SM); see ``MoeAlltoAll``'s ``num_sms``.
    fused_plan : bool, optional
        The pack kernel computes the dispatch plan itself (``None``: the process default,
        ``replaymoe._switches.DEFAULTS.ep_fused``).
    fused_barrier : bool or None
        The ``fused_barrier`` argument, resolved by the symm transport (``None``: its process default).
    pipelined_combine : bool or None
        The ``pipelined_combine`` argument (``None``: by size, :meth:`SymmTransport.pipelines`).
    fused_sanitize : bool
        The pack's last programs to arrive sanitize the received ids (no sanitize launch) where the
        transport signals; off only in tests that run the ranks one after another.

    Attributes
    ----------
    local_expert_offset, num_local_experts : int
        This rank's expert slice (:func:`~replaymoe.ep.partition.expert_partition`).
    recv_counts : torch.Tensor
        int32 [ep]: rows received from each source by the last dispatch (``MoeAlltoAll.recv_counts``).
    plan_scratch : torch.Tensor
        int32 [PLAN_SCRATCH]: the plan's look-back state (ticket, arrivals, epoch, per-block flags and
        counts), kept across calls.
    transport : NcclTransport or SymmTransport
        Buffers and exchange; attached by the owner right after the core is built.
    dispatch_plans : dict
        Steady-state dispatch launch plans (:class:`~replaymoe.ep._dispatch_plan.DispatchState`) by call
        signature; a transport clears it when its buffers grow (the views alias them).
    combine_signatures : dict
        Combine signatures already validated (keys only; insertion order is the eviction order).
    phase : str
        ``"idle"``, ``"dispatching"``, ``"dispatched"``, ``"combining"`` or ``"broken"``.
    runtime_max : int or None
        ``runtime_max_tokens_per_rank`` of the last dispatch (what ``combine`` must be given).
    in_flight : DispatchState or None
        The launch plan of the dispatch awaiting its combine.
    """

    group: Any = field(repr=False)
    ep: int
    rank: int
    device: torch.device
    max_num_tokens: int
    top_k: int
    num_experts: int
    hidden_size: int
    transport_name: str = "nccl"
    kernel_backend: str = "auto"
    timeout: datetime.timedelta | None = None
    device_sms: int | None = None
    num_sms: int | None = None
    fused_plan: bool | None = None
    fused_barrier: bool | None = None
    pipelined_combine: bool | None = None
    fused_sanitize: bool = True
    local_expert_offset: int = field(init=False)
    num_local_experts: int = field(init=False)
    recv_counts: torch.Tensor = field(init=False)
    plan_scratch: torch.Tensor = field(init=False, repr=False)
    # NcclTransport or SymmTransport: they take the core, so it names neither (no import cycle)
    transport: Any = field(init=False, default=None, repr=False)
    dispatch_plans: dict = field(init=False, default_factory=dict, repr=False)
    combine_signatures: dict = field(init=False, default_factory=dict, repr=False)
    phase: str = field(init=False, default="idle")
    runtime_max: int | None = field(init=False, default=None)
    in_flight: DispatchState | None = field(init=False, default=None, repr=False)
    _use_triton: bool | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device_sms is None:
            if self.device.type == "cuda":
                self.device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            else:
                self.device_sms = CPU_PROGRAMS
        if self.fused_plan is None:
            self.fused_plan = _switches.DEFAULTS.ep_fused
        slices = expert_partition(self.num_experts, self.ep)
        self.local_expert_offset, self.num_local_experts = slices[self.rank]
        self.recv_counts = torch.zeros(self.ep, dtype=torch.int32, device=self.device)
        self.plan_scratch = torch.zeros(PLAN_SCRATCH, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------------------------------
    def use_triton(self) -> bool:
        """Whether packing/reduction run the Triton kernels: always with ``symm``, else as
        ``kernel_backend`` resolves on ``device`` (resolved on the first call, then kept; ``ValueError``
        for ``"triton"`` on a CPU without ``TRITON_INTERPRET=1``)."""
        if self._use_triton is None:
            probe = torch.empty(0, device=self.device)  # resolve_backend reads the device off a tensor
            self._use_triton = (
                self.transport_name == "symm"
                or resolve_backend(self.kernel_backend, probe, name="kernel_backend") == "triton"
            )
        return self._use_triton

    def programs(self, work: int, chunks: int = 1) -> int:
        """Programs along the first grid axis of a persistent kernel with ``work`` independent items in
        all and ``chunks`` programs along the second axis (at least one): ``num_sms`` (else every SM)
        shared among the chunks."""
        n = self.device_sms if self.num_sms is None else self.num_sms
        return max(1, min(n, work) // chunks)

    def dense_programs(self, work: int, chunks: int = 1) -> int:
        """The same for the dense grids (``num_sms`` unset): up to 16 programs per SM, then a grid-stride
        loop."""
        return max(1, min(work, 16 * self.device_sms // chunks))

    def pack_grid(self, T: int) -> str:
        """The pack's grid for ``T`` tokens on this rank (:func:`~replaymoe.ep._dispatch_plan.pack_grid`)."""
        return pack_grid(self.num_sms, self.device_sms, T)

    def combine_pipelines(self, runtime_max_tokens_per_rank: int) -> bool:
        """Whether ``combine`` at this ``runtime_max_tokens_per_rank`` runs as the symm transport's one
        pipelined launch (:meth:`~replaymoe.ep.transport_symm.SymmTransport.pipelines`; never with the
        nccl transport)."""
        pipelines = getattr(self.transport, "pipelines", None)  # the symm transport (ep > 1)
        return bool(pipelines is not None and pipelines(runtime_max_tokens_per_rank))

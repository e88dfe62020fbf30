"""MoE all-to-all: dispatch tokens to the ranks that own their experts, combine the results back.

Semantics (DESIGN.md "Expert parallelism", reference/flashinfer-semantics.md §5), with the choices
made here spelled out:

* **Expert split.** Contiguous: ``base = E // ep``, ``rem = E % ep``; rank ``r < rem`` owns
  ``base + 1`` experts starting at ``r * (base + 1)``, the others own ``base`` (any ``ep >= 1``,
  ``E >= ep``). See :func:`expert_partition` and :func:`expert_owner`.
* **Dispatch.** Token ``t`` goes once to every distinct rank owning one of its experts (its own rank
  included). Ids outside ``[0, E)`` (e.g. ``-1``) send the token nowhere. On the receiving rank the
  rows from source ``s`` are ``recv[s, 0:recv_counts[s]]`` **in the source's token order**
  (deterministic, unlike FlashInfer's atomics); rows ``>= recv_counts[s]`` are padding holding
  stale data.
* **Expert ids.** With ``expert_id_payload_index`` the received id payload is *sanitized*: padding
  rows are set to ``invalid_token_expert_id`` entirely, and in real rows every id of an expert this
  rank does not own is set to ``invalid_token_expert_id`` too (FlashInfer keeps those global ids;
  we drop them so that a local expert kernel, or any user code, cannot count a remote expert twice).
  Local ids stay global (``fused_moe(..., local_expert_offset=a2a.local_expert_offset)`` takes them
  as they are).
* **Combine.** ``payload[s, j]`` (``j < recv_counts[s]``) must hold this rank's result for the token
  that arrived from ``s`` at slot ``j`` (already weighted over this rank's experts). It goes back to
  ``s``, which sums, per token, the rows of every rank it was sent to in fp32 (in rank order, so the
  result is deterministic and identical for both transports) and returns the payload dtype.
* **Lockstep.** ``idle -> dispatch -> dispatched -> combine -> idle``; calling a phase twice raises
  ``RuntimeError``. Every rank must call ``dispatch``/``combine`` the same number of times with the
  same ``runtime_max_tokens_per_rank`` and payload layout (dtypes and per-token shapes); a rank with
  zero tokens still calls. Argument errors raise ``ValueError`` on the calling rank *before* any
  communication, so that rank will not enter the collective and its peers will wait for it until
  the group's timeout (gloo/NCCL) or the barrier timeout (symm) fires — all ranks must pass valid
  arguments.

Transports (identical results):

* ``"nccl"``: fixed-size padded ``all_to_all_single`` of byte buffers ``[ep, runtime_max + 1, row]``
  (rows ``0..runtime_max-1`` carry tokens, the last row of each block carries the count). No host
  synchronization; CUDA-graph capturable; works across nodes; with a gloo group it runs on CPU
  (used by the CPU tests).
* ``"symm"``: intra-node; receive buffers in ``torch.distributed._symmetric_memory``; one Triton
  kernel stores each token straight into every destination rank's receive buffer (only real rows
  cross NVLink), then a barrier (release/acquire over signal pads, inside the kernels).

Steady state: a call whose signature (token count, runtime_max, payload dtypes/shapes/alignment)
was seen before skips validation and planning and launches the cached kernels directly (see
:class:`MoeAlltoAll` Notes); ``num_sms`` bounds the programs (SMs) of every kernel.

Received views alias internal buffers: they are valid until ``combine`` (the next ``dispatch`` on
any rank may overwrite them). Consume them (or copy them) before calling ``combine``.

Size: the :class:`MoeAlltoAll` class is one unit (validation, steady-state plan cache, dispatch and
combine phases); the expert split, row layout and packing, receive-side kernels, transports and the
reference live in their own modules of this package.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._backend import BACKENDS, resolve_backend
from .._launch import cdiv, next_power_of_2
from .._validation import check_choice, check_int, check_tensor, fail, is_capturing
from .packing import (
    _PACK_CHUNK,
    _align,
    _gcd_all,
    _RowLayout,
    _unit_dtype,
    recv_views,
    row_layout,
)
from .partition import PLAN_BLOCKS, PLAN_SCRATCH, expert_owner, expert_partition, make_plan, plan_grid
from .receive import combine_reduce
from .reference import combine_torch, dispatch_torch

__all__ = [
    "MoeAlltoAll",
    "expert_partition",
    "expert_owner",
    "dispatch_torch",
    "combine_torch",
]

_COMBINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRANSPORTS = ("nccl", "symm")

_CACHE_SIZE = 64  # steady-state plans kept per MoeAlltoAll (oldest dropped first)

# ep_pack_kernel's grids, chosen per call (MoeAlltoAll._pack_grid):
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
_PACK_PEERS_FIRST = True


def _pack_tiles(Ns: list[int], grid: str, T: int) -> tuple[list[int], int, int, int]:
    """``(NBs, chunks, TT, warps)`` of ``ep_pack_kernel`` on ``grid`` (``"dense"``, ``"narrow"`` or
    ``"wide"``, see above) for ``T`` tokens whose payload rows have ``Ns`` units: the column chunk of
    each payload (a power of two), chunks per row, tokens per iteration and ``num_warps``."""
    NBs = [min(next_power_of_2(n), _PACK_CHUNK) for n in Ns]
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
# the process default of MoeAlltoAll(fused_plan=None); REPLAYMOE_EP_FUSED_PLAN=0 turns it off
FUSED_PLAN = os.environ.get("REPLAYMOE_EP_FUSED_PLAN", "1") != "0"


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
class _DState:
    """Everything a dispatch with one signature needs, built once (see ``MoeAlltoAll`` Notes)."""

    T: int
    rt: int
    layout: _RowLayout
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


# ----------------------------------------------------------------------------------------------
# MoeAlltoAll
# ----------------------------------------------------------------------------------------------


class MoeAlltoAll:
    """Expert-parallel token dispatch and combine over a ``torch.distributed`` process group.

    Parameters
    ----------
    group : ProcessGroup or None
        The expert-parallel group (``None``: the default group). ``ep = group.size()``; this rank's
        index in it is ``rank``.
    max_num_tokens : int
        Upper bound of ``runtime_max_tokens_per_rank`` (and so of any rank's token count); buffers
        are sized by it.
    top_k : int
        Experts per token (``token_selected_experts.shape[1]``).
    num_experts : int
        Global number of experts ``E >= ep``, split contiguously (see :func:`expert_partition`).
    hidden_size : int
        Width ``H`` of the combine payload.
    transport : {"nccl", "symm"}
        ``"nccl"``: padded ``all_to_all_single`` (NCCL on CUDA, gloo on CPU). ``"symm"``: one-sided
        NVLink writes into symmetric-memory buffers (CUDA, one node, ep <= 8; with ep = 1 nothing
        crosses and the local path is used). A failure to set up symmetric memory raises
        ``RuntimeError``; there is no silent fallback.
    payload_bytes_per_token : int, optional
        Pre-size the dispatch buffers for rows of this many bytes (sum over payloads, each region
        rounded up to 64, plus 64). Default: sized lazily by the first dispatch and grown when a later one
        needs more (growth is refused during CUDA-graph capture; with ``symm`` it is collective).
    timeout : float (seconds) or datetime.timedelta, optional
        Bound on waiting for peers. ``nccl``/gloo: a private sub-group with this timeout is created
        (collectively, by every member at the same point) for the exchange. With gloo a peer that
        never arrives raises ``RuntimeError`` naming this rank; with NCCL the collective is
        asynchronous, so the NCCL watchdog reports the timeout (naming the rank and the collective)
        and tears the process down. ``symm``: the barrier's timeout (the device traps after printing
        a message naming both ranks). Default: the group's own timeout (NCCL/gloo), 10 minutes (symm).
    device : torch.device, optional
        Device of the buffers. Default: the current CUDA device for NCCL groups, CPU otherwise.
    kernel_backend : {"auto", "triton", "torch"}
        Packing/reduction implementation: ``auto`` = Triton on CUDA, torch ops on CPU; ``triton`` on
        CPU needs ``TRITON_INTERPRET=1``. ``symm`` always uses Triton.
    num_sms : int, optional
        Most programs (thread blocks, so SMs) any Triton kernel of dispatch/combine launches: the
        copies are persistent loops over tokens, so this bounds the SMs the all-to-all occupies
        (DeepEP's ``Buffer.num_sms``). Default: every SM of the device, with grids chosen by size (the
        dispatch's copy: one short program per token up to 256 tokens, one persistent program per SM
        above). May be changed between calls (attribute ``num_sms``), on every rank alike (with
        ``symm`` it decides the combine's form, see ``pipelined_combine``); a captured CUDA graph keeps
        the value it was captured with.
    fused_plan : bool, optional
        Triton packing (``symm``, or ``kernel_backend`` resolving to Triton): where the first payload
        group moves in 4-byte units, the pack kernel computes the dispatch plan itself (one launch
        less: on the dense grid, ``num_sms`` unset and up to 256 tokens, by a scan in every tile,
        otherwise by a look-back over 128-token blocks before its copy); ``False``: the plan kernel
        runs first. The same results either way.
        Default (``None``): :data:`replaymoe.ep.alltoall.FUSED_PLAN`, on unless the environment
        variable ``REPLAYMOE_EP_FUSED_PLAN=0`` was set at import. Fixed for the object's life
        (attribute ``fused_plan``).
    fused_barrier : bool, optional
        ``symm`` (ep > 1; other transports ignore it): the barrier between the phases runs inside
        the kernels (signal pads; no extra launch); ``False``: torch's signal-pad barrier kernel runs
        between them. The same results either way. Default (``None``):
        :data:`replaymoe.ep.transport_symm.FUSED_BARRIER`, on unless
        ``REPLAYMOE_EP_FUSED_BARRIER=0`` was set at import. Must be the same on every rank; fixed for
        the object's life (attribute ``fused_barrier``, resolved by the ``symm`` transport).
    pipelined_combine : bool, optional
        ``symm`` with the fused barrier: ``True``: ``combine`` is one launch in which some of its
        programs (``num_sms`` of them, or one per SM when unset, at least 2; a third at ep = 2, half at
        larger ep) send the rows back, chunk by chunk (16 rows, each chunk flagged in its source's
        signal pad), while the others sum each token's rows as soon as the chunks holding them have
        landed; ``False``: the send kernel, the barrier, then the reduce kernel. The same bits either
        way. Default (``None``): the pipelined launch in eager calls (one launch less of host time), and
        in a CUDA-graph capture where ``runtime_max_tokens_per_rank`` is above 128
        (:data:`replaymoe.ep.transport_symm.PIPE_MIN_TOKENS`; a rank then sends back more than
        :func:`~replaymoe.ep.transport_symm.pipe_min_rows` rows), with the two kernels below, where their
        replays measured faster at ep = 2 and 4. Every rank must then capture a call alike (all in a
        graph or all eager), as a collective in a graph requires anyway. Must be
        the same on every rank; fixed for the object's life (attribute ``pipelined_combine``;
        :meth:`combine_pipelines` says which a call runs).

    Notes
    -----
    Steady state: the first call with a given signature (token count, runtime_max, payload dtypes,
    shapes, alignment) validates the arguments and builds the launch plan (buffer views, kernel
    arguments, per-rank slot tensors); later calls with the same signature skip both, so an eager
    call costs a few kernel launches of host time (the barrier and the all-to-all included).

    Attributes
    ----------
    ep, rank : int
    local_expert_offset, num_local_experts : int
        This rank's expert slice.
    recv_counts : torch.Tensor
        int32 [ep] on ``device``: rows received from each source by the last dispatch.
    send_counts : torch.Tensor or None
        int32 [ep]: rows this rank sent to each rank in the last dispatch.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        hidden_size: int,
        *,
        transport: str = "nccl",
        payload_bytes_per_token: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        device: torch.device | str | None = None,
        kernel_backend: str = "auto",
        num_sms: int | None = None,
        fused_plan: bool | None = None,
        fused_barrier: bool | None = None,
        pipelined_combine: bool | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            fail(
                "group", "an initialized torch.distributed process group", "torch.distributed not initialized"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.ep = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            fail(
                "group",
                "a process group this rank belongs to",
                f"a group without global rank {dist.get_rank()}",
            )
        self.max_num_tokens = check_int("max_num_tokens", max_num_tokens, low=1)
        self.top_k = check_int("top_k", top_k, low=1)
        self.num_experts = check_int("num_experts", num_experts, low=self.ep)
        self.hidden_size = check_int("hidden_size", hidden_size, low=1)
        self.transport = check_choice("transport", transport, _TRANSPORTS)
        self.kernel_backend = check_choice("kernel_backend", kernel_backend, BACKENDS)
        if self.top_k > self.num_experts:
            fail("top_k", f"an int in [1, num_experts={self.num_experts}]", top_k)
        backend_name = str(dist.get_backend(self.group)).lower()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend_name else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                fail("timeout", "a positive number of seconds or a datetime.timedelta", repr(timeout))
            timeout = datetime.timedelta(seconds=float(timeout))
        self.timeout = timeout
        parts = expert_partition(self.num_experts, self.ep)
        self.local_expert_offset, self.num_local_experts = parts[self.rank]
        self.recv_counts = torch.zeros(self.ep, dtype=torch.int32, device=self.device)
        # the plan kernel's look-back state (ticket, arrivals, epoch, per-block flags and counts)
        self._plan_scratch = torch.zeros(PLAN_SCRATCH, dtype=torch.int32, device=self.device)
        self.send_counts: torch.Tensor | None = None
        self._phase = "idle"
        self._runtime_max: int | None = None
        self._num_tokens: int | None = None
        self.num_sms = num_sms  # validated by the property setter
        for name, value in (
            ("fused_plan", fused_plan),
            ("fused_barrier", fused_barrier),
            ("pipelined_combine", pipelined_combine),
        ):
            if value is not None and not isinstance(value, bool):
                fail(name, "a bool or None (the default)", type(value).__name__, what="type")
        self._fused_plan = FUSED_PLAN if fused_plan is None else fused_plan
        self._fused_sanitize = True  # (the CPU tests, which run the ranks in turn, turn it off)
        self._fused_barrier = fused_barrier  # None: the symm transport's process default
        self._pipelined_combine = pipelined_combine  # None: by size (SymmTransport.pipelines)
        if self.device.type == "cuda":
            self._device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self._device_sms = 4  # CPU (interpreter): a few programs, so the persistent loops iterate
        self._dcache: dict = {}  # steady-state dispatch plans, keyed by the call's signature
        self._ccache: dict = {}  # steady-state combine plans
        self._st: _DState | None = None  # the state of the dispatch in flight

        if self.transport == "symm" and self.device.type != "cuda":
            fail("transport", "'nccl' for a CPU device ('symm' needs CUDA symmetric memory)", "'symm'")
        if self.transport == "symm" and self.ep > 1:
            from .transport_symm import SymmTransport

            self._transport = SymmTransport(self)
        else:
            from .transport_nccl import NcclTransport

            self._transport = NcclTransport(self)
        if payload_bytes_per_token is not None:
            check_int("payload_bytes_per_token", payload_bytes_per_token, low=1)
            self._transport.ensure_dispatch(_align(payload_bytes_per_token))

    # ------------------------------------------------------------------------------------------
    @property
    def num_sms(self) -> int | None:
        """Bound on the programs per kernel (see the class docstring); ``None`` = all SMs."""
        return self._num_sms

    @num_sms.setter
    def num_sms(self, value: int | None) -> None:
        if value is not None:
            check_int("num_sms", value, low=1)
        self._num_sms = value

    @property
    def fused_plan(self) -> bool:
        """The pack kernel computes the dispatch plan itself (see the class docstring)."""
        return self._fused_plan

    @property
    def fused_barrier(self) -> bool | None:
        """``symm``: the barrier runs inside the kernels (see the class docstring); other transports:
        the value given (``None`` when none was)."""
        return getattr(self._transport, "fused", self._fused_barrier)

    @property
    def pipelined_combine(self) -> bool | None:
        """The ``pipelined_combine`` argument (``None``: by size; see the class docstring)."""
        return self._pipelined_combine

    def combine_pipelines(self, runtime_max_tokens_per_rank: int) -> bool:
        """Whether ``combine`` at this ``runtime_max_tokens_per_rank`` now runs as one pipelined launch
        (see ``pipelined_combine`` in the class docstring): ``symm`` only, with the fused barrier, at
        least 2 programs (the current ``num_sms``, or the device's SMs), and the argument (``None``: outside
        a CUDA-graph capture, or more than :func:`~replaymoe.ep.transport_symm.pipe_min_rows` rows to send
        back)."""
        p = getattr(self._transport, "pipelines", None)
        return bool(p is not None and p(runtime_max_tokens_per_rank))

    def _programs(self, work: int, chunks: int = 1) -> int:
        """Programs along the first grid axis of a persistent kernel with ``work`` independent items
        in all and ``chunks`` programs along the second axis (at least one)."""
        n = self._device_sms if self._num_sms is None else self._num_sms
        return max(1, min(n, work) // chunks)

    def _pack_grid(self, T: int) -> str:
        """The pack's grid for ``T`` tokens on this rank: ``"dense"``, ``"narrow"`` or ``"wide"`` (see
        :func:`_pack_tiles`). A local choice: the peers never see the pack's grid."""
        if self._num_sms is None:
            return "dense" if T <= _DENSE_PACK_MAX_T else "wide"
        return "wide" if min(self._num_sms, self._device_sms) >= _WIDE_MIN_PROGRAMS else "narrow"

    def _dense_programs(self, work: int, chunks: int = 1) -> int:
        """The same for the dense grids (num_sms unset): up to 16 programs per SM, then a grid-stride loop."""
        return max(1, min(work, 16 * self._device_sms // chunks))

    def use_triton(self) -> bool:
        """Whether packing/reduction run the Triton kernels (see ``kernel_backend``)."""
        cached = self.__dict__.get("_use_triton")  # fixed at construction; asked on every combine
        if cached is None:
            probe = torch.empty(0, device=self.device)  # resolve_backend reads the device off a tensor
            cached = (
                self.transport == "symm"
                or resolve_backend(self.kernel_backend, probe, name="kernel_backend") == "triton"
            )
            self._use_triton = cached
        return cached

    def __repr__(self) -> str:
        return (
            f"MoeAlltoAll(ep={self.ep}, rank={self.rank}, max_num_tokens={self.max_num_tokens}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"transport={self.transport!r}, local_experts=[{self.local_expert_offset}, "
            f"{self.local_expert_offset + self.num_local_experts}))"
        )

    # ------------------------------------------------------------------------------------------
    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        *,
        invalid_token_expert_id: int = -1,
        expert_id_payload_index: int | None = None,
    ) -> list[torch.Tensor]:
        """Send every token to the ranks owning its experts.

        Parameters
        ----------
        token_selected_experts : torch.Tensor
            int32 [T_local, top_k], global expert ids (ids outside ``[0, E)`` are not sent).
        payloads : list of torch.Tensor
            Each [T_local, *] on ``device``, any dtype of element size <= 8 (bf16 hidden, int32 ids,
            fp32 weights, fp8 data, fp32 scales ...). Same dtypes and per-token shapes on every rank.
        runtime_max_tokens_per_rank : int
            The same on every rank; ``T_local <= runtime_max <= max_num_tokens``.
        invalid_token_expert_id : int
            Id written where ``expert_id_payload_index`` is sanitized.
        expert_id_payload_index : int, optional
            Index of an int32 [T_local, top_k] payload holding expert ids: its padding rows, and its
            entries naming experts not owned by this rank, become ``invalid_token_expert_id``.

        Returns
        -------
        list of torch.Tensor
            One view per payload, [ep, runtime_max, *] in the payload's dtype: ``[s, j]`` for
            ``j < recv_counts[s]`` is the j-th token that source ``s`` sent here (in its token order).
            Views alias internal buffers; valid until ``combine``.
        """
        if self._phase != "idle":
            self._phase_error("dispatch")
        ids = token_selected_experts
        rt = runtime_max_tokens_per_rank
        idx = expert_id_payload_index
        try:  # the call's signature: everything validation and the launch plan depend on
            pkey = tuple((p.dtype, p.shape, p.get_device(), p.is_contiguous(), p.data_ptr() & 15)
                         for p in payloads)  # fmt: skip
            ikey = (ids.shape, ids.dtype, ids.get_device(), ids.data_ptr() & 15)
            key = (ikey, rt, invalid_token_expert_id, idx, pkey)
            st = self._dcache.get(key) if isinstance(payloads, (list, tuple)) else None
        except (AttributeError, TypeError):  # not tensors / unhashable: validation says what is wrong
            key, st = None, None
        if st is None:
            st = self._dispatch_setup(ids, payloads, rt, invalid_token_expert_id, idx)
            if key is not None:
                if len(self._dcache) >= _CACHE_SIZE:
                    self._dcache.pop(next(iter(self._dcache)))
                self._dcache[key] = st
        self._phase = "dispatching"
        try:
            if st.triton:
                self._dispatch_triton(st, ids, payloads)
            else:
                self._dispatch_torch(st, ids, payloads, invalid_token_expert_id, idx)
        except BaseException:
            self._phase = "broken"
            raise
        self._st = st
        self.send_counts = st.send_counts
        self._runtime_max = rt
        self._num_tokens = st.T
        self._phase = "dispatched"
        return st.views

    # ------------------------------------------------------------------------------------------
    def _phase_error(self, op: str) -> None:
        if self._phase == "broken":
            raise RuntimeError(
                f"MoeAlltoAll on rank {self.rank}: a previous dispatch/combine failed part-way; the ranks "
                "are no longer in lockstep, build a new MoeAlltoAll (on every rank)"
            )
        if op == "dispatch":
            raise RuntimeError(
                f"MoeAlltoAll.dispatch on rank {self.rank}: called twice without combine "
                "(the phases are dispatch -> combine -> dispatch ...)"
            )
        raise RuntimeError(
            f"MoeAlltoAll.combine on rank {self.rank}: called before dispatch "
            f"(phase is {self._phase!r}; the phases are dispatch -> combine -> dispatch ...)"
        )

    def _validate_dispatch(self, ids, payloads, rt, invalid, idx) -> tuple[int, int]:
        check_tensor("token_selected_experts", ids, ndim=2, dtype=torch.int32, device=self.device)
        T, K = ids.shape
        if K != self.top_k:
            fail("token_selected_experts", f"[T_local, top_k={self.top_k}]", tuple(ids.shape), what="shape")
        check_int("runtime_max_tokens_per_rank", rt, low=1, high=self.max_num_tokens)
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
            check_tensor(f"payloads[{i}]", p, device=self.device)
            if p.dim() < 1 or p.shape[0] != T:
                fail(f"payloads[{i}]", f"[T_local={T}, *]", tuple(p.shape), what="shape")
            if p.element_size() > 8:
                fail(f"payloads[{i}]", "an element size of at most 8 bytes", p.dtype, what="dtype")
        check_int("invalid_token_expert_id", invalid, low=-(2**31), high=2**31 - 1)
        if idx is not None:
            check_int("expert_id_payload_index", idx, low=0, high=len(payloads) - 1)
            check_tensor(f"payloads[{idx}]", payloads[idx], shape=(T, K), dtype=torch.int32)
        return T, K

    def _dispatch_setup(self, ids, payloads, rt, invalid, idx) -> _DState:
        """Validate a call with a new signature and build its launch plan (buffers, views, kernel
        arguments); every later call with the same signature reuses it."""
        T, K = self._validate_dispatch(ids, payloads, rt, invalid, idx)
        layout = row_layout(list(payloads))
        use_triton = self.use_triton()
        self._transport.ensure_dispatch(layout.row_bytes)
        tg = self._transport.dispatch_targets(layout, rt)
        views, counts = recv_views(tg.recv, layout, self.ep, rt, tg.block)
        st = _DState(T=T, rt=rt, layout=layout, triton=use_triton, targets=tg, views=views, counts=counts)
        st.slot = torch.empty(T, self.ep, dtype=torch.int32, device=self.device)
        st.send_counts = torch.empty(self.ep, dtype=torch.int32, device=self.device)
        if not use_triton:
            return st

        from .._launch import Launcher
        from ._kernel import ep_pack_kernel, ep_plan_kernel, ep_sanitize_kernel

        st.plan_launch = Launcher(ep_plan_kernel, num_warps=4)
        # plan kernel (+ the counts into every destination's header row)
        base, rem = divmod(self.num_experts, self.ep)
        ep_p2 = max(2, next_power_of_2(self.ep))
        hdrs = [h.view(torch.int32) for h in tg.dsts]
        hdrs = hdrs + [hdrs[0]] * (8 - len(hdrs))
        hdr_off = tg.dst_base + rt * layout.row_bytes + layout.count_offset
        bt, st.plan_programs = plan_grid(T)
        st.plan_args = (
            st.slot, st.send_counts, *hdrs, tg.stride_dst_rank // 4, hdr_off // 4, T, self.num_experts,
            base, rem, self._plan_scratch, K, self.ep, ep_p2, bt, PLAN_BLOCKS, True,
        )  # fmt: skip
        # the receive side: sanitize the ids (if any) and copy the counts; with the fused barrier, wait for
        # the peers' dispatch signals first. With one pack launch its last programs to arrive do it (one
        # launch less; see _FUSED_SANITIZERS)
        hdr = tg.recv.view(torch.int32)
        blk = 128
        if idx is not None:
            v = views[idx]
            n = self.ep * (rt + 1) - 1
            flat = torch.as_strided(v, (n, K), v.stride()[1:])
        else:
            n, flat = 0, self.recv_counts
        wait = tg.wait if tg.wait is not None else (self.recv_counts, self.recv_counts, 0, 0, False)
        san = (flat, hdr, self.recv_counts, n, flat.stride(0), rt + 1, counts.stride(0),
               counts.storage_offset() - hdr.storage_offset(), self.local_expert_offset,
               self.local_expert_offset + self.num_local_experts, invalid)  # fmt: skip
        k_p2 = max(2, next_power_of_2(K))
        specs = layout.specs
        live = [i for i, sp in enumerate(specs) if sp.nbytes > 0]
        st.fused_sanitize = (
            tg.wait is not None and self._fused_sanitize and 1 <= len(live) <= 4
            and (_FUSED_SANITIZE_MAX_ROWS is None or self.ep * (rt + 1) <= _FUSED_SANITIZE_MAX_ROWS)
        )  # fmt: skip
        if st.fused_sanitize:
            nz = _FUSED_SANITIZERS if self.device.type == "cuda" else 1
            zs = (*san, *wait[1:4], k_p2, _FUSED_SANITIZE_BLOCK, idx is not None, True, wait[4], nz)
        else:
            zs = (st.send_counts,) * 3 + (0,) * 8 + (st.send_counts, 0, 0, 2, 2, False, False, False, 1)
        if not st.fused_sanitize and (idx is not None or tg.wait is not None):
            st.sanitize = (
                Launcher(ep_sanitize_kernel, num_warps=4),
                max(1, cdiv(n, blk)),
                (*san, *wait[:4], K, k_p2, self.ep, ep_p2, blk, self.rank, idx is not None,
                 tg.wait is not None, wait[4]),
            )  # fmt: skip
        # pack kernel: payloads in groups of four, each group in one unit dtype
        for g0 in range(0, len(live), 4):
            grp = live[g0 : g0 + 4]
            ptrs = [payloads[i].data_ptr() for i in grp]
            unit = _unit_dtype(_gcd_all([specs[i].nbytes for i in grp]), *ptrs)
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
            own_plan = g0 == 0 and unit == torch.int32 and self._fused_plan
            st.fused_plan = st.fused_plan or (own_plan and T <= _DENSE_PACK_MAX_T)
            st.lookback = st.lookback or own_plan
            hdr_units = (rt * layout.row_bytes + layout.count_offset) // 4
            plan_b = (st.send_counts, self.num_experts, base, rem, hdr_units)
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
                NBs, chunks, TT, warps = _pack_tiles(Ns, grid, T)
                variants[grid] = _PackGroup(
                    idx=grp, unit=unit, dsts=dsts, chunks=chunks, TT=TT, warps=warps,
                    consts=(tg.stride_dst_rank // u, tg.dst_base // u, *sig),
                    consts_b=(*plan_b, layout.row_bytes // u, *(Ns + [1] * pad), *(NBs + [1] * pad),
                              *(Os + [0] * pad), len(grp), self.ep, ep_p2, TT, self.rank, signal, fplan, K,
                              64, *zs, self._plan_scratch, bt, PLAN_BLOCKS, lookback,
                              self.device.type == "cuda", grid in _PACK_PREFETCH_GRIDS and not fplan,
                              (self.rank + 1) % self.ep if _PACK_PEERS_FIRST else 0),
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

    def _dispatch_triton(self, st: _DState, ids: torch.Tensor, payloads) -> None:
        self._dispatch_send(st, ids, payloads)
        self._transport.exchange_dispatch(st.targets)
        self._dispatch_recv(st)

    def _dispatch_send(self, st: _DState, ids: torch.Tensor, payloads) -> None:
        """Plan + pack (with the fused barrier, the pack's last program signals the peers)."""
        if not ids.is_contiguous():
            ids = ids.contiguous()
        grid_kind = self._pack_grid(st.T)
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
                    grid = (self._dense_programs(work, g.chunks), g.chunks)
                else:
                    grid = (self._programs(work * g.chunks, g.chunks), g.chunks)
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

    def _dispatch_recv(self, st: _DState) -> None:
        """After the exchange: (wait for the peers,) sanitize the ids, copy the counts."""
        if st.fused_sanitize:  # the pack's last programs to arrive did it
            return
        if st.sanitize is None:
            self.recv_counts.copy_(st.counts)
        else:
            launch, work, args, args_i = st.sanitize
            grid = (self._programs(work) if self._num_sms is not None else self._dense_programs(work),)
            if launch.ready():
                launch.fast(grid, args_i)
            else:
                launch(grid, args)

    def _dispatch_torch(self, st: _DState, ids, payloads, invalid, idx) -> None:
        """The torch-ops path (CPU/gloo): plan, pack by index_copy, exchange, sanitize."""
        plan = make_plan(ids, self.num_experts, self.ep)
        st.slot, st.send_counts = plan.slot, plan.send_counts
        payloads = [p.contiguous() for p in payloads]
        self._transport.dispatch_torch(plan, payloads, st.layout, st.rt, st.targets)
        if idx is None:
            self.recv_counts.copy_(st.counts)
            return
        rt, K = st.rt, self.top_k
        v = st.views[idx]
        n = self.ep * (rt + 1) - 1
        flat = torch.as_strided(v, (n, K), v.stride()[1:])
        lo, hi = self.local_expert_offset, self.local_expert_offset + self.num_local_experts
        self.recv_counts.copy_(st.counts)
        i = torch.arange(n, device=self.device, dtype=torch.int64)
        pad = (i % (rt + 1)) >= self.recv_counts[i // (rt + 1)]
        drop = pad[:, None] | (flat < lo) | (flat >= hi)
        flat.copy_(torch.where(drop, torch.full_like(flat, invalid), flat))

    # ------------------------------------------------------------------------------------------
    def combine(
        self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, *, width: int | None = None
    ) -> torch.Tensor:
        """Return each rank's rows to their source and sum them per token.

        Parameters
        ----------
        payload : torch.Tensor
            [ep, runtime_max, W], fp32/bf16/fp16 (``W = hidden_size`` unless ``width`` says
            otherwise): row ``[s, j]`` (``j < recv_counts[s]``) is this rank's (weighted) result for
            the j-th token received from ``s``. Other rows are ignored (they may hold anything, NaN
            included).
        runtime_max_tokens_per_rank : int
            The value given to the matching ``dispatch``.
        width : int, optional
            Row width ``W`` of the payload when it is not ``hidden_size`` (the same on every rank;
            ``ep_moe``'s backward combines ``[H + K]``-wide fp32 rows: the hidden-state gradient and
            the top-k weight gradient side by side). Buffers grow to the widest row seen (refused
            during CUDA-graph capture, collective with ``symm``, like every growth).

        Returns
        -------
        torch.Tensor
            [T_local, W] in the payload's dtype: per token, the fp32 sum of the rows that came back
            from every rank it was sent to (zeros for a token sent nowhere).
        """
        if self._phase != "dispatched":
            self._phase_error("combine")
        rt = runtime_max_tokens_per_rank
        W = self.hidden_size if width is None else width
        try:
            s = payload.stride()
            key = (payload.shape, payload.dtype, s, payload.get_device(), rt, W)
        except (AttributeError, TypeError):
            key = None
        if key is None or key not in self._ccache or rt != self._runtime_max:
            self._validate_combine(payload, rt, W)
            s = payload.stride()
            if key is not None:
                if len(self._ccache) >= _CACHE_SIZE:
                    self._ccache.pop(next(iter(self._ccache)))
                self._ccache[key] = True
        if s[2] != 1 or s[0] < rt * s[1] or s[1] < W:
            payload = payload.contiguous()
        st = self._st
        assert st is not None
        self._phase = "combining"
        try:
            tr = self._transport
            out = torch.empty(st.T, W, dtype=payload.dtype, device=self.device)
            pipelines = getattr(tr, "pipelines", None)  # the symm transport (ep > 1)
            if pipelines is not None and pipelines(rt):
                tr.combine_pipelined(payload, rt, st.slot, out)
            else:
                rows, block_stride, own, wait = tr.combine(payload, rt)
                combine_reduce(self, rows, block_stride, st.slot, out, st.reduce, own, wait)
        except BaseException:
            self._phase = "broken"
            raise
        self._phase = "idle"
        self._st = None
        return out

    def _validate_combine(self, payload, rt, W) -> None:
        check_int("runtime_max_tokens_per_rank", rt, low=1, high=self.max_num_tokens)
        check_int("width", W, low=1)
        if rt != self._runtime_max:
            fail(
                "runtime_max_tokens_per_rank",
                f"the value given to dispatch ({self._runtime_max})",
                rt,
            )
        check_tensor(
            "payload",
            payload,
            shape=(self.ep, rt, W),
            dtype=_COMBINE_DTYPES,
            device=self.device,
        )

    # ------------------------------------------------------------------------------------------
    def _guard_growth(self, what: str) -> None:
        if is_capturing():
            raise RuntimeError(
                f"MoeAlltoAll on rank {self.rank}: the {what} buffer must grow during CUDA-graph capture; "
                "run one dispatch/combine with the same payloads before capturing (or pass "
                "payload_bytes_per_token)"
            )

    def _collective_error(self, op: str, err: BaseException) -> RuntimeError:
        return RuntimeError(
            f"MoeAlltoAll.{op}: rank {self.rank} of {self.ep} (global rank "
            f"{dist.get_rank()}) failed in the all-to-all — a peer rank did not arrive within the "
            f"timeout or left the group (all ranks must call {op} in lockstep with valid arguments): {err}"
        )

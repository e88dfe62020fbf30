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

Modules: the class is the front door (arguments, the order of the phases, the public attributes); what
its collaborators share (the transport, buffers, steady-state caches, switches, phase and the grid sizes)
is one :class:`~replaymoe.ep._core.AlltoAllCore` (attribute ``core``), passed to each of them. The launch
plan of a dispatch is built in :mod:`~replaymoe.ep._dispatch_plan` and run by
:mod:`~replaymoe.ep._dispatch`, the combine's steps are in :mod:`~replaymoe.ep._combine`, the phase and
growth errors in :mod:`~replaymoe.ep._errors`; the expert split, row layout and packing, receive-side
kernels, transports and the reference live in their own modules of this package, the Triton code in its
``_kernel_*`` modules.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .._backend import BACKENDS
from .._validation import check_choice, check_int, fail
from ._combine import combine_payload, combine_rows
from ._core import AlltoAllCore
from ._dispatch import dispatch_torch_ops, receive, send
from ._dispatch_plan import build_dispatch, find_dispatch, keep_dispatch, validate_dispatch
from ._errors import phase_error
from .packing import align
from .partition import expert_owner, expert_partition
from .reference import combine_torch, dispatch_torch

__all__ = [
    "MoeAlltoAll",
    "expert_partition",
    "expert_owner",
    "dispatch_torch",
    "combine_torch",
]

_TRANSPORTS = ("nccl", "symm")


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
        Default (``None``): the process default ``replaymoe._switches.DEFAULTS.ep_fused``, on unless
        the environment variable ``REPLAYMOE_EP_FUSED=0`` was set when replaymoe was imported. Fixed
        for the object's life (attribute ``fused_plan``).
    fused_barrier : bool, optional
        ``symm`` (ep > 1; other transports ignore it): the barrier between the phases runs inside
        the kernels (signal pads; no extra launch); ``False``: torch's signal-pad barrier kernel runs
        between them. The same results either way. Default (``None``): the process default
        ``replaymoe._switches.DEFAULTS.ep_fused`` (``REPLAYMOE_EP_FUSED``, as ``fused_plan``). Must be
        the same on every rank; fixed for the object's life (attribute ``fused_barrier``, resolved by
        the ``symm`` transport).
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
    core : AlltoAllCore
        The state the dispatch and combine steps and the transport share (internal; read by the
        benchmarks and tests, see :mod:`~replaymoe.ep._core`).
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
        if group is not None and not isinstance(group, dist.ProcessGroup):
            fail("group", "a torch.distributed ProcessGroup or None (the default group)",
                 type(group).__name__, what="type")  # fmt: skip
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
        if self.device.type not in ("cuda", "cpu"):
            fail("device", "a CUDA device (nccl) or the CPU (gloo)", str(self.device))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                fail("timeout", "a positive number of seconds or a datetime.timedelta", repr(timeout))
            timeout = datetime.timedelta(seconds=float(timeout))
        if timeout is not None and timeout <= datetime.timedelta(0):
            fail("timeout", "a positive number of seconds or a positive datetime.timedelta", repr(timeout))
        self.timeout = timeout
        if num_sms is not None:
            check_int("num_sms", num_sms, low=1)
        for name, value in (
            ("fused_plan", fused_plan),
            ("fused_barrier", fused_barrier),
            ("pipelined_combine", pipelined_combine),
        ):
            if value is not None and not isinstance(value, bool):
                fail(name, "a bool or None (the default)", type(value).__name__, what="type")
        # what the collaborators share (buffers, caches, transport, phase): one object, passed to each
        self.core = AlltoAllCore(
            group=self.group, ep=self.ep, rank=self.rank, device=self.device,
            max_num_tokens=self.max_num_tokens, top_k=self.top_k, num_experts=self.num_experts,
            hidden_size=self.hidden_size, transport_name=self.transport, kernel_backend=self.kernel_backend,
            timeout=timeout, num_sms=num_sms, fused_plan=fused_plan, fused_barrier=fused_barrier,
            pipelined_combine=pipelined_combine,
        )  # fmt: skip
        self.local_expert_offset = self.core.local_expert_offset
        self.num_local_experts = self.core.num_local_experts
        self.recv_counts = self.core.recv_counts
        self.send_counts: torch.Tensor | None = None

        if self.transport == "symm" and self.device.type != "cuda":
            fail("transport", "'nccl' for a CPU device ('symm' needs CUDA symmetric memory)", "'symm'")
        if self.transport == "symm" and self.ep > 1:
            from .transport_symm import SymmTransport

            self.core.transport = SymmTransport(self.core)
        else:
            from .transport_nccl import NcclTransport

            self.core.transport = NcclTransport(self.core)
        if payload_bytes_per_token is not None:
            check_int("payload_bytes_per_token", payload_bytes_per_token, low=1)
            self.core.transport.ensure_dispatch(align(payload_bytes_per_token))

    # ------------------------------------------------------------------------------------------
    @property
    def num_sms(self) -> int | None:
        """Bound on the programs per kernel (see the class docstring); ``None`` = all SMs."""
        return self.core.num_sms

    @num_sms.setter
    def num_sms(self, value: int | None) -> None:
        if value is not None:
            check_int("num_sms", value, low=1)
        self.core.num_sms = value

    @property
    def fused_plan(self) -> bool:
        """The pack kernel computes the dispatch plan itself (see the class docstring)."""
        return bool(self.core.fused_plan)

    @property
    def fused_barrier(self) -> bool | None:
        """``symm``: the barrier runs inside the kernels (see the class docstring); other transports:
        the value given (``None`` when none was)."""
        return getattr(self.core.transport, "fused", self.core.fused_barrier)

    @property
    def pipelined_combine(self) -> bool | None:
        """The ``pipelined_combine`` argument (``None``: by size; see the class docstring)."""
        return self.core.pipelined_combine

    def combine_pipelines(self, runtime_max_tokens_per_rank: int) -> bool:
        """Whether ``combine`` at this ``runtime_max_tokens_per_rank`` now runs as one pipelined launch
        (see ``pipelined_combine`` in the class docstring): ``symm`` only, with the fused barrier, at
        least 2 programs (the current ``num_sms``, or the device's SMs), and the argument (``None``: outside
        a CUDA-graph capture, or more than :func:`~replaymoe.ep.transport_symm.pipe_min_rows` rows to send
        back)."""
        return self.core.combine_pipelines(runtime_max_tokens_per_rank)

    def use_triton(self) -> bool:
        """Whether packing/reduction run the Triton kernels (see ``kernel_backend``)."""
        return self.core.use_triton()

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
        core = self.core
        if core.phase != "idle":
            phase_error(core, "dispatch")
        ids = token_selected_experts
        rt = runtime_max_tokens_per_rank
        invalid, idx = invalid_token_expert_id, expert_id_payload_index
        key, st = find_dispatch(core.dispatch_plans, ids, payloads, rt, invalid, idx)
        if st is None:  # a new signature: validated, and its launch plan built, once
            T, K = validate_dispatch(core, ids, payloads, rt, invalid, idx)
            st = build_dispatch(core, T, K, payloads, rt, invalid, idx)
            if key is not None:
                keep_dispatch(core.dispatch_plans, key, st)
        core.phase = "dispatching"
        try:
            if st.triton:
                send(core, st, ids, payloads)
                core.transport.exchange_dispatch(st.targets)
                receive(core, st)
            else:
                dispatch_torch_ops(core, st, ids, payloads, invalid, idx)
        except BaseException:
            core.phase = "broken"
            raise
        core.in_flight = st
        self.send_counts = st.send_counts
        core.runtime_max = rt
        core.phase = "dispatched"
        return st.views

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
        core = self.core
        if core.phase != "dispatched":
            phase_error(core, "combine")
        payload, W = combine_payload(core, payload, runtime_max_tokens_per_rank, width)
        st = core.in_flight
        assert st is not None
        core.phase = "combining"
        try:
            out = combine_rows(core, st, payload, runtime_max_tokens_per_rank, W)
        except BaseException:
            core.phase = "broken"
            raise
        core.phase = "idle"
        core.in_flight = None
        return out

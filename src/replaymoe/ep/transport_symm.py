"""The ``symm`` transport: one-sided NVLink writes into peers' symmetric-memory buffers.

Every rank allocates its receive buffers with ``torch.distributed._symmetric_memory`` (``empty`` +
``rendezvous``) and maps its peers' buffers (``handle.get_buffer(peer, ...)``). Then:

* dispatch: the plan (slots and per-rank counts; computed by the pack kernel itself up to 256
  tokens, else by one small kernel) stores this rank's send counts into every peer's header rows,
  and one Triton kernel for up to four payloads stores each token row straight into each destination
  rank's receive buffer (``[source block = this rank, slot]``), all destinations from the same
  program, so every peer is written concurrently with 128-bit stores and only real rows cross
  NVLink. Then the barrier, and the receive side (sanitize the ids, copy the counts).
* combine: one Triton kernel sends row ``[s, j]`` (``j < recv_counts[s]``, ``s`` another rank) to
  source ``s``'s combine buffer ``[this rank, j]``, its work items (row tiles of one source) interleaved
  over the sources so that every peer is written at once; barrier; the fp32 per-token sum reads the local
  buffer, and this rank's own rows in place in the payload (they never move). With the fused barrier and
  ``num_sms`` >= 2 both halves can be one launch (:meth:`SymmTransport.combine_pipelined`): senders
  flag each chunk of 16 rows (32 on narrow grids from 1024 tokens/rank, :func:`pipe_chunk`) in its
  source's pad, and reducers sum a block of tokens once the chunks it reads have landed. By default
  that launch runs only where a rank sends back more than :func:`pipe_min_rows` rows (the two
  kernels are faster below).

The barrier runs inside the kernels (``MoeAlltoAll(..., fused_barrier=True)``; the default, unless
``REPLAYMOE_EP_FUSED=0`` set the process default, ``replaymoe._switches.DEFAULTS.ep_fused``, off): the
producing kernel's last program to finish (an acq_rel arrival counter, after a CTA barrier) bumps a
device-side epoch and stores it into every peer's signal pad (release, system scope); every program
of the consuming kernel first waits until each peer's flag in its own pad reaches its epoch
(acquire, system scope; after ``timeout`` it prints the two ranks and traps). No barrier kernel is
launched, and the epochs live in device memory, so CUDA-graph replays and eager calls stay in step.
With ``fused_barrier=False`` torch's signal-pad barrier kernel runs between the phases.

Buffer reuse is ordered by those two barriers per round (a peer writes into our dispatch buffer only
after our previous combine barrier, i.e. after we consumed the received views; it writes into our
combine buffer only after our dispatch barrier, i.e. after our previous reduction). So received views
must be consumed before ``combine``.

Intra-node only, ``ep <= 8``. NVLink multicast stays off: creating a :class:`SymmTransport` sets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` where the
process left them unset (:func:`replaymoe._switches.multicast_off`), before its first symmetric-memory
allocation, and the kernels never use multimem. NCCL reads its variable when a communicator is created,
so a process group made before (with NVLS) keeps it: set the three before ``init_process_group``. Any
failure to set up symmetric memory raises ``RuntimeError``; there is no silent fallback to NCCL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import _switches
from .._launch import cdiv, next_power_of_2
from .._validation import fail, is_capturing
from ._errors import guard_growth
from .packing import Targets, row_tiling

if TYPE_CHECKING:
    from ._core import AlltoAllCore

_MAX_EP = 8
_DEFAULT_TIMEOUT_MS = 600_000
# the pipelined combine: rows per arrival flag, and where the flags start in a signal pad (int32 units).
# 16-row chunks: with 64, each sender's chunks landed in a few waves, and the reducers summed the last
# wave's tokens after the send had ended (docs/DESIGN.md, "The pipelined combine")
PIPE_CHUNK = 16
# narrow grids (below 64 programs) from this many tokens/rank flag every PIPE_CHUNK_NARROW rows instead
# (:func:`pipe_chunk`); the pads are sized for PIPE_CHUNK flags per source, so fewer always fit
PIPE_CHUNK_NARROW = 32
PIPE_CHUNK_NARROW_MIN_TOKENS = 1024
FLAG_BASE = 64
PIPE_MAX_GROUP = 8  # most token tiles per reducer step (its waits cover them all)
# pipelined_combine=None (the default): one pipelined launch only where runtime_max (tokens per rank) is
# above PIPE_MIN_TOKENS, i.e. a rank sends back more than pipe_min_rows(ep) = (ep - 1) * PIPE_MIN_TOKENS
# rows; below, the send kernel + reduce kernel are as fast or faster in CUDA graphs: the same crossover,
# between 128 and 256 tokens/rank, at ep = 2 and 4 (2 and 4 x H200) and on both grids; other ep are
# unmeasured and take the same rule. It holds for CUDA-graph captures. Eager calls run the pipelined launch
# at every size: at 128 tokens/rank an eager call is bound by its host, and the one launch saves one
# launch's host time (the figures: docs/DESIGN.md, "The pipelined combine").
PIPE_MIN_TOKENS = 128


def pipe_min_rows(ep: int) -> int:
    """Rows a rank sends back, ``(ep - 1) * runtime_max``, above which ``pipelined_combine=None`` runs
    the pipelined launch: ``(ep - 1) * PIPE_MIN_TOKENS`` (see :data:`PIPE_MIN_TOKENS`), with a
    ``num_sms`` cap or without."""
    return (ep - 1) * PIPE_MIN_TOKENS


def pipe_senders(n: int, ep: int) -> int:
    """Sender programs of the pipelined combine's ``n``: a third at ep = 2 (one peer to send to, two
    rows to sum per token), half at larger ep: the fastest shares measured with 24 programs on H100s and
    H200s (docs/DESIGN.md, "The pipelined combine"); at ep = 4, 12 of 24 beat 10, 11 and 13 because each
    sender's chunks then all go to one peer (senders stride the chunks, which alternate peers)."""
    share = 1 / 3 if ep == 2 else 1 / 2
    return min(n - 1, max(1, round(n * share)))


# the pipelined combine's tall tiles (1024 columns x 16 rows, 16 warps) on narrow grids from this many
# tokens/rank (runtime_max, the same on every rank)
PIPE_TALL_MIN_TOKENS = 2048


def pipe_tiling(W: int, programs: int, rt: int) -> tuple[int, int, int]:
    """``(nb, tt, warps)`` of the pipelined combine for rows of ``W`` elements: columns per tile (a power
    of two, ``PIPE_CHUNK`` a multiple of ``tt``), rows (send) / tokens (reduce) per tile, ``num_warps``.
    Below 64 programs and from :data:`PIPE_TALL_MIN_TOKENS` tokens/rank, tall tiles of 1024 x 16;
    otherwise :func:`row_tiling`'s persistent tiles (4096 x 4 for DeepSeek-V3 rows). The tall tiles are
    faster on 24 programs from 2048 tokens/rank at ep = 2 and 4, slower at smaller sizes and on every SM;
    every 8-warp shape is slower (4 x H200 and 2 x H200; docs/DESIGN.md, "The pipelined combine")."""
    if programs < 64 and rt >= PIPE_TALL_MIN_TOKENS:
        nb, tt = min(1024, next_power_of_2(W)), 16
        warps = 16 if nb * tt >= 8192 else 8 if nb * tt >= 2048 else 4
        return nb, tt, warps
    nb, _, tt, warps = row_tiling(W, True)
    return nb, tt, warps


def pipe_chunk(programs: int, rt: int) -> int:
    """Rows per arrival flag of the pipelined combine: :data:`PIPE_CHUNK_NARROW` below 64 programs from
    :data:`PIPE_CHUNK_NARROW_MIN_TOKENS` tokens/rank, else :data:`PIPE_CHUNK` (a multiple of
    :func:`pipe_tiling`'s rows either way). Each flag is a system-scope release that waits for its
    chunk's stores to land; on a narrow grid each sender has many chunks, and fewer flags let its stores
    run on: 5-7 % faster at 4096 tokens/rank on 24 programs, no slower at 1024 or 2048; 64 rows, and 32
    rows on every SM, are slower (4 x H100, ep = 4; docs/DESIGN.md, "The pipelined combine")."""
    if programs < 64 and rt >= PIPE_CHUNK_NARROW_MIN_TOKENS:
        return PIPE_CHUNK_NARROW
    return PIPE_CHUNK


# the two-kernel combine's send without a num_sms cap: at most this many columns per program (whole rows up
# to it)
SEND_DENSE_MAX_COLS = 8192


def send_tiling(W: int, persistent: bool) -> tuple[int, int, int, int]:
    """``(nb, chunks, tt, warps)`` of ``ep_combine_send_kernel`` (the two-kernel combine's send) for rows of
    ``W`` elements. With a ``num_sms`` cap, :func:`row_tiling`'s persistent tiles. Without one, one program
    per row (up to :data:`SEND_DENSE_MAX_COLS` columns each, 8 warps), as the dense pack copies whole rows,
    instead of row_tiling's 1024-column programs (2 KB each): about 1 µs faster at ep = 2, the same at
    ep = 4, where the send stays ~10 µs above a plain copy of its bytes, so the programs' size is not what
    costs there (4 x H100; docs/DESIGN.md, "The pipelined combine")."""
    if persistent:
        return row_tiling(W, True)
    nb = min(next_power_of_2(W), SEND_DENSE_MAX_COLS)
    return nb, cdiv(W, nb), 1, 8 if nb >= 2048 else 4


def pipe_group(T: int, tt: int, reducers: int) -> int:
    """Token tiles per reducer step: the largest power of two up to :data:`PIPE_MAX_GROUP` that still
    leaves every reducer about 8 steps (fewer flag waits at large ``T``, an even tail at small ``T``;
    docs/DESIGN.md, "The pipelined combine")."""
    g = 1
    while g < PIPE_MAX_GROUP and T >= 2 * g * tt * reducers * 8:
        g *= 2
    return g


class _SymmBuffer:
    """One rendezvoused uint8 buffer: ``local`` (this rank's) and ``peers[r]`` (rank r's, mapped)."""

    def __init__(self, core: AlltoAllCore, nbytes: int, what: str) -> None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=core.device)
            group_name = core.group.group_name
            self.handle = symm_mem.rendezvous(self.local, group_name)
            self.peers = [
                self.local if r == core.rank else self.handle.get_buffer(r, (nbytes,), torch.uint8)
                for r in range(core.ep)
            ]
        except Exception as e:  # re-raised with context, no fallback
            raise RuntimeError(
                f"MoeAlltoAll(transport='symm') on rank {core.rank}: could not set up the {what} buffer "
                f"({nbytes} bytes) in torch.distributed._symmetric_memory: {type(e).__name__}: {e}. "
                "The symm transport needs CUDA GPUs of one node with peer access; use transport='nccl' "
                "otherwise."
            ) from e
        self.nbytes = nbytes


class SymmTransport:
    """Buffers and exchange of :class:`~replaymoe.ep.MoeAlltoAll` over symmetric memory, on the
    all-to-all's shared state ``core`` (:class:`~replaymoe.ep._core.AlltoAllCore`)."""

    def __init__(self, core: AlltoAllCore) -> None:
        if core.ep > _MAX_EP:
            fail("group", f"at most {_MAX_EP} ranks for transport='symm' (one node)", f"{core.ep} ranks")
        _switches.multicast_off()  # before the first symmetric-memory allocation (module docstring)
        self.core = core
        t = core.timeout
        self.timeout_ms = _DEFAULT_TIMEOUT_MS if t is None else max(1, int(t.total_seconds() * 1000))
        self.row_cap = 0
        self.disp: _SymmBuffer | None = None
        self.comb: _SymmBuffer | None = None
        self._retired: list[_SymmBuffer] = []  # grown-out buffers stay mapped (peers may be in flight)
        self._ckeys: dict = {}  # combine launch plans per (dtype, rt, payload strides)
        # None: the process default (REPLAYMOE_EP_FUSED); the barrier inside the kernels (no extra launch
        # per phase), else torch's signal-pad barrier kernel
        self.fused = _switches.DEFAULTS.ep_fused if core.fused_barrier is None else core.fused_barrier
        self.sig: _SymmBuffer | None = None  # signal pads (fused barrier)
        self.signal_args: tuple = ()
        self.wait_args: tuple = ()
        # rows per chunk flag of the pipelined combine: None = pipe_chunk's rule (a probe's lever: any
        # multiple of the tiles' rows from PIPE_CHUNK up; the pads hold PIPE_CHUNK-row flags)
        self.chunk: int | None = None
        self.ncmax = cdiv(core.max_num_tokens, PIPE_CHUNK)  # chunk flags per source in a pad
        self.pads: list[torch.Tensor] = []
        self._pkeys: dict = {}  # pipelined combine launch plans
        # pipelined combine (row width, programs, roles, tall, chunk) -> (senders, nb, tt, warps)
        self._pshape: dict = {}

    def barrier(self) -> None:
        """torch's signal-pad barrier over the group (the phases' barrier without the fused one)."""
        assert self.disp is not None
        self.disp.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def _init_signal(self) -> None:
        """Signal pads for the fused barrier (collective: every rank's first dispatch): int32 per rank,
        slot ``s`` = source s's dispatch epoch, ``8 + s`` its combine epoch, and from ``FLAG_BASE`` the
        pipelined combine's chunk flags (``ncmax`` per source); and this rank's counters [dispatch epoch,
        combine epoch, pack arrivals, send arrivals, the pipelined combine's sender arrivals]."""
        core = self.core
        self.sig = _SymmBuffer(core, 4 * (FLAG_BASE + _MAX_EP * self.ncmax), "signal")
        self.sig.local.zero_()
        self.state = torch.zeros(8, dtype=torch.int32, device=core.device)
        self.sig.handle.barrier(channel=0, timeout_ms=self.timeout_ms)  # zeroed everywhere before use
        self._set_sync_args([p.view(torch.int32) for p in self.sig.peers], self.state)

    def _set_sync_args(self, pads: list[torch.Tensor], state: torch.Tensor) -> None:
        core = self.core
        st = self.state = state
        pads = pads + [pads[0]] * (_MAX_EP - len(pads))
        self.pads = pads
        timer = core.device.type == "cuda"
        tns = self.timeout_ms * 1_000_000
        # (arrive, epoch, q0..q7, pad_off) for the producers; (epoch, pad, pad_base, timeout_ns) + TIMER
        r = core.rank
        self.signal_args = ((st[2:3], st[0:1], *pads, r), (st[3:4], st[1:2], *pads, 8 + r))
        self.wait_args = ((st[0:1], pads[r], 0, tns, timer), (st[1:2], pads[r], 8, tns, timer))

    def ensure_dispatch(self, row_bytes: int) -> None:
        if self.fused and self.sig is None and not self.signal_args:
            self._init_signal()
        if row_bytes <= self.row_cap:
            return
        core = self.core
        guard_growth(core, "dispatch")
        if self.disp is not None:
            self._retired.append(self.disp)
        self.disp = _SymmBuffer(core, core.ep * (core.max_num_tokens + 1) * row_bytes, "dispatch")
        self.row_cap = row_bytes
        core.dispatch_plans.clear()  # cached views alias the old buffers

    # ------------------------------------------------------------------------------------------
    def dispatch_targets(self, layout, rt: int) -> Targets:
        """Token rows of this source go to block ``rank`` of every peer's receive buffer."""
        core = self.core
        buf = self.disp
        assert buf is not None
        block = (rt + 1) * layout.row_bytes  # all ranks use the same rt in a round; barriers order rounds
        return Targets(recv=buf.local, block=block, dsts=list(buf.peers), stride_dst_rank=0,
                       dst_base=core.rank * block, signal=self.signal_args[0] if self.fused else None,
                       wait=self.wait_args[0] if self.fused else None)  # fmt: skip

    def exchange_dispatch(self, tg: Targets) -> None:
        if not self.fused:
            self.barrier()

    def _combine_buffer(self, payload: torch.Tensor) -> _SymmBuffer:
        """The combine receive buffer, grown (collectively; refused during graph capture) to hold
        ``ep * max_num_tokens`` rows of ``payload``'s width and dtype; growth drops the launch plans."""
        core = self.core
        nbytes = core.ep * core.max_num_tokens * payload.shape[2] * payload.element_size()
        if self.comb is None or self.comb.nbytes < nbytes:
            guard_growth(core, "combine")
            if self.comb is not None:
                self._retired.append(self.comb)
            self.comb = _SymmBuffer(core, nbytes, "combine")
            self.drop_combine_plans()
        return self.comb

    def drop_combine_plans(self) -> None:
        """Forget the combine's launch plans (both forms; rebuilt by the next calls): a growth of the
        combine buffer, which they address, or a benchmark timing the first calls again."""
        self._ckeys, self._pkeys = {}, {}

    def combine(self, payload: torch.Tensor, rt: int) -> tuple[torch.Tensor, int, torch.Tensor, tuple | None]:
        """Send row ``[s, j]`` (``j < recv_counts[s]``, ``s`` another rank) to source ``s``'s combine
        buffer at ``[this rank, j]``, barrier; returns the local buffer's rows ``[ep * rt, H]``, the
        block stride (elements) and this rank's own rows ``payload[rank]`` (read in place)."""
        core = self.core
        H = payload.shape[2]  # hidden_size, or combine(width=...)
        persistent = core.num_sms is not None
        key = (payload.dtype, rt, H, payload.stride(), payload.data_ptr() & 15, persistent)
        c = self._ckeys.get(key)  # (a buffer's growth clears the plans: a plan found fits the buffer)
        if c is None:
            from .._launch import Launcher, addresses
            from ._kernel_combine import ep_combine_send_kernel

            es = payload.element_size()
            buf = self._combine_buffer(payload)
            # rows move in the payload's own dtype: strides and offsets are multiples of 16 elements
            # whenever H is, so Triton emits 128-bit accesses without any reinterpreting view
            dst = [p.view(payload.dtype) for p in buf.peers]
            dst = dst + [dst[0]] * (_MAX_EP - len(dst))
            nb, chunks, tt, warps = send_tiling(H, persistent)
            rows = buf.local[: core.ep * rt * H * es].view(payload.dtype).view(core.ep * rt, H)
            work = (core.ep - 1) * cdiv(rt, tt)  # the kernel's work items: row tiles of one source each
            sig = self.signal_args[1] if self.fused else (core.recv_counts,) * 10 + (0,)
            tail = (core.recv_counts, *dst, rt, H, payload.stride(0), payload.stride(1), core.rank * rt * H,
                    H, *sig, core.ep, core.rank, nb, tt, self.fused)  # fmt: skip
            c = (Launcher(ep_combine_send_kernel, num_warps=warps), tail, addresses(tail), chunks, rows, work)
            self._ckeys[key] = c
        launch, tail, tail_i, chunks, rows, work = c
        nprog = core.programs(work * chunks, chunks) if persistent else core.dense_programs(work, chunks)
        # this rank's own rows are not copied: the reduction reads them in place
        if launch.ready():
            launch.fast((nprog, chunks), (payload.data_ptr(), *tail_i))
        else:
            launch((nprog, chunks), (payload, *tail))
        if not self.fused:
            self.barrier()
            return rows, rt * H, payload[core.rank], None
        return rows, rt * H, payload[core.rank], self.wait_args[1]

    # ------------------------------------------------------------------------------------------
    def pipelines(self, rt: int) -> bool:
        """Whether ``combine`` at ``runtime_max_tokens_per_rank = rt`` runs as one pipelined launch
        (:meth:`combine_pipelined`): the fused barrier, at least 2 programs (:meth:`programs`: one sender
        and one reducer at least), and ``pipelined_combine`` True, or None (the default) outside a CUDA-graph
        capture (eager: one launch less of host time) or with more than :func:`pipe_min_rows` rows to send
        back, ``(ep - 1) * rt``. Every input is the same on every rank as long as every rank captures the
        call alike, so every rank chooses alike."""
        core = self.core
        mode = core.pipelined_combine
        if mode is False or not self.fused or self.programs() < 2:
            return False
        if mode is True:
            return True
        return (core.ep - 1) * rt > pipe_min_rows(core.ep) or not is_capturing()

    def programs(self) -> int:
        """Programs of the pipelined combine: ``num_sms``, or every SM when it is unset (one each:
        every program resident at once, since reducers wait on senders)."""
        core = self.core
        return min(core.device_sms if core.num_sms is None else core.num_sms, core.device_sms)

    def combine_pipelined(self, payload: torch.Tensor, rt: int, slot: torch.Tensor, out: torch.Tensor,
                          *, roles: int = 0) -> None:  # fmt: skip
        """Send this rank's rows back and sum the returned rows per token into ``out`` [T, W] in one
        launch (``ep_combine_kernel``): :func:`pipe_senders` of the ``num_sms`` programs send, chunk by
        chunk, each chunk flagged in its source's pad; the others reduce token blocks as their chunks land.
        ``roles`` 1 / 2: the send or the reduce alone (the CPU tests run the ranks in turn)."""
        core = self.core
        W = payload.shape[2]
        T = out.shape[0]
        n = self.programs()
        chunk = pipe_chunk(n, rt) if self.chunk is None else self.chunk
        skey = (W, n, roles, rt >= PIPE_TALL_MIN_TOKENS, chunk)
        shape = self._pshape.get(skey)  # (senders, nb, tt, warps) per row width, grid and chunk
        if shape is None:
            senders = pipe_senders(n, core.ep) if roles == 0 else n
            nb, tt, warps = pipe_tiling(W, n, rt)
            if chunk % tt or chunk < PIPE_CHUNK:  # (the pads hold cdiv(max_num_tokens, PIPE_CHUNK) flags)
                raise ValueError(
                    f"SymmTransport.chunk: expected a multiple of the tiles' {tt} rows, at least "
                    f"{PIPE_CHUNK}, got {chunk}"
                )
            shape = self._pshape[skey] = (senders, nb, tt, warps)
        senders, nb, tt, warps = shape
        group = pipe_group(T, tt, max(1, n - senders))
        p_ptr, strides = payload.data_ptr(), payload.stride()
        # Triton specializes integer arguments on == 1 and % 16 == 0: T moves per call, its class does not
        key = (payload.dtype, rt, W, strides, p_ptr & 15, slot.data_ptr() & 15, out.data_ptr() & 15, roles, n,
               group, chunk, T == 1, T % 16 == 0)  # fmt: skip
        c = self._pkeys.get(key)  # (a buffer's growth clears the plans: a plan found fits the buffer)
        if c is None:
            from .._launch import Launcher, addresses
            from ._kernel_combine import ep_combine_kernel

            self._combine_buffer(payload)
            dst = [p.view(payload.dtype) for p in self.comb.peers]
            dst = dst + [dst[0]] * (_MAX_EP - len(dst))
            st = self.state
            bufs = (*dst, *self.pads)  # the receive buffers and signal pads (fixed addresses)
            ep_p2 = max(2, next_power_of_2(core.ep))
            on_gpu = core.device.type == "cuda"
            after_t = (payload.stride(0), payload.stride(1), rt * W, payload.stride(1), FLAG_BASE, st[3:4],
                       st[1:2], st[4:5], 8, self.timeout_ms * 1_000_000, core.ep, ep_p2, core.rank,
                       senders, self.ncmax, chunk, nb, tt, group, roles, on_gpu)  # fmt: skip
            c = (Launcher(ep_combine_kernel, num_warps=warps), (n,), bufs, addresses(bufs), after_t,
                 addresses(after_t))  # fmt: skip
            if len(self._pkeys) >= 64:
                self._pkeys.pop(next(iter(self._pkeys)))
            self._pkeys[key] = c
        launch, grid, bufs, bufs_i, after_t, after_t_i = c
        own = p_ptr + core.rank * strides[0] * payload.element_size()  # payload[rank]
        if launch.ready():
            launch.fast(grid, (p_ptr, core.recv_counts.data_ptr(), *bufs_i, slot.data_ptr(), out.data_ptr(),
                               own, rt, W, T, *after_t_i))  # fmt: skip
        else:
            own_rows = payload[core.rank]
            launch(grid, (payload, core.recv_counts, *bufs, slot, out, own_rows, rt, W, T, *after_t))

"""Routing capture for a serving loop: :class:`RoutedExpertsCapturer`.

The model's MoE layers write the expert ids they choose into one device buffer
(``routing_replay_out=cap.layer_buffer(l)``); after each step the serving loop tells the
capturer which request and position each of the step's tokens was, and the ids end up in
per-request host storage, from which :meth:`RoutedExpertsCapturer.finish` returns a
:class:`~replaymoe.record.trace.RoutingTrace`::

    cap = RoutedExpertsCapturer(num_layers=L, max_num_tokens=N, top_k=K, device="cuda",
                                num_experts=E, layer_ids=moe_layer_numbers)
    # model forward (may be a CUDA graph replay): layer l calls
    #     route(logits, K, ..., routing_replay_out=cap.layer_buffer(l))
    cap.end_step(token_requests, token_positions)      # outside the graph, after the forward
    ...
    trace = cap.finish(request_id)                      # when the request completes

Data path per step: a device gather of the step's rows into staging, an asynchronous copy to
pinned host memory on a side stream, and a lazy host scatter into per-request pages
(:mod:`replaymoe.record.transfer` has the details).

Memory: per 1k captured tokens ``1000 * L * K * 2`` bytes (1.02 MB at L=64, K=8) plus at most
one partly used page per request; staging ``num_buffers * N * L * K * 2`` bytes pinned and
as much on the device, plus the [L, N, K] buffer itself.

Not thread-safe: call it from the thread that runs the serving loop.

Within one step a (request, position) is carried once (twice is a ``ValueError`` and nothing of the
step is recorded); a later step may record it again (a recomputed token), which overwrites it.
A failed ``end_step``, ``finish`` or ``abort`` leaves the requests, pages and recorded rows as they were.

``end_step`` reads nothing from the device: the request/position bookkeeping is host lists.
The buffer is allocated once, so a whole step, model forward included, can be captured in
a CUDA graph with it as a static input; ``end_step`` is called outside the graph.
On ``device='cpu'`` there are no streams or pinned memory: step 1-2 are a plain copy at
``end_step`` and step 3 is still deferred, so CI exercises the same bookkeeping.

Data-parallel layouts
---------------------
* **This rank's tokens only** (attention DP without all-gather before the MoE, or no DP):
  buffer rows ``0..T-1`` are the step's tokens; pass one entry per token (``None`` for
  padding rows, e.g. CUDA-graph batch padding).
* **All DP ranks' tokens concatenated** (the MoE runs on the all-gathered batch): either pass
  ``dp_span=(start, length)`` with entries for this rank's ``length`` tokens only — just
  rows ``[start, start+length)`` are copied — or pass one entry per row of the whole batch
  with ``None`` for other ranks' tokens.

Host storage
------------
Per-request storage is paged: positions are grouped in pages of ``page_size`` positions
(int16 [page_size, L, K], all -1 when handed to a request) drawn from slabs of ordinary
(pageable) host memory that grow on demand, ``slab_pages`` pages at a time, up to
``max_host_bytes``; freed pages are refilled with -1 and reused, slabs are kept. A request's pages are
allocated lazily for the positions it actually computes; positions never computed (served
from a prefix cache, or by another rank) stay -1. ``finish`` assembles the request's
[positions, L, K] array, returns it as a trace and frees the pages; ``abort`` frees them.
Paging makes the per-step scatter one vectorised copy per slab instead of one per request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._validation import check_int, fail, is_capturing
from ._capture_checks import (
    ENTRY_BYTES,
    CaptureMemoryError,
    check_capturer_args,
    check_distinct_rows,
    check_hashable,
    check_table_growth,
    fail_position,
    invalid_routing,
    max_positions,
    page_table_memory_message,
    step_positions,
)
from .trace import RoutingTrace
from .transfer import CudaTransfer, SyncTransfer

__all__ = ["RoutedExpertsCapturer", "CaptureMemoryError"]


# --------------------------------------------------------------------------------------------
# bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    """Host state of one request: its page table (page index -> global page, -1 = none)."""

    pages: list[int] = field(default_factory=list)
    length: int = 0  # 1 + largest position recorded
    last_step: int = -1  # id of the last step that carried one of its tokens
    alive: bool = True


@dataclass(eq=False)
class _Pending:
    step: int
    slot: int
    T: int
    src: np.ndarray  # int64 [m]: row in the step's [T, L, K] staging
    dst: np.ndarray  # int64 [m]: global row in the page pool (page * page_size + offset)
    handle: Any


def _undo_step(
    free: list[int],
    slabs: list[np.ndarray],
    slab_pages: int,
    num_slabs: int,
    taken: list[tuple[_Request, int, int]],
    touched: dict[Any, tuple[_Request, int, int]],
) -> None:
    """Roll back a failed ``end_step``: give back the pages it took (``(state, page index, page)``,
    in reverse order: the free list as it was), restore the length and page table of each request it
    touched, and drop the slabs it added (``num_slabs`` were there before), all of whose pages are free."""
    for st, pg, g in reversed(taken):
        free.append(g)
        st.pages[pg] = -1
    for st, length, npages in touched.values():
        st.length = length
        del st.pages[npages:]
    if len(slabs) > num_slabs:
        free[:] = [g for g in free if g < num_slabs * slab_pages]
        del slabs[num_slabs:]


def _name_step_error(exc: BaseException, i: int, req: Any, p: int, page_size: int) -> None:
    """Raise the named error for a failure of ``end_step``'s bookkeeping at entry ``i``: an
    unhashable request id, or a page table the host could not allocate; return for anything else."""
    if isinstance(exc, TypeError) and req is not None:
        check_hashable(f"token_requests[{i}]", req)
    if isinstance(exc, MemoryError) and not isinstance(exc, CaptureMemoryError):
        raise CaptureMemoryError(page_table_memory_message(p, i, req, page_size)) from exc


class RoutedExpertsCapturer:
    """Capture the routed expert ids of every token of a serving loop, per request.

    Parameters
    ----------
    num_layers : int
        L, the number of MoE layers (only MoE layers: ``layer_ids`` maps them to model layers).
    max_num_tokens : int
        N, the most tokens one step routes (all DP ranks' tokens when the MoE sees them all).
    top_k : int
        K.
    device : torch.device or str
        Where the buffer lives (``"cuda"``, ``"cuda:1"`` or ``"cpu"``).
    layer_ids : sequence of int, optional
        MoE-layer index -> model layer number (distinct non-negative ints), stored on the traces.
    num_experts : int, optional
        E, stored on the traces (and used to validate ids at ``finish``).
    model_id : str, optional
        Stored on the traces. All three are checked here as the trace checks them.
    max_host_bytes : int, optional
        Bound on host memory (page slabs, staging buffers and the requests' page tables, 8 bytes per
        ``page_size`` positions of a request); a step needing more raises :class:`CaptureMemoryError`
        before anything of that step is recorded. ``None`` = no bound (a position far past any real
        context then allocates its request's page table up to it: set a bound for untrusted
        positions).
    page_size : int
        Positions per host page (default 64).
    num_buffers : int
        Staging buffers in flight (default 2: double-buffered).
    slab_pages : int
        Pages allocated at once when the pool grows (default 256).
    clear_after_copy : bool
        Debug aid: after gathering a step's rows, refill them with -1 (one extra memset on the
        step's stream), so a layer whose kernel skipped its ``routing_replay_out`` write shows up
        as missing (-1) rather than as the previous step's stale ids.

    Attributes
    ----------
    buffer : torch.Tensor int16 [L, N, K]
        The device buffer, allocated once (static address, safe as a CUDA-graph input). Filled
        with -1 at construction; rows the kernels did not write keep their previous content.
    """

    def __init__(
        self,
        num_layers: int,
        max_num_tokens: int,
        top_k: int,
        *,
        device: torch.device | str,
        layer_ids: Sequence[int] | None = None,
        num_experts: int | None = None,
        model_id: str | None = None,
        max_host_bytes: int | None = None,
        page_size: int = 64,
        num_buffers: int = 2,
        slab_pages: int = 256,
        clear_after_copy: bool = False,
    ):
        num_experts, layer_ids = check_capturer_args(
            num_layers=num_layers, max_num_tokens=max_num_tokens, top_k=top_k, layer_ids=layer_ids,
            num_experts=num_experts, model_id=model_id, max_host_bytes=max_host_bytes, page_size=page_size,
            num_buffers=num_buffers, slab_pages=slab_pages, clear_after_copy=clear_after_copy,
        )  # fmt: skip
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            fail("device", "a cuda or cpu device", str(self.device))
        self.num_layers, self.max_num_tokens, self.top_k = num_layers, max_num_tokens, top_k
        self.layer_ids = layer_ids
        self.num_experts, self.model_id = num_experts, model_id
        self.max_host_bytes = max_host_bytes
        self.page_size, self.num_buffers, self.slab_pages = page_size, num_buffers, slab_pages
        self.clear_after_copy = clear_after_copy

        self.buffer = torch.full(
            (num_layers, max_num_tokens, top_k), -1, dtype=torch.int16, device=self.device
        )
        self._transfer = self._make_transfer()
        self._row_bytes = num_layers * top_k * 2
        self._max_positions = max_positions(page_size, self._row_bytes)
        self._slabs: list[np.ndarray] = []  # each [slab_pages * page_size, L, K] int16
        self._free_pages: list[int] = []
        self._requests: dict[Hashable, _Request] = {}
        self._table_entries = 0  # page-table entries of every request (live or zombie): host_bytes()
        self._zombies: list[_Request] = []  # aborted, pages freed once their pending copies land
        self._pending: deque[_Pending] = deque()
        self._slot_busy: list[_Pending | None] = [None] * num_buffers
        self._step = 0
        self._scattered_upto = -1  # every step <= this has been scattered

    def _make_transfer(self) -> Any:
        if self.device.type == "cuda":
            return CudaTransfer(self.buffer, self.num_buffers)
        return SyncTransfer(self.buffer, self.num_buffers)

    # ------------------------------------------------------------------ device side
    def layer_buffer(self, layer: int) -> torch.Tensor:
        """The int16 [N, K] contiguous view for MoE layer ``layer``: pass it as ``routing_replay_out``."""
        check_int("layer", layer, low=0, high=self.num_layers - 1)
        return self.buffer[layer]

    # ------------------------------------------------------------------ step protocol
    def end_step(
        self,
        token_requests: Sequence[Hashable | None],
        token_positions: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        dp_span: tuple[int, int] | None = None,
    ) -> None:
        """Record the step just run: token i of the step belongs to ``token_requests[i]`` at
        position ``token_positions[i]`` of that request's sequence.

        Parameters
        ----------
        token_requests : sequence of hashable or None
            One entry per token of the step, in the step's token order (the buffer's row order).
            ``None`` marks a row to ignore (padding, another DP rank's token).
        token_positions : sequence of int (list, numpy array or CPU tensor)
            Position of each token in its request's sequence (ignored where the request is None).
        dp_span : (start, length), optional
            The buffer holds all DP ranks' tokens concatenated and this rank's are rows
            ``[start, start + length)``; the two sequences then describe those ``length`` tokens.

        Notes
        -----
        Enqueues one device gather on the current stream and one asynchronous copy on a side
        stream; never reads device memory. Call it after the step's kernels were enqueued (after
        the graph replay), on the same stream, and outside CUDA-graph capture.

        Raises
        ------
        ValueError
            Naming the argument, with nothing of the step recorded: e.g. a position out of range, or
            two entries of the step for one (request, position) (a later step may overwrite one).
        CaptureMemoryError
            The step would take host memory past ``max_host_bytes``; nothing of it is recorded.
        """
        if is_capturing():
            fail(
                "end_step", "a call outside CUDA-graph capture (after the graph replay)", "a capturing stream"
            )
        n, pos, start, T = step_positions(token_requests, token_positions, dp_span, self.max_num_tokens)

        # host bookkeeping (one pass over the tokens): staging row -> pool row. Pages are taken
        # as needed; if a check or the memory bound stops the step, everything it changed is rolled back.
        P, top, num_slabs = self.page_size, self._max_positions - 1, len(self._slabs)
        pos_list = pos.tolist()
        requests = self._requests
        touched: dict[Hashable, tuple[_Request, int, int]] = {}  # req -> (state, old length, old #pages)
        taken: list[tuple[_Request, int, int]] = []  # (state, page index, page) pages taken by this step
        src: list[int] = []
        dst: list[int] = []
        i, req, p = -1, None, 0
        try:
            for i, req in enumerate(token_requests):
                if req is None:
                    continue
                p = pos_list[i]
                if not 0 <= p <= top:  # checked before any page is taken for it
                    fail_position(p, i, top + 1)
                t = touched.get(req)
                if t is None:
                    st = requests.get(req)
                    if st is None:
                        st = _Request()
                    touched[req] = t = (st, st.length, len(st.pages))
                st = t[0]
                pg, off = divmod(p, P)
                pages = st.pages
                g = pages[pg] if pg < len(pages) else -1
                if g < 0:
                    if pg >= len(pages):  # the table first: a failure here has taken no page
                        grow = pg + 1 - len(pages)
                        if self.max_host_bytes is not None:
                            check_table_growth(self.host_bytes(), grow, self.max_host_bytes, req, p, i)
                        pages.extend([-1] * grow)
                        self._table_entries += grow
                    g = self._take_page()
                    taken.append((st, pg, g))
                    pages[pg] = g
                src.append(i)
                dst.append(g * P + off)
                if p >= st.length:
                    st.length = p + 1
            src_rows, dst_rows = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
            check_distinct_rows(dst_rows, src_rows, token_requests, pos_list)
        except BaseException as exc:
            self._table_entries -= sum(len(st.pages) - npages for st, _, npages in touched.values())
            _undo_step(self._free_pages, self._slabs, self.slab_pages, num_slabs, taken, touched)
            _name_step_error(exc, i, req, p, P)
            raise
        if not src:
            self._drain(block=False)
            return
        step = self._step
        self._step += 1
        for req, (st, _, _) in touched.items():
            st.last_step = step
            requests[req] = st

        # staging slot: the copy issued num_buffers steps ago must have landed and been scattered
        slot = step % self.num_buffers
        busy = self._slot_busy[slot]
        if busy is not None:
            self._drain(block=True, upto=busy.step)
        handle = self._transfer.start(slot, start, T)
        if self.clear_after_copy:
            self.buffer[:, start : start + T].fill_(-1)
        item = _Pending(step, slot, T, src_rows, dst_rows, handle)
        self._pending.append(item)
        self._slot_busy[slot] = item
        self._drain(block=False)

    # ------------------------------------------------------------------ host side
    def _slab_bytes(self) -> int:
        return self.slab_pages * self.page_size * self._row_bytes

    def _add_slab(self) -> None:
        if self.max_host_bytes is not None and self.host_bytes() + self._slab_bytes() > self.max_host_bytes:
            raise CaptureMemoryError(
                f"RoutedExpertsCapturer: recording this step needs another {self._slab_bytes()}-byte "
                f"slab of host pages, which would take host memory to "
                f"{self.host_bytes() + self._slab_bytes()} bytes, over max_host_bytes={self.max_host_bytes} "
                f"(in use: {self.host_bytes()} bytes; {len(self._requests)} live requests). finish() or "
                f"abort() requests, or raise max_host_bytes. "
                f"Nothing of this step was recorded."
            )
        base = len(self._slabs) * self.slab_pages
        # filled with -1 here and on every free, so taking a page is O(1) on the step path
        self._slabs.append(
            np.full((self.slab_pages * self.page_size, self.num_layers, self.top_k), -1, dtype=np.int16)
        )
        self._free_pages.extend(range(base + self.slab_pages - 1, base - 1, -1))  # pop() gives low first

    def _take_page(self) -> int:
        if not self._free_pages:
            self._add_slab()
        return self._free_pages.pop()

    def _free(self, st: _Request) -> None:
        P = self.page_size
        self._table_entries -= len(st.pages)
        for g in st.pages:
            if g >= 0:
                s, r = divmod(g, self.slab_pages)
                self._slabs[s][r * P : (r + 1) * P] = -1
                self._free_pages.append(g)
        st.pages = []

    def _scatter(self, item: _Pending) -> None:
        view = self._transfer.view(item.slot, item.T)  # [T, L, K] host
        rows_per_slab = self.slab_pages * self.page_size
        slab_of = item.dst // rows_per_slab
        local = item.dst - slab_of * rows_per_slab
        if len(self._slabs) == 1 or (slab_of == slab_of[0]).all():
            self._slabs[int(slab_of[0])][local] = view[item.src]
        else:
            for s in np.unique(slab_of):
                m = slab_of == s
                self._slabs[int(s)][local[m]] = view[item.src[m]]

    def _drain(self, *, block: bool, upto: int | None = None) -> None:
        """Scatter pending copies in step order: all completed ones, and (block=True) every
        step <= ``upto`` waiting for its copy."""
        while self._pending:
            item = self._pending[0]
            must = block and upto is not None and item.step <= upto
            if not self._transfer.ready(item.handle):
                if not must:
                    break
                self._transfer.wait(item.handle)
            self._scatter(item)
            self._pending.popleft()
            if self._slot_busy[item.slot] is item:
                self._slot_busy[item.slot] = None
            self._scattered_upto = item.step
        if self._zombies:
            keep = []
            for z in self._zombies:
                if z.last_step <= self._scattered_upto:
                    self._free(z)
                else:
                    keep.append(z)
            self._zombies = keep

    def poll(self) -> None:
        """Scatter every copy that has completed (``end_step`` does this too); never blocks."""
        self._drain(block=False)

    def finish(self, request_id: Hashable, *, num_positions: int | None = None) -> RoutingTrace:
        """Return a request's routing and free its storage.

        Waits for the copies of the steps that carried the request's tokens (a host wait on those
        copies only). Positions never recorded are -1.

        Parameters
        ----------
        request_id : hashable
        num_positions : int, optional
            Length of the returned trace: truncates positions recorded beyond it (e.g. rejected
            speculative tokens) or pads with -1. Default: 1 + the largest position recorded.

        Raises
        ------
        ValueError
            For an unknown or unhashable ``request_id``, a bad ``num_positions``, or recorded ids that
            make no valid trace (an id >= ``num_experts``, a row of repeated ids): the error names the
            request, the position and the MoE layer. A failed call keeps the request and its pages
            as they were: ``finish`` it again or ``abort`` it.
        """
        st = self._requests.get(check_hashable("request_id", request_id))
        if st is None:
            fail(
                "request_id",
                "a request that has recorded tokens and is not finished/aborted",
                repr(request_id),
            )
        if num_positions is not None:
            check_int("num_positions", num_positions, low=0, high=self._max_positions)
        self._drain(block=True, upto=st.last_step)
        n = st.length if num_positions is None else num_positions
        L, K, P = self.num_layers, self.top_k, self.page_size
        out = np.full((n, L, K), -1, dtype=np.int16)
        for pg, g in enumerate(st.pages):
            lo = pg * P
            if g < 0 or lo >= n:
                continue
            s, r = divmod(g, self.slab_pages)
            hi = min(lo + P, n)
            out[lo:hi] = self._slabs[s][r * P : r * P + (hi - lo)]
        try:  # the trace first: a failure leaves the request and its pages as they were
            trace = RoutingTrace(
                out, num_experts=self.num_experts, top_k=K, layer_ids=self.layer_ids, model_id=self.model_id
            )
        except ValueError as e:
            raise invalid_routing(request_id, e) from e
        del self._requests[request_id]
        st.alive = False
        self._free(st)
        return trace

    def abort(self, request_id: Hashable) -> None:
        """Drop a request (preempted, cancelled) and free its storage; unknown ids are ignored
        (an unhashable one is a ValueError naming ``request_id``).

        Never waits: pages still targeted by an in-flight copy are freed once it has landed.
        A new request may reuse the id at once.
        """
        st = self._requests.pop(check_hashable("request_id", request_id), None)
        if st is None:
            return
        st.alive = False
        if st.last_step <= self._scattered_upto:
            self._free(st)
        else:
            self._zombies.append(st)

    # ------------------------------------------------------------------ introspection
    @property
    def _table_bytes(self) -> int:
        return self._table_entries * ENTRY_BYTES

    @property
    def live_requests(self) -> list[Hashable]:
        """Ids of requests with recorded tokens that are neither finished nor aborted."""
        return list(self._requests)

    @property
    def pending_steps(self) -> int:
        """Steps whose copy has not been scattered yet."""
        return len(self._pending)

    @property
    def transfer(self) -> Any:
        """The staging of the device-to-host copies (:mod:`replaymoe.record.transfer`: on CUDA a
        ``CudaTransfer`` with its device stage buffers, pinned buffers and side stream; else a
        ``SyncTransfer``). Read it, never drive it: the capture benchmark times its pieces alone."""
        return self._transfer

    def host_bytes(self) -> int:
        """Host memory held: page slabs (used or free), staging buffers (pinned on CUDA) and the
        requests' page tables."""
        return len(self._slabs) * self._slab_bytes() + self._transfer.nbytes() + self._table_bytes

    def memory_stats(self) -> dict[str, int]:
        """Breakdown: ``staging_bytes``, ``pool_bytes``, ``used_page_bytes``, ``page_table_bytes``,
        ``live_requests``."""
        used = len(self._slabs) * self.slab_pages - len(self._free_pages)
        return {
            "staging_bytes": self._transfer.nbytes(),
            "pool_bytes": len(self._slabs) * self._slab_bytes(),
            "used_page_bytes": used * self.page_size * self._row_bytes,
            "page_table_bytes": self._table_bytes,
            "live_requests": len(self._requests),
        }

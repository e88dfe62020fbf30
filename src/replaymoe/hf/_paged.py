"""Capture under transformers' continuous batching: ``generate_batch`` and the
``ContinuousBatchingManager`` that ``init_continuous_batching`` makes (paged KV cache).

A continuous-batching forward packs the tokens of several requests, each at its own positions, into
one row ``[1, T]``; which request and position each token is lives on the host, in the batch the
manager's scheduler just prepared. So capture here is the serving-loop capturer's
(:class:`~replaymoe.record.capture.RoutedExpertsCapturer`):

* every router of a packed forward writes its ids into rows ``[0, T)`` of the capturer's device
  buffer ``int16 [L, N, K]`` (``N``: the paged cache's ``max_batch_tokens``), allocated once, right
  after the manager built its cache and before any forward (a CUDA graph or compiled forward of the
  manager records those fixed addresses);
* after each generation step (outside any graph, on the manager's compute stream) the step's
  ``(request id, position)`` per token, read from the batch's request states on the host, goes to
  :meth:`~replaymoe.record.capture.RoutedExpertsCapturer.end_step`: one device gather and one
  asynchronous copy to pinned host memory; no host synchronisation, nothing per layer;
* when the manager's generation loop ends, every traced request becomes one
  :class:`~replaymoe.record.trace.RoutingTrace` over its prompt and generated tokens but the last
  sampled one (as ``generate``'s), with its token ids, handed to the session in the order the
  requests were added (``generate_batch``: its inputs' order). That is the one wait of capture.

The hooks sit on the manager instance (``_create_batch_processor``, ``_generation_step``,
``_run_generation_loop``, ``add_request``, ``output_router.deliver`` / ``deliver_batch``) and read the
batch's ``requests_in_batch`` (``FutureRequestState``: ``state.request_id``, ``state.position_offset``,
``query_length``). :func:`missing_internals` checks they exist; a transformers without them is refused
while capture is on, naming its version (written against 5.17).

While a manager captures, its prefix sharing is off (a shared prefix is never computed for the
request that reuses it, so it would have no routing), and ``num_return_sequences > 1`` is refused
(its children are forked after the parent's prefill, which they then never compute).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Optional

import numpy as np
import torch

from replaymoe._validation import fail
from replaymoe.record.capture import RoutedExpertsCapturer
from replaymoe.record.trace import RoutingTrace

from .step import Step

__all__ = ["PagedCapture", "is_paged_forward", "missing_internals", "paged_generate_batch",
           "paged_init", "plan_paged_step"]  # fmt: skip

_ATTR = "_replaymoe_paged"  # the manager's attribute holding its PagedCapture
_FLUSH_TIMEOUT_S = 300.0  # generate_batch: how long to wait for the loop's traces after it returned
_MANAGER = ("_create_batch_processor", "_generation_step", "_run_generation_loop", "add_request",
            "output_router", "continuous_batching_config", "num_return_sequences", "is_running")  # fmt: skip


def is_paged_forward(kwargs: dict) -> bool:
    """Whether a decoder-stack forward with keyword arguments ``kwargs`` is a continuous-batching
    one (its cache is transformers' ``PagedAttentionCache``)."""
    cache = kwargs.get("cache")
    return cache is not None and type(cache).__name__ == "PagedAttentionCache"


def missing_internals(manager: Any) -> list[str]:
    """The attributes of transformers' ``ContinuousBatchingManager`` the hooks use that ``manager``
    lacks (empty when all are there)."""
    missing = [name for name in _MANAGER if not hasattr(manager, name)]
    router = getattr(manager, "output_router", None)
    missing += [f"output_router.{n}" for n in ("deliver", "deliver_batch") if not hasattr(router, n)]
    return missing


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _fail_internals(missing: list[str]) -> None:
    fail(
        "transformers",
        "a version whose ContinuousBatchingManager has what replaymoe's continuous-batching capture "
        "hooks (written against transformers 5.17)",
        f"transformers {_transformers_version()} without {', '.join(missing)}",
        what="version",
    )


class PagedCapture:
    """The capture of one continuous-batching manager (held on it, and by the session's engine).

    Attributes
    ----------
    capturing : bool
        Its forwards write their ids into :attr:`capturer`'s buffer. Decided when the manager is
        made (capture on, or a rollout-mode ``generate_batch``); a manager made without capture is
        switched to it only while it is stopped and before its forwards were recorded in CUDA
        graphs or compiled.
    capturer : RoutedExpertsCapturer or None
        Allocated once the manager built its paged cache.
    order : list[str]
        Request ids traced since the loop last ended, in the order they were added.
    error : BaseException or None
        What failed in the generation thread (re-raised by ``generate_batch``).
    """

    def __init__(self, engine: Any, manager: Any) -> None:
        self.engine = engine
        self.manager = weakref.ref(manager)
        self.capturing = False
        self.capturer: Optional[RoutedExpertsCapturer] = None
        self.cache: Optional[weakref.ref] = None  # the manager's PagedAttentionCache
        self.order: list[str] = []
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # finished requests: prompt + generated tokens
        self.error: Optional[BaseException] = None
        self.flushed = threading.Event()
        self.flushed.set()
        self.thread: Optional[threading.Thread] = None  # the generation loop's, once it ran
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- set-up
    def install(self, manager: Any) -> None:
        """Wrap the manager's hooks (instance attributes: the class is untouched)."""
        for name, wrap in (
            ("_create_batch_processor", self._wrap_create),
            ("_generation_step", self._wrap_step),
            ("_run_generation_loop", self._wrap_loop),
            ("add_request", self._wrap_add),
        ):
            setattr(manager, name, wrap(getattr(manager, name)))
        router = manager.output_router
        router.deliver = self._wrap_deliver(router.deliver, batch=False)
        router.deliver_batch = self._wrap_deliver(router.deliver_batch, batch=True)
        setattr(manager, _ATTR, self)

    def start_capturing(self, manager: Any) -> None:
        """Capture from now on (the manager is stopped): prefix sharing off, the buffer allocated if
        the cache exists. Refused where the manager cannot be captured faithfully."""
        if manager.num_return_sequences > 1:
            fail(
                "generation_config.num_return_sequences",
                "1 while capture is on (children are forked after their parent's prefill and never "
                "compute their prompt: repeat the prompts instead, as TRL does)",
                manager.num_return_sequences,
            )
        if manager.is_running():
            fail("set_capture", "capture on before the continuous-batching manager starts",
                 "a manager already running without capture", what="state")  # fmt: skip
        bp = getattr(manager, "batch_processor", None)
        if bp is not None:
            cfg = manager.continuous_batching_config
            if any(cfg.cuda_graph_booleans) or cfg.varlen_compile_config or cfg.decode_compile_config:
                fail("init_continuous_batching", "a manager made while capture was on (its CUDA graphs and "
                     "compiled forwards record the capture buffer)", "a persistent manager made without "
                     "capture: model.destroy_cached_continuous_batching_manager() first",
                     what="state")  # fmt: skip
            if bp.cache.use_prefix_sharing:
                fail("init_continuous_batching", "a manager without prefix sharing while capture is on",
                     "a persistent manager that shares prefixes: "
                     "model.destroy_cached_continuous_batching_manager() first", what="state")  # fmt: skip
            self.allocate(bp)
        else:  # read when the manager builds its cache (allow_block_sharing) and sorts requests
            manager.continuous_batching_config.allow_block_sharing = False
            manager._use_prefix_sharing = False
        self.capturing = True

    def allocate(self, batch_processor: Any) -> None:
        """The capture buffer for ``batch_processor``'s paged cache (kept when it fits)."""
        cache = batch_processor.cache
        if cache.use_prefix_sharing:
            fail("continuous_batching_config.allow_block_sharing", "False while capture is on", True)
        self.cache = weakref.ref(cache)
        n, device = int(cache.max_batch_tokens), torch.device(batch_processor.model_device)
        cap = self.capturer
        if cap is None or cap.max_num_tokens < n or cap.device != device:
            meta = self.engine.capture.meta
            self.capturer = RoutedExpertsCapturer(
                meta.num_layers, n, meta.top_k, device=device, layer_ids=meta.layer_ids,
                num_experts=meta.num_experts, model_id=meta.model_id,
            )  # fmt: skip

    def staged(self, num_tokens: int) -> torch.Tensor:
        """The capture slab ``int16 [L, T, K]`` of a packed forward of ``num_tokens`` tokens."""
        cap = self.capturer
        if cap is None:
            fail("init_continuous_batching", "a manager whose capture buffer was made with its cache",
                 "a forward before it", what="state")  # fmt: skip
        if num_tokens > cap.max_num_tokens:
            fail("hidden_states", f"at most {cap.max_num_tokens} tokens (the paged cache's max_batch_tokens)",
                 num_tokens, what="shape")  # fmt: skip
        return cap.buffer[:, :num_tokens]

    # ---------------------------------------------------------------- manager hooks
    def _wrap_create(self, create: Callable) -> Callable:
        @functools.wraps(create)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            bp = create(*args, **kwargs)
            self.cache = weakref.ref(bp.cache)  # how the forwards find their manager (_find)
            if self.capturing and self.engine.enabled:
                self._guard(self.allocate, bp)
            return bp

        return wrapped

    def _wrap_add(self, add: Callable) -> Callable:
        @functools.wraps(add)
        def wrapped(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
            traced = self.engine.enabled and self.engine.capture.on
            if traced and not self.capturing:
                fail("add_request", "a manager made with capture on (make it after set_capture(True))",
                     "a manager made without capture", what="state")  # fmt: skip
            rid = add(input_ids, *args, **kwargs)
            if traced and rid is not None:
                with self.lock:
                    self.flushed.clear()
                    if rid not in self.prompts:
                        self.order.append(rid)
                    self.prompts[rid] = [int(t) for t in input_ids]
            return rid

        return wrapped

    def _wrap_deliver(self, deliver: Callable, *, batch: bool) -> Callable:
        @functools.wraps(deliver)
        def wrapped(outputs: Any) -> Any:
            for out in outputs if batch else (outputs,):
                rid = getattr(out, "request_id", None)
                if rid in self.prompts and out.is_finished():
                    self.outputs[rid] = [int(t) for t in (*out.prompt_ids, *out.generated_tokens)]
            return deliver(outputs)

        return wrapped

    def _wrap_step(self, step: Callable) -> Callable:
        @functools.wraps(step)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not (self.capturing and self.engine.enabled and self.prompts):
                return step(*args, **kwargs)
            manager, cap = self.manager(), self.capturer
            if manager is None or cap is None:  # (a manager calls this: alive; its cache made the buffer)
                self.error = self.error or ValueError(
                    "Invalid state of init_continuous_batching: expected a capture buffer made with the "
                    "manager's cache, got a generation step without one"
                )
                raise self.error
            io = manager.batch_processor.inputs_and_outputs
            requests, positions = self._guard(self.batch_tokens, io)
            out = step(*args, **kwargs)
            stream = getattr(io, "compute_stream", None)  # the forward's stream (None on the CPU)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._guard(cap.end_step, requests, positions)
            return out

        return wrapped

    def _wrap_loop(self, loop: Callable) -> Callable:
        @functools.wraps(loop)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.thread = threading.current_thread()
            try:
                return loop(*args, **kwargs)
            finally:
                self.flush()

        return wrapped

    def _guard(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``, keeping what it raises for the main thread (transformers' generation loop
        turns exceptions into failed requests)."""
        try:
            return fn(*args)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    # ---------------------------------------------------------------- per step, on the host
    def batch_tokens(self, io: Any) -> tuple[list[Optional[Hashable]], list[int]]:
        """(request id or None, position) of every real token of the step the manager just
        prepared, in the packed row's order: request after request, ``query_length`` tokens each,
        from its ``position_offset`` before this step."""
        requests: list[Optional[Hashable]] = []
        positions: list[int] = []
        prompts = self.prompts
        try:
            host = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io  # async or sync
            for future in host.requests_in_batch:
                state, q = future.state, future.query_length
                rid = state.request_id
                start = state.position_offset - q  # (prepare_batch_tensors already advanced it)
                requests.extend([rid if rid in prompts else None] * q)
                positions.extend(range(start, start + q))
        except AttributeError as exc:  # a transformers whose batch holds its requests otherwise
            _fail_internals([f"the batch's requests_in_batch / FutureRequestState fields ({exc})"])
        return requests, positions

    # ---------------------------------------------------------------- end of the loop
    def flush(self) -> None:
        """The traces of every request added since the last flush, in the order added, to the
        session (its ``capture.finished``, read by ``traces()``); the capturer emptied."""
        with self.lock:
            order, prompts, outputs = self.order, self.prompts, self.outputs
            self.order, self.prompts, self.outputs = [], {}, {}
        try:
            if order and self.error is None and self.engine.enabled:
                traces = self._guard(self.traces, order, prompts, outputs)
                self.engine.capture.finished.extend(traces)
        finally:
            cap = self.capturer
            if cap is not None:
                for rid in cap.live_requests:
                    cap.abort(rid)
            self.flushed.set()

    def traces(self, order: list[str], prompts: dict, outputs: dict) -> list[RoutingTrace]:
        """One trace per request of ``order``: a finished one over its prompt and generated tokens
        but the last, the others over what they computed (token ids -1 past the prompt)."""
        meta = self.engine.capture.meta
        cap = self.capturer
        live = set(cap.live_requests) if cap is not None else set()
        out = []
        for rid in order:
            tokens = outputs.get(rid)
            ids = None  # (a live request means a capturer)
            if tokens is not None:
                n = max(len(tokens) - 1, 0)
                if cap is not None and rid in live:
                    ids = cap.finish(rid, num_positions=n).ids
            else:  # never finished (cancelled, stopped): what it computed
                if cap is not None and rid in live:
                    ids = cap.finish(rid).ids
                n = 0 if ids is None else len(ids)
                tokens = prompts[rid] + [-1] * n
            if ids is None:  # no token of it ran
                ids = np.full((n, meta.num_layers, meta.top_k), -1, np.int16)
            out.append(RoutingTrace(ids, num_experts=meta.num_experts, top_k=meta.top_k,
                                    layer_ids=list(meta.layer_ids), model_id=meta.model_id,
                                    token_ids=tokens[:n]))  # fmt: skip
        return out

    def wait_flushed(self) -> None:
        """Wait for the generation loop to hand its traces over (it ran in this call), or flush here
        (it never ran); re-raise what failed in the loop."""
        if self.thread is None:
            self.flush()
        elif not self.flushed.wait(_FLUSH_TIMEOUT_S):
            fail("generate_batch", f"the generation loop to end within {_FLUSH_TIMEOUT_S:.0f} s after "
                 "generate_batch returned", "a loop still running: its traces are not handed over",
                 what="state")  # fmt: skip
        error, self.error = self.error, None
        if error is not None:
            raise error


# -------------------------------------------------------------------- the session's side


def _find(engine: Any, cache: Any) -> Optional[PagedCapture]:
    """The capture of the manager whose paged cache is ``cache``."""
    for paged in engine.paged:  # (only the main thread changes the list: attach)
        if paged.cache is not None and paged.cache() is cache:
            return paged
    return None


def _refuse_replay(engine: Any) -> None:
    if engine.replay.table is not None:
        fail(
            "replay",
            "off during continuous batching (generate_batch, init_continuous_batching): replay matches "
            "whole sequences, which a packed, chunked forward does not hold (rollout mode pauses it there)",
            "a replay set (set_replay / replaying)",
            what="mode",
        )


def _refuse_weights(engine: Any) -> None:
    """Full recall (capture of the combine weights) is not wired into this path: refused, not dropped."""
    if (engine.capture.on and engine.capture.user_weights) or (
        engine.rollout_mode and engine.rollout_weights
    ):
        fail("set_capture", "weights=False (and rollout replay of ids) under continuous batching, whose "
             "capture records expert ids only", "a capture of the combine weights", what="mode")  # fmt: skip


def plan_paged_step(engine: Any, kwargs: dict, num_tokens: int, graphed: bool) -> Step:
    """The :class:`~replaymoe.hf.step.Step` of a continuous-batching forward of ``num_tokens``
    packed tokens: the capture slab of its manager when that manager captures, no replay."""
    _refuse_replay(engine)
    paged = _find(engine, kwargs["cache"])
    staged = None
    if paged is not None and paged.capturing:
        staged = paged.staged(num_tokens)
    elif paged is None and engine.capture.on:
        fail("init_continuous_batching", "a continuous-batching manager made on the patched model (after "
             "replaymoe.hf.enable)", "a forward of a manager made before it", what="state")  # fmt: skip
    return Step(num_tokens, None, staged, None, graphed)


def attach(engine: Any, manager: Any) -> Optional[PagedCapture]:
    """The manager's capture (hooks installed at first sight), capturing when capture is on."""
    paged = manager.__dict__.get(_ATTR)
    if paged is None or paged.engine is not engine:
        missing = missing_internals(manager)
        if missing:
            if engine.capture.on:
                _fail_internals(missing)
            return None
        paged = PagedCapture(engine, manager)
        paged.install(manager)
        engine.paged = [p for p in engine.paged if p.manager() is not None] + [paged]  # dead ones pruned
    if engine.capture.on and not paged.capturing:
        paged.start_capturing(manager)
    return paged


def paged_init(engine: Any, init: Callable) -> Callable:
    """``model.init_continuous_batching`` (the entry of ``generate_batch`` and of the manager API)
    that sets the manager up for capture; replay is refused, and so is the manager API in rollout
    mode (its round is a ``generate_batch`` call)."""

    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if engine.enabled:
            _refuse_replay(engine)
            _refuse_weights(engine)
            if engine.rollout_mode and engine.paged_call is None:
                fail("init_continuous_batching", "generate_batch in rollout mode (a round is one "
                     "generate / generate_batch call)", "the manager API", what="mode")  # fmt: skip
            if engine.capture.on and engine.capture.buffer is not None and engine.paged_call is None:
                engine.capture.harvest(3)  # earlier forwards' traces come first
        manager = init(*args, **kwargs)
        paged = attach(engine, manager) if engine.enabled else None
        if paged is not None and engine.paged_call is not None:
            paged.thread = None
            engine.paged_call.append(paged)
        return manager

    return wrapped


def paged_generate_batch(engine: Any, generate_batch: Callable) -> Callable:
    """``model.generate_batch`` that is a ``generate`` call to the session (a rollout round in
    rollout mode) and returns once its traces are in the session."""

    @functools.wraps(generate_batch)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        busy = engine.capture.on or engine.rollout_mode or engine.replay.table is not None
        if not (engine.enabled and busy):
            return generate_batch(*args, **kwargs)
        if not engine.rollout_mode:  # (rollout mode pauses its replay inside the call)
            _refuse_replay(engine)
        _refuse_weights(engine)
        if engine.capture.buffer is not None and not engine.rollout_mode:
            engine.capture.harvest(3)  # earlier forwards' traces come first
        pending = engine.capture.begin_pending
        engine.generate_begin(1)  # (continuous batching has no beam search)
        engine.capture.begin_pending = pending  # (no forward of this call starts a batch there)
        calls: list[PagedCapture] = []
        engine.paged_call = calls  # the managers this call makes (paged_init)
        out = None
        try:
            out = generate_batch(*args, **kwargs)
        finally:
            engine.paged_call = None
            try:
                for paged in calls:
                    paged.wait_flushed()
            finally:
                engine.generate_end(out)
        return out

    return wrapped

"""The patched model: routers through :func:`replaymoe.routing.route`, capture and replay state.

Per forward, a pre-forward hook on the decoder stack computes every token's position on the device
(:mod:`replaymoe.hf.positions`), gathers the forced ids of all MoE layers at once (replay) and
allots each token a slot of the capture buffer (capture); each router then routes with one
``route`` call that writes its ids into a per-forward staging slab, and a forward hook copies the
slab into the capture buffer with one indexing op. Nothing in a forward reads the device from the
host, so the patched model runs eagerly, under ``torch.compile(fullgraph=True)``, with
``generate(cache_implementation="static")`` and in CUDA graphs.

Size: over 600 lines (about 1000); :class:`ReplayMoE` is one unit (its hooks share the per-forward state that
capture and replay fill), and :func:`enable` documents every option of it.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from replaymoe._backend import BACKENDS
from replaymoe._validation import check_bool, check_choice, check_int, fail, is_capturing
from replaymoe.record.replay import MISSING_MODES
from replaymoe.record.trace import RoutingFingerprint
from replaymoe.routing import RoutingConfig, route

from .aux_loss import install as install_aux_loss
from .aux_loss import target_modules
from .discovery import MoELayerInfo, find_moe_layers
from .experts import IMPLEMENTATION_NAME, fused_compatible, register
from .graphs import BlockGraphs, graphable
from .patches import block_forward, mark_batch_start, refuse_paged, router_forward
from .positions import cache_length, token_positions
from .recompute import MISSING, RecomputeBindings, find_in_checkpoint, unwrap_checkpoint
from .state import CaptureBuffer, ReplayTable, TraceMeta
from .static_cache import StaticCacheKeeper
from .step import DecodeChain, Step, StepBuffers, fused_rows_ok, positions_bound, step_rows

__all__ = ["ReplayMoE", "enable"]


class ReplayMoE:
    """Handle returned by :func:`enable`: the patched model's capture/replay state.

    Attributes
    ----------
    model : nn.Module
        The patched model.
    layers : list[MoELayerInfo]
        Its MoE blocks; ``layer_ids`` = their decoder layer numbers.
    num_experts, top_k : int
        Shared by all MoE layers.
    backend : str
        ``"auto"`` | ``"triton"`` | ``"torch"`` for routing and fused experts.
    graphs : bool
        Eager decode-size forwards run the fused MoE blocks as CUDA graphs (:mod:`replaymoe.hf.graphs`).
    device_decode : bool
        Decode steps inside ``generate`` advance their capture/replay rows on the device, in the first
        MoE block's CUDA graph (:class:`~replaymoe.hf.step.DecodeChain`; ``enable(...,
        device_decode=)``, default True); False launches the bookkeeping kernel on every forward.
        Both give the same traces and replays.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        experts: bool = True,
        max_batch_size: int = 1,
        max_positions: int = 256,
        graphs: bool = True,
        keep_static_cache: bool = True,
        device_decode: bool = True,
    ) -> None:
        check_choice("backend", backend, BACKENDS)
        check_bool("device_decode", device_decode)
        check_bool("graphs", graphs)
        check_bool("keep_static_cache", keep_static_cache)
        check_int("max_batch_size", max_batch_size, low=1)
        check_int("max_positions", max_positions, low=1)
        if getattr(model, "_replaymoe", None) is not None:
            fail("model", "a model without replaymoe enabled (call .disable() first)", "already enabled")
        self.model = model
        self.backend = backend
        self.graphs = graphs
        self.layers = find_moe_layers(model)
        ks = {info.plan.top_k for info in self.layers}
        es = {int(info.router.num_experts) for info in self.layers}
        if len(ks) != 1 or len(es) != 1:
            fail("model", "the same top_k and num_experts in every MoE layer", f"top_k {ks}, experts {es}")
        self.top_k, self.num_experts = ks.pop(), es.pop()
        self.layer_ids = [info.layer_number for info in self.layers]
        config = getattr(model, "config", None)
        self.model_id = str(getattr(config, "_name_or_path", "") or "") or str(
            getattr(config, "model_type", type(model).__name__)
        )
        self._meta = TraceMeta(
            len(self.layers), self.top_k, self.num_experts, tuple(self.layer_ids), self.model_id
        )
        self._capacity = (max_batch_size, max_positions)
        self._step: Optional[Step] = None
        self._capture: Optional[CaptureBuffer] = None  # allocated by set_capture(True)
        self._capturing = False
        self._begin_pending = False  # generate() was called: its first forward starts a batch
        self._finished: list = []  # RoutingTrace, harvested but not yet returned by traces()
        self._replay: Optional[ReplayTable] = None  # the active table
        self._tables: list[ReplayTable] = []  # pool (see _spare_table)
        self._bindings = RecomputeBindings()  # replay ids of live forwards, for checkpoint recomputes
        self._prev_impl: Optional[str] = None
        self._block_graphs: list[BlockGraphs] = []
        self._graphs_on = False  # some block runs through BlockGraphs
        self._step_buffers = StepBuffers(len(self.layers), self.top_k)
        self._decode = DecodeChain(self._step_buffers)  # decode steps whose rows advance on the device
        self.device_decode = device_decode
        self._generation: Optional[int] = None  # set inside generate(): which call it is
        self._generate_calls = 0
        self._outer_generation: list[Optional[int]] = []  # generate() calls nest (e.g. assisted decoding)
        self._hooks: list[Any] = []
        self._rollout_mode = False  # set_rollout_replay: generate() captures, other forwards replay
        self._rollout: list = []  # the traces of the current rollout round
        self._rollout_stale = False  # a forward ran since the last generate: the next one starts a round
        self._user_capturing = False  # capture as set_capture left it (rollout mode turns it on in generate)
        self._kept = 0  # rollout mode: traces in _finished before the current generate call
        self._replay_before: Optional[ReplayTable] = None  # rollout mode: the table before generate
        self._children: list[tuple[ReplayMoE, bool]] = []  # attach(): (session, replays)
        self._mismatch: Optional[torch.Tensor] = None  # int64 [L, 3] (see track_mismatch)
        self._used: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # replayed forward: logits, ids
        self._aux_uninstall: list = []
        self._rollout_missing = "error"  # set_rollout_replay(missing=): the round's replay
        self._enabled = True  # until disable()
        self._patch(experts, keep_static_cache)
        model._replaymoe = self

    @property
    def fingerprint(self) -> RoutingFingerprint:
        """This model's routing (model id, MoE layer numbers, experts, top-k): what a replayed trace's
        :attr:`~replaymoe.record.trace.RoutingTrace.fingerprint` must match."""
        return RoutingFingerprint(
            self.model_id, tuple(self.layer_ids), len(self.layers), self.num_experts, self.top_k
        )

    def _require_enabled(self, call: str) -> None:
        """Raise when :meth:`disable` turned this handle off: nothing it would do could take effect."""
        if not self._enabled:
            fail(
                call,
                "a handle of a model with replaymoe enabled (replaymoe.hf.enable(model) again)",
                "a handle turned off by disable(): the model routes natively and captures nothing",
                what="state",
            )

    # ---------------------------------------------------------------- patching
    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:  # pragma: no cover - a model without parameters has no MoE layers
            return torch.device("cpu")

    def _patch(self, experts: bool, keep_static_cache: bool) -> None:
        config = getattr(self.model, "config", None)
        switch = (
            experts
            and config is not None
            and hasattr(self.model, "set_experts_implementation")
            and any(fused_compatible(info.experts) for info in self.layers)
        )
        pool: list = []  # one CUDA-graph memory pool for all blocks, made at the first capture
        for info in self.layers:
            fused = switch and fused_compatible(info.experts)
            info.router.forward = types.MethodType(router_forward(self, info, fused), info.router)
            info.experts._replaymoe_backend = self.backend
            for module, is_block in ((self._decoder_layer(info), False), (info.block, True)):
                if module is not None:
                    hook = module.register_forward_pre_hook(
                        self._binding_hook(info, is_block), with_kwargs=True
                    )
                    self._hooks.append(hook)
            if self.graphs and fused and self.backend != "torch" and info.block is not None:
                graphs = BlockGraphs(info.block, info.block.forward, pool)
                self._block_graphs.append(graphs)
                info.block.forward = block_forward(self, graphs)
        self._graphs_on = bool(self._block_graphs)
        if switch:
            register()  # idempotent: "replaymoe" in transformers' experts registry
            self._prev_impl = config._experts_implementation
            self.model.set_experts_implementation(IMPLEMENTATION_NAME)
        # the aux loss of a replayed forward: the used ids. The provider holds the session weakly, and
        # a session collected without disable() takes its providers out (no module keeps it alive)
        ref = weakref.ref(self)

        def aux_ids(gate_logits: Any) -> Optional[list]:
            session = ref()
            return None if session is None else session._aux_ids(gate_logits)

        for module in target_modules(self.model):
            uninstall = install_aux_loss(module, aux_ids)
            self._aux_uninstall.append(uninstall)
            weakref.finalize(self, uninstall)
        stack = getattr(self.model, "base_model", self.model)
        self._hooks.append(stack.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._hooks.append(
            stack.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        )
        self._static_cache = StaticCacheKeeper(self.model, install=keep_static_cache)
        if hasattr(self.model, "generate"):
            self.model.generate = mark_batch_start(self, self.model.generate)
        if hasattr(self.model, "init_continuous_batching"):
            self.model.init_continuous_batching = refuse_paged(self, self.model.init_continuous_batching)

    def _decoder_layer(self, info: MoELayerInfo) -> Optional[nn.Module]:
        """The decoder layer holding ``info``'s MoE block (None for a block at the model's root)."""
        if "." not in info.name:
            return None
        return self.model.get_submodule(info.name.rsplit(".", 1)[0])

    def _binding_hook(self, info: MoELayerInfo, is_block: bool) -> Any:
        """Pre-hook of a MoE decoder layer (or block): in the model's forward with gradients on,
        bind this layer's replay ids to its input; outside it (an activation-checkpoint recompute),
        find them again (:mod:`replaymoe.hf.recompute`)."""
        index = info.index

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch.compiler.is_compiling():
                return
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                return
            step = self._step
            if step is None:
                self._bindings.lookup(index, hidden, overwrite=not is_block)
            elif torch.is_grad_enabled() or module.training:  # (reentrant checkpoints run under no_grad)
                self._bindings.bind(index, hidden, None if step.forced is None else step.forced[index])
                if not is_block:  # transformers >= 5.23 recomputes the bare forward, without this hook
                    find_in_checkpoint(module, find)

        def find(hidden: torch.Tensor) -> None:  # a run of the layer's checkpointed forward
            if self._step is None:  # outside the model's forward: a recompute
                self._bindings.lookup(index, hidden, overwrite=True)

        return hook

    def disable(self) -> None:
        """Undo :func:`enable`: original routers and experts implementation, hooks removed (attached
        models too). The handle is off after it: :meth:`set_capture`, :meth:`set_replay`,
        :meth:`replaying`, :meth:`set_rollout_replay`, :meth:`traces` and :meth:`attach` raise.
        Captured traces not yet read with :meth:`traces` are dropped with a warning."""
        if not self._enabled:
            return
        unread = ""
        try:
            if self._capture is not None and self._capture.device.type != "meta":
                self._harvest()
        except ValueError as exc:  # (e.g. an overflowed compiled capture): the patch goes all the same
            unread = f"; the capture buffer could not be read: {exc}"
        if self._finished or unread:
            warnings.warn(
                f"replaymoe: disable() drops {len(self._finished)} captured trace(s) that traces() "
                f"never returned{unread}; call traces() first to keep them",
                RuntimeWarning,
                stacklevel=2,
            )
            self._finished = []
        self._enabled = False
        for child, _ in self._children:
            child.disable()
        self._children.clear()
        for uninstall in self._aux_uninstall:
            uninstall()
        self._aux_uninstall.clear()
        self._used.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for info in self.layers:
            layer = self._decoder_layer(info)
            if layer is not None:
                unwrap_checkpoint(layer)
        for info in self.layers:
            info.router.__dict__.pop("forward", None)
            info.experts.__dict__.pop("_replaymoe_backend", None)
            if info.block is not None:
                info.block.__dict__.pop("forward", None)
        for graphs in self._block_graphs:
            graphs.clear()
        self._block_graphs.clear()
        self._graphs_on = False
        self._step_buffers.clear()
        self.model.__dict__.pop("generate", None)
        self.model.__dict__.pop("init_continuous_batching", None)
        self._static_cache.uninstall()
        if self._prev_impl is not None:
            self.model.set_experts_implementation(self._prev_impl)
        self.model._replaymoe = None
        self._step = None

    def release_static_cache(self) -> None:
        """Free the static KV cache kept across ``generate(cache_implementation="static")`` calls
        (``enable(..., keep_static_cache=True)``), e.g. before a training step; the next such
        ``generate`` makes a new one (and records its decode step's CUDA graphs again)."""
        self._static_cache.release()

    # ---------------------------------------------------------------- forward context
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if ref is None or ref.dim() < 2:
            self._decode.reset()
            self._step = None
            return
        B, S = ref.shape[0], ref.shape[1]
        if not torch.compiler.is_compiling():
            self._raise_uncovered(block=False)  # an earlier forward's, once its counters reached the host
            self._used = {}
            self._follow_device(ref.device)
            if self._rollout_mode and self._generation is None:
                self._rollout_stale = True
        graphed = not torch.compiler.is_compiling() and self._graphs_on and graphable(B * S, ref.device)
        if self._replay is None and not self._capturing:
            self._decode.reset()
            self._step = Step(B * S, None, None, None, graphed)
            return
        # transformers >= 5.24 names the cache `cache` and, in generate, passes no attention mask: the
        # padding is in the position ids (a pad token starts a sequence of its own)
        cache, cache_kw = kwargs.get("past_key_values"), False
        if cache is None and kwargs.get("cache") is not None:
            cache, cache_kw = kwargs["cache"], True
        past = cache_length(cache)
        mask, eager = kwargs.get("attention_mask"), not torch.compiler.is_compiling()
        # replay matched by content: whole sequences (no cache) of traces that carry their tokens
        content = (
            self._replay is not None
            and self._replay.by_content
            and input_ids is not None
            and isinstance(past, int)
            and past == 0
        )
        # eagerly, with a 2-D mask: positions, capture rows and replay ids in one kernel launch
        fused = eager and not content and fused_rows_ok(mask, S, past, ref.device, self.backend)
        if not fused:
            positions = token_positions(
                B,
                S,
                attention_mask=mask,
                past_length=past,
                device=ref.device,
                position_ids=kwargs.get("position_ids"),
                padding_in_positions=cache_kw and mask is None,
            )
        forced = forced_out = staged = slot = None
        if self._replay is not None:
            if not content and self._replay.batch_size != B:
                fail(
                    "replay",
                    f"one trace per batch row ({B} rows in this forward), or traces that carry their "
                    "tokens (captured by replaymoe) for forwards over whole sequences (no KV cache), "
                    "which are matched to rows by content",
                    f"{self._replay.batch_size} trace(s)",
                )
            forced_out = self._step_buffers.get("forced", B * S, torch.int32, ref.device) if graphed else None
            if content:
                tokens = input_ids.to(device=ref.device, dtype=torch.int64)
                forced = self._replay.gather_by_content(tokens, positions, out=forced_out)
            elif not fused:
                forced = self._replay.gather(positions, out=forced_out)
        if self._capturing:
            cap = self._capture
            needed = positions_bound(cache, past, S) if eager else None
            cap.prepare(B, past, needed, new_batch=self._begin_pending, eager=eager)
            self._begin_pending = False
            if not fused:
                slot = cap.slots(positions, check_overflow=not eager or needed is None)
            if graphed:
                staged = self._step_buffers.get("staged", B * S, torch.int16, ref.device)
            else:
                staged = torch.empty(
                    (len(self.layers), B * S, self.top_k), dtype=torch.int16, device=ref.device
                )
        head = None
        if fused:
            cap, rep = (self._capture if self._capturing else None), self._replay
            if graphed and self.device_decode:  # a decode step continuing the chain: no launch here
                P = mask.shape[1]
                head = self._decode.head(self._generation, B, S, P, past, cap, rep, staged, forced_out)
            if head is not None:
                if cap is not None:
                    cap.take_pending()  # the head writes it, inside the first MoE block
                slot, forced = head.slot, forced_out
            elif graphed:
                slot_out, next_pos = self._decode.outputs(B * S, B, ref.device, cap)
                slot, forced = step_rows(mask, S, past, capture=cap, replay=rep, forced_out=forced_out,
                                         slot_out=slot_out, next_pos_out=next_pos)  # fmt: skip
                self._decode.served(self._generation, B, mask.shape[1], past + S, slot)
            else:
                self._decode.reset()
                slot, forced = step_rows(mask, S, past, capture=cap, replay=rep, forced_out=forced_out)
        else:
            self._decode.reset()
        tokens = None
        if self._capturing and input_ids is not None:
            tokens = input_ids.reshape(-1).to(device=ref.device, dtype=torch.int64)
        coverage = None
        if self._replay is not None and self._replay.missing == "error":
            # the step bookkeeping kernel counts uncovered lookups itself (positions None)
            coverage = (self._replay, content, None if fused else positions)
        self._step = Step(B * S, forced, staged, slot, graphed, fused, head, tokens, coverage)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step, self._step = self._step, None
        if step is not None and step.head is not None:  # no router ran (the forward failed before)
            step.head.launch()  # it still writes the previous step's pending capture rows
        if step is not None and step.tokens is not None and step.slot is not None and output is not None:
            self._capture.write_tokens(step.slot, step.tokens)
        if step is not None and step.staged is not None and output is not None:
            if step.defer_commit:  # eager, step_rows took this forward: its next launch commits
                self._capture.defer(step.staged, step.slot)
            else:
                self._capture.commit(step.staged, step.slot)
        if step is not None and step.coverage is not None and step.forced is not None and output is not None:
            self._count_uncovered(step)

    def _follow_device(self, device: torch.device) -> None:
        """Move the capture buffer and the replay table to where the forward runs, when the model
        moved since they were made (``enable`` on a meta-device model, then ``to_empty`` / ``.to()``,
        FSDP2): replaymoe's state follows the model and is never part of its ``state_dict``."""
        cap = self._capture
        if cap is not None and cap.device != device:
            if cap.device.type != "meta":
                self._harvest()
            self._capture = CaptureBuffer(self._meta, device, *self._capacity)
        rep = self._replay
        if rep is not None and rep.source is not None and rep.table.device != device:
            rep.load(*rep.source, device)

    # ---------------------------------------------------------------- capture
    def set_capture(self, enabled: bool) -> None:
        """Turn capture on or off (traces captured so far stay available).

        Turning it on allocates the device buffer (``enable``'s ``max_batch_size`` x
        ``max_positions``; it grows at eager forwards as needed).
        """
        check_bool("enabled", enabled)
        if enabled:
            self._require_enabled("set_capture")
        if enabled and self._capture is None:
            self._capture = CaptureBuffer(self._meta, self._device(), *self._capacity)
        if not enabled and self._capture is not None:
            self._harvest()
        self._capturing = self._user_capturing = enabled

    # ---------------------------------------------------------------- rollout replay (R3)
    def set_rollout_replay(self, enabled: bool, *, missing: str = "error") -> None:
        """Rollout routing replay without glue: every ``generate`` call captures (replay paused
        inside it), and every other forward replays the traces of the latest rollout round, matched
        to rows by content (any order, subset, chunking or padding of the rollout's rows; see
        :meth:`set_replay`). A round is the ``generate`` calls since the last forward outside
        ``generate``: the first ``generate`` after such a forward starts a new one. Turning it off
        stops replaying. Attached models (:meth:`attach`) replay the same traces.

        ``missing`` is :meth:`set_replay`'s: whether a token the round's traces do not cover raises
        (``"error"``, the default) or routes natively (``"native"``, counted in :meth:`report`).
        """
        check_bool("enabled", enabled)
        check_choice("missing", missing, MISSING_MODES)
        if enabled:
            self._require_enabled("set_rollout_replay")
        self._rollout_missing = missing
        self._rollout_mode = enabled
        self._rollout_stale = False
        if not enabled:
            self._rollout = []
            self.set_replay(None)

    def rollout_traces(self) -> list:
        """The traces of the current rollout round (:meth:`set_rollout_replay`), one per generated row."""
        return list(self._rollout)

    def add_rollout_traces(self, traces: Sequence[Any]) -> None:
        """Rollout mode: add traces that another engine recorded (e.g. vLLM's ``routed_experts``,
        :func:`replaymoe.integrations.vllm_outputs.traces_from_vllm_outputs`) to the current round, as
        if this model's ``generate`` had captured them; the following forwards replay them (matched
        by content) together with the round's other traces.

        Parameters
        ----------
        traces : sequence of RoutingTrace
            Each from position 0 (``token_offset == 0``) with its ``token_ids``, this model's
            ``top_k``, ``num_experts`` and MoE layers.

        Raises
        ------
        ValueError
            When rollout mode is off, a trace has no token ids or does not start at position 0, or
            the traces do not fit the model (:meth:`set_replay`).
        """
        from replaymoe.record.trace import RoutingTrace

        self._require_enabled("add_rollout_traces")
        if not self._rollout_mode:
            fail("set_rollout_replay", "on (set_rollout_replay(True)) before add_rollout_traces", "off")
        traces = list(traces)
        for i, trace in enumerate(traces):
            if not isinstance(trace, RoutingTrace):
                fail(f"traces[{i}]", "a RoutingTrace", type(trace).__name__, what="type")
            if trace.token_ids is None or trace.token_offset != 0:
                fail(
                    f"traces[{i}]",
                    "a trace from position 0 with its token_ids (rows are matched by content)",
                    f"token_offset {trace.token_offset}, token_ids "
                    f"{'None' if trace.token_ids is None else 'given'}",
                )
        if not traces:
            return
        if self._rollout_stale:  # a forward ran since the last rollout: this starts a new round
            self._rollout, self._rollout_stale = [], False
        self.set_replay(self._rollout + traces, missing=self._rollout_missing)  # (checked before it is kept)
        self._rollout.extend(traces)

    # ---------------------------------------------------------------- patches.SessionHooks
    @property
    def step(self) -> Optional[Step]:
        """The current forward of the decoder stack, or None outside it."""
        return self._step

    def paged_generation_allowed(self) -> bool:
        return not (self._capturing or self._rollout_mode or self._replay is not None)

    def generate_begin(self) -> None:
        """``generate`` was called: a new capture batch starts at its first forward (so batches are
        kept apart on the host even when the cache's length lives on the device); in rollout mode,
        capture on and replay paused."""
        self._rollout_generate_begin()
        self._begin_pending = True
        self._generate_calls += 1
        self._outer_generation.append(self._generation)
        self._generation = self._generate_calls  # (the decode steps' chain)

    def generate_end(self, out: Any) -> None:
        """``generate`` returned ``out`` (None if it raised): the last forward's deferred capture commit
        is written (none outlives the call: a compiled forward after it never finds one), the kept
        static cache goes if the call returned it, and in rollout mode the round's traces replay."""
        if out is not None:
            self._static_cache.release_if_returned(out)
        self._generation = self._outer_generation.pop()
        self._decode.reset()
        if self._capture is not None:
            self._capture.flush()
        self._rollout_generate_end()
        if out is not None:  # (a failed call's own error goes first)
            self._raise_uncovered()

    def routed(self, info: MoELayerInfo, logits: torch.Tensor, replay_ids: Optional[torch.Tensor],
               used: torch.Tensor, routing: RoutingConfig) -> None:  # fmt: skip
        """A router call with ``replay_ids`` used ``used``: kept for this forward's aux loss, and counted
        (:meth:`track_mismatch`); recomputes (outside the model's forward) are not."""
        if replay_ids is None or self._step is None or torch.compiler.is_compiling():
            return
        self._used[info.index] = (logits, used)
        if self._mismatch is not None:
            self._count_mismatch(info.index, logits, replay_ids, used, routing)

    def layer_io(self, info: MoELayerInfo, num_tokens: int) -> tuple[Any, Any]:
        """(replay ids int32 [T, K] or None, capture slab int16 [T, K] or None) for one router call."""
        return self._layer_io(info, num_tokens)

    # ---------------------------------------------------------------- rollout replay internals
    def _rollout_generate_begin(self) -> None:
        if not self._rollout_mode:
            return
        self._raise_uncovered()  # the round that ends: its replayed forwards' coverage
        if self._rollout_stale:
            self._rollout, self._rollout_stale = [], False
        if self._capture is not None:
            self._harvest()  # what the user captured before stays theirs
        self._kept = len(self._finished)
        self._replay_before = self._replay
        self._set_replay_table(None)  # the rollout routes natively
        if self._capture is None:
            self._capture = CaptureBuffer(self._meta, self._device(), *self._capacity)
        self._capturing = True

    def _rollout_generate_end(self) -> None:
        if not self._rollout_mode:
            return
        self._harvest()
        new = self._finished[self._kept :]
        if not self._user_capturing:
            del self._finished[self._kept :]
        self._capturing = self._user_capturing
        self._set_replay_table(self._replay_before)
        self._rollout.extend(new)
        if self._rollout:
            self.set_replay(self._rollout, missing=self._rollout_missing)

    def _set_replay_table(self, table: Optional[ReplayTable]) -> None:
        self._replay = table
        for child, replays in self._children:
            if replays:
                child._set_replay_table(None if table is None else child._replay_for(table))

    def _replay_for(self, table: ReplayTable) -> Optional[ReplayTable]:
        """This (attached) session's table holding what ``table`` of its parent holds."""
        if table.source is None:
            return None
        mine = self._replay if self._replay is not None else self._spare_table(exclude=None)
        if mine.holds(*table.source, self._device()):  # (replaying() around every step: no reload)
            mine.reset_report()
        else:
            mine.load(*table.source, self._device())
        mine.missing = table.missing
        return mine

    # ---------------------------------------------------------------- reference models
    def attach(self, model: nn.Module, *, replay: bool = True) -> ReplayMoE:
        """Patch another model of the same architecture (e.g. RL's reference model) under this handle.

        With ``replay=True`` it replays whatever this model replays (:meth:`set_replay`,
        :meth:`replaying`, :meth:`set_rollout_replay`), matched to its rows the same way;
        ``replay=False`` leaves its routing native. It never captures. :meth:`disable` undoes both.

        Returns
        -------
        ReplayMoE
            The attached model's own handle (for :meth:`report`).
        """
        check_bool("replay", replay)
        self._require_enabled("attach")
        child = ReplayMoE(model, backend=self.backend, graphs=self.graphs)
        if (child.top_k, child.num_experts, child.layer_ids) != (
            self.top_k,
            self.num_experts,
            self.layer_ids,
        ):
            child.disable()
            want = f"the policy's MoE layers ({self.layer_ids}, top-{self.top_k} of {self.num_experts})"
            fail("model", want, f"{child.layer_ids}, top-{child.top_k} of {child.num_experts}")
        self._children.append((child, replay))
        if replay and self._replay is not None:
            child._set_replay_table(child._replay_for(self._replay))
        return child

    # ---------------------------------------------------------------- aux loss
    def _aux_ids(self, gate_logits: Any) -> Optional[list]:
        """The load-balancing loss's provider (:mod:`replaymoe.hf.aux_loss`): for the router logits
        of this model's latest replayed forward (matched by identity), the ids its routers used;
        None otherwise (transformers' own function runs)."""
        used = self._used
        if not isinstance(gate_logits, (tuple, list)) or len(gate_logits) != len(self.layers) or not used:
            return None
        if len(used) != len(self.layers) or any(gate_logits[i] is not used[i][0] for i in range(len(used))):
            return None
        return [used[i][1] for i in range(len(used))]

    # ---------------------------------------------------------------- routing mismatch
    def track_mismatch(self, enabled: bool = True) -> None:
        """Count, per MoE layer, replayed tokens whose native top-k (this model's router now) differs
        from the rollout's ids, and those whose used ids differ from the rollout's (always 0 unless
        replay is broken). Costs one extra routing per replayed layer call; read with
        :meth:`mismatch`."""
        check_bool("enabled", enabled)
        self._mismatch = (
            torch.zeros(len(self.layers), 3, dtype=torch.int64, device=self._device()) if enabled else None
        )

    def _count_mismatch(self, index: int, logits: torch.Tensor, forced: torch.Tensor, used: torch.Tensor,
                        routing: RoutingConfig) -> None:  # fmt: skip
        if self._mismatch is None:
            return
        if self._mismatch.device != logits.device:
            self._mismatch = self._mismatch.to(logits.device)
        with torch.no_grad():
            native = route(logits.detach(), routing=routing, backend=self.backend).topk_ids
            replayed = forced[:, 0] >= 0
            want = torch.sort(forced.long(), dim=1).values
            differs_native = (torch.sort(native.long(), dim=1).values != want).any(dim=1) & replayed
            differs_used = (torch.sort(used.long(), dim=1).values != want).any(dim=1) & replayed
            row = torch.stack([replayed.sum(), differs_native.sum(), differs_used.sum()])
            self._mismatch[index].add_(row)

    def mismatch(self, *, reset: bool = True) -> dict:
        """Routing agreement since the last call (one host sync): ``tokens`` replayed token-layer
        lookups, ``native_vs_rollout`` the fraction whose native top-k differs from the rollout's,
        ``replayed_vs_rollout`` the fraction whose used ids differ (0.0 when replay holds)."""
        if self._mismatch is None:
            fail("track_mismatch", "on (call track_mismatch() first)", "off", what="state")
        self._raise_uncovered()
        n, native, used = (int(v) for v in self._mismatch.sum(dim=0).tolist())
        if reset:
            self._mismatch.zero_()
        return {
            "tokens": n,
            "native_vs_rollout": native / n if n else 0.0,
            "replayed_vs_rollout": used / n if n else 0.0,
        }

    def _harvest(self) -> None:
        traces, lost = self._capture.harvest()
        self._finished.extend(traces)
        if lost:
            warnings.warn(
                f"replaymoe: {lost} captured batch(es) were overwritten before traces() was called "
                "(batches begun inside a compiled forward cannot be kept on the host side); call "
                "traces() after each compiled forward or generate",
                RuntimeWarning,
                stacklevel=3,
            )

    def traces(self, num_positions: Sequence[int] | None = None) -> list:
        """All sequences captured since the last call, one ``RoutingTrace`` each, in (batch, row) order.

        A forward with an empty cache (``generate``'s prefill, a training forward) or a call of
        ``generate`` starts a new batch; its row ``b`` is one sequence (a row that was all padding
        gives an empty trace). Positions are unpadded; the trace covers every position that went
        through the model. This is the one host synchronisation of capture.

        Parameters
        ----------
        num_positions : sequence of int, optional
            One length per returned trace: each trace is cut to (or padded with -1 to) that many
            positions. ``generate`` keeps feeding pad tokens, with attention mask 1, to rows that
            already reached EOS, and those positions are captured too; pass
            ``len(prompt) + len(completion up to and including EOS) - 1`` per row to drop them.
        """
        self._require_enabled("traces")
        self._raise_uncovered()
        if self._capture is not None:
            self._harvest()
        out, self._finished = self._finished, []
        if num_positions is None:
            return out
        if len(num_positions) != len(out):
            self._finished = out  # nothing is lost on a bad call
            fail("num_positions", f"{len(out)} lengths (one per trace)", len(num_positions))
        cut = []
        for trace, n in zip(out, num_positions):
            check_int("num_positions", n, low=0)
            ids = trace.ids[:n]
            if ids.shape[0] < n:
                pad = np.full((n - ids.shape[0], *ids.shape[1:]), -1, dtype=ids.dtype)
                ids = np.concatenate([ids, pad])
            cut.append(trace.replace(ids=ids))
        return cut

    # ---------------------------------------------------------------- replay
    def set_replay(self, replay: Any, *, missing: str = "error", check_model_id: bool = True) -> None:
        """Replay ``replay`` (``RoutingTrace``, list of them — one per batch row — or ``ReplaySource``;
        None stops replaying) in the following forwards.

        The traces are checked and copied to the device once, here; forwards then only gather.

        Parameters
        ----------
        replay : RoutingTrace, sequence of RoutingTrace, ReplaySource or None
            Matched to a forward's rows by content when every trace carries its ``token_ids`` from
            position 0 and the forward runs whole sequences (no KV cache); else trace ``b`` serves
            batch row ``b``.
        missing : {"error", "native"}
            A replayed forward must find a recorded route for every token, except padding and each
            sequence's last sampled token (never fed through the model that recorded the trace, so
            it has none: by batch row the position one past the trace, by content each row's last
            token). ``"error"`` (the default) raises ValueError naming the batch row, position and
            layer of a token without one (a position before the trace's start, past its end, or
            recorded as missing, e.g. a skipped prompt prefix). No forward waits for the device to
            check: each counts such lookups on the device (:meth:`ReplayTable.count_uncovered`). On
            the CPU the forward then raises itself. On CUDA an eager forward copies the counters
            to the host asynchronously and the next forward's start raises once the copy is done;
            at the latest (and for forwards compiled or captured in a CUDA graph) the next
            :meth:`traces`, :meth:`report`, :meth:`mismatch`, :meth:`set_replay`, end of
            :meth:`replaying` or of ``generate``, or rollout round raises (one host sync there).
            ``"native"`` routes such tokens natively and counts them in :meth:`report`.
        check_model_id : bool
            Refuse traces whose ``model_id`` is known and differs from this model's
            (:attr:`fingerprint`); False when routes recorded under another name (e.g. a served
            model's alias) are known to be this model's.

        Raises
        ------
        ValueError
            When the handle was disabled; when the traces' fingerprint differs from the model's
            (top_k, num_experts, MoE layers by ``layer_ids`` when the trace has them, else by count,
            model id unless ``check_model_id=False``); or a recorded row is not K distinct ids in
            ``[0, E)``.
        """
        self._raise_uncovered()
        if replay is None:
            self._set_replay_table(None)
            return
        self._require_enabled("set_replay")
        check_choice("missing", missing, MISSING_MODES)
        check_bool("check_model_id", check_model_id)
        from replaymoe.record.replay import ReplaySource

        src = replay if isinstance(replay, ReplaySource) else ReplaySource(replay)
        src.check_model(len(self.layers), self.top_k, self.num_experts)
        if src.traces[0].layer_ids is None:
            mapping = [info.index for info in self.layers]  # MoE order
        else:
            try:
                mapping = [src.layer_for_model_layer(info.layer_number) for info in self.layers]
            except ValueError as exc:
                fail(
                    "replay",
                    f"traces whose layer_ids are the model's MoE layers {self.layer_ids}",
                    f"layer_ids {list(src.traces[0].layer_ids)} ({exc})",
                    what="layers",
                )
        mine = self.fingerprint
        for i, trace in enumerate(src.traces):
            diff = trace.fingerprint.differences(mine, model_id=check_model_id)
            if diff:
                fail(
                    "replay",
                    f"traces of this model ({mine.model_id!r}: MoE layers {list(mine.layer_ids)}, top-"
                    f"{mine.top_k} of {mine.num_experts} experts; check_model_id=False when a differing "
                    "model id names the same model)",
                    f"traces[{i}] of another model: " + "; ".join(diff),
                    what="model",
                )
        table = self._replay if self._replay is not None else self._spare_table(exclude=None)
        if table.holds(src.traces, mapping, self._device()):  # the same traces again (e.g. replaying()
            table.reset_report()  # around every step): the table already holds them
        else:
            table.load(src.traces, mapping, self._device())
        table.missing = missing
        self._set_replay_table(table)

    def _spare_table(self, exclude: Optional[ReplayTable]) -> ReplayTable:
        """A pooled table other than ``exclude``: tables are reused, so that their buffers keep
        their shapes and addresses across batches (no recompile, no CUDA-graph re-record)."""
        for table in self._tables:
            if table is not exclude:
                return table
        table = ReplayTable()
        self._tables.append(table)
        return table

    @contextlib.contextmanager
    def replaying(
        self, replay: Any, *, missing: str = "error", check_model_id: bool = True
    ) -> Iterator[ReplayMoE]:
        """Context manager: :meth:`set_replay` (same arguments) inside, the previous replay restored
        after. Uncovered tokens of compiled forwards inside raise on the way out."""
        self._require_enabled("replaying")
        prev = self._replay
        self._replay = self._spare_table(exclude=prev)
        try:
            self.set_replay(replay, missing=missing, check_model_id=check_model_id)
            yield self
            self._raise_uncovered()
        finally:
            self._set_replay_table(prev)

    def report(self) -> Any:
        """Tokens replayed vs fallen back to native routing, per layer (``ReplayReport``), or None."""
        self._raise_uncovered()
        return None if self._replay is None else self._replay.report()

    def reset_report(self) -> None:
        """Start :meth:`report`'s counts again (the active replay's)."""
        if self._replay is not None:
            self._replay.reset_report()

    def _layer_names(self) -> list[str]:
        return [f"MoE layer {i} (model layer {n})" for i, n in enumerate(self.layer_ids)]

    def _raise_uncovered(self, *, block: bool = True) -> None:
        """Raise for the active replay's uncovered lookups since the last check
        (:meth:`ReplayTable.check_uncovered`): ``block`` reads the device counters (one host sync, at
        the user's calls: traces(), report(), set_replay, the end of replaying() or generate);
        otherwise only a finished asynchronous snapshot is read (the start of every eager forward)."""
        table = self._replay
        if table is not None and not torch.compiler.is_compiling() and not is_capturing():
            table.check_uncovered(self._layer_names(), block=block)

    def _count_uncovered(self, step: Step) -> None:
        """End of a replayed forward with ``missing="error"``: count the tokens that needed a recorded
        route and found none (:meth:`ReplayTable.count_uncovered`, device ops only, whichever
        producer wrote the forced ids), and, eagerly, start the counters' copy to the host that the
        next forward's start reads without waiting."""
        table, by_content, positions = step.coverage
        if positions is not None:
            table.count_uncovered(step.forced, positions, by_content=by_content)
        if torch.compiler.is_compiling() or is_capturing():
            return
        if table.uncovered.is_cuda:
            table.snapshot_uncovered()
        else:  # host memory: reading it waits for nothing, so this forward raises itself
            table.check_uncovered(self._layer_names(), block=True)

    # ---------------------------------------------------------------- per layer
    def _layer_io(self, info: MoELayerInfo, num_tokens: int) -> tuple[Any, Any]:
        """(replay ids int32 [T, K] or None, capture slab int16 [T, K] or None) for one router call."""
        step = self._step
        if step is None:
            # outside the model's forward: an activation-checkpoint recompute (the ids its forward
            # used, bound to the layer's input), or a direct call of the layer
            found = self._bindings.take(info.index)
            if found is not MISSING:
                if found is not None and found.shape[0] != num_tokens:
                    fail("hidden_states", f"{found.shape[0]} tokens (the recomputed forward's)",
                         f"{num_tokens} tokens at {info.name}", what="shape")  # fmt: skip
                return found, None
            if self._replay is not None or self._bindings.replayed_alive:
                fail(
                    "replay",
                    "MoE layers called inside the model's forward, or recomputed by activation "
                    "checkpointing from the inputs that forward saved (so that they route as it did)",
                    f"a call of {info.name} outside the model's forward that matches no forward with replay",
                    what="context",
                )
            return None, None
        if step.num_tokens != num_tokens:
            fail(
                "hidden_states",
                f"{step.num_tokens} tokens (batch x sequence of the model's forward)",
                f"{num_tokens} tokens at {info.name}",
                what="shape",
            )
        if step.head is not None:  # no MoE block wrapper ran it (e.g. a block called with more arguments)
            head, step.head = step.head, None
            head.launch()
        forced = None if step.forced is None else step.forced[info.index]
        staged = None if step.staged is None else step.staged[info.index]
        return forced, staged


def enable(
    model: nn.Module,
    *,
    capture: bool = False,
    replay: Any = None,
    missing: str = "error",
    # ReplayMoE's keywords spelled out: the public entry point's signature documents them
    backend: str = "auto",
    experts: bool = True,
    max_batch_size: int = 1,
    max_positions: int = 256,
    graphs: bool = True,
    keep_static_cache: bool = True,
    device_decode: bool = True,
) -> ReplayMoE:
    """Route a transformers MoE model through replaymoe, with optional capture and replay.

    Parameters
    ----------
    model : nn.Module
        A transformers model of a supported architecture (package docstring), patched in place.
    capture : bool
        Record every MoE layer's ids in every forward (``generate`` included); read them with
        :meth:`ReplayMoE.traces`.
    replay : RoutingTrace | list[RoutingTrace] | ReplaySource, optional
        Force these ids (batch row ``b`` = trace ``b``, or matched by content). Change later with
        :meth:`ReplayMoE.set_replay` or :meth:`ReplayMoE.replaying`.
    missing : {"error", "native"}
        With ``replay``: what a token the traces do not cover does (:meth:`ReplayMoE.set_replay`).
    backend : {"auto", "triton", "torch"}
        Routing and fused-experts backend: ``auto`` = Triton kernels on CUDA, torch references
        elsewhere.
    experts : bool
        Also switch the experts to ``experts_implementation="replaymoe"`` (when their layout fits).
    max_batch_size, max_positions : int
        Initial capacity of the capture buffer (batch rows x positions per sequence). It grows at
        eager forwards (a static cache's ``max_cache_len`` at its prefill); a forward traced by
        ``torch.compile`` cannot grow it, so give the capacity of compiled forwards here.
    graphs : bool
        Run each MoE block with fused experts as a CUDA graph in eager forwards of decode size
        (no gradient, at most ``replaymoe.hf.graphs.GRAPH_MAX_TOKENS`` tokens, CUDA): a block's
        graph is captured the second time an input shape is seen and replayed after, which takes
        its Python and launch overhead off the host. Same kernels, same results. ``False`` keeps
        every forward eager.
    keep_static_cache : bool
        Keep the KV cache of ``generate(cache_implementation="static")`` and reset it for the next
        call of the same batch size and length (transformers makes a new one per call; one that
        lands elsewhere makes the compiled decode step record its CUDA graphs again). Its memory
        stays allocated between calls: :meth:`ReplayMoE.release_static_cache` frees it.
    device_decode : bool
        Decode steps inside ``generate`` advance their capture and replay rows on the device, inside
        the first MoE block's CUDA graph (default); False launches the bookkeeping kernel on every
        forward instead. Both give the same traces and replays.

    Returns
    -------
    ReplayMoE
        The handle (also at ``model._replaymoe``); ``.disable()`` undoes the patch.

    Raises
    ------
    ValueError
        Unsupported architecture, bad backend, replay trace not matching the model (layers, top_k,
        num_experts).
    """
    check_bool("capture", capture)
    state = ReplayMoE(
        model,
        backend=backend,
        experts=experts,
        max_batch_size=max_batch_size,
        max_positions=max_positions,
        graphs=graphs,
        keep_static_cache=keep_static_cache,
        device_decode=device_decode,
    )
    try:
        state.set_capture(capture)
        if replay is not None:
            state.set_replay(replay, missing=missing)
    except Exception:
        state.disable()
        raise
    return state

"""The private collaborator of :class:`~replaymoe.hf.session.ReplayMoE`: the session's state and the
hooks its patches call.

Per forward, a pre-forward hook on the decoder stack computes every token's position on the device
(:mod:`replaymoe.hf.positions`), gathers the forced ids of all MoE layers at once (replay) and
allots each token a slot of the capture buffer (capture); each router then routes with one
``route`` call that writes its ids into a per-forward staging slab, and a forward hook copies the
slab into the capture buffer with one indexing op. Nothing in a forward reads the device from the
host, so the patched model runs eagerly, under ``torch.compile(fullgraph=True)``, with
``generate(cache_implementation="static")`` and in CUDA graphs.

The handle owns one :class:`Engine`; the patches (:mod:`replaymoe.hf._patching`) call it through
:class:`~replaymoe.hf.patches.SessionHooks`. Its capture and replay state live in
:class:`~replaymoe.hf._capture_state.CaptureState` and :class:`~replaymoe.hf._replay_state.ReplayState`,
the planning of one forward in :func:`~replaymoe.hf._forward.plan_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from replaymoe._validation import check_bool, check_choice, fail
from replaymoe.record.replay import MISSING_MODES, REPLAY_MODES
from replaymoe.record.replay.source import trace_list
from replaymoe.record.trace import RoutingFingerprint, RoutingTrace
from replaymoe.routing import RoutingConfig

from ._capture_state import CaptureState
from ._forward import plan_step
from ._patching import ModelPatch
from ._replay_state import ReplayState, model_device
from .discovery import MoELayerInfo
from .positions import forward_cache
from .recompute import MISSING, RecomputeBindings, drop_recompute_guard, guard_recomputes
from .state import ReplayTable, TraceMeta
from .step import DecodeChain, Step, StepBuffers

__all__ = ["Engine", "enabled_handle"]

_HANDLE = "_replaymoe"  # the model's attribute that holds its handle while replaymoe is enabled on it


def enabled_handle(model: nn.Module) -> Optional[object]:
    """The handle of the session enabled on ``model`` (``model._replaymoe``), or None."""
    return getattr(model, _HANDLE, None)


class Engine:
    """One session's state, and the hooks its patches call (:class:`~replaymoe.hf.patches.SessionHooks`).

    Attributes
    ----------
    model : nn.Module
        The patched model; ``layers`` its MoE blocks.
    backend : str
        Routing and fused-experts backend (``enable``'s).
    device_decode : bool
        Decode steps inside ``generate`` advance their rows on the device (``enable``'s).
    enabled : bool
        Until ``disable()``.
    step : Step or None
        The current forward of the decoder stack, or None outside it.
    capture : CaptureState
    replay : ReplayState
    bindings : RecomputeBindings
        Replay ids of live forwards, for checkpoint recomputes.
    patch : ModelPatch
        What :meth:`install` put on the model.
    """

    def __init__(self, model: nn.Module, layers: list[MoELayerInfo], meta: TraceMeta, *, backend: str,
                 capacity: tuple[int, int], device_decode: bool) -> None:  # fmt: skip
        self.model, self.layers, self.backend, self.device_decode = model, layers, backend, device_decode
        self.top_k = meta.top_k
        fingerprint = RoutingFingerprint(
            meta.model_id, meta.layer_ids, meta.num_layers, meta.num_experts, meta.top_k
        )
        self.enabled = True
        self.step: Optional[Step] = None
        self.capture = CaptureState(meta, capacity)
        self.replay = ReplayState(model, layers, fingerprint)
        self.bindings = RecomputeBindings()
        self.step_buffers = StepBuffers(len(layers), self.top_k)
        self.decode = DecodeChain(self.step_buffers)  # decode steps whose rows advance on the device
        self.generation: Optional[int] = None  # set inside generate(): which call it is
        self.generate_calls = 0
        self.outer_generation: list[Optional[int]] = []  # generate() calls nest (e.g. assisted decoding)
        # inside generate(): a bool (not ``generation``, an int that changes every call) so that a
        # compiled forward's hook, which reads it, is guarded on two values at most
        self.in_generate = False
        self.rollout_mode = False  # set_rollout_replay: generate() captures, other forwards replay
        self.rollout: list = []  # the traces of the current rollout round
        self.rollout_stale = False  # a forward ran since the last generate: the next one starts a round
        self.rollout_missing = "error"  # set_rollout_replay(missing=): the round's replay
        self.rollout_weights = False  # set_rollout_replay(replay="ids+weights"): full recall
        self.kept = 0  # rollout mode: traces in capture.finished before the current generate call
        self.replay_before: Optional[ReplayTable] = None  # rollout mode: the table before generate
        self.children: list[tuple[Engine, bool]] = []  # attach(): (session, replays)
        self.patch: Optional[ModelPatch] = None
        self.paged: list = []  # hf._paged.PagedCapture of the continuous-batching managers made
        self.paged_call: Optional[list] = None  # inside generate_batch: the managers it made

    def install(self, owner: object, *, experts: bool, graphs: bool, keep_static_cache: bool) -> None:
        """Patch the model (:class:`~replaymoe.hf._patching.ModelPatch`); ``owner``: the handle, which
        the model then holds (:func:`enabled_handle`) until :meth:`disable`."""
        drop_recompute_guard(self.model)  # an earlier session's (its recomputes are this one's now)
        self.patch = ModelPatch(
            self, owner, experts=experts, graphs=graphs, keep_static_cache=keep_static_cache
        )
        setattr(self.model, _HANDLE, owner)

    def device(self) -> torch.device:
        return model_device(self.model)

    def require_enabled(self, call: str) -> None:
        """Raise when ``disable()`` turned this session off: nothing it would do could take effect."""
        if not self.enabled:
            fail(
                call,
                "a handle of a model with replaymoe enabled (replaymoe.hf.enable(model) again)",
                "a handle turned off by disable(): the model routes natively and captures nothing",
                what="state",
            )

    def disable(self, stacklevel: int) -> None:
        """``disable()``; a warning is given ``stacklevel`` (as if warned here)."""
        if not self.enabled:
            return
        self.capture.drop_unread(stacklevel + 1)
        self.enabled = False
        for child, _ in self.children:
            child.disable(2)
        self.children.clear()
        self.replay.used.clear()
        self.patch.remove()
        if self.bindings.replayed_alive:  # a checkpointed backward still to come must not go native
            guard_recomputes(self.model, [(i.name, i.block) for i in self.layers], self.bindings)
        self.step_buffers.clear()
        self.paged.clear()
        setattr(self.model, _HANDLE, None)
        self.step = None

    # ---------------------------------------------------------------- capture
    def set_capture(self, enabled: bool, stacklevel: int, weights: bool = False) -> None:
        check_bool("enabled", enabled)
        check_bool("weights", weights)
        if enabled:
            self.require_enabled("set_capture")
        self.capture.set(enabled, self.device(), stacklevel + 1, weights)

    def traces(self, num_positions: Sequence[int] | None, stacklevel: int) -> list:
        self.require_enabled("traces")
        self.replay.raise_uncovered()
        return self.capture.take(num_positions, stacklevel + 1)

    # ---------------------------------------------------------------- replay
    def set_replay(
        self, replay: Any, missing: str = "error", check_model_id: bool = True, mode: str = "ids"
    ) -> None:
        self.replay.raise_uncovered()
        if replay is None:
            self.set_table(None)
            return
        self.require_enabled("set_replay")
        check_choice("missing", missing, MISSING_MODES)
        check_bool("check_model_id", check_model_id)
        check_choice("replay", mode, REPLAY_MODES)
        self.set_table(self.replay.load(replay, missing, check_model_id, weights=mode == "ids+weights"))

    def enter_replaying(self) -> Optional[ReplayTable]:
        """``replaying()``'s start: a spare table becomes the active one (the attached sessions follow
        at :meth:`set_replay`), the active one is held until :meth:`exit_replaying`; returns it."""
        self.require_enabled("replaying")
        return self.replay.hold()

    def exit_replaying(self, prev: Optional[ReplayTable]) -> None:
        """``replaying()``'s end: ``prev`` (:meth:`enter_replaying`'s) is active again, here and in the
        attached sessions."""
        self.replay.release(prev)
        self.set_table(prev)

    def set_table(self, table: Optional[ReplayTable]) -> None:
        """``table`` is the active replay, here and in the attached sessions that replay."""
        self.replay.table = table
        for child, replays in self.children:
            if replays:
                child.set_table(None if table is None else child.replay.table_like(table))

    def adopt(self, child: Engine, replays: bool) -> None:
        """``attach()``: ``child`` (an attached model's engine) replays what this session replays."""
        self.children.append((child, replays))
        if replays and self.replay.table is not None:
            child.set_table(child.replay.table_like(self.replay.table))

    # ---------------------------------------------------------------- rollout replay (R3)
    def set_rollout_replay(self, enabled: bool, missing: str, mode: str = "ids") -> None:
        check_bool("enabled", enabled)
        check_choice("missing", missing, MISSING_MODES)
        check_choice("replay", mode, REPLAY_MODES)
        if not enabled:
            self.rollout_mode, self.rollout, self.rollout_stale = False, [], False
            self.set_replay(None)
            return
        self.require_enabled("set_rollout_replay")
        if self.rollout_mode and self.rollout:  # on already: the round in replay takes the new settings
            self.set_replay(self.rollout, missing, mode=mode)  # (checked first: a refusal changes nothing)
            stale = True  # and the next generate starts a new round
        else:
            self.rollout, stale = [], False
        self.rollout_missing = missing
        self.rollout_weights = mode == "ids+weights"
        self.rollout_mode, self.rollout_stale = True, stale

    def add_rollout_traces(self, traces: Sequence[Any]) -> None:
        self.require_enabled("add_rollout_traces")
        if not self.rollout_mode:
            fail("set_rollout_replay", "on (set_rollout_replay(True)) before add_rollout_traces", "off")
        traces = trace_list("traces", traces)
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
        # a forward ran since the last rollout: this starts a new round (once the traces are accepted:
        # refused ones leave the round and its replay as they were)
        kept = [] if self.rollout_stale else self.rollout
        self.set_replay(kept + traces, self.rollout_missing, mode=self.rollout_mode_name())
        self.rollout, self.rollout_stale = kept + traces, False

    def rollout_generate_begin(self) -> None:
        if not self.rollout_mode:
            return
        self.replay.raise_uncovered()  # the round that ends: its replayed forwards' coverage
        if self.rollout_stale:
            self.rollout, self.rollout_stale = [], False
        if self.capture.buffer is not None:
            self.capture.harvest(3)  # what the user captured before stays theirs
        self.kept = len(self.capture.finished)
        self.replay_before = self.replay.table
        self.set_table(None)  # the rollout routes natively
        if self.rollout_weights:  # full recall: the round's traces carry their weights
            self.capture.ensure_weights(self.device(), 3)
        elif self.capture.buffer is None:
            self.capture.allocate(self.device())
        self.capture.on = True

    def rollout_generate_end(self) -> None:
        if not self.rollout_mode:
            return
        self.capture.harvest(3)
        new = self.capture.finished[self.kept :]
        if not self.capture.user_on:
            del self.capture.finished[self.kept :]
        self.capture.on = self.capture.user_on
        self.set_table(self.replay_before)
        self.rollout.extend(new)
        if self.rollout:
            self.set_replay(self.rollout, self.rollout_missing, mode=self.rollout_mode_name())

    def rollout_mode_name(self) -> str:
        """The rollout round's replay mode (``set_rollout_replay(replay=)``)."""
        return "ids+weights" if self.rollout_weights else "ids"

    # ---------------------------------------------------------------- patches.SessionHooks
    def generate_begin(self, num_beams: int) -> None:
        """``generate`` was called: a new capture batch starts at its first forward (so batches are
        kept apart on the host even when the cache's length lives on the device); in rollout mode,
        capture on and replay paused. Beam search (``num_beams > 1``) is refused while capture or
        replay is on: it reorders the KV cache's rows between steps, so a row's routes would mix beams."""
        if num_beams > 1 and (self.capture.user_on or self.rollout_mode or self.replay.table is not None):
            fail(
                "num_beams",
                "1 while replaymoe captures or replays (beam search reorders the cache's rows between "
                "steps: a row's routes would mix several beams)",
                num_beams,
            )
        self.rollout_generate_begin()
        self.capture.begin_pending = True
        self.generate_calls += 1
        self.outer_generation.append(self.generation)
        self.generation = self.generate_calls  # (the decode steps' chain)
        self.in_generate = True

    def generate_end(self, out: Any) -> None:
        """``generate`` returned ``out`` (None if it raised): the last forward's deferred capture commit
        is written (none outlives the call: a compiled forward after it never finds one), the kept
        static cache goes if the call returned it, and in rollout mode the round's traces replay."""
        if out is not None:
            self.patch.static_cache.release_if_returned(out)
        self.generation = self.outer_generation.pop()
        self.in_generate = bool(self.outer_generation)
        self.decode.reset()
        if self.capture.buffer is not None:
            self.capture.buffer.flush()
        self.rollout_generate_end()
        if out is not None:  # (a failed call's own error goes first)
            self.replay.raise_uncovered()

    def routed(self, info: MoELayerInfo, logits: torch.Tensor, replay_ids: Optional[torch.Tensor],
               used: torch.Tensor, routing: RoutingConfig) -> None:  # fmt: skip
        """A router call with ``replay_ids`` used ``used``: kept for this forward's aux loss, and counted
        (``track_mismatch``, compiled forwards too: device ops on the counters); recomputes (outside the
        model's forward) are not."""
        if replay_ids is None or self.step is None:
            return
        if not torch.compiler.is_compiling():
            self.replay.used[info.index] = (logits, used)
        if self.replay.mismatch is not None:
            self.replay.count_mismatch(info.index, logits, replay_ids, used, routing, self.backend)

    def layer_io(self, info: MoELayerInfo, num_tokens: int) -> tuple[Any, Any, Any, Any]:
        """(replay ids int32 [T, K] or None, capture slab int16 [T, K] or None, replayed weights float32
        [T, K] or None, the weights' capture slab float32 [T, K] or None) for one router call."""
        step = self.step
        if step is None:
            # outside the model's forward: an activation-checkpoint recompute (the ids its forward
            # used, and with full recall their weights, bound to the layer's input), or a direct call
            found = self.bindings.take(info.index)
            if found is not MISSING:
                ids, weights = found if isinstance(found, tuple) else (found, None)
                if ids is not None and ids.shape[0] != num_tokens:
                    fail("hidden_states", f"{ids.shape[0]} tokens (the recomputed forward's)",
                         f"{num_tokens} tokens at {info.name}", what="shape")  # fmt: skip
                return ids, None, weights, None
            if self.replay.table is not None or self.bindings.replayed_alive:
                fail(
                    "replay",
                    "MoE layers called inside the model's forward, or recomputed by activation "
                    "checkpointing from the inputs that forward saved (so that they route as it did)",
                    f"a call of {info.name} outside the model's forward that matches no forward with replay",
                    what="context",
                )
            return None, None, None, None
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
        forced_w = None if step.forced_w is None else step.forced_w[info.index]
        staged_w = None if step.staged_w is None else step.staged_w[info.index]
        return forced, staged, forced_w, staged_w

    # ---------------------------------------------------------------- forward context
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Pre-hook of the decoder stack: this forward's :class:`~replaymoe.hf.step.Step`."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if ref is None or ref.dim() < 2:
            self.decode.reset()
            self.step = None
            self.patch.static_cache.advance(forward_cache(kwargs)[0], None)
            return
        compiled = torch.compiler.is_compiling()
        if self.rollout_mode and not self.in_generate:  # a forward outside generate ends the round
            # (compiled too: dynamo replays this attribute write after every call of the graph)
            self.rollout_stale = True
        if not compiled:
            self.replay.raise_uncovered(
                block=False
            )  # an earlier forward's, once its counters reached the host
            self.replay.used = {}
            self.follow_device(ref.device)
        self.step = plan_step(self, input_ids, ref, kwargs)
        # the kept static cache's host-side length (hf.static_cache), for the next forward
        self.patch.static_cache.advance(forward_cache(kwargs)[0], None if compiled else ref.shape[1])

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of the decoder stack (also when the forward raised): the capture slab into the
        buffer, the coverage count of a replayed forward."""
        step, self.step = self.step, None
        if step is not None and step.head is not None:  # no router ran (the forward failed before)
            step.head.launch()  # it still writes the previous step's pending capture rows
        if step is not None and step.tokens is not None and step.slot is not None and output is not None:
            self.capture.buffer.write_tokens(step.slot, step.tokens)
        if step is not None and step.staged_w is not None and output is not None:
            self.capture.buffer.commit_weights(step.staged_w, step.slot)  # (at once: slot is this step's)
        # (a continuous-batching forward has no slot: its slab is its manager's, read after the step)
        if step is not None and step.staged is not None and step.slot is not None and output is not None:
            if step.defer_commit:  # eager, step_rows took this forward: its next launch commits
                self.capture.buffer.defer(step.staged, step.slot)
            else:
                self.capture.buffer.commit(step.staged, step.slot)
        if step is not None and step.coverage is not None and step.forced is not None and output is not None:
            self.replay.count_uncovered(step)

    def follow_device(self, device: torch.device) -> None:
        """Move the capture buffer and the replay table to where the forward runs, when the model
        moved since they were made (``enable`` on a meta-device model, then ``to_empty`` / ``.to()``,
        FSDP2): replaymoe's state follows the model and is never part of its ``state_dict``."""
        cap = self.capture.buffer
        if cap is not None and cap.device != device:
            if cap.device.type != "meta":
                self.capture.harvest(3)
            self.capture.allocate(device)
        rep = self.replay.table
        if rep is not None and rep.source is not None and rep.device != device:
            rep.load(*rep.source, device, weights=rep.with_weights)

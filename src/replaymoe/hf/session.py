"""The public handle of a patched model, :class:`ReplayMoE`, and :func:`enable`, which makes one.

The handle is small: enable or disable, capture, replay (``replaying``), traces, report, attach. The
patch hooks and the state they share (capture buffer, replay tables, coverage checks, step
bookkeeping) live in its private collaborator, :class:`replaymoe.hf._engine.Engine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from replaymoe._backend import BACKENDS
from replaymoe._validation import check_bool, check_choice, check_int, fail
from replaymoe.record.replay import MISSING_MODES
from replaymoe.record.trace import RoutingFingerprint

from ._engine import Engine, enabled_handle
from .discovery import find_moe_layers
from .state import TraceMeta

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
        _check_handle_args(model, backend, experts, max_batch_size, max_positions, graphs, keep_static_cache,
                           device_decode)  # fmt: skip
        if enabled_handle(model) is not None:
            fail("model", "a model without replaymoe enabled (call .disable() first)", "already enabled")
        self.model = model
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
        meta = TraceMeta(len(self.layers), self.top_k, self.num_experts, tuple(self.layer_ids), self.model_id)
        capacity = (max_batch_size, max_positions)
        self._engine = Engine(
            model, self.layers, meta, backend=backend, capacity=capacity, device_decode=device_decode
        )
        self._engine.install(self, experts=experts, graphs=graphs, keep_static_cache=keep_static_cache)

    @property
    def backend(self) -> str:
        return self._engine.backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._engine.backend = value

    @property
    def device_decode(self) -> bool:
        return self._engine.device_decode

    @device_decode.setter
    def device_decode(self, value: bool) -> None:
        self._engine.device_decode = value

    @property
    def block_graph_captures(self) -> int:
        """CUDA graphs of MoE blocks captured so far (:mod:`replaymoe.hf.graphs`; 0 with ``graphs=False``)."""
        return sum(g.captures for g in self._engine.patch.block_graphs)

    @property
    def fingerprint(self) -> RoutingFingerprint:
        """This model's routing (model id, MoE layer numbers, experts, top-k): what a replayed trace's
        :attr:`~replaymoe.record.trace.RoutingTrace.fingerprint` must match."""
        return RoutingFingerprint(
            self.model_id, tuple(self.layer_ids), len(self.layers), self.num_experts, self.top_k
        )

    def disable(self) -> None:
        """Undo :func:`enable`: original routers and experts implementation, hooks removed (attached
        models too). The handle is off after it: :meth:`set_capture`, :meth:`set_replay`,
        :meth:`replaying`, :meth:`set_rollout_replay`, :meth:`traces` and :meth:`attach` raise.
        Captured traces not yet read with :meth:`traces` are dropped with a warning."""
        self._engine.disable(stacklevel=3)

    def release_static_cache(self) -> None:
        """Free the static KV cache kept across ``generate(cache_implementation="static")`` calls
        (``enable(..., keep_static_cache=True)``), e.g. before a training step; the next such
        ``generate`` makes a new one (and records its decode step's CUDA graphs again)."""
        self._engine.patch.static_cache.release()

    # ---------------------------------------------------------------- capture
    def set_capture(self, enabled: bool, *, weights: bool = False) -> None:
        """Turn capture on or off (traces captured so far stay available).

        Turning it on allocates the device buffer (``enable``'s ``max_batch_size`` x
        ``max_positions``; it grows at eager forwards as needed).

        Parameters
        ----------
        enabled : bool
        weights : bool
            Also record each row's combine weights (fp32, written by the routing kernel beside the
            ids), so that the traces replay with ``replay="ids+weights"`` (full recall). A second
            device buffer, ``float32 [L, B_cap * S_cap + 1, K]``; False (the default) allocates
            none and costs nothing. Switching it harvests what the current buffer holds first.
        """
        self._engine.set_capture(enabled, stacklevel=3, weights=weights)

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
        return self._engine.traces(num_positions, stacklevel=3)

    # ---------------------------------------------------------------- replay
    def set_replay(
        self, traces: Any, *, missing: str = "error", check_model_id: bool = True, replay: str = "ids"
    ) -> None:
        """Replay ``traces`` (``RoutingTrace``, list of them — one per batch row — or ``ReplaySource``;
        None stops replaying) in the following forwards.

        The traces are checked and copied to the device once, here; forwards then only gather.

        Parameters
        ----------
        traces : RoutingTrace, sequence of RoutingTrace, ReplaySource or None
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
        replay : {"ids", "ids+weights"}
            What is replayed. ``"ids"`` (R3, the default): the recorded experts, with weights
            recomputed from this model's router logits (the router gets a gradient through them).
            ``"ids+weights"`` (full recall, or router recall): the recorded experts and their
            recorded combine weights, so the experts get exactly the rollout's weights and no
            gradient reaches the router through them (tokens routed natively, e.g. each row's last
            token, keep their own). Every trace must carry weights (``set_capture(True,
            weights=True)``); traces from vLLM or SGLang, which return expert ids only, raise.

        Raises
        ------
        ValueError
            When the handle was disabled; ``replay="ids+weights"`` with a trace without weights;
            when the traces' fingerprint differs from the model's
            (top_k, num_experts, MoE layers by ``layer_ids`` when the trace has them, else by count,
            model id unless ``check_model_id=False``); or a recorded row is not K distinct ids in
            ``[0, E)``.
        """
        self._engine.set_replay(traces, missing, check_model_id, replay)

    @contextlib.contextmanager
    def replaying(
        self, traces: Any, *, missing: str = "error", check_model_id: bool = True, replay: str = "ids"
    ) -> Iterator[ReplayMoE]:
        """Context manager: :meth:`set_replay` (same arguments) inside, the previous replay restored
        after. Uncovered tokens of compiled forwards inside raise on the way out."""
        prev = self._engine.enter_replaying()
        try:
            self.set_replay(traces, missing=missing, check_model_id=check_model_id, replay=replay)
            yield self
            self._engine.replay.raise_uncovered()
        finally:
            self._engine.exit_replaying(prev)

    def report(self) -> Any:
        """Tokens replayed vs fallen back to native routing, per layer (``ReplayReport``), or None."""
        self._engine.replay.raise_uncovered()
        table = self._engine.replay.table
        return None if table is None else table.report()

    def reset_report(self) -> None:
        """Start :meth:`report`'s counts again (the active replay's)."""
        if self._engine.replay.table is not None:
            self._engine.replay.table.reset_report()

    # ---------------------------------------------------------------- rollout replay (R3)
    def set_rollout_replay(self, enabled: bool, *, missing: str = "error", replay: str = "ids") -> None:
        """Rollout routing replay without glue: every ``generate`` call captures (replay paused
        inside it), and every other forward replays the traces of the latest rollout round, matched
        to rows by content (any order, subset, chunking or padding of the rollout's rows; see
        :meth:`set_replay`). A round is the ``generate`` calls since the last forward outside ``generate``
        (compiled ones too). Called again while on, the round takes the new settings and the next
        ``generate`` starts a new one (``R3GRPOTrainer``: before each rollout). Turning it off stops
        replaying. Attached models (:meth:`attach`) replay the same traces.

        ``missing`` is :meth:`set_replay`'s: whether a token the round's traces do not cover raises
        (``"error"``, the default) or routes natively (``"native"``, counted in :meth:`report`).
        ``replay`` is :meth:`set_replay`'s: ``"ids"`` (R3, the default) or ``"ids+weights"``
        (full recall: ``generate`` also captures the combine weights, and the round replays them;
        traces added with :meth:`add_rollout_traces` must then carry weights too).
        """
        self._engine.set_rollout_replay(enabled, missing, replay)

    def rollout_traces(self) -> list:
        """The traces of the current rollout round (:meth:`set_rollout_replay`), one per generated row."""
        return list(self._engine.rollout)

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
        self._engine.add_rollout_traces(traces)

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
        self._engine.require_enabled("attach")
        child = ReplayMoE(model, backend=self.backend, graphs=self.graphs)
        if (child.top_k, child.num_experts, child.layer_ids) != (
            self.top_k,
            self.num_experts,
            self.layer_ids,
        ):
            child.disable()
            want = f"the policy's MoE layers ({self.layer_ids}, top-{self.top_k} of {self.num_experts})"
            fail("model", want, f"{child.layer_ids}, top-{child.top_k} of {child.num_experts}")
        self._engine.adopt(child._engine, replay)
        return child

    # ---------------------------------------------------------------- routing mismatch
    def track_mismatch(self, enabled: bool = True) -> None:
        """Count, per MoE layer, replayed tokens whose native top-k (this model's router now) differs
        from the rollout's ids, and those whose used ids differ from the rollout's (always 0 unless
        replay is broken). Costs one extra routing per replayed layer call; read with
        :meth:`mismatch`."""
        check_bool("enabled", enabled)
        self._engine.replay.track_mismatch(enabled)

    def mismatch(self, *, reset: bool = True) -> dict:
        """Routing agreement since the last call (one host sync): ``tokens`` replayed token-layer
        lookups, ``native_vs_rollout`` the fraction whose native top-k differs from the rollout's,
        ``replayed_vs_rollout`` the fraction whose used ids differ (0.0 when replay holds)."""
        return self._engine.replay.read_mismatch(reset)


def _check_handle_args(model, backend, experts, max_batch_size, max_positions, graphs, keep_static_cache,
                       device_decode) -> None:  # fmt: skip
    """:class:`ReplayMoE`'s arguments checked (``enable`` and ``attach`` make one)."""
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module (a transformers MoE model)", type(model).__name__, what="type")
    check_choice("backend", backend, BACKENDS)
    for name, value in (("experts", experts), ("graphs", graphs), ("keep_static_cache", keep_static_cache),
                        ("device_decode", device_decode)):  # fmt: skip
        check_bool(name, value)
    check_int("max_batch_size", max_batch_size, low=1)
    check_int("max_positions", max_positions, low=1)


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
    check_choice("missing", missing, MISSING_MODES)  # (checked without a replay too: never ignored)
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

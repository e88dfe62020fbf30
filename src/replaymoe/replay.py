"""Feed recorded routing back into a forward pass.

:class:`ReplaySource` turns one :class:`~replaymoe.trace.RoutingTrace` per sequence of a batch
into the per-layer ``replay_ids`` that :func:`replaymoe.route` / :func:`replaymoe.fused_moe`
take. Rows it cannot fill (padding, a position the trace does not cover, a row recorded as
missing) come back as all -1, which the routing kernels treat as "route this token natively";
the source counts those per layer so a trainer can tell how much of a batch was really replayed::

    src = ReplaySource([trace_a, trace_b])            # one trace per sequence
    src.check_model(num_layers=48, top_k=8, num_experts=128)
    for layer in range(48):
        ids = src.ids_for(layer, positions)           # int32 [B*S, K] on positions.device
        out = route(logits[layer], 8, replay_ids=ids)
    print(src.report())

``ids_for`` is a pure device gather (no host synchronisation, fixed shapes), so it can run
inside a CUDA graph once :meth:`ReplaySource.prepare` has put the tables on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ._validation import check_int, check_tensor, fail
from .trace import RoutingTrace

__all__ = ["ReplaySource", "ReplayReport"]


@dataclass
class ReplayReport:
    """How much of the replayed batches fell back to native routing.

    Attributes
    ----------
    tokens_seen : int
        Non-padding tokens looked up per layer (the maximum over layers, i.e. the tokens of all
        ``ids_for`` calls of one layer since the last reset).
    fallback_tokens_per_layer : np.ndarray int64 [L]
        Per MoE layer, non-padding tokens that got a -1 row (not recorded, or beyond the trace).
    layers_with_fallback : int
        Number of layers with at least one fallback token.
    tokens_seen_per_layer : np.ndarray int64 [L]
        Non-padding tokens looked up per layer.
    """

    tokens_seen: int
    fallback_tokens_per_layer: np.ndarray
    layers_with_fallback: int
    tokens_seen_per_layer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def from_counts(cls, seen: np.ndarray, fallback: np.ndarray) -> ReplayReport:
        """The report of per-layer counts: tokens looked up and tokens that fell back (int64 [L])."""
        return cls(
            tokens_seen=int(seen.max()) if seen.size else 0,
            fallback_tokens_per_layer=fallback,
            layers_with_fallback=int((fallback > 0).sum()),
            tokens_seen_per_layer=seen,
        )

    @property
    def fallback_fraction(self) -> float:
        """Fallback tokens over tokens looked up, all layers together (0.0 when nothing was seen)."""
        seen = int(self.tokens_seen_per_layer.sum())
        return float(self.fallback_tokens_per_layer.sum()) / seen if seen else 0.0

    def __str__(self) -> str:
        L = len(self.fallback_tokens_per_layer)
        fallback = int(self.fallback_tokens_per_layer.sum())
        lines = [
            f"replay: {self.tokens_seen} tokens looked up per MoE layer, {L} layers; {fallback} "
            f"token-layer lookups routed natively (no recorded row: "
            f"{100 * self.fallback_fraction:.2f}%), in {self.layers_with_fallback} of the {L} layers"
        ]
        worst = np.argsort(-self.fallback_tokens_per_layer, kind="stable")[: min(5, L)]
        worst = [int(i) for i in worst if self.fallback_tokens_per_layer[i] > 0]
        if worst:
            lines.append(
                "  tokens routed natively, by MoE-layer index: "
                + ", ".join(f"{i}: {int(self.fallback_tokens_per_layer[i])}" for i in worst)
            )
        return "\n".join(lines)


class ReplaySource:
    """Per-layer ``replay_ids`` for a batch of sequences from recorded traces.

    Parameters
    ----------
    traces : RoutingTrace or sequence of RoutingTrace
        One trace per sequence of the batch (row b of ``positions`` reads ``traces[b]``). All must
        have the same number of layers, top_k, layer_ids and (when known) num_experts. A trace's
        ``token_offset`` is honoured: position p reads ``ids[p - token_offset]``.
    """

    def __init__(self, traces: RoutingTrace | Sequence[RoutingTrace]):
        self._single = isinstance(traces, RoutingTrace)
        tr = [traces] if self._single else list(traces)
        if not tr:
            fail("traces", "at least one RoutingTrace", "an empty sequence")
        for i, t in enumerate(tr):
            if not isinstance(t, RoutingTrace):
                fail(f"traces[{i}]", "a RoutingTrace", type(t).__name__, what="type")
        first = tr[0]
        for i, t in enumerate(tr[1:], 1):
            if (t.num_layers, t.top_k, t.model_layer_ids()) != (
                first.num_layers,
                first.top_k,
                first.model_layer_ids(),
            ):
                fail(
                    f"traces[{i}]",
                    f"layers={first.num_layers}, top_k={first.top_k}, layer_ids as traces[0]",
                    f"layers={t.num_layers}, top_k={t.top_k}, layer_ids={t.layer_ids}",
                )
        known = {t.num_experts for t in tr if t.num_experts is not None}
        if len(known) > 1:
            fail("traces", "one num_experts across traces", sorted(known))
        self.traces: list[RoutingTrace] = tr
        self.num_layers = first.num_layers
        self.top_k = first.top_k
        self.num_experts: int | None = known.pop() if known else None
        self._layer_of = {m: i for i, m in enumerate(first.model_layer_ids())}
        # host table [L, total + 1, K] int16: the traces' rows back to back (sequence b's row n at
        # base[b] + n), then one all -1 row that padding and uncovered positions read
        lengths = [t.num_tokens for t in tr]
        self._total = sum(lengths)
        table = np.full((self.num_layers, self._total + 1, self.top_k), -1, dtype=np.int16)
        base = 0
        bases = []
        for t in tr:
            table[:, base : base + t.num_tokens] = t.ids.transpose(1, 0, 2)
            bases.append(base)
            base += t.num_tokens
        self._host_table = torch.from_numpy(table)
        self._offsets = torch.tensor([t.token_offset for t in tr], dtype=torch.int64)
        self._lengths = torch.tensor(lengths, dtype=torch.int64)
        self._bases = torch.tensor(bases, dtype=torch.int64)
        self._dev: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._seen: dict[torch.device, torch.Tensor] = {}
        self._fallback: dict[torch.device, torch.Tensor] = {}

    @property
    def batch_size(self) -> int:
        """Number of sequences (traces)."""
        return len(self.traces)

    # ------------------------------------------------------------------ validation
    def check_model(self, num_layers: int, top_k: int, num_experts: int) -> None:
        """Raise ValueError naming the mismatch unless the traces fit a model of this shape.

        ``num_layers`` counts the model's MoE layers (the trace's L). When the traces do not know
        E (e.g. from a vLLM payload), every recorded id must lie below ``num_experts``.
        """
        check_int("num_layers", num_layers, low=1)
        check_int("top_k", top_k, low=1)
        check_int("num_experts", num_experts, low=1)
        if num_layers != self.num_layers:
            fail(
                "num_layers",
                f"the trace's {self.num_layers} MoE layers (layer_ids {list(self._layer_of)})",
                f"a model with {num_layers} MoE layers",
            )
        if top_k != self.top_k:
            fail("top_k", f"the trace's top_k {self.top_k}", f"a model with top_k {top_k}")
        if self.num_experts is not None:
            if num_experts != self.num_experts:
                fail("num_experts", f"the trace's {self.num_experts} experts", f"a model with {num_experts}")
        else:
            top = max((int(t.ids.max()) for t in self.traces if t.ids.size), default=-1)
            if top >= num_experts:
                fail("num_experts", f"more than the trace's largest expert id {top}", num_experts)

    def layer_for_model_layer(self, model_layer_number: int) -> int:
        """MoE-layer index (trace order) of a model layer number, through the traces' ``layer_ids``."""
        check_int("model_layer_number", model_layer_number, low=0)
        if model_layer_number not in self._layer_of:
            fail(
                "model_layer_number",
                f"one of the traced MoE layers {sorted(self._layer_of)}",
                model_layer_number,
            )
        return self._layer_of[model_layer_number]

    # ------------------------------------------------------------------ lookup
    def prepare(self, device: torch.device | str) -> torch.device:
        """Copy the id tables to ``device`` (done lazily by :meth:`ids_for`; call it before capturing
        a CUDA graph, since a host-to-device copy cannot be captured)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._dev:
            self._dev[device] = (
                self._host_table.to(device),
                self._offsets.to(device),
                self._lengths.to(device),
                self._bases.to(device),
            )
            self._seen[device] = torch.zeros(self.num_layers, dtype=torch.int64, device=device)
            self._fallback[device] = torch.zeros(self.num_layers, dtype=torch.int64, device=device)
        return device

    def ids_for(
        self, layer: int, positions: torch.Tensor, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Recorded expert ids of MoE layer ``layer`` for each token of a batch.

        Parameters
        ----------
        layer : int
            MoE-layer index in trace order, 0 .. L-1 (see :meth:`layer_for_model_layer`).
        positions : torch.Tensor int64 (or int32) [B, S], or [S] when the source has one trace
            Each token's position in its sequence; -1 (any negative) = padding.
        device : optional
            Where to return the ids (default: ``positions.device``).

        Returns
        -------
        torch.Tensor int32 [positions.numel(), K]
            Row-major over ``positions``; all -1 for padding, for positions outside the trace and
            for rows recorded as missing (native-routing fallback per token).
        """
        check_int("layer", layer, low=0, high=self.num_layers - 1)
        check_tensor("positions", positions, dtype=(torch.int64, torch.int32))
        B = self.batch_size
        if positions.dim() == 1 and B == 1:
            pos2 = positions.reshape(1, -1)
        elif positions.dim() == 2 and positions.shape[0] == B:
            pos2 = positions
        else:
            want = f"[{B}, S]" + (" or [S]" if B == 1 else "")
            fail("positions", f"{want} (one row per trace)", tuple(positions.shape), what="shape")
        dev = self.prepare(device if device is not None else positions.device)
        table, offsets, lengths, bases = self._dev[dev]
        pos2 = pos2.to(dev, torch.int64)
        rel = pos2 - offsets[:, None]
        real = pos2 >= 0
        inside = real & (rel >= 0) & (rel < lengths[:, None])
        row = torch.where(inside, rel + bases[:, None], torch.full_like(rel, self._total))
        out = table[layer].index_select(0, row.reshape(-1)).to(torch.int32)
        fell_back = real.reshape(-1) & (out[:, 0] < 0)
        self._seen[dev][layer] += real.sum()
        self._fallback[dev][layer] += fell_back.sum()
        return out

    # ------------------------------------------------------------------ report
    def report(self) -> ReplayReport:
        """Counts since construction or the last :meth:`reset_report` (one host sync)."""
        seen = np.zeros(self.num_layers, dtype=np.int64)
        fb = np.zeros(self.num_layers, dtype=np.int64)
        for dev in self._seen:
            seen += self._seen[dev].cpu().numpy()
            fb += self._fallback[dev].cpu().numpy()
        return ReplayReport.from_counts(seen, fb)

    def reset_report(self) -> None:
        """Zero the counters of :meth:`report`."""
        for dev in self._seen:
            self._seen[dev].zero_()
            self._fallback[dev].zero_()

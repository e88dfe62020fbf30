"""Feed recorded routing back into a forward pass, layer by layer: :class:`ReplaySource`.

:class:`ReplaySource` turns one :class:`~replaymoe.record.trace.RoutingTrace` per sequence of a batch
into the per-layer ``replay_ids`` that :func:`replaymoe.route` / :func:`replaymoe.fused_moe`
take; it looks them up in a :class:`~replaymoe.record.replay.ReplayTable` per device, by batch row
and position (see :mod:`replaymoe.record.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..._validation import check_int, check_tensor, fail
from ..trace import RoutingTrace
from .table import ReplayReport, ReplayTable

__all__ = ["ReplaySource", "trace_list"]


def trace_list(name: str, traces: object) -> list:
    """``traces`` (any iterable but a string) as a list, or ValueError naming ``name``: the elements'
    own types are checked by the caller, each naming ``name[i]``."""
    if isinstance(traces, (str, bytes)) or not hasattr(traces, "__iter__"):
        fail(name, "a sequence of RoutingTrace", type(traces).__name__, what="type")
    return list(traces)


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
        tr = [traces] if isinstance(traces, RoutingTrace) else trace_list("traces", traces)
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
        self._tables: dict[torch.device, ReplayTable] = {}  # the device tables, made by prepare()

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
                f"the trace's {self.num_layers} MoE layers ("
                + (
                    f"layer_ids {list(self._layer_of)}"
                    if self.traces[0].layer_ids is not None
                    else "the trace records no layer_ids"
                )
                + ")",
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
        if device not in self._tables:
            table = ReplayTable()
            table.load(self.traces, list(range(self.num_layers)), device, match_content=False)
            self._tables[device] = table
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
        return self._tables[dev].gather_layer(layer, pos2.to(dev, torch.int64))

    # ------------------------------------------------------------------ report
    def report(self) -> ReplayReport:
        """Counts since construction or the last :meth:`reset_report` (one host sync)."""
        seen = np.zeros(self.num_layers, dtype=np.int64)
        fb = np.zeros(self.num_layers, dtype=np.int64)
        for table in self._tables.values():
            seen += table.seen.cpu().numpy()
            fb += table.fallback.cpu().numpy()
        return ReplayReport.from_counts(seen, fb)

    def reset_report(self) -> None:
        """Zero the counters of :meth:`report`."""
        for table in self._tables.values():
            table.reset_report()

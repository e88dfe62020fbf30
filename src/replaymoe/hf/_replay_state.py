"""The replay side of a :class:`~replaymoe.hf.session.ReplayMoE` session: the active replay table and
its pool, the checks of traces against the model, the coverage checks of ``missing="error"``, the
routing-mismatch counters and the ids the routers of the latest replayed forward used (aux loss)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from replaymoe._validation import fail, is_capturing
from replaymoe.record.replay import ReplaySource
from replaymoe.record.trace import RoutingFingerprint
from replaymoe.routing import RoutingConfig, route
from replaymoe.routing.methods import weight_bounds

from .discovery import MoELayerInfo
from .state import ReplayTable
from .step import Step

__all__ = ["ReplayState", "model_device"]


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s (first) parameter lives: where new capture and replay state goes."""
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters has no MoE layers
        return torch.device("cpu")


class ReplayState:
    """What one session replays.

    Attributes
    ----------
    table : ReplayTable or None
        The active table (None: routing is native).
    pool : list[ReplayTable]
        Tables made so far, reused (:meth:`spare`).
    held : list[ReplayTable]
        The tables that enclosing ``replaying()`` blocks restore when they end, outermost first:
        never reloaded while held (:meth:`hold`).
    mismatch : torch.Tensor or None
        int64 ``[L, 3]`` while ``track_mismatch`` is on: replayed lookups, native top-k differing,
        used ids differing.
    used : dict[int, tuple[torch.Tensor, torch.Tensor]]
        The latest replayed forward's router logits and used ids, per MoE layer (aux loss).
    """

    def __init__(self, model: nn.Module, layers: list[MoELayerInfo], fingerprint: RoutingFingerprint) -> None:
        self.model, self.layers, self.fingerprint = model, layers, fingerprint
        self.layer_ids = [info.layer_number for info in layers]
        self.table: Optional[ReplayTable] = None
        self.pool: list[ReplayTable] = []
        self.held: list[ReplayTable] = []
        self.mismatch: Optional[torch.Tensor] = None
        self.used: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def spare(self) -> ReplayTable:
        """A pooled table that is neither active nor held by an enclosing ``replaying()`` block (a new
        one when all are): tables are reused, so that their buffers keep their shapes and addresses
        across batches (no recompile, no CUDA-graph re-record)."""
        for table in self.pool:
            if table is not self.table and not any(table is h for h in self.held):
                return table
        table = ReplayTable()
        self.pool.append(table)
        return table

    def writable(self) -> ReplayTable:
        """The table a new replay loads into: the active one, else a :meth:`spare` one."""
        return self.table if self.table is not None else self.spare()

    def hold(self) -> Optional[ReplayTable]:
        """``replaying()``'s start: the active table (or None) is kept aside, untouched until
        :meth:`release` gives it back, and a spare table becomes the active one. Returns the kept one."""
        prev = self.table
        if prev is not None:
            self.held.append(prev)
        self.table = self.spare()
        return prev

    def release(self, prev: Optional[ReplayTable]) -> None:
        """``replaying()``'s end: ``prev`` (what :meth:`hold` returned) is no longer held."""
        if prev is not None and self.held and self.held[-1] is prev:
            self.held.pop()

    def load(self, replay: Any, missing: str, check_model_id: bool, *, weights: bool = False) -> ReplayTable:
        """The table holding ``replay`` (``set_replay``'s, not None), checked against the model: the
        active one, or a spare one when none is. ``weights``: full recall (every trace must carry
        its weights)."""
        src = replay if isinstance(replay, ReplaySource) else ReplaySource(replay)
        if weights:
            ReplayTable.check_weighted(src.traces)
        mine = self.fingerprint
        src.check_model(len(self.layers), mine.top_k, mine.num_experts)
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
        if weights:
            self._check_weight_values(src.traces, mapping)
        table = self.writable()
        dev = model_device(self.model)
        if table.holds(src.traces, mapping, dev, weights=weights):  # the same traces again (e.g.
            table.reset_report()  # replaying() around every step): the table already holds them
        else:
            table.load(src.traces, mapping, dev, weights=weights)
        table.missing = missing
        return table

    def _check_weight_values(self, traces: Any, mapping: list[int]) -> None:
        """Full recall: each replayed row's weights must be what the layer's routing can make
        (:func:`~replaymoe.routing.methods.weight_bounds`): >= 0 for every method but TOPK (the rule
        ``route`` applies to ``replay_weights``), each at most the method's maximum, and the row's sum
        in its range (1 for a renormalized routing, the scale for DeepSeek-V3's). Checked here once,
        on the host, since the forwards skip it: weights scaled, zeroed, or from a model that weighs
        otherwise (another ``norm_topk_prob`` or ``routed_scaling_factor``) are refused."""
        for info, col in zip(self.layers, mapping):
            routing, own = info.plan.routing, info.plan.sigmoid_scale
            if own is not None:  # the router's own weights, sigmoid(logits) * scale (no renorm)
                bounds = None if own < 0 else (own, 0.0, own * routing.top_k)
            else:
                bounds = weight_bounds(routing.method, routing.scale, routing.top_k)
            if bounds is None:
                continue
            top, lo, hi = bounds
            tol = 1e-3 * max(1.0, hi)
            for i, trace in enumerate(traces):
                w, real = trace.weights[:, col], trace.ids[:, col, 0] >= 0  # [N, K], [N]
                sums = w.sum(axis=1)
                bad_w = ((w < 0) | (w > top + tol)) & real[:, None]
                bad_row = real & ((sums < lo - tol) | (sums > hi + tol))
                if not (bad_w.any() or bad_row.any()):
                    continue
                rule = (
                    f"weights in [0, {top:g}] summing to {lo:g} per row"
                    if lo == hi
                    else f"weights in [0, {top:g}] summing to at most {hi:g} per row"
                )
                if bad_w.any():
                    pos, slot = (int(v) for v in np.argwhere(bad_w)[0])
                    got = f"{float(w[pos, slot])} at position {trace.token_offset + pos}, slot {slot}"
                else:
                    pos = int(np.argwhere(bad_row)[0][0])
                    got = f"a row summing to {float(sums[pos]):.6g} at position {trace.token_offset + pos}"
                fail(
                    f"traces[{i}]",
                    f"{rule} for MoE layer {info.index} (model layer {info.layer_number}), as its routing "
                    f"({routing.method.name.lower()}) makes them",
                    got,
                    what="weights",
                )

    def table_like(self, table: ReplayTable) -> Optional[ReplayTable]:
        """This (attached) session's table holding what ``table`` of its parent holds."""
        if table.source is None:
            return None
        mine = self.writable()
        dev, weights = model_device(self.model), table.with_weights
        if mine.holds(*table.source, dev, weights=weights):  # (replaying() around every step: no reload)
            mine.reset_report()
        else:
            mine.load(*table.source, dev, weights=weights)
        mine.missing = table.missing
        return mine

    # ---------------------------------------------------------------- coverage (missing="error")
    def layer_names(self) -> list[str]:
        return [f"MoE layer {i} (model layer {n})" for i, n in enumerate(self.layer_ids)]

    def raise_uncovered(self, *, block: bool = True) -> None:
        """Raise for the active replay's uncovered lookups since the last check
        (:meth:`ReplayTable.check_uncovered`): ``block`` reads the device counters (one host sync, at
        the user's calls: traces(), report(), set_replay, the end of replaying() or generate);
        otherwise only a finished asynchronous snapshot is read (the start of every eager forward)."""
        table = self.table
        if table is not None and not torch.compiler.is_compiling() and not is_capturing():
            table.check_uncovered(self.layer_names(), block=block)

    def count_uncovered(self, step: Step) -> None:
        """End of a replayed forward with ``missing="error"`` (or whose tokens were checked against
        their traces'): count the tokens that needed a recorded route and found none
        (:meth:`ReplayTable.count_uncovered`, device ops only, whichever producer wrote the forced
        ids), and, eagerly, start the counters' copy to the host that the next forward's start reads
        without waiting."""
        table, by_content, positions = step.coverage
        if positions is not None and table.missing == "error":
            table.count_uncovered(step.forced, positions, by_content=by_content)
        if torch.compiler.is_compiling() or is_capturing():
            return
        if table.device.type == "cuda":
            table.snapshot_uncovered()
        else:  # host memory: reading it waits for nothing, so this forward raises itself
            table.check_uncovered(self.layer_names(), block=True)

    # ---------------------------------------------------------------- routing mismatch
    def track_mismatch(self, enabled: bool) -> None:
        """Counters on (zeroed) or off."""
        self.mismatch = (
            torch.zeros(len(self.layers), 3, dtype=torch.int64, device=model_device(self.model))
            if enabled
            else None
        )

    def count_mismatch(self, index: int, logits: torch.Tensor, forced: torch.Tensor, used: torch.Tensor,
                       routing: RoutingConfig, backend: str) -> None:  # fmt: skip
        if self.mismatch is None:
            return
        if self.mismatch.device != logits.device:
            self.mismatch = self.mismatch.to(logits.device)
        with torch.no_grad():
            native = route(logits.detach(), routing=routing, backend=backend).topk_ids
            replayed = forced[:, 0] >= 0
            want = torch.sort(forced.long(), dim=1).values
            differs_native = (torch.sort(native.long(), dim=1).values != want).any(dim=1) & replayed
            differs_used = (torch.sort(used.long(), dim=1).values != want).any(dim=1) & replayed
            row = torch.stack([replayed.sum(), differs_native.sum(), differs_used.sum()])
            self.mismatch[index].add_(row)

    def read_mismatch(self, reset: bool) -> dict:
        """``mismatch()``: the counters as fractions (one host sync)."""
        if self.mismatch is None:
            fail("track_mismatch", "on (call track_mismatch() first)", "off", what="state")
        self.raise_uncovered()
        n, native, used = (int(v) for v in self.mismatch.sum(dim=0).tolist())
        if reset:
            self.mismatch.zero_()
        return {
            "tokens": n,
            "native_vs_rollout": native / n if n else 0.0,
            "replayed_vs_rollout": used / n if n else 0.0,
        }

    # ---------------------------------------------------------------- aux loss
    def aux_ids(self, gate_logits: Any) -> Optional[list]:
        """The load-balancing loss's provider (:mod:`replaymoe.hf.aux_loss`): for the router logits
        of this model's latest replayed forward (matched by identity), the ids its routers used;
        None otherwise (transformers' own function runs)."""
        used = self.used
        if not isinstance(gate_logits, (tuple, list)) or len(gate_logits) != len(self.layers) or not used:
            return None
        if len(used) != len(self.layers) or any(gate_logits[i] is not used[i][0] for i in range(len(used))):
            return None
        return [used[i][1] for i in range(len(used))]

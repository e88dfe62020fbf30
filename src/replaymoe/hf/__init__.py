"""Hugging Face ``transformers`` integration: fused experts, routing through replaymoe, capture and replay.

Two entry points:

``experts_implementation="replaymoe"``
    Importing this module registers :func:`replaymoe_experts_forward` in transformers' experts
    registry (``transformers.integrations.moe.ExpertsInterface``), so the usual switch works::

        import replaymoe.hf  # registers "replaymoe"
        model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="replaymoe")
        model.set_experts_implementation("replaymoe")          # or switch a loaded model

    This replaces the experts' compute only (routers stay the model's own).

:func:`enable`
    Patches a loaded model in place: experts as above, every router through
    :func:`replaymoe.routing.route` with the matching :class:`~replaymoe.routing.RoutingMethod`,
    and optional routing **capture** (one :class:`~replaymoe.trace.RoutingTrace` per sequence) and
    **replay** (forced expert ids per layer with weights recomputed from the model's own router
    logits, so gradients reach the router — the "rollout routing replay" (R3) recipe)::

        moe = replaymoe.hf.enable(model, capture=True)
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        traces = moe.traces()                    # list[RoutingTrace], one per batch row
        moe.set_capture(False)
        with moe.replaying(traces):              # the trainer forward
            logits = model(full_ids, attention_mask=full_mask).logits
        moe.disable()                            # restores the model

Supported architectures (transformers 5.17) and how each router maps
-------------------------------------------------------------------------
=====================  ==========================  =================================================
router class           method                      notes
=====================  ==========================  =================================================
Qwen3MoeTopKRouter     RENORMALIZE if              softmax -> top-k (-> renormalise); weights cast
Qwen2MoeTopKRouter     ``norm_topk_prob`` else     to the logits' dtype as the model does. Qwen2-MoE's
OlmoeTopKRouter        DEFAULT                     shared expert is left to the model.
MixtralTopKRouter      RENORMALIZE                 softmax -> top-k -> renormalise; fp32 weights.
DeepseekV3TopkRouter   DEEPSEEK_V3                 fp32 logits; ``bias = e_score_correction_bias``,
Glm4MoeTopkRouter                                  ``n_group``, ``topk_group``,
                                                   ``routed_scaling_factor``. With
                                                   ``norm_topk_prob=False`` the ids come from
                                                   route() and the weights are
                                                   ``sigmoid(x)[ids] * scale`` (no renorm). Dense
                                                   first layers are not MoE layers (layer_ids).
GptOssTopKRouter       RENORMALIZE                 logits include the router bias; top-k on logits,
                                                   softmax over the k. Experts are interleaved,
                                                   transposed, biased and use a clamped SwiGLU, which
                                                   fused_moe does not implement: they stay on
                                                   transformers' ``grouped_mm``.
=====================  ==========================  =================================================

Column order: replaymoe returns ids in descending selection-score order (ties to the smaller
index), as ``torch.topk(sorted=True)``; DeepSeek-V3/GLM4's own router uses ``sorted=False``, so
its column order may differ while the sets and the sums are the same.

Experts compute (:func:`replaymoe_experts_forward`)
---------------------------------------------------
* When no gradient is needed (``torch.no_grad()``, ``generate``): :func:`replaymoe.moe.fused_moe`,
  the Triton kernels on CUDA and the torch reference elsewhere (``backend="auto"``; override with
  ``enable(..., backend=...)``). fp32 weights on CUDA use the torch reference (the kernels take
  bf16/fp16).
* When a gradient is needed (training forwards): fused_moe is not differentiable in this version,
  so the experts run through transformers' own differentiable ``grouped_mm`` implementation with
  replaymoe's ids and weights (the weights carry the router's gradient).
* Experts whose layout fused_moe does not take (biased, transposed, interleaved, non-SiLU) always
  run through ``grouped_mm``.

Positions, capture and replay
-----------------------------
A pre-forward hook on the decoder stack (``model.base_model``) reads ``attention_mask`` and the
cache length of every forward and derives each token's **position in its sequence with padding
excluded**: ``cumsum(attention_mask) - 1`` over the full mask (``-1`` for padding, so left padding
in ``generate`` and right padding in a trainer batch both work); without a 2-D mask the positions
are ``past_length + arange(S)``. Batch row ``b`` is sequence ``b``.

* Capture uses :class:`~replaymoe.capture.RoutedExpertsCapturer`: every router writes its ids into
  the capturer's per-layer buffer through ``route(..., routing_replay_out=...)``; the step ends with
  the (row, position) of each token, padding ignored. A forward with an empty cache starts a new
  batch of sequences. :meth:`ReplayMoE.traces` returns one trace per sequence: prompt and completion
  positions, ``ids int16 [N, L, K]`` with the model's real layer numbers in ``layer_ids``. As in
  vLLM, the last generated token has no routing (it was never fed back), so ``N`` is
  ``len(prompt) + len(completion) - 1``.
* Replay: :class:`~replaymoe.replay.ReplaySource` gives each layer's ids for the positions of the
  forward (``-1`` rows, e.g. positions past the trace's end or padding, are routed natively inside
  ``route``); ``route(..., replay_ids=...)`` forces them and recomputes the weights from this
  model's logits, differentiably. A trace is matched to the model's MoE layers by ``layer_ids``.
  A trace without ``layer_ids`` is matched in MoE-layer order. Replay needs one trace per batch
  row, in batch order; ``report()`` (inside ``replaying``) tells how many tokens fell back.
* Gradient checkpointing: a recomputed layer (called outside the model's forward) reuses the ids of
  that layer's last forward when the token count matches, so recomputation sees the same routing.

Limits: capture assumes each batch row stays one sequence for the whole ``generate`` (greedy or
sampling, ``num_return_sequences`` included; beam search reorders rows and is not supported) and a
KV cache (``use_cache=True``, the default: without it every step is a new full-sequence forward and
yields its own traces). Padded batches need their ``attention_mask`` (positions come from it).
Layers placed on other devices than the first (``device_map``) capture through a staging copy.
The patch is eager-mode Python (hooks, a host read of the positions per forward for capture): it is
not meant for ``torch.compile``/CUDA-graph generation; the kernels underneath are graph-safe.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from replaymoe._validation import check_choice, check_int, fail
from replaymoe.routing import RoutingMethod, route

__all__ = [
    "IMPLEMENTATION_NAME",
    "SUPPORTED_ROUTERS",
    "ReplayMoE",
    "MoELayerInfo",
    "enable",
    "find_moe_layers",
    "register",
    "replaymoe_experts_forward",
    "token_positions",
]

IMPLEMENTATION_NAME = "replaymoe"
_BACKENDS = ("auto", "triton", "torch")


# --------------------------------------------------------------------------------------------------
# router specifications
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RouterSpec:
    """How one transformers router class maps onto :func:`replaymoe.routing.route`."""

    family: str  # "softmax" | "mixtral" | "deepseek" | "gptoss"

    def method(self, router: nn.Module) -> RoutingMethod:
        if self.family == "softmax":
            return RoutingMethod.RENORMALIZE if router.norm_topk_prob else RoutingMethod.DEFAULT
        if self.family == "deepseek":
            return RoutingMethod.DEEPSEEK_V3
        return RoutingMethod.RENORMALIZE

    def logits(self, router: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.reshape(-1, router.hidden_dim)
        if self.family == "deepseek":
            return F.linear(h.type(torch.float32), router.weight.type(torch.float32))
        if self.family == "gptoss":
            return F.linear(h, router.weight, router.bias)
        return F.linear(h, router.weight)

    def route_kwargs(self, router: nn.Module) -> dict[str, Any]:
        if self.family != "deepseek":
            return {}
        n_group = int(router.num_group or 1)
        return {
            "bias": router.e_score_correction_bias,
            "n_group": n_group,
            "topk_group": int(router.topk_group or 1) if n_group > 1 else None,
            "routed_scaling_factor": float(router.routed_scaling_factor),
        }

    def weights(
        self, router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The weights the model's own router would return for ``ids``, in its dtype."""
        if self.family == "deepseek":
            if not router.norm_topk_prob:
                return torch.sigmoid(logits.float()).gather(1, ids.long()) * float(
                    router.routed_scaling_factor
                )
            return weights
        if self.family == "mixtral":
            return weights
        return weights.to(logits.dtype)


SUPPORTED_ROUTERS: dict[str, _RouterSpec] = {
    "Qwen3MoeTopKRouter": _RouterSpec("softmax"),
    "Qwen2MoeTopKRouter": _RouterSpec("softmax"),
    "OlmoeTopKRouter": _RouterSpec("softmax"),
    "MixtralTopKRouter": _RouterSpec("mixtral"),
    "DeepseekV3TopkRouter": _RouterSpec("deepseek"),
    "Glm4MoeTopkRouter": _RouterSpec("deepseek"),
    "GptOssTopKRouter": _RouterSpec("gptoss"),
}


# --------------------------------------------------------------------------------------------------
# experts implementation (registry)
# --------------------------------------------------------------------------------------------------


def _fused_compatible(experts: nn.Module) -> bool:
    """True when ``experts`` holds gate-first ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` + SiLU."""
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False):
        return False
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return False
    if type(experts)._apply_gate is not _default_apply_gate():
        return False
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3:
        return False
    E, two_i, H = w13.shape
    if tuple(w2.shape) != (E, H, two_i // 2):
        return False
    # nn.SiLU or transformers' SiLUActivation (ACT2FN["silu"])
    return type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")


def _default_apply_gate() -> Callable:
    from transformers.integrations import moe as hf_moe

    return hf_moe._default_apply_gate


def _grouped_mm_forward(experts, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden_states, top_k_index, top_k_weights)


def replaymoe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"replaymoe"`` experts implementation (registered in transformers' ``ExpertsInterface``).

    Parameters
    ----------
    self : nn.Module
        A transformers experts module (``gate_up_proj [E, 2I, H]`` gate-first, ``down_proj [E, H, I]``).
    hidden_states : torch.Tensor
        ``[T, H]`` activations.
    top_k_index : torch.Tensor
        ``[T, K]`` integer expert ids.
    top_k_weights : torch.Tensor
        ``[T, K]`` routing weights.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in ``hidden_states.dtype``: ``Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))``.

    Without a gradient this is :func:`replaymoe.moe.fused_moe` (backend from
    ``self._replaymoe_backend``, default ``"auto"``); with one, or for expert layouts fused_moe does not
    take, transformers' differentiable ``grouped_mm`` implementation (module docstring).
    """
    needs_grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad or top_k_weights.requires_grad or self.gate_up_proj.requires_grad
    )
    if needs_grad or not _fused_compatible(self):
        return _grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)
    from replaymoe.moe import fused_moe

    w13, w2 = self.gate_up_proj, self.down_proj
    backend = getattr(self, "_replaymoe_backend", "auto")
    if backend == "auto" and w13.is_cuda and w13.dtype == torch.float32:
        backend = "torch"  # the kernels take bf16/fp16
    x = hidden_states.to(w13.dtype)
    out = fused_moe(
        x,
        w13,
        w2,
        topk_ids=top_k_index.to(torch.int32),
        topk_weights=top_k_weights.float(),
        backend=backend,
    )
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``"replaymoe"`` in transformers' experts registry (done on import; idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, replaymoe_experts_forward)


register()


# --------------------------------------------------------------------------------------------------
# model discovery
# --------------------------------------------------------------------------------------------------


@dataclass
class MoELayerInfo:
    """One MoE block of a model.

    Attributes
    ----------
    index : int
        MoE-layer index (0-based over the model's MoE blocks, in forward order).
    layer_number : int
        The decoder layer number in the model (``model.layers.{n}``): trace ``layer_ids`` use it.
    name : str
        Module path of the block.
    router, experts : nn.Module
        The block's router (gate) and experts modules.
    """

    index: int
    layer_number: int
    name: str
    router: nn.Module
    experts: nn.Module
    spec: _RouterSpec = field(repr=False)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_moe_layers(model: nn.Module) -> list[MoELayerInfo]:
    """The supported MoE blocks of ``model`` (sorted by layer number).

    Raises
    ------
    ValueError
        When the model has no supported MoE router (the message lists the supported classes).
    """
    found = []
    for name, module in model.named_modules():
        for attr in ("gate", "router"):
            router = getattr(module, attr, None)
            experts = getattr(module, "experts", None)
            if router is None or experts is None or type(router).__name__ not in SUPPORTED_ROUTERS:
                continue
            m = _LAYER_RE.search(name + ".")
            number = int(m.group(1)) if m else len(found)
            found.append((number, name, router, experts, SUPPORTED_ROUTERS[type(router).__name__]))
    if not found:
        routers = sorted({type(m).__name__ for m in model.modules() if "Router" in type(m).__name__})
        fail(
            "model",
            "a transformers MoE model with one of the routers " + ", ".join(SUPPORTED_ROUTERS),
            f"{type(model).__name__} (router classes found: {routers or 'none'})",
            what="architecture",
        )
    found.sort(key=lambda x: x[0])
    return [MoELayerInfo(i, n, name, r, e, s) for i, (n, name, r, e, s) in enumerate(found)]


def token_positions(
    batch_size: int,
    seq_len: int,
    *,
    attention_mask: Optional[torch.Tensor],
    past_length: int,
    device: torch.device,
) -> torch.Tensor:
    """Positions ``int64 [B, S]`` of a forward's tokens in their sequences, padding excluded (-1).

    With a 2-D ``attention_mask`` ``[B, P]`` covering the cached and the new tokens (what
    ``generate`` passes; ``P = past_length + S``), the position of a kept token is the number of
    kept tokens before it; padded tokens get -1. Columns missing at the mask's left (``P <
    past_length + S``) are taken as unpadded. Otherwise the positions are ``past_length + arange(S)``.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= seq_len:
        m = attention_mask.to(device=device).bool()
        offset = past_length + seq_len - m.shape[1]
        pos = m.long().cumsum(1) - 1 + offset
        pos = pos[:, -seq_len:]
        return torch.where(m[:, -seq_len:], pos, torch.full_like(pos, -1))
    base = torch.arange(past_length, past_length + seq_len, device=device, dtype=torch.int64)
    return base.unsqueeze(0).expand(batch_size, seq_len).contiguous()


# --------------------------------------------------------------------------------------------------
# the patched model
# --------------------------------------------------------------------------------------------------


@dataclass
class _Step:
    positions: torch.Tensor  # int64 [B, S] on the model's device, -1 = padding
    batch_size: int
    seq_len: int
    epoch: int


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
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        experts: bool = True,
        max_num_tokens: int = 8192,
    ) -> None:
        check_choice("backend", backend, _BACKENDS)
        check_int("max_num_tokens", max_num_tokens, low=1)
        if getattr(model, "_replaymoe", None) is not None:
            fail("model", "a model without replaymoe enabled (call .disable() first)", "already enabled")
        self.model = model
        self.backend = backend
        self.layers = find_moe_layers(model)
        ks = {int(info.router.top_k) for info in self.layers}
        es = {int(info.router.num_experts) for info in self.layers}
        if len(ks) != 1 or len(es) != 1:
            fail("model", "the same top_k and num_experts in every MoE layer", f"top_k {ks}, experts {es}")
        self.top_k, self.num_experts = ks.pop(), es.pop()
        self.layer_ids = [info.layer_number for info in self.layers]
        self.model_id = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "") or str(
            getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        )
        self._max_num_tokens = max_num_tokens
        self._step: Optional[_Step] = None
        self._epoch = 0
        self._capture = False
        self._capturer = None
        self._capturer_device: Optional[torch.device] = None
        # request ids not finished yet (ordered) -> whether any of its tokens was recorded
        self._pending: dict[Any, bool] = {}
        self._finished: list[Any] = []  # RoutingTrace list, in order
        self._replay = None  # ReplaySource
        self._trace_layer: list[int] = []
        self._last_ids: dict[int, tuple[int, Optional[torch.Tensor]]] = {}
        self._prev_impl: Optional[str] = None
        self._hooks: list[Any] = []
        self._patch(experts)
        model._replaymoe = self

    # ---------------------------------------------------------------- patching
    def _patch(self, experts: bool) -> None:
        for info in self.layers:
            router = info.router
            router._replaymoe_info = info
            router.forward = types.MethodType(_make_router_forward(self, info), router)
            info.experts._replaymoe_backend = self.backend
        config = getattr(self.model, "config", None)
        if experts and config is not None and hasattr(self.model, "set_experts_implementation"):
            if any(_fused_compatible(info.experts) for info in self.layers):
                self._prev_impl = config._experts_implementation
                self.model.set_experts_implementation(IMPLEMENTATION_NAME)
        stack = getattr(self.model, "base_model", self.model)
        self._hooks.append(stack.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._hooks.append(
            stack.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        )

    def disable(self) -> None:
        """Undo :func:`enable`: original routers and experts implementation, hooks removed."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for info in self.layers:
            info.router.__dict__.pop("forward", None)
            info.router.__dict__.pop("_replaymoe_info", None)
            info.experts.__dict__.pop("_replaymoe_backend", None)
        if self._prev_impl is not None:
            self.model.set_experts_implementation(self._prev_impl)
        self.model._replaymoe = None
        self._step = None

    # ---------------------------------------------------------------- forward context
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        if ref is None or ref.dim() < 2:
            self._step = None
            return
        B, S = int(ref.shape[0]), int(ref.shape[1])
        cache = kwargs.get("past_key_values")
        past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        device = ref.device
        positions = token_positions(
            B, S, attention_mask=kwargs.get("attention_mask"), past_length=past, device=device
        )
        if past == 0:
            self._epoch += 1
        self._step = _Step(positions, B, S, self._epoch)
        if self._capture:
            self._prepare_capturer(B * S, device, new_batch=past == 0)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step, self._step = self._step, None
        if step is None or not self._capture or self._capturer is None:
            return
        pos = step.positions.reshape(-1).tolist()
        requests = [None if p < 0 else (step.epoch, i // step.seq_len) for i, p in enumerate(pos)]
        for b in range(step.batch_size):  # every row is a sequence, even one that is all padding
            self._pending.setdefault((step.epoch, b), False)
        for r in requests:
            if r is not None:
                self._pending[r] = True
        self._capturer.end_step(requests, pos)

    # ---------------------------------------------------------------- capture
    def _prepare_capturer(self, num_tokens: int, device: torch.device, *, new_batch: bool) -> None:
        cap = self._capturer
        fits = cap is not None and num_tokens <= self._max_num_tokens and self._capturer_device == device
        if fits:
            return
        if cap is not None and not new_batch:
            fail(
                "max_num_tokens",
                f">= {num_tokens} tokens in one forward (enable(..., max_num_tokens=...))",
                self._max_num_tokens,
            )
        self._finish_pending()
        from replaymoe.capture import RoutedExpertsCapturer

        self._max_num_tokens = max(self._max_num_tokens, num_tokens)
        self._capturer = RoutedExpertsCapturer(
            len(self.layers),
            self._max_num_tokens,
            self.top_k,
            device=device,
            layer_ids=list(self.layer_ids),
            num_experts=self.num_experts,
            model_id=self.model_id,
        )
        self._capturer_device = device

    def _finish_pending(self) -> None:
        if self._capturer is None:
            return
        from replaymoe.trace import RoutingTrace

        cap = self._capturer
        for r, recorded in list(self._pending.items()):
            if recorded:
                self._finished.append(cap.finish(r))
            else:  # a row that was padding only: an empty trace keeps traces() aligned with rows
                empty = np.empty((0, cap.num_layers, cap.top_k), dtype=np.int16)
                self._finished.append(
                    RoutingTrace(
                        empty,
                        num_experts=cap.num_experts,
                        top_k=cap.top_k,
                        layer_ids=cap.layer_ids,
                        model_id=cap.model_id,
                    )
                )
        self._pending.clear()

    def set_capture(self, enabled: bool) -> None:
        """Turn capture on or off (traces captured so far stay available)."""
        if not isinstance(enabled, bool):
            fail("enabled", "a bool", type(enabled).__name__, what="type")
        if not enabled:
            self._finish_pending()
        self._capture = enabled

    def traces(self, num_positions: Sequence[int] | None = None) -> list:
        """All sequences captured since the last call, one ``RoutingTrace`` each, in (forward, row) order.

        A forward with an empty cache (``generate``'s prefill, a training forward) starts a new
        batch; its row ``b`` is one sequence (a row that was all padding gives an empty trace).
        Positions are unpadded; the trace covers every position that went through the model.

        Parameters
        ----------
        num_positions : sequence of int, optional
            One length per returned trace: each trace is cut to (or padded with -1 to) that many
            positions. ``generate`` keeps feeding pad tokens, with attention mask 1, to rows that
            already reached EOS, and those positions are captured too; pass
            ``len(prompt) + len(completion up to and including EOS) - 1`` per row to drop them.
        """
        self._finish_pending()
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
    def set_replay(self, replay: Any) -> None:
        """Replay ``replay`` (``RoutingTrace``, list of them — one per batch row — or ``ReplaySource``;
        None stops replaying) in the following forwards.

        Raises
        ------
        ValueError
            When the trace's top_k or num_experts differs from the model's, or its layers do not
            match the model's MoE layers (by ``layer_ids`` when the trace has them, else by count).
        """
        self._last_ids.clear()
        if replay is None:
            self._replay = None
            self._trace_layer = []
            return
        from replaymoe.replay import ReplaySource

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
        self._replay = src
        self._trace_layer = mapping

    @contextlib.contextmanager
    def replaying(self, replay: Any) -> Iterator[ReplayMoE]:
        """Context manager: :meth:`set_replay` inside, the previous replay restored after."""
        prev, prev_map = self._replay, self._trace_layer
        self.set_replay(replay)
        try:
            yield self
        finally:
            self._replay, self._trace_layer = prev, prev_map
            self._last_ids.clear()

    def report(self) -> Any:
        """The replay source's report (tokens/layers replayed vs fallen back), or None."""
        return None if self._replay is None else self._replay.report()

    # ---------------------------------------------------------------- per layer
    def _layer_io(
        self, info: MoELayerInfo, num_tokens: int, device: torch.device
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(replay_ids int32 [T, K] or None, capture buffer int16 [N, K] or None) for one router call."""
        step = self._step
        if step is None:
            # outside the model's forward: a gradient-checkpointing recompute; reuse the last ids
            last = self._last_ids.get(info.index)
            if last is not None and last[0] == num_tokens:
                return last[1], None
            if self._replay is not None:
                fail(
                    "replay",
                    "MoE layers called inside the model's forward (positions unknown otherwise)",
                    f"a direct call of {info.name}",
                    what="context",
                )
            return None, None
        if step.batch_size * step.seq_len != num_tokens:
            fail(
                "hidden_states",
                f"{step.batch_size * step.seq_len} tokens (batch {step.batch_size} x {step.seq_len})",
                f"{num_tokens} tokens at {info.name}",
                what="shape",
            )
        ids = None
        if self._replay is not None:
            if self._replay.batch_size != step.batch_size:
                fail(
                    "replay",
                    f"one trace per batch row ({step.batch_size} rows in this forward)",
                    f"{self._replay.batch_size} trace(s)",
                )
            ids = self._replay.ids_for(self._trace_layer[info.index], step.positions, device=device)
        cap = None
        if self._capture and self._capturer is not None:
            cap = self._capturer.layer_buffer(info.index)
        self._last_ids[info.index] = (num_tokens, ids)
        return ids, cap


def _make_router_forward(state: ReplayMoE, info: MoELayerInfo) -> Callable:
    spec = info.spec

    def forward(router: nn.Module, hidden_states: torch.Tensor):
        logits = spec.logits(router, hidden_states)
        T = logits.shape[0]
        replay_ids, capture_out = state._layer_io(info, T, logits.device)
        staged = None
        if capture_out is not None and capture_out.device != logits.device:
            # layer on another device than the capture buffer (device_map): capture here, copy over
            staged = torch.empty((T, capture_out.shape[1]), dtype=torch.int16, device=logits.device)
        out = route(
            logits,
            int(router.top_k),
            spec.method(router),
            routing_replay_out=capture_out if staged is None else staged,
            replay_ids=replay_ids,
            backend=state.backend,
            **spec.route_kwargs(router),
        )
        if staged is not None:
            capture_out[:T].copy_(staged)
        weights = spec.weights(router, logits, out.topk_ids, out.topk_weights)
        return logits, weights, out.topk_ids.long()

    return forward


def enable(
    model: nn.Module,
    *,
    capture: bool = False,
    replay: Any = None,
    backend: str = "auto",
    experts: bool = True,
    max_num_tokens: int = 8192,
) -> ReplayMoE:
    """Route a transformers MoE model through replaymoe, with optional capture and replay.

    Parameters
    ----------
    model : nn.Module
        A transformers model of a supported architecture (module docstring), patched in place.
    capture : bool
        Record every MoE layer's ids in every forward (``generate`` included); read them with
        :meth:`ReplayMoE.traces`.
    replay : RoutingTrace | list[RoutingTrace] | ReplaySource, optional
        Force these ids (batch row ``b`` = trace ``b``); -1 rows route natively. Change later with
        :meth:`ReplayMoE.set_replay` or :meth:`ReplayMoE.replaying`.
    backend : {"auto", "triton", "torch"}
        Routing and fused-experts backend: ``auto`` = Triton kernels on CUDA, torch references
        elsewhere.
    experts : bool
        Also switch the experts to ``experts_implementation="replaymoe"`` (when their layout fits).
    max_num_tokens : int
        Initial capture buffer size in tokens per forward (grows at the start of a new batch).

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
    if not isinstance(capture, bool):
        fail("capture", "a bool", type(capture).__name__, what="type")
    state = ReplayMoE(model, backend=backend, experts=experts, max_num_tokens=max_num_tokens)
    try:
        state.set_capture(capture)
        if replay is not None:
            state.set_replay(replay)
    except Exception:
        state.disable()
        raise
    return state

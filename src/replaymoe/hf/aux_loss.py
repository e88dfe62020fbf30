"""The MoE load-balancing aux loss on the expert ids a forward actually used (routing replay).

transformers computes the Switch-Transformer load-balancing loss (``output_router_logits=True``)
in ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``, one copy per
modeling file, and takes the experts of every token from its own ``torch.topk`` of
``softmax(gate_logits)``. Under rollout routing replay the routers use *recorded* ids instead, so
that count term is wrong. :func:`load_balancing_loss` is the same formula on given ids, and
:func:`install` swaps a modeling module's ``load_balancing_loss_func`` for a wrapper that asks a
provider for the ids of the logits it is given (and calls the original where no provider knows
them).

What the function is, in transformers 5.17 (checked by ``tests/test_hf_aux_loss.py``)
-----------------------------------------------------------------------------------
* Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS (and 22 other MoE modeling files: DBRX, Jamba,
  Granite-MoE, PhiMoE, ...) hold byte-identical copies (the modular system copies Mixtral's).
  It softmaxes every layer's logits *in their own dtype* (bf16 logits: a bf16 softmax), takes
  ``topk`` of that, and pools counts and probabilities over all layers before the product:
  ``E * sum_e f_e * P_e`` with ``f_e = (sum_layers sum_tokens [e selected]) / (L * T)`` and
  ``P_e = (sum_layers sum_tokens p_e) / (L * T)`` (tokens weighted by the attention mask when one
  is given: ``T = mask.sum()``) -- the product of the pooled means, *not* a sum of per-layer
  losses. The routers themselves select differently from the loss: Qwen/OLMoE/Mixtral softmax in
  fp32, GPT-OSS takes ``topk`` of the raw logits and softmaxes only the top-k. So even without
  replay, bf16 logits can make the loss's ids differ from the routed ones at near-ties.
* DeepSeek-V3 and GLM4-MoE have none (sigmoid scores with a bias-based, loss-free balancing; their
  configs have no ``output_router_logits``), so there is nothing to install for them.
* Switch-Transformers, NLLB-MoE and Doge have their own, different functions; not handled here.

TRL 1.16
--------
Every TRL trainer (GRPO, RLOO, SFT, DPO, KTO) patches the model with
``trl.trainer.utils.add_fused_lm_head``; its forward with ``fused_lm_head=True`` runs the backbone
and computes the aux loss itself, with ``from transformers.models.mixtral.modeling_mixtral import
load_balancing_loss_func`` *inside the forward*, i.e. Mixtral's module attribute looked up at call
time, for every architecture. So a replayed forward through TRL needs :func:`install` on
``modeling_mixtral`` as well as on the model's own module; :func:`target_modules` lists both.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

__all__ = ["FUNC_NAME", "install", "load_balancing_loss", "target_modules"]

FUNC_NAME = "load_balancing_loss_func"

# the module whose function TRL's fused LM head calls, for every architecture
_TRL_MODULE = "transformers.models.mixtral.modeling_mixtral"

Provider = Callable[[Any], "Sequence[torch.Tensor] | None"]


def load_balancing_loss(
    gate_logits: Sequence[torch.Tensor],
    selected: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' load-balancing aux loss, counting the experts in ``selected``.

    The formula, dtypes, devices and attention-mask weighting of transformers'
    ``load_balancing_loss_func`` (identical in every modeling file that has one, see the module
    docstring); only the per-token experts come from ``selected`` instead of
    ``topk(softmax(logits))``. With ``selected[l] = topk(softmax(gate_logits[l]), top_k).indices``
    the result is bitwise transformers' own.

    Parameters
    ----------
    gate_logits : sequence of torch.Tensor
        One ``[T, E]`` floating tensor per MoE layer (``T = batch * seq_len`` rows, ``E`` =
        ``num_experts``), the router logits as the model returns them in ``router_logits``; any
        float dtype (softmaxed in that dtype, as transformers does), on any devices (moved to the
        first one's device, where the loss is computed).
    selected : sequence of torch.Tensor
        One ``[T, top_k]`` integer tensor per layer (any int dtype, any device): the expert ids that
        row actually used. A negative id (``-1``) is an empty slot: counted for no expert (the row
        still counts in the denominator).
    num_experts : int
        ``E``.
    top_k : int
        Experts per token; must equal each ``selected`` tensor's last dimension.
    attention_mask : torch.Tensor, optional
        ``[batch, seq_len]`` (any dtype, usually 0/1 int64; ``batch * seq_len == T``): every row
        is weighted by its mask value, in counts, probabilities and the number of rows, as in
        transformers. None: every row counts.

    Returns
    -------
    torch.Tensor
        0-dim float32 on the first logits' device: ``E * sum_e f_e * P_e``, with ``f_e`` the
        (mask-weighted) fraction of token-slots sent to expert ``e`` and ``P_e`` the mean router
        probability of ``e``, both pooled over all layers and rows. Differentiable in
        ``gate_logits`` (through ``P``).

    Raises
    ------
    ValueError
        On no layers, a different number of ``selected`` tensors than layers, a ``selected`` tensor
        not ``[T, top_k]`` for its layer's ``T``, or an id ``>= num_experts``.
    """
    gate_logits = tuple(gate_logits)
    selected = tuple(selected)
    if not gate_logits:
        raise ValueError("load_balancing_loss: no gate logits (zero MoE layers)")
    if len(selected) != len(gate_logits):
        raise ValueError(
            f"load_balancing_loss: {len(selected)} selected-id tensors for {len(gate_logits)} layers "
            "of gate logits"
        )

    # below: transformers' load_balancing_loss_func line for line (same ops, same order, so the same
    # bits), with the topk replaced by `selected` and the counts taken by a scatter_add that skips
    # empty (-1) slots. Counts are integer-valued in fp32, exact whatever the order of the adds.
    compute_device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    total_rows = 0.0

    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=compute_device, dtype=torch.float32)

    for layer, (layer_gate, ids) in enumerate(zip(gate_logits, selected)):
        rows = layer_gate.shape[0]
        if ids.dim() != 2 or ids.shape[0] != rows or ids.shape[1] != top_k:
            raise ValueError(
                f"load_balancing_loss: layer {layer}: selected ids of shape {tuple(ids.shape)}, "
                f"expected [{rows}, {top_k}] (its logits are {tuple(layer_gate.shape)}, top_k={top_k})"
            )
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise ValueError(
                f"load_balancing_loss: layer {layer}: selected ids must be integers, got {ids.dtype}"
            )
        ids = ids.to(device=compute_device, dtype=torch.long).reshape(-1)
        if ids.numel() and bool((ids >= num_experts).any()):
            raise ValueError(
                f"load_balancing_loss: layer {layer}: expert id {int(ids.max())} >= num_experts={num_experts}"
            )
        used = ids >= 0
        index = ids.clamp(min=0)

        routing_weights = torch.nn.functional.softmax(layer_gate.to(compute_device), dim=-1)
        if attention_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=compute_device
            ).scatter_add_(0, index, used.float())
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=compute_device
            ).scatter_add_(0, index, flat_mask.repeat_interleave(top_k) * used)
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()

    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows

    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


# --------------------------------------------------------------------------------------- patching


@dataclass
class _Patch:
    """One patched module: its original function, the single wrapper installed in its place, and
    the providers (``(token, provider)``, install order) the wrapper asks. ``providers`` is a
    tuple, replaced (never mutated) under ``_LOCK``, so a call reads a consistent snapshot."""

    original: Callable
    wrapper: Callable | None = None
    providers: tuple = field(default_factory=tuple)


_LOCK = threading.RLock()  # (re-entrant: a session collected while it is held uninstalls)
_PATCHES: weakref.WeakKeyDictionary[ModuleType, _Patch] = weakref.WeakKeyDictionary()


def _make_wrapper(patch: _Patch) -> Callable:
    original = patch.original

    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if isinstance(gate_logits, tuple) and gate_logits and num_experts is not None:
            for _, provider in patch.providers:
                selected = provider(gate_logits)
                if selected is not None:
                    return load_balancing_loss(gate_logits, selected, num_experts, top_k, attention_mask)
        return original(gate_logits, num_experts, top_k, attention_mask)

    load_balancing_loss_func._replaymoe_patch = patch  # type: ignore[attr-defined]
    return load_balancing_loss_func


def _chain_has(func: Any, target: Callable) -> bool:
    """``func`` is ``target``, or wraps it through ``__wrapped__`` links (functools.wraps)."""
    seen = 0
    while func is not None and seen < 64:
        if func is target:
            return True
        func, seen = getattr(func, "__wrapped__", None), seen + 1
    return False


def install(modeling_module: ModuleType, provider: Provider) -> Callable[[], None]:
    """Route ``modeling_module.load_balancing_loss_func`` through ``provider``'s expert ids.

    The first install on a module replaces its ``load_balancing_loss_func`` with one wrapper (same
    signature and ``__wrapped__`` = the original); later installs on it only add their provider.
    On a call the wrapper asks each provider, in install order, ``provider(gate_logits)``: the
    first that returns ids (a sequence of ``[T, top_k]`` int tensors, one per layer, as
    :func:`load_balancing_loss` takes) decides, and the loss is
    ``load_balancing_loss(gate_logits, ids, num_experts, top_k, attention_mask)``. When every
    provider returns None (logits of a forward none of them replayed), or the call is one the
    original answers with ``0`` (no tuple of logits), the original function is called unchanged.
    Exceptions of a provider propagate.

    The wrapper is looked up by the module's own ``*ForCausalLM.forward`` at call time (a module
    global), and by TRL's fused LM head through ``modeling_mixtral`` (see the module docstring).

    Parameters
    ----------
    modeling_module : module
        A transformers modeling module with a ``load_balancing_loss_func`` (e.g.
        ``transformers.models.qwen3_moe.modeling_qwen3_moe``).
    provider : callable
        ``provider(gate_logits: tuple[Tensor, ...]) -> Sequence[Tensor] | None``.

    Returns
    -------
    callable
        ``uninstall()``: removes this provider (idempotent). Installs stack in any order; when the
        last provider of a module goes, the original function object is put back -- unless someone
        else has since replaced the module attribute, which is then left alone (our wrapper, if
        still called through theirs, falls through to the original).

    Raises
    ------
    ValueError
        ``modeling_module`` has no ``load_balancing_loss_func`` (e.g. DeepSeek-V3, GLM4-MoE).
    RuntimeError
        The module's function was replaced, since our install, by one that does not wrap ours
        (e.g. a module reload): our providers would never be asked.
    """
    if not callable(provider):
        raise TypeError(f"install: provider must be callable, got {type(provider).__name__}")
    token = object()
    with _LOCK:
        current = getattr(modeling_module, FUNC_NAME, None)
        if current is None:
            raise ValueError(
                f"install: {getattr(modeling_module, '__name__', modeling_module)!r} has no {FUNC_NAME} "
                "(this architecture computes no load-balancing aux loss)"
            )
        patch = _PATCHES.get(modeling_module)
        if patch is None:
            patch = _Patch(original=current)
            patch.wrapper = _make_wrapper(patch)
            setattr(modeling_module, FUNC_NAME, patch.wrapper)
            _PATCHES[modeling_module] = patch
        elif not _chain_has(current, patch.wrapper):
            raise RuntimeError(
                f"install: {modeling_module.__name__}.{FUNC_NAME} was replaced by {current!r} after "
                "replaymoe patched it, and does not call replaymoe's wrapper"
            )
        patch.providers = patch.providers + ((token, provider),)

    def uninstall() -> None:
        with _LOCK:
            if _PATCHES.get(modeling_module) is not patch:
                return
            kept = tuple(p for p in patch.providers if p[0] is not token)
            if len(kept) == len(patch.providers):
                return  # already uninstalled
            patch.providers = kept
            if kept:
                return
            del _PATCHES[modeling_module]
            if getattr(modeling_module, FUNC_NAME, None) is patch.wrapper:
                setattr(modeling_module, FUNC_NAME, patch.original)

    return uninstall


def target_modules(model: torch.nn.Module) -> list[ModuleType]:
    """The modeling modules whose ``load_balancing_loss_func`` computes ``model``'s aux loss.

    The module of the first (sub)module class, searched through ``model.modules()`` and each
    class's MRO (so PEFT and FSDP2 wrappers are seen through), that has one -- and then also
    ``modeling_mixtral``, whose function TRL's fused LM head calls for every architecture. Empty
    for models without an aux loss (DeepSeek-V3, GLM4-MoE, dense models).
    """
    found: ModuleType | None = None
    for sub in model.modules():
        for cls in type(sub).__mro__:
            mod = sys.modules.get(cls.__module__)
            if mod is not None and callable(getattr(mod, FUNC_NAME, None)):
                found = mod
                break
        if found is not None:
            break
    if found is None:
        return []
    import importlib

    trl_module = importlib.import_module(_TRL_MODULE)
    return [found] if trl_module is found else [found, trl_module]

"""The ``"replaymoe"`` experts implementation for transformers' ``ExpertsInterface``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["IMPLEMENTATION_NAME", "fused_compatible", "register", "replaymoe_experts_forward"]

IMPLEMENTATION_NAME = "replaymoe"


def _default_apply_gate() -> Callable:
    from transformers.integrations import moe as hf_moe

    return hf_moe._default_apply_gate


def _check_fused_compatible(experts: nn.Module) -> bool:
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


def fused_compatible(experts: nn.Module) -> bool:
    """True when ``experts`` holds gate-first ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` + SiLU.

    The answer is cached on the module (``_replaymoe_fused``): the layout of a module's weights
    does not change while it is in use, and a forward should not pay for the check.
    """
    cached = experts.__dict__.get("_replaymoe_fused")
    if cached is None:
        cached = _check_fused_compatible(experts)
        experts.__dict__["_replaymoe_fused"] = cached
    return cached


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
        ``[T, K]`` integer expert ids (int32 or int64).
    top_k_weights : torch.Tensor
        ``[T, K]`` routing weights.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in ``hidden_states.dtype``: ``Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))``.

    Fused-compatible experts run :func:`replaymoe.moe.fused_moe` (backend from
    ``self._replaymoe_backend``, default ``"auto"``; fp32 weights on CUDA take the torch
    reference, the kernels being bf16/fp16), with or without a gradient. Other layouts (biased,
    transposed, interleaved, non-SiLU: gpt-oss) run transformers' ``grouped_mm`` implementation.
    """
    if not fused_compatible(self):
        return _grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)
    from replaymoe.moe import fused_moe

    w13, w2 = self.gate_up_proj, self.down_proj
    backend = self.__dict__.get("_replaymoe_backend", "auto")
    if backend == "auto" and w13.is_cuda and w13.dtype == torch.float32:
        backend = "torch"  # the kernels take bf16/fp16
    ids = top_k_index if top_k_index.dtype == torch.int32 else top_k_index.to(torch.int32)
    weights = top_k_weights if top_k_weights.dtype == torch.float32 else top_k_weights.float()
    x = hidden_states if hidden_states.dtype == w13.dtype else hidden_states.to(w13.dtype)
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=weights, backend=backend)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def register() -> None:
    """Register ``"replaymoe"`` in transformers' experts registry (done on import; idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, replaymoe_experts_forward)

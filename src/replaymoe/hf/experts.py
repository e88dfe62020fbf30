"""The ``"replaymoe"`` experts implementation for transformers' ``ExpertsInterface``.

Two layouts run :func:`replaymoe.moe.fused_moe`: the standard one (gate-first ``gate_up_proj
[E, 2I, H]``, ``down_proj [E, H, I]``, SiLU, no bias: Qwen3/Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3,
GLM4-MoE) and gpt-oss's (``GptOssExperts``: transposed ``gate_up_proj [E, H, 2I]`` with gate and up
columns interleaved, ``down_proj [E, I, H]``, biases on both, clamped SwiGLU), which is passed as
transposed views (no copy), its biases, ``gate_up_layout="interleaved"`` and
``ClampedSwiGLU(alpha, limit)``. Other layouts run transformers' ``grouped_mm``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["IMPLEMENTATION_NAME", "fused_compatible", "register", "replaymoe_experts_forward", "set_backend"]

IMPLEMENTATION_NAME = "replaymoe"
_BACKEND = "_replaymoe_backend"  # where set_backend keeps an experts module's backend (its __dict__)


def _default_apply_gate() -> Callable:
    from transformers.integrations import moe as hf_moe

    return hf_moe._default_apply_gate


def _gptoss_apply_gate() -> Callable | None:
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # pragma: no cover - a transformers without gpt-oss
        return None
    return GptOssExperts._apply_gate


def _gptoss_activation(experts: nn.Module):
    """``ClampedSwiGLU(alpha, limit)`` when ``experts`` is laid out as transformers' GptOssExperts
    (transposed, interleaved, biased, GptOss's ``_apply_gate``, the expected shapes); else None."""
    from replaymoe.moe import ClampedSwiGLU

    if not getattr(experts, "has_gate", True) or not getattr(experts, "has_bias", False):
        return None
    if not getattr(experts, "is_transposed", False) or getattr(experts, "is_concatenated", True):
        return None
    gate = _gptoss_apply_gate()
    if gate is None or type(experts)._apply_gate is not gate:
        return None
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    b13, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
    if not all(isinstance(t, torch.Tensor) for t in (w13, w2, b13, b2)) or w13.dim() != 3:
        return None
    E, H, two_i = w13.shape
    if two_i % 2 or tuple(w2.shape) != (E, two_i // 2, H):
        return None
    if tuple(b13.shape) != (E, two_i) or tuple(b2.shape) != (E, H):
        return None
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    try:
        return ClampedSwiGLU(alpha, limit)
    except ValueError:
        return None


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
    """True when ``experts`` holds gate-first ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` +
    SiLU, or is laid out as transformers' ``GptOssExperts`` (see the module docstring).

    The answer is cached on the module (``_replaymoe_fused``, and gpt-oss's activation in
    ``_replaymoe_gptoss``): the layout of a module's weights does not change while it is in use,
    and a forward should not pay for the check.
    """
    cached = experts.__dict__.get("_replaymoe_fused")
    if cached is None:
        act = _gptoss_activation(experts)
        cached = act is not None or _check_fused_compatible(experts)
        experts.__dict__["_replaymoe_gptoss"] = act
        experts.__dict__["_replaymoe_fused"] = cached
    return cached


def _grouped_mm_forward(experts, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden_states, top_k_index, top_k_weights)


_HALF = (torch.bfloat16, torch.float16)


def _direct_ok(x, w13, w2, ids, weights) -> bool:
    """This call is one the Triton executors take as it is (the preconditions of
    :func:`replaymoe.moe._forward.experts_triton` and :func:`replaymoe.moe._backward.experts_triton_train`
    for the standard experts, by metadata only: the weights' layout was checked once by
    :func:`fused_compatible`). Anything else goes through :func:`replaymoe.moe.fused_moe`, which checks
    every argument and names the wrong one. Not under ``torch.compile`` (which traces ``fused_moe``;
    host time does not matter there)."""
    if x.dim() != 2 or ids.dim() != 2 or not w13.is_cuda or x.dtype not in _HALF:
        return False
    T, H = x.shape
    dev = w13.device
    return (
        T > 0
        and x.dtype == w13.dtype == w2.dtype
        and H == w13.shape[2]
        and ids.shape[0] == T
        and ids.shape[1] <= w13.shape[0]
        and weights.shape == ids.shape
        and x.device == dev
        and w2.device == dev
        and ids.device == dev
        and weights.device == dev
        and not torch.compiler.is_compiling()
    )


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
        A transformers experts module (``gate_up_proj [E, 2I, H]`` gate-first, ``down_proj [E, H, I]``;
        or gpt-oss's ``gate_up_proj [E, H, 2I]`` interleaved, ``down_proj [E, I, H]`` and biases).
    hidden_states : torch.Tensor
        ``[T, H]`` activations.
    top_k_index : torch.Tensor
        ``[T, K]`` integer expert ids (int32 or int64).
    top_k_weights : torch.Tensor
        ``[T, K]`` routing weights.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in ``hidden_states.dtype``: ``Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x))``
        (gpt-oss: ``Σ_k w_k · (down_e(act(gate_up_e(x) + b)) + b_down)`` with its clamped SwiGLU).

    Fused-compatible experts run :func:`replaymoe.moe.fused_moe` (backend from
    :func:`set_backend`, default ``"auto"``; fp32 weights on CUDA take the torch
    reference, the kernels being bf16/fp16), with or without a gradient; gpt-oss's experts too,
    with its transposed weights as views, its biases, ``gate_up_layout="interleaved"`` and
    ``ClampedSwiGLU(self.alpha, self.limit)``. Other layouts (biased or transposed other than
    gpt-oss's, non-SiLU) run transformers' ``grouped_mm`` implementation.
    """
    if not fused_compatible(self):
        return _grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)
    from replaymoe.moe import fused_moe

    gptoss = self.__dict__.get("_replaymoe_gptoss")
    if gptoss is not None:  # [E, H, 2I] / [E, I, H] stored transposed: read through views, no copy
        w13, w2 = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        extra = dict(
            w13_bias=self.gate_up_proj_bias,
            w2_bias=self.down_proj_bias,
            activation=gptoss,
            gate_up_layout="interleaved",
        )
    else:
        w13, w2 = self.gate_up_proj, self.down_proj
        extra = {}
    backend = self.__dict__.get(_BACKEND, "auto")
    if backend == "auto" and w13.is_cuda and w13.dtype == torch.float32:
        backend = "torch"  # the kernels take bf16/fp16
    ids = top_k_index if top_k_index.dtype == torch.int32 else top_k_index.to(torch.int32)
    weights = top_k_weights if top_k_weights.dtype == torch.float32 else top_k_weights.float()
    x = hidden_states if hidden_states.dtype == w13.dtype else hidden_states.to(w13.dtype)
    if backend == "auto" and gptoss is None and _direct_ok(x, w13, w2, ids, weights):
        # the executors fused_moe ends in, past its checks (the same tensor, bits and autograd)
        if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad
                                        or weights.requires_grad):  # fmt: skip
            from replaymoe.moe._backward import experts_triton_train

            out = experts_triton_train(x, w13, w2, ids, weights, local_expert_offset=0, recompute=False)
        else:
            from replaymoe.moe._forward import experts_triton

            out = experts_triton(
                x, w13, w2, ids, weights, w13_scale=None, w2_scale=None, local_expert_offset=0, out=None
            )
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=weights, backend=backend, check_ids=False, **extra)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def set_backend(experts: nn.Module, backend: str | None) -> None:
    """The backend :func:`replaymoe_experts_forward` runs ``experts`` with (a session's ``backend``);
    None: back to the default, ``"auto"``."""
    if backend is None:
        experts.__dict__.pop(_BACKEND, None)
    else:
        experts.__dict__[_BACKEND] = backend


def register() -> None:
    """Register ``"replaymoe"`` in transformers' experts registry (done on import; idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, replaymoe_experts_forward)

"""Small transformers MoE models with seeded random weights, built from configs (no download).

One place for the model zoo that the tests, the benchmarks and the demo share: :func:`build_config`
gives a transformers config of a supported architecture at a named size, and :func:`build_model`
a causal-LM in eval mode whose routers are decisive (re-drawn router weights) and whose selection
bias, where the architecture has one, is non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ARCHITECTURES", "SIZES", "build_config", "build_model"]

# architecture -> (config class name, per-size kwargs builder)
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")


@dataclass(frozen=True)
class _Size:
    hidden: int
    layers: int
    experts: int
    top_k: int
    inter: int
    heads: int
    vocab: int


SIZES = {
    # tests: every architecture in well under a second
    "tiny": _Size(hidden=32, layers=3, experts=8, top_k=2, inter=16, heads=2, vocab=64),
    # the demo on CPU
    "demo": _Size(hidden=64, layers=4, experts=16, top_k=4, inter=32, heads=4, vocab=256),
    # GPU tests
    "medium": _Size(hidden=1024, layers=4, experts=64, top_k=8, inter=512, heads=8, vocab=4096),
    # GPU benchmark: Qwen3-30B-A3B's MoE shape, fewer layers
    "bench": _Size(hidden=2048, layers=8, experts=128, top_k=8, inter=768, heads=16, vocab=32768),
}


def build_config(arch: str = "qwen3_moe", size: str = "tiny", **overrides: Any):
    """A transformers config of ``arch`` at ``size`` (``tiny`` | ``demo`` | ``medium`` | ``bench``).

    Every MoE architecture gets ``experts`` experts, top-``top_k``; DeepSeek-V3 and GLM4-MoE get one
    dense first layer (so MoE-layer indices differ from layer numbers), grouped routing and a
    shared expert; Qwen2-MoE and OLMoE keep their default ``norm_topk_prob=False`` (DEFAULT
    routing), Qwen3-MoE uses ``norm_topk_prob=True`` (RENORMALIZE).
    """
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"Invalid value of arch: expected one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"Invalid value of size: expected one of {', '.join(SIZES)}, got {size!r}")
    s = SIZES[size]
    head_dim = s.hidden // s.heads
    common = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=max(1, s.heads // 2),
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    if arch == "qwen3_moe":
        kw = dict(
            head_dim=head_dim,
            intermediate_size=4 * s.inter,
            moe_intermediate_size=s.inter,
            num_experts=s.experts,
            num_experts_per_tok=s.top_k,
            norm_topk_prob=True,
        )
        cls = transformers.Qwen3MoeConfig
    elif arch == "qwen2_moe":
        kw = dict(
            intermediate_size=4 * s.inter,
            moe_intermediate_size=s.inter,
            shared_expert_intermediate_size=2 * s.inter,
            num_experts=s.experts,
            num_experts_per_tok=s.top_k,
        )
        cls = transformers.Qwen2MoeConfig
    elif arch == "olmoe":
        kw = dict(intermediate_size=s.inter, num_experts=s.experts, num_experts_per_tok=s.top_k)
        cls = transformers.OlmoeConfig
    elif arch == "mixtral":
        kw = dict(
            head_dim=head_dim,
            intermediate_size=s.inter,
            num_local_experts=s.experts,
            num_experts_per_tok=s.top_k,
        )
        cls = transformers.MixtralConfig
    elif arch in ("deepseek_v3", "glm4_moe"):
        kw = dict(
            intermediate_size=4 * s.inter,
            moe_intermediate_size=s.inter,
            n_routed_experts=s.experts,
            num_experts_per_tok=s.top_k,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
        if arch == "deepseek_v3":
            common["num_key_value_heads"] = s.heads
            kw.update(
                kv_lora_rank=head_dim,
                q_lora_rank=2 * head_dim,
                qk_rope_head_dim=head_dim // 2,
                qk_nope_head_dim=head_dim // 2,
                v_head_dim=head_dim,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            )
            cls = transformers.DeepseekV3Config
        else:
            kw.update(head_dim=head_dim)
            cls = transformers.Glm4MoeConfig
    else:  # gpt_oss
        kw = dict(
            head_dim=head_dim,
            intermediate_size=s.inter,
            num_local_experts=s.experts,
            num_experts_per_tok=s.top_k,
            layer_types=["full_attention"] * s.layers,
        )
        cls = transformers.GptOssConfig
    kw = {**common, **kw, **overrides}
    return cls(**kw)


def build_model(
    arch: str = "qwen3_moe",
    size: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **overrides: Any,
):
    """A causal-LM of ``arch`` with seeded random weights (no download), in eval mode.

    Router weights are re-drawn with a larger spread (std 0.5/sqrt(H)... see code) so routing is
    decisive, and DeepSeek-V3/GLM4's ``e_score_correction_bias`` gets small random values so the
    selection bias is exercised.
    """
    import transformers

    from replaymoe.hf import find_moe_layers

    config = build_config(arch, size, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for info in find_moe_layers(model):
            w = info.router.weight
            w.copy_(torch.randn(w.shape, generator=g) * (2.0 / w.shape[1] ** 0.5))
            bias = getattr(info.router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()

"""The problem the ``replaymoe bench ep`` benchmark times: the layer shape (DeepSeek-V3's by default)
and the per-rank inputs drawn for it. The shape is a frozen :class:`Shape`, built once from the
command line (``--hidden`` / ``--experts`` / ``--top-k`` / ``--inter``) by ``bench.ep.main`` and passed
to every part of the benchmark that needs it (driver, naive reference, DeepEP peer, layer, host profile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """Hidden size ``H``, expert count ``E``, top-k ``K`` and expert intermediate size ``INTER``
    (DeepSeek-V3's by default)."""

    H: int = 7168
    E: int = 256
    K: int = 8
    INTER: int = 2048


# ``--impls`` names of MoeAlltoAll configurations beyond the transports themselves: symm with the
# combine forced to two kernels (send, barrier, reduce) or to the pipelined launch; plain ``symm``
# chooses by size (``pipelined_combine=None``)
IMPL_KWARGS = {
    "symm_2k": {"transport": "symm", "pipelined_combine": False},
    "symm_pipe": {"transport": "symm", "pipelined_combine": True},
}


def a2a_kwargs(impl: str) -> dict:
    """MoeAlltoAll keyword arguments of an ``--impls`` name (nccl, symm, symm_2k, symm_pipe)."""
    return dict(IMPL_KWARGS.get(impl, {"transport": impl}))


def inputs(shape: Shape, T: int, rank: int, dev):
    """``(ids, x, wts, x8, s8, logits)`` of ``shape`` for ``T`` tokens of ``rank`` (seeded by rank and
    ``T``)."""
    H, E, K = shape.H, shape.E, shape.K
    g = torch.Generator(device=dev).manual_seed(1234 + 17 * rank + T)
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices.to(torch.int32)
    x = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
    wts = torch.rand(T, K, generator=g, device=dev)
    x8 = (torch.randn(T, H, generator=g, device=dev) * 4).to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, generator=g, device=dev)
    logits = torch.randn(T, E, generator=g, device=dev)
    return ids, x, wts, x8, s8, logits

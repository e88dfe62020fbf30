"""What one forward of the decoder stack hands its routers (:class:`Step`), and the fixed-address
slabs of forwards whose MoE blocks replay CUDA graphs (:class:`StepBuffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Step", "StepBuffers", "positions_bound"]


@dataclass
class Step:
    """One forward of the decoder stack, as the routers see it."""

    num_tokens: int  # B * S
    forced: Optional[torch.Tensor]  # int32 [L, T, K] replay ids (-1 rows: route natively), or None
    staged: Optional[torch.Tensor]  # int16 [L, T, K] capture slab, or None
    slot: Optional[torch.Tensor]  # int64 [T] capture-buffer row of each token, or None
    graphable: bool = False  # the MoE blocks may run as CUDA graphs (see replaymoe.hf.graphs)


class StepBuffers:
    """One ``[L, T, K]`` slab per (kind, T, device), kept: a block's CUDA graph reads the replay ids
    and writes the capture slab at the addresses it saw at capture (graphed forwards have at most
    ``GRAPH_MAX_TOKENS`` tokens, so there are few)."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.slabs: dict[tuple, torch.Tensor] = {}

    def get(self, kind: str, num_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (kind, num_tokens, device)
        slab = self.slabs.get(key)
        if slab is None:
            slab = torch.empty((self.num_layers, num_tokens, self.top_k), dtype=dtype, device=device)
            self.slabs[key] = slab
        return slab

    def clear(self) -> None:
        self.slabs.clear()


def positions_bound(cache: Any, past: Any, seq_len: int) -> Optional[int]:
    """An upper bound of 1 + any position of this forward known on the host, or None."""
    get_max = getattr(cache, "get_max_length", None)
    max_len = get_max() if callable(get_max) else None
    if isinstance(max_len, int) and max_len > 0:
        return max_len
    if isinstance(past, int):
        return past + seq_len
    return None

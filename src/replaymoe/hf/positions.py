"""Each token's position in its sequence, from what a transformers forward already holds.

Everything here is device arithmetic on the forward's own tensors (attention mask, position ids,
the cache's length): no host synchronisation and no data-dependent shapes, so it traces under
``torch.compile(fullgraph=True)`` and runs inside CUDA graphs.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

__all__ = ["cache_length", "token_positions"]

PastLength = Union[int, torch.Tensor]


def forward_cache(kwargs: dict) -> tuple[Any, bool]:
    """``(cache, named_cache)``: the KV cache a decoder-stack forward got in its keyword arguments
    (None without one); ``named_cache`` when it came as ``cache`` (transformers >= 5.24, whose
    ``generate`` also puts the padding in the position ids) rather than ``past_key_values``."""
    cache = kwargs.get("past_key_values")
    if cache is None and kwargs.get("cache") is not None:
        return kwargs["cache"], True
    return cache, False


def cache_length(cache: Any) -> PastLength:
    """Tokens already in ``cache`` (``past_key_values``) without a host sync.

    ``0`` without a cache; a Python int where the cache knows it on the host (``DynamicCache``: the
    keys' shape; a ``StaticCache`` not written yet); otherwise the cache's own device counter (an
    initialised ``StaticCache``), a 0-dim tensor.
    """
    if cache is None or not hasattr(cache, "get_seq_length"):
        return 0
    return cache.get_seq_length()


def token_positions(
    batch_size: int,
    seq_len: int,
    *,
    attention_mask: Optional[torch.Tensor],
    past_length: PastLength,
    device: torch.device | str,
    position_ids: Optional[torch.Tensor] = None,
    padding_in_positions: bool = False,
) -> torch.Tensor:
    """Positions ``int64 [B, S]`` of a forward's tokens in their sequences, padding excluded (-1).

    Parameters
    ----------
    batch_size, seq_len : int
        ``B`` and ``S`` of the forward.
    attention_mask : torch.Tensor, optional
        * 2-D ``[B, P]`` covering the cached and the new tokens (what ``generate`` passes with a
          dynamic cache and what a trainer passes; ``P = past_length + S``): the position of a
          kept token is the number of kept tokens before it, padding gets -1. Columns missing at
          the mask's left (``P < past_length + S``) are taken as unpadded.
        * 4-D ``[B, 1, S, KV]`` (what ``generate`` passes with a static cache; bool, or additive
          float with 0 where attended): a token whose row attends to nothing is padding. Its
          position is ``position_ids`` when given, else ``past_length + arange(S)``.
        * None: no padding; positions as in the 4-D case.
    past_length : int or 0-dim tensor
        Tokens already in the cache (:func:`cache_length`).
    device : torch.device or str
        Where to compute.
    position_ids : torch.Tensor, optional
        ``[B, S]`` or ``[1, S]`` rotary positions, which ``generate`` computes as the unpadded
        position of every kept token. Used with 4-D or no masks.
    padding_in_positions : bool
        With no mask and ``position_ids``: the padding is in the positions, as transformers >= 5.24's
        ``generate`` passes it (no attention mask; a left pad token gets position 0, so each starts a
        sequence of its own): the tokens of a row before its last position 0 are padding (-1).

    Returns
    -------
    torch.Tensor
        ``int64 [B, S]`` on ``device``.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= seq_len:
        m = attention_mask if attention_mask.device == torch.device(device) else attention_mask.to(device)
        m = m != 0
        # kept tokens up to and including each column (cumsum of bool counts in int64), made a
        # position: -1 for the token itself, + the cache columns missing at the mask's left
        pos = m.cumsum(1)[:, -seq_len:] + (past_length + seq_len - m.shape[1] - 1)
        return torch.where(m[:, -seq_len:], pos, -1)
    if position_ids is not None and position_ids.dim() == 2 and position_ids.shape[1] == seq_len:
        pos = position_ids.to(device=device, dtype=torch.int64).expand(batch_size, seq_len)
        if padding_in_positions and attention_mask is None:
            idx = torch.arange(seq_len, device=device, dtype=torch.int64)
            start = torch.where(pos == 0, idx, 0).amax(1, keepdim=True)  # the row's last position 0
            return torch.where(idx < start, -1, pos)
    else:
        base = torch.arange(seq_len, device=device, dtype=torch.int64) + past_length
        pos = base.unsqueeze(0).expand(batch_size, seq_len)
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] == seq_len:
        m = attention_mask[:, 0].to(device=device)
        attends = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        return torch.where(attends.any(-1), pos, -1)
    return pos.contiguous()

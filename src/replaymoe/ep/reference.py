"""Executable spec of the all-to-all: :func:`dispatch_torch` and :func:`combine_torch` simulate all
``ep`` ranks of :class:`~replaymoe.ep.MoeAlltoAll` in one process (the tests' reference)."""

from __future__ import annotations

import torch

from .partition import expert_partition

__all__ = ["dispatch_torch", "combine_torch"]


def dispatch_torch(
    token_selected_experts: list[torch.Tensor],
    payloads: list[list[torch.Tensor]],
    num_experts: int,
    runtime_max_tokens_per_rank: int,
    *,
    invalid_token_expert_id: int = -1,
    expert_id_payload_index: int | None = None,
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Executable spec of :meth:`MoeAlltoAll.dispatch` for all ``ep`` ranks in one process.

    Parameters
    ----------
    token_selected_experts : list of ep tensors int [T_r, K]
    payloads : list (per rank) of lists of [T_r, *] tensors
    num_experts, runtime_max_tokens_per_rank, invalid_token_expert_id, expert_id_payload_index
        As for :meth:`MoeAlltoAll.dispatch`.

    Returns
    -------
    (recv, counts)
        ``recv[r][p]``: [ep, runtime_max, *] what rank ``r`` receives of payload ``p`` (padding rows
        zero, or ``invalid_token_expert_id`` for the sanitized id payload); ``counts``: int32
        [ep (receiver), ep (source)].
    """
    ep = len(token_selected_experts)
    parts = expert_partition(num_experts, ep)
    rt = runtime_max_tokens_per_rank
    counts = torch.zeros(ep, ep, dtype=torch.int32)
    recv = []
    for r in range(ep):
        lo, n = parts[r]
        outs = [torch.zeros(ep, rt, *p.shape[1:], dtype=p.dtype) for p in payloads[0]]
        if expert_id_payload_index is not None:
            outs[expert_id_payload_index].fill_(invalid_token_expert_id)
        for s in range(ep):
            ids = token_selected_experts[s].long().cpu()
            j = 0
            for t in range(ids.shape[0]):
                if any(lo <= int(e) < lo + n for e in ids[t]):
                    for p, o in zip(payloads[s], outs):
                        o[s, j] = p[t].cpu()
                    if expert_id_payload_index is not None:
                        o = outs[expert_id_payload_index][s, j]
                        o.copy_(
                            torch.where(
                                (o >= lo) & (o < lo + n), o, torch.full_like(o, invalid_token_expert_id)
                            )
                        )
                    j += 1
            if j > rt:
                raise ValueError(f"rank {s} has more than runtime_max={rt} tokens")
            counts[r, s] = j
        recv.append(outs)
    return recv, counts


def combine_torch(
    payloads: list[torch.Tensor],
    token_selected_experts: list[torch.Tensor],
    num_experts: int,
) -> list[torch.Tensor]:
    """Executable spec of :meth:`MoeAlltoAll.combine` for all ranks in one process.

    ``payloads[r]`` is rank r's [ep, runtime_max, H] combine payload laid out as
    :func:`dispatch_torch` delivered; returns per source rank the [T_s, H] fp32 sum (cast to the
    payload dtype) over the ranks each token was sent to.
    """
    ep = len(token_selected_experts)
    parts = expert_partition(num_experts, ep)
    outs = []
    for s in range(ep):
        ids = token_selected_experts[s].long().cpu()
        T = ids.shape[0]
        H = payloads[0].shape[-1]
        acc = torch.zeros(T, H, dtype=torch.float32)
        nxt = [0] * ep
        for t in range(T):
            for r in range(ep):
                lo, n = parts[r]
                if any(lo <= int(e) < lo + n for e in ids[t]):
                    acc[t] += payloads[r][s, nxt[r]].float().cpu()
                    nxt[r] += 1
        outs.append(acc.to(payloads[0].dtype))
    return outs

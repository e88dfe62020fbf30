"""``ep_moe``: one expert-parallel MoE layer = route -> dispatch -> local fused_moe -> combine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._validation import check_tensor, fail
from .alltoall import MoeAlltoAll

if TYPE_CHECKING:
    from .._routing_method import RoutingMethod
    from ..routing_config import RoutingConfig

__all__ = ["ep_moe"]


def _flat_rows(view: torch.Tensor, rt: int) -> torch.Tensor:
    """The received ``[ep, rt, *inner]`` view as one 2-D-ish run of rows ``[ep * (rt + 1) - 1, *inner]``.

    Both transports lay rank ``s``'s rows at ``s * (rt + 1) + j`` (row ``rt`` of a block is the count
    header), so the blocks form a single strided run: no copy. Row ``s * (rt + 1) + j`` is
    ``view[s, j]``; the header rows in between are junk and must carry invalid expert ids.
    """
    ep = view.shape[0]
    assert view.stride(0) == (rt + 1) * view.stride(1)
    return torch.as_strided(view, (ep * (rt + 1) - 1, *view.shape[2:]), view.stride()[1:])


def ep_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    a2a: MoeAlltoAll,
    *,
    top_k: int | None = None,
    method: RoutingMethod | None = None,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    routing: RoutingConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    routing_replay_out: torch.Tensor | None = None,
    replay_ids: torch.Tensor | None = None,
    runtime_max_tokens_per_rank: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Expert-parallel MoE layer; equals single-device ``fused_moe`` on the full weights.

    1. ``route`` over all ``E`` experts (global ids; capture with ``routing_replay_out`` and replay
       with ``replay_ids`` work as in :func:`replaymoe.route`, on this rank's tokens);
    2. ``a2a.dispatch`` of (hidden states, topk ids, topk weights) to the ranks owning the experts;
    3. ``fused_moe`` on the received rows with the given ids/weights and this rank's expert slice
       (``local_expert_offset``; ids of other ranks' experts were invalidated by the dispatch);
    4. ``a2a.combine``: the per-token fp32 sum of the partial results.

    Parameters
    ----------
    hidden_states : torch.Tensor
        [T_local, H] bf16/fp16/fp32 (T_local may be 0: the rank still takes part).
    router_logits : torch.Tensor
        [T_local, E] router logits over all experts.
    w13_local, w2_local : torch.Tensor
        This rank's experts: [E_local, 2I, H] and [E_local, H, I] (``E_local = a2a.num_local_experts``),
        fp8 ``float8_e4m3fn`` with ``w13_scale``/``w2_scale`` for the block-scale path.
    a2a : MoeAlltoAll
        Built with the same ``top_k``, ``num_experts = E`` and ``hidden_size = H``.
    top_k, method, bias, n_group, topk_group, routed_scaling_factor, routing_replay_out, replay_ids
        As in :func:`replaymoe.route` (``top_k``, ``method`` … ``routed_scaling_factor`` may be
        given as one :class:`~replaymoe.routing.RoutingConfig`, ``routing=``).
        Routing arguments, as for :func:`replaymoe.route`.
    w13_scale, w2_scale : torch.Tensor, optional
        fp8 block scales of the local experts.
    runtime_max_tokens_per_rank : int, optional
        The same on every rank (default ``a2a.max_num_tokens``, always safe); must be >= every rank's
        T_local.
    backend : {"auto", "triton", "torch"}
        Backend of ``route`` and ``fused_moe``.

    Returns
    -------
    torch.Tensor
        [T_local, H] in the activation dtype (bf16 for fp8 weights).

    Note
    ----
    Hidden states travel in their own dtype; with fp8 weights ``fused_moe`` quantizes them on the
    receiving rank per 1x128 group exactly as single-device ``fused_moe`` would.
    """
    from ..moe import fused_moe
    from ..routing import route
    from ..routing_config import as_config

    if not isinstance(a2a, MoeAlltoAll):
        fail("a2a", "a MoeAlltoAll", type(a2a).__name__, what="type")
    check_tensor("hidden_states", hidden_states, ndim=2, device=a2a.device)
    T, H = hidden_states.shape
    if H != a2a.hidden_size:
        fail(
            "hidden_states",
            f"[T_local, hidden_size={a2a.hidden_size}]",
            tuple(hidden_states.shape),
            what="shape",
        )
    check_tensor("router_logits", router_logits, shape=(T, a2a.num_experts), device=a2a.device)
    cfg = as_config(routing, top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    if cfg.top_k != a2a.top_k:
        fail("top_k", f"a2a.top_k = {a2a.top_k}", cfg.top_k)
    check_tensor("w13_local", w13_local, ndim=3, device=a2a.device)
    if w13_local.shape[0] != a2a.num_local_experts:
        fail(
            "w13_local",
            f"[E_local={a2a.num_local_experts} (rank {a2a.rank}'s expert slice), 2I, H]",
            tuple(w13_local.shape),
            what="shape",
        )
    rt = a2a.max_num_tokens if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank

    r = route(
        router_logits,
        config=cfg,
        routing_replay_out=routing_replay_out,
        replay_ids=replay_ids,
        backend=backend,
    )
    hid, ids, wts = a2a.dispatch(
        r.topk_ids, [hidden_states, r.topk_ids, r.topk_weights], rt, expert_id_payload_index=1
    )
    out_dtype = torch.bfloat16 if w13_scale is not None else hidden_states.dtype
    out_rows = torch.empty(a2a.ep * (rt + 1), H, dtype=out_dtype, device=a2a.device)
    n = a2a.ep * (rt + 1) - 1
    fused_moe(
        _flat_rows(hid, rt),
        w13_local,
        w2_local,
        topk_ids=_flat_rows(ids, rt),
        topk_weights=_flat_rows(wts, rt),
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        local_expert_offset=a2a.local_expert_offset,
        num_experts=a2a.num_experts,
        out=out_rows[:n],
        backend=backend,
    )
    payload = out_rows.view(a2a.ep, rt + 1, H)[:, :rt]
    return a2a.combine(payload, rt)

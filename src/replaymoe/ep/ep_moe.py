"""``ep_moe``: one expert-parallel MoE layer = route -> dispatch -> local fused_moe -> combine.

Differentiable (eager): :class:`_EpExperts` is the autograd node of dispatch -> fused_moe -> combine
(see :func:`ep_moe`, "Gradients", for the backward's data flow); ``route`` keeps its own backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.autograd.function import once_differentiable

from .._validation import check_int, check_tensor, fail
from ..moe._validate import check_experts
from .alltoall import MoeAlltoAll

if TYPE_CHECKING:
    from ..routing import RoutingConfig, RoutingMethod

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
    # the routing keywords spelled out as in fused_moe and route (public signatures; as_routing folds them)
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
    recompute: bool = False,
    check_ids: bool = True,
) -> torch.Tensor:
    """Expert-parallel MoE layer; equals single-device ``fused_moe`` on the full weights.

    1. ``route`` over all ``E`` experts (global ids; capture with ``routing_replay_out`` and replay
       with ``replay_ids`` work as in :func:`replaymoe.route`, on this rank's tokens);
    2. ``a2a.dispatch`` of (hidden states, topk ids, topk weights) to the ranks owning the experts;
    3. ``fused_moe`` on the received rows with the given ids/weights and this rank's expert slice
       (``local_expert_offset``; ids of other ranks' experts were invalidated by the dispatch: ``-1``,
       a slot with no expert; ``route``'s ids, so not checked again: ``check_ids=False``);
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
    top_k, method, bias, n_group, topk_group, routed_scaling_factor : optional
        Routing arguments, as for :func:`replaymoe.route` (``top_k`` must equal ``a2a.top_k``).
    routing : RoutingConfig, optional
        The routing arguments above as one object, validated once when it was built; give it or
        them, not both.
    routing_replay_out, replay_ids : torch.Tensor, optional
        Capture and replay, as for :func:`replaymoe.route` (on this rank's tokens). ``replay_ids``
        [T_local, K] int16/int32/int64 are the caller's ids here (``ep_moe`` takes no ``topk_ids``):
        global ids in ``[0, E)`` of the whole model (``E = a2a.num_experts``; ids of other ranks'
        experts are legal: those ranks compute them), distinct within a row, or a row of all ``-1``
        (routed natively); checked unless ``check_ids`` is False.
    w13_scale, w2_scale : torch.Tensor, optional
        fp8 block scales of the local experts.
    runtime_max_tokens_per_rank : int, optional
        The same on every rank (default ``a2a.max_num_tokens``, always safe); must be >= every rank's
        T_local.
    backend : {"auto", "triton", "torch"}
        Backend of ``route`` and ``fused_moe``.
    recompute : bool, keyword-only
        Training only: passed to the backward's local ``fused_moe`` (``True``: its GEMM1 rows
        ``[ep * (runtime_max + 1) * top_k, 2I]`` are recomputed instead of held for the duration of
        the local backward; less peak memory, more time).
    check_ids : bool, keyword-only
        ``True`` (default) checks ``replay_ids`` by value (``route``'s ``check_replay``: one host
        sync eagerly, none while a CUDA graph is captured; a ValueError naming ``replay_ids`` with
        the first bad row). ``False`` skips it, for ids from a trusted producer (a validated trace).

    Returns
    -------
    torch.Tensor
        [T_local, H] in the activation dtype (bf16 for fp8 weights).

    Note
    ----
    Hidden states travel in their own dtype; with fp8 weights ``fused_moe`` quantizes them on the
    receiving rank per 1x128 group exactly as single-device ``fused_moe`` would.

    Gradients
    ---------
    Differentiable (eager; bf16/fp16/fp32, not fp8) with respect to ``hidden_states``,
    ``w13_local``, ``w2_local`` and ``router_logits`` (through :func:`replaymoe.route`'s backward on
    the top-k weights, with ``replay_ids`` too). When nothing requires grad (or grad mode is off)
    the call is the inference path itself; otherwise the forward runs the same code inside an
    autograd node and saves only its inputs (the ``[T_local, *]`` hidden states, top-k ids and
    weights, and the expert weights by reference). The backward is **collective**: every rank must
    run it for every differentiated ``ep_moe`` call, in the same order (as for the forward); a rank
    whose loss does not use the output still has to (e.g. ``out.sum() * 0``), else its peers wait
    until the timeout.

    Data flow of the backward (all exchanges on ``a2a``, each rank):

    1. ``dispatch`` of ``[dOut, hidden_states, topk_ids, topk_weights]`` with the forward's routing:
       the adjoint of ``combine`` (``d partial_r[t] = dOut[t]`` on every rank ``r`` the token went
       to), and the forward's received rows again, in the same slots (the plan depends only on the
       ids). The received rows are *re-dispatched* rather than kept from the forward: keeping them
       would hold ``ep * (runtime_max + 1)`` padded rows of ``H`` per call (``ep`` times the
       layer's own input, whatever the skew) plus the local ``fused_moe``'s saved GEMM1 rows
       (``top_k * 2I`` per padded row) until the backward; re-sending costs one more ``H``-wide
       payload in the backward's dispatch and a local forward recompute.
    2. The local ``fused_moe``'s own backward (its forward re-run on the received rows under
       autograd; the output is discarded) gives the received rows' ``dX`` and ``d topk_weights``
       (zero at slots of other ranks' experts: their ids were sanitized to ``-1``) and this rank's
       ``d w13_local``, ``d w2_local`` (every source's tokens of the local experts).
    3. ``combine`` (the adjoint of ``dispatch``) of ``[dX | d topk_weights]`` rows, fp32,
       ``_grad_width(H, K)`` wide (``combine(..., width=W)``): per token, the fp32 sum over the
       ranks it was sent to in rank order — ``dX`` is the sum of the partials, each
       ``d topk_weights[t, k]`` the one non-zero value from the owner of expert ``ids[t, k]``.
       Then ``route``'s backward takes ``d topk_weights`` to ``d router_logits``.

    No float atomics; every sum in a fixed order: two backward passes are bitwise equal.
    Buffer reuse: the forward's output is a fresh tensor (``combine`` allocates it) and the
    backward's received views are consumed (the local backward) before its ``combine``, so the
    backward's exchanges clobber nothing that is still in use; the received rows are passed to the
    local ``fused_moe`` as they are, without copies. The backward's dispatch rows are wider than
    the forward's: the buffers grow once on its first call (pass ``payload_bytes_per_token`` to
    :class:`MoeAlltoAll` to size them up front).
    """
    from ..routing import as_routing, route

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
    routing = as_routing(routing, top_k, method, bias, n_group, topk_group, routed_scaling_factor)
    if routing.top_k != a2a.top_k:
        fail("top_k", f"a2a.top_k = {a2a.top_k}", routing.top_k)
    check_tensor("w13_local", w13_local, ndim=3, device=a2a.device)
    if w13_local.shape[0] != a2a.num_local_experts:
        fail(
            "w13_local",
            f"[E_local={a2a.num_local_experts} (rank {a2a.rank}'s expert slice), 2I, H]",
            tuple(w13_local.shape),
            what="shape",
        )
    fp8 = w13_scale is not None or w2_scale is not None  # (inference-only: refused first)
    if (
        fp8
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (hidden_states, router_logits, w13_local, w2_local))
    ):
        fail(
            "w13_scale",
            "None when gradients are required (the fp8 block-scale path is inference-only)",
            "fp8 weights with an input that requires grad",
        )
    # the local experts' arguments as fused_moe checks them, under this function's names, before anything
    # is routed (routing_replay_out written) or dispatched (a failed call would leave the all-to-all
    # between dispatch and combine, and the peers waiting)
    check_experts(hidden_states, w13_local, w2_local, w13_scale=w13_scale, w2_scale=w2_scale,
                  w13_name="w13_local", w2_name="w2_local")  # fmt: skip
    if not isinstance(recompute, bool):
        fail("recompute", "a bool", type(recompute).__name__, what="type")
    if not isinstance(check_ids, bool):
        fail("check_ids", "a bool", type(check_ids).__name__, what="type")
    rt = a2a.max_num_tokens if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
    check_int("runtime_max_tokens_per_rank", rt, low=max(T, 1), high=a2a.max_num_tokens)

    r = route(
        router_logits,
        routing=routing,
        routing_replay_out=routing_replay_out,
        replay_ids=replay_ids,
        backend=backend,
        check_replay=check_ids,
    )
    needs_grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad
        or w13_local.requires_grad
        or w2_local.requires_grad
        or r.topk_weights.requires_grad
    )
    if not needs_grad:  # inference: exactly the path without autograd
        return _ep_experts(
            hidden_states, r.topk_ids, r.topk_weights, w13_local, w2_local, a2a, rt,
            w13_scale=w13_scale, w2_scale=w2_scale, backend=backend,
        )  # fmt: skip
    return _EpExperts.apply(
        hidden_states, r.topk_weights, w13_local, w2_local, r.topk_ids, a2a, rt, backend, recompute
    )


def _ep_experts(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    a2a: MoeAlltoAll,
    rt: int,
    *,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """dispatch -> local ``fused_moe`` on the received rows -> combine: ``[T_local, H]``."""
    from ..moe import fused_moe

    H = a2a.hidden_size
    hid, ids, wts = a2a.dispatch(
        topk_ids, [hidden_states, topk_ids, topk_weights], rt, expert_id_payload_index=1
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
        check_ids=False,  # route's ids (valid), other ranks' slots set to -1 by the dispatch
    )
    payload = out_rows.view(a2a.ep, rt + 1, H)[:, :rt]
    return a2a.combine(payload, rt)


def _grad_width(H: int, K: int) -> int:
    """Row width of the backward's combine: ``[dX (H) | d topk_weights (K) | pad]`` fp32, rounded up to
    16 elements (64 bytes) so that the rows stay aligned for the Triton copies."""
    return (H + K + 15) // 16 * 16


class _EpExperts(torch.autograd.Function):
    """Autograd node of dispatch -> local fused_moe -> combine (``route`` stays outside, with its own
    backward). Forward: :func:`_ep_experts`, unchanged. Backward: see :func:`ep_moe`, "Gradients"."""

    @staticmethod
    def forward(ctx, hidden_states, topk_weights, w13_local, w2_local, topk_ids, a2a, rt, backend, recompute):
        out = _ep_experts(
            hidden_states, topk_ids, topk_weights, w13_local, w2_local, a2a, rt,
            w13_scale=None, w2_scale=None, backend=backend,
        )  # fmt: skip
        # only [T_local, *] tensors (the inputs): the received rows are re-dispatched by the backward
        ctx.save_for_backward(hidden_states, topk_ids, topk_weights, w13_local, w2_local)
        ctx.a2a, ctx.rt, ctx.backend, ctx.recompute = a2a, rt, backend, recompute
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        from ..moe import fused_moe

        x, ids, wts, w13, w2 = ctx.saved_tensors
        a2a, rt = ctx.a2a, ctx.rt
        need_x, need_wts, need_w13, need_w2 = ctx.needs_input_grad[:4]
        ep, H, K = a2a.ep, a2a.hidden_size, a2a.top_k
        n = ep * (rt + 1) - 1
        W = _grad_width(H, K)
        # 1. dOut rows to the ranks that computed them, with what the local backward needs (the same
        #    routing, so the same slots as the forward's dispatch; ids sanitized the same way)
        views = a2a.dispatch(ids, [grad_out, x, ids, wts], rt, expert_id_payload_index=2)
        d_rows, x_rows, id_rows, w_rows = (_flat_rows(v, rt) for v in views)
        # 2. the local fused_moe's backward (its forward re-run on the received rows, the output unused).
        #    dX and d topk_weights rows are computed whatever this rank needs: they belong to the
        #    sources; the weight gradients only where this rank's weights need them.
        pay = torch.empty(ep * (rt + 1), W, dtype=torch.float32, device=a2a.device)
        with torch.enable_grad():
            xr = x_rows.detach().requires_grad_()
            wr = w_rows.detach().requires_grad_()
            w13l = w13.detach().requires_grad_(need_w13)
            w2l = w2.detach().requires_grad_(need_w2)
            y = fused_moe(
                xr, w13l, w2l, topk_ids=id_rows, topk_weights=wr,
                local_expert_offset=a2a.local_expert_offset, num_experts=a2a.num_experts,
                backend=ctx.backend, recompute=ctx.recompute, check_ids=False,
            )  # fmt: skip
            leaves = [xr, wr] + [t for t in (w13l, w2l) if t.requires_grad]
            grads = list(torch.autograd.grad(y, leaves, d_rows))
        dx_rows, dw_rows = grads[0], grads[1]
        dw13 = grads.pop(2) if need_w13 else None
        dw2 = grads.pop(2) if need_w2 else None
        # 3. back to the sources: [dX | d topk_weights] rows, summed over ranks in fp32 (rank order).
        #    A slot of another rank's expert gets exactly 0 here (its id was sanitized to -1), so the
        #    sum is that slot's owner's value.
        pay[:n, :H].copy_(dx_rows)
        pay[:n, H : H + K].copy_(dw_rows.masked_fill(id_rows < 0, 0))
        pay[:, H + K :].zero_()
        res = a2a.combine(pay.view(ep, rt + 1, W)[:, :rt], rt, width=W)
        dx = res[:, :H].to(x.dtype) if need_x else None
        dwts = res[:, H : H + K].to(wts.dtype) if need_wts else None
        return dx, dwts, dw13, dw2, None, None, None, None, None

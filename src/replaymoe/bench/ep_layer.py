"""The whole-layer part of ``replaymoe bench ep``: ``ep_moe`` (route -> dispatch -> local fused_moe ->
combine) against the compute it would take with the communication hidden.

Rows (``op``), each timed eagerly and as a CUDA-graph replay (median over iterations of the max over
ranks, :func:`~replaymoe.bench.ep_timing.time_phases`):

* ``layer``: one ``ep_moe`` call.
* ``layer_local``: ``route`` on this rank's logits + one ``fused_moe`` on the rows this rank received
  (copied out of a real dispatch of the same routing beforehand), no communication: the time
  ``ep_moe`` would take if its dispatch and combine were hidden entirely behind expert compute
  (issue 16 goal 4 compares ``layer`` against it).
* ``layer_local_split``: the same compute as one ``fused_moe`` per source rank's block of received
  rows: what a pipeline that starts the experts on the first source's rows while the others are
  still in flight would pay for computing in pieces (every piece reads all local expert weights).
* ``layer_train``: one ``ep_moe`` forward and its backward (``torch.autograd.grad`` of the hidden
  states, the router logits and the local expert weights, against a fixed output gradient), eager
  only: what a training step pays per layer, to set against ``layer``'s eager forward.

Every function takes the layer's :class:`~replaymoe.bench.ep_shape.Shape` (``shape``) and the timing
settings (``iters``, ``warmup``, ``graphs``, ``align``: :func:`~replaymoe.bench.ep_timing.time_phases`)
as keywords. Every layer row also carries ``weights_floor_us``: the local experts' weight bytes over the HBM
bandwidth (4.27 TB/s), the floor of a decode-size layer.
"""

from __future__ import annotations

import torch

from ._timing import HBM_BYTES_PER_S
from .ep_naive import naive_layer
from .ep_shape import Shape
from .ep_timing import err, graph, sync, time_phases, time_replays

__all__ = ["time_layer", "time_layer_train", "time_local", "received_rows", "weights_floor_us"]


def weights_floor_us(w13: torch.Tensor, w2: torch.Tensor) -> float:
    """Microseconds to read the local experts' weights once from HBM."""
    nbytes = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    return nbytes / HBM_BYTES_PER_S * 1e6


def _modes(fn, *, iters: int, warmup: int, graphs: bool, align: bool, log, what: str) -> dict:
    """{"eager": µs, "graph": µs} of ``fn`` (graph only when ``graphs`` and capture works)."""

    def it(ev):
        ev[0].record()
        fn()
        ev[1].record()

    res = {"eager": time_phases(it, 1, iters, warmup, align=align)[0][0]}
    if graphs:
        try:
            g, _ = graph(fn)
        except Exception as e:
            log(f"{what}: graph capture failed: {err(e)}")
            return res
        res["graph"] = time_replays([g], iters, warmup, align=align)[0]
    return res


def time_layer(impl, naive, a2a, x, logits, w13, w2, lo, n, T, route_kw, *, shape: Shape, iters, warmup,
               graphs, align, log):  # fmt: skip
    """Per mode, the time of one whole layer (µs): ``ep_moe`` on ``a2a``, or the naive NCCL recipe
    (eager only)."""
    from ..ep import ep_moe

    if impl == "naive":
        return _modes(lambda: naive_layer(naive, x, logits, w13, w2, lo, n, route_kw), iters=iters,
                      warmup=warmup, graphs=False, align=align, log=log,
                      what=f"layer naive T={T}")  # fmt: skip

    def fn():
        return ep_moe(x, logits, w13, w2, a2a, top_k=shape.K, runtime_max_tokens_per_rank=T, **route_kw)

    return _modes(
        fn, iters=iters, warmup=warmup, graphs=graphs, align=align, log=log, what=f"layer {impl} T={T}"
    )


def time_layer_train(
    a2a, x, logits, w13, w2, T, route_kw, *, shape: Shape, iters, warmup, graphs, align, log
) -> dict:
    """Eager time (µs) of one ``ep_moe`` forward + backward: gradients of ``x``, ``logits`` and the
    local ``w13`` / ``w2`` against a fixed output gradient (``graphs`` is ignored: eager only)."""
    from ..ep import ep_moe

    leaves = tuple(t.detach().requires_grad_() for t in (x, logits, w13, w2))
    g = torch.Generator(device=x.device).manual_seed(7)
    dout = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)

    def fn():
        out = ep_moe(leaves[0], leaves[1], leaves[2], leaves[3], a2a, top_k=shape.K,
                     runtime_max_tokens_per_rank=T, **route_kw)  # fmt: skip
        return torch.autograd.grad(out, leaves, dout)

    return _modes(
        fn, iters=iters, warmup=warmup, graphs=False, align=align, log=log, what=f"layer_train T={T}"
    )


def received_rows(
    a2a, x, logits, T, route_kw, *, shape: Shape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [ep, T, H], ids [ep, T, K], weights [ep, T, K])``: copies of the rows this rank
    receives when every rank dispatches its routed tokens (collective; ids sanitized, padding rows
    invalid), as ``ep_moe`` would hand them to its local ``fused_moe``."""
    from ..routing import route

    r = route(logits, shape.K, **route_kw)
    views = a2a.dispatch(r.topk_ids, [x, r.topk_ids, r.topk_weights], T, expert_id_payload_index=1)
    rows = tuple(v.clone() for v in views)
    a2a.combine(torch.zeros(a2a.ep, T, shape.H, dtype=x.dtype, device=x.device), T)  # back to idle
    sync()
    return rows


def time_local(
    a2a, x, logits, w13, w2, T, route_kw, *, split, shape: Shape, iters, warmup, graphs, align, log
) -> dict:
    """Per mode (µs): ``route`` + ``fused_moe`` on the received rows, without communication; with
    ``split``, one ``fused_moe`` per source block (see the module docstring)."""
    from ..moe import fused_moe
    from ..routing import route

    hid, ids, wts = received_rows(a2a, x, logits, T, route_kw, shape=shape)
    ep, H, K = a2a.ep, shape.H, shape.K
    kw = {"local_expert_offset": a2a.local_expert_offset, "num_experts": a2a.num_experts, "check_ids": False}
    out = torch.empty(ep, T, H, dtype=x.dtype, device=x.device)
    blocks = [(hid[s], ids[s], wts[s], out[s]) for s in range(ep)] if split else [
        (hid.view(ep * T, H), ids.view(ep * T, K), wts.view(ep * T, K), out.view(ep * T, H))]  # fmt: skip

    def fn():
        route(logits, K, **route_kw)
        for h, i, w, o in blocks:
            fused_moe(h, w13, w2, topk_ids=i, topk_weights=w, out=o, **kw)

    what = f"layer_local{'_split' if split else ''} T={T}"
    return _modes(fn, iters=iters, warmup=warmup, graphs=graphs, align=align, log=log, what=what)

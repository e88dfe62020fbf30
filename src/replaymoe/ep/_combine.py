"""The steps of :meth:`~replaymoe.ep.MoeAlltoAll.combine` behind its phase checks: the payload's
arguments, validated once per signature (:func:`combine_payload`), and the rows sent back and summed per
token (:func:`combine_rows`: the transport's send and :func:`~replaymoe.ep.receive.combine_reduce`, or
the symm transport's pipelined launch).
"""

from __future__ import annotations

import torch

from .._validation import check_int, check_tensor, fail
from ._dispatch_plan import CACHE_SIZE, DispatchState
from .receive import combine_reduce

_COMBINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def combine_payload(a2a, payload, rt: int, width: int | None) -> tuple[torch.Tensor, int]:
    """``(payload, W)``: the payload to send back (contiguous where its strides need it) and its row
    width. The first call with a signature validates the arguments (``ValueError`` before any
    communication); later ones find it in ``a2a``'s cache of :data:`CACHE_SIZE` signatures."""
    W = a2a.hidden_size if width is None else width
    try:
        s = payload.stride()
        key = (payload.shape, payload.dtype, s, payload.get_device(), rt, W)
    except (AttributeError, TypeError):
        key = None
    if key is None or key not in a2a._ccache or rt != a2a._runtime_max:
        _validate_combine(a2a, payload, rt, W)
        s = payload.stride()
        if key is not None:
            if len(a2a._ccache) >= CACHE_SIZE:
                a2a._ccache.pop(next(iter(a2a._ccache)))
            a2a._ccache[key] = True
    if s[2] != 1 or s[0] < rt * s[1] or s[1] < W:
        payload = payload.contiguous()
    return payload, W


def _validate_combine(a2a, payload, rt, W) -> None:
    check_int("runtime_max_tokens_per_rank", rt, low=1, high=a2a.max_num_tokens)
    check_int("width", W, low=1)
    if rt != a2a._runtime_max:
        fail(
            "runtime_max_tokens_per_rank",
            f"the value given to dispatch ({a2a._runtime_max})",
            rt,
        )
    check_tensor(
        "payload",
        payload,
        shape=(a2a.ep, rt, W),
        dtype=_COMBINE_DTYPES,
        device=a2a.device,
    )


def combine_rows(a2a, st: DispatchState, payload: torch.Tensor, rt: int, W: int) -> torch.Tensor:
    """Send this rank's rows back to their sources and sum the returned rows per token: ``[T_local, W]``
    in the payload's dtype."""
    tr = a2a._transport
    out = torch.empty(st.T, W, dtype=payload.dtype, device=a2a.device)
    pipelines = getattr(tr, "pipelines", None)  # the symm transport (ep > 1)
    if pipelines is not None and pipelines(rt):
        tr.combine_pipelined(payload, rt, st.slot, out)
    else:
        rows, block_stride, own, wait = tr.combine(payload, rt)
        combine_reduce(a2a, rows, block_stride, st.slot, out, st.reduce, own, wait)
    return out

"""The steps of :meth:`~replaymoe.ep.MoeAlltoAll.combine` behind its phase checks: the payload's
arguments, validated once per signature (:func:`combine_payload`), and the rows sent back and summed per
token (:func:`combine_rows`: the transport's send and :func:`~replaymoe.ep.receive.combine_reduce`, or
the symm transport's pipelined launch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._validation import check_int, check_tensor, fail
from ._dispatch_plan import CACHE_SIZE, DispatchState
from .receive import combine_reduce

if TYPE_CHECKING:
    from ._core import AlltoAllCore

_COMBINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def combine_payload(core: AlltoAllCore, payload, rt: int, width: int | None) -> tuple[torch.Tensor, int]:
    """``(payload, W)``: the payload to send back (contiguous where its strides need it) and its row
    width. The first call with a signature validates the arguments (``ValueError`` before any
    communication); later ones find it in ``core.combine_signatures`` (:data:`CACHE_SIZE` signatures)."""
    W = core.hidden_size if width is None else width
    seen = core.combine_signatures
    try:
        s = payload.stride()
        key = (payload.shape, payload.dtype, s, payload.get_device(), rt, W)
    except (AttributeError, TypeError):
        key = None
    if key is None or key not in seen or rt != core.runtime_max:
        _validate_combine(core, payload, rt, W)
        s = payload.stride()
        if key is not None:
            if len(seen) >= CACHE_SIZE:
                seen.pop(next(iter(seen)))
            seen[key] = True
    if s[2] != 1 or s[0] < rt * s[1] or s[1] < W:
        payload = payload.contiguous()
    return payload, W


def _validate_combine(core: AlltoAllCore, payload, rt, W) -> None:
    check_int("runtime_max_tokens_per_rank", rt, low=1, high=core.max_num_tokens)
    check_int("width", W, low=1)
    if rt != core.runtime_max:
        fail(
            "runtime_max_tokens_per_rank",
            f"the value given to dispatch ({core.runtime_max})",
            rt,
        )
    check_tensor(
        "payload",
        payload,
        shape=(core.ep, rt, W),
        dtype=_COMBINE_DTYPES,
        device=core.device,
    )


def combine_rows(
    core: AlltoAllCore, st: DispatchState, payload: torch.Tensor, rt: int, W: int
) -> torch.Tensor:
    """Send this rank's rows back to their sources and sum the returned rows per token: ``[T_local, W]``
    in the payload's dtype."""
    tr = core.transport
    out = torch.empty(st.T, W, dtype=payload.dtype, device=core.device)
    if core.combine_pipelines(rt):  # the symm transport's one launch
        tr.combine_pipelined(payload, rt, st.slot, out)
    else:
        rows, block_stride, own, wait = tr.combine(payload, rt)
        combine_reduce(core, rows, block_stride, st.slot, out, st.reduce, own, wait)
    return out

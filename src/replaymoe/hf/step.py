"""What one forward of the decoder stack hands its routers (:class:`Step`), and the fixed-address
slabs of forwards whose MoE blocks replay CUDA graphs (:class:`StepBuffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton

from replaymoe._backend import INTERPRET
from replaymoe._kernels.step_rows import step_rows_kernel
from replaymoe._launch import fast

__all__ = ["Step", "StepBuffers", "fused_rows_ok", "positions_bound", "step_rows"]


@dataclass
class Step:
    """One forward of the decoder stack, as the routers see it."""

    num_tokens: int  # B * S
    forced: Optional[torch.Tensor]  # int32 [L, T, K] replay ids (-1 rows: route natively), or None
    staged: Optional[torch.Tensor]  # int16 [L, T, K] capture slab, or None
    slot: Optional[torch.Tensor]  # int64 [T] capture-buffer row of each token, or None
    graphable: bool = False  # the MoE blocks may run as CUDA graphs (see replaymoe.hf.graphs)
    defer_commit: bool = False  # capture: the next step_rows launch writes the staged ids


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


def fused_rows_ok(attention_mask: Any, seq_len: int, past: Any, device: torch.device, backend: str) -> bool:
    """Whether :func:`step_rows` serves this eager forward: the Triton backend on ``device`` (CUDA,
    or the interpreter with ``backend="triton"``), a 2-D mask there covering the forward's tokens with
    unit column stride, and a host-side cache length."""
    kernels = (
        device.type == "cuda"
        if backend == "auto"
        else backend == "triton" and (device.type == "cuda" or INTERPRET)
    )
    return (
        kernels
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.shape[1] >= seq_len
        and attention_mask.device == device
        and attention_mask.stride(1) == 1
        and isinstance(past, int)
    )


def step_rows(
    attention_mask: torch.Tensor,
    seq_len: int,
    past: int,
    capture: Any = None,
    replay: Any = None,
    forced_out: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One forward's capture rows and replay ids in one kernel launch (``_kernels/step_rows.py``).

    The same values as :func:`~replaymoe.hf.positions.token_positions` followed by
    :meth:`CaptureBuffer.slots` (with the overflow check) and :meth:`ReplayTable.gather`, which are
    its reference (and the path under ``torch.compile``). The same launch writes the capture
    buffer's deferred commit (:meth:`CaptureBuffer.defer`), if any.

    Parameters
    ----------
    attention_mask : torch.Tensor
        ``[B, P]`` (any dtype; nonzero = kept) covering the cached and the forward's ``seq_len``
        tokens (:func:`fused_rows_ok`).
    seq_len, past : int
        ``S`` and the tokens already in the cache.
    capture : CaptureBuffer, optional
        Gives the capture rows ``int64 [B*S]`` (and its ``overflow`` flag).
    replay : ReplayTable, optional
        Gives the forced ids ``int32 [L, B*S, K]`` (into ``forced_out`` when given) and counts
        ``seen`` / ``fallback``.

    Returns
    -------
    (slot or None, forced or None)
    """
    B, P = attention_mask.shape
    T = B * seq_len
    dev = attention_mask.device
    slot = forced = pending = None
    if capture is not None:
        slot = torch.empty(T, dtype=torch.int64, device=dev)
        pending = capture.take_pending()
    if replay is not None:
        L, R, K = replay.table.shape
        forced = (
            forced_out if forced_out is not None else torch.empty((L, T, K), dtype=torch.int32, device=dev)
        )
    else:
        L, R, K = 0, 1, 1
    if T == 0:
        if pending is not None:
            capture.pending = pending
            capture.flush()
        return slot, forced
    if pending is not None:
        L, _, K = pending[0].shape  # the capture's layers (replay's, when both are on: the same)
    d = attention_mask  # stands in for the pointers of the parts that are off
    cap, rep, pend = capture is not None, replay is not None, pending is not None
    args = (  # in the kernel's order
        attention_mask, attention_mask.stride(0), P, seq_len, past + seq_len - P,
        slot if cap else d, capture.seq_cap if cap else 1, capture.batch_cap * capture.seq_cap if cap else 0,
        capture.overflow_i8 if cap else d,
        replay.table if rep else d, R * K, R - 1, replay.offsets if rep else d, replay.ends if rep else d,
        replay.shift if rep else d, d if forced is None else forced, T * K, replay.seen if rep else d,
        replay.fallback if rep else d, L,
        pending[0] if pend else d, pending[1] if pend else d, pending[1].shape[0] if pend else 0,
        capture.ids if pend else d, capture.ids.stride(0) if pend else 0,
    )  # fmt: skip
    ints = [a for a in args if isinstance(a, int)]
    consts = dict(K=K, KP=triton.next_power_of_2(K), CAPTURE=cap, REPLAY=rep, BLOCK=128, PENDING=pend)
    if max(ints) < 2**31 and min(ints) >= -(2**31):  # the int32 variant (the key's promise)
        _STEP_ROWS.launch_fixed((dev.index, attention_mask.dtype, K, cap, rep, pend), (B,), args, consts)
    else:
        _STEP_ROWS[(B,)](*args, **consts)
    return slot, forced


_STEP_ROWS = fast(step_rows_kernel)

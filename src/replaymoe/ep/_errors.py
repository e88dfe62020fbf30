"""The all-to-all's ``RuntimeError``s, raised by :class:`~replaymoe.ep.MoeAlltoAll` and its transports: a
phase called out of order (or after a failure), a buffer growth during CUDA-graph capture, a collective
that failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from .._validation import is_capturing

if TYPE_CHECKING:
    from ._core import AlltoAllCore


def phase_error(core: AlltoAllCore, op: str) -> None:
    """Raise for ``op`` (``"dispatch"`` or ``"combine"``) called in the wrong phase of ``core``."""
    if core.phase == "broken":
        raise RuntimeError(
            f"MoeAlltoAll on rank {core.rank}: a previous dispatch/combine failed part-way; the ranks "
            "are no longer in lockstep, build a new MoeAlltoAll (on every rank)"
        )
    if op == "dispatch":
        raise RuntimeError(
            f"MoeAlltoAll.dispatch on rank {core.rank}: called twice without combine "
            "(the phases are dispatch -> combine -> dispatch ...)"
        )
    raise RuntimeError(
        f"MoeAlltoAll.combine on rank {core.rank}: called before dispatch "
        f"(phase is {core.phase!r}; the phases are dispatch -> combine -> dispatch ...)"
    )


def guard_growth(core: AlltoAllCore, what: str) -> None:
    """Raise if the ``what`` buffer of ``core`` must grow during CUDA-graph capture."""
    if is_capturing():
        raise RuntimeError(
            f"MoeAlltoAll on rank {core.rank}: the {what} buffer must grow during CUDA-graph capture; "
            "run one dispatch/combine with the same payloads before capturing (or pass "
            "payload_bytes_per_token)"
        )


def collective_error(core: AlltoAllCore, op: str, err: BaseException) -> RuntimeError:
    """The error to raise when ``core``'s exchange in ``op`` failed with ``err``."""
    return RuntimeError(
        f"MoeAlltoAll.{op}: rank {core.rank} of {core.ep} (global rank "
        f"{dist.get_rank()}) failed in the all-to-all — a peer rank did not arrive within the "
        f"timeout or left the group (all ranks must call {op} in lockstep with valid arguments): {err}"
    )

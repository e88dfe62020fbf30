"""The all-to-all's ``RuntimeError``s, raised by :class:`~replaymoe.ep.MoeAlltoAll` and its transports: a
phase called out of order (or after a failure), a buffer growth during CUDA-graph capture, a collective
that failed.
"""

from __future__ import annotations

import torch.distributed as dist

from .._validation import is_capturing


def phase_error(a2a, op: str) -> None:
    """Raise for ``op`` (``"dispatch"`` or ``"combine"``) called in the wrong phase of ``a2a``."""
    if a2a._phase == "broken":
        raise RuntimeError(
            f"MoeAlltoAll on rank {a2a.rank}: a previous dispatch/combine failed part-way; the ranks "
            "are no longer in lockstep, build a new MoeAlltoAll (on every rank)"
        )
    if op == "dispatch":
        raise RuntimeError(
            f"MoeAlltoAll.dispatch on rank {a2a.rank}: called twice without combine "
            "(the phases are dispatch -> combine -> dispatch ...)"
        )
    raise RuntimeError(
        f"MoeAlltoAll.combine on rank {a2a.rank}: called before dispatch "
        f"(phase is {a2a._phase!r}; the phases are dispatch -> combine -> dispatch ...)"
    )


def guard_growth(a2a, what: str) -> None:
    """Raise if the ``what`` buffer of ``a2a`` must grow during CUDA-graph capture."""
    if is_capturing():
        raise RuntimeError(
            f"MoeAlltoAll on rank {a2a.rank}: the {what} buffer must grow during CUDA-graph capture; "
            "run one dispatch/combine with the same payloads before capturing (or pass "
            "payload_bytes_per_token)"
        )


def collective_error(a2a, op: str, err: BaseException) -> RuntimeError:
    """The error to raise when ``a2a``'s exchange in ``op`` failed with ``err``."""
    return RuntimeError(
        f"MoeAlltoAll.{op}: rank {a2a.rank} of {a2a.ep} (global rank "
        f"{dist.get_rank()}) failed in the all-to-all — a peer rank did not arrive within the "
        f"timeout or left the group (all ranks must call {op} in lockstep with valid arguments): {err}"
    )

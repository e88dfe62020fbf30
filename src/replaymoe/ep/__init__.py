"""Expert parallelism: :class:`MoeAlltoAll` (dispatch / combine over torch.distributed) and :func:`ep_moe`.

See :mod:`replaymoe.ep.alltoall` for the semantics and the transports (``nccl``, ``symm``). Modules:
:mod:`~replaymoe.ep.partition` (expert split, dispatch plan), :mod:`~replaymoe.ep.packing` (row layout,
packing), :mod:`~replaymoe.ep.alltoall` (the class), :mod:`~replaymoe.ep.receive` (sanitize, combine sum),
:mod:`~replaymoe.ep.transport_nccl` / :mod:`~replaymoe.ep.transport_symm`, :mod:`~replaymoe.ep.reference`
(single-process spec) and :mod:`~replaymoe.ep.ep_moe`; the class's private collaborators ``_dispatch_plan``
(a dispatch's launch plan), ``_dispatch`` (its launches), ``_combine`` and ``_errors``, which with the
transports share one ``_core.AlltoAllCore`` (``MoeAlltoAll.core``), and the Triton code in ``_kernel_sync``,
``_kernel_plan``, ``_kernel_pack``, ``_kernel_sanitize`` and ``_kernel_combine``.
"""

from __future__ import annotations

from .alltoall import MoeAlltoAll as MoeAlltoAll
from .ep_moe import ep_moe as ep_moe
from .partition import expert_owner as expert_owner
from .partition import expert_partition as expert_partition
from .reference import combine_torch as combine_torch
from .reference import dispatch_torch as dispatch_torch

__all__ = ["MoeAlltoAll", "ep_moe", "expert_partition", "expert_owner", "dispatch_torch", "combine_torch"]

"""Expert parallelism: :class:`MoeAlltoAll` (dispatch / combine over torch.distributed) and :func:`ep_moe`.

See :mod:`replaymoe.ep.alltoall` for the semantics and the transports (``nccl``, ``symm``).
"""

from __future__ import annotations

from .alltoall import MoeAlltoAll as MoeAlltoAll
from .alltoall import combine_torch as combine_torch
from .alltoall import dispatch_torch as dispatch_torch
from .alltoall import expert_owner as expert_owner
from .alltoall import expert_partition as expert_partition
from .ep_moe import ep_moe as ep_moe

__all__ = ["MoeAlltoAll", "ep_moe", "expert_partition", "expert_owner", "dispatch_torch", "combine_torch"]

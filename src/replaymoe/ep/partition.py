"""Which rank owns which expert, and where each of this rank's tokens goes.

The contiguous expert split (:func:`expert_partition`, :func:`expert_owner`) and the dispatch plan
built from it (:func:`make_plan`: per token and destination rank, the token's row in that rank's
block, and the rows sent to each rank), in torch ops or one Triton kernel (``ep_plan_kernel``: one
program per block of tokens, the prefix across blocks by look-back; :func:`plan_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._launch import cdiv, next_power_of_2
from .._validation import check_int, fail

__all__ = ["expert_partition", "expert_owner"]

# ep_plan_kernel: at most PLAN_BLOCKS programs (all resident at once on any GPU it runs on: 4 warps each),
# at least 128 tokens each; its scratch (int32): ticket, arrivals, epoch, a flag and 8 counts per block, and
# (the pack kernel's look-back plan) the number of blocks whose slots are stored
PLAN_BLOCKS = 128
PLAN_SCRATCH = 4 + 9 * PLAN_BLOCKS


def plan_grid(T: int) -> tuple[int, int]:
    """``(tokens per program, programs)`` of ``ep_plan_kernel`` for ``T`` tokens (one program at T = 0,
    to store the zero counts)."""
    bt = max(128, next_power_of_2(cdiv(max(T, 1), PLAN_BLOCKS)))
    return bt, max(1, cdiv(T, bt))


def expert_partition(num_experts: int, ep: int) -> list[tuple[int, int]]:
    """Contiguous expert split: ``(first expert, number of experts)`` per rank.

    ``base = E // ep``; the first ``E % ep`` ranks own ``base + 1`` experts, the rest ``base``.
    """
    check_int("ep", ep, low=1)
    check_int("num_experts", num_experts, low=ep)
    base, rem = divmod(num_experts, ep)
    out = []
    for r in range(ep):
        out.append((r * base + min(r, rem), base + (1 if r < rem else 0)))
    return out


def expert_owner(ids: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    """Rank owning each expert id (int64, same shape); ids outside ``[0, E)`` map to ``ep``.

    ``ids``: an integer tensor of any shape; ``num_experts`` and ``ep`` as :func:`expert_partition`'s
    (each rank owns at least one expert)."""
    check_int("ep", ep, low=1)
    check_int("num_experts", num_experts, low=ep)
    integer = isinstance(ids, torch.Tensor) and not (
        ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool
    )
    if not integer:
        got = getattr(ids, "dtype", type(ids).__name__)
        fail("ids", "an integer tensor of expert ids", got, what="dtype")
    base, rem = divmod(num_experts, ep)
    ids64 = ids.long()
    cut = rem * (base + 1)
    owner = torch.where(ids64 < cut, ids64 // (base + 1), rem + (ids64 - cut) // base)
    valid = (ids64 >= 0) & (ids64 < num_experts)
    return torch.where(valid, owner, torch.full_like(owner, ep))


@dataclass
class _Plan:
    """Where this rank's tokens go (device tensors, computed without host sync).

    slot : int32 [T, ep] — row of token t in rank r's block of this source, -1 = not sent to r.
    send_counts : int32 [ep] — rows sent to each rank (= max slot + 1).
    """

    slot: torch.Tensor
    send_counts: torch.Tensor


def make_plan(ids: torch.Tensor, num_experts: int, ep: int, *, use_triton: bool = False) -> _Plan:
    """The dispatch plan of this rank's ``ids`` (int32 ``[T, K]``, global expert ids; ids outside
    ``[0, num_experts)`` go nowhere) over ``ep`` ranks: torch ops, or with ``use_triton`` the
    ``ep_plan_kernel`` alone (the all-to-all fuses it with its header writes)."""
    T = ids.shape[0]
    if use_triton:
        from ._kernel_plan import ep_plan_kernel

        ids = ids.contiguous()
        slot = torch.empty(T, ep, dtype=torch.int32, device=ids.device)
        counts = torch.empty(ep, dtype=torch.int32, device=ids.device)
        scratch = torch.zeros(PLAN_SCRATCH, dtype=torch.int32, device=ids.device)
        base, rem = divmod(num_experts, ep)
        ep_p2 = max(2, next_power_of_2(ep))
        bt, nprog = plan_grid(T)
        ep_plan_kernel[(nprog,)](
            ids, slot, counts, *([counts] * 8), 0, 0, T, num_experts, base, rem, scratch,
            K=ids.shape[1], EP=ep, EP_P2=ep_p2, BLOCK_T=bt, NBLK=PLAN_BLOCKS, PUT=False,
        )  # fmt: skip
        return _Plan(slot=slot, send_counts=counts)
    owner = expert_owner(ids, num_experts, ep)  # [T, K] in [0, ep]
    mask = torch.zeros(T, ep + 1, dtype=torch.int32, device=ids.device)
    mask.scatter_(1, owner, 1)
    mask = mask[:, :ep]
    csum = torch.cumsum(mask, dim=0, dtype=torch.int32)
    slot = torch.where(mask.bool(), csum - 1, torch.full_like(csum, -1)).contiguous()
    if T > 0:
        counts = csum[-1].contiguous()
    else:
        counts = torch.zeros(ep, dtype=torch.int32, device=ids.device)
    return _Plan(slot=slot, send_counts=counts)

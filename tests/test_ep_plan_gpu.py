"""``ep_plan_kernel`` on the GPU, where its blocks really run at once: the look-back prefix across
blocks against the torch plan, over sizes from one token to past ``PLAN_BLOCKS`` blocks, and many
launches back to back on one scratch (as one ``MoeAlltoAll`` makes them) without a sync between."""

from __future__ import annotations

import pytest
import torch

from replaymoe.ep.partition import PLAN_BLOCKS, PLAN_SCRATCH, make_plan, plan_grid

pytestmark = pytest.mark.gpu


def _ids(T, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(T, E, generator=g, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    if T > 3:
        ids[1] = -1  # a token sent nowhere
        ids[2, 0] = E  # an out-of-range id is ignored
    return ids


@pytest.mark.parametrize(
    "T, E, ep, K",
    [
        (1, 256, 8, 8),  # decode: one program
        (4096, 256, 2, 8),  # the EP bench's largest size at ep = 2: 32 blocks
        (4095, 256, 4, 8),  # a partial last block
        (16384, 64, 8, 4),  # PLAN_BLOCKS blocks of 128 tokens
        (100_000, 256, 4, 8),  # 1024-token blocks, 98 programs
    ],
)
def test_plan_kernel_matches_torch_on_gpu(T, E, ep, K):
    ids = _ids(T, E, K, T)
    ref = make_plan(ids, E, ep)
    got = make_plan(ids, E, ep, use_triton=True)
    assert torch.equal(got.slot, ref.slot)
    assert torch.equal(got.send_counts, ref.send_counts)


def test_plan_kernel_back_to_back_on_one_scratch():
    """Launches of different sizes on one scratch, queued without a sync: every launch's flags must
    wait for its own blocks, not an earlier launch's (the epoch), and tickets must restart at 0."""
    from replaymoe.ep._kernel_plan import ep_plan_kernel

    E, ep, K = 256, 4, 8
    scratch = torch.zeros(PLAN_SCRATCH, dtype=torch.int32, device="cuda")
    runs = []
    for i, T in enumerate([4096, 300, 1, 8191, 0, 2048] * 4):
        ids = _ids(T, E, K, 100 + i)
        slot = torch.full((T, ep), -7, dtype=torch.int32, device="cuda")
        counts = torch.full((ep,), -7, dtype=torch.int32, device="cuda")
        bt, nprog = plan_grid(T)
        ep_plan_kernel[(nprog,)](ids, slot, counts, *([counts] * 8), 0, 0, T, E, E // ep, E % ep, scratch,
                                 K=K, EP=ep, EP_P2=ep, BLOCK_T=bt, NBLK=PLAN_BLOCKS, PUT=False)  # fmt: skip
        runs.append((ids, slot, counts))
    torch.cuda.synchronize()
    for i, (ids, slot, counts) in enumerate(runs):
        ref = make_plan(ids, E, ep)
        assert torch.equal(slot, ref.slot) and torch.equal(counts, ref.send_counts), i
    assert scratch[:3].tolist() == [0, 0, len(runs)]

"""The symm transport's combine send kernel (``ep_combine_send_kernel``) under TRITON_INTERPRET=1:
every live row ``[s, j]`` (``j < counts[s]``, ``s`` not this rank) lands at ``[this rank, j]`` of
source ``s``'s buffer, nothing else is written, for any number of programs (the work items
interleave the sources; a grid-stride loop covers them all). The peers' buffers are local tensors."""

from __future__ import annotations

import pytest
import torch

from replaymoe.ep._kernel_combine import ep_combine_send_kernel

pytestmark = pytest.mark.interpret

POISON = -7.0


@pytest.mark.parametrize(
    "ep,rank,counts,nprog",
    [
        (4, 0, [9, 5, 0, 9], 1),  # one program walks every item; a source with no rows
        (4, 2, [3, 9, 7, 1], 3),  # programs fewer than items; this rank in the middle
        (4, 3, [9, 9, 9, 9], 64),  # more programs than items: the extra ones do nothing
        (2, 1, [6, 2], 2),  # two ranks: one peer
        (8, 5, [1, 2, 3, 4, 5, 6, 7, 8], 5),  # eight ranks, every pointer slot used
    ],
)
def test_combine_send_writes_exactly_the_live_rows(ep, rank, counts, nprog):
    rows, H, NB, TT = 9, 64, 32, 4  # rows not a multiple of TT: a partial last tile
    g = torch.Generator().manual_seed(ep * 10 + rank)
    src = torch.randn(ep, rows, H, generator=g).half()
    cnt = torch.tensor(counts, dtype=torch.int32)
    bufs = [torch.full((ep * rows, H), POISON, dtype=torch.float16) for _ in range(ep)]
    peers = bufs + [bufs[0]] * (8 - ep)
    sig = torch.zeros(16, dtype=torch.int32)  # unused without SIGNAL
    ep_combine_send_kernel[(nprog, H // NB)](
        src, cnt, *peers, rows, H, src.stride(0), src.stride(1), rank * rows * H, H,
        sig, sig, *([sig] * 8), 0, EP=ep, SKIP=rank, NB=NB, TT=TT, SIGNAL=False,
    )  # fmt: skip
    for s in range(ep):
        want = torch.full((ep * rows, H), POISON, dtype=torch.float16)
        if s != rank:  # this rank's own rows are read in place by the reduction, never sent
            want[rank * rows : rank * rows + counts[s]] = src[s, : counts[s]]
        assert torch.equal(bufs[s], want), f"source {s}'s buffer"

"""Token layout (align step): Triton kernels vs invariants and the torch reference."""

from __future__ import annotations

import pytest
import torch

from replaymoe.moe.layout import (
    ExpertLayout,
    compact_layout,
    compact_layout_torch,
    expert_layout,
    layout_sizes,
    layout_torch,
)


def _random_ids(T, K, E, g, *, dtype=torch.int32):
    if T == 0:
        return torch.zeros(0, K, dtype=dtype)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dtype)


def check_invariants(lay: ExpertLayout, ids: torch.Tensor, E_local: int, offset: int) -> None:
    """Checks written from the definition, independent of layout_torch."""
    T, K = ids.shape
    n = T * K
    seg = lay.block_m * lay.cluster
    nt = int(lay.num_tiles[0])
    assert nt % lay.cluster == 0
    rows = nt * lay.block_m
    flat = ids.reshape(-1).long().cpu() - offset
    local = (flat >= 0) & (flat < E_local)
    slots = lay.sorted_slots[:rows].long().cpu()
    real = slots[slots != n]
    # each local slot exactly once, no non-local slot, padding marked with T*K
    assert sorted(real.tolist()) == torch.nonzero(local).flatten().tolist()
    assert ((slots >= 0) & (slots <= n)).all()
    offs = lay.expert_offsets.long().cpu()
    counts = lay.expert_counts.long().cpu()
    assert offs[0] == 0 and offs[-1] == rows
    assert torch.equal(counts, torch.bincount(flat[local], minlength=E_local))
    te = lay.tile_expert.long().cpu()
    tre = lay.tile_row_end.long().cpu()
    for e in range(E_local):
        s, t = int(offs[e]), int(offs[e + 1])
        assert (t - s) % seg == 0 and t - s == -(-int(counts[e]) // seg) * seg  # padded to seg, minimal
        seg_slots = slots[s:t]
        c = int(counts[e])
        assert (flat[seg_slots[:c]] == e).all()  # segment holds this expert's slots ...
        assert torch.equal(seg_slots[:c], torch.sort(seg_slots[:c]).values)  # ... in slot order ...
        assert (seg_slots[c:] == n).all()  # ... then padding
        assert (te[s // lay.block_m : t // lay.block_m] == e).all()
        assert (tre[s // lay.block_m : t // lay.block_m] == s + c).all()
    assert (te[nt:] == -1).all()


CASES = [
    # (T, K, E_total, E_local, offset, block_m, cluster) -- edge each hits
    (5, 2, 8, 8, 0, 4, 1),  # all experts local, tiny tiles
    (37, 4, 16, 6, 3, 8, 2),  # EP slice in the middle + clustered padding
    (1, 8, 64, 64, 0, 16, 1),  # decode: more experts than slots
    (9, 3, 12, 4, 8, 16, 1),  # last slice; many tokens routed elsewhere
    (0, 2, 4, 4, 0, 4, 1),  # no tokens
    (50, 1, 3, 3, 0, 64, 1),  # top-1, one tile per expert larger than the counts
    (40, 2, 8, 8, 0, 16, 1),  # 80 slots: two chunks (the histogram's own launch), all local
    (32, 2, 8, 5, 3, 16, 1),  # 64 slots: exactly one chunk (the scatter counts them), an EP slice
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,K,E,E_local,offset,block_m,cluster", CASES)
def test_layout_triton_matches_reference(T, K, E, E_local, offset, block_m, cluster, generator):
    ids = _random_ids(T, K, E, generator)
    lay = expert_layout(ids, E_local, block_m=block_m, local_expert_offset=offset, cluster=cluster)
    check_invariants(lay, ids, E_local, offset)
    ref = layout_torch(ids, E_local, block_m=block_m, local_expert_offset=offset, cluster=cluster)
    rows = int(ref.num_tiles[0]) * block_m
    assert int(lay.num_tiles[0]) == int(ref.num_tiles[0])
    assert torch.equal(lay.sorted_slots[:rows], ref.sorted_slots[:rows])
    for f in ("tile_expert", "tile_row_end", "expert_offsets", "expert_counts"):
        assert torch.equal(getattr(lay, f), getattr(ref, f)), f


@pytest.mark.interpret
@pytest.mark.parametrize(
    "T,K,E,launches,warps",
    [
        (8, 8, 128, 1, 8),  # 64 slots: one chunk, the scatter counts them itself (one launch)
        (9, 8, 128, 2, 4),  # 72 slots: two 64-slot chunks, the histogram's launch; scatter on 4 warps
        (256, 8, 128, 2, 8),  # 2048 slots: 32 chunks of 64, beyond the measured 4-warp range
        (520, 8, 128, 2, 8),  # 4160 slots: past 64 chunks of 64, so 33 chunks of 128 (prefill-sized chunks)
    ],
)
def test_layout_launches_by_size(T, K, E, launches, warps, generator, monkeypatch):
    # the layout's launches and the scatter's warps (moe.layout.build_layout), and its result
    import replaymoe._launch as launch

    seen = []
    real = launch.fast

    def spy(fn):
        def grid(g):
            def run(*args, **kwargs):
                seen.append((fn.fn.__name__, kwargs.get("num_warps")))
                return real(fn)[g](*args, **kwargs)

            return run

        return type("Spy", (), {"__getitem__": lambda self, g: grid(g)})()

    monkeypatch.setattr(launch, "fast", spy)
    ids = _random_ids(T, K, E, generator)
    lay = expert_layout(ids, E, block_m=16)
    assert len(seen) == launches and seen[-1] == ("layout_scatter_kernel", warps)
    check_invariants(lay, ids, E, 0)


@pytest.mark.interpret
def test_layout_triton_int64_ids_and_out_of_range_ids(generator):
    # int64 ids, negative EP padding ids (-1) and ids >= E all get no slot
    ids = _random_ids(12, 3, 10, generator, dtype=torch.int64)
    ids[0] = torch.tensor([-1, -1, -1])
    ids[1, 0] = 99
    lay = expert_layout(ids, 5, block_m=4, local_expert_offset=2)
    check_invariants(lay, ids, 5, 2)


@pytest.mark.interpret
def test_layout_skewed_all_to_one_expert(generator):
    # every slot to expert 2: one long segment, every other expert empty (no tiles)
    ids = torch.full((20, 1), 2, dtype=torch.int32)
    lay = expert_layout(ids, 4, block_m=8)
    check_invariants(lay, ids, 4, 0)
    assert int(lay.num_tiles[0]) == 3 and lay.tile_expert[:3].tolist() == [2, 2, 2]


@pytest.mark.parametrize("T,K,E,E_local,offset,block_m,cluster", CASES)
def test_layout_torch_invariants(T, K, E, E_local, offset, block_m, cluster, generator):
    ids = _random_ids(T, K, E, generator)
    check_invariants(layout_torch(ids, E_local, block_m=block_m, local_expert_offset=offset, cluster=cluster),
                     ids, E_local, offset)  # fmt: skip


def test_layout_sizes_exact_beyond_int32_product():
    # T*K*block_m > 2^31: an int32 product would wrap, the host computation must not.
    n = 2**31 // 128 + 5
    assert n * 128 > 2**31
    wrapped = torch.tensor([n], dtype=torch.int32) * 128
    assert int(wrapped) < 0  # what an int32 computation would give
    max_padded, max_tiles = layout_sizes(n, 256, 128)
    assert max_padded == (n + 256 * 127) // 128 * 128
    assert max_tiles == max_padded // 128
    assert max_padded >= n and max_padded % 128 == 0


def test_layout_sizes_bound_is_tight_for_decode():
    # one slot per expert: every slot its own tile, no more
    assert layout_sizes(8, 256, 16) == (128, 8)
    assert layout_sizes(0, 4, 16) == (0, 0)
    assert layout_sizes(3, 8, 4, cluster=2) == (24, 6)


def test_layout_sizes_rejects_positions_beyond_int32():
    with pytest.raises(ValueError, match="topk_ids"):
        layout_sizes(2**31 - 100, 64, 128)


def test_layout_triton_rejects_sort_key_overflow():
    # 4097 local experts pad to 8192 and take one chunk of 2^18 slots: 8193 * 2^18 >= 2^31 would
    # wrap the kernel's int32 sort key; rejected on the host before any launch
    ids = torch.zeros(2**15, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="shape of topk_ids: expected fewer .* sort key"):
        expert_layout(ids, 4097, block_m=64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk_ids=torch.zeros(4, 2)), "dtype of topk_ids"),  # float ids
        (dict(topk_ids=torch.zeros(8, dtype=torch.int32)), "shape of topk_ids"),  # 1-D
        (dict(topk_ids=torch.zeros(2, 4, dtype=torch.int32).T), "layout of topk_ids"),  # not contiguous
        (dict(num_local_experts=0), "num_local_experts"),
        (dict(block_m=12), "block_m"),  # not a power of two
        (dict(block_m=0), "block_m"),
        (dict(local_expert_offset=-1), "local_expert_offset"),
        (dict(cluster=0), "cluster"),
    ],
)
@pytest.mark.parametrize("fn", [expert_layout, layout_torch])
def test_layout_rejects(fn, kwargs, match):
    args = dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32), num_local_experts=4, block_m=16)
    args.update(kwargs)
    ids = args.pop("topk_ids")
    E = args.pop("num_local_experts")
    with pytest.raises(ValueError, match=match):
        fn(ids, E, **args)


def test_layout_rejects_non_bool_with_compact():
    with pytest.raises(ValueError, match="with_compact"):
        expert_layout(torch.zeros(4, 2, dtype=torch.int32), 4, block_m=16, with_compact=1)


def check_compact(cl, lay: ExpertLayout) -> None:
    """The compact layout from its definition: the padded layout's real rows in order, then the
    marker T*K; exact_start the exclusive cumsum of the counts; shift = padded - compact start."""
    n = lay.num_slots
    rows = int(lay.num_tiles[0]) * lay.block_m
    slots = lay.sorted_slots[:rows].long().cpu()
    real = slots[slots != n]  # padding removed, layout order kept
    got = cl.compact_slots.long().cpu()
    assert got.shape == (n,) and cl.compact_slots.dtype == torch.int32
    assert torch.equal(got[: real.numel()], real)
    assert (got[real.numel() :] == n).all()  # slots of non-local experts
    counts = lay.expert_counts.long().cpu()
    start = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    assert torch.equal(cl.exact_start.long().cpu(), start)
    assert torch.equal(cl.expert_shift.long().cpu(), lay.expert_offsets.long().cpu()[:-1] - start[:-1])


@pytest.mark.interpret
@pytest.mark.parametrize("T,K,E,E_local,offset,block_m,cluster", CASES)
@pytest.mark.parametrize("with_layout", [False, True], ids=["own-launch", "with-layout"])
def test_compact_layout_triton_matches_reference(T, K, E, E_local, offset, block_m, cluster, with_layout,
                                                  generator, monkeypatch):  # fmt: skip
    # outputs poisoned with a valid slot id (0): every entry must be written, the EP tail included;
    # built by its own launch from a layout, or inside the layout's scatter (with_compact)
    ids = _random_ids(T, K, E, generator)
    ref = compact_layout_torch(layout_torch(ids, E_local, block_m=block_m, local_expert_offset=offset,
                                            cluster=cluster))  # fmt: skip
    empty = torch.empty
    if not with_layout:
        lay = expert_layout(ids, E_local, block_m=block_m, local_expert_offset=offset, cluster=cluster)
        assert lay.compact is None
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(0))
    if with_layout:
        lay = expert_layout(ids, E_local, block_m=block_m, local_expert_offset=offset, cluster=cluster,
                            with_compact=True)  # fmt: skip
    cl = compact_layout(lay)
    monkeypatch.undo()
    assert (cl is lay.compact) == with_layout  # no second launch for a layout built with it
    check_compact(ref, lay)
    check_compact(cl, lay)
    for f in ("compact_slots", "exact_start", "expert_shift"):
        assert torch.equal(getattr(cl, f), getattr(ref, f)), f


@pytest.mark.interpret
@pytest.mark.parametrize("block_m", [16, 32])
def test_compact_layout_padding_heavy_and_full_segment(block_m, generator):
    # 1 slot on each of 16 experts (the padded layout is block_m times the slots), one expert with
    # exactly block_m slots (no padding row), experts without slots, one slot not local (id 30)
    ids = torch.full((block_m + 17, 1), 30, dtype=torch.int32)
    ids[:block_m, 0] = 3
    ids[block_m : block_m + 16, 0] = torch.randperm(16, generator=generator).to(torch.int32) + 4
    lay = expert_layout(ids, 24, block_m=block_m)
    cl = compact_layout(lay)
    check_compact(cl, lay)
    assert cl.exact_start[3:6].tolist() == [0, block_m, block_m + 1]
    assert cl.exact_start[-1] == block_m + 16 and cl.compact_slots[-1] == block_m + 17


def test_compact_layout_rejects_other_types():
    with pytest.raises(ValueError, match="type of layout: expected an ExpertLayout"):
        compact_layout(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="type of layout"):
        compact_layout_torch(None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,E,E_local,offset,block_m",
    [
        (4096, 8, 256, 256, 0, 64),  # DeepSeek prefill
        (16384, 8, 128, 32, 64, 128),  # EP slice, many chunks
        (1, 8, 256, 256, 0, 16),  # decode
        (333, 2, 8, 8, 0, 16),  # Mixtral-like, ragged T
    ],
)
def test_layout_gpu_matches_reference(T, K, E, E_local, offset, block_m, generator):
    ids = _random_ids(T, K, E, generator).cuda()
    lay = expert_layout(ids, E_local, block_m=block_m, local_expert_offset=offset)
    ref = layout_torch(ids, E_local, block_m=block_m, local_expert_offset=offset)
    rows = int(ref.num_tiles[0]) * block_m
    assert torch.equal(lay.sorted_slots[:rows], ref.sorted_slots[:rows])
    for f in ("tile_expert", "tile_row_end", "expert_offsets", "expert_counts", "num_tiles"):
        assert torch.equal(getattr(lay, f), getattr(ref, f)), f
    cl_ref = compact_layout_torch(ref)
    with_cl = expert_layout(ids, E_local, block_m=block_m, local_expert_offset=offset, with_compact=True)
    for cl in (compact_layout(lay), with_cl.compact):  # its own launch; inside the layout's scatter
        for f in ("compact_slots", "exact_start", "expert_shift"):
            assert torch.equal(getattr(cl, f), getattr(cl_ref, f)), f

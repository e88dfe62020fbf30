"""Tuned tables of the fused MoE (``replaymoe.moe.tuned``): the shipped tables, the choice by device,
JSON round trips and their errors, ``moe_config`` and ``moe_bwd_config`` reading a table, and the
launchers (forward and backward) taking the table of the input's device (interpreter)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from replaymoe.moe import _backward as bwd
from replaymoe.moe import _forward as fwd
from replaymoe.moe import fused_moe, fused_moe_torch
from replaymoe.moe.configs import (
    BWD_TILE_FIELDS,
    FP8_BLOCK_M,
    MoEConfig,
    fp8_invariant,
    moe_bwd_config,
    moe_config,
)
from replaymoe.moe.tuned import (
    TunedTable,
    builtin_table,
    choose_table_name,
    set_tuned_table,
    table_for,
    table_key,
)
from replaymoe.testing import assert_close


@pytest.fixture(autouse=True)
def _no_override():
    set_tuned_table(None)
    yield
    set_tuned_table(None)


def test_shipped_tables_hold_the_tuned_entries():
    h200, h100 = builtin_table("h200"), builtin_table("h100")
    # DeepSeek-V3 bf16 decode and Qwen3 fp8 decode, as tuned on the H200 (bench/README.md; the fp8
    # decode entry re-tuned for the swapped kernels in session 23)
    assert h200.lookup((7168, 2048, 256, 8, False, 1)) == MoEConfig(True, 16, 64, 128, 4, 4, 32, 256, 4, 4)
    assert h200.lookup((2048, 768, 128, 8, True, 1)) == MoEConfig(True, 64, 32, 128, 4, 5, 128, 128, 8, 4)
    assert h200.lookup((2048, 768, 128, 8, True, 1), fp8_fast=True).block_m == 16
    assert h200.tuned_on and h100.base == "h200" and builtin_table("generic").entries == {}
    for table in (h200, h100):  # every batch-invariant fp8 entry keeps the 64-row tiles
        assert all(fp8_invariant(c) for k, c in table.entries.items() if k[4])


@pytest.mark.parametrize(
    "name, capability, memory, expected",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 79.2, "h100"),  # by name
        ("NVIDIA H200", (9, 0), 139.8, "h200"),
        ("NVIDIA H100 NVL", (9, 0), 93.6, "h100"),
        ("NVIDIA H800", (9, 0), 79.6, "h100"),  # another Hopper: the nearest memory size
        ("NVIDIA GH200 144G HBM3e", (9, 0), 143.8, "h200"),  # 'GH200' is not an H200 by name
        ("NVIDIA GH200 480GB", (9, 0), 95.0, "h100"),
        ("NVIDIA H20", (9, 0), 95.6, "h100"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 80.0, "generic"),  # not Hopper: the heuristics alone
        ("NVIDIA B200", (10, 0), 179.0, "generic"),
    ],
)
def test_each_device_gets_its_table(name, capability, memory, expected):
    assert choose_table_name(name, capability, memory) == expected


def test_moe_config_reads_the_table():
    qwen_decode = (1, 8, 2048, 768, 128)
    mine = MoEConfig(True, 16, 16, 64, 4, 2, 16, 64, 4, 2)
    table = TunedTable("mine", entries={table_key(2048, 768, 128, 8, False, 1): mine})
    assert moe_config(*qwen_decode, table=table) == mine
    assert moe_config(*qwen_decode) == moe_config(*qwen_decode, table=builtin_table("generic"))  # heuristics
    assert moe_config(2, 8, 2048, 768, 128, table=table) != mine  # another token bucket
    # a tuned TMA entry (the H100's Mixtral prefill) where TMA is off: the same tiles, pointer loads
    h100 = builtin_table("h100")
    mixtral = (16384, 2, 4096, 14336, 8)
    assert moe_config(*mixtral, tma=True, table=h100) == h100.lookup(
        table_key(4096, 14336, 8, 2, False, 16384)
    )
    assert moe_config(*mixtral, tma=True, table=h100).tma
    off = moe_config(*mixtral, tma=False, table=h100)
    assert not off.tma and off.block_k1 == moe_config(*mixtral, tma=True, table=h100).block_k1
    # fp8: the batch-invariant entries, or fp8_fast with batch_invariant=False
    h200 = builtin_table("h200")
    assert moe_config(1, 8, 2048, 768, 128, fp8=True, table=h200).block_m == FP8_BLOCK_M
    assert moe_config(1, 8, 2048, 768, 128, fp8=True, batch_invariant=False, table=h200).block_m == 16


def test_json_round_trip_and_merge(tmp_path):
    table = builtin_table("h200").with_entries(
        {table_key(64, 32, 4, 2, False, 5): MoEConfig(False, 16, 32, 32, 4, 2, 32, 32, 4, 2, group_m=4)},
        name="mine",
        tuned_on="cpu",
    )
    path = tmp_path / "mine.json"
    table.save(path)
    again = TunedTable.load(path)
    assert (
        again == table
        and again.name == "mine"
        and len(again.entries) == len(builtin_table("h200").entries) + 1
    )
    assert again.lookup((64, 32, 4, 2, False, 8)).group_m == 4  # T=5 is the bucket of 8


def test_swapped_tile_entries_round_trip(tmp_path):
    # an fp8 tile-mode entry on the swapped kernels (16-row tiles) keeps its swap_ab through a file;
    # entries without it are written without the field
    c = MoEConfig(False, 16, 32, 128, 4, 3, 64, 128, 4, 3, swap_ab=True)
    table = builtin_table("h100").with_entries({(2048, 768, 128, 8, True, 8): c})
    table.save(tmp_path / "t.json")
    again = TunedTable.load(tmp_path / "t.json")
    assert again.lookup((2048, 768, 128, 8, True, 8)) == c and fp8_invariant(c)
    written = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert all(("swap_ab" in e) is bool(e.get("swap_ab")) for e in written.values())
    assert any("swap_ab" not in e for e in written.values())
    # a direct-mode entry with the top-k sum in the reduce kernel (bench tune's neighbours try it) keeps
    # fused_reduce False through a file; the default (None: in GEMM2) is written without the field
    d = MoEConfig(True, 64, 32, 128, 4, 5, 64, 128, 4, 4, fused_reduce=False)
    TunedTable("mine").with_entries({(2048, 768, 128, 8, True, 1): d, (2048, 768, 128, 8, True, 2): c}).save(
        tmp_path / "d.json"
    )
    again = TunedTable.load(tmp_path / "d.json")
    assert again.lookup((2048, 768, 128, 8, True, 1)) == d and again.lookup((2048, 768, 128, 8, True, 2)) == c
    written = json.loads((tmp_path / "d.json").read_text())["entries"]
    assert [("fused_reduce" in e) for e in written.values()] == [True, False]
    # the H200's Mixtral fp8 T <= 8 entry (session 34's bench tune): the H100's choice again
    h200_mix = builtin_table("h200").lookup((4096, 14336, 8, 2, True, 8))
    assert h200_mix.block_m == 16 and h200_mix.swap_ab is True and fp8_invariant(h200_mix)
    # the H100's Mixtral fp8 T <= 8 entry (session 29): 16-row swapped tiles, GEMM1 on 128 columns
    mix = builtin_table("h100").lookup((4096, 14336, 8, 2, True, 8))
    assert mix.block_m == 16 and mix.swap_ab is True and mix.block_n1 == 128 and fp8_invariant(mix)


@pytest.mark.parametrize(
    "shape, T, swapped",
    [
        ((2048, 768, 128, 8), 8, True),  # Qwen3: 1 row per active expert
        ((2048, 768, 128, 8), 128, True),  # 8 rows per expert: the last bucket on 16-row tiles
        ((2048, 768, 128, 8), 256, False),  # 16 rows per expert: 64-row tiles
        ((4096, 14336, 8, 2), 32, True),  # Mixtral: 8 rows per expert
        ((4096, 14336, 8, 2), 64, False),  # 16 rows per expert
        ((7168, 2048, 256, 8), 256, True),  # DeepSeek-V3: 8 rows per expert
    ],
)
def test_fp8_small_batches_take_swapped_16_row_tiles(shape, T, swapped):
    H, I, E, K = shape  # noqa: E741
    c = moe_config(T, K, H, I, E, fp8=True)
    assert fp8_invariant(c) and not c.direct
    assert (c.block_m == 16 and c.swap_ab is True) is swapped


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda o: o.update(format="other"), "format"),  # not a table
        (lambda o: o.update(version=99), "version"),  # a newer format
        (lambda o: o["entries"].update({"H=1,I=2": {}}), "table entry key"),  # a broken key
        (lambda o: next(iter(o["entries"].values())).update(block_q=1), r"fields of MoEConfig.*block_q"),
        (lambda o: next(iter(o["entries"].values())).pop("warps1"), r"fields of MoEConfig.*missing.*warps1"),
        (lambda o: next(iter(o["entries"].values())).update(block_m=0), "positive ints"),  # a zero tile
        (lambda o: next(iter(o["entries"].values())).update(stages1="4"), "positive ints"),  # text
        (lambda o: next(iter(o["entries"].values())).update(block_n1=96), "powers of two"),  # Triton's tiles
        (
            lambda o: o["entries"].update({"H=2048,I=768,E=128,K=8,fp8=1,T<=8": {**_row(o), "block_m": 16}}),
            "block_m.*fp8 batch invariance",  # an fp8 entry that would break batch invariance
        ),
        (  # 16-row tiles need the swapped kernels, whose GEMM2 takes 64 or 128 columns
            lambda o: o["entries"].update(
                {
                    "H=2048,I=768,E=128,K=8,fp8=1,T<=8": {
                        **_row(o),
                        "direct": False,
                        "block_m": 16,
                        "block_n2": 256,
                        "swap_ab": True,
                    }
                }
            ),
            "block_m.*fp8 batch invariance",
        ),
        (lambda o: next(iter(o["entries"].values())).update(swap_ab=1), "swap_ab"),  # a flag: true/false
        (lambda o: next(iter(o["entries"].values())).update(fused_reduce="no"), "fused_reduce"),  # a flag too
        # the backward section
        (lambda o: o["backward"].update({"H=1,I=2": {}}), "table entry key"),  # a broken key
        (lambda o: o["backward"].update({"H=64,I=32,E=4,K=2,fp8=1,T<=8": _tiles()}), "fp8=0"),  # fp8
        (lambda o: _bwd_row(o).pop("stages_x"), r"backward\[.*the fields"),  # a field missing
        (lambda o: _bwd_row(o).update(dw_tma=1), r"backward\[.*the fields"),  # a switch: not a tile
        (lambda o: _bwd_row(o).update(bn_x=96), "powers of two"),  # Triton's tiles
        (lambda o: _bwd_row(o).update(stages_x=0), "the rest >= 1"),  # no stages
        (lambda o: _bwd_row(o).update(dw_mode=3), "dw_mode 0-2"),
        (lambda o: _bwd_row(o).update(dw_progs=-2), "dw_progs >= -1"),
        (lambda o: _bwd_row(o).update(warps_x="8"), "ints"),  # text
    ],
)
def test_bad_table_files_fail_clearly(edit, match, tmp_path):
    obj = builtin_table("h100").to_json()  # forward entries and a backward section
    edit(obj)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=match):
        TunedTable.load(path)


def _row(obj):
    return dict(next(iter(obj["entries"].values())))


def test_unreadable_table_and_unknown_name_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="path.*tuned-table JSON"):
        TunedTable.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="name"):
        builtin_table("h300")


def test_override_and_the_cpu_table(tmp_path):
    cpu = torch.device("cpu")
    assert table_for(cpu).name == "generic"  # the interpreter is no card: heuristics alone
    path = tmp_path / "t.json"
    TunedTable("mine", "test").save(path)
    set_tuned_table(path)
    assert table_for(cpu).name == "mine"
    set_tuned_table("h100")
    assert table_for(cpu) is builtin_table("h100")
    set_tuned_table(None)
    assert table_for(cpu).name == "generic"


@pytest.mark.interpret
def test_the_launcher_takes_the_table_of_the_device(generator, monkeypatch):
    # an entry for this small problem, set as the table: fused_moe's Triton path launches with it
    T, H, I, E, K = 3, 64, 32, 4, 2  # noqa: E741
    mine = MoEConfig(True, 16, 16, 32, 4, 2, 32, 32, 4, 2, group_m=2)  # direct: an eager call keeps it
    set_tuned_table(TunedTable("mine", entries={table_key(H, I, E, K, False, T): mine}))
    seen = []
    launch = fwd.launch_experts
    monkeypatch.setattr(fwd, "launch_experts", lambda *a, **k: (seen.append(a[9]), launch(*a, **k))[1])
    x = torch.randn(T, H, generator=generator)
    w13 = torch.randn(E, 2 * I, H, generator=generator) / H**0.5
    w2 = torch.randn(E, H, I, generator=generator) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).int()
    wts = torch.rand(T, K, generator=generator)
    out = fwd.experts_triton(
        x, w13, w2, ids, wts, w13_scale=None, w2_scale=None, local_expert_offset=0, out=None
    )
    assert seen == [mine]
    assert_close(out, fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts), dtype=torch.float32)


MIXTRAL = (4096, 14336, 8, 2)  # H, I, E, K


def _tiles(**changes):
    """A backward entry: the heuristics' tiles of Mixtral at T=4096 (TMA on), with ``changes``."""
    H, I, E, K = MIXTRAL  # noqa: E741
    c = moe_bwd_config(4096, K, H, I, E, tma=True)
    return {**{f: int(getattr(c, f)) for f in BWD_TILE_FIELDS}, **changes}


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer loads"])
def test_moe_bwd_config_reads_the_backward_section(tma):
    # an entry measured with TMA (Hopper) is also read where TMA is off (fp32, REPLAYMOE_TMA=0): the
    # same tiles with pointer loads, as the forward's entries
    H, I, E, K = MIXTRAL  # noqa: E741
    entry = _tiles(stages_x=3, group_m=4)
    table = TunedTable("mine", backward={table_key(H, I, E, K, False, 4096): entry})
    heuristics = moe_bwd_config(4096, K, H, I, E, tma=tma)
    got = moe_bwd_config(4096, K, H, I, E, tma=tma, table=table)
    # the entry's tiles, the device's switches (TMA for dW and the GEMMs as the heuristics chose them)
    assert got == dataclasses.replace(heuristics, **entry)
    assert (got.dw_tma, got.gemm_tma) == (heuristics.dw_tma, heuristics.gemm_tma)
    assert moe_bwd_config(3000, K, H, I, E, tma=tma, table=table) == got  # T=3000: the bucket of 4096
    assert moe_bwd_config(8192, K, H, I, E, tma=tma, table=table) == moe_bwd_config(8192, K, H, I, E, tma=tma)
    assert moe_bwd_config(4096, K, H, I, E, tma=tma, table=builtin_table("generic")) == heuristics


def test_shipped_backward_entries():
    # the H100's Mixtral entries (bench/README.md, session 20): the heuristics with the dX GEMM in 3
    # stages, at each bench token count; the H200's one entry (session 35's local search): Mixtral T <= 1024
    # with dX in 3 stages and group_m 4, its heuristics elsewhere
    H, I, E, K = MIXTRAL  # noqa: E741
    h100, h200 = builtin_table("h100"), builtin_table("h200")
    for T in (1024, 4096, 16384):
        c = moe_bwd_config(T, K, H, I, E, tma=True, table=h100)
        assert c == dataclasses.replace(moe_bwd_config(T, K, H, I, E, tma=True), stages_x=3)
    assert list(h200.backward) == [table_key(H, I, E, K, False, 1024)]
    for T, want in ((1024, {"stages_x": 3, "group_m": 4}), (600, {"stages_x": 3, "group_m": 4}), (4096, {})):
        c = moe_bwd_config(T, K, H, I, E, tma=True, table=h200)
        assert c == dataclasses.replace(moe_bwd_config(T, K, H, I, E, tma=True), **want)
    qwen3 = (4096, 8, 2048, 768, 128)  # lost with 3 stages on the H100: no entry
    assert moe_bwd_config(*qwen3, tma=True, table=h100) == moe_bwd_config(*qwen3, tma=True)


def test_backward_section_round_trip(tmp_path):
    H, I, E, K = MIXTRAL  # noqa: E741
    table = builtin_table("h100").with_entries({}, name="mine")
    table = dataclasses.replace(
        table, backward={**table.backward, table_key(64, 32, 4, 2, False, 8): _tiles()}
    )
    path = tmp_path / "mine.json"
    table.save(path)
    again = TunedTable.load(path)
    assert again == table and again.lookup_backward(table_key(64, 32, 4, 2, False, 5)) == _tiles()
    del_backward = table.to_json()
    del del_backward["backward"]  # a table written before backward entries existed
    assert TunedTable.from_json(del_backward).backward == {}


def _bwd_row(obj):
    return next(iter(obj["backward"].values()))


@pytest.mark.interpret
def test_the_backward_launcher_takes_the_table_of_the_device(generator, monkeypatch):
    # a backward entry for this small problem, set as the table: fused_moe's Triton backward runs it
    T, H, I, E, K = 5, 64, 32, 4, 2  # noqa: E741
    c = moe_bwd_config(T, K, H, I, E)
    mine = {**{f: int(getattr(c, f)) for f in BWD_TILE_FIELDS}, "bn_x": 32, "stages_x": 2, "group_m": 2}
    set_tuned_table(TunedTable("mine", backward={table_key(H, I, E, K, False, T): mine}))
    seen = []
    launch = bwd.launch_bwd
    monkeypatch.setattr(bwd, "launch_bwd", lambda *a, **k: (seen.append(a[10]), launch(*a, **k))[1])
    x = torch.randn(T, H, generator=generator).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, generator=generator) / H**0.5).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=generator) / I**0.5).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).int()
    wts = torch.rand(T, K, generator=generator).requires_grad_()
    dout = torch.randn(T, H, generator=generator)
    got = torch.autograd.grad(fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="triton"),
                              (x, w13, w2, wts), dout)  # fmt: skip
    assert seen == [dataclasses.replace(c, bn_x=32, stages_x=2, group_m=2)]
    want = torch.autograd.grad(
        fused_moe_torch(x, w13, w2, topk_ids=ids, topk_weights=wts), (x, w13, w2, wts), dout
    )
    for a, b, name in zip(got, want, ("dx", "dw13", "dw2", "dwts")):
        assert_close(a, b, dtype=torch.float32, name=name)


@pytest.mark.parametrize("T", [1, 8, 64, 256, 4096, 65536])  # every heuristic branch, decode to prefill
@pytest.mark.parametrize("shape", [(32, 16, 8, 2), (2048, 768, 128, 8), (4096, 14336, 8, 2)])
def test_fp32_configs_fit_the_shared_memory_and_keep_the_bf16_tiles(T, shape):
    # fp32: the bf16 choice's tiles (block sizes, warps, mode), with stages (or K chunks) cut until
    # each GEMM's staged tiles fit the budget; a bf16 configuration that already fits is kept whole
    from replaymoe.moe.configs import SHARED_BUDGET, fit_shared_memory, moe_config

    H, I, E, K = shape  # noqa: E741
    bf16 = moe_config(T, K, H, I, E)
    fp32 = moe_config(T, K, H, I, E, itemsize=4)
    for rows, bk, stages in (
        (fp32.block_m + 2 * fp32.block_n1, fp32.block_k1, fp32.stages1),
        (fp32.block_m + fp32.block_n2, fp32.block_k2, fp32.stages2),
    ):
        assert rows * bk * 4 * (stages - 1) <= SHARED_BUDGET  # stages - 1 tiles in flight
    same = ("direct", "block_m", "block_n1", "warps1", "block_n2", "warps2", "group_m")
    assert all(getattr(fp32, f) == getattr(bf16, f) for f in same)
    assert fit_shared_memory(bf16, 2) == bf16  # every bf16 choice fits at 2 bytes


def test_fit_shared_memory_cuts_k_chunks_only_where_one_tile_does_not_fit():
    # at 4 bytes, GEMM1's 16 + 2 * 64 rows x 512-deep K is 288 KiB a tile: halved to 256 (144 KiB, one in
    # flight: 2 stages); GEMM2's 16 + 64 rows x 256 x 4 = 80 KiB a tile keeps its K, 2 in flight
    from replaymoe.moe.configs import MoEConfig, fit_shared_memory

    c = fit_shared_memory(MoEConfig(False, 16, 64, 512, 4, 3, 64, 256, 4, 4), 4)
    assert (c.block_k1, c.stages1, c.block_k2, c.stages2) == (256, 2, 256, 3)


@pytest.mark.parametrize("T", [1, 64, 512, 4096, 65536])  # every backward heuristic branch
@pytest.mark.parametrize("tma", [False, True])
def test_fp32_backward_configs_fit_the_shared_memory(T, tma):
    # the backward's dA, dX and dW GEMMs at fp32: bf16's tiles, stages (or K chunks) cut to fit
    from replaymoe.moe.configs import SHARED_BUDGET, moe_bwd_config

    H, I, E, K = 2048, 768, 128, 8  # noqa: E741
    bf16 = moe_bwd_config(T, K, H, I, E, tma=tma)
    fp32 = moe_bwd_config(T, K, H, I, E, tma=tma, itemsize=4)
    for rows, bk, stages in (
        (fp32.block_m + fp32.bn_a, fp32.bk_a, fp32.stages_a),
        (fp32.block_m + fp32.bn_x, fp32.bk_x, fp32.stages_x),
        (fp32.bm_w + fp32.bn_w, fp32.bk_w, fp32.stages_w),
    ):
        assert rows * bk * 4 * (stages - 1) <= SHARED_BUDGET
    same = ("block_m", "bn_a", "warps_a", "bn_x", "warps_x", "bm_w", "bn_w", "warps_w", "dw_mode")
    assert all(getattr(fp32, f) == getattr(bf16, f) for f in same)

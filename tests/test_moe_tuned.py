"""Tuned tables of the fused MoE (``replaymoe.moe.tuned``): the shipped tables, the choice by device,
JSON round trips and their errors, ``moe_config`` reading a table, and the launcher taking the table of
the input's device (interpreter)."""

from __future__ import annotations

import json

import pytest
import torch

from replaymoe.moe import _forward as fwd
from replaymoe.moe import fused_moe_torch
from replaymoe.moe.configs import FP8_BLOCK_M, MoEConfig, moe_config
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
    # DeepSeek-V3 bf16 decode and Qwen3 fp8 decode, as tuned on the H200 (bench/moe_notes.md)
    assert h200.lookup((7168, 2048, 256, 8, False, 1)) == MoEConfig(True, 16, 64, 128, 4, 4, 32, 256, 4, 4)
    assert h200.lookup((2048, 768, 128, 8, True, 1)) == MoEConfig(True, 64, 64, 128, 4, 6, 128, 128, 8, 4)
    assert h200.lookup((2048, 768, 128, 8, True, 1), fp8_fast=True).block_m == 16
    assert h200.tuned_on and h100.base == "h200" and builtin_table("generic").entries == {}
    for table in (h200, h100):  # every batch-invariant fp8 entry keeps the 64-row tiles
        assert all(c.block_m == FP8_BLOCK_M for k, c in table.entries.items() if k[4])


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
    ],
)
def test_bad_table_files_fail_clearly(edit, match, tmp_path):
    obj = builtin_table("h200").to_json()
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
    launch = fwd._launch
    monkeypatch.setattr(fwd, "_launch", lambda *a, **k: (seen.append(a[9]), launch(*a, **k))[1])
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

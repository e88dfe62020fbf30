"""``replaymoe bench tune``: its candidate grid (CPU) and a short sweep on the GPU that writes a table
the library then reads."""

from __future__ import annotations

import json

import pytest
import torch

from replaymoe.bench import tune as bench_tune
from replaymoe.moe.configs import FP8_BLOCK_M, moe_config
from replaymoe.moe.tuned import TunedTable, set_tuned_table, table_for

QWEN3 = (2048, 768, 128)  # H, I, E (top-8)


@pytest.mark.parametrize(
    "T, fp8, fast",
    [
        (1, False, False),  # decode: direct configurations join the tiles
        (64, False, False),  # 512 slots over 128 experts: 16/32-row tiles
        (4096, False, False),  # prefill: 64/128-row tiles
        (1, True, False),  # fp8 batch-invariant: 64-row tiles only, 128-deep K (the block scales)
        (64, True, True),  # fp8 --fast: any tile height
    ],
)
def test_candidates_start_with_the_heuristics_and_keep_the_guarantees(T, fp8, fast):
    H, I, E = QWEN3  # noqa: E741
    cands = bench_tune.candidates(T, 8, H, I, E, fp8=fp8, fast=fast, tma=False)
    assert cands[0] == moe_config(T, 8, H, I, E, fp8=fp8, batch_invariant=not fast)
    assert len(cands) == len(set(cands)) > 3
    assert any(c.direct for c in cands) == (T * 8 <= 256)
    if fp8 and not fast:
        assert all(c.block_m == FP8_BLOCK_M for c in cands)
    if fp8:
        assert all(c.block_k1 == c.block_k2 == 128 for c in cands[1:])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--shape", "qwen3", "--tokens", "1,x"], "--tokens"),
        (["--shape", "qwen3", "--tokens", "0"], "--tokens"),
        (["--shape", "qwen3", "--fast"], "--fast"),  # bf16 has no fp8_fast entries
        (["--shape", "qwen3", "--min-gain", "1.5"], "--min-gain"),
        (["--shape", "llama"], "--shape"),
    ],
)
def test_bad_options_fail_before_any_work(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_tune.main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_short_sweep_writes_a_table_the_library_reads(tmp_path):
    try:
        assert bench_tune.main(["--shape", "qwen3", "--tokens", "1", "--max-minutes", "2", "--min-gain", "0",
                                "--name", "mine", "--out", str(tmp_path)]) == 0  # fmt: skip
        rows = json.loads((tmp_path / "tune.json").read_text())
        rows = rows["rows"] if isinstance(rows, dict) else rows
        assert any(r["current"] for r in rows) and all(r["us"] > 0 for r in rows)
        table = TunedTable.load(tmp_path / "tuned_mine.json")
        assert table.name == "mine" and table.tuned_on == torch.cuda.get_device_name()
        set_tuned_table(tmp_path / "tuned_mine.json")
        assert table_for(torch.device("cuda", 0)) == table
    finally:
        set_tuned_table(None)

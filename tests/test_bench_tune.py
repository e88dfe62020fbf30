"""``replaymoe bench tune``: its candidate grids (CPU), the backward sweep with a stand-in timer in
Triton's interpreter, and short sweeps on the GPU that write a table the library then reads."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from replaymoe.bench import tune as bench_tune
from replaymoe.bench import tune_bwd
from replaymoe.moe import configs
from replaymoe.moe.configs import BWD_TILE_FIELDS, FP8_BLOCK_M, fp8_invariant, moe_bwd_config, moe_config
from replaymoe.moe.tuned import TunedTable, set_tuned_table, table_for, table_key

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
    if fp8 and not fast:  # one MMA kind: 64-row tiles, or the swapped kernels' 16 / 32-row tiles
        assert all(fp8_invariant(c) for c in cands)
        assert any(c.block_m != FP8_BLOCK_M for c in cands) == (T * 8 / min(E, T * 8) < 48)
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
        (["--shape", "qwen3", "--backward", "--dtype", "fp8"], "--backward"),  # fp8 is inference-only
        (["--shape", "qwen3", "--refine-rounds", "-1"], "--refine-rounds"),
        (["--shape", "qwen3", "--table", "/nonexistent/tuned_h200.json"], "--table"),  # no such file
    ],
)
def test_bad_options_fail_before_any_work(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_tune.main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize(
    "T, K, E",
    [
        (4096, 2, 8),  # Mixtral: long expert segments, 128-row tiles, the dW tile grid
        (64, 8, 128),  # Qwen3 T=64: 4 rows per expert, 16-row tiles (the dW grid is left out)
    ],
)
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer loads"])
def test_backward_candidates_start_with_the_heuristics(T, K, E, tma):
    H, I = 4096, 1024  # noqa: E741
    cands = tune_bwd.backward_candidates(T, K, H, I, E, tma=tma)
    base = moe_bwd_config(T, K, H, I, E, tma=tma)
    assert cands[0] == base and len(cands) == len(set(cands)) > 10
    # every candidate keeps the device's switches and the layout's tile height (the forward's layout)
    assert all((c.dw_tma, c.gemm_tma, c.block_m) == (base.dw_tma, base.gemm_tma, base.block_m) for c in cands)
    assert any(c.stages_x != base.stages_x for c in cands) and any(c.group_m != base.group_m for c in cands)
    assert any(c.dw_progs != base.dw_progs for c in cands) == tma


@pytest.mark.parametrize("tma", [False, True], ids=["pointer dW", "TMA dW (its grid varies too)"])
def test_backward_variations_vary_one_group_around_any_configuration(tma):
    # around a configuration that is not the heuristics' (the local search's lead): the same groups vary
    # around it, it is not among them, and the other groups keep its values
    base = moe_bwd_config(4096, 8, 2048, 768, 128, tma=tma)
    lead = dataclasses.replace(base, stages_x=2, group_m=16)
    vs = tune_bwd.variations(lead)
    assert lead not in vs and len(vs) == len(set(vs)) > 10
    dw_tiles = {"bm_w", "bn_w", "bk_w", "warps_w", "stages_w", "maxnreg_w"}
    groups = [
        {f} for f in ("stages_a", "stages_x", "warps_a", "warps_x", "bn_a", "bn_x", "dw_progs", "group_m")
    ]
    groups.append(dw_tiles)
    for v in vs:
        changed = {f.name for f in dataclasses.fields(v) if getattr(v, f.name) != getattr(lead, f.name)}
        assert any(changed <= g for g in groups), changed
    assert dataclasses.replace(lead, bn_a=128 if lead.bn_a != 128 else 256) in vs
    assert any(v.dw_progs != lead.dw_progs for v in vs) == tma


@pytest.mark.interpret
def test_backward_sweep_keeps_a_confirmed_winner(monkeypatch):
    # a tiny layer in the interpreter; a stand-in timer makes the dX GEMM in 2 stages faster, and faster
    # still with another group_m, which alone gains nothing: the grid finds the first, the local search
    # (one round of variations around it) the two together, confirmed in alternating rounds; its kernel
    # tiles become the entry
    H, I, E, K, T = 64, 32, 4, 2, 5  # noqa: E741
    base = moe_bwd_config(T, K, H, I, E)
    g = 16 if base.group_m != 16 else 4
    assert base.stages_x != 2

    def fake_time(config, fn, timer=None):
        fn()  # the configuration runs (and must give the heuristics' bits to be timed at all)
        return 1.5 if config.stages_x != 2 else 1.0 if config.group_m == g else 1.25

    monkeypatch.setattr(tune_bwd, "time_config", fake_time)
    logged = []
    rows, winners = tune_bwd.tune_backward(
        "tiny",
        (H, I, E, K),
        [T],
        min_gain=0.02,
        deadline=math.inf,
        log=logged.append,
        device="cpu",
        refine_rounds=1,
    )
    best = dataclasses.replace(base, stages_x=2, group_m=g)
    assert winners == {table_key(H, I, E, K, False, T): {f: getattr(best, f) for f in BWD_TILE_FIELDS}}
    assert any(r["current"] for r in rows) and all(r["pass"] == "backward" for r in rows)
    assert any(r["refined"] for r in rows) and not any(r["refined"] for r in rows[:2])
    assert any("+50.0%" in line for line in logged)  # the confirmation's median gain
    table = TunedTable("mine").with_entries(winners, backward=True)
    assert moe_bwd_config(T, K, H, I, E, table=table) == best


@pytest.mark.interpret
@pytest.mark.parametrize("gain, kept", [(0.5, True), (0.01, False)], ids=["a gain", "below --min-gain"])
def test_forward_sweep_keeps_a_confirmed_winner(gain, kept, monkeypatch):
    # a tiny layer in the interpreter, two candidates of the same tiles (the same bits there): the second
    # one, timed faster by a stand-in timer, becomes the entry where it gains at least min_gain
    from replaymoe.bench import _tuning

    H, I, E, K, T = 64, 32, 4, 2, 5  # noqa: E741
    base = moe_config(T, K, H, I, E)
    other = dataclasses.replace(base, stages1=base.stages1 + 1)
    monkeypatch.setattr(bench_tune, "candidates", lambda *a, **k: [base, other])
    monkeypatch.setattr(_tuning, "_time_config", lambda c, fn: (fn(), 1.0 if c == other else 1.0 + gain)[1])
    rows, winners = bench_tune.tune("tiny", [T], fp8=False, fast=False, min_gain=0.02, deadline=math.inf,
                                    log=lambda _: None, device="cpu", dims=(H, I, E, K),
                                    refine_rounds=0)  # fmt: skip
    assert winners == ({table_key(H, I, E, K, False, T): other} if kept else {})
    assert [r["current"] for r in rows] == [True, False] and rows[1]["vs_current"] == pytest.approx(1 + gain)


@pytest.mark.interpret
def test_forward_sweep_from_a_given_table_merges_into_it(monkeypatch, tmp_path):
    # --table chains runs: the given table's entry is the current choice (so the same faster candidate
    # is no gain over it), and a run's winners merge into the table it started from
    from replaymoe.bench import _tuning

    H, I, E, K = 64, 32, 4, 2  # noqa: E741
    base = moe_config(5, K, H, I, E)
    other = dataclasses.replace(base, stages1=base.stages1 + 1)
    monkeypatch.setattr(bench_tune, "candidates", lambda *a, **k: [base, other])
    monkeypatch.setattr(_tuning, "_time_config", lambda c, fn: (fn(), 1.0 if c == other else 2.0)[1])
    earlier = {table_key(H, I, E, K, False, 5): other}
    start = TunedTable("mine", notes="an earlier run.").with_entries(earlier)
    start.save(tmp_path / "tuned_mine.json")
    start = TunedTable.load(tmp_path / "tuned_mine.json")  # as main reads --table
    kw = dict(fp8=False, fast=False, min_gain=0.02, deadline=math.inf, log=lambda _: None, device="cpu",
              dims=(H, I, E, K), refine_rounds=0)  # fmt: skip
    rows, winners = bench_tune.tune("tiny", [5], table=start, **kw)
    assert winners == {} and [r["current"] for r in rows] == [False, True]  # the table's entry is current
    assert rows[1]["config"] == str(other)
    rows, winners = bench_tune.tune("tiny", [12], table=start, **kw)  # another bucket: a new entry
    assert winners == {table_key(H, I, E, K, False, 12): other}
    merged = start.with_entries(winners)
    assert set(merged.entries) == {*earlier, *winners} and merged.notes == "an earlier run."


@pytest.mark.parametrize(
    "c, expected",
    [
        # direct mode, GEMM1 mid-range, GEMM2 at the stages' top and on 8 warps: none past 6 stages, and
        # the top-k sum (on in GEMM2 by default) moved to the reduce kernel
        (
            configs.MoEConfig(True, 16, 32, 128, 4, 3, 64, 128, 8, 6),
            [
                ("fused_reduce", False),
                ("stages1", 2),
                ("stages1", 4),
                ("warps1", 8),
                ("stages2", 5),
                ("warps2", 4),
            ],
        ),
        # direct mode with the reduce kernel: the sum moves back into GEMM2
        (
            configs.MoEConfig(True, 64, 32, 128, 4, 3, 64, 128, 4, 3, fused_reduce=False),
            [
                ("fused_reduce", True),
                ("stages1", 2),
                ("stages1", 4),
                ("warps1", 8),
                ("stages2", 2),
                ("stages2", 4),
                ("warps2", 8),
            ],
        ),
        # the stages' floor, and warps outside (4, 8) left alone: only GEMM1's stages + 1, GEMM2's +/- 1
        (
            configs.MoEConfig(False, 64, 128, 128, 2, 2, 128, 128, 16, 4),
            [("stages1", 3), ("stages2", 3), ("stages2", 5)],
        ),
        # an fp8 swapped 16-row tile: the swap and the tiles stay, so the batch-invariance class does
        (
            configs.MoEConfig(False, 16, 32, 128, 4, 3, 64, 128, 4, 3, swap_ab=True),
            [("stages1", 2), ("stages1", 4), ("warps1", 8), ("stages2", 2), ("stages2", 4), ("warps2", 8)],
        ),
    ],
)
def test_neighbours_are_one_step_in_warps_or_stages(c, expected):
    got = bench_tune.neighbours(c)
    assert got == [dataclasses.replace(c, **{f: v}) for f, v in expected]
    assert all(fp8_invariant(n) == fp8_invariant(c) and n.swap_ab == c.swap_ab for n in got)


@pytest.mark.interpret
@pytest.mark.parametrize("rounds", [0, 1, 2], ids=["grid only", "one round", "two rounds"])
def test_forward_refinement_walks_to_a_faster_neighbour(rounds, monkeypatch):
    # the grid is the heuristics' configuration alone; a stand-in timer makes one step away (GEMM1 one
    # stage deeper) 1.5x faster and two steps away (also on 8 warps) 2x: each refinement round takes one
    # step, and the walk's end, confirmed, becomes the entry
    from replaymoe.bench import _tuning

    H, I, E, K, T = 64, 32, 4, 2, 5  # noqa: E741
    base = moe_config(T, K, H, I, E)
    one = dataclasses.replace(base, stages1=base.stages1 + 1)
    two = dataclasses.replace(one, warps1=12 - base.warps1)  # the other of 4 and 8
    speed = {one: 1.5, two: 2.0}
    monkeypatch.setattr(bench_tune, "candidates", lambda *a, **k: [base])
    monkeypatch.setattr(_tuning, "_time_config", lambda c, fn: (fn(), 2.0 / speed.get(c, 1.0))[1])
    rows, winners = bench_tune.tune("tiny", [T], fp8=False, fast=False, min_gain=0.02, deadline=math.inf,
                                    log=lambda _: None, device="cpu", dims=(H, I, E, K),
                                    refine_rounds=rounds)  # fmt: skip
    expected = {0: {}, 1: {table_key(H, I, E, K, False, T): one}, 2: {table_key(H, I, E, K, False, T): two}}
    assert winners == expected[rounds]
    assert [r["refined"] for r in rows][:1] == [False] and all(r["refined"] for r in rows[1:])
    assert len(rows) == 1 + (rounds >= 1) * len(bench_tune.neighbours(base)) + (rounds >= 2) * sum(
        n not in {base, *bench_tune.neighbours(base)} for n in bench_tune.neighbours(one)
    )


@pytest.mark.interpret
def test_backward_sweep_keeps_the_current_choice_without_a_gain(monkeypatch):
    monkeypatch.setattr(tune_bwd, "time_config", lambda config, fn, timer=None: (fn(), 1.0)[1])
    rows, winners = tune_bwd.tune_backward(
        "tiny", (64, 32, 4, 2), [3], min_gain=0.02, deadline=math.inf, log=lambda _: None, device="cpu"
    )
    # every time equal: the heuristics' configuration stays the fastest, and its neighbours were the grid
    assert winners == {} and rows and not any(r["refined"] for r in rows)


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


@pytest.mark.gpu
def test_gpu_backward_sweep_writes_backward_entries(tmp_path):
    # a short backward sweep (Qwen3, T=64) writes the card's table with its backward section intact
    try:
        argv = ["--shape", "qwen3", "--tokens", "64", "--backward", "--max-minutes", "2", "--min-gain", "0",
                "--name", "mine", "--out", str(tmp_path)]  # fmt: skip
        assert bench_tune.main(argv) == 0
        rows = json.loads((tmp_path / "tune.json").read_text())
        rows = rows["rows"] if isinstance(rows, dict) else rows
        assert any(r["current"] for r in rows) and all(r["us"] > 0 and r["pass"] == "backward" for r in rows)
        table = TunedTable.load(tmp_path / "tuned_mine.json")
        current = table_for(torch.device("cuda", 0))
        assert table.entries == current.entries  # the forward entries as they were
        assert set(current.backward) <= set(table.backward)
    finally:
        set_tuned_table(None)

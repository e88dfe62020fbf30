"""`replaymoe bench trl`'s section columns, turn-taking and clocks, and its `--loss-curve`, on the CPU
(the timing itself needs a GPU)."""

import argparse
import csv
import math
import threading

import pytest

from replaymoe.bench import trl as bench_trl

pytest.importorskip("trl")


@pytest.mark.parametrize(
    "name, inside_loss, column",
    [
        ("R3GRPOTrainer.transformers.generate", False, "generate"),  # the class name is cut off
        ("GRPOTrainer.transformers.generate_batch", False, "generate"),  # continuous batching
        ("GRPOTrainer.vLLM.generate", False, "generate"),  # a dotted section name
        ("GRPOTrainer._get_per_token_logps_and_entropies", False, "scoring"),  # old/ref log-probs
        ("GRPOTrainer._get_per_token_logps_and_entropies", True, "loss_forward"),  # inside the loss
        ("GRPOTrainer.compute_loss", False, "loss_forward"),
        ("GRPOTrainer._prepare_inputs", False, "prepare"),
        ("GRPOTrainer.CountLowTokens", False, "rewards"),  # a reward function's own section
    ],
)
def test_section_columns(name, inside_loss, column):
    assert bench_trl.section_of(name, inside_loss) == column


@pytest.mark.parametrize("steps", [[3, 3, 3], [1, 3, 2], [0, 2, 2]])  # equal; uneven; one dies at once
def test_turns_alternate_one_step_each(steps):
    turns = bench_trl.Turns(len(steps))
    order: list[int] = []

    def trainer(i: int) -> None:
        for s in range(steps[i]):
            turns.wait(i, first=s == 0)
            order.append(i)  # one trainer at a time: no lock needed
        turns.done(i, arrived=steps[i] > 0)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(len(steps))]
    for t in reversed(threads):  # the last one arrives first: the order must not depend on arrival
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    expected = [i for r in range(max(steps)) for i in range(len(steps)) if r < steps[i]]
    assert order == expected


def test_clock_sections_are_exclusive_and_add_up():
    clock = bench_trl.StepClock(lambda: None)
    clock.start_step()
    clock.enter("prepare")
    clock.enter("generate")  # nested: its time counts in generate, not in prepare
    clock.exit()
    clock.exit()
    clock.enter("backward")
    clock.exit()
    clock.end_step()
    (row,) = clock.sections
    assert set(row) == set(bench_trl.SECTIONS)
    assert all(v >= 0 for v in row.values())
    assert sum(row.values()) == pytest.approx(clock.steps[0], rel=1e-9, abs=1e-12)


def _args(**given):
    """bench trl's options at toy size on the CPU (one warm-up step)."""
    a = dict(arch="qwen3_moe", size="tiny", generations=2, warmup=1, checkpointing=False, device="cpu",
             cache="dynamic", compile_generate=False, lr=1e-6)  # fmt: skip
    return argparse.Namespace(**{**a, **given})


def test_alternating_trainers_on_the_cpu(tmp_path):
    # the real thing at toy size: two trainers (enable() and R3), one step each in turn, sections
    # that add up to the step, and the ratios of the summary
    a = _args(batch=4, completion=3, steps=2, rounds=1, sequential=False)
    clocks = bench_trl.run_rounds(["replaymoe", "r3"], a)
    starts = sorted((t, impl) for impl, c in clocks.items() for t in c.starts)
    assert [impl for _, impl in starts] == ["replaymoe", "r3"] * 3
    for clock in clocks.values():
        assert len(clock.steps) == 3
        for step, row in zip(clock.steps, clock.sections):
            assert sum(row.values()) == pytest.approx(step)
            assert row["generate"] > 0 and row["loss_forward"] > 0 and row["backward"] > 0
            assert row["optimizer"] > 0
    assert all(c.timed == [False, True, True] for c in clocks.values())  # the warm-up step is not counted
    rows = {r["impl"]: r for r in bench_trl.summarize(clocks, a)}
    assert rows["r3"]["steps"] == 2
    assert rows["r3"]["generate_vs_enable"] == pytest.approx(
        rows["r3"]["generate_ms"] / rows["replaymoe"]["generate_ms"]
    )


def test_sequential_rounds_reverse_the_order():
    # two rounds, one trainer after the other: A B, then B A; each round's warm-up step left out; the
    # replaymoe's generation on a static cache with TRL's disable_compile turned off
    # (--cache static --compile-generate; transformers compiles on CUDA only)
    a = _args(
        batch=2, completion=2, steps=1, rounds=2, sequential=True, cache="static", compile_generate=True
    )
    clocks = bench_trl.run_rounds(["grouped_mm", "replaymoe"], a)
    starts = sorted((t, impl) for impl, c in clocks.items() for t in c.starts)
    assert [impl for _, impl in starts] == ["grouped_mm"] * 2 + ["replaymoe"] * 4 + ["grouped_mm"] * 2
    assert all(c.timed == [False, True, False, True] for c in clocks.values())
    rows = bench_trl.summarize(clocks, a)
    assert [r["steps"] for r in rows] == [2, 2]
    # stock keeps TRL's defaults, the baseline of the fast setting: a dynamic cache, nothing compiled
    assert [(r["cache"], r["compile_generate"]) for r in rows] == [("dynamic", False), ("static", True)]


def test_loss_curve_on_the_cpu(tmp_path, capsys):
    # the real thing at toy size through main(): R3 trains 3 steps in each replay mode from the same
    # weights; every step logs (no warm-up dropped), replay holds in both modes, and the picture is
    # written. A higher lr than the default so the routers move within 3 steps (native_vs_rollout
    # may then be > 0: that is drift, not a replay failure, and is not asserted)
    argv = ["--loss-curve", "--device", "cpu", "--size", "tiny", "--batch", "4", "--generations", "2",
            "--completion", "3", "--steps", "3", "--lr", "1e-2", "--out", str(tmp_path)]  # fmt: skip
    assert bench_trl.main(argv) == 0
    with open(tmp_path / "trl_loss.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[: 2 + len(bench_trl.LOGGED_KEYS)] == ["step", "mode", *bench_trl.LOGGED_KEYS]
    assert sorted((r["mode"], int(r["step"])) for r in rows) == [
        (mode, step) for mode in sorted(bench_trl.LOSS_MODES) for step in (1, 2, 3)
    ]
    for r in rows:
        assert math.isfinite(float(r["loss"])) and math.isfinite(float(r["reward"]))
        assert float(r["r3/replayed_vs_rollout"]) == 0.0  # every replayed lookup used the rollout's ids
        assert r["grad_norm"] != ""  # TRL logs it at every step
    first = {r["mode"]: r for r in rows if r["step"] == "1"}  # same seed, weights, prompts: same rollout
    assert first["ids"]["reward"] == first["ids+weights"]["reward"]
    png = (tmp_path / "trl_loss.png").read_bytes()
    assert len(png) > 1000 and png.startswith(b"\x89PNG\r\n\x1a\n")
    out = capsys.readouterr().out
    assert "loss:ids" in out and "loss:full" in out and "trl_loss.png" in out


def test_loss_rows_skip_the_summary_and_leave_unlogged_keys_empty():
    # the run's last log_history entry is TRL's summary (train_loss, no loss): not a step; a step
    # whose log lacks a key (no grad_norm, no R3 counts) keeps the row with None there
    history = [
        {"loss": 0.5, "reward": 1.0, "r3/replayed_vs_rollout": 0.0, "step": 1},
        {"train_loss": 0.5, "train_runtime": 1.0, "step": 1},
    ]
    (row,) = bench_trl.loss_rows(history, "ids")
    assert row["step"] == 1 and row["mode"] == "ids" and row["loss"] == 0.5
    assert row["grad_norm"] is None and row["r3/native_vs_rollout"] is None


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--impls", "r3"], "--impls"),  # the trainers of the timing: the curve always trains R3
        (["--warmup", "0"], "--warmup"),  # given even at 0: the curve counts every step anyway
        (["--rounds", "2"], "--rounds"),
        (["--sequential"], "--sequential"),
        (["--impls", "r3", "--sequential"], "--impls, --sequential are"),  # every one named
    ],
)
def test_loss_curve_refuses_timing_options(extra, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_trl.main(["--loss-curve", "--device", "cpu", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--loss-curve" in err and named in err and "timing comparison only" in err


@pytest.mark.parametrize("extra", [[], ["--loss-curve", "--cache", "static"]])  # dynamic cache; the curve
def test_compile_generate_needs_the_static_cache_timing(extra, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_trl.main(["--device", "cpu", "--compile-generate", *extra])
    assert exc.value.code == 2 and "--compile-generate needs --cache static" in capsys.readouterr().err


def test_lr_must_be_positive(capsys):
    # a bad --lr is a usage error before any model is built (timing and loss curve alike)
    with pytest.raises(SystemExit) as exc:
        bench_trl.main(["--loss-curve", "--device", "cpu", "--lr", "0"])
    assert exc.value.code == 2 and "--lr must be positive" in capsys.readouterr().err

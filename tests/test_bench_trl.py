"""`replaymoe bench trl`'s section columns, turn-taking and clocks, on the CPU (the benchmark itself
needs a GPU)."""

import argparse
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
             cache="dynamic")  # fmt: skip
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
    # generation on a static cache (GRPOConfig.cache_implementation)
    a = _args(batch=2, completion=2, steps=1, rounds=2, sequential=True, cache="static")
    clocks = bench_trl.run_rounds(["grouped_mm", "replaymoe"], a)
    starts = sorted((t, impl) for impl, c in clocks.items() for t in c.starts)
    assert [impl for _, impl in starts] == ["grouped_mm"] * 2 + ["replaymoe"] * 4 + ["grouped_mm"] * 2
    assert all(c.timed == [False, True, False, True] for c in clocks.values())
    rows = bench_trl.summarize(clocks, a)
    assert [r["steps"] for r in rows] == [2, 2] and all(r["cache"] == "static" for r in rows)

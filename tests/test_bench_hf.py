"""`replaymoe bench hf`'s per-step clock and percentile, on the CPU (the benchmark itself needs a GPU)."""

import statistics

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from replaymoe.bench import hf as bench_hf
from replaymoe.bench.hf_timing import GraphCaptureCount, StepClock, quantile, shared_copy
from replaymoe.hf.models import build_model


@pytest.mark.parametrize("new", [1, 2, 5])  # 1: no decode step at all; 2: one gap
def test_step_clock_stamps_once_per_generated_token(new):
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "tiny", dtype=torch.float32, device="cpu")
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
    assert out.shape[1] == ids.shape[1] + new
    assert len(clock.stamps) == new  # one stamp per generated token
    steps = clock.steps()
    assert len(steps) == new - 1 and all(s > 0 for s in steps)


@pytest.mark.parametrize(
    "values, q",
    [
        ([3.0], 0.1),  # one value: itself
        ([5.0, 1.0], 0.1),  # two values, unsorted
        (list(np.random.default_rng(0).random(401)), 0.1),  # many values
        (list(np.random.default_rng(1).random(63)), 0.5),  # the median
    ],
)
def test_quantile_matches_numpy(values, q):
    assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12)


def test_graph_capture_count_installs_and_restores():
    orig = torch.cuda.CUDAGraph.capture_begin
    with GraphCaptureCount() as counter:
        assert torch.cuda.CUDAGraph.capture_begin is not orig
        assert counter.count == 0
    assert torch.cuda.CUDAGraph.capture_begin is orig


@pytest.mark.gpu
def test_graph_capture_count_counts_each_capture():
    x = torch.zeros(4, device="cuda")
    with GraphCaptureCount() as counter:
        for _ in range(2):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                x.add_(1)
    assert counter.count == 2


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--impls", "grouped_mm,nope"], "--impls: unknown ['nope']"),  # one unknown among known
        (["--modes", "eager,compiled"], "--modes: unknown ['compiled']"),
        (["--batch", "1,x"], "--batch: expected comma-separated positive integers, got '1,x'"),
        (["--batch", "0"], "--batch: expected comma-separated positive integers, got '0'"),  # not positive
        (["--batch", ","], "--batch: expected at least one entry, got none"),  # empty after the split
        (["--modes", ""], "--modes: expected at least one entry, got none"),
    ],
)
def test_bad_arguments_exit_before_the_gpu_is_needed(argv, named, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_hf.main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--impls", "grouped_mm,nope"], "unknown impls ['nope']"),  # one unknown layer impl among known
        (["--shapes", "qwen3,gpt5"], "unknown shapes ['gpt5']"),
    ],
)
def test_bench_train_bad_arguments_exit_before_the_gpu_is_needed(argv, named, capsys, tmp_path):
    from replaymoe.bench import train as bench_train

    with pytest.raises(SystemExit) as exc:
        bench_train.main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    "mode", ["eager", "static"]
)  # static: a StaticCache, kept across calls (no compile on CPU)
def test_bench_cell_rows_on_cpu(mode, monkeypatch, generator):
    # the cell's bookkeeping end to end on real tiny models (its times mean nothing on the CPU);
    # the device syncs are the only CUDA calls on this path
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    model = build_model("qwen3_moe", "tiny", seed=0)
    model.set_experts_implementation("grouped_mm")
    ref = build_model("qwen3_moe", "tiny", seed=0)
    args = bench_hf._parse(["--batch", "2", "--prompt", "5", "--new", "4", "--repeats", "2"])
    impls = list(bench_hf.IMPLS)
    copies = {i: (model if i == "grouped_mm" else shared_copy(model)) for i in impls}
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=generator)
    graphs = GraphCaptureCount()  # never entered: no capture counted (none on the CPU anyway)
    rows = bench_hf._bench_cell(
        copies, ref, impls, ids, torch.ones_like(ids), mode, args, bench_hf._SkipLog(), graphs=graphs
    )
    assert [r["impl"] for r in rows] == impls
    for r in rows:
        assert r["mode"] == mode and r["batch"] == 2 and len(r["round_s"]) == 2
        assert r["step_ms_p10"] > 0 and r["cuda_graph_captures"] == 0
        assert r["same_tokens_as_grouped_mm"] == 1.0  # fp32 tiny model: the same greedy tokens
        assert r["logits_rel_err_vs_fp32"] < 1e-5
    assert rows[1]["vs_replaymoe"] == 1.0 and rows[1]["vs_replaymoe_step_p10"] == 1.0
    assert rows[3]["same_tokens_as_rollout"] == 1.0  # replay regenerates the captured rollout


def test_bench_cell_rollout_in_training_mode_on_cpu(monkeypatch, generator):
    # --train-mode with R3's rollout (capture, then the round loaded for replay), as TRL generates:
    # the rows come out, the copies stay in training mode
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    model = build_model("qwen3_moe", "tiny", seed=0)
    args = bench_hf._parse(["--batch", "2", "--prompt", "5", "--new", "4", "--repeats", "2", "--train-mode",
                            "--impls", "replaymoe,replaymoe+rollout", "--no-error"])  # fmt: skip
    copies = {i: shared_copy(model).train(args.train_mode) for i in args.impl_list}
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=generator)
    rows = bench_hf._bench_cell(
        copies, None, args.impl_list, ids, torch.ones_like(ids), "eager", args, bench_hf._SkipLog(),
        graphs=GraphCaptureCount(),
    )  # fmt: skip
    assert [r["impl"] for r in rows] == ["replaymoe", "replaymoe+rollout"]
    assert all(r["train_mode"] for r in rows)
    assert all(m.training for m in copies.values())


@pytest.mark.parametrize("replay", [False, True])
def test_bench_train_hf_rows_record_checkpointing_and_replay(replay, monkeypatch):
    # `bench train --checkpointing [--replay]`'s HF rows on a tiny CPU model, each step run once in
    # place of its timing: the rows say what was on, and a checkpointed step replays through
    # moe.replaying (the recompute in backward finds its bound ids)
    from replaymoe.bench import train as bench_train

    monkeypatch.setattr(bench_train, "time_eager", lambda fn, **kw: (fn(), 1000.0)[1])
    rows = bench_train._hf_rows(
        "qwen3_moe", 2, 6, rounds=1, checkpointing=True, replay=replay, size="tiny", device="cpu"
    )
    impls = ["grouped_mm", "replaymoe"] + ([] if replay else ["replaymoe+replay"])
    assert [r["impl"] for r in rows] == impls
    assert all(r["checkpointing"] is True for r in rows)
    assert [r["replay"] for r in rows] == [False, replay] + ([] if replay else [True])
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["host_ms"] > 0 for r in rows)  # the host's time to issue a step (the CPU: the step)


@pytest.mark.parametrize("compile", [None, "aot_eager"])
def test_bench_train_floor_row_is_free_experts(compile, monkeypatch):
    # `bench train --floor`: the free_experts row runs the model with experts that do no work (each
    # token's output is its input times its summed routing weight), eager and compiled; its step
    # differs from grouped_mm's (a different loss), reaches the routers in the backward, and its
    # speed-up column is the ceiling next to the others
    from replaymoe.bench import train as bench_train

    torch._dynamo.reset()
    monkeypatch.setattr(bench_train, "time_eager", lambda fn, **kw: (fn(), 1000.0)[1])
    rows = bench_train._hf_rows(
        "qwen3_moe", 2, 6, rounds=1, checkpointing=True, replay=True, compile=compile, size="tiny",
        device="cpu", floor=True,
    )  # fmt: skip
    torch._dynamo.reset()
    assert [r["impl"] for r in rows] == ["grouped_mm", "replaymoe", "free_experts"]
    free = rows[2]
    assert free["replay"] is False and np.isfinite(free["loss"])
    assert free["loss"] != pytest.approx(rows[0]["loss"], rel=1e-3)  # the experts really were replaced
    assert free["fwdbwd_speedup"] == 1.0  # the stubbed timing: every step 1 s


def test_free_experts_forward_scales_by_summed_weight():
    # the floor row's experts function: [T, H] out = x * sum_k w[t, k], gradients to x and w
    from replaymoe.bench.train import _free_experts_forward

    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    out = _free_experts_forward(None, x, torch.zeros(5, 3, dtype=torch.long), w)
    torch.testing.assert_close(out, x * w.sum(-1, keepdim=True))
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(-1, keepdim=True).detach().expand(5, 3))


def test_bench_train_hf_rows_compiled_replay(monkeypatch):
    # `bench train --checkpointing --replay --compile`: one compiled model per implementation (the
    # rounds recompile nothing), the replaymoe row's compiled checkpointed step replaying the traces
    # of grouped_mm's routing (same weights, same batch), so both losses agree; aot_eager keeps the
    # CPU compile short
    from replaymoe.bench import train as bench_train

    torch._dynamo.reset()
    monkeypatch.setattr(bench_train, "time_eager", lambda fn, **kw: (fn(), 1000.0)[1])
    rows = bench_train._hf_rows(
        "qwen3_moe", 2, 6, rounds=2, checkpointing=True, replay=True, compile="aot_eager", size="tiny",
        device="cpu",
    )  # fmt: skip
    torch._dynamo.reset()
    assert [r["impl"] for r in rows] == ["grouped_mm", "replaymoe"]
    assert all(r["compiled"] == "aot_eager" and r["compile_s"] > 0 for r in rows)
    assert [r["replay"] for r in rows] == [False, True]
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)


def test_interleaved_host_clock_calls_each_function_in_turn_and_times_each_call():
    # bench moe --check-ids' eager and host clocks: one call of each function per turn, the order
    # rotated every turn (a drift of the host touches all alike); warm-up turns are not kept, and a
    # function that sleeps longer reads longer
    import time

    from replaymoe.bench._timing import interleaved_us

    order: list[str] = []
    fns = {
        "a": lambda: order.append("a"),
        "b": lambda: (order.append("b"), time.sleep(0.002)),
        "c": lambda: order.append("c"),
    }
    times = interleaved_us(fns, clock="host", calls=4, warmup=2)
    assert order == list("abcbcacababcbcacab")
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert min(times["b"]) >= 2000 > max(times["a"])
    with pytest.raises(ValueError, match="clock must be"):
        interleaved_us(fns, clock="wall")


@pytest.mark.parametrize(
    "caller, q_spread",
    [
        ([10.0] * 400, 0.0),  # the same as off everywhere: ratio 1, no spread
        ([11.0] * 200 + [10.0] * 200, 0.05),  # costlier in the first half only: blocks 1.1 and 1.0
    ],
)
def test_check_ratios_are_medians_over_off_with_block_quartiles(caller, q_spread):
    # bench moe --check-ids' columns: median / off's median, and the ratio's quartiles over blocks
    from replaymoe.bench.moe import _check_ratios

    row: dict = {}
    times = {"off": [10.0] * 400, "route": [10.0] * 400, "caller": caller}
    _check_ratios(row, "host", times)
    assert row["host_off_us"] == 10.0 and row["host_route_ratio"] == 1.0
    assert row["host_caller_ratio"] == pytest.approx(statistics.median(caller) / 10.0)
    assert row["host_caller_ratio_q3"] - row["host_caller_ratio_q1"] == pytest.approx(q_spread)

"""``replaymoe bench ep`` end to end on CPU: two gloo ranks, a tiny layer shape, the nccl transport
(gloo underneath) and the naive recipe. Checks the rows a GPU run relies on exist with sane values
(every point timed, the layer's compute-alone rows present), and that the summary prints the goals.
Also ``--cpu-dry-run`` as a user runs it: under torchrun with its own (tiny) defaults, in seconds,
and without torchrun a one-line error saying how to run it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _bench(rank, world_size, out):
    from replaymoe.bench.ep import main

    args = ["--cpu-dry-run", "--impls", "nccl,naive", "--tokens", "3,8", "--hidden", "64", "--experts", "8",
            "--top-k", "2", "--inter", "32", "--iters", "2", "--warmup", "1", "--payloads", "bf16",
            "--out", out, "--name", "dry"]  # fmt: skip
    assert main(args) == 0


def test_bench_ep_cpu_dry_run(tmp_path, capfd):
    run_distributed(_bench, 2, str(tmp_path))
    rows = list(csv.DictReader(open(tmp_path / "dry.csv")))
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    got = {(r["impl"], r["tokens"], r["op"], r["mode"]) for r in rows}
    for T in ("3", "8"):
        for op in ("dispatch", "combine", "dispatch+combine"):
            assert ("nccl", T, op, "eager") in got and ("naive", T, op, "eager") in got
        assert ("nccl", T, "dispatch+combine", "eager_loop") in got  # back-to-back pairs (goal 4)
        assert ("nccl", T, "dispatch", "eager_loop") not in got  # (per pair only)
        loop = [r for r in rows if (r["impl"], r["tokens"], r["mode"]) == ("nccl", T, "eager_loop")]
        assert float(loop[0]["host_us"]) > 0  # the steady-state host time per pair
        # the layer, the compute it is measured against (goal 6): whole and split by source, and the
        # training step's forward + backward through the all-to-all (goal 5)
        for op in ("layer", "layer_local", "layer_local_split", "layer_train"):
            assert ("nccl", T, op, "eager") in got
        assert ("naive", T, "layer", "eager") in got
    assert all(float(r["us"]) > 0 for r in rows)
    layer = [r for r in rows if r["op"] == "layer"]
    assert all(float(r["weights_floor_us"]) > 0 for r in layer)
    captured = capfd.readouterr()
    printed = captured.out
    assert "# goal 6 (overlap)" in printed and "# goal 4 (eager calls)" in printed
    assert "host µs per call in the loop (steady state)" in printed
    assert "prewarm:" in printed + captured.err  # every path once at every size before the timed rows
    assert "# goal 5 (training)" in printed


def test_bench_ep_dry_run_without_torchrun_says_how(monkeypatch, capsys):
    # was a ValueError traceback (RANK unset) from init_process_group
    from replaymoe.apps import cli

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(["bench", "ep", "--cpu-dry-run"]) == 2
    cap = capsys.readouterr()
    (line,) = cap.err.strip().splitlines()
    assert line.startswith("replaymoe bench ep: error: run it under torchrun")
    assert "torchrun --nproc-per-node 2 -m replaymoe bench ep --cpu-dry-run" in line and cap.out == ""


def test_bench_ep_dry_run_defaults_are_tiny():
    # the dry run used DeepSeek-V3's shapes (7.5 GB of layer weights per rank): OOM-killed at 11.9 GB
    from replaymoe.bench.ep import _parse

    a = _parse(["--cpu-dry-run"])
    assert a.hidden * a.experts * a.inter <= 2**20 and max(map(int, a.tokens.split(","))) <= 64
    assert a.iters <= 3 and "symm" not in a.impls
    gpu = _parse([])
    assert (gpu.hidden, gpu.experts, gpu.top_k, gpu.inter) == (7168, 256, 8, 2048)
    assert _parse(["--cpu-dry-run", "--hidden", "256"]).hidden == 256  # an explicit option still wins


def test_bench_ep_options_instead_of_variables():
    # the A/B variants of MoeAlltoAll and DeepEP's tree are options (no environment variable)
    from replaymoe.bench.ep import _parse
    from replaymoe.bench.ep_deepep import DEEPEP_DIR

    a = _parse([])
    assert (a.unfused_barrier, a.unfused_plan, a.deepep_dir) == (False, False, DEEPEP_DIR)
    a = _parse(["--unfused-barrier", "--unfused-plan", "--deepep-dir", "/x/DeepEP"])
    assert (a.unfused_barrier, a.unfused_plan, a.deepep_dir) == (True, True, "/x/DeepEP")


def _align_calls(rank, world_size, out):
    from replaymoe.bench import ep_timing

    calls: list[bool] = []
    ep_timing.align_ranks = lambda *, settle: calls.append(settle)  # (this spawned process only)

    def it(ev):
        ev[0].record()
        ev[1].record()

    for align in (True, False):
        ep_timing.time_phases(it, 1, 2, 1, align=align)
    out.put(calls)


def test_bench_ep_settings_are_passed_not_module_state():
    # the shape (--hidden / --experts / --top-k / --inter) and --no-align were module globals that main set
    # (ep_shape.SHAPE via set_shape, ep_timing.ALIGN_RANKS): now a frozen Shape and an ``align`` argument
    import dataclasses

    import torch
    import torch.multiprocessing as mp

    from replaymoe.bench import ep_shape, ep_timing

    assert not hasattr(ep_shape, "SHAPE") and not hasattr(ep_shape, "set_shape")
    assert not hasattr(ep_timing, "ALIGN_RANKS")
    shape = ep_shape.Shape(H=256, E=16, K=4, INTER=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.H = 128  # type: ignore[misc]
    ids, x, wts, x8, s8, logits = ep_shape.inputs(shape, 3, 0, torch.device("cpu"))
    assert ids.shape == (3, 4) and x.shape == (3, 256) and s8.shape == (3, 2) and logits.shape == (3, 16)
    q = mp.get_context("spawn").Queue()
    run_distributed(_align_calls, 1, q)
    assert q.get(timeout=10) == [False, False]  # align_ranks before each timed iteration with align only


def test_host_profile_takes_triton_launch_path_under_a_hook():
    # the host profile's "without direct launches" timing: a no-op Triton launch hook, while inside, makes
    # both launchers defer to Triton (nothing of replaymoe's own is reassigned)
    from replaymoe import _launch
    from replaymoe.bench.ep_host import triton_launch_path

    assert _launch.hooks_off()
    with triton_launch_path():
        assert not _launch.hooks_off()
    assert _launch.hooks_off()


def test_bench_ep_dry_run_under_torchrun_takes_seconds(tmp_path):
    # as the docs say to run it: torchrun, 2 gloo ranks, no shape options
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]  # fmt: skip
    cmd = [*torchrun, "-m", "replaymoe", "bench", "ep", "--cpu-dry-run", "--out", str(tmp_path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert "CPU dry run, 2 gloo ranks: hidden 128, 8 experts, top-2, I = 64" in proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "ep.csv")))
    assert rows and not [r for r in rows if r.get("error")]
    assert "# goal 6 (overlap)" in proc.stdout
    assert seconds < 90, seconds  # a few seconds on 2 idle cores


@pytest.mark.parametrize(
    "impls, shown, auto",
    [
        # both forced combines and symm ran: the table, ratio pipelined / two-kernel, symm's time beside
        (("symm_pipe", "symm_2k", "symm"), True, "611.0"),
        (("symm_pipe", "symm_2k"), True, "-"),  # symm did not run: a dash in its column
        (("symm", "symm_2k"), False, None),  # no forced pipelined run: no table
        (("symm_pipe",), False, None),  # only one: no table
    ],
)
def test_summary_compares_pipelined_and_two_kernel_combine(impls, shown, auto, capsys):
    from replaymoe.bench.ep_summary import print_summary

    us = {"symm_pipe": 611.2, "symm_2k": 978.3, "symm": 611.0}
    rows = [
        {
            "impl": i,
            "payload": "bf16",
            "tokens": 4096,
            "num_sms": 24,
            "op": "combine",
            "mode": m,
            "us": us[i],
            "GBps_per_rank": 160e3 / us[i],
        }  # fmt: skip
        for i in impls
        for m in ("graph", "eager")
    ]
    print_summary(rows)
    out = capsys.readouterr().out
    assert ("pipelined (symm_pipe) / two kernels (symm_2k)" in out) is shown
    if shown:
        line = [ln for ln in out.splitlines() if ln.split()[:3] == ["24", "4096", "graph"]]
        assert line and line[0].split()[3:] == ["611.2", "978.3", "0.62", auto]


@pytest.mark.parametrize(
    "ep, us, verdict",
    [
        (2, 39.0, "yes"),  # ep = 2: the 40 µs bound
        (2, 41.0, "NO"),
        (4, 49.0, "yes"),  # larger ep: 50 µs
        (4, 51.0, "NO"),
    ],
)
def test_summary_decode_bound_follows_ep(ep, us, verdict, capsys):
    from replaymoe.bench.ep_summary import print_summary

    row = {"impl": "symm", "payload": "bf16", "tokens": 128, "num_sms": 0, "op": "dispatch+combine",
           "mode": "graph", "us": us, "GBps_per_rank": 1.0, "ep": ep}  # fmt: skip
    print_summary([row])
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.strip().startswith("num_sms")]
    assert f"(ep = {ep})" in out and line and line[0].split()[-1] == verdict
    assert line[0].split()[2] == "bf16"  # the payload is named: fp8 dispatch rows are judged apart


def test_summary_decode_names_each_payload(capsys):
    from replaymoe.bench.ep_summary import print_summary

    base = {"impl": "symm", "tokens": 128, "num_sms": 0, "op": "dispatch+combine", "mode": "graph", "ep": 4}
    cases = (("fp8", 49.0), ("bf16", 62.9))
    rows = [{**base, "payload": p, "us": us, "GBps_per_rank": 1.0} for p, us in cases]
    print_summary(rows)
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("num_sms")]
    assert [(ln[2], ln[-2], ln[-1]) for ln in lines] == [("bf16", "62.9", "NO"), ("fp8", "49.0", "yes")]


@pytest.mark.parametrize(
    "loop_host, host_col, verdict",
    [
        (50.0, "25.0", "yes"),  # 25 µs per call in the loop: within the 30 µs host budget
        (70.0, "35.0", "NO"),  # 35 µs per call: over it, though the loop's time is within its bound
        (None, "nan", "yes"),  # rows of an older run, without the loop's host time: judged on time alone
    ],
)
def test_summary_back_to_back_calls_judge_the_loops_host_time(loop_host, host_col, verdict, capsys):
    from replaymoe.bench.ep_summary import print_summary

    base = {"impl": "symm", "payload": "bf16", "tokens": 128, "num_sms": 0, "op": "dispatch+combine",
            "GBps_per_rank": 1.0}  # fmt: skip
    rows = [{**base, "mode": "graph", "us": 75.0}, {**base, "mode": "eager", "us": 205.0, "host_us": 113.0},
            {**base, "mode": "eager_loop", "us": 80.0, "host_us": loop_host}]  # fmt: skip
    print_summary(rows)
    out = capsys.readouterr().out.split("# goal 4, back-to-back eager calls")[1]
    line = [ln.split() for ln in out.splitlines() if ln.split()[:3] == ["symm", "0", "128"]][0]
    assert line[3:] == ["80.0", "205.0", "75.0", "120.0", host_col, verdict]  # bound 1.2 x 75 + 30

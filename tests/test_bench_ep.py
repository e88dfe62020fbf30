"""``replaymoe bench ep`` end to end on CPU: two gloo ranks, a tiny layer shape, the nccl transport
(gloo underneath) and the naive recipe. Checks the rows a GPU run relies on exist with sane values
(every point timed, the layer's compute-alone rows present), and that the summary prints the goals."""

from __future__ import annotations

import csv

from _dist import run_distributed


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
        # the layer, and the compute it is measured against (goal 4): whole and split by source
        for op in ("layer", "layer_local", "layer_local_split"):
            assert ("nccl", T, op, "eager") in got
        assert ("naive", T, "layer", "eager") in got
    assert all(float(r["us"]) > 0 for r in rows)
    layer = [r for r in rows if r["op"] == "layer"]
    assert all(float(r["weights_floor_us"]) > 0 for r in layer)
    printed = capfd.readouterr().out
    assert "# goal 4 (overlap)" in printed and "# goal 1 (eager calls)" in printed

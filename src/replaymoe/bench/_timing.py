"""Timing helpers shared by the benchmarks (GPU only).

Serving runs under CUDA graphs, so the headline figure is the median of CUDA-graph
replays with the L2 flushed before each replay; eager medians are reported too
(at small sizes they measure Python launch cost).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

NO_CUDA_EXIT = 2  # the documented exit code of a benchmark started without a GPU (replaymoe.apps.cli)

HBM_BYTES_PER_S = 4.27e12  # measured device-to-device copy on the H200 (read + write)
BF16_FLOPS_PER_S = 700e12  # measured dense bf16 matmul on the H200

_L2_FLUSH_BYTES = 256 * 1024 * 1024


def no_cuda(prog: str) -> bool:
    """True, after one error line on stderr, when there is no CUDA GPU (the same wording for every
    benchmark; the caller then exits with :data:`NO_CUDA_EXIT`)."""
    if torch.cuda.is_available():
        return False
    print(
        f"{prog}: error: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)",
        file=sys.stderr,
    )
    return True


def _flush_buffer() -> torch.Tensor:
    buf = getattr(_flush_buffer, "_buf", None)
    if buf is None:
        buf = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        _flush_buffer._buf = buf  # type: ignore[attr-defined]
    return buf


def time_eager(fn: Callable[[], object], *, iters: int = 50, warmup: int = 5, flush_l2: bool = True) -> float:
    """Median wall time of ``fn()`` in microseconds, measured with CUDA events."""
    flush = _flush_buffer()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush_l2:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph(fn: Callable[[], object], *, iters: int = 50, warmup: int = 3, flush_l2: bool = True) -> float:
    """Median time of one CUDA-graph replay of ``fn()`` in microseconds (L2 flushed before each)."""
    flush = _flush_buffer()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush_l2:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def environment() -> dict[str, str]:
    """GPU, versions and commit recorded with every benchmark row."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:  # best effort
        commit = ""
    import triton

    from replaymoe import __version__

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "replaymoe": __version__,
        "commit": commit,
        "host": platform.node(),
    }


def write_results(rows: list[dict], out: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``rows`` to ``out/name.csv`` and ``out/name.json`` (with the environment)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{name}.csv", out_dir / f"{name}.json"
    env = environment()
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + list(env))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env})
    json_path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return csv_path, json_path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as a fixed-width table with the given columns."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))

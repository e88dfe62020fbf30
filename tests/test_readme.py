"""The README stays true: every Python block runs as written, and CI runs the README's test command.

Each block runs in a fresh interpreter (its own names only, as a reader would paste it) with the
working directory in a temporary folder; on a CPU machine that is the torch-reference path (and the
gloo process group for the expert-parallel block), on a GPU machine the Triton kernels.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
HEADINGS = [re.findall(r"^## (.+)$", README[: README.index(b)], flags=re.M)[-1] for b in BLOCKS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_has_the_python_blocks():
    # the sections whose examples must run (a block dropped or renamed fails here, not silently)
    sections = ("Quick example", "Serving loop", "Fused MoE", "Transformers", "R3 with TRL", "Expert")
    for section in sections:
        assert any(h.startswith(section) for h in HEADINGS), section


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[re.sub(r"\W+", "_", h)[:30] for h in HEADINGS])
def test_readme_python_block_runs(index, tmp_path):
    code = BLOCKS[index]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(_free_port())  # the EP block takes it through os.environ.setdefault
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the auto backend, no interpreter
    env["OMP_NUM_THREADS"] = "1"  # tiny shapes: latency-bound, and the suite runs with -n 2
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"README block {index} ({HEADINGS[index]}) failed:\n{proc.stderr[-3000:]}"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[-1] == "make test"  # the last thing CI does
    assert re.search(r"^make test\b", README, flags=re.M)  # ... is the command the README gives

"""The ``replaymoe`` command line as a user runs it: no traceback, the documented exit codes.

Run in fresh processes (``python -m replaymoe ...``, or ``python -c`` that first makes an optional
package unimportable the way a plain install leaves it, then calls the CLI's ``main``), with real
pipes closed early; no mock of the CLI. Every option of every command has a help text.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replaymoe.apps import cli
from replaymoe.record.trace import RoutingTrace

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # tiny shapes: latency-bound, and the suite runs with -n 2
    return env


def _without(modules: tuple[str, ...], argv: list[str], cwd, timeout: int = 120):
    """``replaymoe ARGV`` in a fresh process where importing ``modules`` fails as when they are not
    installed (``sys.modules[name] = None``: ``import name`` raises ModuleNotFoundError)."""
    code = (
        "import sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None\n"
        "from replaymoe.apps.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- optional dependencies (case 1)


def test_demo_without_transformers_says_which_extra_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = _without(("transformers",), ["demo", "--fast", "--quiet", "--device", "cpu", "--out", str(out)],
                    tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith("replaymoe demo: error:") and "transformers" in line
    assert "pip install 'replaymoe[hf,plot]'" in line
    assert proc.stdout == "" and not out.exists()  # nothing ran, nothing written


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "tune", "--help"],  # the bench module imports torch at its top
        ["inspect", "--help"],  # a command module
    ],
)
def test_without_torch_one_line_naming_the_install(tmp_path, argv):
    # a Python without replaymoe's install (PYTHONPATH=src on a bare interpreter): no traceback
    proc = _without(("torch",), argv, tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith(f"replaymoe {argv[0]}") and "needs 'torch'" in line and "pip install -e ." in line


def test_demo_without_matplotlib_warns_and_writes_everything_else(tmp_path):
    out = tmp_path / "out"
    proc = _without(("matplotlib",), ["demo", "--fast", "--quiet", "--device", "cpu", "--out", str(out)],
                    tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith("replaymoe demo: warning: matplotlib is not installed")
    assert "pip install 'replaymoe[plot]'" in line
    assert "R3 figures" in proc.stdout and "picture    : none (matplotlib is not installed" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agreement_replay_all_layers"] == 1.0
    assert (out / "vllm_response_seq0.json").is_file() and len(list((out / "traces").glob("*.rmtrace"))) == 4
    assert not (out / "heatmap.png").exists()


def test_inspect_heatmap_without_matplotlib_fails_before_any_output(tmp_path):
    ids = np.argsort(np.random.default_rng(0).random((6, 2, 8)), axis=-1)[..., :2]
    RoutingTrace(ids, num_experts=8, top_k=2).save(tmp_path / "a.rmtrace")
    proc = _without(("matplotlib",), ["inspect", str(tmp_path / "a.rmtrace"), "--heatmap", "h.png"], tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert (
        line.startswith("replaymoe inspect: error: --heatmap needs matplotlib") and "replaymoe[plot]" in line
    )
    assert proc.stdout == ""  # was: the summary, then the error


# ---------------------------------------------------------------- a closed pipe (case 2)


def _piped(argv: list[str], cwd, lines: int) -> tuple[int, str, str]:
    """``replaymoe ARGV | head -LINES``: read that many lines, close the pipe, wait. The writer meets
    the closed pipe for sure only when it has more left to write than the pipe holds (64 KiB), or
    with ``lines=0`` (closed at once, long before a fresh Python process writes anything)."""
    proc = subprocess.Popen([sys.executable, "-m", "replaymoe", *argv], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    head = [proc.stdout.readline() for _ in range(lines)]
    proc.stdout.close()  # the reader goes away, as head does
    err = proc.stderr.read()
    return proc.wait(timeout=120), "".join(head), err


def _big_trace(tmp_path) -> Path:
    # 2000 layers, a table row each: ~190 KB of output, more than a pipe holds (64 KiB), so the writer
    # meets the closed pipe for sure
    ids = np.argsort(np.random.default_rng(0).random((4, 2000, 8)), axis=-1)[..., :2]
    path = tmp_path / "a.rmtrace"
    RoutingTrace(ids, num_experts=8, top_k=2).save(path)
    return path


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    path = _big_trace(tmp_path)
    rc, head, err = _piped(["inspect", str(path)], tmp_path, 3)
    assert head.startswith(str(path)) and len(head.splitlines()) == 3
    assert (rc, err) == (141, "")  # was: "error: : Broken pipe", exit 2


def test_demo_into_a_closed_pipe_exits_quietly(tmp_path):
    # its output is smaller than a pipe holds: closed before it writes (as `| head -0` would)
    rc, head, err = _piped(["demo", "--fast", "--quiet", "--device", "cpu", "--out", str(tmp_path / "o")],
                           tmp_path, 0)  # fmt: skip
    assert (rc, err) == (141, "")  # was: a BrokenPipeError traceback


def test_help_into_a_closed_pipe_exits_quietly(tmp_path):
    rc, head, err = _piped(["--help"], tmp_path, 1)
    assert head.startswith("usage: replaymoe") and "Traceback" not in err and "Exception" not in err
    assert rc in (0, 141)  # 0 when the help fitted the pipe before it closed


def test_ctrl_c_is_quiet(monkeypatch, capsys):
    inspect_mod = importlib.import_module("replaymoe.apps.inspect")

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_mod, "main", interrupted)
    assert cli.main(["inspect", "x"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- every option has a help text (case 6)


class _Parsed(Exception):
    pass


def _parsers(module_name: str, argv: list[str], monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser a command's ``main`` builds (argparse's parse_args stopped before it parses)."""

    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    module = importlib.import_module(module_name)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Parsed) as exc:
            module.main(argv)
    parser = exc.value.args[0]
    found = [parser]
    for action in parser._actions:  # private: argparse has no public walk over its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            found += list(action.choices.values())
    return found


COMMANDS = ["replaymoe.apps.cli", "replaymoe.apps.check", "replaymoe.apps.demo", "replaymoe.apps.inspect"] + [
    f"replaymoe.bench.{name}" for name in sorted(cli._BENCHES)
]


@pytest.mark.parametrize("module_name", COMMANDS)
def test_every_option_has_a_help_text(module_name, monkeypatch):
    argv = ["bench"] if module_name.endswith(".cli") else []
    missing = []
    for parser in _parsers(module_name, argv, monkeypatch):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not (action.help or "").strip():
                missing.append(f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}")
    assert missing == []

"""The ``replaymoe`` command line.

Subcommands live in their own modules and are imported only when run, so that
``replaymoe --help`` is fast and an optional dependency missing for one command
does not break the others:

``replaymoe demo``                  -> ``replaymoe.apps.demo:main``
``replaymoe bench {routing,moe,ep,capture,hf,...}`` -> ``replaymoe.bench.<name>:main``
``replaymoe inspect TRACE``         -> ``replaymoe.apps.inspect:main``
``replaymoe check --model M FILES`` -> ``replaymoe.apps.check:main`` (exits with its defect bits)

Exit codes (every subcommand; errors are one line on stderr, no traceback):

* 0 -- success;
* 1 -- the run finished but one of its own checks failed (``demo``: the router got no gradient
  under replay; ``bench capture``: the captured trace differs from the routed ids);
* 2 -- the command cannot run as asked: a bad option or value, an unreadable, invalid or unwritable
  file or directory, a benchmark started without a CUDA GPU, or an optional dependency missing
  (``pip install 'replaymoe[hf,plot]'``);
* 141 -- stdout was closed early (``replaymoe demo | head -1``): the command stops quietly, as Unix
  tools killed by SIGPIPE do (128 + 13, what a shell reports for them);
* 130 -- interrupted (Ctrl-C), quietly.

Those last two, and the missing optional dependency, are handled once, here in :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys

from replaymoe.bench._text import strip_rest

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_CHECK_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main",
           "strip_rest"]  # fmt: skip

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool stopped by a closed pipe
EXIT_INTERRUPTED = 130  # 128 + SIGINT
# optional dependencies -> the extra that installs them (pyproject.toml)
OPTIONAL_DEPENDENCIES = {"transformers": "hf", "tqdm": "hf", "matplotlib": "plot"}
INSTALL_EXTRAS = "pip install 'replaymoe[hf,plot]'"
# required dependencies that a Python without replaymoe's install may lack (a bare PYTHONPATH=src run)
REQUIRED_DEPENDENCIES = ("torch", "triton", "numpy")
INSTALL_REQUIRED = "install replaymoe into this Python (pip install -e ., or make venv: .venv/bin/python)"

# name -> (module, help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("replaymoe.apps.demo", "rollout with capture, then trainer forwards with and without replay"),
    "inspect": ("replaymoe.apps.inspect", "summarise a routing trace or a vLLM response"),
    "check": ("replaymoe.apps.check", "check an engine's routes against the model (exit bits per defect)"),
}
_BENCHES: dict[str, str] = {
    "routing": "route() against torch ops (and FlashInfer's figures)",
    "moe": "fused_moe() against the per-expert loop and torch._grouped_mm",
    "ep": "MoeAlltoAll dispatch/combine and ep_moe (run under torchrun)",
    "capture": "decode loop with RoutedExpertsCapturer on vs off",
    "hf": "transformers generate() throughput, replaymoe vs grouped_mm experts",
    "train": "MoE layer forward+backward and an HF training step, replaymoe vs grouped_mm",
    "trl": "TRL GRPO steps, stock grouped_mm vs replaymoe vs R3GRPOTrainer, alternating, by section",
    "tune": "the fused MoE's kernel configurations on this card: writes its tuned table",
}
# options with which a benchmark runs without a GPU (checks or summaries only)
_BENCH_CPU_OPTIONS: dict[str, tuple[str, ...]] = {
    "ep": ("--cpu-dry-run", "--summary-from"),
    "trl": ("--device",),
}


def _build_parser() -> argparse.ArgumentParser:
    from replaymoe import __version__

    parser = argparse.ArgumentParser(
        prog="replaymoe",
        description="Fused MoE kernels with routing capture and replay.",
        epilog="exit codes: 0 success; 1 the run finished but a check failed; 2 bad options or "
        "input/output files, a benchmark without a CUDA GPU, or a missing optional dependency; 141 "
        "stdout closed early (e.g. | head). 'replaymoe COMMAND --help' for each.",
    )
    parser.add_argument("--version", action="version", version=f"replaymoe {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="the command to run (replaymoe COMMAND --help: its options)"
    )
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser(
        "bench",
        help="benchmarks (GPU): " + ", ".join(_BENCHES),
        description="Benchmarks on a CUDA GPU, each against its peers in the same run; results as "
        "CSV and JSON under --out. Without a CUDA GPU: exit code 2.",
        epilog="Each benchmark has more options: replaymoe bench NAME --help.",
    )
    bench.add_argument(
        "op",
        choices=sorted(_BENCHES),
        metavar="NAME",
        help="which benchmark: " + "; ".join(f"{k}: {v}" for k, v in _BENCHES.items()),
    )
    bench.add_argument(
        "--out",
        metavar="DIR",
        help="directory for the results, NAME.csv and NAME.json (default: the benchmark's own)",
    )
    return parser


def _bench_help(module, rest: list[str]) -> int:
    """A benchmark's own --help, with its docstring's reST markup turned into plain text."""
    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf):
        try:
            module.main(rest)
        except SystemExit as exc:  # argparse exits after printing the help
            code = exc.code if isinstance(exc.code, int) else 0
    sys.stdout.write(strip_rest(buf.getvalue()))
    return code


def _bench(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    rest = argv[1:]
    if not rest or rest[0].startswith("-") and rest[0] != "--out":
        parser.parse_args(argv)  # prints the bench help (or a usage error) and exits
    # `bench [--out DIR] NAME [options...]`: --out may also come before the name
    out: list[str] = []
    while rest and rest[0] == "--out":
        if len(rest) < 2:
            parser.parse_args(argv)  # "expected one argument", exit 2
        out, rest = ["--out", rest[1]], rest[2:]
    if not rest or rest[0] not in _BENCHES:
        parser.parse_args(["bench", *rest] if rest else ["bench"])  # usage error naming the choices
    op, options = rest[0], rest[1:] + out
    module = importlib.import_module(f"replaymoe.bench.{op}")
    if "-h" in options or "--help" in options:
        return _bench_help(module, options)
    from replaymoe.bench._timing import no_cuda

    cpu_ok = any(o.split("=")[0] in _BENCH_CPU_OPTIONS.get(op, ()) for o in options)
    if not cpu_ok and no_cuda(f"replaymoe bench {op}"):
        return EXIT_USAGE
    return int(module.main(options) or 0)


def _run(argv: list[str]) -> int:
    parser = _build_parser()
    if not argv:
        parser.print_help()
        return EXIT_OK
    if argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv)  # prints and exits
    command, rest = argv[0], argv[1:]
    if command in _COMMANDS:
        module = importlib.import_module(_COMMANDS[command][0])
        return int(module.main(rest) or 0)
    if command == "bench":
        return _bench(parser, argv)
    parser.parse_args(argv)
    return EXIT_USAGE


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The optional dependency an import failed for, or None for any other module."""
    name = (exc.name or "").split(".")[0]
    return name if name in OPTIONAL_DEPENDENCIES else None


def _quiet_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's last flush of what is
    still buffered does not fail again (Python's documented recipe for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by a buffer without a descriptor (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run ``replaymoe ARGV``; returns the exit code (module docstring). ``--help``, ``--version`` and
    usage errors exit through ``SystemExit`` as argparse does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv[:1] if a in _COMMANDS or a == "bench"]
    words += [a for a in argv[1:4] if words == ["bench"] and a in _BENCHES][:1]  # `bench [--out D] NAME`
    prog = " ".join(["replaymoe", *words])
    try:
        try:
            return _run(argv)
        except ModuleNotFoundError as exc:
            required = (exc.name or "").split(".")[0]
            if required in REQUIRED_DEPENDENCIES:
                why = f"needs {required!r}, which this Python does not have"
                fix = INSTALL_REQUIRED
                if required == "triton" and not sys.platform.startswith("linux"):
                    fix = "Triton publishes Linux wheels only; run this command on Linux"
                print(f"{prog}: error: {why}: {fix}", file=sys.stderr)
                return EXIT_USAGE
            name = _missing_extra(exc)
            if name is None:
                raise
            print(
                f"{prog}: error: needs the optional dependency {name!r}, which is not installed: "
                f"{INSTALL_EXTRAS}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        finally:
            sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as Unix tools do
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

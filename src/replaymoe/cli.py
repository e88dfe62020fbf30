"""The ``replaymoe`` command line.

Subcommands live in their own modules and are imported only when run, so that
``replaymoe --help`` is fast and an optional dependency missing for one command
does not break the others:

``replaymoe demo``                  -> ``replaymoe.demo:main``
``replaymoe bench {routing,moe,ep,capture,hf}`` -> ``replaymoe.bench.<name>:main``
``replaymoe inspect TRACE``         -> ``replaymoe.inspect_cli:main``
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("replaymoe.demo", "rollout with capture, then trainer forwards with and without replay"),
    "inspect": ("replaymoe.inspect_cli", "summarise a routing trace or a vLLM response"),
}
_BENCHES: dict[str, str] = {
    "routing": "route() against torch ops (and FlashInfer's figures)",
    "moe": "fused_moe() against the per-expert loop and torch._grouped_mm",
    "ep": "MoeAlltoAll dispatch/combine and ep_moe (run under torchrun)",
    "capture": "decode loop with RoutedExpertsCapturer on vs off",
    "hf": "transformers generate() throughput, replaymoe vs grouped_mm experts",
}


def _build_parser() -> argparse.ArgumentParser:
    from replaymoe import __version__

    parser = argparse.ArgumentParser(
        prog="replaymoe",
        description="Fused MoE kernels with routing capture and replay.",
    )
    parser.add_argument("--version", action="version", version=f"replaymoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks (GPU): " + ", ".join(_BENCHES))
    bench.add_argument("op", choices=sorted(_BENCHES), help="which benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv:
        parser.print_help()
        return 0
    if argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv)  # prints and exits
    command, rest = argv[0], argv[1:]
    if command in _COMMANDS:
        module = importlib.import_module(_COMMANDS[command][0])
        return int(module.main(rest) or 0)
    if command == "bench":
        if not rest or rest[0] not in _BENCHES:
            parser.parse_args(argv)  # prints the usage error and exits
        module = importlib.import_module(f"replaymoe.bench.{rest[0]}")
        return int(module.main(rest[1:]) or 0)
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

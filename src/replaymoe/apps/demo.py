"""``replaymoe demo``: rollout with routing capture, then trainer forwards without and with replay.

Runs on a fresh machine with no download (a few seconds on 2 CPU cores; the Triton kernels on a
GPU, the torch reference on a CPU, or the Triton kernels in Triton's CPU interpreter with
``--backend triton``, 1.5-5 minutes on 2 cores). Needs the ``hf`` extra (transformers, tqdm), checked
before any work; without the ``plot`` extra (matplotlib) it warns and writes everything but the picture:

1. builds a small MoE model from a config (Qwen3-MoE by default; ``--model-config`` picks another
   supported architecture) with seeded random weights and a tiny vocabulary -- no tokenizer, the
   prompts are token ids;
2. ``generate`` samples completions for a few left-padded prompts with capture on
   (:func:`replaymoe.hf.enable`) and saves one :class:`~replaymoe.record.trace.RoutingTrace` per sequence;
3. perturbs the router weights slightly (as one optimizer step would) and runs the "trainer"
   forward over prompt + completion twice: with native routing and with the rollout's routing
   replayed;
4. prints, for both, router agreement per layer between rollout and trainer and the R3 paper's
   figures (router decisions that differ, tokens that differ in at least one layer, mean
   KL(rollout || trainer) over the generated tokens, share of "extreme" tokens whose log-prob moved
   by more than ln 2), and the router's gradient norm under replay; writes a picture of the
   rollout's expert load beside per-layer agreement, and ``summary.json``.

``python -m replaymoe.apps.demo --help`` lists the options. Exit codes as ``replaymoe.apps.cli``: 0, 1 (the
router got no gradient under replay), 2 (a bad option or file, or transformers missing).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import subprocess
import sys

import torch

from replaymoe.apps.demo_inputs import EXIT_USAGE, TRITON_CPU_TIME
from replaymoe.apps.demo_inputs import DemoError as _DemoError
from replaymoe.apps.demo_run import run
from replaymoe.hf.models import ARCHITECTURES, SIZES, build_config, build_model

__all__ = ["ARCHITECTURES", "SIZES", "build_config", "build_model", "main"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="replaymoe demo",
        description="Rollout with routing capture, then trainer forwards with and without routing replay.",
        epilog="exit codes: 0 success; 1 the router got no gradient under replay; 2 a bad option or file. "
        "Backends: auto = Triton kernels on a GPU, torch reference on the CPU; --backend triton on the "
        "CPU runs the kernels in Triton's interpreter (the demo re-runs itself with TRITON_INTERPRET=1).",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument(
        "--model-config",
        default="qwen3_moe",
        choices=ARCHITECTURES,
        help="architecture of the small random model (default qwen3_moe)",
    )
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate per prompt (default 24)")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--out", default="./replaymoe_out", help="output directory (default ./replaymoe_out)")
    p.add_argument("--fast", action="store_true", help="smaller model and fewer tokens (smoke test)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, prompts and sampling (default 0)"
    )
    p.add_argument(
        "--perturb",
        type=float,
        default=0.05,
        help="router perturbation, relative to the weights' std (default 0.05; >= 0)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="replaymoe backend (default auto: Triton on a GPU, torch reference on the CPU)",
    )
    p.add_argument(
        "--from-vllm",
        metavar="RESPONSE.json",
        default=None,
        help="also replay a vLLM response's routed_experts (one sequence; its prompt_token_ids and "
        "choices[0].token_ids must be present, and the model must have the trace's shape)",
    )
    p.add_argument(
        "--prompt-start",
        type=int,
        default=None,
        metavar="S",
        help="with --from-vllm: the request's routed_experts_prompt_start (vLLM does not echo it; "
        "default 0); positions below it replay natively",
    )
    p.add_argument(
        "--layer-ids",
        default=None,
        metavar="N,N,...",
        help="with --from-vllm: the model layer numbers of the MoE layers, e.g. 1,2 (default: the demo "
        "model's); vLLM 0.33 sends a column per decoder layer, dense layers all zero",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--trl",
        action="store_true",
        help="instead: a few TRL GRPO steps with rollout routing replay (R3GRPOTrainer) and the "
        "routing-mismatch table (needs the trl extra)",
    )
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens < 2:
        p.error(f"--tokens must be >= 2, got {args.tokens}")
    if args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    if args.from_vllm == "":
        p.error("--from-vllm: expected a file name, got an empty string")
    if (args.prompt_start is not None or args.layer_ids is not None) and not args.from_vllm:
        p.error("--prompt-start and --layer-ids go with --from-vllm")
    if args.prompt_start is not None and args.prompt_start < 0:
        p.error(f"--prompt-start must be >= 0, got {args.prompt_start}")
    if args.layer_ids is not None:
        try:
            args.layer_ids = [int(v) for v in args.layer_ids.split(",")]
        except ValueError:
            p.error(
                f"--layer-ids: expected comma-separated layer numbers such as 1,2, got {args.layer_ids!r}"
            )
        if min(args.layer_ids) < 0 or len(set(args.layer_ids)) != len(args.layer_ids):
            p.error(f"--layer-ids: expected distinct layer numbers >= 0, got {args.layer_ids}")
    if not (math.isfinite(args.perturb) and args.perturb >= 0):
        p.error(
            f"--perturb must be a finite number >= 0 (a fraction of the router weights' std), "
            f"got {args.perturb}"
        )
    return args


def _missing_hf() -> str | None:
    """The first of the ``hf`` extra's packages (transformers, tqdm) that does not import, or None."""
    for name in ("transformers", "tqdm"):
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def _missing_trl() -> str | None:
    """``trl`` (the ``trl`` extra) if it does not import, else None."""
    try:
        importlib.import_module("trl")
    except ImportError:
        return "trl"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    missing = _missing_hf()  # before any work, not as a traceback from deep inside the model build
    if not missing and args.trl:
        missing = _missing_trl()
    if missing:
        print(
            f"replaymoe demo: error: needs {missing}, which is not installed: "
            f"pip install 'replaymoe[{'hf,trl' if args.trl else 'hf,plot'}]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("replaymoe demo: error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return EXIT_USAGE
    if args.backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when it is imported: only a fresh process can turn it on
        print(
            "replaymoe demo: --backend triton on the CPU runs the Triton kernels in Triton's interpreter, "
            "which must be on before Triton is imported; re-running as TRITON_INTERPRET=1 replaymoe demo "
            f"(slow: {TRITON_CPU_TIME})",
            file=sys.stderr,
        )
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.call([sys.executable, "-m", "replaymoe", "demo", *argv], env=env)
    threads = torch.get_num_threads()
    if device == "cpu":
        # a model this small is latency-bound: one intra-op thread avoids OpenMP barrier costs
        # (10-100x per op when the cores are shared, e.g. under pytest -n 2)
        torch.set_num_threads(1)
    try:
        if args.trl:
            from replaymoe.apps.demo_trl import run_trl

            return run_trl(device=device, seed=args.seed, quiet=args.quiet)
        return run(args, device)
    except _DemoError as exc:
        print(f"replaymoe demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":  # pragma: no cover
    from replaymoe.apps.cli import main as cli_main  # a closed pipe, Ctrl-C: handled there, once

    sys.exit(cli_main(["demo", *sys.argv[1:]]))

"""``replaymoe check``: check an engine's routes against the model before training on them.

::

    replaymoe check --model PATH_OR_SIZE:ARCH [--seed N] [--num-experts E] [--layer-ids 0,1,...]
                    [--prompt-start S] [--choice I] [--max-disagreement F] [--near-tie F]
                    [--ignore-model-id] [--json] ROUTES [ROUTES ...]

Each ROUTES file is a vLLM response (chat or /v1/completions, with ``return_token_ids``), SGLang
response(s) (``meta_info.routed_experts`` and the token ids), or a replaymoe trace file; every
sequence in them is teacher-forced through the model and compared, per MoE layer
(:func:`replaymoe.hf.conformance.check_routes`). Prints the per-layer table and the defects, or with
``--json`` the report's dict.

``--layer-ids`` takes either form: the model layer of each payload column (one number per column), or,
for a payload of one column per decoder layer (vLLM 0.33), the MoE layers' numbers, which name their
columns (the form of ``replaymoe inspect`` and ``replaymoe demo --from-vllm``; the other columns are
dense and must be zero).

Exit status: 0 clean; otherwise the OR of the defect bits 1 (disagreement above
``--max-disagreement``; a layer where more than half of the compared rows were excused as near-ties),
4 (out-of-range or repeated ids), 8 (all-zero rows, constant layers, rows of -1 within a sequence),
16 (non-zero dense-layer columns, a column count that fits no layer count, a row count that does not
fit the sequence's tokens: the rows within the tokens are still judged; a MoE layer all -1 in a
sequence whose other MoE layers are routed, or with no judged row; a trace whose model id or MoE
layers are another model's), 32 (misaligned rows), 64 (dtype overflow): never 2, which stays a bad
option, an unreadable or invalid file (not a regular file, over 1 GiB, a sequence without tokens, no
routed rows to check in a MoE layer's column, a trace of other experts or top-k), or a model that
cannot be loaded or does not fit the routes (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]

EXIT_USAGE = 2  # replaymoe.apps.cli's exit code for bad options and bad input files

_EPILOG = (
    "exit status: 0 clean; else the OR of 1 disagreement above --max-disagreement, or a layer where "
    "more than half of the compared rows were excused as near-ties, 4 out-of-range or repeated ids, 8 "
    "all-zero rows, constant layers or rows of -1 (missing) within a sequence (replay needs "
    "missing='native' for them), 16 non-zero dense-layer columns, a column count that fits no layer "
    "count, a row count that does not fit the tokens, a MoE layer all -1 in a sequence whose other MoE "
    "layers are routed or with no judged row, or a trace whose model id or MoE layers are another "
    "model's, 32 misaligned rows (best shift != 0), 64 dtype overflow (a dtype narrower than E, wrapped "
    "ids); 2 a bad option, an unreadable or invalid file (not a regular file, over 1 GiB, no tokens, no "
    "routed rows to check, a trace of other experts or top-k), or a model that cannot be loaded or "
    "does not fit the routes."
)
_SEED_RANGE = (-(1 << 63), (1 << 64) - 2)  # torch's seed range (build_model also seeds with seed + 1)


def _layer_ids(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None
    if not vals or min(vals) < 0 or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected distinct layer numbers >= 0, got {text!r}")
    return vals


def _file_name(text: str) -> str:
    """A ROUTES argument: a file name, never an empty string (which names no file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got an empty string")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replaymoe check",
        description="Check an engine's routes (vLLM, SGLang, replaymoe traces) against a model: "
        "teacher-force each sequence, report per MoE layer the agreement with the recomputed routing, "
        "near-ties, invalid, all-zero and constant rows, dense-layer columns, row misalignment and "
        "dtype overflow.",
        epilog=_EPILOG,
    )
    p.add_argument(
        "routes",
        nargs="+",
        type=_file_name,
        metavar="ROUTES",
        help="vLLM/SGLang response JSON or trace files",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a transformers checkpoint (directory, loaded offline) or SIZE:ARCH, a random-weight "
        "replaymoe model (e.g. tiny:qwen3_moe, demo:deepseek_v3; see --seed)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of a SIZE:ARCH model (default 0); refused with a checkpoint, whose weights are loaded",
    )
    p.add_argument("--num-experts", type=int, default=None, help="E, a cross-check of the model's")
    p.add_argument(
        "--layer-ids",
        type=_layer_ids,
        default=None,
        metavar="N,N,...",
        help="either the model layer of each payload column (one number per column), or, for a payload "
        "of one column per decoder layer (vLLM), the MoE layers' numbers, naming their columns, as "
        "inspect and demo --from-vllm take them (e.g. 1,2; the other columns must be zero); default: by "
        "the column count, one per MoE layer or one per decoder layer; a trace's own. SGLang's flat "
        "payloads are read with as many columns (or, for the MoE layers' numbers, one per decoder layer "
        "when its dense columns are zero)",
    )
    p.add_argument(
        "--prompt-start",
        type=int,
        default=None,
        help="the request's routed_experts_prompt_start (vLLM does not echo it; default 0; SGLang: "
        "meta_info's own); refused for a trace file, which records its own",
    )
    p.add_argument(
        "--choice",
        type=int,
        default=None,
        help="only this choice of a vLLM response (default all); refused for trace and SGLang files",
    )
    p.add_argument(
        "--max-disagreement",
        type=float,
        default=0.05,
        help="fail when more than this fraction of a layer's judged rows disagree (default 0.05)",
    )
    p.add_argument(
        "--near-tie",
        type=float,
        default=None,
        help="relative tolerance of a near-tie of the selection scores, in [0, 1e9] (default the "
        "library's, 5e-3)",
    )
    p.add_argument(
        "--ignore-model-id",
        action="store_true",
        help="accept traces recorded under another model id (another name of this model); their MoE "
        "layers are still compared (exit 16), and other experts or top-k refused (exit 2)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``replaymoe check``; returns the report's exit code, or 2 (one line on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_experts is not None and args.num_experts < 1:
        parser.error(f"--num-experts must be >= 1, got {args.num_experts}")
    if args.prompt_start is not None and args.prompt_start < 0:
        parser.error(f"--prompt-start must be >= 0, got {args.prompt_start}")
    if args.choice is not None and args.choice < 0:
        parser.error(f"--choice must be >= 0, got {args.choice}")
    if not 0 <= args.max_disagreement <= 1:
        parser.error(f"--max-disagreement must be in [0, 1], got {args.max_disagreement}")
    from replaymoe.hf.conformance import NEAR_TIE_MAX, check_routes, load_model, load_routes, model_layout

    if args.near_tie is not None and not 0 <= args.near_tie <= NEAR_TIE_MAX:
        parser.error(f"--near-tie must be a number in [0, 1e9] (a relative tolerance), got {args.near_tie}")
    if args.seed is not None and not _SEED_RANGE[0] <= args.seed <= _SEED_RANGE[1]:
        parser.error(
            f"--seed must be in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}] (torch's seeds), got {args.seed}"
        )
    from replaymoe.record.trace.file import check_input

    try:
        for path in args.routes:  # reported before a model is loaded: a missing file, /dev/zero, a pipe
            check_input(path, reader="replaymoe check")
        model = load_model(args.model, seed=args.seed)
        lay = model_layout(model)
        # SGLang's flat payloads: --layer-ids gives their column count (the MoE layers' numbers: also one
        # column per decoder layer), else the model's candidates
        n_moe, n_dec = len(lay.moe_layers), lay.num_hidden_layers
        n = len(args.layer_ids or ())
        counts = (n_dec, n_moe) if not n else (n, n_dec) if n == n_moe != n_dec else (n,)
        routes = []
        for path in args.routes:
            routes += load_routes(
                path,
                num_layers=counts,
                top_k=lay.top_k,
                choice=args.choice,
                prompt_start=args.prompt_start,
            )
        kw = {} if args.near_tie is None else {"near_tie": args.near_tie}
        report = check_routes(
            model,
            routes,
            num_experts=args.num_experts,
            layer_ids=args.layer_ids,
            max_disagreement=args.max_disagreement,
            check_model_id=not args.ignore_model_id,
            **kw,
        )
    except BrokenPipeError:  # handled once, in replaymoe.apps.cli.main
        raise
    except OSError as e:  # an unreadable routes file
        print(f"replaymoe check: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # TraceFormatError included; messages name the file or the option
        msg = " ".join(str(e).split())
        for name in ("model", "seed", "num_experts", "layer_ids", "prompt_start", "choice", "near_tie"):
            msg = msg.replace(f" of {name}:", f" of --{name.replace('_', '-')}:")
        print(f"replaymoe check: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return report.exit_code


if __name__ == "__main__":  # pragma: no cover
    from replaymoe.apps.cli import main as cli_main  # a closed pipe, Ctrl-C: handled there, once

    sys.exit(cli_main(["check", *sys.argv[1:]]))

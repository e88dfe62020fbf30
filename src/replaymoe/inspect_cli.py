"""``replaymoe inspect``: summarise a routing trace or a vLLM/SGLang-style response.

::

    replaymoe inspect TRACE_OR_VLLM_JSON [--heatmap out.png] [--compare OTHER] [--num-experts E]

Input files are recognised by content: a replaymoe trace file (``RoutingTrace.save``), a JSON
vLLM response / choice object (``routed_experts`` / ``prompt_routed_experts``), or a text file
holding vLLM's base64 ``.npy`` string. Prints tokens, layers, top_k, the missing fraction,
per-layer balance (max/mean, CV, normalised entropy) and, with ``--compare``, per-layer and
every-layer agreement with the other trace.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .stats import agreement, balance, expert_load, plot_heatmap
from .trace import RoutingTrace, TraceFormatError

__all__ = ["main", "load_any"]


def load_any(path: str, *, num_experts: int | None = None, choice: int = 0) -> RoutingTrace:
    """Read a trace file, a vLLM response/choice JSON file, or a file holding vLLM's base64 string."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        t = RoutingTrace.load(path)
        if num_experts is not None and t.num_experts is None:
            t = t.replace(num_experts=num_experts)
        return t
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    try:
        if text.startswith("{"):
            obj = json.loads(text)
        elif text.startswith('"'):
            obj = json.loads(text)  # a JSON string holding the base64
        else:
            obj = text
        return RoutingTrace.from_vllm(obj, num_experts=num_experts, choice=choice)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: invalid JSON ({e})", path) from e
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}", path) from e


def _fmt(x: float, spec: str = ".3f") -> str:
    return "nan" if not np.isfinite(x) else format(x, spec)


def summarize(trace: RoutingTrace, other: RoutingTrace | None = None, *, name: str = "trace") -> str:
    """The text ``replaymoe inspect`` prints."""
    load = expert_load(trace)
    E = load.shape[1]
    bal = balance(load)
    lines = [
        f"{name}",
        f"  model: {trace.model_id or '-'}   tokens: {trace.num_tokens} (positions {trace.token_offset}.."
        f"{trace.end - 1})   layers: {trace.num_layers}   top_k: {trace.top_k}   experts: "
        f"{trace.num_experts if trace.num_experts is not None else f'{E} (inferred)'}   "
        f"missing: {100 * trace.missing_fraction():.2f}%",
    ]
    rep = None
    if other is not None:
        rep = agreement(trace, other)
    missing = trace.missing_mask()
    header = ["layer", "model_layer", "tokens", "missing%", "max/mean", "cv", "entropy"]
    if rep is not None:
        header += ["agree", "compared"]
    rows = []
    for i, m in enumerate(trace.model_layer_ids()):
        rec = int((~missing[:, i]).sum())
        miss = 100 * float(missing[:, i].mean()) if trace.num_tokens else 0.0
        row = [
            str(i),
            str(m),
            str(rec),
            f"{miss:.2f}",
            _fmt(bal["max_over_mean"][i]),
            _fmt(bal["cv"][i]),
            _fmt(bal["entropy"][i]),
        ]
        if rep is not None:
            row += [_fmt(rep.per_layer[i], ".4f"), str(int(rep.compared_per_layer[i]))]
        rows.append(row)
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(header)]
    lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    finite = np.isfinite(bal["cv"])
    if finite.any():
        lines.append(
            f"  overall: max/mean {np.nanmean(bal['max_over_mean']):.3f} (mean over layers), "
            f"cv {np.nanmean(bal['cv']):.3f}, entropy {np.nanmean(bal['entropy']):.3f}"
        )
    if rep is not None:
        lines.append("  " + str(rep))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="replaymoe inspect",
        description="Summarise a routing trace or a vLLM response: tokens, layers, missing rows, "
        "per-layer expert balance, and agreement with another trace.",
    )
    parser.add_argument("trace", help="replaymoe trace file, vLLM response/choice JSON, or base64 .npy text")
    parser.add_argument("--heatmap", metavar="PNG", help="write a layer x expert load heatmap here")
    parser.add_argument(
        "--compare", metavar="OTHER", help="a second trace of the same tokens to compare with"
    )
    parser.add_argument("--num-experts", type=int, default=None, help="E, for inputs that do not record it")
    parser.add_argument("--choice", type=int, default=0, help="which choice of a vLLM response (default 0)")
    args = parser.parse_args(argv)
    try:
        trace = load_any(args.trace, num_experts=args.num_experts, choice=args.choice)
        other = None
        if args.compare:
            other = load_any(args.compare, num_experts=args.num_experts, choice=args.choice)
        print(summarize(trace, other, name=args.trace))
        if args.heatmap:
            plot_heatmap(trace, args.heatmap)
            print(f"  heatmap written to {args.heatmap}")
    except (OSError, ValueError, ImportError) as e:
        print(f"replaymoe inspect: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

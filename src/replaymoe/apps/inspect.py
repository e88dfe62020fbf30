"""``replaymoe inspect``: summarise a routing trace or a vLLM/SGLang-style response.

::

    replaymoe inspect TRACE_OR_VLLM_JSON [--heatmap out.png|.svg|.pdf] [--compare OTHER [--ignore-tokens]]
                      [--num-experts E] [--choice I] [--prompt-start S[,S2]] [--layer-ids 1,2,3]

Input files are recognised by content: a replaymoe trace file (``RoutingTrace.save``), a JSON
vLLM chat or ``/v1/completions`` response, or one choice object (``routed_experts``), or a text
file holding vLLM's base64 ``.npy`` string. Prints tokens, layers, top_k, the missing fraction,
per-layer balance (max/mean, CV, normalised entropy) and, with ``--compare``, per-layer and
every-layer agreement with the other trace.

vLLM inputs (:meth:`RoutingTrace.from_vllm <replaymoe.record.trace.RoutingTrace.from_vllm>`): vLLM
0.33 sends one layer column per decoder layer, dense layers all zero: ``--layer-ids`` names the MoE
layers' numbers, as ``replaymoe check`` and ``demo --from-vllm`` take them (a payload with an all-zero
column is refused without them, and with a number for every column, ``check``'s other form); the request's
``routed_experts_prompt_start``, which vLLM does not echo, is ``--prompt-start`` (default 0;
``--prompt-start S,S2`` gives OTHER of ``--compare`` its own, and an empty side none). When
the response carries its token ids (``return_token_ids: true``), its rows must be
``prompt + completion - 1 - prompt_start``. ``--prompt-start`` is refused for a trace file (it records
its own ``token_offset``), ``--choice`` for a trace file and for a bare payload or choice object (no
``choices``). An SGLang response is refused with a pointer to ``replaymoe check``: its flat payload
does not carry its layer count and top_k, which only a model gives. A UTF-8 byte-order mark is
accepted.

Refused with exit code 2 and one line on stderr: an input that is not a regular file (``/dev/zero``,
a directory, a pipe) or is larger than :data:`MAX_INPUT_BYTES` (1 GiB; ``RoutingTrace.load`` reads
larger trace files from Python), checked before reading; an empty file name; an input with no routed
rows (no tokens, or every row -1) or no layers; ``--num-experts`` that contradicts the input (a trace's
own E, an id at or above it, more experts than a vLLM payload's dtype holds: uint8 at most 256);
``--compare`` of two inputs whose token ids are both known and differ (``--ignore-tokens`` compares
them anyway), or that have no token both record.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import codecs
import functools
import importlib
import io
import json
import os
import re
import sys

import numpy as np

from replaymoe.record.stats import agreement, balance, expert_load, plot_heatmap
from replaymoe.record.trace import RoutingTrace, TraceFormatError
from replaymoe.record.trace.file import MAX_INPUT_BYTES, read_input
from replaymoe.record.trace.wire import routes_array

__all__ = ["MAX_INPUT_BYTES", "main", "load_any"]

EXIT_USAGE = 2  # replaymoe.apps.cli's exit code for bad options and bad input/output files

_ACCEPTED = (
    "expected a replaymoe trace file (RoutingTrace.save), a vLLM response or choice JSON, "
    "or a text file holding vLLM's base64 .npy routed_experts"
)
_B64_TEXT = re.compile(rb"[A-Za-z0-9+/=\s]+")


def _describe(data: bytes) -> str:
    """A few words on what a file that is not a trace holds (for the error message)."""
    head = data[:40]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data starting {bytes(head[:8])!r}"
    if not text.isprintable() and not text.replace("\n", "").replace("\t", "").isprintable():
        return f"binary data starting {bytes(head[:8])!r}"
    text = " ".join(text.split())
    return f"text starting {text[:30]!r}"


def _npy_problem(raw: bytes) -> str | None:
    """Why decoded base64 is not an integer .npy array of routed experts, or None when it is one."""
    if not raw.startswith(b"\x93NUMPY"):
        return "not the base64 of a .npy array"
    try:
        f = io.BytesIO(raw)
        major, _ = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    except ValueError as e:
        return f"a .npy payload with a broken header ({e})"
    if dtype.hasobject:
        return "a .npy payload of Python objects, not integer expert ids"
    if dtype.kind not in "iu":
        return f"a .npy payload of {dtype} values, not integer expert ids"
    if len(shape) != 3:
        return f"a .npy payload of shape {shape}, not (tokens, layers, top_k)"
    return None


def _read_input(path: str) -> bytes:
    """The bytes of ``path``: :func:`~replaymoe.record.trace.file.read_input`, refused before reading
    when not a regular file or larger than :data:`MAX_INPUT_BYTES`."""
    return read_input(path, reader="replaymoe inspect", accepted=_ACCEPTED)


def load_any(
    path: str,
    *,
    num_experts: int | None = None,
    choice: int | None = None,
    prompt_start: int | None = None,
    layer_ids: list[int] | None = None,
) -> RoutingTrace:
    """Read a trace file, a vLLM response/choice JSON file, or a file holding vLLM's base64 string.

    Parameters
    ----------
    path : str
        The file; its kind is recognised by content. It must be a regular file of at most
        :data:`MAX_INPUT_BYTES`.
    num_experts : int, optional
        E for inputs that do not record it (vLLM's); must agree with a trace that records it and
        exceed every expert id.
    choice : int, optional
        Which choice of a vLLM response (default 0); refused for a trace file, a bare payload and a
        choice object, which have no choices.
    prompt_start : int, optional
        The vLLM request's ``routed_experts_prompt_start`` (vLLM does not echo it; default 0). Refused
        for trace files, which record their own ``token_offset``.
    layer_ids : list of int, optional
        The model layer numbers of the MoE layers: selects the MoE columns of vLLM's
        one-column-per-decoder-layer payload (:meth:`RoutingTrace.from_vllm`). A trace file must
        record the same ones (or none, and have as many layers).

    Raises
    ------
    TraceFormatError
        (a ValueError) naming the file, when it is none of the accepted kinds, not a regular
        file, too large, or its payload is bad (including rows that do not fit the response's
        token counts).
    ValueError
        When ``num_experts``, ``layer_ids``, ``choice`` or ``prompt_start`` contradict or do not apply
        to the input.
    OSError
        When the file cannot be read.
    """
    data = _read_input(path).removeprefix(codecs.BOM_UTF8)  # a BOM, as json.loads(bytes) accepts
    sent = None  # the element type of a vLLM payload, read when --num-experts may not fit it
    if not data.strip():
        raise TraceFormatError(f"{path}: empty file; {_ACCEPTED}", path)
    if data[:4] == b"PK\x03\x04":
        for option, value, why in (
            ("--prompt-start", prompt_start, "it records its own token_offset"),
            ("--choice", choice, "it holds one sequence, no choices"),
        ):
            if value is not None:
                raise ValueError(f"Invalid value of {option}: expected none for the replaymoe trace file "
                                 f"{path} ({why}), got {value}")  # fmt: skip
        trace = RoutingTrace.load(path)
        if layer_ids is not None:
            if trace.layer_ids is not None and list(trace.layer_ids) != list(layer_ids):
                raise ValueError(
                    f"Invalid value of --layer-ids: expected the layer ids {path} records, "
                    f"{','.join(map(str, trace.layer_ids))}, got {','.join(map(str, layer_ids))}"
                )
            if trace.layer_ids is None and trace.num_layers != len(layer_ids):
                raise ValueError(
                    f"Invalid value of --layer-ids: expected {trace.num_layers} layer numbers (the "
                    f"layers of {path}), got {len(layer_ids)}"
                )
            trace = trace.replace(layer_ids=layer_ids)
    else:
        text = data.decode("utf-8", errors="replace").strip()
        try:
            if text.startswith(("{", '"')):
                obj = json.loads(text)  # a response / choice object, or a JSON string of the base64
            else:
                obj = text
            if isinstance(obj, str):
                stripped = obj.strip().encode("ascii", errors="replace")
                if not _B64_TEXT.fullmatch(stripped):
                    what = _describe(data)
                    raise TraceFormatError(f"{path}: not a routing trace: {what}; {_ACCEPTED}", path)
                try:
                    raw = base64.b64decode(b"".join(stripped.split()), validate=True)
                except (binascii.Error, ValueError):
                    raise TraceFormatError(
                        f"{path}: not a routing trace: {_describe(data)} (not base64); {_ACCEPTED}", path
                    ) from None
                problem = _npy_problem(raw)
                if problem:
                    if raw.startswith(b"\x93NUMPY"):
                        what = "base64 text of " + problem.removeprefix("a ")
                    else:
                        what = f"{_describe(data)} ({problem})"
                    raise TraceFormatError(f"{path}: not a routing trace: {what}; {_ACCEPTED}", path)
            elif _is_sglang(obj):
                raise TraceFormatError(
                    f"{path}: an SGLang response (meta_info.routed_experts): its flat payload does not "
                    "carry its layer count and top_k, so only a model can read it: replaymoe check "
                    f"--model MODEL {path}, or RoutingTrace.from_sglang(meta_info, num_layers, top_k)",
                    path,
                )
            elif not isinstance(obj, dict):
                raise TraceFormatError(
                    f"{path}: not a routing trace: JSON {type(obj).__name__}; {_ACCEPTED}", path
                )
            if choice is not None and not (isinstance(obj, dict) and "choices" in obj):
                what = "a bare routed_experts payload" if isinstance(obj, str) else "a choice object"
                raise ValueError(f"Invalid value of --choice: expected none for {path}, {what} (no "
                                 f"choices), got {choice}")  # fmt: skip
            trace = RoutingTrace.from_vllm(
                obj, choice=choice or 0, prompt_start=prompt_start, layer_ids=layer_ids
            )
            if num_experts is not None and num_experts > 256:  # more than uint8 holds
                sent = _payload_dtype(raw if isinstance(obj, str) else obj, choice or 0, path)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}: invalid JSON ({e})", path) from e
        except TraceFormatError as e:
            msg = str(e)
            if "pickle" in msg:  # numpy's wording for an object payload inside a JSON response
                msg = "the routed_experts payload is not an integer .npy array (it holds Python objects)"
            elif "columns as MoE layers" in msg:  # check's form, a number per column, dense ones included
                msg += "; --layer-ids names the MoE layers only here (those columns that are not all zero)"
            raise TraceFormatError(msg if msg.startswith(str(path)) else f"{path}: {msg}", path) from e
        except ValueError as e:  # an argument that does not fit this response (e.g. --prompt-start)
            raise ValueError(str(e) if str(e).startswith("Invalid value of --") else f"{path}: {e}") from None
    if num_experts is not None:
        top = int(trace.ids.max()) if trace.ids.size else -1
        if trace.num_experts is not None and num_experts != trace.num_experts:
            raise ValueError(
                f"Invalid value of --num-experts: expected the trace's own {trace.num_experts} "
                f"(recorded in {path}), got {num_experts}"
            )
        if num_experts <= top:
            raise ValueError(
                f"Invalid value of --num-experts: expected more than the largest expert id {top} "
                f"in {path}, got {num_experts}"
            )
        if sent is not None and sent.itemsize <= 2 and num_experts > (most := int(np.iinfo(sent).max)) + 1:
            raise ValueError(
                f"Invalid value of --num-experts: expected at most {most + 1} for the {sent.name} payload of "
                f"{path} ({sent.name} holds expert ids up to {most}: the ids of more experts would have "
                f"wrapped; vLLM sends uint16 above 256 experts), got {num_experts}"
            )
        trace = trace.replace(num_experts=num_experts)
    return trace


def _payload_dtype(obj: object, choice: int, path: str) -> np.dtype:
    """The element type a vLLM payload was sent in (``obj``: its raw ``.npy`` bytes, or the response or
    choice dict :meth:`RoutingTrace.from_vllm` has read), which the trace does not keep."""
    if not isinstance(obj, dict):
        return routes_array(obj, path).dtype
    ch, top = (obj["choices"][choice], obj) if "choices" in obj else (obj, {})
    fields = (top.get("prompt_routed_experts", ch.get("prompt_routed_experts")), ch.get("routed_experts"))
    return np.result_type(*(routes_array(v, path).dtype for v in fields if v is not None))


def _fmt(x: float, spec: str = ".3f") -> str:
    return "nan" if not np.isfinite(x) else format(x, spec)


def _positions(ranges: list[tuple[int, int]]) -> str:
    """``[(0, 3), (9, 12)]`` -> ``"0..2, 9..11"`` (half-open ranges, empty ones dropped)."""
    return ", ".join(f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in ranges if b > a)


def _only_in(t: RoutingTrace, o: RoutingTrace) -> tuple[int, str]:
    """How many of ``t``'s positions ``o`` does not cover, and which."""
    lo, hi = max(t.token_offset, o.token_offset), min(t.end, o.end)
    if hi <= lo:
        ranges = [(t.token_offset, t.end)]
    else:
        ranges = [(t.token_offset, lo), (hi, t.end)]
    return sum(max(0, b - a) for a, b in ranges), _positions(ranges)


def _agreement_line(rep, trace: RoutingTrace, other: RoutingTrace, name: str, other_name: str) -> str:
    """The every-layer agreement, with the excluded tokens split by why: covered by one trace only
    (saying which), or recorded as missing (-1) in a layer of either."""
    pl = rep.per_layer
    lo = f"{np.nanmin(pl):.4f}" if np.isfinite(pl).any() else "n/a"
    mean = f"{np.nanmean(pl):.4f}" if np.isfinite(pl).any() else "n/a"
    n_a, where_a = _only_in(trace, other)
    n_b, where_b = _only_in(other, trace)
    parts = []
    if n_a:
        parts.append(f"{n_a} only in {name} (positions {where_a})")
    if n_b:
        parts.append(f"{n_b} only in {other_name} (positions {where_b})")
    n_missing = rep.excluded_tokens - n_a - n_b
    if n_missing:
        parts.append(f"{n_missing} in both but missing (-1) in some layer of either")
    excluded = f"{rep.excluded_tokens} excluded: " + "; ".join(parts) if parts else "none excluded"
    return (
        f"agreement: {_fmt(rep.all_layers, '.4f')} of {rep.compared_tokens} tokens identical in every "
        f"layer ({excluded}); per layer mean {mean}, min {lo}"
    )


def summarize(
    trace: RoutingTrace,
    other: RoutingTrace | None = None,
    *,
    name: str = "trace",
    other_name: str = "the other trace",
) -> str:
    """The text ``replaymoe inspect`` prints (``name`` / ``other_name``: how the two are called)."""
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
    warnings = []
    if other is not None:
        rep = agreement(trace, other)
        if (trace.token_offset, trace.end) != (other.token_offset, other.end):
            both = max(0, min(trace.end, other.end) - max(trace.token_offset, other.token_offset))
            warnings.append(
                f"warning: the traces cover different positions ({trace.token_offset}..{trace.end - 1} "
                f"in {name} vs {other.token_offset}..{other.end - 1} in {other_name}): only the {both} "
                "positions in both are compared; traces of different sequences do not agree by design"
            )
        if trace.model_id and other.model_id and trace.model_id != other.model_id:
            warnings.append(f"warning: different models ({trace.model_id!r} vs {other.model_id!r})")
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
        lines.append("  " + _agreement_line(rep, trace, other, name, other_name))
        lines += ["  " + w for w in warnings]
    return "\n".join(lines)


def _check_output(path: str) -> None:
    """Raise ValueError naming --heatmap for a suffix that is no image format or a place not writable."""
    from replaymoe.record.stats import heatmap_format

    try:
        heatmap_format(path)
    except ValueError:
        raise ValueError(
            f"Invalid value of --heatmap: expected a file name ending in .png, .svg, .pdf (or another "
            f"image format matplotlib writes), got {path!r}"
        ) from None
    try:  # the plot extra: checked before any work, not after the summary is printed
        importlib.import_module("matplotlib")
    except ImportError:
        raise ValueError(
            "--heatmap needs matplotlib, which is not installed: pip install 'replaymoe[plot]'"
        ) from None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"Invalid value of --heatmap: expected a file name, got the directory {path!r}")
    if not os.path.isdir(parent):
        raise ValueError(
            f"Invalid value of --heatmap: expected a file in an existing directory, got {path!r}"
        )
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(
            f"Invalid value of --heatmap: expected a writable place, got {path!r} (permission denied)"
        )


def _layer_list(text: str) -> list[int]:
    """``--layer-ids 1,2,3`` -> ``[1, 2, 3]`` (distinct non-negative ints)."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer numbers such as 1,2,3, got {text!r}"
        ) from None
    if min(vals) < 0 or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected distinct layer numbers >= 0, got {text!r}")
    return vals


def _not_empty(trace: RoutingTrace, path: str) -> RoutingTrace:
    """``trace``, or a ValueError naming ``path`` when it has no routed rows or no layers (nothing to
    summarise)."""
    if trace.num_tokens == 0:
        raise TraceFormatError(
            f"{path}: no routed rows (0 tokens): nothing to summarise (a one-token completion, or a "
            "prompt start at the end of the sequence?)",
            path,
        )
    if trace.num_layers == 0:
        raise TraceFormatError(
            f"{path}: no layers (ids of shape {trace.ids.shape}): nothing to summarise", path
        )
    if trace.missing_mask().all():
        raise TraceFormatError(
            f"{path}: no routed rows: all {trace.num_tokens} tokens are -1 (missing) in every layer: "
            "nothing to summarise",
            path,
        )
    return trace


def _is_sglang(obj: object) -> bool:
    """An SGLang response (or a list of them): ``meta_info`` beside the token ids."""
    first = obj[0] if isinstance(obj, list) and obj else obj
    return isinstance(first, dict) and isinstance(first.get("meta_info"), dict)


def _starts(text: str) -> list[int | None]:
    """``--prompt-start S`` or ``S,S2`` (the second for --compare's OTHER; an empty side: none given)."""
    parts = text.split(",")
    try:
        vals = [None if p.strip() == "" else int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S or S,S2 (ints >= 0), got {text!r}") from None
    if len(vals) > 2 or all(v is None for v in vals) or any(v is not None and v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected S or S,S2 (ints >= 0), got {text!r}")
    return vals


def _compared(trace: RoutingTrace, other: RoutingTrace, name: str, other_name: str) -> None:
    """ValueError naming both files when no (position, layer) is recorded in both: nothing to compare."""
    lo, hi = max(trace.token_offset, other.token_offset), min(trace.end, other.end)
    if hi > lo:
        a = ~trace.missing_mask()[lo - trace.token_offset : hi - trace.token_offset]
        b = ~other.missing_mask()[lo - other.token_offset : hi - other.token_offset]
        if (a & b).any():
            return
    raise ValueError(
        f"--compare: {name} (positions {trace.token_offset}..{trace.end - 1}) and {other_name} (positions "
        f"{other.token_offset}..{other.end - 1}) have no (position, layer) recorded in both (what one "
        "records is missing, -1, in the other, or they cover other positions): nothing to compare"
    )


def _check_same_tokens(a: RoutingTrace, b: RoutingTrace, name_a: str, name_b: str) -> None:
    """ValueError naming both files when both carry token ids and they differ at a position both cover
    (routing of different sequences does not agree by design; ``--ignore-tokens`` allows it)."""
    if a.token_ids is None or b.token_ids is None:
        return
    lo, hi = max(a.token_offset, b.token_offset), min(a.end, b.end)
    if hi <= lo:
        return
    ta = a.token_ids[lo - a.token_offset : hi - a.token_offset]
    tb = b.token_ids[lo - b.token_offset : hi - b.token_offset]
    differ = np.flatnonzero((ta != tb) & (ta >= 0) & (tb >= 0))
    if differ.size:
        i = int(differ[0])
        raise ValueError(
            f"--compare: {name_a} and {name_b} hold different tokens ({differ.size} of {hi - lo} "
            f"positions, first at position {lo + i}: {int(ta[i])} vs {int(tb[i])}): routing of "
            "different sequences does not agree by design (--ignore-tokens compares them anyway)"
        )


def main(argv: list[str] | None = None) -> int:
    """Run ``replaymoe inspect``; returns 0, or 2 (after one line on stderr) for a bad option or file."""
    parser = argparse.ArgumentParser(
        prog="replaymoe inspect",
        description="Summarise a routing trace or a vLLM response: tokens, layers, missing rows, "
        "per-layer expert balance, and agreement with another trace.",
        epilog="exit codes: 0 success; 2 a bad option, or an input that cannot be read, is not a regular "
        f"file of at most {MAX_INPUT_BYTES >> 20} MiB, is not a routing trace or has no routed rows or "
        "layers, rows that do not fit the response's token counts, an option that does not apply to the "
        "input (--prompt-start, --choice of a trace file), a --num-experts the input contradicts (ids at "
        "or above it, more than a uint8 payload holds), --compare of different token sequences or of "
        "inputs with no recorded token in common, or a heatmap that cannot be written.",
    )
    parser.add_argument("trace", help="replaymoe trace file, vLLM response/choice JSON, or base64 .npy text")
    parser.add_argument(
        "--heatmap",
        metavar="PATH",
        help="write a layer x expert load heatmap here (format from the suffix: .png, .svg, .pdf, ...)",
    )
    parser.add_argument(
        "--compare", metavar="OTHER", help="a second trace of the same tokens to compare with"
    )
    parser.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="E, for inputs that do not record it (vLLM's); must match a trace that records it, exceed "
        "its ids and fit a vLLM payload's dtype (uint8: at most 256)",
    )
    parser.add_argument(
        "--choice",
        type=int,
        default=None,
        help="which choice of a vLLM response (default 0); refused for a trace file or a bare payload",
    )
    parser.add_argument(
        "--prompt-start",
        type=_starts,
        default=None,
        metavar="S[,S2]",
        help="the vLLM request's routed_experts_prompt_start (vLLM does not echo it; default 0): the "
        "payload's first row is position S; S,S2: S2 for --compare's OTHER (an empty side: none); "
        "refused for a trace file, which records its own",
    )
    parser.add_argument(
        "--layer-ids",
        type=_layer_list,
        default=None,
        metavar="N,N,...",
        help="the model layer numbers of the MoE layers only, e.g. 1,2,3 (as check and demo --from-vllm "
        "take them): picks their columns from vLLM's one-column-per-decoder-layer payload, whose dense "
        "layers are all-zero columns; a number for every column (check's other form) takes each column "
        "as a MoE layer, so an all-zero dense column is refused",
    )
    parser.add_argument(
        "--ignore-tokens",
        action="store_true",
        help="with --compare: compare even when both inputs carry token ids and they differ",
    )
    args = parser.parse_args(argv)
    if args.num_experts is not None and args.num_experts < 1:
        parser.error(f"--num-experts must be >= 1, got {args.num_experts}")
    if args.choice is not None and args.choice < 0:
        parser.error(f"--choice must be >= 0, got {args.choice}")
    for option, value in (("TRACE", args.trace), ("--compare", args.compare), ("--heatmap", args.heatmap)):
        if value == "":
            parser.error(f"{option}: expected a file name, got an empty string")
    starts = args.prompt_start or [None]
    if len(starts) == 2 and args.compare is None:
        parser.error(f"--prompt-start {starts[0]},{starts[1]}: the second start is --compare's; no --compare")
    try:
        if args.heatmap:
            _check_output(args.heatmap)  # before any work
        read = functools.partial(
            load_any, num_experts=args.num_experts, choice=args.choice, layer_ids=args.layer_ids
        )
        trace = _not_empty(read(args.trace, prompt_start=starts[0]), args.trace)
        other = None
        if args.compare is not None:
            other = _not_empty(read(args.compare, prompt_start=starts[-1]), args.compare)
            if (other.num_layers, other.top_k) != (trace.num_layers, trace.top_k):
                raise ValueError(
                    f"--compare {args.compare}: {other.num_layers} layers, top_k {other.top_k}; "
                    f"{args.trace} has {trace.num_layers} layers, top_k {trace.top_k}"
                )
            if not args.ignore_tokens:
                _check_same_tokens(trace, other, args.trace, args.compare)
            _compared(trace, other, args.trace, args.compare)
        print(summarize(trace, other, name=args.trace, other_name=args.compare or ""))
        if args.heatmap:
            plot_heatmap(trace, args.heatmap)
            print(f"  heatmap written to {args.heatmap}")
    except BrokenPipeError:  # stdout closed early (| head): replaymoe.apps.cli.main exits quietly
        raise
    except OSError as e:  # unreadable input, unwritable heatmap
        from replaymoe.bench._text import os_error_text

        writing = bool(args.heatmap) and os.fsdecode(e.filename or "") == args.heatmap
        print(f"replaymoe inspect: error: {os_error_text(e, action='write' if writing else 'read')}",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    except (ValueError, ImportError) as e:
        print(f"replaymoe inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":  # pragma: no cover
    from replaymoe.apps.cli import main as cli_main  # a closed pipe, Ctrl-C: handled there, once

    sys.exit(cli_main(["inspect", *sys.argv[1:]]))

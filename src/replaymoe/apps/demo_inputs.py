"""What ``replaymoe demo`` reads and writes, checked before the run (:mod:`replaymoe.apps.demo_run`):
the output directory and every file the run writes there, and a ``--from-vllm`` response.

A problem is a :class:`DemoError`: one line on stderr and exit code 2, before any work.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

__all__ = [
    "EXIT_USAGE",
    "NO_PLOT",
    "OUTPUT_FILES",
    "TRITON_CPU_TIME",
    "DemoError",
    "can_plot",
    "prepare_out",
    "read_vllm",
]

EXIT_USAGE = 2  # replaymoe.apps.cli: bad options or files
TRITON_CPU_TIME = "1.5-5 minutes on 2 cores"  # --backend triton on the CPU (Triton's interpreter)
NO_PLOT = "matplotlib is not installed: pip install 'replaymoe[plot]'"


class DemoError(Exception):
    """A bad option or input file: one line on stderr, exit code 2."""


OUTPUT_FILES = ("heatmap.png", "vllm_response_seq0.json", "summary.json")  # besides traces/seq*.rmtrace


def prepare_out(path: str, num_prompts: int) -> Path:
    """Create the output directory (and traces/) and check every file the run will write, or raise
    DemoError saying which one cannot be written: all before any work, not as a traceback at the end."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {path}: expected a directory, got an existing file")
    traces = out / "traces"
    if traces.exists() and not traces.is_dir():
        raise DemoError(f"--out {path}: {traces} is a file, where the demo writes its traces (a directory)")
    for folder in (out, traces):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".replaymoe-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise DemoError(
                f"--out {path}: cannot create or write the directory {folder} ({exc.strerror or exc})"
            ) from None
    files = [out / name for name in OUTPUT_FILES]
    files += [traces / f"seq{i}.rmtrace" for i in range(num_prompts)]
    for f in files:
        if f.is_dir():
            raise DemoError(f"--out {path}: {f} is a directory, where the demo writes a file")
        if f.exists() and not os.access(f, os.W_OK):
            raise DemoError(f"--out {path}: {f} exists and is not writable (permission denied)")
    return out


def read_vllm(
    path: str,
    *,
    prompt_start: int | None = None,
    layer_ids: list[int] | None = None,
    vocab_size: int | None = None,
    layer_ids_given: bool = True,
):
    """(prompt ids, completion ids, RoutingTrace) of a vLLM response file, or raise DemoError.

    The file must be a regular file of at most 1 GiB (refused before reading). The response (chat:
    ``prompt_token_ids`` at the top level, also when the choice's is null; ``/v1/completions``: in the
    choice) must carry the token ids of ``choices[0]`` (``return_token_ids: true``), each below
    ``vocab_size`` when given; its rows must be ``prompt + completion - 1 - prompt_start``.
    ``layer_ids`` (the MoE layers' numbers) map vLLM 0.33's one-column-per-decoder-layer payload
    (:meth:`RoutingTrace.from_vllm`); ``layer_ids_given``: whether the user passed them
    (``--layer-ids``), else they are the demo model's and an error does not blame the option.
    """
    from replaymoe.record.trace import RoutingTrace
    from replaymoe.record.trace.file import read_input

    try:
        data = read_input(path, reader="replaymoe demo").removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM
    except OSError as exc:
        raise DemoError(f"--from-vllm {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # not a regular file, too large (the message names the file)
        raise DemoError(f"--from-vllm {exc}") from None
    if data[:4] == b"PK\x03\x04":
        raise DemoError(
            f"--from-vllm {path}: this is a replaymoe trace file (RoutingTrace.save), not a vLLM response; "
            "--from-vllm needs the response JSON (prompt_token_ids, choices[0].token_ids, routed_experts), "
            "e.g. the vllm_response_seq0.json this demo writes (replaymoe inspect reads trace files)"
        )
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DemoError(
            f"--from-vllm {path}: expected a vLLM response in JSON, got invalid JSON ({exc})"
        ) from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if isinstance(choices, list) and not choices:
        raise DemoError(f'--from-vllm {path}: the response has no choices ("choices": [])')
    choice = choices[0] if isinstance(choices, list) and isinstance(choices[0], dict) else {}
    prompt = choice.get("prompt_token_ids")  # null in the choice: the top-level list (chat)
    if prompt is None and isinstance(obj, dict):
        prompt = obj.get("prompt_token_ids")
    completion = choice.get("token_ids")
    if prompt is None or completion is None:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DemoError(
            f"--from-vllm {path}: expected a response with token ids (return_token_ids: true): "
            f"prompt_token_ids (chat: top level; /v1/completions: in the choice) and choices[0].token_ids, "
            f"got keys {keys} / {sorted(choice)}"
        )
    try:  # rows checked against the token counts: P + C - 1 - prompt_start; token ids: ints
        trace = RoutingTrace.from_vllm(obj, prompt_start=prompt_start, layer_ids=layer_ids)
    except ValueError as exc:
        msg = str(exc)
        if not layer_ids_given:  # the demo model's MoE layers, which the user did not pass
            msg = msg.replace("layer_ids", "the demo model's MoE layers")
        raise DemoError(f"--from-vllm {path}: {msg}") from None
    if vocab_size is not None:
        for name, toks in (("prompt_token_ids", prompt), ("choices[0].token_ids", completion)):
            bad = next((i for i, t in enumerate(toks) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise DemoError(
                    f"--from-vllm {path}: {name}[{bad}] is {toks[bad]}, outside the demo model's "
                    f"vocabulary of {vocab_size} tokens (0..{vocab_size - 1})"
                )
    return list(prompt), list(completion), trace


def can_plot() -> bool:
    """Whether matplotlib (the ``plot`` extra) imports: the picture needs it, nothing else does."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True

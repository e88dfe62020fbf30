"""Engine routes as the engine sent them: :class:`EngineRoutes` and its readers (vLLM, SGLang, traces).

A conformance check (:func:`replaymoe.hf.conformance.check_routes`) must see the values an engine
sent before anything validates them: :class:`~replaymoe.record.trace.RoutingTrace` rejects an
out-of-range id at construction, and a uint8 payload that wrapped an id of a 300-expert model looks
valid once widened. So the readers here decode the raw array themselves (with the wire module's
helpers), keep every value as sent (widened to int64, the element type's name kept beside it), and
pair it with the token ids of the sequence, so that the sequence can be teacher-forced again:

* vLLM 0.33 (``--enable-return-routed-experts``): each choice's ``routed_experts`` is base64 of an
  ``.npy`` ``[rows, num_hidden_layers, top_k]`` (uint8 for <= 256 experts, else uint16); rows cover
  positions ``s .. P + C - 2`` (``s`` = the request's ``routed_experts_prompt_start``, not echoed).
  Token ids come with ``return_token_ids: true``: chat puts ``prompt_token_ids`` at the top level and
  ``token_ids`` in each choice, ``/v1/completions`` puts both in each choice. The older split form
  (``prompt_routed_experts`` + the choice's completion rows) is read too.
* SGLang: ``meta_info.routed_experts`` is base64 of a *flat* array (int32, or uint8/uint16 named by
  ``routed_experts_dtype``) of logical shape ``[seqlen - 1, layers, top_k]``; the layer count is not
  sent, so the reader takes the model's candidates (decoder layers, MoE layers): one whose extra
  columns are all zero (dense layers), else the one whose row count is nearest the token count's.
  Token ids: ``input_ids`` (the request's, or ``prompt_token_ids``) and ``output_ids`` (or
  ``token_ids``), at the top level or in ``meta_info``.
* replaymoe trace files (:meth:`RoutingTrace.save <replaymoe.record.trace.RoutingTrace.save>`): ids
  already validated, with the ``token_ids`` that capture records and the MoE ``layer_ids``.

Malformed payloads raise :class:`~replaymoe.record.trace.TraceFormatError` (a ``ValueError``) naming
the file or the field; bad arguments raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_int, fail
from .trace import RoutingFingerprint, RoutingTrace, TraceFormatError
from .trace.file import read_input
from .trace.wire import b64decode_field, routes_array

__all__ = [
    "EngineRoutes",
    "check_fit",
    "load_routes",
    "routes_from_sglang",
    "routes_from_trace",
    "routes_from_vllm",
]

_SGLANG_DTYPES = ("int32", "uint8", "uint16", "int16")
_ACCEPTED = (
    "expected a replaymoe trace file, a vLLM response (choices with routed_experts) or an SGLang "
    "response (meta_info.routed_experts)"
)
_PROMPT_KEYS = ("input_ids", "prompt_token_ids", "origin_input_ids")
_OUTPUT_KEYS = ("output_ids", "token_ids", "completion_token_ids", "output_token_ids")


@dataclass(frozen=True, eq=False)
class EngineRoutes:
    """One sequence's routes as an engine sent them, with the sequence's tokens.

    Attributes
    ----------
    ids : np.ndarray
        int64 ``[rows, columns, top_k]``: the values as sent (widened, never range-checked). Row ``i``
        is position ``start + i``; a column is a decoder layer (vLLM 0.33: every layer, dense ones
        zero), a MoE layer, or what ``layer_ids`` names.
    token_ids : np.ndarray
        int64 ``[T]``: the tokens of positions ``0 .. T - 1`` (prompt + completion), >= 0. Rows past
        position ``T - 1`` are kept as sent (the check reports the row count and judges the rows
        within the tokens).
    start : int
        Position of row 0 (vLLM's ``routed_experts_prompt_start``, SGLang's
        ``routed_experts_start_len``, a trace's ``token_offset``).
    dtype : str, optional
        The integer element type the payload was sent in (``"uint8"``, ``"int32"``...): the dtype
        checks read it. Default: the dtype of ``ids`` as given.
    source : str
        Where the routes came from (file and choice), for the report.
    layer_ids : tuple of int, optional
        Model layer number of each column (a trace's ``layer_ids``); None: inferred from the count.
    expected_rows : int
        How many rows the engine should have sent: ``T - 1 - start`` by default (the last sampled
        token never ran through the model); a trace's own row count.
    num_experts : int, optional
        The E the routes record (a trace's ``num_experts``); None when the engine does not send it.
    prompt_tokens : int, optional
        How many of ``token_ids`` are the prompt (the request's prompt start is at most that), when
        known: a row count that does not fit is reported with the prompt start that would fit.
    fingerprint : RoutingFingerprint, optional
        The routing of the model that recorded the routes (a trace's
        :attr:`~replaymoe.record.trace.RoutingTrace.fingerprint`); the check compares it with the
        model's. None when the engine does not send one.
    guess : str
        How a reader guessed the layout of a payload that more than one layer count fits, and the
        other readings (SGLang's flat payloads whose rows do not fit the tokens); part of the
        ``row_count`` defect's words. Empty when nothing was guessed.
    """

    ids: np.ndarray
    token_ids: np.ndarray
    start: int = 0
    dtype: str | None = None
    source: str = "routes"
    layer_ids: tuple[int, ...] | None = None
    expected_rows: int | None = None
    num_experts: int | None = None
    prompt_tokens: int | None = None
    fingerprint: RoutingFingerprint | None = None
    guess: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            fail("source", "a str naming the routes", type(self.source).__name__, what="type")
        if self.fingerprint is not None and not isinstance(self.fingerprint, RoutingFingerprint):
            fail("fingerprint", "a RoutingFingerprint or None", type(self.fingerprint).__name__, what="type")
        ids = np.asarray(self.ids)
        name = "ids" if self.source == "routes" else f"ids of {self.source}"
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
            fail(name, "an integer array [rows, columns, top_k]", f"{ids.dtype} array of shape {ids.shape}")
        if ids.shape[1] < 1 or ids.shape[2] < 1:
            fail(name, "at least one layer column and one top-k entry", f"shape {ids.shape}", what="shape")
        tok = np.asarray(self.token_ids)
        if tok.ndim != 1 or (tok.size and not np.issubdtype(tok.dtype, np.integer)) or tok.dtype == np.bool_:
            fail("token_ids", "a 1-D integer array", f"{tok.dtype} array of shape {tok.shape}")
        if self.num_experts is not None:
            check_int("num_experts", self.num_experts, low=1)
        if self.prompt_tokens is not None:
            check_int("prompt_tokens", self.prompt_tokens, low=0, high=tok.size)
        check_int("start", self.start, low=0)
        tok = np.ascontiguousarray(tok, dtype=np.int64)
        if tok.size and int(tok.min()) < 0:
            fail("token_ids", "token ids >= 0", int(tok.min()))
        if self.expected_rows is not None:
            check_int("expected_rows", self.expected_rows, low=0)
        if ids.size and ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and int(ids.max()) > 2**63 - 1:
            fail(name, "ids below 2**63 (int64)", int(ids.max()))
        dtype = ids.dtype.name if self.dtype is None else self.dtype
        try:
            kind = np.dtype(dtype).kind
        except TypeError:
            kind = None
        if not isinstance(dtype, str) or kind not in ("i", "u"):
            fail("dtype", "the name of a numpy integer dtype (uint8, int32...)", repr(dtype))
        layer_ids = None
        if self.layer_ids is not None:
            layer_ids = tuple(int(v) for v in self.layer_ids)
            if len(layer_ids) != ids.shape[1] or len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
                fail("layer_ids", f"{ids.shape[1]} distinct layer numbers >= 0 (one per column)", layer_ids)
        expected = tok.size - 1 - self.start if self.expected_rows is None else int(self.expected_rows)
        object.__setattr__(self, "ids", np.ascontiguousarray(ids, dtype=np.int64))
        object.__setattr__(self, "dtype", str(np.dtype(dtype).name))
        object.__setattr__(self, "token_ids", tok)
        object.__setattr__(self, "layer_ids", layer_ids)
        object.__setattr__(self, "expected_rows", expected)

    def row_count_note(self) -> str:
        """The row count beside the expected one, the rows past the last token (not judged), and a
        prompt start that would give that count (the words of the ``row_count`` defect of
        :func:`replaymoe.hf.conformance.check_routes`)."""
        T = len(self.token_ids)
        note = f"{self.rows} rows, expected {self.expected_rows}"
        if self.expected_rows == T - 1 - self.start:
            note += f" ({T} tokens - 1 - start {self.start})"
        past = self.start + self.rows - T
        if past > 0:
            note += f"; {past} row(s) past the last token (position {T - 1}), not judged"
        fits = T - 1 - self.rows
        if 0 <= fits <= (T - 1 if self.prompt_tokens is None else self.prompt_tokens) and fits != self.start:
            note += f"; a prompt start of {fits} gives {self.rows} rows (--prompt-start {fits}?)"
        elif fits < 0:
            note += f"; no prompt start gives {self.rows} rows: {-fits} more than the tokens allow"
        return note + (f"; {self.guess}" if self.guess else "")

    @property
    def rows(self) -> int:
        """Number of rows sent."""
        return int(self.ids.shape[0])

    @property
    def columns(self) -> int:
        """Number of layer columns sent."""
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        """K, entries per row."""
        return int(self.ids.shape[2])


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------


def _tokens(value: Any, what: str) -> np.ndarray:
    if not isinstance(value, list):
        raise TraceFormatError(f"{what}: expected a list of token ids, got {type(value).__name__}")
    bad = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        v = value[bad]
        raise TraceFormatError(
            f"{what}: expected a list of integer token ids, got {v!r} ({type(v).__name__}) at index {bad}"
        )
    if value and max(value) > np.iinfo(np.int64).max:
        raise TraceFormatError(f"{what}: expected token ids below 2**63, got {max(value)}")
    arr = np.asarray(value, dtype=np.int64)
    if arr.size and int(arr.min()) < 0:
        raise TraceFormatError(f"{what}: expected token ids >= 0, got {int(arr.min())}")
    return arr


def _start(given: int | None, found: Any, what: str) -> int:
    if given is not None:
        return check_int("prompt_start", given, low=0)
    if found is None:
        return 0
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        raise TraceFormatError(f"{what}: expected an int >= 0, got {found!r}")
    return found


def _parse_json(obj: Any, what: str) -> Any:
    if isinstance(obj, (str, bytes, bytearray)):
        try:
            return json.loads(obj)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceFormatError(f"{what}: invalid JSON ({e})") from e
        except RecursionError:  # json's decoder recurses once per level: 5000 '[' exhaust the stack
            raise TraceFormatError(f"{what}: invalid JSON (nested too deeply for a response)") from None
    return obj


def routes_from_vllm(
    obj: Any, *, choice: int | None = None, prompt_start: int | None = None, source: str = "vLLM response"
) -> list[EngineRoutes]:
    """The routes of each choice of a vLLM response (module docstring: the two endpoints' forms).

    Parameters
    ----------
    obj : dict or str
        A response (``choices`` of dicts holding ``routed_experts``), one choice dict, or its JSON.
    choice : int, optional
        Only this choice; default every choice.
    prompt_start : int, optional
        The request's ``routed_experts_prompt_start``, default 0. vLLM does not echo it, so a
        response's field of that name is not read; a wrong start shows as a row count that does not fit
        the tokens and as misaligned rows (the check's best shift).
    source : str
        Name of the input, used in the routes' ``source`` and in errors.

    Returns
    -------
    list of EngineRoutes
        One per choice, the payload's values untouched (``dtype`` its element type).

    Raises
    ------
    TraceFormatError
        No routes or no token ids (request ``return_token_ids: true``), a bad payload.
    ValueError
        ``choice`` past the response's choices, ``prompt_start`` past the prompt.
    """
    resp = _parse_json(obj, source)
    if not isinstance(resp, Mapping):
        raise TraceFormatError(f"{source}: expected a JSON object, got {type(resp).__name__}")
    if "choices" in resp:
        choices = resp["choices"]
        if not isinstance(choices, list) or not choices:
            raise TraceFormatError(f"{source}: 'choices' is not a non-empty list")
    else:
        choices, resp = [resp], {}
    if choice is not None:
        check_int("choice", choice, low=0)
        if choice >= len(choices):
            fail("choice", f"an index below the response's {len(choices)} choices", choice)
    out = []
    for i in range(len(choices)) if choice is None else (choice,):
        where = f"{source} choices[{i}]" if resp else source
        ch = choices[i]
        if not isinstance(ch, Mapping):
            raise TraceFormatError(f"{where}: not an object")
        fields = [
            (name, value)
            for name, value in (
                ("prompt_routed_experts", resp.get("prompt_routed_experts", ch.get("prompt_routed_experts"))),
                ("routed_experts", ch.get("routed_experts")),
            )
            if value is not None
        ]
        if not fields:
            raise TraceFormatError(
                f"{where}: no routed_experts (start vLLM with --enable-return-routed-experts)"
            )
        arrays = [routes_array(value, f"{where} {name}") for name, value in fields]
        if len(arrays) == 2 and arrays[0].shape[1:] != arrays[1].shape[1:]:
            raise TraceFormatError(
                f"{where}: prompt_routed_experts {arrays[0].shape} and routed_experts {arrays[1].shape} "
                "differ in (layers, top_k)"
            )
        dtype = np.result_type(*arrays).name
        ids = np.concatenate([a.astype(np.int64) for a in arrays], axis=0)
        prompt = ch.get("prompt_token_ids")  # null in the choice: the top-level list (chat), if any
        prompt = resp.get("prompt_token_ids") if prompt is None else prompt
        completion = ch.get("token_ids")
        if prompt is None or completion is None:
            missing = "prompt_token_ids" if prompt is None else "token_ids"
            raise TraceFormatError(
                f"{where}: no {missing} (request them with return_token_ids: true; the check "
                "teacher-forces the sequence)"
            )
        ptok = _tokens(prompt, f"{where} prompt_token_ids")
        tokens = np.concatenate([ptok, _tokens(completion, f"{where} token_ids")])
        start = _start(prompt_start, None, "prompt_start")  # vLLM never echoes the request's start
        if start > len(ptok):
            fail("prompt_start", f"at most the prompt length {len(ptok)} ({where})", start)
        out.append(EngineRoutes(ids, tokens, start=start, dtype=dtype, source=where, prompt_tokens=len(ptok)))
    return out


def routes_from_sglang(
    obj: Any,
    *,
    num_layers: int | Sequence[int],
    top_k: int,
    prompt_start: int | None = None,
    source: str = "SGLang response",
) -> list[EngineRoutes]:
    """The routes of SGLang responses (one dict with ``meta_info``, a list of them, or their JSON).

    Parameters
    ----------
    obj : dict, list of dict, or str
        Each holds ``meta_info.routed_experts`` (base64, flat) and the token ids (module docstring).
    num_layers : int or sequence of int
        The layer count of the flat ``[rows, layers, top_k]`` array, or candidates (the model's
        decoder and MoE layer counts): of those that divide the payload, one whose columns beyond a
        smaller candidate's are all zero (dense layers' columns), else the one whose row count is
        nearest ``tokens - 1 - start`` (the first on a tie), so a row too many or too few keeps the
        layout and shows as a row count that does not fit; then the routes' ``guess`` names the
        other readings.
    top_k : int
        K (SGLang does not send the shape).
    prompt_start : int, optional
        ``routed_experts_start_len``; default ``meta_info``'s own, else 0.
    source : str
        Name of the input.

    Raises
    ------
    TraceFormatError
        No routes or token ids, an unknown ``routed_experts_dtype``, a payload no layer count fits.
    """
    cands = (num_layers,) if isinstance(num_layers, int) else tuple(num_layers)
    if not cands:
        fail("num_layers", "a layer count or a non-empty sequence of them", "an empty sequence")
    for c in cands:
        check_int("num_layers", c, low=1)
    check_int("top_k", top_k, low=1)
    data = _parse_json(obj, source)
    items = data if isinstance(data, list) else [data]
    out = []
    for i, item in enumerate(items):
        where = f"{source}[{i}]" if isinstance(data, list) else source
        if not isinstance(item, Mapping):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(item).__name__}")
        meta = item.get("meta_info", item)
        if not isinstance(meta, Mapping) or meta.get("routed_experts") is None:
            raise TraceFormatError(
                f"{where}: no meta_info.routed_experts (start SGLang with --enable-return-routed-experts "
                "and request return_routed_experts)"
            )
        dtype = str(meta.get("routed_experts_dtype", "int32")).replace("torch.", "")
        if dtype not in _SGLANG_DTYPES:
            raise TraceFormatError(
                f"{where}: routed_experts_dtype expected one of {', '.join(_SGLANG_DTYPES)}, got {dtype!r}"
            )
        raw = b64decode_field(meta["routed_experts"], f"{where} routed_experts")
        toks = []
        for keys, name in ((_PROMPT_KEYS, "prompt"), (_OUTPUT_KEYS, "output")):
            found = next((d[k] for k in keys for d in (item, meta) if d.get(k) is not None), None)
            if found is None:
                raise TraceFormatError(
                    f"{where}: no {name} token ids (one of {', '.join(keys)}; the request's input_ids "
                    "may be added to the response object)"
                )
            toks.append(_tokens(found, f"{where} {name} token ids"))
        tokens = np.concatenate(toks)
        start = _start(
            prompt_start, meta.get("routed_experts_start_len"), f"{where} routed_experts_start_len"
        )
        itemsize = np.dtype(dtype).itemsize
        if len(raw) % itemsize:
            raise TraceFormatError(f"{where}: {len(raw)} bytes is not a whole number of {dtype} values")
        flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
        fits = [c for c in cands if flat.size % (c * top_k) == 0]
        if not fits:
            raise TraceFormatError(
                f"{where}: {flat.size} values are not whole [layers, top_k={top_k}] rows for layers in "
                f"{list(cands)}"
            )
        layers, guess = _sglang_layout(flat, fits, top_k, len(tokens), start, len(toks[0]))
        ids = flat.reshape(-1, layers, top_k).astype(np.int64)
        out.append(EngineRoutes(ids, tokens, start=start, dtype=dtype, source=where,
                                prompt_tokens=len(toks[0]), guess=guess))  # fmt: skip
    return out


def _sglang_layout(
    flat: np.ndarray, fits: list[int], top_k: int, T: int, start: int, prompt: int
) -> tuple[int, str]:
    """(layer count, the words of a guess) of a flat SGLang payload that ``fits`` layer counts divide.

    A layout whose extra columns (over a smaller count's) are all zero, dense layers', is taken; else
    the one whose row count is nearest ``T - 1 - start`` (a payload one row short or long keeps its
    layout; 33 MoE-only rows are not 22 decoder rows). When that row count still does not fit the
    tokens, the guess names the other readings and the prompt start that fits each."""
    rows = {c: flat.size // (c * top_k) for c in fits}
    for c in sorted(fits, reverse=True):
        zero = int((flat.reshape(-1, c, top_k) == 0).all(axis=(0, 2)).sum()) if rows[c] else 0
        if any(c - zero <= o < c for o in fits) and zero < c:  # as many all-zero columns as dense layers
            return c, ""
    want = T - 1 - start
    near = min(fits, key=lambda c: abs(rows[c] - want))
    if rows[near] == want or len(fits) == 1:
        return near, ""
    alts = [
        f"{rows[c]} rows of {c} columns"
        + (
            f" from a prompt start of {s}"
            if 0 <= (s := T - 1 - rows[c]) <= prompt
            else " (no prompt start fits)"
        )
        for c in fits
        if c != near
    ]
    return near, (
        f"layout guessed: its {flat.size} values were read as {rows[near]} rows of {near} columns (the "
        f"nearest to the tokens), and are also {' or '.join(alts)} (--layer-ids of as many layer numbers "
        "as columns, and --prompt-start, read them so)"
    )


def routes_from_trace(trace: RoutingTrace, *, source: str = "trace") -> EngineRoutes:
    """A replaymoe trace as routes (its ``token_ids`` must cover positions from 0).

    Raises
    ------
    ValueError
        The trace has no ``token_ids`` (capture records them), starts past position 0 (its prefix
        tokens are unknown) or has unknown (-1) tokens.
    """
    if not isinstance(trace, RoutingTrace):
        fail("trace", "a RoutingTrace", type(trace).__name__, what="type")
    tok = trace.token_ids
    if tok is None or trace.token_offset != 0 or (tok.size and int(tok.min()) < 0):
        got = (
            "no token_ids"
            if tok is None
            else f"token_offset {trace.token_offset}"
            if trace.token_offset
            else "unknown (-1) token ids"
        )
        fail(
            f"trace {source}",
            "token_ids of every position from 0 (what replaymoe capture records), to teacher-force",
            got,
        )
    return EngineRoutes(
        trace.ids.astype(np.int64),
        tok,
        start=0,
        dtype=str(trace.ids.dtype),
        source=source,
        layer_ids=trace.layer_ids,
        expected_rows=trace.num_tokens,
        num_experts=trace.num_experts,
        fingerprint=trace.fingerprint,
    )


def load_routes(
    path: str | os.PathLike,
    *,
    num_layers: int | Sequence[int] | None = None,
    top_k: int | None = None,
    choice: int | None = None,
    prompt_start: int | None = None,
) -> list[EngineRoutes]:
    """Read the routes in one file: a trace file, a vLLM response, or SGLang response(s), by content.

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    num_layers, top_k
        SGLang's flat payloads need them (see :func:`routes_from_sglang`); ignored otherwise.
    choice, prompt_start
        For vLLM responses (:func:`routes_from_vllm`); ``prompt_start`` also for SGLang. A trace file
        refuses both (it records its own start and has no choices), an SGLang response ``choice``.

    Raises
    ------
    ValueError
        ``choice`` or ``prompt_start`` given for a file they do not apply to, or an empty ``path``.
    OSError
        The file cannot be read.
    TraceFormatError
        The file is not a regular file, is larger than
        :data:`~replaymoe.record.trace.file.MAX_INPUT_BYTES` (both refused before reading), is none of
        the accepted kinds or holds a bad payload; the message names the file.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        fail("path", "a file name (str, bytes or os.PathLike)", type(path).__name__, what="type")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if path == "":
        fail("path", "a file name", "an empty string")
    data = read_input(path, reader="load_routes", accepted=_ACCEPTED)
    if data[:4] == b"PK\x03\x04":
        for name, value, why in (
            ("prompt_start", prompt_start, "it records its own token_offset"),
            ("choice", choice, "it holds one sequence, no choices"),
        ):
            if value is not None:
                fail(name, f"none for the replaymoe trace file {path} ({why})", value)
        return [routes_from_trace(RoutingTrace.load(path), source=path)]
    if not data.strip():
        raise TraceFormatError(f"{path}: empty file", path)
    obj = _parse_json(data, path)
    first = obj[0] if isinstance(obj, list) and obj else obj
    if isinstance(first, Mapping) and "meta_info" in first:
        if choice is not None:
            fail("choice", f"none for the SGLang response {path} (it has no choices)", choice)
        if num_layers is None or top_k is None:
            fail("num_layers", f"the model's layer counts and top_k for SGLang's flat routes in {path}", None)
        return routes_from_sglang(
            obj, num_layers=num_layers, top_k=top_k, prompt_start=prompt_start, source=path
        )
    if isinstance(obj, Mapping):
        return routes_from_vllm(obj, choice=choice, prompt_start=prompt_start, source=path)
    if isinstance(obj, list) and obj and all(isinstance(o, Mapping) for o in obj):
        out = []
        for i, o in enumerate(obj):
            out += routes_from_vllm(o, choice=choice, prompt_start=prompt_start, source=f"{path}[{i}]")
        return out
    raise TraceFormatError(f"{path}: {_ACCEPTED}, got JSON {type(obj).__name__}", path)


def check_fit(routes: Sequence[EngineRoutes], *, top_k: int, num_experts: int, vocab: int | None) -> None:
    """Refuse routes that cannot be checked against a model of ``top_k``, ``num_experts`` and
    vocabulary size ``vocab`` (None: unknown): another top_k or recorded E, a sequence without tokens,
    token ids outside the vocabulary, or nothing to check (no rows, every row -1: missing, or no row
    within the tokens).

    Raises
    ------
    ValueError
        Naming the routes' source.
    """
    for r in routes:
        if r.top_k != top_k:
            fail(f"routes of {r.source}", f"top_k {top_k} (the model's)", f"top_k {r.top_k}", what="shape")
        if r.num_experts is not None and r.num_experts != num_experts:
            fail(f"num_experts of {r.source}", f"the model's {num_experts} experts (routes of another "
                 "model are not this model's)", f"{r.num_experts} recorded in it")  # fmt: skip
        if r.token_ids.size == 0:
            fail(f"routes of {r.source}", "a sequence of at least one token to teacher-force",
                 "no tokens (empty prompt and completion token ids)", what="length")  # fmt: skip
        if vocab is not None and int(r.token_ids.max()) >= vocab:
            i = int(np.argmax(r.token_ids >= vocab))
            fail(f"token ids of {r.source}", f"ids below the model's vocabulary size {vocab}",
                 f"{int(r.token_ids[i])} at position {i}")  # fmt: skip
        T = r.token_ids.size
        if r.rows == 0 or (r.ids == -1).all() or r.start >= T:
            why = (
                "0 rows"
                if r.rows == 0
                else f"start {r.start}: no row within its {T} tokens"
                if r.start >= T
                else f"every one of its {r.rows} rows is -1 (missing)"
            )
            fail(f"routes of {r.source}", "at least one routed row", f"no routed rows to check ({why})",
                 what="length")  # fmt: skip

"""vLLM and SGLang routed-experts wire formats: decoding responses, encoding payloads.

This module's one job is the bytes servers send: :meth:`RoutingTrace.from_vllm
<replaymoe.record.trace.RoutingTrace.from_vllm>`, ``to_vllm``, ``from_sglang`` and ``to_sglang`` delegate
here. Decoders take the class to build (this module never imports :class:`RoutingTrace`); encoders
take the trace's int16 ids. Malformed payloads raise :class:`~replaymoe.record.trace.TraceFormatError`.

* vLLM 0.33 (``--enable-return-routed-experts``): ``choices[i].routed_experts`` is base64 of an
  ``.npy`` file (``np.save``, no pickle), the offline ``CompletionOutput.routed_experts`` unchanged:
  shape [rows, num_hidden_layers, top_k], **one column per decoder layer** (dense layers, e.g.
  DeepSeek-V3's ``first_k_dense_replace``, are all-zero columns), uint8 when E <= 256 else uint16
  (never int32, no -1 sentinel). Row ``i`` is position ``s + i``, ``s`` being the request's
  ``SamplingParams.routed_experts_prompt_start`` (default 0, ``0 <= s <= prompt_len``), which vLLM
  does not echo: ``prompt_len + completion_len - 1 - s`` rows (the last sampled token was never
  fed through the model). Token ids come only with ``return_token_ids: true``: chat puts
  ``prompt_token_ids`` at the top level and ``token_ids`` in each choice, ``/v1/completions`` puts
  both in each choice. :func:`select_moe_layers` maps the layer axis to the MoE layers.
  Legacy payloads still read: a layer axis of the MoE layers only (any integer dtype, int16/int32
  with -1 rows for prefix-cache hits), and the split form of vLLM's v0.21 design (#39917:
  ``prompt_routed_experts`` at response level, the completion's rows in each choice), which
  vLLM 0.33 does not send. See :meth:`RoutingTrace.from_vllm`.
* SGLang: ``meta_info.routed_experts`` is base64 of a *flat* array (int32 by default,
  uint8/uint16 with ``SGLANG_ROUTED_EXPERTS_DTYPE``, named by ``meta_info.routed_experts_dtype``)
  of logical shape [seqlen - 1, L, K]. See :meth:`RoutingTrace.from_sglang`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..._validation import check_choice, check_int, fail
from .checks import as_int, int_tuple, is_int
from .file import TraceFormatError

__all__ = [
    "b64decode_field",
    "check_rows",
    "decode_sglang",
    "decode_vllm",
    "encode_sglang",
    "encode_vllm",
    "routes_array",
    "select_moe_layers",
]

T = TypeVar("T")

_WIRE_DTYPES = ("int16", "int32", "int64", "uint8", "uint16")
_SGLANG_DTYPES = ("int32", "uint8", "uint16", "int16")


def _check_unsigned_fits(ids: np.ndarray, dtype: str) -> None:
    """An unsigned ``dtype`` cannot hold -1 (missing rows) nor ids above its maximum."""
    if dtype.startswith("uint"):
        if (ids < 0).any():
            fail("dtype", "a signed dtype for a trace with missing (-1) rows", dtype)
        if ids.size and int(ids.max()) > np.iinfo(dtype).max:
            fail("dtype", f"a dtype holding expert id {int(ids.max())}", dtype)


def encode_vllm(
    ids: np.ndarray,
    dtype: str,
    *,
    num_hidden_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
) -> str:
    """Base64 of an ``.npy`` of ``ids`` [N, L, K] as ``dtype`` (see ``RoutingTrace.to_vllm``).

    ``num_hidden_layers``: write vLLM 0.33's layout, one column per decoder layer, MoE layer ``l``'s
    ids in column ``layer_ids[l]`` (the identity when None) and every other column zero; None writes
    the columns of ``ids`` as they are.
    """
    if num_hidden_layers is not None:
        layers = tuple(range(ids.shape[1])) if layer_ids is None else tuple(layer_ids)
        check_int("num_hidden_layers", num_hidden_layers, low=max(layers, default=-1) + 1)
        full = np.zeros((ids.shape[0], num_hidden_layers, ids.shape[2]), dtype=ids.dtype)
        full[:, list(layers)] = ids
        ids = full
    check_choice("dtype", dtype, _WIRE_DTYPES)
    _check_unsigned_fits(ids, dtype)
    buf = io.BytesIO()
    np.save(buf, ids.astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def select_moe_layers(routes: np.ndarray, layer_ids: Sequence[int] | None, what: str) -> np.ndarray:
    """The MoE layers' columns of a vLLM routed-experts array.

    Parameters
    ----------
    routes : np.ndarray, integer, shape [rows, C, K]
        vLLM 0.33 sends one column per decoder layer (``C = num_hidden_layers``), dense layers
        all zero; legacy payloads have one column per MoE layer (``C = len(layer_ids)``).
    layer_ids : sequence of int or None
        The model layer numbers of the MoE layers (e.g.
        :func:`replaymoe.integrations.vllm_outputs.moe_layer_ids`). ``None``: every column is
        taken as a MoE layer, which is refused when a column is entirely zero (a dense layer as
        vLLM writes it: the layer numbers are needed, and never guessed).
    what : str
        How the payload is named in errors.

    Returns
    -------
    np.ndarray, same dtype, shape [rows, len(layer_ids), K]
        ``routes[:, layer_ids]`` (``routes`` itself when it already has ``len(layer_ids)``
        columns, or when ``layer_ids`` is None).

    Raises
    ------
    TraceFormatError
        A zero column without ``layer_ids``; fewer columns than ``layer_ids``, or a layer number
        past the last column; a column outside ``layer_ids`` (a dense layer) holding non-zero ids.
    ValueError
        ``layer_ids`` not distinct non-negative ints.
    """
    n_cols = routes.shape[1]
    zero = np.flatnonzero((routes == 0).all(axis=(0, 2))) if routes.shape[0] else np.zeros(0, int)
    cols = ", ".join(map(str, zero.tolist()))
    if layer_ids is None:
        if zero.size:
            raise TraceFormatError(
                f"{what}: layer column(s) {cols} of {n_cols} are all zero: vLLM writes a dense "
                "(non-MoE) layer as an all-zero column, so the MoE layers must be named: pass "
                "layer_ids (--layer-ids), the model layer numbers of the MoE layers "
                "(replaymoe.integrations.vllm_outputs.moe_layer_ids(config) reads them)"
            )
        return routes
    ids = list(int_tuple("layer_ids", layer_ids))
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        fail("layer_ids", "distinct non-negative model layer numbers", ids)
    if n_cols == len(ids):  # the MoE layers only (legacy layout, or a model whose every layer is MoE)
        if zero.size:
            raise TraceFormatError(
                f"{what}: layer column(s) {cols} of {n_cols} are all zero, and layer_ids {ids} take "
                f"all {n_cols} columns as MoE layers, so MoE layer(s) "
                f"{', '.join(str(ids[c]) for c in zero.tolist())} hold no expert ids: routing that was "
                "never written (an engine kernel that does not record it), or a dense layer's column "
                "(a payload of another model)"
            )
        return routes
    if n_cols < len(ids) or max(ids) >= n_cols:
        raise TraceFormatError(
            f"{what}: {n_cols} layer columns, but layer_ids {ids} expect {len(ids)} (the MoE layers "
            f"only) or one per decoder layer (more than {max(ids)}): the payload is not this model's"
        )
    moe = set(ids)
    for c in range(n_cols):
        if c in moe:
            continue
        nz = np.argwhere((routes[:, c] != 0) & (routes[:, c] != -1))  # (-1: a legacy missing row)
        if nz.size:
            row = int(nz[0][0])
            raise TraceFormatError(
                f"{what}: layer column {c} is not in layer_ids {ids}, so it should be a dense layer's "
                f"all-zero column, but it holds expert ids ({routes[row, c].tolist()} at row {row}): "
                "layer_ids do not match the model that produced the payload"
            )
    return routes[:, ids]


def decode_vllm(
    build: Callable[..., T],
    obj: Any,
    *,
    num_experts: int | None,
    choice: int,
    prompt_start: int | None,
    layer_ids: Sequence[int] | None,
    model_id: str | None,
) -> T:
    """Decode vLLM's ``routed_experts`` into ``build(ids, **meta)`` (see ``RoutingTrace.from_vllm``)."""
    choice = as_int("choice", choice, low=0)
    start = 0 if prompt_start is None else as_int("prompt_start", prompt_start, low=0)
    resp = _parse_vllm_obj(obj)
    tokens = None
    if isinstance(resp, np.ndarray):
        ids = resp
    else:
        ids, prompt, completion, found_model = _vllm_dict_ids(resp, choice, start)
        if model_id is None:
            model_id = found_model
        tokens = check_rows(len(ids), prompt, completion, start, "vLLM routed_experts")
    if ids.ndim != 3 or ids.shape[1] < 1 or ids.shape[2] < 1:
        fail(
            "routed_experts",
            "an array of shape (tokens, layers, top_k), at least one layer and one top-k column",
            f"shape {ids.shape}",
            what="shape",
        )
    ids = select_moe_layers(ids, layer_ids, "vLLM routed_experts")
    return build(
        ids,  # any integer dtype as sent: the trace checks the values as given (a uint64 stays positive)
        num_experts=num_experts,
        top_k=int(ids.shape[2]),
        layer_ids=layer_ids,
        model_id=model_id,
        token_offset=start,
        token_ids=tokens,
    )


def check_rows(
    rows: int,
    prompt: Sequence[int] | None,
    completion: Sequence[int] | None,
    start: int,
    what: str,
    *,
    start_name: str = "prompt_start",
    start_from: str = "pass the value the request used as prompt_start / --prompt-start",
) -> np.ndarray | None:
    """Check a payload's row count against its request's tokens; return the covered positions' ids.

    vLLM routes positions ``start .. P + C - 2`` (``P`` prompt, ``C`` completion tokens): the last
    sampled token is never fed through the model. Without both token lists nothing is checked.

    Returns
    -------
    np.ndarray int64 [rows] or None
        ``(prompt + completion)[start : P + C - 1]``, or None when a token list is missing.

    Raises
    ------
    ValueError
        ``start`` past the prompt (the message names ``start_name``).
    TraceFormatError
        ``rows != P + C - 1 - start``; names the row count got and expected, and the prompt start
        that would give ``rows`` (vLLM does not echo the request's ``routed_experts_prompt_start``).
    """
    if prompt is None or completion is None:
        return None
    n_p, n_c = len(prompt), len(completion)
    if n_p + n_c == 0:
        raise TraceFormatError(f"{what}: the sequence has no tokens (empty prompt and completion token ids)")
    if start > n_p:
        fail(start_name, f"at most the prompt's {n_p} tokens", start)
    want = n_p + n_c - 1 - start
    if rows != want:
        fits = n_p + n_c - 1 - rows
        hint = ""
        if 0 <= fits <= n_p and fits != start:
            hint = (
                f"; a request with routed_experts_prompt_start={fits} gives {rows} rows (vLLM does "
                f"not echo it: {start_from})"
            )
        raise TraceFormatError(
            f"{what}: {rows} rows, expected {want} ({n_p} prompt + {n_c} completion tokens - 1 - "
            f"{start_name} {start}: one row per position fed through the model, from {start}){hint}"
        )
    return np.asarray([*prompt, *completion][start : n_p + n_c - 1], dtype=np.int64)


def encode_sglang(ids: np.ndarray, dtype: str) -> str:
    """Base64 of the flat little-endian ``ids`` as ``dtype`` (see ``RoutingTrace.to_sglang``)."""
    check_choice("dtype", dtype, _SGLANG_DTYPES)
    _check_unsigned_fits(ids, dtype)
    return base64.b64encode(ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")


def decode_sglang(
    build: Callable[..., T],
    b64: str | bytes | Mapping[str, Any],
    num_layers: int,
    top_k: int,
    *,
    dtype: str,
    num_experts: int | None,
    start: int,
    layer_ids: Sequence[int] | None,
    model_id: str | None,
) -> T:
    """Decode SGLang's flat ``meta_info.routed_experts`` into ``build(ids, **meta)`` (see ``from_sglang``)."""
    num_layers = as_int("num_layers", num_layers, low=1)
    top_k = as_int("top_k", top_k, low=1)
    start = as_int("start", start, low=0)
    meta = None
    if isinstance(b64, Mapping):
        meta = b64
        if "routed_experts" not in meta:
            raise TraceFormatError(
                "SGLang meta_info has no 'routed_experts' (request it with return_routed_experts)"
            )
        b64 = meta["routed_experts"]
        if meta.get("routed_experts_dtype") is not None:  # "uint8" or "torch.uint8"
            dtype = str(meta["routed_experts_dtype"]).removeprefix("torch.")
            check_choice("meta_info.routed_experts_dtype", dtype, _SGLANG_DTYPES)
    check_choice("dtype", dtype, _SGLANG_DTYPES)
    raw = b64decode_field(b64, "SGLang routed_experts")
    itemsize = np.dtype(dtype).itemsize
    row = num_layers * top_k
    if len(raw) % (itemsize * row):
        raise TraceFormatError(
            f"SGLang routed_experts: {len(raw)} bytes is not a whole number of {dtype} "
            f"[num_layers={num_layers}, top_k={top_k}] rows ({itemsize * row} bytes each)"
        )
    flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    rows = flat.size // row
    # JSON values, checked to be ints below
    counts: list[Any] = (
        [meta.get(k) for k in ("prompt_tokens", "completion_tokens")] if meta is not None else []
    )
    for key, n in zip(("prompt_tokens", "completion_tokens"), counts):
        if n is not None and (not is_int(n) or n < 0):
            raise TraceFormatError(f"SGLang meta_info.{key}: expected a token count (an int >= 0), got {n!r}")
    if len(counts) == 2 and None not in counts:
        want = counts[0] + counts[1] - 1 - start  # the last sampled token was never fed through the model
        if rows != want:
            raise TraceFormatError(
                f"SGLang routed_experts: {rows} rows, expected {want} (meta_info's {counts[0]} prompt + "
                f"{counts[1]} completion tokens - 1 - start {start}); is num_layers={num_layers} or the "
                "start right?"
            )
    ids = select_moe_layers(flat.reshape(-1, num_layers, top_k), layer_ids, "SGLang routed_experts")
    return build(
        ids,
        num_experts=num_experts,
        top_k=top_k,
        layer_ids=layer_ids,
        model_id=model_id,
        token_offset=start,
    )


def b64decode_field(b64: Any, what: str) -> bytes:
    if isinstance(b64, str):
        if not b64.isascii():
            raise TraceFormatError(f"{what}: invalid base64 (non-ASCII characters)")
        b64 = b64.encode("ascii")
    if not isinstance(b64, (bytes, bytearray)):
        raise TraceFormatError(f"{what}: expected a base64 string, got {type(b64).__name__}")
    try:
        return base64.b64decode(b"".join(bytes(b64).split()), validate=True)  # line breaks allowed
    except (binascii.Error, ValueError) as e:
        raise TraceFormatError(f"{what}: invalid base64 ({e})") from e


def _decode_npy(raw: bytes, what: str) -> np.ndarray:
    if not raw.startswith(b"\x93NUMPY"):
        raise TraceFormatError(
            f"{what}: not an .npy payload: the base64 decodes to {len(raw)} bytes starting "
            f"{raw[:8]!r}, not an .npy file (vLLM sends base64 of np.save's bytes)"
        )
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as e:
        raise TraceFormatError(f"{what}: not a valid .npy payload ({type(e).__name__}: {e})") from e
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
        raise TraceFormatError(f"{what}: expected an integer array, got {getattr(arr, 'dtype', type(arr))}")
    return arr


def routes_array(value: Any, what: str) -> np.ndarray:
    """One vLLM routed-experts field (base64 .npy, raw .npy bytes, array or nested list) -> array."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (bytes, bytearray)) and bytes(value[:6]) == b"\x93NUMPY":
        arr = _decode_npy(bytes(value), what)
    elif isinstance(value, (str, bytes, bytearray)):
        arr = _decode_npy(b64decode_field(value, what), what)
    elif isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError:  # numpy: "setting an array element with a sequence"
            raise TraceFormatError(
                f"{what}: expected a (tokens, layers, top_k) nested list of expert ids, got a ragged one "
                "(nested lists of different lengths)"
            ) from None
        if arr.size == 0:
            arr = arr.astype(np.int64).reshape(0, 0, 0) if arr.ndim < 3 else arr.astype(np.int64)
    else:
        try:
            import torch

            if not isinstance(value, torch.Tensor):
                raise TraceFormatError(f"{what}: unsupported payload type {type(value).__name__}")
            if value.dtype == torch.bfloat16:  # numpy has no bfloat16; refused below as floats
                value = value.float()
            arr = value.detach().cpu().numpy()  # then the dtype and shape checks, as for an array
        except ImportError:  # pragma: no cover
            raise TraceFormatError(f"{what}: unsupported payload type {type(value).__name__}") from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TraceFormatError(f"{what}: expected integer expert ids, got dtype {arr.dtype}")
    if arr.ndim != 3:
        raise TraceFormatError(f"{what}: expected shape (tokens, layers, top_k), got {arr.shape}")
    return arr


def _parse_vllm_obj(obj: Any) -> np.ndarray | Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if isinstance(obj, str) and obj.lstrip().startswith("{"):
        try:
            parsed = json.loads(obj)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"vLLM response: invalid JSON ({e})") from e
        return parsed
    return routes_array(obj, "vLLM routed_experts")


def _token_list(value: Any, what: str) -> list[int] | None:
    """A response's ``prompt_token_ids`` / ``token_ids`` as a list of ints, or None when absent."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TraceFormatError(f"vLLM response: {what} is not a list of token ids ({type(value).__name__})")
    bad = next((i for i, t in enumerate(value) if not is_int(t)), None)
    if bad is not None:
        t = value[bad]
        raise TraceFormatError(
            f"vLLM response: {what} is not a list of integer token ids: {t!r} ({type(t).__name__}) at "
            f"index {bad}"
        )
    return list(value)


def _vllm_dict_ids(
    d: Mapping[str, Any], choice: int, start: int
) -> tuple[np.ndarray, list[int] | None, list[int] | None, str | None]:
    """(ids, prompt token ids, completion token ids, model) from a vLLM response or choice dict.

    Token ids are present only when the request set ``return_token_ids: true``: chat completions
    put ``prompt_token_ids`` at the top level, ``/v1/completions`` in each choice; ``token_ids``
    is per choice in both. ``start`` (the request's prompt start) checks the legacy split form's
    prompt rows.
    """
    model = d.get("model") if isinstance(d.get("model"), str) else None
    if "choices" in d:
        choices = d["choices"]
        if not isinstance(choices, list):
            raise TraceFormatError(f"vLLM response: choices is not a list ({type(choices).__name__})")
        if not choices:
            raise TraceFormatError('vLLM response has no choices ("choices": []): no routed_experts to read')
        if choice >= len(choices):
            fail("choice", f"an index below the response's {len(choices)} choices", choice)
        ch = choices[choice]
        if not isinstance(ch, Mapping):
            raise TraceFormatError(f"vLLM response: choices[{choice}] is not an object")
    else:
        ch, d = d, {}
    prompt = ch.get("prompt_token_ids")  # null in the choice: the top-level list (chat), if any
    prompt_ids = _token_list(d.get("prompt_token_ids") if prompt is None else prompt, "prompt_token_ids")
    completion_ids = _token_list(ch.get("token_ids"), "token_ids")
    legacy_prompt = d.get("prompt_routed_experts", ch.get("prompt_routed_experts"))  # v0.21 split form
    completion = ch.get("routed_experts")
    if legacy_prompt is None and completion is None:
        raise TraceFormatError(
            "vLLM response carries no routed_experts (start the server with --enable-return-routed-experts)"
        )
    parts = []
    if legacy_prompt is not None:
        p = routes_array(legacy_prompt, "vLLM prompt_routed_experts")
        if prompt_ids is not None and p.shape[0] != len(prompt_ids) - start:
            raise TraceFormatError(
                f"vLLM prompt_routed_experts has {p.shape[0]} rows but the prompt has "
                f"{len(prompt_ids)} tokens (prompt_start {start})"
            )
        parts.append(p)
    if completion is not None:
        parts.append(routes_array(completion, "vLLM routed_experts"))
    parts = [p for p in parts if p.shape[0] > 0] or parts[:1]
    if len(parts) == 2 and parts[0].shape[1:] != parts[1].shape[1:]:
        raise TraceFormatError(
            f"vLLM prompt_routed_experts {parts[0].shape} and routed_experts {parts[1].shape} "
            "differ in (layers, top_k)"
        )
    ids = np.concatenate([p.astype(np.int64) for p in parts], axis=0) if len(parts) > 1 else parts[0]
    return ids, prompt_ids, completion_ids, model

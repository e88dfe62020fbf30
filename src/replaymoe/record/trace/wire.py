"""vLLM and SGLang routed-experts wire formats: decoding responses, encoding payloads.

This module's one job is the bytes servers send: :meth:`RoutingTrace.from_vllm
<replaymoe.record.trace.RoutingTrace.from_vllm>`, ``to_vllm``, ``from_sglang`` and ``to_sglang`` delegate
here. Decoders take the class to build (this module never imports :class:`RoutingTrace`); encoders
take the trace's int16 ids. Malformed payloads raise :class:`~replaymoe.record.trace.TraceFormatError`.

* vLLM (``--enable-return-routed-experts``): base64 of an ``.npy`` file of shape
  (tokens, layers, top_k); vLLM 0.33 sends uint8 when E <= 256, else uint16 or int32.
  A request's routing covers prompt + completion minus the last sampled token (which
  was never fed through the model): ``num_tokens - 1`` rows. The split form carries
  ``prompt_routed_experts`` at response level (shared by the n choices) and the
  completion part in each choice's ``routed_experts``; a request may skip the first
  ``routed_experts_prompt_start`` prompt tokens. See :meth:`RoutingTrace.from_vllm`.
* SGLang: ``meta_info.routed_experts`` is base64 of a *flat* array (int32 by default,
  uint8/uint16 with ``SGLANG_ROUTED_EXPERTS_DTYPE``) of logical shape
  [seqlen - 1, L, K]. See :meth:`RoutingTrace.from_sglang`.
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
from .file import TraceFormatError

__all__ = ["encode_vllm", "decode_vllm", "encode_sglang", "decode_sglang"]

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


def encode_vllm(ids: np.ndarray, dtype: str) -> str:
    """Base64 of an ``.npy`` of ``ids`` as ``dtype`` (see ``RoutingTrace.to_vllm``)."""
    check_choice("dtype", dtype, _WIRE_DTYPES)
    _check_unsigned_fits(ids, dtype)
    buf = io.BytesIO()
    np.save(buf, ids.astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


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
    check_int("choice", choice, low=0)
    resp = _parse_vllm_obj(obj)
    if isinstance(resp, np.ndarray):
        ids = resp
        found_start = None
    else:
        ids, found_start, found_model = _vllm_dict_ids(resp, choice, prompt_start)
        if model_id is None:
            model_id = found_model
    if prompt_start is None:
        prompt_start = found_start if found_start is not None else 0
    check_int("prompt_start", prompt_start, low=0)
    if ids.ndim != 3:
        fail(
            "routed_experts",
            "an array of shape (tokens, layers, top_k)",
            f"shape {ids.shape}",
            what="shape",
        )
    return build(
        ids.astype(np.int64),
        num_experts=num_experts,
        top_k=int(ids.shape[2]),
        layer_ids=layer_ids,
        model_id=model_id,
        token_offset=prompt_start,
    )


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
    check_int("num_layers", num_layers, low=1)
    check_int("top_k", top_k, low=1)
    if isinstance(b64, Mapping):
        meta = b64
        if "routed_experts" not in meta:
            raise TraceFormatError(
                "SGLang meta_info has no 'routed_experts' (request it with return_routed_experts)"
            )
        dtype = str(meta.get("routed_experts_dtype", dtype)).replace("torch.", "")
        b64 = meta["routed_experts"]
    check_choice("dtype", dtype, _SGLANG_DTYPES)
    raw = _b64decode(b64, "SGLang routed_experts")
    itemsize = np.dtype(dtype).itemsize
    row = num_layers * top_k
    if len(raw) % (itemsize * row):
        raise TraceFormatError(
            f"SGLang routed_experts: {len(raw)} bytes is not a whole number of {dtype} "
            f"[num_layers={num_layers}, top_k={top_k}] rows ({itemsize * row} bytes each)"
        )
    flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    ids = flat.reshape(-1, num_layers, top_k).astype(np.int64)
    return build(
        ids,
        num_experts=num_experts,
        top_k=top_k,
        layer_ids=layer_ids,
        model_id=model_id,
        token_offset=start,
    )


def _b64decode(b64: Any, what: str) -> bytes:
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
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as e:
        raise TraceFormatError(f"{what}: not a valid .npy payload ({type(e).__name__}: {e})") from e
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
        raise TraceFormatError(f"{what}: expected an integer array, got {getattr(arr, 'dtype', type(arr))}")
    return arr


def _routes_array(value: Any, what: str) -> np.ndarray:
    """One vLLM routed-experts field (base64 .npy, raw .npy bytes, array or nested list) -> array."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (bytes, bytearray)) and bytes(value[:6]) == b"\x93NUMPY":
        arr = _decode_npy(bytes(value), what)
    elif isinstance(value, (str, bytes, bytearray)):
        arr = _decode_npy(_b64decode(value, what), what)
    elif isinstance(value, list):
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64).reshape(0, 0, 0) if arr.ndim < 3 else arr.astype(np.int64)
    else:
        try:
            import torch

            if isinstance(value, torch.Tensor):
                return value.detach().cpu().numpy()
        except ImportError:  # pragma: no cover
            pass
        raise TraceFormatError(f"{what}: unsupported payload type {type(value).__name__}")
    if not np.issubdtype(arr.dtype, np.integer):
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
    return _routes_array(obj, "vLLM routed_experts")


def _vllm_dict_ids(
    d: Mapping[str, Any], choice: int, given_start: int | None = None
) -> tuple[np.ndarray, int | None, str | None]:
    """(ids, prompt_start found, model found) from a vLLM response or choice dict.

    ``given_start`` (the caller's ``prompt_start``) takes precedence over the response's own field
    when the prompt rows are checked against ``prompt_token_ids``.
    """
    start_key = "routed_experts_prompt_start"
    model = d.get("model") if isinstance(d.get("model"), str) else None
    if "choices" in d:
        choices = d["choices"]
        if not isinstance(choices, list) or choice >= len(choices):
            n = len(choices) if isinstance(choices, list) else 0
            fail("choice", f"an index below the response's {n} choices", choice)
        ch = choices[choice]
        if not isinstance(ch, Mapping):
            raise TraceFormatError(f"vLLM response: choices[{choice}] is not an object")
    else:
        ch, d = d, {}
    prompt = d.get("prompt_routed_experts", ch.get("prompt_routed_experts"))
    completion = ch.get("routed_experts", ch.get("completion_routed_experts"))
    start = ch.get(start_key, d.get(start_key))
    if prompt is None and completion is None:
        raise TraceFormatError(
            "vLLM response carries no routed_experts (start the server with --enable-return-routed-experts "
            "and request return_routed_experts)"
        )
    parts = []
    if prompt is not None:
        p = _routes_array(prompt, "vLLM prompt_routed_experts")
        ptoks = d.get("prompt_token_ids", ch.get("prompt_token_ids"))
        skip = given_start if given_start is not None else (start or 0)
        if isinstance(ptoks, list) and isinstance(skip, int) and p.shape[0] != len(ptoks) - skip:
            raise TraceFormatError(
                f"vLLM prompt_routed_experts has {p.shape[0]} rows but the prompt has {len(ptoks)} tokens"
                f" (prompt_start {skip})"
            )
        parts.append(p)
    if completion is not None:
        c = _routes_array(completion, "vLLM routed_experts")
        parts.append(c)
    parts = [p for p in parts if p.shape[0] > 0] or parts[:1]
    if len(parts) == 2 and parts[0].shape[1:] != parts[1].shape[1:]:
        raise TraceFormatError(
            f"vLLM prompt_routed_experts {parts[0].shape} and routed_experts {parts[1].shape} "
            "differ in (layers, top_k)"
        )
    ids = np.concatenate([p.astype(np.int64) for p in parts], axis=0) if len(parts) > 1 else parts[0]
    if start is not None and (isinstance(start, bool) or not isinstance(start, int)):
        raise TraceFormatError(f"vLLM {start_key} is not an int: {start!r}")
    return ids, start, model

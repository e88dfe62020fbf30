"""Recorded MoE routing: :class:`RoutingTrace`, its file format, and vLLM/SGLang wire formats.

A trace holds, for one sequence, the expert ids every MoE layer chose for every token::

    ids : int16 [N, L, K]     N tokens (positions token_offset .. token_offset+N-1),
                              L MoE layers (trace order), K = top_k columns in the
                              router's selection order; -1 = no routing recorded
                              (a whole [K] row is either -1 or K distinct ids in [0, E)).

File format (``RoutingTrace.save`` / ``RoutingTrace.load``), version 1
-----------------------------------------------------------------------
One file, a zip archive in numpy's ``.npz`` layout (readable with ``numpy.load``
without pickle), holding exactly two members:

``ids.npy``
    int16 little-endian [N, L, K], C order.
``meta.npy``
    uint8 [M]: a UTF-8 JSON object::

        {"format": "replaymoe-routing-trace", "version": 1,
         "shape": [N, L, K], "dtype": "int16",
         "num_experts": E or null, "top_k": K, "layer_ids": [..L ints..] or null,
         "model_id": str or null, "token_offset": int,
         "sha256": hex SHA-256 of the ids' raw bytes (int16 little-endian, C order)}

Writes are atomic: the archive is written to a temporary file in the target
directory, fsync'ed and renamed over the target, so a failing save leaves no file
and never clobbers an existing one. Loading checks the archive, the format name,
the version (newer versions are refused), the shape/dtype and the checksum; any
failure raises :class:`TraceFormatError` (a ``ValueError``) naming the file.

Wire formats
------------
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
import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._validation import check_choice, check_int, fail

__all__ = ["RoutingTrace", "TraceFormatError", "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "replaymoe-routing-trace"
FORMAT_VERSION = 1

_WIRE_DTYPES = ("int16", "int32", "int64", "uint8", "uint16")


class TraceFormatError(ValueError):
    """A trace file (or wire payload) is truncated, corrupted, foreign or of an unsupported version.

    ``path`` is the offending file (``None`` for in-memory payloads); it also appears in the message.
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _as_int_array(name: str, ids: Any) -> np.ndarray:
    """Return ``ids`` as a numpy integer array (torch tensors and nested lists accepted)."""
    try:
        import torch

        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    arr = np.asarray(ids)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0 and arr.dtype == np.float64:  # an empty list
            arr = arr.astype(np.int64)
        else:
            fail(name, "an integer array", f"dtype {arr.dtype}", what="dtype")
    return arr


def _check_ids(ids: np.ndarray, num_experts: int | None, name: str = "ids") -> np.ndarray:
    """Validate an integer [N, L, K] array of expert ids and return it as C-contiguous int16."""
    if ids.ndim != 3:
        fail(name, "a 3-D array [tokens, layers, top_k]", f"shape {ids.shape}", what="shape")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        top = (num_experts - 1) if num_experts is not None else np.iinfo(np.int16).max
        if lo < -1 or hi > top:
            bad = np.argwhere((ids < -1) | (ids > top))[0]
            fail(
                name,
                f"expert ids in [0, {top}] or -1 (missing)",
                f"{int(ids[tuple(bad)])} at [token, layer, k] = {bad.tolist()}",
            )
    out = np.ascontiguousarray(ids, dtype=np.int16)
    if out.size:
        missing = out < 0
        mixed = missing.any(-1) & ~missing.all(-1)
        if mixed.any():
            t, layer = np.argwhere(mixed)[0].tolist()
            fail(
                name,
                "each [top_k] row all -1 (missing) or all valid ids",
                f"row {out[t, layer].tolist()} at token {t}, layer {layer}",
            )
        K = out.shape[2]
        if K > 1:
            if K <= 16:  # pairwise compares are much faster than a sort per row for small K
                dup = np.zeros(out.shape[:2], dtype=bool)
                for a in range(K - 1):
                    col = out[..., a]
                    for b in range(a + 1, K):
                        dup |= col == out[..., b]
                dup &= ~missing[..., 0]
            else:
                srt = np.sort(out, axis=-1)
                dup = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)
            if dup.any():
                t, layer = np.argwhere(dup)[0].tolist()
                fail(
                    name,
                    "distinct expert ids in a row",
                    f"row {out[t, layer].tolist()} at token {t}, layer {layer}",
                )
    return out


def _check_layer_ids(layer_ids: Any, num_layers: int) -> tuple[int, ...] | None:
    if layer_ids is None:
        return None
    try:
        vals = tuple(int(v) for v in layer_ids)
    except (TypeError, ValueError):
        fail("layer_ids", "a sequence of ints", repr(layer_ids))
    if len(vals) != num_layers:
        fail("layer_ids", f"{num_layers} entries (one per MoE layer of ids)", f"{len(vals)} entries")
    if any(v < 0 for v in vals) or len(set(vals)) != len(vals):
        fail("layer_ids", "distinct non-negative model layer numbers", list(vals))
    return vals


def _sha256(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i2").tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# the trace
# --------------------------------------------------------------------------------------------


class RoutingTrace:
    """Expert ids recorded for one sequence.

    Parameters
    ----------
    ids : array-like of int, shape [N, L, K]
        Expert ids per token (position ``token_offset + n``), MoE layer and top-k column; -1 = missing
        (e.g. positions served from a prefix cache). Any integer dtype, numpy array or torch tensor;
        stored as C-contiguous int16. A [K] row is either all -1 or K distinct ids in [0, num_experts).
    num_experts : int or None
        Number of routed experts E of the model; ``None`` when unknown (e.g. a vLLM payload without
        model information), in which case consumers that need E infer ``max(id) + 1`` or take it as
        an argument.
    top_k : int
        K; must equal ``ids.shape[2]``.
    layer_ids : sequence of int, optional
        MoE-layer index -> model layer number (length L, distinct). ``None`` = identity. Needed
        because dense layers (e.g. DeepSeek-V3's first three) shift MoE indices.
    model_id : str, optional
        Free-form model identifier (e.g. the HF repo id or vLLM's ``model`` field).
    token_offset : int
        Position in the sequence of ``ids[0]`` (non-zero for a multi-turn continuation or a vLLM
        request with ``routed_experts_prompt_start``).

    Attributes
    ----------
    ids : np.ndarray int16 [N, L, K]
    num_experts, top_k, layer_ids (tuple or None), model_id, token_offset
    format_version : int
        :data:`FORMAT_VERSION` of the file format this class writes.
    """

    format_version = FORMAT_VERSION

    def __init__(
        self,
        ids: Any,
        *,
        num_experts: int | None,
        top_k: int,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
        token_offset: int = 0,
    ):
        if num_experts is not None:
            check_int("num_experts", num_experts, low=1, high=np.iinfo(np.int16).max + 1)
        check_int("top_k", top_k, low=1, high=num_experts)
        check_int("token_offset", token_offset, low=0)
        if model_id is not None and not isinstance(model_id, str):
            fail("model_id", "a str or None", type(model_id).__name__, what="type")
        arr = _as_int_array("ids", ids)
        if arr.ndim == 3 and arr.shape[2] != top_k:
            fail("ids", f"shape[2] == top_k == {top_k}", f"shape {arr.shape}", what="shape")
        self.ids: np.ndarray = _check_ids(arr, num_experts)
        self.num_experts = num_experts
        self.top_k = top_k
        self.layer_ids = _check_layer_ids(layer_ids, self.ids.shape[1])
        self.model_id = model_id
        self.token_offset = token_offset

    # ---------------------------------------------------------------- basic properties
    @property
    def num_tokens(self) -> int:
        """N, the number of positions the trace covers."""
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers."""
        return int(self.ids.shape[1])

    @property
    def end(self) -> int:
        """One past the last position covered: ``token_offset + num_tokens``."""
        return self.token_offset + self.num_tokens

    def missing_mask(self) -> np.ndarray:
        """bool [N, L]: True where the (token, layer) row is missing (-1)."""
        return self.ids[..., 0] < 0

    def missing_fraction(self) -> float:
        """Fraction of (token, layer) rows that are missing; 0.0 for an empty trace."""
        m = self.missing_mask()
        return float(m.mean()) if m.size else 0.0

    def model_layer_ids(self) -> tuple[int, ...]:
        """Model layer number of each MoE layer (``layer_ids`` or the identity)."""
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.num_layers))

    def _meta(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layer_ids": list(self.layer_ids) if self.layer_ids is not None else None,
            "model_id": self.model_id,
            "token_offset": self.token_offset,
        }

    def replace(self, **changes: Any) -> RoutingTrace:
        """A copy with some constructor arguments changed (``ids`` included)."""
        kw = {"ids": self.ids.copy(), **self._meta()}
        kw.update(changes)
        ids = kw.pop("ids")
        return RoutingTrace(ids, **kw)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return self._meta() == other._meta() and np.array_equal(self.ids, other.ids)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(tokens={self.num_tokens}, layers={self.num_layers}, top_k={self.top_k}, "
            f"num_experts={self.num_experts}, token_offset={self.token_offset}, model_id={self.model_id!r}, "
            f"missing={self.missing_fraction():.3f})"
        )

    # ---------------------------------------------------------------- file format
    def save(self, path: str | os.PathLike, *, compress: bool = True) -> None:
        """Write the trace to ``path`` atomically (see the module docstring for the format).

        Parameters
        ----------
        path : str or os.PathLike
            Target file; written exactly there (no suffix is added). Its directory must exist.
        compress : bool
            Deflate the archive members (ids of < 256 experts typically shrink 2-3x).
        """
        path = os.fspath(path)
        ids = np.ascontiguousarray(self.ids, dtype="<i2")
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "shape": list(ids.shape),
            "dtype": "int16",
            **self._meta(),
            "sha256": _sha256(ids),
        }
        meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), dtype=np.uint8)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_payload(f, ids, meta_bytes, compress)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read a trace written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            ``path`` does not exist.
        TraceFormatError
            The file is truncated, corrupted (checksum or archive CRC), not a replaymoe trace, or of a
            newer format version. The message names the file.
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()

        def bad(why: str) -> TraceFormatError:
            return TraceFormatError(f"{path}: {why}", path)

        if not data.startswith(b"PK\x03\x04"):
            raise bad("not a replaymoe routing trace (not an .npz/zip archive)")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                names = set(z.files)
                if "meta" not in names or "ids" not in names:
                    raise bad(f"not a replaymoe routing trace (archive members {sorted(names)})")
                meta_arr = z["meta"]
                if meta_arr.dtype != np.uint8 or meta_arr.ndim != 1:
                    raise bad("not a replaymoe routing trace (meta is not a JSON byte string)")
                meta = json.loads(meta_arr.tobytes().decode("utf-8"))
                if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
                    raise bad(f"not a replaymoe routing trace (format {meta.get('format')!r})")
                version = meta.get("version")
                if not isinstance(version, int) or version < 1:
                    raise bad(f"invalid format version {version!r}")
                if version > FORMAT_VERSION:
                    raise bad(
                        f"format version {version} is newer than this replaymoe reads "
                        f"(<= {FORMAT_VERSION}); upgrade replaymoe"
                    )
                ids = z["ids"]
        except TraceFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - any decoding failure means a damaged file
            raise bad(f"truncated or corrupted trace file ({type(e).__name__}: {e})") from e
        if ids.dtype != np.dtype("<i2") or list(ids.shape) != meta.get("shape"):
            raise bad(f"ids {ids.dtype} {list(ids.shape)} do not match the metadata {meta.get('shape')}")
        if _sha256(ids) != meta.get("sha256"):
            raise bad("checksum mismatch: the ids are corrupted")
        try:
            return cls(
                ids,
                num_experts=meta["num_experts"],
                top_k=meta["top_k"],
                layer_ids=meta["layer_ids"],
                model_id=meta["model_id"],
                token_offset=meta["token_offset"],
            )
        except (KeyError, ValueError) as e:
            raise bad(f"invalid metadata ({type(e).__name__}: {e})") from e

    # ---------------------------------------------------------------- vLLM
    def to_vllm(self, dtype: str = "int32") -> str:
        """Encode as vLLM does: base64 of an ``.npy`` file of shape (tokens, layers, top_k).

        ``numpy.load(io.BytesIO(base64.b64decode(s)))`` reads it back. Unsigned dtypes (vLLM's compact
        uint8 for <= 256 experts, uint16) cannot hold -1: a trace with missing rows or ids too large for
        the dtype raises ``ValueError``.
        """
        check_choice("dtype", dtype, _WIRE_DTYPES)
        arr = self.ids
        if dtype.startswith("uint"):
            if (arr < 0).any():
                fail("dtype", "a signed dtype for a trace with missing (-1) rows", dtype)
            if arr.size and int(arr.max()) > np.iinfo(dtype).max:
                fail("dtype", f"a dtype holding expert id {int(arr.max())}", dtype)
        buf = io.BytesIO()
        np.save(buf, arr.astype(dtype), allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    @classmethod
    def from_vllm(
        cls,
        obj: Any,
        *,
        num_experts: int | None = None,
        choice: int = 0,
        prompt_start: int | None = None,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
    ) -> RoutingTrace:
        """Decode vLLM's ``routed_experts``.

        Parameters
        ----------
        obj : str, bytes, dict, np.ndarray or nested list
            * the base64 string of an ``.npy`` (what vLLM puts in ``routed_experts``), or the raw
              ``.npy`` bytes, or an already-decoded array [tokens, layers, top_k] (offline API);
            * a choice dict holding ``routed_experts`` (or ``completion_routed_experts``);
            * a whole response (dict, or its JSON text): ``choices[choice]`` is used, and when the
              response carries ``prompt_routed_experts`` (the split form) the trace is the prompt
              rows followed by the choice's completion rows.
        num_experts : int, optional
            The model's E (vLLM does not send it). ``None`` leaves it unknown.
        choice : int
            Which choice of a whole response.
        prompt_start : int, optional
            ``routed_experts_prompt_start`` of the request: the first position the payload covers
            (becomes ``token_offset``). Defaults to the value found in the response/choice, else 0.
        layer_ids, model_id
            Stored on the trace (``model_id`` defaults to the response's ``model`` field).

        Notes
        -----
        A request of ``num_tokens`` tokens (prompt + completion) yields ``num_tokens - 1`` rows: the
        last sampled token was never fed through the model. Rows of -1 (vLLM's prefix-cache sentinel)
        are kept as missing.
        """
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
        return cls(
            ids.astype(np.int64),
            num_experts=num_experts,
            top_k=int(ids.shape[2]),
            layer_ids=layer_ids,
            model_id=model_id,
            token_offset=prompt_start,
        )

    # ---------------------------------------------------------------- SGLang
    @classmethod
    def from_sglang(
        cls,
        b64: str | bytes | Mapping[str, Any],
        num_layers: int,
        top_k: int,
        *,
        dtype: str = "int32",
        num_experts: int | None = None,
        start: int = 0,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
    ) -> RoutingTrace:
        """Decode SGLang's flat ``meta_info.routed_experts``.

        Parameters
        ----------
        b64 : str, bytes or dict
            Base64 of the flat array, or the ``meta_info`` dict (then ``routed_experts`` is read from
            it, and ``routed_experts_dtype`` overrides ``dtype`` when present).
        num_layers, top_k : int
            The logical shape [tokens, num_layers, top_k] (SGLang does not send it). When SGLang fuses
            shared experts into the capture, top_k counts them too.
        dtype : {"int32", "uint8", "uint16", "int16"}
            Element type (SGLang's default int32; ``SGLANG_ROUTED_EXPERTS_DTYPE`` = uint8/uint16).
        start : int
            ``routed_experts_start_len``: the first position covered (becomes ``token_offset``).
        """
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
        check_choice("dtype", dtype, ("int32", "uint8", "uint16", "int16"))
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
        return cls(
            ids,
            num_experts=num_experts,
            top_k=top_k,
            layer_ids=layer_ids,
            model_id=model_id,
            token_offset=start,
        )

    def to_sglang(self, dtype: str = "int32") -> str:
        """Encode as SGLang does: base64 of the flat little-endian array (inverse of :meth:`from_sglang`)."""
        check_choice("dtype", dtype, ("int32", "uint8", "uint16", "int16"))
        if dtype.startswith("uint"):
            if (self.ids < 0).any():
                fail("dtype", "a signed dtype for a trace with missing (-1) rows", dtype)
            if self.ids.size and int(self.ids.max()) > np.iinfo(dtype).max:
                fail("dtype", f"a dtype holding expert id {int(self.ids.max())}", dtype)
        return base64.b64encode(self.ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")

    # ---------------------------------------------------------------- combining
    @classmethod
    def concat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Join traces of consecutive position ranges (e.g. prompt then completion).

        Each trace must start where the previous one ends (``t[i+1].token_offset == t[i].end``); the
        result starts at ``traces[0].token_offset``. Metadata must agree (see :meth:`merge`).
        """
        traces = list(traces)
        if not traces:
            fail("traces", "at least one RoutingTrace", "an empty sequence")
        meta = _common_meta(traces)
        for prev, nxt in zip(traces, traces[1:]):
            if nxt.token_offset != prev.end:
                fail(
                    "traces",
                    f"consecutive position ranges (next token_offset == {prev.end})",
                    f"token_offset {nxt.token_offset}; use RoutingTrace.merge for gaps or overlaps",
                )
        ids = np.concatenate([t.ids for t in traces], axis=0)
        return cls(ids, **meta, token_offset=traces[0].token_offset)

    @classmethod
    def merge(cls, traces: Sequence[RoutingTrace], *, on_conflict: str = "error") -> RoutingTrace:
        """Overlay traces by position (multi-turn: turn 2's payload starts at its prompt offset).

        The result covers ``min(token_offset)`` .. ``max(end)``; positions no trace covers are -1. A
        recorded row fills a missing one; where two traces record *different* experts for the same
        (position, layer), ``on_conflict`` decides: ``"error"`` (ValueError naming the position),
        ``"first"`` (keep the earlier trace's row) or ``"last"`` (take the later one's).
        """
        check_choice("on_conflict", on_conflict, ("error", "first", "last"))
        traces = list(traces)
        if not traces:
            fail("traces", "at least one RoutingTrace", "an empty sequence")
        meta = _common_meta(traces)
        start = min(t.token_offset for t in traces)
        stop = max(t.end for t in traces)
        L, K = traces[0].num_layers, traces[0].top_k
        out = np.full((stop - start, L, K), -1, dtype=np.int16)
        for t in traces:
            dst = out[t.token_offset - start : t.end - start]
            have_new = t.ids[..., 0] >= 0
            have_old = dst[..., 0] >= 0
            clash = have_new & have_old & (dst != t.ids).any(-1)
            if clash.any() and on_conflict == "error":
                n, layer = np.argwhere(clash)[0].tolist()
                fail(
                    "traces",
                    "the same experts where traces overlap (or on_conflict='first'/'last')",
                    f"{dst[n, layer].tolist()} vs {t.ids[n, layer].tolist()} at position "
                    f"{t.token_offset + n}, layer {layer}",
                )
            take = have_new & ~have_old if on_conflict != "last" else have_new
            dst[take] = t.ids[take]
        return cls(out, **meta, token_offset=start)


def _common_meta(traces: Sequence[RoutingTrace]) -> dict[str, Any]:
    """Metadata shared by ``traces`` (None = unknown is compatible with any value)."""
    for i, t in enumerate(traces):
        if not isinstance(t, RoutingTrace):
            fail(f"traces[{i}]", "a RoutingTrace", type(t).__name__, what="type")
    first = traces[0]
    out: dict[str, Any] = {"top_k": first.top_k}
    for i, t in enumerate(traces[1:], 1):
        if (t.num_layers, t.top_k) != (first.num_layers, first.top_k):
            fail(
                f"traces[{i}]",
                f"layers={first.num_layers}, top_k={first.top_k} like traces[0]",
                f"layers={t.num_layers}, top_k={t.top_k}",
            )
    for key in ("num_experts", "layer_ids", "model_id"):
        known = {getattr(t, key) for t in traces if getattr(t, key) is not None}
        if len(known) > 1:
            fail("traces", f"one {key} across traces", sorted(map(str, known)))
        out[key] = known.pop() if known else None
    return out


def _write_payload(f: Any, ids: np.ndarray, meta_bytes: np.ndarray, compress: bool) -> None:
    """Write the npz archive (a separate function so tests can make it fail midway).

    Same layout as ``numpy.savez[_compressed]`` (so ``numpy.load`` reads it), but deflate level 1:
    routing ids compress nearly as well and several times faster than at numpy's default level.
    """
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(f, "w", compression=mode, compresslevel=1 if compress else None) as zf:
        for name, arr in (("ids.npy", ids), ("meta.npy", meta_bytes)):
            with zf.open(name, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(arr), allow_pickle=False)


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
    except Exception as e:  # noqa: BLE001
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

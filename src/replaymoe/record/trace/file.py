"""The routing-trace file format, version 2: atomic ``.npz`` writes and checked reads.

This module's one job is the bytes on disk of
:meth:`RoutingTrace.save <replaymoe.record.trace.RoutingTrace.save>` and
:meth:`RoutingTrace.load <replaymoe.record.trace.RoutingTrace.load>` (which delegate here), plus
:class:`TraceFormatError`, the error every damaged or foreign payload raises (the wire decoders reuse it),
and :func:`read_input`, which every reader of a user's file (``replaymoe inspect``, ``check``, the demo's
``--from-vllm``, :func:`~replaymoe.record.engine_routes.load_routes`) reads it with: a regular file of at
most :data:`MAX_INPUT_BYTES`, checked before a byte is read.
It knows nothing of :class:`RoutingTrace` itself: the writer takes the ids and metadata, the reader
takes the class to build.

One file, a zip archive in numpy's ``.npz`` layout (readable with ``numpy.load``
without pickle), holding two members, or three with the weights:

``ids.npy``
    int16 little-endian [N, L, K], C order.
``weights.npy`` (version 2, only when the trace carries weights: full recall)
    float32 little-endian [N, L, K], C order; NaN in missing rows.
``meta.npy``
    uint8 [M]: a UTF-8 JSON object::

        {"format": "replaymoe-routing-trace", "version": 2,
         "shape": [N, L, K], "dtype": "int16",
         "num_experts": E or null, "top_k": K, "layer_ids": [..L ints..] or null,
         "model_id": str or null, "token_offset": int, "token_ids": [..N ints..] or null,
         "sha256": hex SHA-256 of the ids' raw bytes (int16 little-endian, C order),
         "weights_sha256": hex SHA-256 of the weights' raw bytes (float32 little-endian,
                           C order), or null without weights}

Version 1 (replaymoe before full recall) is version 2 without weights (no ``weights.npy``, no
``weights_sha256``); it is still read. Every file is written as version 2, with or without weights.

Writes are atomic: the archive is written to a temporary file in the target
directory, fsync'ed and renamed over the target, so a failing save leaves no file
and never clobbers an existing one. Loading checks the archive, the format name,
the version (newer versions are refused), the shape/dtype and the checksum; any
failure raises :class:`TraceFormatError` (a ``ValueError``) naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_INPUT_BYTES",
    "TraceFormatError",
    "check_input",
    "read_input",
    "read_trace",
    "write_trace",
]

FORMAT_NAME = "replaymoe-routing-trace"
FORMAT_VERSION = 2

T = TypeVar("T")

# what ``build`` raises for the ids themselves (replaymoe._validation.fail's words for the name "ids")
_IDS_ERROR = re.compile(r"Invalid \w+ of (ids|weights): ")


class TraceFormatError(ValueError):
    """A trace file (or wire payload) is truncated, corrupted, foreign or of an unsupported version.

    ``path`` is the offending file (``None`` for in-memory payloads); it also appears in the message.
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


MAX_INPUT_BYTES = 1 << 30  # read_input refuses larger files before reading (a trace of 128K tokens x 48
# layers x top-8 is ~100 MB; vLLM's base64 JSON of it ~135 MB)


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in a few words."""
    for test, words in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def _not_regular(path: str, mode: int, accepted: str) -> TraceFormatError:
    tail = f"; {accepted}" if accepted else ""
    return TraceFormatError(f"{path}: not a regular file ({_file_kind(mode)}){tail}", path)


def _too_big(path: str, size: str, reader: str) -> TraceFormatError:
    return TraceFormatError(
        f"{path}: {size} bytes, more than the {MAX_INPUT_BYTES >> 20} MiB {reader} reads "
        "(RoutingTrace.load reads a larger trace file from Python)",
        path,
    )


def check_input(path: str | os.PathLike, *, reader: str = "replaymoe", accepted: str = "") -> None:
    """Refuse an input file without opening it: not a regular file (``/dev/zero``, a directory, a pipe
    with no writer, which an ``open`` would wait on forever), or larger than :data:`MAX_INPUT_BYTES`.

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    reader : str
        Who reads it (``"replaymoe check"``), for the too-large message.
    accepted : str
        What the reader accepts, appended to the not-a-regular-file message.

    Raises
    ------
    OSError
        The file does not exist or cannot be examined (``FileNotFoundError``, ``PermissionError``).
    TraceFormatError
        Naming the file: not a regular file, or larger than :data:`MAX_INPUT_BYTES`.
    """
    path = os.fspath(path)
    st = os.stat(path)  # does not open the file
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode, accepted)
    if st.st_size > MAX_INPUT_BYTES:
        raise _too_big(path, str(st.st_size), reader)


def read_input(path: str | os.PathLike, *, reader: str = "replaymoe", accepted: str = "") -> bytes:
    """The bytes of an input file, after :func:`check_input` (so ``/dev/zero``, a pipe or a huge sparse
    file is refused before anything is read); the same parameters and errors, and ``OSError`` when the
    file cannot be read."""
    path = os.fspath(path)
    check_input(path, reader=reader, accepted=accepted)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # never blocks, even if swapped
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file opened, which may not be the one stat saw
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, accepted)
        data = f.read(MAX_INPUT_BYTES + 1)  # the file may have grown since stat
    if len(data) > MAX_INPUT_BYTES:
        raise _too_big(path, f"over {MAX_INPUT_BYTES}", reader)
    return data


def _sha256(ids: np.ndarray, dtype: str = "<i2") -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=dtype).tobytes()).hexdigest()


def write_trace(
    path: str | os.PathLike,
    ids: np.ndarray,
    meta: Mapping[str, Any],
    *,
    compress: bool,
    weights: np.ndarray | None = None,
) -> None:
    """Write ``ids`` [N, L, K], the trace's ``meta`` (constructor keywords) and its ``weights``
    (float32 [N, L, K], or None) to ``path`` atomically."""
    path = os.fspath(path)
    ids = np.ascontiguousarray(ids, dtype="<i2")
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype="<f4")
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "shape": list(ids.shape),
        "dtype": "int16",
        **meta,
        "sha256": _sha256(ids),
        "weights_sha256": None if weights is None else _sha256(weights, "<f4"),
    }
    meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    except OSError as e:  # named after the target, not the temporary file that was never made
        folder = os.path.dirname(path) or directory
        reason = f"the folder {folder} does not exist" if not os.path.exists(directory) else e.strerror
        raise OSError(e.errno, reason, path) from None  # (OSError picks the errno's subclass)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_payload(f, ids, meta_bytes, compress, **({} if weights is None else {"weights": weights}))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp):
            # a failed write (a full disk) carries no file name, or the temporary one: name the target
            raise OSError(e.errno, e.strerror, path) from e
        raise


def read_trace(path: str | os.PathLike, build: Callable[..., T]) -> T:
    """Read a file written by :func:`write_trace`; ``build(ids, **meta)`` makes the trace (see ``load``)."""
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
            weights = z["weights"] if "weights" in names else None
    except TraceFormatError:
        raise
    except Exception as e:  # any decoding failure means a damaged file
        raise bad(f"truncated or corrupted trace file ({type(e).__name__}: {e})") from e
    if ids.dtype != np.dtype("<i2") or list(ids.shape) != meta.get("shape"):
        raise bad(f"ids {ids.dtype} {list(ids.shape)} do not match the metadata {meta.get('shape')}")
    if _sha256(ids) != meta.get("sha256"):
        raise bad("checksum mismatch: the ids are corrupted")
    want_w = meta.get("weights_sha256") if version >= 2 else None
    if (weights is None) != (want_w is None):
        raise bad(
            "the weights member and the metadata's weights_sha256 disagree "
            f"({'no' if weights is None else 'a'} weights member, weights_sha256 {want_w!r})"
        )
    if weights is not None:
        if weights.dtype != np.dtype("<f4") or weights.shape != ids.shape:
            raise bad(
                f"weights {weights.dtype} {list(weights.shape)} do not match the ids' {list(ids.shape)}"
            )
        if _sha256(weights, "<f4") != want_w:
            raise bad("checksum mismatch: the weights are corrupted")
    try:
        return build(
            ids,
            num_experts=meta["num_experts"],
            top_k=meta["top_k"],
            layer_ids=meta["layer_ids"],
            model_id=meta["model_id"],
            token_offset=meta["token_offset"],
            **({"token_ids": meta["token_ids"]} if meta.get("token_ids") is not None else {}),
            **({"weights": weights} if weights is not None else {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ValueError) and _IDS_ERROR.match(str(e)):
            # the stored ids or weights themselves (an id out of range, a duplicate in a row, a
            # non-finite weight): the constructor's words, which name the bad row, not "invalid metadata"
            raise bad(str(e)) from e
        raise bad(f"invalid metadata ({type(e).__name__}: {e})") from e


def _write_payload(
    f: Any, ids: np.ndarray, meta_bytes: np.ndarray, compress: bool, weights: np.ndarray | None = None
) -> None:
    """Write the npz archive (a separate function so tests can make it fail midway).

    Same layout as ``numpy.savez[_compressed]`` (so ``numpy.load`` reads it), but deflate level 1:
    routing ids compress nearly as well and several times faster than at numpy's default level.
    """
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(f, "w", compression=mode, compresslevel=1 if compress else None) as zf:
        members = [("ids.npy", ids)] + ([("weights.npy", weights)] if weights is not None else [])
        for name, arr in (*members, ("meta.npy", meta_bytes)):
            with zf.open(name, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(arr), allow_pickle=False)

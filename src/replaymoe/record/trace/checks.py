"""The checks of a :class:`~replaymoe.record.trace.RoutingTrace`'s constructor arguments.

This module's one job is turning what a caller passes (numpy arrays, torch tensors, nested lists) into
the arrays a trace keeps, or a ``ValueError`` naming the argument and, for ids, the first bad row
(``Invalid value of ids: ...``, words :mod:`~replaymoe.record.trace.file` recognises in a damaged
file). It knows nothing of :class:`RoutingTrace` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..._validation import check_int, fail

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "as_int_array",
    "check_ids",
    "check_layer_ids",
    "check_token_ids",
    "check_weights",
    "as_int",
    "int_tuple",
    "is_int",
]


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool (a float, a str or a bool is never taken as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value``, a Python or numpy int (not a bool) in ``[low, high]``, as a Python int; a ValueError
    naming ``name`` otherwise (:func:`replaymoe._validation.check_int`'s words)."""
    return check_int(name, int(value) if is_int(value) else value, low=low, high=high)


def int_tuple(name: str, value: Any) -> tuple[int, ...]:
    """``value``, a sequence of ints (Python or numpy, not bools), as a tuple; a ValueError naming
    ``name`` for anything else (a str such as ``"12"``, floats such as ``[1.7, 2.2]``, ``[True, 2]``)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        fail(name, "a sequence of ints", repr(value), what="type")
    vals = list(value.tolist() if hasattr(value, "tolist") else value)  # numpy/torch: Python numbers
    bad = next((v for v in vals if not is_int(v)), None)
    if bad is not None:
        fail(name, "a sequence of ints", f"{bad!r} ({type(bad).__name__}) in {vals!r}", what="type")
    return tuple(int(v) for v in vals)


def _as_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a numpy array (a torch tensor is detached and copied to the host, bf16 as float32);
    a ValueError naming ``name`` for a ragged nested list."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype == torch.bfloat16:  # numpy has no bfloat16
                value = value.float()
            value = value.numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if isinstance(value, (str, bytes)):
        fail(name, "an array or a (nested) list of numbers", f"the {type(value).__name__} {value!r}",
             what="type")  # fmt: skip
    try:
        return np.asarray(value)
    except ValueError:  # numpy: "setting an array element with a sequence" / inhomogeneous shape
        fail(name, "a rectangular array (every nested list of one length)", "a ragged nested list",
             what="shape")  # fmt: skip


def as_int_array(name: str, ids: Any) -> np.ndarray:
    """Return ``ids`` as a numpy integer array (torch tensors and nested lists accepted)."""
    arr = _as_array(name, ids)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0 and arr.dtype == np.float64:  # an empty list
            arr = arr.astype(np.int64)
        else:
            fail(name, "an integer array", f"dtype {arr.dtype}", what="dtype")
    return arr


def check_ids(ids: np.ndarray, num_experts: int | None, name: str = "ids") -> np.ndarray:
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
            _fail_row(name, "each [top_k] row all -1 (missing) or all valid ids", out, mixed)
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
                _fail_row(name, "distinct expert ids in a row", out, dup)
    return out


def _fail_row(name: str, expected: str, ids: np.ndarray, bad: npt.ArrayLike) -> NoReturn:
    """ValueError naming the first [token, layer] row of ``ids`` where ``bad`` [N, L] holds."""
    t, layer = np.argwhere(bad)[0].tolist()
    fail(name, expected, f"row {ids[t, layer].tolist()} at token {t}, layer {layer}")


def check_layer_ids(layer_ids: Any, num_layers: int) -> tuple[int, ...] | None:
    """``layer_ids`` as a tuple of ``num_layers`` distinct non-negative ints (None stays None)."""
    if layer_ids is None:
        return None
    vals = int_tuple("layer_ids", layer_ids)
    if len(vals) != num_layers:
        fail("layer_ids", f"{num_layers} entries (one per MoE layer of ids)", f"{len(vals)} entries")
    if any(v < 0 for v in vals) or len(set(vals)) != len(vals):
        fail("layer_ids", "distinct non-negative model layer numbers", list(vals))
    return vals


def check_token_ids(token_ids: Any, num_tokens: int) -> np.ndarray:
    """``token_ids`` as C-contiguous int64 [num_tokens], each >= -1 (-1 = unknown)."""
    given = as_int_array("token_ids", token_ids)
    if given.size and int(given.max()) > np.iinfo(np.int64).max:
        fail("token_ids", "token ids below 2**63", int(given.max()))
    tok = np.ascontiguousarray(given, dtype=np.int64)
    if tok.shape != (num_tokens,):
        fail(
            "token_ids",
            f"shape ({num_tokens},) (one per position)",
            f"shape {tok.shape}",
            what="shape",
        )
    if tok.size and int(tok.min()) < -1:
        fail("token_ids", "token ids >= 0 (-1 = unknown)", int(tok.min()))
    return tok


def check_weights(weights: Any, ids: np.ndarray) -> np.ndarray:
    """``weights`` (the combine weights of full recall) as C-contiguous float32 [N, L, K], the shape of
    ``ids``: finite in every recorded row; NaN in every missing row (-1 ids), whatever was given
    there (the invariant the trace keeps)."""
    arr = _as_array("weights", weights)
    if not np.issubdtype(arr.dtype, np.floating):
        fail("weights", "a float32 array", f"dtype {arr.dtype}", what="dtype")
    if arr.shape != ids.shape:
        fail("weights", f"shape {ids.shape} (the ids')", f"shape {arr.shape}", what="shape")
    out = np.array(arr, dtype=np.float32, order="C", copy=True)
    missing = ids[..., 0] < 0
    out[missing] = np.nan
    bad = ~np.isfinite(out).all(-1) & ~missing
    if bad.any():
        n, layer = np.argwhere(bad)[0].tolist()
        fail(
            "weights",
            "finite weights in every recorded row",
            f"non-finite weights {out[n, layer].tolist()} at [token, layer] = [{n}, {layer}]",
        )
    return out

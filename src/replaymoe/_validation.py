"""Boundary checks for the public API.

Every public entry point validates its arguments with the helpers here, so that a
user's mistake surfaces as one ``ValueError`` that names the argument, what was
expected and what was got::

    ValueError: Invalid dtype of router_logits: expected one of (float32, bfloat16, float16), got int32

Internal invariants use ``assert``; kernels use ``tl.static_assert``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn, TypeGuard

import torch

__all__ = ["fail", "check_tensor", "check_int", "check_choice", "is_capturing", "tensor_ok"]


def fail(name: str, expected: object, got: object, *, what: str = "value") -> NoReturn:
    """Raise ``ValueError("Invalid {what} of {name}: expected {expected}, got {got}")``."""
    raise ValueError(f"Invalid {what} of {name}: expected {expected}, got {got}")


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else "one of (" + ", ".join(names) + ")"


def check_tensor(
    name: str,
    x: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check a tensor argument and return it.

    Parameters
    ----------
    name : str
        Argument name used in the error message.
    x : object
        The value to check; must be a ``torch.Tensor``.
    ndim : int, optional
        Required number of dimensions.
    shape : sequence of int or None, optional
        Required shape; ``None`` entries match any size. Implies ``ndim``.
    dtype : torch.dtype or sequence of torch.dtype, optional
        Allowed dtype(s).
    device : torch.device or str, optional
        Required device (compared by type and index, so ``cuda`` matches ``cuda:0``
        only when the index is unspecified).
    contiguous : bool
        Require ``x.is_contiguous()``.
    """
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__, what="type")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and x.dim() != ndim:
        fail(name, f"a {ndim}-D tensor", f"{x.dim()}-D with shape {tuple(x.shape)}", what="shape")
    if shape is not None:
        for want, got in zip(shape, x.shape):
            if want is not None and want != got:
                exp = tuple("*" if s is None else s for s in shape)
                fail(name, exp, tuple(x.shape), what="shape")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if x.dtype not in allowed:
            fail(name, _fmt_dtypes(allowed), str(x.dtype).replace("torch.", ""), what="dtype")
    if device is not None:
        want = torch.device(device)
        same = x.device.type == want.type and (want.index is None or x.device.index == want.index)
        if not same:
            fail(name, f"a tensor on {want}", f"a tensor on {x.device}", what="device")
    if contiguous and not x.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {tuple(x.stride())}", what="layout")
    return x


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """Check an integer argument lies in ``[low, high]`` (inclusive) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, "an int", type(value).__name__, what="type")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        fail(name, f"an int in [{lo}, {hi}]", value)
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` itself when it is a bool; a ValueError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        fail(name, "a bool", type(value).__name__, what="type")
    return value


def check_choice(name: str, value: object, choices: Iterable[object]) -> object:
    """Check ``value`` is one of ``choices`` and return it."""
    choices = tuple(choices)
    if value not in choices:
        fail(name, "one of " + ", ".join(repr(c) for c in choices), repr(value))
    return value


def is_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream.

    Validation that needs a host synchronization (reading device values) is
    skipped then, because a sync would invalidate the capture.
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tensor_ok(
    t: object, ndim: int, dtypes: tuple, device: torch.device | None, contiguous: bool
) -> TypeGuard[torch.Tensor]:
    """Cheap predicate for the common valid case (:func:`check_tensor` then explains a failure)."""
    return (
        isinstance(t, torch.Tensor)
        and t.dim() == ndim
        and t.dtype in dtypes
        and (device is None or t.device == device)
        and (not contiguous or t.is_contiguous())
    )

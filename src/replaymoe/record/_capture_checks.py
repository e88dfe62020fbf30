"""The argument checks of :class:`~replaymoe.record.capture.RoutedExpertsCapturer`.

Each check raises one ``ValueError`` naming the argument, what was expected and what was got
(:func:`replaymoe._validation.fail`'s words); the capturer calls them at its public boundary, before
it changes any state or, for the checks of ``end_step``'s bookkeeping, inside its rollback. The
``fail_*`` helpers only build the message of a check that already failed, so the per-step path pays
nothing for them.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Set
from typing import Any, NoReturn

import numpy as np
import torch

from .._validation import check_bool, check_int, fail
from .trace.checks import as_int, check_layer_ids

__all__ = [
    "CaptureMemoryError",
    "check_capturer_args",
    "max_positions",
    "check_requests",
    "check_dp_span",
    "check_hashable",
    "check_distinct_rows",
    "fail_position",
    "page_table_memory_message",
    "check_table_growth",
    "step_positions",
    "ENTRY_BYTES",
    "invalid_routing",
]


class CaptureMemoryError(MemoryError):
    """The capturer's host storage would exceed ``max_host_bytes`` (exported by
    :mod:`replaymoe.record.capture`)."""


ENTRY_BYTES = 8  # one entry of a request's page table (a Python list slot)


def check_capturer_args(
    *,
    num_layers: Any,
    max_num_tokens: Any,
    top_k: Any,
    layer_ids: Any,
    num_experts: Any,
    model_id: Any,
    max_host_bytes: Any,
    page_size: Any,
    num_buffers: Any,
    slab_pages: Any,
    clear_after_copy: Any,
) -> tuple[int | None, tuple[int, ...] | None]:
    """Check the capturer's constructor arguments as :class:`~replaymoe.record.trace.RoutingTrace`
    checks the ones it stores on its traces, so that ``finish`` never fails on them.

    Returns
    -------
    num_experts : int or None
        As a Python int (numpy ints are taken, as the trace takes them).
    layer_ids : tuple of int or None
        ``num_layers`` distinct non-negative ints (never a float, a str or a bool converted).
    """
    check_int("num_layers", num_layers, low=1)
    check_int("max_num_tokens", max_num_tokens, low=1)
    if num_experts is not None:  # before top_k, which it bounds
        num_experts = as_int("num_experts", num_experts, low=1, high=np.iinfo(np.int16).max + 1)
    check_int("top_k", top_k, low=1, high=num_experts)
    layer_ids = check_layer_ids(layer_ids, num_layers)
    if model_id is not None and not isinstance(model_id, str):
        fail("model_id", "a str or None", type(model_id).__name__, what="type")
    if max_host_bytes is not None:
        check_int("max_host_bytes", max_host_bytes, low=0)
    check_int("page_size", page_size, low=1)
    check_int("num_buffers", num_buffers, low=1)
    check_int("slab_pages", slab_pages, low=1)
    check_bool("clear_after_copy", clear_after_copy)
    staging = num_buffers * max_num_tokens * num_layers * top_k * 2  # the int16 staging buffers' bytes
    if max_host_bytes is not None and staging > max_host_bytes:  # before anything is allocated
        raise CaptureMemoryError(
            f"max_host_bytes={max_host_bytes} is below the {staging} bytes of staging "
            f"buffers ({num_buffers} x [{max_num_tokens}, {num_layers}, {top_k}] int16)"
        )
    return num_experts, layer_ids


def step_positions(
    token_requests: Any, token_positions: Any, dp_span: Any, max_num_tokens: int
) -> tuple[int, np.ndarray, int, int]:
    """``end_step``'s arguments checked: ``(n entries, positions int [n], first buffer row, rows)``."""
    n = check_requests(token_requests)
    if isinstance(token_positions, torch.Tensor):
        if token_positions.device.type != "cpu":
            fail("token_positions", "a host sequence (list, numpy array or CPU tensor)", "a device tensor")
        token_positions = token_positions.numpy()
    pos = np.asarray(token_positions)
    if pos.ndim != 1 or len(pos) != n:
        fail("token_positions", f"{n} positions (one per entry of token_requests)", f"shape {pos.shape}")
    if n and not np.issubdtype(pos.dtype, np.integer):
        fail("token_positions", "integer positions", f"dtype {pos.dtype}", what="dtype")
    start, T = (0, n) if dp_span is None else check_dp_span(dp_span, n)
    if start + T > max_num_tokens:
        fail("end_step", f"at most max_num_tokens={max_num_tokens} rows", f"rows up to {start + T}")
    return n, pos, start, T


def max_positions(page_size: int, row_bytes: int) -> int:
    """The most positions one request can have (its longest trace).

    ``finish`` returns an [n, L, K] int16 array of ``n * row_bytes`` bytes, and numpy addresses at most
    ``sys.maxsize`` bytes; the request's page table is a list of one 8-byte entry per page of
    ``page_size`` positions, and a list holds at most ``sys.maxsize // 8`` entries. (Below this, a page
    table the host cannot allocate is a ``CaptureMemoryError`` naming the position.)
    """
    return min(sys.maxsize // row_bytes, page_size * (sys.maxsize // ENTRY_BYTES))


def check_requests(token_requests: Any) -> int:
    """``len(token_requests)``, or a ValueError naming it when it is not a sequence of request ids."""
    if isinstance(token_requests, torch.Tensor):  # its elements are 0-d tensors, hashed by identity
        fail(
            "token_requests",
            "a sequence of request ids (a tensor's .tolist())",
            "a torch.Tensor",
            what="type",
        )
    if isinstance(token_requests, (str, bytes, Set)) or not hasattr(token_requests, "__len__"):
        got = f"the {type(token_requests).__name__} {token_requests!r}"
        fail("token_requests", "a sequence of request ids, None for rows to ignore", got, what="type")
    return len(token_requests)


def check_dp_span(dp_span: Any, n: int) -> tuple[int, int]:
    """``(start, length)`` from ``dp_span``, whose length must be ``n`` (the number of entries)."""
    if isinstance(dp_span, (str, bytes)) or not hasattr(dp_span, "__len__") or len(dp_span) != 2:
        fail("dp_span", "(start, length)", repr(dp_span))
    start = check_int("dp_span[0]", dp_span[0], low=0)
    length = check_int("dp_span[1]", dp_span[1], low=0)
    if length != n:
        fail("dp_span", f"length == len(token_requests) == {n}", length)
    return start, length


def check_hashable(name: str, request_id: object) -> Hashable:
    """``request_id`` itself when it can key a dict; a ValueError naming ``name`` otherwise."""
    try:
        hash(request_id)
    except TypeError:
        got = f"the unhashable {type(request_id).__name__} {request_id!r}"
        fail(name, "a hashable request id", got, what="type")
    return request_id


def fail_position(p: int, i: int, limit: int) -> NoReturn:
    """The error for position ``p`` (entry ``i``) outside ``[0, limit)`` (:func:`max_positions`)."""
    if p < 0:
        fail("token_positions", "non-negative positions for tokens of a request", f"{p} at index {i}")
    fail(
        "token_positions",
        f"positions in [0, {limit - 1}] for tokens of a request (the longest trace the host can address)",
        f"{p} at index {i}",
    )


def check_distinct_rows(dst: np.ndarray, src: np.ndarray, token_requests: Any, positions: list) -> None:
    """A ValueError naming ``token_positions`` when two entries of one step claim one (request, position).

    ``dst[j]`` is the pool row of entry ``src[j]``; pages are never shared between requests, so equal pool
    rows are one request's one position. One sort of the step's rows; the indices only on failure.
    """
    if len(dst) < 2:
        return
    srt = np.sort(dst)
    if not (srt[1:] == srt[:-1]).any():
        return
    order = np.argsort(dst, kind="stable")
    k = int(np.argmax(dst[order[1:]] == dst[order[:-1]]))
    a, b = int(src[order[k]]), int(src[order[k + 1]])
    req = list(token_requests)[a]
    fail(
        "token_positions",
        "one entry per (request, position) in a step (nothing of the step was recorded)",
        f"request {req!r} at position {positions[a]} at indices {a} and {b}",
    )


def page_table_memory_message(p: int, i: int, req: object, page_size: int) -> str:
    """The message of the CaptureMemoryError for a page table the host could not allocate."""
    return (
        f"RoutedExpertsCapturer: no host memory for the page table of request {req!r} up to position {p} "
        f"(index {i} of token_positions): {p // page_size + 1} entries of {ENTRY_BYTES} bytes. "
        f"Nothing of this step was recorded."
    )


def check_table_growth(held: int, grow: int, limit: int, req: object, p: int, i: int) -> None:
    """Raise ``CaptureMemoryError`` when ``grow`` more page-table entries (request ``req`` up to position
    ``p``, entry ``i`` of the step) would take the capturer's host memory (``held`` bytes) past ``limit``
    (``max_host_bytes``)."""
    need = held + grow * ENTRY_BYTES
    if need <= limit:
        return
    raise CaptureMemoryError(
        f"RoutedExpertsCapturer: recording position {p} of request {req!r} (index {i} of token_positions) "
        f"needs {grow} more page-table entries of {ENTRY_BYTES} bytes, which would take host memory to "
        f"{need} bytes, over max_host_bytes={limit}. A position this far is past any real context: check "
        f"token_positions, or raise max_host_bytes. Nothing of this step was recorded."
    )


def invalid_routing(request_id: object, err: ValueError) -> ValueError:
    """The error of a ``finish`` whose recorded ids do not make a valid trace (out-of-range ids, say)."""
    return ValueError(
        f"Invalid routing recorded for request {request_id!r} (token = position in the request, "
        f"layer = MoE layer index; the request is kept: abort() drops it): {err}"
    )

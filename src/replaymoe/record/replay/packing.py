"""The host side of :meth:`ReplayTable.load <replaymoe.record.replay.ReplayTable.load>`: traces packed
into the table's rows, their per-trace offsets, and the sorted content index.

Each function returns numpy arrays that the table copies to its device buffers as they are; none
touches the device. Buffer sizes come from :func:`capacity` (a power of two, at least 64), so that new
traces of a similar size reuse the device buffers (same shapes, same addresses: no recompile, no
CUDA-graph re-record).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..trace import RoutingTrace
from .hashes import traces_hashes

__all__ = ["capacity", "content_index", "pack_ids", "pack_tokens", "pack_weights", "row_meta"]


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1); replay needs no Triton to import."""
    return 1 << max(int(n) - 1, 0).bit_length()


def capacity(n: int) -> int:
    """Rows of a buffer holding ``n`` entries and one more: a power of two, at least 64."""
    return max(_next_power_of_2(n + 1), 64)


def pack_ids(traces: Sequence[RoutingTrace], layer_of: Sequence[int]) -> np.ndarray:
    """int32 [L, R_cap, K]: model MoE layer ``l``'s ids (trace layer ``layer_of[l]``), the traces'
    positions back to back, then all -1 rows (``R_cap``: :func:`capacity` of the positions)."""
    L, K = len(layer_of), traces[0].top_k
    rows = capacity(sum(t.num_tokens for t in traces))
    host = np.full((L, rows, K), -1, dtype=np.int32)
    ids = np.concatenate([t.ids for t in traces])  # [positions, L_trace, K], one copy
    host[:, : ids.shape[0]] = ids[:, list(layer_of)].transpose(1, 0, 2)
    return host


def pack_weights(traces: Sequence[RoutingTrace], layer_of: Sequence[int]) -> np.ndarray:
    """float32 [L, R_cap, K]: :func:`pack_ids`'s rows, holding the traces' weights (NaN in the rows of
    no recorded route). Every trace carries weights (the caller checked)."""
    L, K = len(layer_of), traces[0].top_k
    rows = capacity(sum(t.num_tokens for t in traces))
    host = np.full((L, rows, K), np.nan, dtype=np.float32)
    assert all(t.weights is not None for t in traces)
    weights = np.concatenate([t.weights for t in traces])
    host[:, : weights.shape[0]] = weights[:, list(layer_of)].transpose(1, 0, 2)
    return host


def pack_tokens(traces: Sequence[RoutingTrace]) -> np.ndarray:
    """int64 [R_cap]: the token each trace recorded at each of :func:`pack_ids`'s rows (-1 where the
    trace carries no tokens, where its token is unknown, and in the all -1 rows)."""
    host = np.full(capacity(sum(t.num_tokens for t in traces)), -1, dtype=np.int64)
    base = 0
    for t in traces:
        if t.token_ids is not None:
            host[base : base + t.num_tokens] = t.token_ids
        base += t.num_tokens
    return host


def row_meta(traces: Sequence[RoutingTrace]) -> np.ndarray:
    """int64 [5, B]: per trace, ``offsets`` (``token_offset``), ``lengths`` (positions), ``bases`` (first
    table row of :func:`pack_ids`), ``ends`` (``offsets + lengths``) and ``shift`` (``bases - offsets``)."""
    counts = [t.num_tokens for t in traces]
    bases = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    offsets = np.array([t.token_offset for t in traces], dtype=np.int64)
    lengths = np.array(counts, dtype=np.int64)
    return np.stack([offsets, lengths, bases, offsets + lengths, bases - offsets])


def content_index(
    traces: Sequence[RoutingTrace], bases: np.ndarray, last_row: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted prefix hashes of every recorded position (one host pass), and the table row of each,
    for content matching: int64 [H_cap] each (:func:`capacity` of the hashes), padded with a sentinel
    hash above any hash and ``last_row`` (the table's all -1 row). Of equal hashes (the same prefix in
    several traces: a group's shared prompt) the earliest trace's row comes first, and is the one
    replayed. ``bases``: each trace's first table row (:func:`row_meta`)."""
    hashes = traces_hashes(traces)
    counts = np.array([t.num_tokens for t in traces], dtype=np.int64)
    start = np.repeat(np.cumsum(counts) - counts, counts)  # each position's trace's first position
    rows = (
        np.repeat(np.asarray(bases, dtype=np.int64)[: len(traces)], counts) + np.arange(len(hashes)) - start
    )
    keep = hashes >= 0
    hashes, rows = hashes[keep], rows[keep].astype(np.int64)
    order = np.lexsort((rows, hashes))
    cap = capacity(len(hashes))
    sorted_h = np.full(cap, np.iinfo(np.int64).max, dtype=np.int64)  # sentinel: above any hash
    sorted_r = np.full(cap, last_row, dtype=np.int64)  # (the all -1 last row)
    sorted_h[: len(hashes)], sorted_r[: len(hashes)] = hashes[order], rows[order]
    return sorted_h, sorted_r

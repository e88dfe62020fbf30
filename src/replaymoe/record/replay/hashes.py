"""Content matching: each token's prefix hash, on the device and on the host.

A causal model routes a token by the tokens before it, so a replayed forward can find a token's
recorded row by the hash of its prefix (positions 0..p of its sequence), whatever row of the batch it
sits in: :func:`prefix_hashes` hashes a forward's tokens (device ops only), :func:`prefix_hashes_np` a
trace's (:func:`trace_hashes` keeps them on the trace), and :class:`~replaymoe.record.replay.ReplayTable`
looks the first up among the second (:mod:`~replaymoe.record.replay.packing` sorts them).

Two polynomial hashes modulo primes below 2^31, of the tokens at positions 0..p, combined into 62 bits.
Every step stays below 2^63 in int64 (a product of two values below 2^31; a cumulative sum of fewer than
2^32 terms below 2^31), so the device (torch) and the host (numpy) compute the same integers exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..trace import RoutingTrace

__all__ = [
    "hash_powers",
    "prefix_hashes",
    "prefix_hashes_concat",
    "prefix_hashes_np",
    "trace_hashes",
    "traces_hashes",
]

_PRIMES = (2147483647, 2147483629)
_BASES = (1000003, 917513)
_HASHES_KEY = "_replaymoe_prefix_hashes"  # where trace_hashes keeps a trace's hashes (its __dict__)


_powers = np.ones((2, 1), dtype=np.int64)  # the longest table made so far (prefixes of it are the rest)


def hash_powers(n: int) -> np.ndarray:
    """int64 [2, max(n, 1)]: ``base^i mod prime`` for each hash, i < n (a read-only view of a table kept
    for the process, grown to the next power of two when a longer one is asked for)."""
    global _powers
    if n > _powers.shape[1]:
        _powers = _make_powers(1 << (n - 1).bit_length())
        _powers.flags.writeable = False
    return _powers[:, : max(n, 1)]


def _make_powers(n: int) -> np.ndarray:
    out = np.ones((2, max(n, 1)), dtype=np.int64)
    for h, (p, a) in enumerate(zip(_PRIMES, _BASES)):
        k, step = 1, a % p
        while k < n:  # out[k:2k] = out[:k] * a^k
            m = min(k, n - k)
            out[h, k : k + m] = out[h, :m] * step % p
            step = step * step % p
            k += m
    return out


def prefix_hashes_np(tokens: np.ndarray) -> np.ndarray:
    """int64 [N]: hash of ``tokens[:p + 1]`` for each p (``tokens`` int [N] at positions 0..N-1);
    -1 from the first unknown (-1) token on. Equal to :func:`prefix_hashes` on the same tokens."""
    tok = np.asarray(tokens, dtype=np.int64)
    n = tok.shape[0]
    pw = hash_powers(n)[:, :n]
    parts = [np.cumsum((tok + 1) % p * pw[h] % p) % p for h, p in enumerate(_PRIMES)]
    out = parts[0] * (1 << 31) + parts[1]
    unknown = np.cumsum(tok < 0) > 0
    return np.where(unknown, -1, out)


def prefix_hashes_concat(tokens: Sequence[np.ndarray]) -> np.ndarray:
    """:func:`prefix_hashes_np` of each array of ``tokens``, concatenated, in one pass over all of them
    (int64 [sum of lengths]): each array's cumulative sums are the running sums over the concatenation
    less the sum before its start, exact in int64 below 2^32 tokens in all."""
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    tok = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    start = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each token's array start
    pos = np.arange(total, dtype=np.int64) - start
    pw = hash_powers(int(lengths.max()))

    def since_start(x: np.ndarray) -> np.ndarray:  # per array, the running sum of x from its start
        c = np.cumsum(x)
        return c - np.where(start > 0, c[start - 1], 0)

    parts = [since_start((tok + 1) % p * pw[h][pos] % p) % p for h, p in enumerate(_PRIMES)]
    return np.where(since_start(tok < 0) > 0, -1, parts[0] * (1 << 31) + parts[1])


def trace_hashes(trace: RoutingTrace) -> np.ndarray:
    """:func:`prefix_hashes_np` of ``trace.token_ids``, computed once per trace (kept in the trace's
    ``__dict__``, with the token array it was computed from). Only traces that carry their tokens
    come here (:attr:`ReplayTable.by_content <replaymoe.record.replay.ReplayTable.by_content>`)."""
    tokens = trace.token_ids
    assert tokens is not None, "content matching hashes traces that carry their tokens"
    cached = trace.__dict__.get(_HASHES_KEY)
    if cached is not None and cached[0] is tokens:
        return cached[1]
    hashes = prefix_hashes_np(tokens)
    trace.__dict__[_HASHES_KEY] = (tokens, hashes)
    return hashes


def traces_hashes(traces: Sequence[RoutingTrace]) -> np.ndarray:
    """:func:`trace_hashes` of every trace, concatenated; the traces not hashed yet are hashed together
    (:func:`prefix_hashes_concat`: one pass for a rollout round's traces, not one per trace)."""
    fresh = [t for t in traces if (c := t.__dict__.get(_HASHES_KEY)) is None or c[0] is not t.token_ids]
    if fresh:
        tokens: list[np.ndarray] = []
        for t in fresh:
            assert t.token_ids is not None, "content matching hashes traces that carry their tokens"
            tokens.append(t.token_ids)
        split = np.cumsum([len(x) for x in tokens])[:-1]
        for t, x, h in zip(fresh, tokens, np.split(prefix_hashes_concat(tokens), split)):
            t.__dict__[_HASHES_KEY] = (x, h)
    return np.concatenate([trace_hashes(t) for t in traces]) if traces else np.zeros(0, dtype=np.int64)


def prefix_hashes(tokens: torch.Tensor, positions: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: per token, the hash of its sequence's tokens at positions 0..p (the prefix the
    model saw when it routed it); -1 for padding (``positions < 0``) and positions past
    ``powers``' length. ``tokens``, ``positions``: int64 [B, S] with each row's positions increasing
    (left or right padding); ``powers``: int64 [2, P] from :func:`hash_powers`. Device ops only."""
    P = powers.shape[1]
    valid = (positions >= 0) & (positions < P)
    pos = positions.clamp(0, P - 1)
    parts = []
    for h, p in enumerate(_PRIMES):
        term = torch.where(valid, (tokens + 1) % p * powers[h][pos] % p, 0)
        parts.append(torch.cumsum(term, dim=1) % p)
    return torch.where(valid, parts[0] * (1 << 31) + parts[1], -1)

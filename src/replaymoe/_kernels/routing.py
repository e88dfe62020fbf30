"""Triton kernel of :func:`replaymoe.route`: selection, weights, capture and replay in one launch.

Each program handles ``BLOCK_T`` tokens x all experts. The experts sit in a padded
``[NGP, GSP]`` grid (groups x experts per group, both powers of two; one group when the
method is not grouped) flattened to ``EP = NGP * GSP`` columns; column ``g * GSP + j``
holds expert ``g * GS + j``.

Selection works on exact int64 keys ``(sortable_int32(score) << 16) | (65535 - expert)``:
the largest key is the largest score, ties going to the smaller expert; NaN scores were
replaced by -inf beforehand and padding columns hold ``_SENTINEL`` (below every key), so
ids are always distinct and in range. The top-k is a bitonic top-k (``tl.topk``) or K
rounds of max + mask (``ALGO``), both exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Method numbers (RoutingMethod); kept literal so this module holds only Triton code.
_DEFAULT = tl.constexpr(0)
_RENORMALIZE = tl.constexpr(1)
_DEEPSEEK_V3 = tl.constexpr(2)
_LLAMA4 = tl.constexpr(3)
_RENORMALIZE_NAIVE = tl.constexpr(4)
_TOPK = tl.constexpr(5)
_SIGMOID_RENORM = tl.constexpr(6)
_MINIMAX2 = tl.constexpr(7)
_SIGMOID = tl.constexpr(8)
_TOPK_SIGMOID = tl.constexpr(9)

_SENTINEL = tl.constexpr(-4611686018427387904)  # -2**62, below every int64 key (>= -2**47)
_SENTINEL32 = tl.constexpr(-2147483648)  # below every int32 key (-inf packs above it)


@triton.jit
def _pack(score, expert, KEY32: tl.constexpr):
    """Key ordering by (score, -expert); score fp32 without NaN, -0.0 canonicalised.

    KEY32: int32 key for scores that are exactly 16-bit floats (their fp32 form has 13 zero
    low bits, which carry ``8191 - expert``); else int64 ``(ordered << 16) | (65535 - expert)``.
    """
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    if KEY32:
        return (ordered & -8192) | (8191 - expert)
    else:
        return (ordered.to(tl.int64) << 16) | (65535 - expert).to(tl.int64)


@triton.jit
def _unpack_score(key):
    """Score of an int64 key."""
    ordered = (key >> 16).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unpack_expert(key, KEY32: tl.constexpr):
    if KEY32:
        return 8191 - (key & 8191)
    else:
        return 65535 - (key & 65535).to(tl.int32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _select(
    x,  # fp32 [BLOCK_T, EP] logits (padding: anything)
    bias,  # fp32 [EP] (zeros when absent)
    valid,  # bool [1, EP] real expert columns
    expert,  # int32 [1, EP] expert id of each column
    METHOD: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    NG: tl.constexpr,
    GS: tl.constexpr,
    NGP: tl.constexpr,
    GSP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ALGO: tl.constexpr,
    KEY32: tl.constexpr,
):
    """int32 [BLOCK_T, KP] selected experts, columns in descending key order."""
    EP: tl.constexpr = NGP * GSP
    if METHOD == _DEEPSEEK_V3 or METHOD == _MINIMAX2:
        b = _sigmoid(x) + bias[None, :]
    else:
        b = x
    b = tl.where(b != b, float("-inf"), b)  # NaN -> -inf
    b = tl.where(b == 0.0, 0.0, b)  # -0.0 -> +0.0 (they compare equal)
    if KEY32:
        SENT: tl.constexpr = _SENTINEL32
    else:
        SENT: tl.constexpr = _SENTINEL
    key = tl.where(valid, _pack(b, expert, KEY32), SENT)

    if METHOD == _DEEPSEEK_V3 and NG > 1:
        k3 = tl.reshape(key, [BLOCK_T, NGP, GSP])
        k1 = tl.max(k3, axis=2)
        if GS >= 2:
            k2 = tl.max(tl.where(k3 == k1[:, :, None], _SENTINEL, k3), axis=2)
            gscore = _unpack_score(k1) + _unpack_score(k2)
        else:
            gscore = _unpack_score(k1)
        gscore = tl.where(gscore != gscore, float("-inf"), gscore)
        gscore = tl.where(gscore == 0.0, 0.0, gscore)
        gid = tl.arange(0, NGP)[None, :]
        gvalid = gid < NG
        gkey = tl.where(gvalid, _pack(gscore, gid, False), _SENTINEL)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=1)
            gkey = tl.where(gkey == best[:, None], _SENTINEL, gkey)
        kept = (gkey == _SENTINEL) & gvalid  # the groups taken above
        masked = _pack(tl.full([1, EP], float("-inf"), tl.float32), expert, False)
        key = tl.where(
            tl.reshape(tl.broadcast_to(kept[:, :, None], [BLOCK_T, NGP, GSP]), [BLOCK_T, EP]),
            key,
            tl.where(valid, masked, _SENTINEL),
        )

    cols = tl.arange(0, KP)[None, :]
    if ALGO == 0:
        if KP == 1:
            top = tl.max(key, axis=1)[:, None]
        else:
            top = tl.topk(key, KP, dim=1)
        ids = _unpack_expert(top, KEY32)
    else:
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(key, axis=1)
            key = tl.where(key == best[:, None], SENT, key)
            ids = tl.where(cols == j, _unpack_expert(best, KEY32)[:, None], ids)
    return ids


@triton.jit(do_not_specialize=["T"])
def route_kernel(
    logits_ptr,  # [T, E] fp32/bf16/fp16, unit stride along experts
    stride_lt,  # row stride of the logits (elements)
    bias_ptr,  # [E] fp32/bf16/fp16 (dummy when HAS_BIAS is False)
    replay_ptr,  # [T, K] int16/int32/int64 forced ids (dummy when HAS_REPLAY is False)
    ids_ptr,  # [T, K] int32 out
    weights_ptr,  # [T, K] fp32 out
    capture_ptr,  # [>= T, K] int16 out (dummy when HAS_CAPTURE is False)
    T,
    scale,  # routed_scaling_factor (fp32)
    METHOD: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    NG: tl.constexpr,
    GS: tl.constexpr,
    NGP: tl.constexpr,
    GSP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_REPLAY: tl.constexpr,
    HAS_CAPTURE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ALGO: tl.constexpr,
    KEY32: tl.constexpr,  # 16-bit logits and a method selecting on the raw logits
):
    EP: tl.constexpr = NGP * GSP
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)

    c = tl.arange(0, EP)
    if NG == 1 or GS == GSP:
        expert1 = c  # contiguous columns
        valid1 = c < NG * GS
    else:
        g = c // GSP
        j = c % GSP
        expert1 = g * GS + j
        valid1 = (g < NG) & (j < GS)
    expert = expert1[None, :]
    valid = valid1[None, :]
    lmask = row_ok[:, None] & valid
    x = tl.load(logits_ptr + rows64[:, None] * stride_lt + expert, mask=lmask, other=0.0).to(tl.float32)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert1, mask=valid1, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([EP], dtype=tl.float32)

    if METHOD == _DEFAULT or METHOD == _RENORMALIZE_NAIVE:
        xm = tl.where(valid, x, float("-inf"))
        row_max = tl.max(xm, axis=1)
        denom = tl.sum(tl.exp(xm - row_max[:, None]), axis=1)

    cols = tl.arange(0, KP)[None, :]
    col_ok = cols < K
    omask = row_ok[:, None] & col_ok
    out_off = rows64[:, None] * K + cols

    if HAS_REPLAY:
        forced = tl.load(replay_ptr + out_off, mask=omask, other=-1).to(tl.int32)
        native = tl.sum(((forced != -1) & col_ok).to(tl.int32), axis=1) == 0
        ids = forced
        if tl.max((native & row_ok).to(tl.int32), axis=0) > 0:
            sel = _select(
                x, bias, valid, expert, METHOD, K, KP, NG, GS, NGP, GSP, TOPK_GROUP, BLOCK_T, ALGO, KEY32
            )
            ids = tl.where(native[:, None], sel, ids)
    else:
        ids = _select(
            x, bias, valid, expert, METHOD, K, KP, NG, GS, NGP, GSP, TOPK_GROUP, BLOCK_T, ALGO, KEY32
        )

    # weights from the logits at the chosen experts (a cached gather), by the method's formula
    xs = tl.load(logits_ptr + rows64[:, None] * stride_lt + ids, mask=omask, other=0.0).to(tl.float32)
    if METHOD == _DEFAULT:
        w = tl.exp(xs - row_max[:, None]) / denom[:, None]
    elif METHOD == _RENORMALIZE_NAIVE:
        p = tl.where(col_ok, tl.exp(xs - row_max[:, None]) / denom[:, None], 0.0)
        w = p / tl.sum(p, axis=1)[:, None]
    elif METHOD == _RENORMALIZE:
        xk = tl.where(col_ok, xs, float("-inf"))
        e = tl.exp(xk - tl.max(xk, axis=1)[:, None])
        w = e / tl.sum(e, axis=1)[:, None]
    elif METHOD == _TOPK:
        w = xs
    elif METHOD == _SIGMOID_RENORM:
        s = tl.where(col_ok, _sigmoid(xs), 0.0)
        w = s / tl.maximum(tl.sum(s, axis=1), 1e-20)[:, None]
    elif METHOD == _DEEPSEEK_V3 or METHOD == _MINIMAX2:
        s = tl.where(col_ok, _sigmoid(xs), 0.0)
        w = s / (tl.sum(s, axis=1) + 1e-20)[:, None] * scale
    else:  # LLAMA4, SIGMOID, TOPK_SIGMOID
        w = _sigmoid(xs)

    tl.store(ids_ptr + out_off, ids, mask=omask)
    tl.store(weights_ptr + out_off, w, mask=omask)
    if HAS_CAPTURE:
        tl.store(capture_ptr + out_off, ids.to(tl.int16), mask=omask)

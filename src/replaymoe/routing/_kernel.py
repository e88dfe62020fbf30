"""Triton kernel of :func:`replaymoe.route`: selection, weights, capture and replay in one launch.

Capture writes the ids (``HAS_CAPTURE``, int16) and, for full recall, the weights (``HAS_WEIGHTS_OUT``,
fp32); replay forces the ids (``HAS_REPLAY``) and, for full recall, the weights of the forced rows
(``HAS_REPLAY_WEIGHTS``). Each is a constexpr: absent, it is compiled out.

The method comes in as its table row's flags (:meth:`replaymoe.routing.methods.MethodSpec.kernel_flags`):
``BIASED`` (selection score ``sigmoid(x) + bias``), ``GROUPED`` (DeepSeek-V3 group masking),
``WEIGHTS`` (the weights formula's branch) and ``FULL_SOFTMAX`` (the formula needs the softmax over
all experts).

Each program handles ``BLOCK_T`` tokens x all experts. The experts sit in a padded
``[NGP, GSP]`` grid (groups x experts per group, both powers of two; one group when the
method is not grouped) flattened to ``EP = NGP * GSP`` columns; column ``g * GSP + j``
holds expert ``g * GS + j``.

Selection works on exact int64 keys ``(sortable_int32(score) << 16) | (65535 - expert)``:
the largest key is the largest score, ties going to the smaller expert; NaN scores were
replaced by -inf beforehand and padding columns hold a sentinel below every key, so ids are
always distinct and in range. ``ALGO`` picks the (exact) top-k: 0 bitonic ``tl.topk`` on the
keys, 1 K rounds of max + mask on the keys, 2 K rounds of two int32 reductions (best
ordered score, then the smallest expert holding it; int32 reductions map to warp ``redux``),
3 K rounds of one int32 reduction on truncated keys, verified, with 2 as the fallback.
16-bit logits selected on the raw logits use one int32 key (``KEY32``) in every ALGO.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replaymoe.routing import methods
from replaymoe.routing._kernel_ids import check_replay_tile, check_weights_tile

# The weights formulas' branch numbers, from the method table (a plain int each, as Triton's constexpr
# globals must be); the kernel reads a method's properties from its row's flags, never its name.
KIND_SOFTMAX_ALL = tl.constexpr(methods.W_SOFTMAX_ALL.kernel)
KIND_SOFTMAX_SELECTED = tl.constexpr(methods.W_SOFTMAX_SELECTED.kernel)
KIND_SIGMOID_SCALED = tl.constexpr(methods.W_SIGMOID_SCALED.kernel)
KIND_SIGMOID = tl.constexpr(methods.W_SIGMOID.kernel)
KIND_SOFTMAX_ALL_RENORM = tl.constexpr(methods.W_SOFTMAX_ALL_RENORM.kernel)
KIND_LOGITS = tl.constexpr(methods.W_LOGITS.kernel)
KIND_SIGMOID_RENORM = tl.constexpr(methods.W_SIGMOID_RENORM.kernel)

_SENTINEL = tl.constexpr(-4611686018427387904)  # -2**62, below every int64 key (>= -2**47)
_MIN32 = tl.constexpr(-2147483648)  # padding / removed: below every int32 key (-inf is above it)
_ORD_NEG_INF = tl.constexpr(-2139095041)  # _ordered(-inf) = 0xFF800000 ^ 0x7FFFFFFF


@triton.jit
def _pack(score, expert):
    """int64 key ordering by (score, -expert); score fp32 without NaN, -0.0 canonicalised."""
    return (_ordered(score).to(tl.int64) << 16) | (65535 - expert).to(tl.int64)


@triton.jit
def _ordered(score):
    """int32 whose signed order is the fp32 order of ``score`` (no NaN; -0.0 below +0.0)."""
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_ordered(ordered):
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
    BIASED: tl.constexpr,
    GROUPED: tl.constexpr,
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
    LOG_EP: tl.constexpr,
    row_ok,
):
    """int32 [BLOCK_T, KP] selected experts, columns in descending score order (ties: smaller id)."""
    EP: tl.constexpr = NGP * GSP
    if BIASED:
        b = _sigmoid(x) + bias[None, :]
    else:
        b = x
    b = tl.where(b != b, float("-inf"), b)  # NaN -> -inf
    b = tl.where(b == 0.0, 0.0, b)  # -0.0 -> +0.0 (they compare equal)
    ordered = tl.where(valid, _ordered(b), _MIN32)  # int32, monotone in the score; padding lowest

    if GROUPED and NG > 1:
        # group score = sum of the group's two largest scores; keep TOPK_GROUP groups
        o3 = tl.reshape(ordered, [BLOCK_T, NGP, GSP])
        m1 = tl.max(o3, axis=2)
        if GS >= 2:
            is1 = o3 == m1[:, :, None]
            m2 = tl.max(tl.where(is1, _MIN32, o3), axis=2)
            m2 = tl.where(tl.sum(is1.to(tl.int32), axis=2) >= 2, m1, m2)  # a repeated maximum
            gscore = _from_ordered(m1) + _from_ordered(m2)
        else:
            gscore = _from_ordered(m1)
        gscore = tl.where(gscore != gscore, float("-inf"), gscore)
        gscore = tl.where(gscore == 0.0, 0.0, gscore)
        gid = tl.arange(0, NGP)[None, :]
        gvalid = gid < NG
        gkey = tl.where(gvalid, _pack(gscore, gid), _SENTINEL)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=1)
            gkey = tl.where(gkey == best[:, None], _SENTINEL, gkey)
        kept = (gkey == _SENTINEL) & gvalid  # the groups taken above
        kept = tl.reshape(tl.broadcast_to(kept[:, :, None], [BLOCK_T, NGP, GSP]), [BLOCK_T, EP])
        ordered = tl.where(kept, ordered, tl.where(valid, _ORD_NEG_INF, _MIN32))

    cols = tl.arange(0, KP)[None, :]
    if KEY32:
        # 16-bit scores: (ordered score, 8191 - expert) fits one int32 key
        key = tl.where(valid, (ordered & -8192) | (8191 - expert), _MIN32)
        SENT: tl.constexpr = _MIN32
    elif ALGO < 2:
        key = tl.where(valid, (ordered.to(tl.int64) << 16) | (65535 - expert).to(tl.int64), _SENTINEL)
        SENT: tl.constexpr = _SENTINEL
    if ALGO == 0:
        if KP == 1:
            top = tl.max(key, axis=1)[:, None]
        else:
            top = tl.topk(key, KP, dim=1)
        ids = _unpack_expert(top, KEY32)
    elif ALGO == 1 or KEY32:
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(key, axis=1)
            key = tl.where(key == best[:, None], SENT, key)
            ids = tl.where(cols == j, _unpack_expert(best, KEY32)[:, None], ids)
    elif ALGO == 2:
        ids = _topk_two_pass(ordered, expert, K, KP, BLOCK_T)
    else:
        # one int32 key per column: the score truncated to its top 32 - LOG_EP bits, then the
        # column. Exact whenever the K picks and the next one have distinct truncated scores
        # (then truncated order = score order); rows where that fails are redone by the
        # two-reduction pass (a branch taken only by blocks holding such a row).
        low: tl.constexpr = (1 << LOG_EP) - 1
        col = tl.arange(0, EP)[None, :]
        tkey = tl.where(valid, (ordered & (-(1 << LOG_EP))) | (low - col), _MIN32)
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        prev = tl.max(tkey, axis=1)
        bad = prev != prev  # all False
        for j in tl.static_range(K):
            best = tl.max(tkey, axis=1)
            if j > 0:
                bad = bad | ((best >> LOG_EP) == (prev >> LOG_EP))
            prev = best
            tkey = tl.where(tkey == best[:, None], _MIN32, tkey)
            c = low - (best & low)
            ids = tl.where(cols == j, ((c // GSP) * GS + c % GSP)[:, None], ids)
        if K < NG * GS:
            nxt = tl.max(tkey, axis=1)
            bad = bad | ((nxt >> LOG_EP) == (prev >> LOG_EP))
        if tl.max((bad & row_ok).to(tl.int32), axis=0) > 0:
            exact = _topk_two_pass(ordered, expert, K, KP, BLOCK_T)
            ids = tl.where(bad[:, None], exact, ids)
    return ids


@triton.jit
def _topk_two_pass(ordered, expert, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Exact top-k of int32 ``ordered`` with two int32 reductions per pick: the best score, then
    the smallest expert holding it."""
    cols = tl.arange(0, KP)[None, :]
    rev = 65535 - expert
    ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(ordered, axis=1)
        r = tl.max(tl.where(ordered == best[:, None], rev, -1), axis=1)
        ordered = tl.where(rev == r[:, None], _MIN32, ordered)
        ids = tl.where(cols == j, 65535 - r[:, None], ids)
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
    BIASED: tl.constexpr,  # selection score sigmoid(x) + bias (the method's row, methods.METHODS)
    GROUPED: tl.constexpr,  # the method groups experts (group masking when NG > 1)
    WEIGHTS: tl.constexpr,  # the weights formula's branch (methods.Formula.kernel)
    FULL_SOFTMAX: tl.constexpr,  # the formula needs the softmax over all experts
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
    LOG_EP: tl.constexpr,  # log2(NGP * GSP)
    err_addr=None,  # the error mailbox's address, an int (routing/_id_mailbox.py; None without CHECK_REPLAY)
    CHECK_REPLAY: tl.constexpr = False,  # check the replay ids on the device (routing/_kernel_ids.py)
    wcap_ptr=None,  # [>= T, K] fp32 out: the weights captured (when HAS_WEIGHTS_OUT)
    rw_ptr=None,  # [T, K] fp32 replayed weights of the forced rows (when HAS_REPLAY_WEIGHTS)
    HAS_WEIGHTS_OUT: tl.constexpr = False,
    HAS_REPLAY_WEIGHTS: tl.constexpr = False,  # only with HAS_REPLAY
    RW_NONNEG: tl.constexpr = True,  # CHECK_REPLAY with HAS_REPLAY_WEIGHTS: the weights must be >= 0
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

    if FULL_SOFTMAX:
        xm = tl.where(valid, x, float("-inf"))
        row_max = tl.max(xm, axis=1)
        denom = tl.sum(tl.exp(xm - row_max[:, None]), axis=1)

    cols = tl.arange(0, KP)[None, :]
    col_ok = cols < K
    omask = row_ok[:, None] & col_ok
    out_off = rows64[:, None] * K + cols

    if HAS_REPLAY:
        if CHECK_REPLAY:
            raw = tl.load(replay_ptr + out_off, mask=omask, other=-1).to(tl.int64)
            check_replay_tile(raw, rows64, cols, omask, K, NG * GS, err_addr)
            forced = raw.to(tl.int32)
        else:
            forced = tl.load(replay_ptr + out_off, mask=omask, other=-1).to(tl.int32)
        native = tl.sum(((forced != -1) & col_ok).to(tl.int32), axis=1) == 0
        ids = forced
        if tl.max((native & row_ok).to(tl.int32), axis=0) > 0:
            sel = _select(
                x,
                bias,
                valid,
                expert,
                BIASED,
                GROUPED,
                K,
                KP,
                NG,
                GS,
                NGP,
                GSP,
                TOPK_GROUP,
                BLOCK_T,
                ALGO,
                KEY32,
                LOG_EP,
                row_ok,
            )
            ids = tl.where(native[:, None], sel, ids)
    else:
        ids = _select(
            x,
            bias,
            valid,
            expert,
            BIASED,
            GROUPED,
            K,
            KP,
            NG,
            GS,
            NGP,
            GSP,
            TOPK_GROUP,
            BLOCK_T,
            ALGO,
            KEY32,
            LOG_EP,
            row_ok,
        )

    # weights from the logits at the chosen experts (a cached gather), by the method's formula; replay
    # ids outside [0, E) (checked on the device, reported later: CHECK_REPLAY) read nothing
    gmask = omask & (ids >= 0) & (ids < NG * GS) if HAS_REPLAY else omask
    xs = tl.load(logits_ptr + rows64[:, None] * stride_lt + ids, mask=gmask, other=0.0).to(tl.float32)
    if WEIGHTS == KIND_SOFTMAX_ALL:
        w = tl.exp(xs - row_max[:, None]) / denom[:, None]
    elif WEIGHTS == KIND_SOFTMAX_ALL_RENORM:
        p = tl.where(col_ok, tl.exp(xs - row_max[:, None]) / denom[:, None], 0.0)
        w = p / tl.sum(p, axis=1)[:, None]
    elif WEIGHTS == KIND_SOFTMAX_SELECTED:
        xk = tl.where(col_ok, xs, float("-inf"))
        e = tl.exp(xk - tl.max(xk, axis=1)[:, None])
        w = e / tl.sum(e, axis=1)[:, None]
    elif WEIGHTS == KIND_LOGITS:
        w = xs
    elif WEIGHTS == KIND_SIGMOID_RENORM:
        s = tl.where(col_ok, _sigmoid(xs), 0.0)
        w = s / tl.maximum(tl.sum(s, axis=1), 1e-20)[:, None]
    elif WEIGHTS == KIND_SIGMOID_SCALED:
        s = tl.where(col_ok, _sigmoid(xs), 0.0)
        w = s / (tl.sum(s, axis=1) + 1e-20)[:, None] * scale
    else:
        tl.static_assert(WEIGHTS == KIND_SIGMOID, "a weights formula without a branch here")
        w = _sigmoid(xs)

    if HAS_REPLAY_WEIGHTS:
        # full recall: a forced row's weights are the replayed ones; a native row keeps its own
        tl.static_assert(HAS_REPLAY, "replayed weights come with replayed ids")
        rw = tl.load(rw_ptr + out_off, mask=omask, other=0.0)
        if CHECK_REPLAY:
            check_weights_tile(rw, (native == 0) & row_ok, rows64, cols, omask, RW_NONNEG, err_addr)
        w = tl.where(native[:, None], w, rw)

    tl.store(ids_ptr + out_off, ids, mask=omask)
    tl.store(weights_ptr + out_off, w, mask=omask)
    if HAS_CAPTURE:
        tl.store(capture_ptr + out_off, ids.to(tl.int16), mask=omask)
    if HAS_WEIGHTS_OUT:
        tl.store(wcap_ptr + out_off, w, mask=omask)

"""Full recall (``replay="ids+weights"``): the routing kernel captures and replays the combine weights
(``routing_weights_out``, ``replay_weights``), traces carry them (file format 2; version-1 files still
read), the replay table hands them to the routers, and a transformers model replayed with the ids and
weights of a captured forward gives bitwise that forward's output while the router gets no gradient
through the weights. CPU: the torch reference and the Triton kernel under the interpreter (fp32/fp16)."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

from _routing_cases import routing_kwargs
from replaymoe import fused_moe
from replaymoe.record.replay import ReplayTable
from replaymoe.record.trace import FORMAT_VERSION, RoutingTrace, TraceFormatError
from replaymoe.routing import RoutingMethod, route, route_torch
from replaymoe.testing import assert_close, poison, tie_free_logits

M = RoutingMethod
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.interpret),  # the kernel in Triton's interpreter
]


def _forced(x, top_k, native_rows):
    """Replay ids (another router's choice: a softmax top-k of the reversed logits) with ``native_rows``
    all -1, and positive weights that no formula gives (NaN in the native rows: never read)."""
    ids = route_torch(x.flip(1).contiguous(), top_k).topk_ids.clone()
    ids = (x.shape[1] - 1 - ids).to(torch.int32)  # the flip's expert numbers
    ids[native_rows] = -1
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) + 0.25
    w[native_rows] = float("nan")
    return ids, w


# ---------------------------------------------------------------- route: capture and replay of weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the kernel's int32 keys
@pytest.mark.parametrize("method", list(RoutingMethod))
def test_weights_out_holds_the_returned_weights(method, dtype, backend, generator):
    # T = 9 (a partial last program block); 3 spare rows in the buffer must stay untouched (NaN)
    kw = routing_kwargs(method, 48, generator, top_k=3, bias_dtype=torch.float16)
    x = tie_free_logits(9, 48, dtype=dtype, generator=generator)
    cap = poison(torch.empty(12, kw["top_k"], dtype=torch.int16))
    wcap = poison(torch.empty(12, kw["top_k"], dtype=torch.float32))
    out = route(x, method=method, routing_replay_out=cap, routing_weights_out=wcap, backend=backend, **kw)
    assert torch.equal(wcap[:9], out.topk_weights)  # the very values returned
    assert bool(wcap[9:].isnan().all())
    ref = route_torch(x, method=method, **kw)
    assert torch.equal(out.topk_ids, ref.topk_ids)
    assert_close(wcap[:9], ref.topk_weights, dtype=torch.float32)
    # capture changes nothing
    plain = route(x, method=method, backend=backend, **kw)
    assert torch.equal(plain.topk_weights, out.topk_weights)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "method",
    [M.RENORMALIZE, M.DEEPSEEK_V3, M.TOPK, M.LLAMA4],  # softmax, grouped+bias, raw logits, K=1
)
def test_replayed_weights_pass_through_and_native_rows_compute_theirs(method, backend, generator):
    kw = routing_kwargs(method, 32, generator, top_k=4, groups=(4, 2))
    x = tie_free_logits(7, 32, generator=generator)
    native = [2, 5]
    ids, w = _forced(x, kw["top_k"], native)
    wcap = poison(torch.empty(7, kw["top_k"]))
    out = route(
        x, method=method, replay_ids=ids, replay_weights=w, routing_weights_out=wcap, backend=backend, **kw
    )
    replayed = [i for i in range(7) if i not in native]
    assert torch.equal(out.topk_ids[replayed], ids[replayed])
    assert torch.equal(out.topk_weights[replayed], w[replayed])  # bitwise the replayed values
    ref = route(x, method=method, replay_ids=ids, backend=backend, **kw)  # R3: weights recomputed
    assert torch.equal(out.topk_ids, ref.topk_ids)
    assert torch.equal(out.topk_weights[native], ref.topk_weights[native])
    assert torch.equal(wcap, out.topk_weights)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_reaches_the_logits_through_replayed_weights(backend, generator):
    x = tie_free_logits(6, 16, generator=generator).requires_grad_(True)
    ids, w = _forced(x.detach(), 3, [1])
    scale = torch.tensor([1.0, -2.0, 3.0])  # (a plain sum of renormalized weights has no gradient)
    (route(x, 3, replay_ids=ids, replay_weights=w, backend=backend).topk_weights * scale).sum().backward()
    g_full = x.grad.clone()
    x.grad = None
    (route(x, 3, replay_ids=ids, backend=backend).topk_weights * scale).sum().backward()
    g_r3 = x.grad.clone()
    assert bool((g_full[[0, 2, 3, 4, 5]] == 0).all())  # replayed rows: no gradient at all
    assert torch.equal(g_full[1], g_r3[1]) and bool((g_r3[1] != 0).any())  # the native row keeps its own
    assert bool((g_r3[[0, 2]] != 0).any())  # (R3 does pass one)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(replay_weights=torch.ones(4, 2)), "replay_weights.*without replay_ids"),  # weights alone
        (
            dict(replay_ids=True, replay_weights=torch.ones(4, 2, dtype=torch.float16)),
            "dtype of replay_weights",
        ),
        (dict(replay_ids=True, replay_weights=torch.ones(4, 3)), "shape of replay_weights"),
        (
            dict(replay_ids=True, replay_weights=torch.full((4, 2), float("inf"))),
            "replay_weights.*finite.*row 0",
        ),
        (dict(replay_ids=True, replay_weights=-torch.ones(4, 2)), "replay_weights.*>= 0"),  # softmax weights
        (dict(routing_weights_out=torch.empty(4, 2, dtype=torch.float16)), "dtype of routing_weights_out"),
        (dict(routing_weights_out=torch.empty(3, 2)), "shape of routing_weights_out"),  # fewer than T rows
        (dict(routing_weights_out=torch.empty(8, 4)[:, ::2]), "routing_weights_out.*contiguous"),
    ],
)
def test_bad_weight_arguments_name_themselves(kwargs, match):
    x = torch.randn(4, 8)
    if kwargs.get("replay_ids") is True:
        kwargs["replay_ids"] = route_torch(x, 2).topk_ids
    with pytest.raises(ValueError, match=match):
        route(x, 2, **kwargs)


def test_weight_values_allowed_where_they_mean_nothing_or_a_method_signs_them():
    x = torch.randn(4, 8)
    ids = route_torch(x, 2).topk_ids.clone()
    ids[1] = -1
    w = torch.ones(4, 2)
    w[1] = float("nan")  # a native row's weights are not read
    assert not route(x, 2, replay_ids=ids, replay_weights=w).topk_weights.isnan().any()
    # TOPK's weights are the raw logits, negative ones included
    neg = -torch.ones(4, 2)
    assert torch.equal(route(x, 2, M.TOPK, replay_ids=ids, replay_weights=neg).topk_weights[0], neg[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_routing_inside_captures_and_replays_weights(backend, generator):
    # the same output as the caller's own ids and weights: the replayed weights are what the experts get
    T, H, I, E, K = 5, 16, 8, 6, 2  # noqa: E741
    x = torch.randn(T, H, generator=generator)
    w13 = torch.randn(E, 2 * I, H, generator=generator) * 0.2
    w2 = torch.randn(E, H, I, generator=generator) * 0.2
    logits = tie_free_logits(T, E, generator=generator)
    ids, w = _forced(logits, K, [])
    wcap = poison(torch.empty(T, K))
    dt = torch.float16 if backend == "triton" else torch.float32  # (the interpreter's fp32 dot is not)
    args = (x.to(dt), w13.to(dt), w2.to(dt))
    out = fused_moe(*args, router_logits=logits, top_k=K, replay_ids=ids, replay_weights=w,
                    routing_weights_out=wcap, backend=backend)  # fmt: skip
    given = fused_moe(*args, topk_ids=ids, topk_weights=w, backend=backend)
    assert torch.equal(out, given)
    assert torch.equal(wcap, w)
    with pytest.raises(ValueError, match="replay_weights.*router_logits"):
        fused_moe(*args, topk_ids=ids, topk_weights=w, replay_weights=w, backend=backend)


# ---------------------------------------------------------------- traces


def _trace(n=6, weights=True, seed=0, **kw):
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(16)[:4] for _ in range(3)] for _ in range(n)]).astype(np.int16)
    ids[1, 2] = -1  # one missing row
    w = rng.random(ids.shape).astype(np.float32) if weights else None
    tokens = np.arange(n) + 3 + 10 * seed  # (distinct prefixes per seed: content matching tells them apart)
    return RoutingTrace(ids, num_experts=16, top_k=4, weights=w, token_ids=tokens, **kw)


def test_trace_weights_invariant():
    t = _trace()
    assert t.has_weights and t.weights.dtype == np.float32 and t.weights.flags.c_contiguous
    assert np.isnan(t.weights[1, 2]).all()  # a missing row's weights are NaN, whatever was given
    assert np.isfinite(t.weights[t.ids[..., 0] >= 0]).all()
    bad = t.weights.copy()
    bad[0, 0, 1] = np.inf
    with pytest.raises(ValueError, match=r"weights.*finite.*\[0, 0\]"):
        RoutingTrace(t.ids, num_experts=16, top_k=4, weights=bad)
    with pytest.raises(ValueError, match="shape of weights"):
        RoutingTrace(t.ids, num_experts=16, top_k=4, weights=t.weights[:, :2])
    assert not _trace(weights=False).has_weights


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("weights", [True, False])
def test_file_round_trip_version_2(tmp_path, weights, compress):
    t = _trace(weights=weights)
    path = tmp_path / "t.trace"
    t.save(path, compress=compress)
    back = RoutingTrace.load(path)
    assert back == t and back.has_weights == weights
    if weights:
        assert np.array_equal(back.weights, t.weights, equal_nan=True)
    with zipfile.ZipFile(path) as z:
        meta = json.loads(np.load(z.open("meta.npy")).tobytes())
        assert ("weights.npy" in z.namelist()) == weights
    assert meta["version"] == FORMAT_VERSION == 2


def _write_v1(path, trace):
    """A file exactly as replaymoe before format 2 wrote it: ids and meta, version 1, no weights."""
    import hashlib

    ids = np.ascontiguousarray(trace.ids, dtype="<i2")
    meta = {"format": "replaymoe-routing-trace", "version": 1, "shape": list(ids.shape), "dtype": "int16",
            "num_experts": trace.num_experts, "top_k": trace.top_k, "layer_ids": None, "model_id": "m",
            "token_offset": 0, "token_ids": trace.token_ids.tolist(),
            "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}  # fmt: skip
    meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    with zipfile.ZipFile(path, "w") as zf:
        for name, arr in (("ids.npy", ids), ("meta.npy", meta_bytes)):
            with zf.open(name, "w") as member:
                np.lib.format.write_array(member, arr, allow_pickle=False)


def test_version_1_files_still_load(tmp_path):
    t = _trace(weights=False, model_id="m")
    _write_v1(tmp_path / "v1.trace", t)
    back = RoutingTrace.load(tmp_path / "v1.trace")
    assert back == t and not back.has_weights


def test_damaged_weights_are_refused(tmp_path):
    t = _trace()
    path = tmp_path / "t.trace"
    t.save(path, compress=False)
    with zipfile.ZipFile(path) as z:
        members = {n: np.load(z.open(n)) for n in z.namelist()}
    members["weights.npy"] = members["weights.npy"].copy()
    members["weights.npy"][0, 0, 0] += 1.0
    for drop, match in ((None, "weights are corrupted"), ("weights.npy", "weights member")):
        with zipfile.ZipFile(path, "w") as zf:
            for name, arr in members.items():
                if name != drop:
                    with zf.open(name, "w") as member:
                        np.lib.format.write_array(member, arr, allow_pickle=False)
        with pytest.raises(TraceFormatError, match=match):
            RoutingTrace.load(path)


def test_joins_and_cuts_keep_weights():
    a, b = _trace(4, seed=1), _trace(3, seed=2)
    b = b.replace(token_offset=4, token_ids=None)
    a = a.replace(token_ids=None)
    joined = RoutingTrace.concat([a, b])
    assert np.array_equal(joined.weights, np.concatenate([a.weights, b.weights]), equal_nan=True)
    merged = RoutingTrace.merge([b, a])
    assert merged == joined
    cut = joined.replace(ids=joined.ids[:5])  # the weights follow the cut
    assert np.array_equal(cut.weights, joined.weights[:5], equal_nan=True)
    longer = a.replace(ids=np.concatenate([a.ids, np.full((2, 3, 4), -1, np.int16)]))
    assert np.isnan(longer.weights[4:]).all()
    assert a != a.replace(weights=None)  # weights are part of equality
    with pytest.raises(ValueError, match="all with weights or all without"):
        RoutingTrace.concat([a, b.replace(weights=None)])


def test_wire_formats_carry_ids_only():
    t = _trace(weights=True)
    assert not RoutingTrace.from_vllm(t.to_vllm(), num_experts=16).has_weights
    assert not RoutingTrace.from_sglang(t.to_sglang(), 3, 4, num_experts=16).has_weights


# ---------------------------------------------------------------- the replay table


def test_table_hands_the_rows_weights_to_every_torch_producer():
    t0, t1 = _trace(5, seed=4), _trace(6, seed=5)
    table = ReplayTable()
    table.load([t0, t1], [0, 1, 2], torch.device("cpu"), weights=True)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, -1]])  # row 0 one past its trace
    for tokens in (None, torch.stack([torch.arange(6) + 53, torch.tensor([43, 44, 45, 46, 47, 0])])):
        # by batch row, then by content (row 0 holds t1's tokens, row 1 t0's: swapped rows)
        w = torch.empty(3, 12, 4)
        ids = table.lookup(positions, tokens=tokens, weights_out=w)
        src = [t0, t1] if tokens is None else [t1, t0]
        for b in range(2):
            for p in range(6):
                got_ids, got_w = ids[:, b * 6 + p], w[:, b * 6 + p]
                if positions[b, p] < 0 or p >= src[b].num_tokens:
                    assert bool((got_ids == -1).all()) and bool(got_w.isnan().all())
                else:
                    want = torch.from_numpy(src[b].weights[p])
                    assert torch.equal(got_w.nan_to_num(-7.0), want.nan_to_num(-7.0))  # (NaN: missing rows)
                    assert torch.equal(got_ids, torch.from_numpy(src[b].ids[p]).int())
    with pytest.raises(ValueError, match="weights_out"):
        table.lookup(positions)
    with pytest.raises(ValueError, match="kernel"):
        table.lookup(kernel=lambda args, out: out, weights_out=torch.empty(3, 12, 4))
    with pytest.raises(ValueError, match=r"traces\[1\].*vLLM or SGLang"):
        table.load([t0, t1.replace(weights=None)], [0, 1, 2], torch.device("cpu"), weights=True)

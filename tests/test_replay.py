"""ReplaySource: per-layer replay_ids for a padded batch, fallback accounting, model checks,
and the ids it produces driving route() (forced rows replayed, -1 rows routed natively)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaymoe.record.replay import ReplayReport, ReplaySource
from replaymoe.record.trace import RoutingTrace


def random_ids(rng, n, L, K, E):
    return np.argsort(rng.random((n, L, E)), axis=-1)[..., :K].astype(np.int64)


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(generator.initial_seed()))


def _expected_rows(traces, positions, layer, K):
    """Plain-loop spec of ids_for."""
    pos = positions.reshape(len(traces), -1).tolist()
    rows = []
    for b, t in enumerate(traces):
        for p in pos[b]:
            n = p - t.token_offset
            if p >= 0 and 0 <= n < t.num_tokens:
                rows.append(t.ids[n, layer].tolist())
            else:
                rows.append([-1] * K)
    return np.array(rows, dtype=np.int64).reshape(-1, K)


def _batch(rng):
    L, K, E = 3, 2, 8
    a_ids = random_ids(rng, 6, L, K, E)
    a_ids[1, 2] = -1  # one missing (token, layer) row
    a = RoutingTrace(a_ids, num_experts=E, top_k=K, layer_ids=[1, 2, 4])
    # b starts at position 2 (e.g. prompt_start) and is shorter than the batch row
    b = RoutingTrace(random_ids(rng, 3, L, K, E), num_experts=E, top_k=K, layer_ids=[1, 2, 4], token_offset=2)
    positions = torch.tensor(
        [
            [0, 1, 2, 3, 4, 5, 6],  # last position beyond a's 6 rows (the -1-token shape)
            [-1, -1, 0, 1, 2, 3, 4],  # left padding; 0,1 before b's offset; 2..4 inside
        ],
        dtype=torch.int64,
    )
    return [a, b], positions, (L, K, E)


def test_ids_for_matches_spec_and_report(rng):
    traces, positions, (L, K, E) = _batch(rng)
    src = ReplaySource(traces)
    expected_fallback = np.zeros(L, dtype=np.int64)
    for layer in range(L):
        out = src.ids_for(layer, positions)
        assert out.dtype == torch.int32 and out.shape == (positions.numel(), K)
        exp = _expected_rows(traces, positions, layer, K)
        np.testing.assert_array_equal(out.numpy(), exp)
        real = positions.reshape(-1).numpy() >= 0
        expected_fallback[layer] = int((real & (exp[:, 0] < 0)).sum())
    # hand count: a: position 6 beyond (every layer) + the missing row at layer 2;
    # b: positions 0 and 1 before its offset (every layer); padding is not a fallback
    np.testing.assert_array_equal(expected_fallback, [3, 3, 4])
    rep = src.report()
    assert isinstance(rep, ReplayReport)
    assert rep.tokens_seen == 12  # 14 slots minus 2 padding
    np.testing.assert_array_equal(rep.fallback_tokens_per_layer, expected_fallback)
    assert rep.layers_with_fallback == 3
    assert rep.fallback_fraction == pytest.approx(10 / 36)
    text = str(rep)
    assert "12 tokens" in text and "index: 2: 4" in text
    src.reset_report()
    assert src.report().tokens_seen == 0 and src.report().layers_with_fallback == 0


def test_single_trace_1d_positions_and_int32(rng):
    t = RoutingTrace(random_ids(rng, 4, 2, 3, 10), num_experts=10, top_k=3)
    src = ReplaySource(t)
    pos = torch.tensor([3, 2, -1, 0, 9], dtype=torch.int32)
    out = src.ids_for(1, pos)
    np.testing.assert_array_equal(out.numpy(), _expected_rows([t], pos.long(), 1, 3))
    rep = src.report()
    assert rep.tokens_seen == 4 and rep.fallback_tokens_per_layer.tolist() == [0, 1]


def test_no_fallback_when_fully_covered(rng):
    t = RoutingTrace(random_ids(rng, 5, 2, 2, 6), num_experts=6, top_k=2)
    src = ReplaySource([t])
    for layer in range(2):
        src.ids_for(layer, torch.arange(5).reshape(1, 5))
    rep = src.report()
    assert rep.layers_with_fallback == 0 and rep.fallback_tokens_per_layer.sum() == 0
    assert "in 0 of the 2 layers" in str(rep)


def test_rejections(rng):
    traces, positions, _ = _batch(rng)
    src = ReplaySource(traces)
    with pytest.raises(ValueError, match="layer"):
        src.ids_for(3, positions)
    with pytest.raises(ValueError, match="shape of positions"):
        src.ids_for(0, positions[0])  # [S] needs a single-trace source
    with pytest.raises(ValueError, match="shape of positions"):
        src.ids_for(0, positions[:1])
    with pytest.raises(ValueError, match="dtype of positions"):
        src.ids_for(0, positions.float())
    with pytest.raises(ValueError, match="at least one"):
        ReplaySource([])
    with pytest.raises(ValueError, match="RoutingTrace"):
        ReplaySource([traces[0], "x"])
    other = RoutingTrace(random_ids(rng, 2, 2, 2, 8), num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="layers=3"):
        ReplaySource([traces[0], other])
    with pytest.raises(ValueError, match="num_experts"):
        ReplaySource([traces[0], traces[1].replace(num_experts=9)])


def test_check_model(rng):
    traces, _, (L, K, E) = _batch(rng)
    src = ReplaySource(traces)
    src.check_model(L, K, E)
    with pytest.raises(ValueError, match="num_layers.*3 MoE layers"):
        src.check_model(L + 1, K, E)  # e.g. a dense layer counted as MoE
    with pytest.raises(ValueError, match="top_k"):
        src.check_model(L, K + 1, E)
    with pytest.raises(ValueError, match="num_experts"):
        src.check_model(L, K, E * 2)
    # unknown E (vLLM payload): ids must fit the model
    unk = ReplaySource(RoutingTrace(np.array([[[5, 2]]]), num_experts=None, top_k=2))
    unk.check_model(1, 2, 6)
    with pytest.raises(ValueError, match="largest expert id 5"):
        unk.check_model(1, 2, 5)


def test_layer_for_model_layer(rng):
    traces, _, _ = _batch(rng)
    src = ReplaySource(traces)
    assert [src.layer_for_model_layer(m) for m in (1, 2, 4)] == [0, 1, 2]
    with pytest.raises(ValueError, match="model_layer_number"):
        src.layer_for_model_layer(3)  # a dense layer
    ident = ReplaySource(RoutingTrace(random_ids(rng, 1, 2, 1, 4), num_experts=4, top_k=1))
    assert ident.layer_for_model_layer(1) == 1


def test_replay_drives_route(rng, generator):
    from replaymoe.routing import RoutingMethod, route

    traces, positions, (L, K, E) = _batch(rng)
    src = ReplaySource(traces)
    T = positions.numel()
    for layer in range(L):
        logits = torch.randn(T, E, generator=generator)
        replay = src.ids_for(layer, positions)
        forced = route(logits, K, RoutingMethod.RENORMALIZE, replay_ids=replay)
        native = route(logits, K, RoutingMethod.RENORMALIZE)
        fb = replay[:, 0] < 0
        assert torch.equal(forced.topk_ids[~fb], replay[~fb].to(forced.topk_ids.dtype))
        assert torch.equal(forced.topk_ids[fb], native.topk_ids[fb])
        # weights come from the logits over the forced set (renormalized softmax)
        sm = torch.softmax(logits, -1).gather(1, forced.topk_ids.long())
        torch.testing.assert_close(forced.topk_weights, sm / sm.sum(-1, keepdim=True))


def test_capture_save_load_replay_round_trip(tmp_path, generator):
    """Rollout with capture -> trace file -> trainer forward with other logits replays the ids."""
    from replaymoe.record.capture import RoutedExpertsCapturer
    from replaymoe.routing import RoutingMethod, route

    L, K, E = 2, 2, 8
    cap = RoutedExpertsCapturer(L, 8, K, device="cpu", num_experts=E, layer_ids=[0, 2])
    rollout = []
    for step_positions in ([0, 1, 2, 3], [4], [5]):  # prefill then two decode steps
        T = len(step_positions)
        ids = []
        for layer in range(L):
            out = route(torch.randn(T, E, generator=generator), K, routing_replay_out=cap.layer_buffer(layer))
            ids.append(out.topk_ids)
        rollout.append(torch.stack(ids, 1))  # [T, L, K]
        cap.end_step(["req"] * T, step_positions)
    cap.finish("req").save(tmp_path / "req.trace")
    rolled = torch.cat(rollout)  # [6, L, K]

    src = ReplaySource(RoutingTrace.load(tmp_path / "req.trace"))
    src.check_model(L, K, E)
    positions = torch.arange(7)  # the trainer also feeds the last sampled token (no routing for it)
    for model_layer in (0, 2):
        layer = src.layer_for_model_layer(model_layer)
        logits = torch.randn(7, E, generator=generator)  # the trainer's own logits
        out = route(logits, K, RoutingMethod.RENORMALIZE, replay_ids=src.ids_for(layer, positions))
        assert torch.equal(out.topk_ids[:6], rolled[:, layer])
        assert torch.equal(out.topk_ids[6:], route(logits[6:], K).topk_ids)  # native fallback
    rep = src.report()
    assert rep.tokens_seen == 7 and rep.fallback_tokens_per_layer.tolist() == [1, 1]


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 1, 7, 3],  # a rollout round's rows of different lengths
        [0, 4, 0],  # empty traces among them
        [3000],  # one long sequence: the power table grows
    ],
)
def test_prefix_hashes_of_many_arrays_in_one_pass_equal_one_per_array(lengths, generator):
    # content matching hashes a round's traces together; per array the same integers as one call each,
    # -1 from an array's first unknown token on (and not into the next array)
    from replaymoe.record.replay.hashes import prefix_hashes_concat, prefix_hashes_np

    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
    arrays = [rng.integers(0, 2**31 - 2, size=n) for n in lengths]
    if lengths[0] > 2:
        arrays[0][2] = -1  # unknown from position 2 of the first array
    want = np.concatenate([prefix_hashes_np(a) for a in arrays])
    np.testing.assert_array_equal(prefix_hashes_concat(arrays), want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])  # fullgraph: no host sync
def test_token_diff_counts_the_first_differing_token(compiled):
    # forwards matched by batch row compare each token with the one its trace recorded there: the
    # count, and the smallest (row, position) with both tokens; unknown tokens (-1), padding and
    # positions past a trace are not compared; a second forward keeps the earlier first key
    from replaymoe.record.replay import ReplayTable
    from replaymoe.record.replay.coverage import NO_KEY

    ids = np.zeros((5, 1, 2), dtype=np.int64)
    ids[:, 0, 1] = 1
    traces = [
        RoutingTrace(ids, num_experts=4, top_k=2, token_ids=[10, 11, 12, 13, 14]),
        RoutingTrace(ids, num_experts=4, top_k=2, token_ids=[20, 21, -1, 23, 24]),
    ]
    table = ReplayTable()
    table.load(traces, [0], torch.device("cpu"), match_content=False)
    assert table.checks_tokens and table.token_diff.tolist() == [0, NO_KEY, 0, 0]
    count = (
        torch.compile(table.count_token_diff, fullgraph=True, backend="eager")
        if compiled
        else (table.count_token_diff)
    )
    positions = torch.tensor([[2, 3, 4, 5], [-1, 1, 2, 3]])  # row 1 starts with padding; 5 is past
    tokens = torch.tensor([[12, 99, 14, 7], [0, 21, 77, 98]])  # differ: (0, 3), (1, 3); (1, 2) unknown
    count(tokens, positions)
    assert table.token_diff.tolist() == [2, 3, 13, 99]  # key 0 << 28 | 3: recorded 13, got 99
    # one more difference, (1, 0): its key 1 << 28 | 0 is above the first one's, which stays
    count(torch.tensor([[12, 13, 14, 0], [0, 21, 77, 0]]), torch.tensor([[2, 3, 4, 5], [-1, 1, 2, 0]]))
    assert table.token_diff.tolist() == [3, 3, 13, 99]
    with pytest.raises(ValueError, match=r"Invalid tokens of replay.*3 token\(s\) differ"):
        table.check_uncovered(["l0"], block=True)
    assert table.token_diff.tolist() == [0, NO_KEY, 0, 0]  # cleared once raised

"""Statistics against hand counts: expert_load, balance, agreement, plot_heatmap."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from replaymoe.record.stats import AgreementReport, agreement, balance, expert_load, plot_heatmap
from replaymoe.record.trace import RoutingTrace

M = [-1, -1]  # a missing row


@pytest.fixture
def small():
    ids = [
        [[0, 1], [3, 0]],
        [[1, 2], [3, 1]],
        [M, [3, 2]],
    ]
    return RoutingTrace(np.array(ids), num_experts=4, top_k=2, layer_ids=[2, 5])


def test_expert_load_hand_counts(small):
    load = expert_load(small)
    assert load.dtype == np.int64
    np.testing.assert_array_equal(load, [[1, 2, 1, 0], [1, 1, 1, 3]])
    # summed over several traces; E widened on request; inferred when unknown
    np.testing.assert_array_equal(expert_load([small, small])[1], [2, 2, 2, 6])
    assert expert_load(small, num_experts=6).shape == (2, 6)
    assert expert_load(small.replace(num_experts=None)).shape == (2, 4)
    with pytest.raises(ValueError, match="num_experts"):
        expert_load(small, num_experts=3)
    with pytest.raises(ValueError, match="layers"):
        expert_load([small, RoutingTrace(np.zeros((1, 1, 2), int) + [[[0, 1]]], num_experts=4, top_k=2)])
    empty = RoutingTrace(np.zeros((0, 2, 2), np.int16), num_experts=4, top_k=2)
    np.testing.assert_array_equal(expert_load(empty), np.zeros((2, 4)))


def test_balance_hand_values(small):
    b = balance(expert_load(small))
    # layer 0: [1, 2, 1, 0], mean 1; layer 1: [1, 1, 1, 3], mean 1.5
    np.testing.assert_allclose(b["max_over_mean"], [2.0, 2.0])
    np.testing.assert_allclose(b["cv"], [math.sqrt(0.5) / 1.0, math.sqrt(0.75) / 1.5])
    h0 = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5)) / math.log(4)
    h1 = -(3 * (1 / 6) * math.log(1 / 6) + 0.5 * math.log(0.5)) / math.log(4)
    np.testing.assert_allclose(b["entropy"], [h0, h1])


@pytest.mark.parametrize(
    "load, mom, cv, ent",
    [
        ([5, 5, 5, 5], 1.0, 0.0, 1.0),  # perfectly even
        ([8, 0, 0, 0], 4.0, math.sqrt(3), 0.0),  # everything on one expert
        ([0, 0, 0, 0], math.nan, math.nan, math.nan),  # a layer with no tokens
        ([7], 1.0, 0.0, 1.0),  # E == 1
    ],
)
def test_balance_edges(load, mom, cv, ent):
    b = balance(np.array(load))
    np.testing.assert_allclose([b["max_over_mean"][0], b["cv"][0], b["entropy"][0]], [mom, cv, ent])


def test_balance_rejects():
    with pytest.raises(ValueError, match="load"):
        balance(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="load"):
        balance(np.zeros((2, 2, 2)))


def _pair():
    a = np.array(
        [
            [[0, 1], [2, 3]],
            [[1, 2], [0, 3]],
            [M, [1, 2]],
            [[3, 0], [1, 0]],
        ]
    )
    b = np.array(
        [
            [[1, 0], [2, 3]],  # same sets, other column order
            [[1, 3], [3, 0]],  # layer 0 differs
            [[0, 1], [1, 2]],  # a misses layer 0
            [M, [0, 2]],  # b misses layer 0; layer 1 differs
        ]
    )
    return (RoutingTrace(a, num_experts=4, top_k=2), RoutingTrace(b, num_experts=4, top_k=2))


def test_agreement_hand_counts():
    a, b = _pair()
    r = agreement(a, b)
    assert isinstance(r, AgreementReport)
    np.testing.assert_allclose(r.per_layer, [1 / 2, 3 / 4])
    np.testing.assert_array_equal(r.compared_per_layer, [2, 4])
    np.testing.assert_array_equal(r.excluded_per_layer, [2, 0])
    assert (r.compared_tokens, r.excluded_tokens) == (2, 2)
    assert r.all_layers == pytest.approx(1 / 2)  # token 0 identical everywhere, token 1 not
    assert agreement(a, a).all_layers == 1.0
    assert "0.5000 of 2 tokens" in str(r)


def test_agreement_offsets():
    a, b = _pair()
    # b shifted to positions 1..4: only positions 1..3 overlap; a's row p vs b's row p-1
    r = agreement(a, b.replace(token_offset=1))
    # layer 1 compares a[1..3] with b[0..2]: [0,3]vs[2,3] no, [1,2]vs[3,0] no, [1,0]vs[1,2] no
    np.testing.assert_allclose(r.per_layer[1], 0.0)
    assert r.compared_per_layer[1] == 3 and r.excluded_per_layer[1] == 5 - 3
    # disjoint traces: nothing compared
    far = agreement(a, b.replace(token_offset=10))
    assert np.isnan(far.per_layer).all() and math.isnan(far.all_layers) and far.excluded_tokens == 8


def test_agreement_rejects(small):
    a, _ = _pair()
    with pytest.raises(ValueError, match="layers"):
        agreement(a, RoutingTrace(np.array([[[0, 1]]]), num_experts=4, top_k=2))
    with pytest.raises(ValueError, match="RoutingTrace"):
        agreement(a, "b")


def test_plot_heatmap(tmp_path, small):
    path = plot_heatmap(small, tmp_path / "h.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_heatmap_without_matplotlib(tmp_path, small, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"replaymoe\[plot\]"):
        plot_heatmap(small, tmp_path / "h.png")
    assert not (tmp_path / "h.png").exists()


def test_agreement_token_layer_hand_count():
    a, b = _pair()
    # per layer 1/2 of 2 and 3/4 of 4 compared tokens: 1 + 3 equal decisions of 6
    assert agreement(a, b).token_layer == pytest.approx(4 / 6)
    assert agreement(a, a).token_layer == 1.0
    assert math.isnan(agreement(a, b.replace(token_offset=10)).token_layer)  # nothing compared


def _png_size(path) -> tuple[int, int]:
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.parametrize(
    "name, magic",
    [
        ("h.svg", b"<?xml"),  # vector: the suffix picks the format, not always PNG
        ("h.pdf", b"%PDF"),
        ("h.PNG", b"\x89PNG"),  # suffix case-insensitive
        ("heatmap", b"\x89PNG"),  # no suffix: PNG
    ],
)
def test_plot_heatmap_format_from_suffix(tmp_path, small, name, magic):
    path = plot_heatmap(small, tmp_path / name)
    assert open(path, "rb").read(len(magic)) == magic


def test_plot_heatmap_rejects_unknown_suffix(tmp_path, small):
    with pytest.raises(ValueError, match="suffix of path.*'.*h.txt'"):
        plot_heatmap(small, tmp_path / "h.txt")
    assert not (tmp_path / "h.txt").exists()


def test_plot_heatmap_agreement_panel(tmp_path, small):
    plain = plot_heatmap(small, tmp_path / "plain.png")
    both = plot_heatmap(
        small,
        tmp_path / "both.png",
        agreement={"native routing": [0.5, float("nan")], "with replay": [1.0, 1.0]},  # NaN: no tokens
        agreement_title="rollout vs trainer",
    )
    (w0, _), (w1, _) = _png_size(plain), _png_size(both)
    assert w1 > w0  # the second panel widens the figure
    with pytest.raises(ValueError, match="length of agreement\\['x'\\]"):
        plot_heatmap(small, tmp_path / "bad.png", agreement={"x": [1.0, 1.0, 1.0]})  # 3 values, 2 layers

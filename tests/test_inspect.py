"""`replaymoe inspect` on small traces: the table, --compare, --heatmap, vLLM inputs, errors."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from replaymoe import cli
from replaymoe.inspect_cli import main
from replaymoe.trace import RoutingTrace


@pytest.fixture
def traces(generator):
    rng = np.random.default_rng(int(generator.initial_seed()))
    ids = np.argsort(rng.random((12, 3, 16)), axis=-1)[..., :4]
    ids[:2] = -1  # a 2-token prefix-cache hit
    a = RoutingTrace(ids, num_experts=16, top_k=4, layer_ids=[1, 2, 3], model_id="toy/moe")
    b_ids = a.ids.copy()
    b_ids[5, 1] = np.setdiff1d(np.arange(16), b_ids[5, 1])[:4]  # token 5 differs in layer 1
    return a, RoutingTrace(b_ids, num_experts=16, top_k=4, layer_ids=[1, 2, 3], model_id="toy/moe")


def test_inspect_table_compare_heatmap(tmp_path, traces, capsys):
    a, b = traces
    a.save(tmp_path / "a.trace")
    b.save(tmp_path / "b.trace")
    png = tmp_path / "heat.png"
    rc = main([str(tmp_path / "a.trace"), "--heatmap", str(png), "--compare", str(tmp_path / "b.trace")])
    out = capsys.readouterr().out
    assert rc == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "tokens: 12" in out and "layers: 3" in out and "top_k: 4" in out and "experts: 16" in out
    assert "missing: 16.67%" in out  # 2 of 12 tokens
    lines = [ln.split() for ln in out.splitlines()]
    header = next(ln for ln in lines if ln[:2] == ["layer", "model_layer"])
    assert header[-2:] == ["agree", "compared"]
    layer1 = next(ln for ln in lines if ln[:2] == ["1", "2"])
    assert layer1[-2:] == [f"{9 / 10:.4f}", "10"]  # 10 compared tokens, one differs
    assert "0.9000 of 10 tokens identical in every layer (2 excluded" in out


def test_inspect_via_cli_dispatch_and_vllm_json(tmp_path, traces, capsys):
    a, _ = traces
    full = a.replace(ids=a.ids[2:], token_offset=0)
    buf = io.BytesIO()
    np.save(buf, full.ids.astype(np.uint8))
    resp = {
        "model": "toy/moe",
        "choices": [{"index": 0, "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
    }
    (tmp_path / "resp.json").write_text(json.dumps(resp))
    (tmp_path / "b64.txt").write_text(a.replace(ids=a.ids[2:]).to_vllm())
    assert cli.main(["inspect", str(tmp_path / "resp.json"), "--num-experts", "16"]) == 0
    out = capsys.readouterr().out
    assert "tokens: 10" in out and "experts: 16" in out and "missing: 0.00%" in out
    assert main([str(tmp_path / "b64.txt")]) == 0
    assert "(inferred)" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"PK\x03\x04garbage", b"{broken json", b"@@not base64@@"])
def test_inspect_errors_name_the_file(tmp_path, content, capsys):
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    assert main([str(path)]) == 1
    assert str(path) in capsys.readouterr().err


def test_inspect_missing_file(tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 1
    assert "absent" in capsys.readouterr().err

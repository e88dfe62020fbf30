"""`replaymoe demo` end to end on the CPU (fast mode), and its vLLM round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from replaymoe.demo import main  # noqa: E402
from replaymoe.trace import RoutingTrace  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are latency-bound; one intra-op thread avoids OpenMP barrier stalls under -n 2."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # default; grouped routing + dense layer
def test_demo_fast_writes_files(arch, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--fast", "--quiet", "--device", "cpu", "--model-config", arch, "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for needle in ("router agreement", "max |Δ log-prob|", "gradients reach the router", "heatmap"):
        assert needle in text
    traces = sorted((out / "traces").glob("seq*.rmtrace"))
    assert len(traces) == 4
    loaded = [RoutingTrace.load(p) for p in traces]
    assert all(t.missing_fraction() == 0.0 and t.num_tokens > 8 for t in loaded)
    png = (out / "heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agreement_replay"] == [1.0] * len(summary["layer_ids"])
    assert summary["agreement_replay_all_layers"] == 1.0
    assert min(summary["agreement_native"]) < 1.0  # the perturbation moved some tokens
    assert summary["max_abs_dlogprob_replay"] < summary["max_abs_dlogprob_native"]
    assert all(np.isfinite(g) and g > 0 for g in summary["router_grad_norm_replay"])

    if arch != "qwen3_moe":
        return
    # the vLLM-style response it wrote replays back into the trainer forward
    resp = out / "vllm_response_seq0.json"
    rc = main(
        [
            "--fast",
            "--quiet",
            "--device",
            "cpu",
            "--model-config",
            arch,
            "--out",
            str(out),
            "--from-vllm",
            str(resp),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "vLLM response" in text and "ids identical to the response's: True" in text


def test_demo_from_vllm_mismatch_is_a_clear_error(tmp_path, capsys):
    # a response recorded from another model (top-4 of 16 experts) cannot replay into the fast model
    from replaymoe.trace import RoutingTrace

    ids = np.argsort(np.random.default_rng(0).random((9, 3, 16)), axis=-1)[..., :4]
    resp = {
        "prompt_token_ids": [5, 6, 7, 8],
        "choices": [
            {"token_ids": [9] * 6, "routed_experts": RoutingTrace(ids, num_experts=16, top_k=4).to_vllm()}
        ],
    }
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(resp))
    rc = main(
        ["--fast", "--quiet", "--device", "cpu", "--out", str(tmp_path / "o"), "--from-vllm", str(path)]
    )
    assert rc == 2
    assert "top_k" in capsys.readouterr().err


def test_demo_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        main(["--tokens", "1"])
    with pytest.raises(SystemExit):
        main(["--model-config", "llama"])

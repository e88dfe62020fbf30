"""`replaymoe demo` end to end on the CPU (fast mode), and its vLLM round trip."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import replaymoe.apps.demo as demo_mod  # noqa: E402
from replaymoe.apps.demo import main  # noqa: E402
from replaymoe.record.trace import RoutingTrace  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # every test here: one intra-op thread (conftest)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # default; grouped routing + dense layer
def test_demo_fast_writes_files(arch, tmp_path, capsys):
    out = tmp_path / "out"
    # no --quiet: the progress bar is on, but stderr is not a terminal here, so tqdm prints nothing
    rc = main(["--fast", "--device", "cpu", "--model-config", arch, "--out", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    text = cap.out
    assert "\r" not in cap.err and "\r" not in text
    for needle in (
        "router agreement per layer",
        "R3 figures",
        "router decisions (token, layer) that differ",
        "tokens that differ in >= 1 layer",
        "mean KL(rollout || trainer)",
        "extreme tokens: |Δ log-prob| > ln 2",
        "under replay |Δ log-prob| is not 0",
        "gradients reach the router",
        "backend: torch reference",
        "picture",
    ):
        assert needle in text, needle
    traces = sorted((out / "traces").glob("seq*.rmtrace"))
    assert len(traces) == 4
    loaded = [RoutingTrace.load(p) for p in traces]
    assert all(t.missing_fraction() == 0.0 and t.num_tokens > 8 for t in loaded)
    png = (out / "heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    L = len(summary["layer_ids"])
    # the labels use the model's layer numbers (DeepSeek-V3's first layer is dense: L1..L3)
    assert ("L0:" in text) == (summary["layer_ids"][0] == 0)
    assert all(f"L{n}:" in text for n in summary["layer_ids"])
    assert summary["agreement_replay"] == [1.0] * L
    assert summary["agreement_replay_all_layers"] == 1.0
    assert min(summary["agreement_native"]) < 1.0  # the perturbation moved some tokens
    assert summary["max_abs_dlogprob_replay"] < summary["max_abs_dlogprob_native"]
    assert all(np.isfinite(g) and g > 0 for g in summary["router_grad_norm_replay"])
    # counts: the rollout's routed tokens are the traces' positions; the trainer sees one more per
    # sequence (the last sampled token), which falls back to native routing in every layer
    routed = sum(t.num_tokens for t in loaded)
    assert summary["rollout_routed_tokens"] == routed and f"= {routed} routed tokens" in text
    assert summary["replay_tokens_per_layer"] == [routed + 4] * L
    assert summary["replay_fallback_tokens_per_layer"] == [4] * L
    # R3 figures: replay removes every routing difference; native routing has some
    nat, rep = summary["r3_native"], summary["r3_replay"]
    assert rep["decisions_differ"] == 0.0 and rep["tokens_differ_any_layer"] == 0.0
    assert 0 < nat["decisions_differ"] <= nat["tokens_differ_any_layer"] <= 1
    assert nat["tokens_differ_any_layer"] == pytest.approx(1 - summary["agreement_native_all_layers"])
    assert 0 <= rep["mean_kl_rollout_trainer"] < nat["mean_kl_rollout_trainer"]
    for r in (nat, rep):
        assert 0 <= r["extreme_token_share"] <= 1
    assert summary["generated_tokens"] == 4 * 8

    # the vLLM-style response it wrote (vLLM 0.33's layout: a column per decoder layer, DeepSeek-V3's
    # dense layer 0 all zero, uint8) replays back into the trainer forward, the layer ids being the model's
    resp = out / "vllm_response_seq0.json"
    payload = json.loads(resp.read_text())["choices"][0]["routed_experts"]
    arr = np.load(io.BytesIO(base64.b64decode(payload)))
    assert arr.dtype == np.uint8 and arr.shape[1] == 3  # num_hidden_layers of the fast model
    assert (arr[:, 0] == 0).all() == (arch == "deepseek_v3")
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


def _from_vllm_run(tmp_path, ids, num_experts: int) -> int:
    """The fast demo on a vLLM response of 4 prompt and 6 completion tokens routed by ``ids`` [9, 3, K]."""
    trace = RoutingTrace(ids, num_experts=num_experts, top_k=ids.shape[2])
    resp = {
        "prompt_token_ids": [5, 6, 7, 8],
        "choices": [{"token_ids": [9] * 6, "routed_experts": trace.to_vllm()}],
    }
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(resp))
    return main(
        ["--fast", "--quiet", "--device", "cpu", "--out", str(tmp_path / "o"), "--from-vllm", str(path)]
    )


def test_demo_from_vllm_mismatch_is_a_clear_error_before_the_run(tmp_path, capsys):
    # a response recorded from another model (top-4 of 16 experts) cannot replay into the fast model
    ids = np.argsort(np.random.default_rng(0).random((9, 3, 16)), axis=-1)[..., :4]
    rc = _from_vllm_run(tmp_path, ids, 16)
    assert rc == 2
    cap = capsys.readouterr()
    assert "top_k" in cap.err and cap.err.startswith("replaymoe demo: error: --from-vllm")
    assert "rollout:" not in cap.out  # checked right after the model is built, before generate


@pytest.mark.parametrize("rows", [[4], [1, 2]], ids=["last-row", "middle-rows"])
def test_demo_from_vllm_rows_without_routing_fail_before_the_run(tmp_path, rows, capsys):
    # int32 rows of -1 (no routing) in a response of the fast model's shape: the replay refused them
    # mid-run (missing="error") with a traceback and exit 1, the code of "no router gradient"
    ids = np.argsort(np.random.default_rng(0).random((9, 3, 8)), axis=-1)[..., :2].astype(np.int32)
    ids[rows] = -1
    rc = _from_vllm_run(tmp_path, ids, 8)
    cap = capsys.readouterr()
    assert rc == 2 and len(cap.err.strip().splitlines()) == 1 and cap.out == ""
    assert f"pair(s) of -1 (no routing), the first at position {rows[0]}, MoE layer 0" in cap.err
    assert not (tmp_path / "o").exists()  # nothing written


def _trace_file(tmp_path):
    path = tmp_path / "seq0.rmtrace"
    ids = np.argsort(np.random.default_rng(1).random((5, 3, 8)), axis=-1)[..., :2]
    RoutingTrace(ids, num_experts=8, top_k=2).save(path)
    return path


@pytest.mark.parametrize(
    "make, says",
    [
        (_trace_file, "replaymoe trace file"),  # a .rmtrace, not the response JSON (was a utf-8 error)
        (lambda d: (d / "r.json").write_text("{not json") and d / "r.json", "invalid JSON"),
        (
            lambda d: (d / "r.json").write_text('{"choices": []}') and d / "r.json",
            "the response has no choices",
        ),
        (  # chat response without return_token_ids: nothing to check the rows against
            lambda d: (d / "r.json").write_text('{"choices": [{"routed_experts": "AAAA"}]}') and d / "r.json",
            "expected a response with token ids (return_token_ids: true)",
        ),
        (lambda d: d / "absent.json", "cannot read"),  # no such file
    ],
)
def test_demo_from_vllm_bad_files_fail_before_the_run(tmp_path, make, says, capsys):
    path = make(tmp_path)
    rc = main(
        ["--fast", "--quiet", "--device", "cpu", "--out", str(tmp_path / "o"), "--from-vllm", str(path)]
    )
    assert rc == 2
    cap = capsys.readouterr()
    assert says in cap.err and len(cap.err.strip().splitlines()) == 1 and cap.out == ""


@pytest.mark.parametrize(
    "where, says",
    [
        ("file", "expected a directory, got an existing file"),  # --out is a file
        ("file/sub", "cannot create or write"),  # below a file: NotADirectoryError
    ],
)
def test_demo_bad_out_is_a_clear_error(tmp_path, where, says, capsys):
    (tmp_path / "file").write_text("x")
    rc = main(["--fast", "--quiet", "--device", "cpu", "--out", str(tmp_path / where)])
    assert rc == 2
    cap = capsys.readouterr()
    assert cap.err.startswith(f"replaymoe demo: error: --out {tmp_path / where}") and says in cap.err
    assert cap.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens", "1"],  # fewer than 2 new tokens
        ["--model-config", "llama"],  # not a supported MoE architecture
        ["--perturb", "-1"],  # a negative perturbation
        ["--perturb", "nan"],  # not a number
        ["--prompts", "0"],
    ],
)
def test_demo_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_demo_triton_on_cpu_reruns_itself_under_the_interpreter(tmp_path, monkeypatch, capsys):
    # Triton reads TRITON_INTERPRET at import, so the demo starts a fresh process with it set
    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(demo_mod.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    argv = ["--fast", "--quiet", "--device", "cpu", "--backend", "triton", "--out", str(tmp_path)]
    assert main(argv) == 0
    ((cmd, env),) = calls
    assert cmd[1:4] == ["-m", "replaymoe", "demo"] and cmd[4:] == argv and env["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def _cli_demo(argv, capsys):
    from replaymoe.apps import cli

    rc = cli.main(["demo", "--fast", "--quiet", "--device", "cpu", *argv])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap


@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda d: (d / "heatmap.png").mkdir(),
            "heatmap.png is a directory",
        ),  # was IsADirectoryError, exit 1
        (lambda d: (d / "summary.json").mkdir(), "summary.json is a directory"),  # ... after the whole run
        (lambda d: (d / "vllm_response_seq0.json").mkdir(), "vllm_response_seq0.json is a directory"),
        (lambda d: (d / "traces" / "seq3.rmtrace").mkdir(parents=True), "seq3.rmtrace is a directory"),
        (lambda d: (d / "traces").write_text("x"), "traces is a file"),
    ],
)
def test_demo_unwritable_outputs_fail_before_the_run(tmp_path, make, says, capsys):
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    rc, cap = _cli_demo(["--out", str(out)], capsys)
    assert rc == 2
    assert cap.err.startswith(f"replaymoe demo: error: --out {out}: ") and says in cap.err
    assert len(cap.err.strip().splitlines()) == 1 and cap.out == ""  # before the model is even built


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_demo_read_only_traces_fail_before_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "traces").mkdir(parents=True)
    (out / "traces").chmod(0o555)
    try:
        rc, cap = _cli_demo(["--out", str(out)], capsys)
    finally:
        (out / "traces").chmod(0o755)
    assert rc == 2 and "cannot create or write the directory" in cap.err and "traces" in cap.err
    assert len(cap.err.strip().splitlines()) == 1 and cap.out == ""


def test_demo_from_vllm_tokens_and_rows_must_match(tmp_path, capsys):
    # 9 tokens (4 prompt + 5 completion) but 29 routed rows: was replayed anyway, exit 0 after
    # "ids identical to the response's: False"
    ids = np.argsort(np.random.default_rng(0).random((29, 3, 8)), axis=-1)[..., :2]  # the fast model's shape
    resp = {
        "prompt_token_ids": [5, 6, 7, 8],
        "choices": [
            {"token_ids": [9] * 5, "routed_experts": RoutingTrace(ids, num_experts=8, top_k=2).to_vllm()}
        ],
    }
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(resp))
    rc, cap = _cli_demo(["--out", str(tmp_path / "o"), "--from-vllm", str(path)], capsys)
    assert rc == 2 and cap.out == ""
    (line,) = cap.err.strip().splitlines()
    assert line.startswith(f"replaymoe demo: error: --from-vllm {path}: vLLM routed_experts: 29 rows")
    assert "expected 8 (4 prompt + 5 completion tokens - 1 - prompt_start 0" in line


def _fast_model_response(rows, *, endpoint, start=0, dense_first=False):
    """A vLLM 0.33 response for the fast model (3 layers, top-2 of 8): uint8, one column per decoder
    layer (layer 0 all zero with ``dense_first``), rows from ``start``; /v1/completions puts the
    prompt ids in the choice, chat at the top level."""
    ids = np.argsort(np.random.default_rng(3).random((rows, 3, 8)), axis=-1)[..., :2].astype(np.uint8)
    if dense_first:
        ids[:, 0] = 0
    buf = io.BytesIO()
    np.save(buf, ids[start:])
    prompt, completion = [5, 6, 7, 8], [9, 10, 11, 12, 13][: rows + 1 - 4]
    choice = {
        "index": 0,
        "token_ids": completion,
        "routed_experts": base64.b64encode(buf.getvalue()).decode(),
    }
    resp = {"model": "m", "choices": [choice]}
    if endpoint == "completions":
        choice["prompt_token_ids"] = prompt
    else:
        resp["prompt_token_ids"] = prompt
    return resp


@pytest.mark.parametrize(
    "resp, argv, says",
    [
        (  # a response from a model whose layer 0 is dense, replayed into the all-MoE fast model
            _fast_model_response(8, endpoint="chat", dense_first=True),
            [],
            "take all 3 columns as MoE layers",
        ),
        (  # --layer-ids other than the model's: column 0 holds ids, so it is no dense layer
            _fast_model_response(8, endpoint="chat"),
            ["--layer-ids", "1,2"],
            "layer column 0 is not in layer_ids [1, 2]",
        ),
        (  # /v1/completions, rows from position 2, --prompt-start not given: the hint names it
            _fast_model_response(8, endpoint="completions", start=2),
            [],
            "6 rows, expected 8 (4 prompt + 5 completion tokens - 1 - prompt_start 0",
        ),
    ],
)
def test_demo_from_vllm_layers_and_prompt_start_fail_before_the_run(tmp_path, resp, argv, says, capsys):
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(resp))
    rc, cap = _cli_demo(["--out", str(tmp_path / "o"), "--from-vllm", str(path), *argv], capsys)
    assert rc == 2 and cap.out == ""
    (line,) = cap.err.strip().splitlines()
    assert line.startswith(f"replaymoe demo: error: --from-vllm {path}: ") and says in line, line


def test_demo_from_vllm_completions_response_with_a_prompt_start(tmp_path, capsys):
    # /v1/completions (prompt ids in the choice), routed_experts_prompt_start = 2: positions 0, 1 replay
    # natively, the rest replays the response's ids
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(_fast_model_response(8, endpoint="completions", start=2)))
    rc, cap = _cli_demo(
        ["--out", str(tmp_path / "o"), "--from-vllm", str(path), "--prompt-start", "2"], capsys
    )
    assert rc == 0, cap.err
    assert "token_offset=2" in cap.out and "ids identical to the response's: True" in cap.out
    assert "3 token(s) in each MoE layer without routing" in cap.out  # positions 0, 1 and the last token


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-start", "1"],  # without --from-vllm
        ["--from-vllm", "r.json", "--prompt-start", "-1"],  # negative
        ["--from-vllm", "r.json", "--layer-ids", "1,x"],  # not numbers
        ["--from-vllm", "r.json", "--layer-ids", "1,1"],  # repeated
    ],
)
def test_demo_rejects_bad_from_vllm_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("--prompt-start" in err) or ("--layer-ids" in err)


def _oov_response(d):  # a prompt token id past the fast model's vocabulary of 64
    resp = _fast_model_response(8, endpoint="chat")
    resp["prompt_token_ids"][1] = 10**9
    (d / "oov.json").write_text(json.dumps(resp))
    return d / "oov.json"


def _other_model_response(d):  # top-4 of 16 experts: does not fit the fast model (checked after its build)
    ids = np.argsort(np.random.default_rng(0).random((8, 3, 16)), axis=-1)[..., :4]
    resp = {
        "prompt_token_ids": [5, 6, 7, 8],
        "choices": [
            {"token_ids": [9] * 5, "routed_experts": RoutingTrace(ids, num_experts=16, top_k=4).to_vllm()}
        ],
    }
    (d / "other.json").write_text(json.dumps(resp))
    return d / "other.json"


def _fifo(d):  # a pipe nobody writes to: open() would wait forever
    os.mkfifo(d / "pipe")
    return d / "pipe"


@pytest.mark.parametrize(
    "make, says",
    [
        # was the whole demo run, files written, then an IndexError traceback (exit 1)
        (_oov_response, "prompt_token_ids[1] is 1000000000, outside the demo model's vocabulary of 64"),
        (lambda d: d / "absent.json", "cannot read"),  # was exit 2 but ./replaymoe_out/traces created
        (_other_model_response, "top_k"),  # refused after the model's build, still before --out
        (lambda d: "/dev/zero", "/dev/zero: not a regular file (a character device)"),  # was MemoryError
        pytest.param(
            _fifo,
            "not a regular file (a pipe)",  # was a hang
            marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes"),
        ),
    ],
)
def test_demo_bad_from_vllm_is_refused_before_anything_is_written(tmp_path, make, says, capsys):
    out = tmp_path / "o"
    path = make(tmp_path)
    rc, cap = _cli_demo(["--out", str(out), "--from-vllm", str(path)], capsys)
    assert rc == 2 and cap.out == ""
    (line,) = cap.err.strip().splitlines()
    assert line.startswith(f"replaymoe demo: error: --from-vllm {path}") and says in line, line
    assert not out.exists()  # nothing created


def test_demo_from_vllm_empty_name_is_a_bad_option(capsys):
    # was ignored: the demo ran without the vLLM replay, exit 0
    with pytest.raises(SystemExit) as exc:
        main(["--fast", "--from-vllm", ""])
    assert (
        exc.value.code == 2
        and "--from-vllm: expected a file name, got an empty string" in capsys.readouterr().err
    )


def test_demo_from_vllm_reads_a_bom_and_a_null_choice_prompt(tmp_path, capsys):
    # a UTF-8 byte-order mark, and "prompt_token_ids": null in the choice beside the chat's top-level list
    resp = _fast_model_response(8, endpoint="chat")
    resp["choices"][0]["prompt_token_ids"] = None
    path = tmp_path / "resp.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(resp).encode())
    rc, cap = _cli_demo(["--out", str(tmp_path / "o"), "--from-vllm", str(path)], capsys)
    assert rc == 0, cap.err
    assert "ids identical to the response's: True" in cap.out

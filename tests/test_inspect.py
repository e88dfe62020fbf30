"""`replaymoe inspect` on small traces: the table, --compare, --heatmap, vLLM inputs, errors."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

from replaymoe.apps import cli
from replaymoe.apps.inspect import MAX_INPUT_BYTES, main
from replaymoe.record.trace import RoutingTrace


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


def _b64_npy(arr, allow_pickle=False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue())


@pytest.mark.parametrize(
    "content, says",
    [
        (b"PK\x03\x04garbage", ""),  # a truncated trace file (zip magic, no archive)
        (b"{broken json", "invalid JSON"),
        (b"@@not base64@@", "not a routing trace: text starting '@@not base64@@'"),
        (b"", "empty file"),  # nothing at all
        (b"  \n", "empty file"),  # only whitespace
        (b"hello world this is text\n", "text starting 'hello world"),  # valid base64 alphabet, not .npy
        (base64.b64encode(b"some bytes that are no npy"), "not the base64 of a .npy array"),
        (_b64_npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), "Python objects"),  # pickled
        (_b64_npy(np.zeros((2, 3, 4), dtype=np.float32)), "float32 values"),  # not integer ids
        (_b64_npy(np.zeros((2, 3), dtype=np.int32)), "shape (2, 3)"),  # not (tokens, layers, top_k)
        (b"\x89PNG\r\n\x1a\n\x00\x00", "binary data"),  # an image passed by mistake
        (b"[1, 2, 3]", "text starting '[1, 2, 3]'"),  # JSON, but neither a response nor a choice
    ],
)
def test_inspect_errors_name_the_file(tmp_path, content, says, capsys):
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"replaymoe inspect: error: {path}") and says in err
    assert "allow_pickle" not in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_inspect_pickled_payload_inside_a_response(tmp_path, capsys):
    # the same bad payload inside a vLLM response JSON: numpy's allow_pickle wording is not shown
    obj = np.array([{"a": 1}], dtype=object)
    resp = {"choices": [{"routed_experts": _b64_npy(obj, allow_pickle=True).decode()}]}
    (tmp_path / "r.json").write_text(json.dumps(resp))
    assert main([str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "Python objects" in err and "allow_pickle" not in err


def test_inspect_missing_file(tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_inspect_heatmap_format_follows_the_suffix(tmp_path, traces, suffix, magic, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    out = tmp_path / f"heat{suffix}"
    assert main([str(tmp_path / "a.trace"), "--heatmap", str(out)]) == 0
    assert out.read_bytes()[: len(magic)] == magic


@pytest.mark.parametrize(
    "where, says",
    [
        ("heat.txt", "ending in .png"),  # not an image format
        ("nodir/heat.png", "existing directory"),  # parent missing
        (".", "directory"),  # a directory, not a file
    ],
)
def test_inspect_heatmap_bad_path_fails_before_any_output(tmp_path, traces, where, says, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    assert main([str(tmp_path / "a.trace"), "--heatmap", str(tmp_path / where)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "--heatmap" in cap.err and says in cap.err


@pytest.mark.parametrize("num_experts", [8, 32])  # smaller, larger than the recorded E = 16
def test_inspect_num_experts_contradicting_the_trace(tmp_path, traces, num_experts, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    assert main([str(tmp_path / "a.trace"), "--num-experts", str(num_experts)]) == 2
    err = capsys.readouterr().err
    assert "--num-experts" in err and "the trace's own 16" in err and f"got {num_experts}" in err


@pytest.mark.parametrize("argv", [["--num-experts", "0"], ["--choice", "-1"]])  # below the minimum
def test_inspect_rejects_bad_numbers(tmp_path, traces, argv, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "a.trace"), *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_inspect_num_experts_below_the_ids_of_a_vllm_payload(tmp_path, traces, capsys):
    a, _ = traces
    (tmp_path / "b64.txt").write_text(a.replace(ids=a.ids[2:]).to_vllm())  # vLLM records no E
    top = int(a.ids.max())
    assert main([str(tmp_path / "b64.txt"), "--num-experts", str(top)]) == 2
    assert f"largest expert id {top}" in capsys.readouterr().err
    assert main([str(tmp_path / "b64.txt"), "--num-experts", str(top + 1)]) == 0
    assert f"experts: {top + 1}" in capsys.readouterr().out


def test_inspect_compare_different_lengths_warns(tmp_path, traces, capsys):
    a, b = traces
    a.save(tmp_path / "a.trace")
    b.replace(ids=b.ids[:7]).save(tmp_path / "b.trace")  # positions 0..6 of 0..11
    assert main([str(tmp_path / "a.trace"), "--compare", str(tmp_path / "b.trace")]) == 0
    out = capsys.readouterr().out
    a_name, b_name = tmp_path / "a.trace", tmp_path / "b.trace"
    assert f"warning: the traces cover different positions (0..11 in {a_name} vs 0..6 in {b_name})" in out
    assert "only the 7 positions in both are compared" in out
    # the excluded tokens say why: 5 positions only A covers (was "7 excluded as missing"), 2 rows of -1
    assert f"(7 excluded: 5 only in {a_name} (positions 7..11); 2 in both but missing (-1) in some" in out


def test_inspect_compare_says_which_side_covers_what(tmp_path, traces, capsys):
    a, b = traces
    a.replace(ids=a.ids[2:7], token_offset=2).save(tmp_path / "a.trace")  # positions 2..6
    b.replace(ids=b.ids[4:], token_offset=4).save(tmp_path / "b.trace")  # positions 4..11
    assert main([str(tmp_path / "a.trace"), "--compare", str(tmp_path / "b.trace")]) == 0
    out = capsys.readouterr().out
    assert "missing (-1)" not in out  # every row of both is recorded
    assert (
        f"(7 excluded: 2 only in {tmp_path / 'a.trace'} (positions 2..3); "
        f"5 only in {tmp_path / 'b.trace'} (positions 7..11))"
    ) in out


def test_inspect_compare_other_shape_is_an_error(tmp_path, traces, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    RoutingTrace(a.ids[:, :2], num_experts=16, top_k=4).save(tmp_path / "b.trace")  # 2 layers, not 3
    assert main([str(tmp_path / "a.trace"), "--compare", str(tmp_path / "b.trace")]) == 2
    assert "2 layers" in capsys.readouterr().err


# ----------------------------------------------------------------------------- vLLM 0.33 inputs, refusals


def _resp(rows, *, endpoint="chat", prompt=(1, 2, 3, 4), completion=(5, 6, 7, 8, 9)):
    """A vLLM response with ``return_token_ids: true`` (chat: prompt ids at the top level;
    /v1/completions: in the choice)."""
    choice = {"index": 0, "token_ids": list(completion), "routed_experts": _b64_npy(rows).decode()}
    resp = {"model": "toy/moe", "choices": [choice]}
    if endpoint == "chat":
        resp["prompt_token_ids"] = list(prompt)
    else:
        choice["prompt_token_ids"] = list(prompt)
    return resp


def _all_layers(n, seed=0):
    """[n, 4, 2] uint8 as vLLM 0.33 sends it for a model whose layer 0 is dense (all zero)."""
    out = np.zeros((n, 4, 2), np.uint8)
    out[:, 1:] = np.argsort(np.random.default_rng(seed).random((n, 3, 8)), axis=-1)[..., :2]
    return out


def _one_error_line(rc, capsys, *needles):
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and "Traceback" not in cap.err
    (line,) = cap.err.strip().splitlines()
    assert line.startswith("replaymoe inspect: error: ")
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "layer column(s) 0 of 4 are all zero"),  # a dense layer's zero column: never guessed
        (["--layer-ids", "1,2,3"], None),  # the MoE layers named: their columns are read
        # the dense layer named as MoE (check's form, a number per column): refused, naming inspect's form
        (
            ["--layer-ids", "0,1,2,3"],
            "take all 4 columns as MoE layers, so MoE layer(s) 0 hold no expert ids",
        ),
        (["--layer-ids", "0,1,2,3"], "--layer-ids names the MoE layers only here"),
        (["--layer-ids", "2,3"], "layer column 1 is not in layer_ids [2, 3]"),  # a MoE layer left out
    ],
)
def test_inspect_vllm_all_layer_columns(tmp_path, argv, says, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_resp(_all_layers(8))))
    rc = cli.main(["inspect", str(path), *argv])
    if says is None:
        out = capsys.readouterr().out
        assert rc == 0 and "layers: 3" in out and "tokens: 8" in out
        assert [ln.split()[1] for ln in out.splitlines() if ln.split()[:1] in (["0"], ["1"], ["2"])] == [
            "1",
            "2",
            "3",
        ]  # the model_layer column shows the layer numbers
    else:
        _one_error_line(rc, capsys, str(path), says)


@pytest.mark.parametrize(
    "endpoint, rows, argv, says",
    [
        ("chat", 8, [], None),  # 4 prompt + 5 completion - 1 rows
        ("completions", 8, [], None),  # /v1/completions: prompt_token_ids inside the choice
        ("completions", 20, [], "20 rows, expected 8 (4 prompt + 5 completion tokens"),  # another request's
        ("chat", 9, [], "9 rows, expected 8"),  # one row too many
        ("chat", 6, ["--prompt-start", "2"], None),  # rows from position 2
        ("chat", 6, [], "routed_experts_prompt_start=2 gives 6 rows"),  # the start not passed: the hint
        ("chat", 8, ["--prompt-start", "5"], "prompt_start: expected at most the prompt's 4 tokens, got 5"),
    ],
)
def test_inspect_vllm_rows_fit_the_token_counts(tmp_path, endpoint, rows, argv, says, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_resp(_all_layers(rows)[:, 1:], endpoint=endpoint)))
    rc = main([str(path), *argv])
    if says is None:
        out = capsys.readouterr().out
        start = int(argv[1]) if argv else 0
        assert rc == 0 and f"tokens: {rows} (positions {start}..7)" in out
    else:
        _one_error_line(rc, capsys, str(path), says)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: d / "nochoices.json", 'has no choices ("choices": [])'),  # was blamed on --choice 0
        (lambda d: d / "zero_rows.json", "no routed rows (0 tokens)"),  # was exit 0 and a table of nan
        (lambda d: "/dev/zero", "not a regular file (a character device)"),  # was read until MemoryError
        (lambda d: d / "sparse.trace", f"{(1 << 30) + 1} bytes, more than the 1024 MiB"),  # refused unread
        (lambda d: d, "not a regular file (a directory)"),
    ],
)
def test_inspect_refuses_inputs_before_reading_them(tmp_path, make, says, capsys):
    (tmp_path / "nochoices.json").write_text('{"choices": []}')
    empty = {"choices": [{"routed_experts": _b64_npy(np.zeros((0, 2, 2), np.uint8)).decode()}]}
    (tmp_path / "zero_rows.json").write_text(json.dumps(empty))
    (tmp_path / "sparse.trace").touch()
    os.truncate(tmp_path / "sparse.trace", MAX_INPUT_BYTES + 1)  # sparse: no disk used, as `truncate -s`
    path = make(tmp_path)
    _one_error_line(main([str(path)]), capsys, str(path), says)


@pytest.mark.parametrize(
    "b_tokens, argv, ok",
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [], True),  # the same sequence: compared
        ([11, 12, 13, 14, 15, 16, 17, 18, 19], [], False),  # another sequence, same length: refused
        ([11, 12, 13, 14, 15, 16, 17, 18, 19], ["--ignore-tokens"], True),  # the explicit opt-out
        ([1, 2, 3, 4, 5, 6, 7, 80, 9], [], False),  # one token differs (position 7)
    ],
)
def test_inspect_compare_refuses_different_token_sequences(tmp_path, b_tokens, argv, ok, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_resp(_all_layers(8, seed=1)[:, 1:])))
    b.write_text(
        json.dumps(_resp(_all_layers(8, seed=2)[:, 1:], prompt=b_tokens[:4], completion=b_tokens[4:]))
    )
    rc = main([str(a), "--compare", str(b), *argv])
    if ok:
        assert rc == 0 and "agreement:" in capsys.readouterr().out
    else:
        line = _one_error_line(rc, capsys, str(a), str(b), "hold different tokens", "--ignore-tokens")
        assert "position 7: 8 vs 80" in line or "position 0: 1 vs 11" in line


def test_inspect_layer_ids_and_a_trace_file(tmp_path, traces, capsys):
    a, _ = traces  # records layer_ids 1, 2, 3
    a.save(tmp_path / "a.trace")
    assert main([str(tmp_path / "a.trace"), "--layer-ids", "1,2,3"]) == 0  # the same: fine
    capsys.readouterr()
    rc = main([str(tmp_path / "a.trace"), "--layer-ids", "0,1,2"])
    _one_error_line(rc, capsys, "--layer-ids", "expected the layer ids", "1,2,3", "got 0,1,2")


@pytest.mark.parametrize(
    "argv",
    [
        ["--layer-ids", "1,x"],  # not a number
        ["--layer-ids", "1,1"],  # repeated
        ["--layer-ids", "-1,2"],  # negative
        ["--prompt-start", "-1"],  # below the minimum
    ],
)
def test_inspect_rejects_bad_layer_ids_and_prompt_start(tmp_path, traces, argv, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "a.trace"), *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


# ----------------------------------------------------------------------------- nothing to summarise, options


def _fifo(d):  # a pipe nobody writes to: open() would wait forever
    os.mkfifo(d / "pipe")
    return d / "pipe"


def _write(d, name, obj):
    (d / name).write_text(json.dumps(obj))
    return d / name


@pytest.mark.parametrize(
    "make, says",
    [
        # every row -1 (the int16 prefix-cache sentinel): was exit 0, a nan table, "experts: 1 (inferred)"
        (lambda d: _write(d, "r.json", _resp(np.full((8, 3, 2), -1, np.int16))), "no routed rows: all 8"),
        # shape (8, 0, 2): was exit 0, "layers: 0"; top_k 0 likewise
        (lambda d: _write(d, "r.json", _resp(np.zeros((8, 0, 2), np.uint8))), "got shape (8, 0, 2)"),
        (lambda d: _write(d, "r.json", _resp(np.zeros((8, 3, 0), np.uint8))), "got shape (8, 3, 0)"),
        # no tokens at all: was "0 rows, expected -1"
        (
            lambda d: _write(d, "r.json", _resp(np.zeros((0, 3, 2), np.uint8), prompt=(), completion=())),
            "the sequence has no tokens",
        ),  # fmt: skip
        # base64 of bytes that are no .npy file: was "it holds Python objects"
        (
            lambda d: _write(
                d, "r.json", {"choices": [{"routed_experts": base64.b64encode(b"plain").decode()}]}
            ),
            "not an .npy payload",
        ),  # fmt: skip
        # an SGLang response: was "vLLM response carries no routed_experts"
        (
            lambda d: _write(d, "r.json", {"meta_info": {"routed_experts": "AAAA"}, "output_ids": [1]}),
            "an SGLang response (meta_info.routed_experts)",
        ),  # fmt: skip
        pytest.param(
            _fifo,
            "not a regular file (a pipe)",
            marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no pipes"),
        ),  # fmt: skip
    ],
)
def test_inspect_refuses_inputs_with_nothing_to_summarise(tmp_path, make, says, capsys):
    path = make(tmp_path)
    _one_error_line(main([str(path)]), capsys, str(path), says)


def test_inspect_unwritten_column_is_not_blamed_on_layer_ids(tmp_path, capsys):
    # an all-MoE model's column 1 never written, read with the right --layer-ids: was "layer_ids must list
    # the MoE layers only"
    rows = _all_layers(8)[:, 1:]
    rows[:, 1] = 0
    path = _write(tmp_path, "r.json", _resp(rows))
    line = _one_error_line(main([str(path), "--layer-ids", "0,1,2"]), capsys, "column(s) 1 of 3 are all zero")
    assert "never written" in line and "must list the MoE layers only" not in line


def test_inspect_bom_and_null_choice_prompt(tmp_path, capsys):
    # a UTF-8 BOM: was refused as "binary data" (check read it)
    resp = _resp(_all_layers(8)[:, 1:])
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(resp).encode())
    assert main([str(tmp_path / "bom.json")]) == 0
    capsys.readouterr()
    # "prompt_token_ids": null in the choice: the chat's top-level list is used, so 9 rows for 8 are refused
    resp = _resp(_all_layers(9)[:, 1:])
    resp["choices"][0]["prompt_token_ids"] = None
    path = _write(tmp_path, "r.json", resp)
    _one_error_line(main([str(path)]), capsys, "9 rows, expected 8")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--compare", ""], "--compare: expected a file name"),  # was ignored: exit 0, no comparison
        (["--heatmap", ""], "--heatmap: expected a file name"),
        (["--prompt-start", "1,2"], "no --compare"),  # a second start without a second file
        (["--prompt-start", "1,2,3"], "--prompt-start"),
    ],
)
def test_inspect_empty_names_and_bad_prompt_starts_are_bad_options(tmp_path, traces, argv, says, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "a.trace"), *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_inspect_empty_input_name_is_a_bad_option(capsys):
    with pytest.raises(SystemExit) as exc:  # was "cannot read: No such file or directory"
        main([""])
    assert exc.value.code == 2 and "TRACE: expected a file name" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, argv, says",
    [
        ("a.trace", ["--prompt-start", "1"], "--prompt-start: expected none for the replaymoe trace file"),
        ("a.trace", ["--choice", "0"], "--choice: expected none for the replaymoe trace file"),
        ("b64.txt", ["--choice", "1"], "a bare routed_experts payload"),  # was ignored
    ],
)
def test_inspect_refuses_options_that_do_not_apply(tmp_path, traces, name, argv, says, capsys):
    a, _ = traces
    a.save(tmp_path / "a.trace")
    (tmp_path / "b64.txt").write_text(a.to_vllm())
    _one_error_line(main([str(tmp_path / name), *argv]), capsys, says)


def test_inspect_compare_with_two_prompt_starts(tmp_path, capsys):
    # the same sequence from two requests, routed from positions 0 and 2: was impossible to compare (one
    # --prompt-start for both files)
    rows = _all_layers(8)[:, 1:]
    a, b = _write(tmp_path, "a.json", _resp(rows)), _write(tmp_path, "b.json", _resp(rows[2:]))
    assert main([str(a), "--compare", str(b), "--prompt-start", "0,2"]) == 0
    assert "1.0000 of 6 tokens identical in every layer" in capsys.readouterr().out


def test_inspect_compare_with_no_token_in_common(tmp_path, capsys):
    # first half missing in one, second half in the other: was "agreement: nan of 0 tokens", exit 0
    rows = _all_layers(8)[:, 1:].astype(np.int16)
    first, second = rows.copy(), rows.copy()
    first[:4], second[4:] = -1, -1
    a, b = _write(tmp_path, "a.json", _resp(first)), _write(tmp_path, "b.json", _resp(second))
    _one_error_line(main([str(a), "--compare", str(b)]), capsys, "nothing to compare")


@pytest.mark.parametrize(
    "form, dtype, num_experts, says",
    [
        # a uint8 payload cannot hold ids >= 256: was exit 0, "experts: 300"
        ("response", np.uint8, 300, "expected at most 256 for the uint8 payload"),
        ("base64_text", np.uint8, 257, "expected at most 256 for the uint8 payload"),  # one past its edge
        ("response", np.uint8, 256, None),  # ids 0..255: what uint8 holds
        ("response", np.uint16, 300, None),  # vLLM's dtype above 256 experts
    ],
)
def test_inspect_num_experts_beyond_the_payload_dtype(tmp_path, form, dtype, num_experts, says, capsys):
    rows = _all_layers(8).astype(dtype)
    path = tmp_path / "r.json"
    if form == "response":
        path.write_text(json.dumps(_resp(rows)))
    else:
        path.write_bytes(_b64_npy(rows))
    rc = cli.main(["inspect", str(path), "--layer-ids", "1,2,3", "--num-experts", str(num_experts)])
    if says is None:
        assert rc == 0 and f"experts: {num_experts}" in capsys.readouterr().out
    else:
        _one_error_line(rc, capsys, str(path), "--num-experts", says, f"got {num_experts}")

"""`replaymoe check` and `hf.conformance.check_routes`: engine routes against the model's own routing.

Starts from a good capture (a tiny DeepSeek-V3, whose first layer is dense, routes its own
``generate`` with capture on; the routes are written in vLLM 0.33's form: one uint8 column per decoder
layer, the dense one zero), checks it is clean, then fabricates each defect from it and checks that the
report names it and the exit status carries its bit (and only its bit). Input errors exit 2 with one
line on stderr. Everything runs on the CPU, through the real CLI entry with files in ``tmp_path`` and
through the library function.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers.utils import logging as tf_logging  # noqa: E402

import replaymoe.hf as rh  # noqa: E402
from replaymoe.apps import cli  # noqa: E402
from replaymoe.apps.check import _parser  # noqa: E402
from replaymoe.hf.conformance import (  # noqa: E402
    CheckCode,
    EngineRoutes,
    check_routes,
    load_model,
    load_routes,
    routes_from_sglang,
    routes_from_trace,
    routes_from_vllm,
)
from replaymoe.hf.discovery import find_moe_layers  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402
from replaymoe.record.route_check import DEFECT_KINDS  # noqa: E402
from replaymoe.record.route_judge import LayerTies, tie_excused  # noqa: E402

MODEL = ["--model", "tiny:deepseek_v3", "--seed", "0"]
P_LEN, C_LEN = 24, 8  # prompt and completion tokens: 31 rows, enough for a constant layer to be implausible


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _chat(ids: np.ndarray, prompt: list[int], completion: list[int], **extra) -> dict:
    """vLLM 0.33's chat response with return_token_ids: prompt ids at the top level."""
    return {
        "model": "tiny",
        "prompt_token_ids": prompt,
        "choices": [{"index": 0, "token_ids": completion, "routed_experts": _npy_b64(ids), **extra}],
    }


@pytest.fixture(scope="module")
def good():
    """A tiny DeepSeek-V3 (dense layer 0, MoE layers 1 and 2, E=8, K=2) routing its own generate."""
    model = build_model("deepseek_v3", "tiny", seed=0)
    moe = rh.enable(model, capture=True)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 64, (1, P_LEN), generator=g)
    torch.manual_seed(7)
    out = model.generate(prompt, max_new_tokens=C_LEN, do_sample=True)
    (trace,) = moe.traces()
    moe.disable()
    assert trace.layer_ids == (1, 2) and trace.num_tokens == P_LEN + C_LEN - 1
    ids = np.zeros((trace.num_tokens, 3, 2), dtype=np.uint8)  # vLLM 0.33: every decoder layer
    ids[:, [1, 2]] = trace.ids
    # the routes another model (seed 1) gives the same tokens
    other = build_model("deepseek_v3", "tiny", seed=1)
    moe1 = rh.enable(other, capture=True)
    with torch.no_grad():
        other(out[:, :-1], use_cache=False)
    (t1,) = moe1.traces()
    moe1.disable()
    ids1 = np.zeros_like(ids)
    ids1[:, [1, 2]] = t1.ids
    return {
        "model": model,
        "trace": trace,
        "ids": ids,
        "other_ids": ids1,
        "prompt": prompt[0].tolist(),
        "completion": out[0, P_LEN:].tolist(),
    }


def _write(tmp_path, name: str, obj) -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["check", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("replaymoe check: error: "), err
    return lines[0]


# --------------------------------------------------------------------------------------------
# the good capture, then each defect fabricated from it
# --------------------------------------------------------------------------------------------


def _zero_moe(ids, other):  # vLLM #44116: a fused kernel that never writes its routing
    ids[:, 1:] = 0


def _constant(ids, other):  # one expert set at every token of layer 2
    ids[:, 2] = [3, 5]


def _out_of_range(ids, other):  # an id 9 in a model of 8 experts
    ids[3, 1] = [9, ids[3, 1, 1] if ids[3, 1, 1] != 9 else 2]


def _duplicate(ids, other):  # the same expert twice in a row
    ids[5, 2] = [6, 6]


def _out_of_range_twice(ids, other):  # [9, 9]: out of range, and was also counted a duplicate
    ids[4, 1] = [9, 9]


def _dense_column(ids, other):  # dense layer 0's column must stay zero
    ids[7, 0] = [1, 4]


def _extra_column(ids, other):  # 4 columns for a model of 3 decoder / 2 MoE layers
    return np.concatenate([ids, ids[:, :1]], axis=1)


def _at_dtype_max(ids, other):  # 255 in uint8 for E = 8: a -1 cast to unsigned
    ids[2, 1] = [255, ids[2, 1, 1]]


def _drop_first_row(ids, other):  # rows start at position 1 while the request said 0
    return ids[1:]


def _other_model(ids, other):  # another model's routes (a different seed)
    return other.copy()


def _same(ids, other):
    return None


def _one_row_more(ids, other):  # 32 rows for 31 positions: the last sampled token's row sent too
    return np.concatenate([ids, ids[-1:]])


DEFECTS = [
    # (case, fabricate, extra CLI args, expected exit, defect kind reported)
    ("clean", _same, [], 0, None),
    ("all_zero", _zero_moe, [], 8, "all_zero"),
    ("constant", _constant, [], 8, "constant"),
    ("out_of_range", _out_of_range, [], 4, "out_of_range"),
    ("duplicate", _duplicate, [], 4, "duplicate"),
    ("out_of_range_twice", _out_of_range_twice, [], 4, "out_of_range"),
    ("dense_column", _dense_column, [], 16, "dense_column"),
    ("column_count", _extra_column, [], 16, "column_count"),
    ("dtype_max", _at_dtype_max, [], 64, "dtype_overflow"),
    # the prompt start off by one, either way: the rows misaligned, and their count not the tokens'
    ("prompt_start_too_late", _same, ["--prompt-start", "1"], 48, "row_count misaligned"),
    ("rows_start_later", _drop_first_row, [], 48, "row_count misaligned"),
    ("other_model", _other_model, [], 1, "disagreement"),
    # was a note and exit 0: a row count that does not fit the tokens is a layout defect; the rows judged
    ("one_row_more", _one_row_more, [], 16, "row_count"),
]


@pytest.mark.parametrize("case, fabricate, extra, code, kind", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_cli_reports_each_defect_with_its_bit(good, tmp_path, capsys, case, fabricate, extra, code, kind):
    ids = good["ids"].copy()
    new = fabricate(ids, good["other_ids"])
    ids = ids if new is None else new
    path = _write(tmp_path, "resp.json", _chat(ids, good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, *extra], capsys)
    assert err == "" and rc == code, out
    kinds = [] if kind is None else kind.split()
    if kind is None:
        assert "clean" in out and "exit 0" in out
    else:
        assert all(f"{k} [" in out for k in kinds)
        names = " | ".join(c.name for c in CheckCode if c and c & code)
        assert f"exit {code} ({names})" in out
    rc, out, _ = _run([*MODEL, path, *extra, "--json"], capsys)
    d = json.loads(out)
    assert rc == code == d["exit_code"]
    assert [x["kind"] for x in d["defects"]] == kinds


def test_library_good_capture_is_clean(good):
    routes = routes_from_vllm(_chat(good["ids"], good["prompt"], good["completion"]))
    (r,) = routes
    assert (r.rows, r.columns, r.top_k, r.start, r.dtype) == (P_LEN + C_LEN - 1, 3, 2, 0, "uint8")
    report = check_routes(good["model"], routes)
    assert report.ok and report.exit_code == 0 and report.code is CheckCode.OK
    assert report.agreement == 1.0 and report.best_shift == 0
    assert [c.layer for c in report.layers] == [1, 2]
    assert all(c.rows == r.rows and c.agreement == 1.0 for c in report.layers)
    assert report.sequences[0].layout == "decoder" and not report.sequences[0].misaligned
    assert json.loads(json.dumps(report.to_dict()))["exit_code"] == 0
    assert "clean" in str(report)
    assert getattr(good["model"], "_replaymoe", None) is None  # the check disabled its session


def test_library_defect_examples_name_row_layer_and_ids(good):
    ids = good["ids"].copy()
    ids[3, 1] = [9, 2]  # out of range at row 3, layer 1
    ids[:, 2] = [3, 5]  # layer 2 constant
    report = check_routes(good["model"], routes_from_vllm(_chat(ids, good["prompt"], good["completion"])))
    assert report.code == CheckCode.INVALID_IDS | CheckCode.DEGENERATE_ROWS
    oor = report.defect("out_of_range")
    assert (oor.count, oor.first.row, oor.first.position, oor.first.layer, oor.first.ids) == (
        1,
        3,
        3,
        1,
        (9, 2),
    )
    assert report.defect("constant").first.layer == 2
    assert report.layers[1].constant == 1 and report.layers[0].out_of_range == 1


def test_library_misalignment_shift_and_threshold(good):
    base = _chat(good["ids"], good["prompt"], good["completion"])
    report = check_routes(good["model"], routes_from_vllm(base, prompt_start=1))
    assert report.code == CheckCode.LAYOUT | CheckCode.MISALIGNED and report.best_shift == -1
    assert "31 rows, expected 30" in report.defect("row_count").first.note  # one row too many
    assert report.sequences[0].best_shift == -1 and report.sequences[0].misaligned
    other = _chat(good["other_ids"], good["prompt"], good["completion"])
    assert check_routes(good["model"], routes_from_vllm(other)).code == CheckCode.DISAGREEMENT
    # a threshold above the rate passes it: disagreement alone only fails above its threshold
    assert check_routes(good["model"], routes_from_vllm(other), max_disagreement=1.0).ok


def test_uint8_overflow_for_300_experts(tmp_path, capsys):
    # a checkpoint of 300 experts (tiny dims), loaded from its directory; vLLM would send uint16, an
    # engine that casts to uint8 wraps ids >= 256
    model = build_model("qwen3_moe", "tiny", seed=0, num_experts=300)
    model.save_pretrained(tmp_path / "ckpt")
    tokens = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    moe = rh.enable(model, capture=True)
    with torch.no_grad():
        model(tokens[:, :-1], use_cache=False)
    (trace,) = moe.traces()
    moe.disable()
    assert int(trace.ids.max()) >= 256  # some ids need more than 8 bits
    prompt, completion = tokens[0, :30].tolist(), tokens[0, 30:].tolist()
    args = ["--model", str(tmp_path / "ckpt")]
    good16 = _write(tmp_path, "u16.json", _chat(trace.ids.astype(np.uint16), prompt, completion))
    wrapped = _write(tmp_path, "u8.json", _chat(trace.ids.astype(np.uint8), prompt, completion))
    bar = tf_logging.is_progress_bar_enabled()
    capsys.readouterr()  # save_pretrained's own "Writing model shards" bar
    rc, out, err = _run([*args, good16], capsys)
    # stderr empty: transformers' "Loading weights" progress bar was printed there; restored after
    assert rc == 0 and "E=300" in out and err == "", out + err
    assert tf_logging.is_progress_bar_enabled() is bar
    rc, out, err = _run([*args, wrapped], capsys)
    assert rc == int(CheckCode.DTYPE_OVERFLOW), out + err
    assert "dtype_narrow [64]" in out and "uint8 holds ids up to 255; the model has 300 experts" in out
    assert "dtype_overflow [64]" in out  # rows equal to the recomputed ids wrapped into uint8
    report = check_routes(model, load_routes(wrapped))
    assert report.defect("dtype_overflow").count == int((trace.ids >= 256).any(-1).sum())


# --------------------------------------------------------------------------------------------
# the other inputs: /v1/completions, several choices and files, SGLang, trace files, --layer-ids
# --------------------------------------------------------------------------------------------


def test_completions_form_choices_and_several_files(good, tmp_path, capsys):
    ids, p, c = good["ids"], good["prompt"], good["completion"]
    bad = ids.copy()
    bad[:, 1:] = 0
    completions = {  # /v1/completions: both token lists in each choice
        "choices": [
            {"index": i, "prompt_token_ids": p, "token_ids": c, "routed_experts": _npy_b64(x)}
            for i, x in enumerate((ids, bad))
        ]
    }
    path = _write(tmp_path, "completions.json", completions)
    chat = _write(tmp_path, "chat.json", _chat(ids, p, c))
    assert _run([*MODEL, path, "--choice", "0"], capsys)[0] == 0
    rc, out, _ = _run([*MODEL, chat, path], capsys)  # every choice of every file by default
    assert rc == 8 and out.count("choices[") == 3 + 1  # 3 sequence rows, the example's source


def test_sglang_flat_payload_and_trace_file(good, tmp_path, capsys):
    trace, p, c = good["trace"], good["prompt"], good["completion"]
    moe_only = trace.ids.astype(np.uint8)
    sglang = {  # the request's input_ids added beside the response's output_ids
        "input_ids": p,
        "output_ids": c,
        "meta_info": {
            "routed_experts": base64.b64encode(moe_only.tobytes()).decode(),
            "routed_experts_dtype": "uint8",
        },
    }
    path = _write(tmp_path, "sglang.json", sglang)
    rc, out, err = _run([*MODEL, path], capsys)
    assert rc == 0, out + err
    assert "2 (moe)" in out
    (r,) = routes_from_sglang(sglang, num_layers=(3, 2), top_k=2)
    assert (r.columns, r.dtype) == (2, "uint8")
    trace.save(tmp_path / "t.rmtrace")
    rc, out, err = _run([*MODEL, str(tmp_path / "t.rmtrace")], capsys)
    assert rc == 0 and "(trace)" in out, out + err
    assert routes_from_trace(trace).layer_ids == (1, 2)


def test_layer_ids_map_columns(good, tmp_path, capsys):
    moe_only = good["trace"].ids.astype(np.uint8)
    path = _write(tmp_path, "r.json", _chat(moe_only, good["prompt"], good["completion"]))
    assert _run([*MODEL, path, "--layer-ids", "1,2"], capsys)[0] == 0
    # columns named layers 0 and 1: layer 0 is dense and its column holds ids
    rc, out, _ = _run([*MODEL, path, "--layer-ids", "0,1"], capsys)
    assert rc & int(CheckCode.LAYOUT) and "dense_column" in out


# --------------------------------------------------------------------------------------------
# input errors: exit 2, one line, no traceback
# --------------------------------------------------------------------------------------------


ERRORS = [
    # (case, files {name: content}, args (FILE = the first file), text in the error line)
    ("missing_file", {}, [*MODEL, "nope.json"], "nope.json: No such file"),
    ("bad_json", {"r.json": "{not json"}, [*MODEL, "FILE"], "invalid JSON"),
    ("no_routes", {"r.json": {"choices": [{"token_ids": [1]}]}}, [*MODEL, "FILE"], "no routed_experts"),
    ("foreign_json", {"r.json": [1, 2]}, [*MODEL, "FILE"], "expected a replaymoe trace file"),
    # chat response without return_token_ids: nothing to teacher-force
    ("no_token_ids", {"r.json": "NO_TOKENS"}, [*MODEL, "FILE"], "return_token_ids"),
    ("unknown_arch", {"r.json": "GOOD"}, ["--model", "tiny:nonesuch", "FILE"], "--model"),
    ("not_a_checkpoint", {"r.json": "GOOD"}, ["--model", "EMPTY_DIR", "FILE"], "--model"),
    # a model whose top_k (4) is not the routes' (2)
    ("wrong_model_top_k", {"r.json": "GOOD"}, ["--model", "demo:qwen3_moe", "FILE"], "top_k 4"),
    ("num_experts_mismatch", {"r.json": "GOOD"}, [*MODEL, "--num-experts", "16", "FILE"], "--num-experts"),
    # 1 number for 3 columns (one per decoder layer) of a model of 2 MoE layers: neither form
    (
        "layer_ids_count",
        {"r.json": "GOOD"},
        [*MODEL, "--layer-ids", "1", "FILE"],
        "expected 3 layer numbers (one per column of FILE choices[0]), or 2: the MoE layers' columns",
    ),
    # the MoE layers' form naming a dense layer (0): not the model's MoE layers 1, 2
    (
        "layer_ids_not_moe",
        {"r.json": "GOOD"},
        [*MODEL, "--layer-ids", "0,1", "FILE"],
        "expected the model's MoE layers 1,2",
    ),
    ("choice_past_end", {"r.json": "GOOD"}, [*MODEL, "--choice", "3", "FILE"], "--choice"),
]


@pytest.mark.parametrize("case, files, args, text", ERRORS, ids=[e[0] for e in ERRORS])
def test_input_errors_exit_2_with_one_line(good, tmp_path, capsys, monkeypatch, case, files, args, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    written = []
    for name, content in files.items():
        if content == "GOOD":
            content = _chat(good["ids"], good["prompt"], good["completion"])
        elif content == "NO_TOKENS":
            content = _chat(good["ids"], good["prompt"], good["completion"])
            del content["prompt_token_ids"]
        written.append(_write(tmp_path, name, content))
    args = [written[0] if a == "FILE" else str(tmp_path / "empty") if a == "EMPTY_DIR" else a for a in args]
    rc, out, err = _run(args, capsys)
    assert rc == 2 and out == ""
    assert text.replace("FILE", written[0] if written else "FILE") in _one_error_line(err)


@pytest.mark.parametrize(
    "args",
    [
        ["--max-disagreement", "2"],  # a fraction above 1
        ["--layer-ids", "a,b"],  # not layer numbers
        [],  # no --model
    ],
)
def test_bad_options_are_usage_errors(tmp_path, args, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", *(MODEL if args else []), *args, str(tmp_path / "r.json")])
    assert exc.value.code == 2


def test_every_option_has_help_and_the_codes_never_collide():
    missing = [a.dest for a in _parser()._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []
    bits = [int(c) for c in CheckCode if c]
    assert sum(bits) < 128 and all(b & (b - 1) == 0 and b != 2 for b in bits)  # never 2, 130 or 141
    assert "check" in cli._COMMANDS


def test_engine_routes_validates_its_fields():
    # 5 rows from position 1 of 5 tokens: was refused ("Invalid length"); kept as sent, the check reports the
    # row count and judges the rows within the tokens
    r = EngineRoutes(np.zeros((5, 1, 2), np.int64), np.arange(5), start=1, source="x")
    assert (r.rows, r.expected_rows) == (5, 3)
    assert "1 row(s) past the last token (position 4), not judged" in r.row_count_note()
    with pytest.raises(ValueError, match="Invalid value of ids"):
        EngineRoutes(np.zeros((5, 1, 2)), np.arange(6))  # float ids
    r = EngineRoutes(np.zeros((5, 1, 2), np.uint8), np.arange(6))
    assert (r.expected_rows, r.ids.dtype, r.dtype) == (5, np.int64, "uint8")  # the dtype as sent


# --------------------------------------------------------------------------------------------
# inputs refused before reading, sequences with nothing to check, options that do not apply
# --------------------------------------------------------------------------------------------


def _fifo(d):  # a pipe nobody writes to: open() would wait forever
    os.mkfifo(d / "pipe")
    return str(d / "pipe")


def _sparse(d):  # 3 GiB of nothing, no disk used: was read whole (4.3 GB), then "invalid JSON"
    (d / "big.json").touch()
    os.truncate(d / "big.json", 3 << 30)
    return str(d / "big.json")


@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda d: "/dev/zero",
            "/dev/zero: not a regular file (a character device)",
        ),  # was MemoryError, rc 1
        (lambda d: str(d), "not a regular file (a directory)"),
        pytest.param(
            _fifo,
            "not a regular file (a pipe)",
            marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no pipes"),
        ),
        (_sparse, f"{3 << 30} bytes, more than the 1024 MiB"),
    ],
)
def test_inputs_refused_before_reading(tmp_path, capsys, make, says):
    path = make(tmp_path)
    rc, out, err = _run([*MODEL, path], capsys)
    assert rc == 2 and out == "" and says in _one_error_line(err)


def _seq(good, rows, prompt=None, completion=None, dtype=np.uint8):
    ids = good["ids"][:rows].astype(dtype)
    return _chat(ids, good["prompt"] if prompt is None else prompt, good["completion"] if completion is None
                 else completion)  # fmt: skip


def _all_missing(good):  # the legacy int16 prefix-cache sentinel in every row: nothing was routed
    return _chat(np.full((31, 3, 2), -1, np.int16), good["prompt"], good["completion"])


def _sglang_empty(good):  # SGLang's routed_experts "" (no rows)
    return {
        "input_ids": good["prompt"],
        "output_ids": good["completion"],
        "meta_info": {"routed_experts": ""},
    }


NOTHING_TO_CHECK = [
    # (case, response, text): exit 2, where they were an IndexError traceback (rc 1) or "clean"
    ("no_tokens", lambda g: _seq(g, 0, [], []), "no tokens"),  # empty prompt and completion
    ("zero_rows", lambda g: _seq(g, 0), "no routed rows to check (0 rows)"),
    ("all_missing", _all_missing, "no routed rows to check (every one of its 31 rows is -1"),
    ("sglang_empty", _sglang_empty, "no routed rows to check (0 rows)"),
]


@pytest.mark.parametrize("case, make, text", NOTHING_TO_CHECK, ids=[c[0] for c in NOTHING_TO_CHECK])
def test_nothing_to_check_is_an_input_error(good, tmp_path, capsys, case, make, text):
    path = _write(tmp_path, "r.json", make(good))
    rc, out, err = _run([*MODEL, path], capsys)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert path in line and text in line


def test_row_count_names_the_rows_and_a_fitting_prompt_start(good):
    # 30 rows where 31 are expected: a request with routed_experts_prompt_start=1 sends 30
    report = check_routes(good["model"], routes_from_vllm(_seq(good, 30)))
    d = report.defect("row_count")
    assert d is not None and report.code & CheckCode.LAYOUT
    assert "30 rows, expected 31" in d.first.note and "a prompt start of 1 gives 30 rows" in d.first.note
    assert report.layers[0].rows == 30  # the rows that fit are still judged
    assert "note:" not in str(report)


def test_sglang_layout_follows_the_token_counts(good, tmp_path, capsys):
    # MoE-only rows of a model whose 3 decoder layers make 2 x 2 x 33 values also 3 x 2 x 22: 33 rows were
    # read as 22 decoder rows (exit 17, dense column + disagreement); 30 rows as 20 decoder rows
    moe = good["trace"].ids.astype(np.uint8)

    def sglang(rows):
        return {"input_ids": good["prompt"], "output_ids": good["completion"],
                "meta_info": {"routed_experts": base64.b64encode(rows.tobytes()).decode(),
                              "routed_experts_dtype": "uint8"}}  # fmt: skip

    more = _write(tmp_path, "more.json", sglang(np.concatenate([moe, moe[-2:]])))
    rc, out, err = _run([*MODEL, more, "--json"], capsys)
    d = json.loads(out)  # 33 rows for 32 tokens: was exit 2 ("got 33 rows"); the rows that fit are judged
    assert rc == 16 and [x["kind"] for x in d["defects"]] == ["row_count"], out
    assert d["sequences"][0]["layout"] == "moe" and d["layers"][0]["rows"] == 32
    assert "no prompt start gives 33 rows: 2 more than the tokens allow" in d["defects"][0]["first"]["note"]
    fewer = _write(tmp_path, "fewer.json", sglang(moe[:30]))
    rc, out, err = _run([*MODEL, fewer, "--json"], capsys)
    d = json.loads(out)
    assert rc == 16 and [x["kind"] for x in d["defects"]] == ["row_count"], out
    assert d["sequences"][0]["layout"] == "moe"


def _trace_with(good, tmp_path, **changes):
    path = tmp_path / "t.rmtrace"
    good["trace"].replace(**changes).save(path)
    return str(path)


@pytest.mark.parametrize(
    "case, make, args, text",
    [
        # layer ids a trace records, not --layer-ids (which the user did not pass), are blamed
        ("trace_layer_ids", lambda g, d: _trace_with(g, d, layer_ids=[5, 6]), [], "layer_ids of FILE"),
        # a trace of a 16-expert model: was "clean"
        ("trace_num_experts", lambda g, d: _trace_with(g, d, num_experts=16), [], "num_experts of FILE"),
        # options that cannot apply to a trace file: were ignored
        ("trace_prompt_start", lambda g, d: _trace_with(g, d), ["--prompt-start", "1"], "--prompt-start"),
        ("trace_choice", lambda g, d: _trace_with(g, d), ["--choice", "0"], "--choice"),
        ("sglang_choice", lambda g, d: _write(d, "s.json", _sglang_empty(g)), ["--choice", "0"], "--choice"),
        # token ids of another type: was "expected a list of token ids, got list"
        (
            "float_token",
            lambda g, d: _write(d, "r.json", _seq(g, 31, [1.5] + g["prompt"][1:])),
            [],
            "got 1.5 (float) at index 0",
        ),  # fmt: skip
        (
            "bool_token",
            lambda g, d: _write(d, "r.json", _seq(g, 31, None, [True] + g["completion"][1:])),
            [],
            "got True (bool) at index 0",
        ),  # fmt: skip
        # a payload of no layers: was "Invalid shape of ids" without the file
        (
            "no_layers",
            lambda g, d: _write(
                d, "r.json", _chat(np.zeros((31, 0, 2), np.uint8), g["prompt"], g["completion"])
            ),
            [],
            "ids of FILE",
        ),  # fmt: skip
    ],
)
def test_input_errors_name_the_file_or_the_option(good, tmp_path, capsys, case, make, args, text):
    path = make(good, tmp_path)
    rc, out, err = _run([*MODEL, path, *args], capsys)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert text.replace("FILE", path) in line, line
    if case == "trace_layer_ids":
        assert "--layer-ids" not in line


def test_bom_and_a_null_choice_prompt_read_as_inspect_reads_them(good, tmp_path, capsys):
    resp = _seq(good, 31)
    resp["choices"][0]["prompt_token_ids"] = None  # null: the top-level list, not "no prompt_token_ids"
    path = tmp_path / "r.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(resp).encode())
    rc, out, err = _run([*MODEL, str(path)], capsys)
    assert rc == 0 and "clean" in out, out + err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--layer-ids", "1,1,2"], "--layer-ids: expected distinct"),  # was judged as data: exit 1
        (["--near-tie", "1e10"], "--near-tie must be a number in [0, 1e9]"),  # the library's limit, named
        (["--near-tie", "inf"], "--near-tie must be a number in [0, 1e9]"),
        (["--seed", str(10**20)], "--seed must be in"),  # was "Overflow when unpacking long long"
        ([""], "ROUTES: expected a file name, got an empty string"),  # was "error: : No such file"
    ],
)
def test_bad_options_name_the_option(tmp_path, capsys, args, says):
    path = _write(tmp_path, "r.json", {})
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", *MODEL, *args, *([] if args == [""] else [path])])
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"layer_ids": "12"}, "Invalid type of layer_ids"),  # a str: was taken as (1, 2)
        ({"layer_ids": [1.7, 2.2]}, "Invalid type of layer_ids"),  # floats: were truncated
        ({"layer_ids": [1, 1, 2]}, "distinct"),
        ({"near_tie": 1e10}, "Invalid value of near_tie: expected a number in [0, 1e9]"),
    ],
)
def test_library_check_refuses_bad_arguments(good, kw, says):
    routes = routes_from_vllm(_chat(good["ids"], good["prompt"], good["completion"]))
    with pytest.raises(ValueError) as exc:
        check_routes(good["model"], routes, **kw)
    assert says in str(exc.value)


# --------------------------------------------------------------------------------------------
# audit: layers never examined, deep JSON, near-ties, row counts, fingerprints, constant layers across
# sequences, misalignment, SGLang --layer-ids, API errors, sources and --seed
# --------------------------------------------------------------------------------------------


def _with(ids, where, value, dtype=np.int32):
    out = ids.astype(dtype)
    out[where] = value
    return out


UNROUTED = [
    # (case, fabricate, extra args, exit, text): each was "clean", exit 0, with a MoE layer never examined
    # vLLM's int32 decoder layout: the dense column's zeros hid that both MoE columns are -1
    ("moe_columns_missing", lambda ids: _with(ids, np.s_[:, 1:], -1), [], 2,
     "no routed rows to check (every row of its MoE-layer columns [1, 2] is -1"),
    # its one column is named the dense layer 0: no MoE layer has a column
    ("dense_column_only", lambda ids: ids[:, :1], ["--layer-ids", "0"], 2, "none a MoE layer"),
    # MoE layer 2 entirely -1, layer 1 good: the sequence's unrouted layer
    ("one_layer_missing", lambda ids: _with(ids, np.s_[:, 2], -1), [], 16,
     "layer 2 (column 2) (every one of its 31 rows -1 (missing) while its other MoE layers are routed"),
    # one column named layer 2: MoE layer 1 has no column at all
    ("one_column", lambda ids: ids[:, 2:], ["--layer-ids", "2"], 16, "layer 1 (no source has a row for it)"),
]  # fmt: skip


@pytest.mark.parametrize("case, fabricate, extra, code, text", UNROUTED, ids=[u[0] for u in UNROUTED])
def test_layers_never_examined_are_not_clean(good, tmp_path, capsys, case, fabricate, extra, code, text):
    ids = fabricate(good["ids"].copy())
    path = _write(tmp_path, "r.json", _chat(ids, good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, *extra], capsys)
    assert rc == code, out + err
    if code == 2:
        assert out == "" and text in _one_error_line(err)
        return
    assert "unrouted_layer [16]" in out and text in out and "clean" not in out
    d = json.loads(_run([*MODEL, path, *extra, "--json"], capsys)[1])
    assert [x["kind"] for x in d["defects"]] == ["unrouted_layer"]


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000 + "]" * 5000,  # was a RecursionError traceback, exit 1
        '{"choices": ' * 5000 + "1" + "}" * 5000,
    ],
    ids=["arrays", "objects"],
)
def test_deeply_nested_json_is_an_input_error(tmp_path, capsys, text):
    path = _write(tmp_path, "deep.json", text)
    rc, out, err = _run([*MODEL, path], capsys)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert path in line and "nested too deeply" in line


# near-ties ------------------------------------------------------------------------------------


def _ties(tol, top_k=2, n_group=1, topk_group=1):
    return LayerTies(np.zeros(1, bool), np.zeros(1, np.int64), np.zeros((1, 4), np.float32), top_k, n_group,
                     topk_group, tol)  # fmt: skip


@pytest.mark.parametrize(
    "u, x, ties, excused",
    [
        # scores 0.9 > 0.5 ~ 0.498 > 0.1, K=2: the recomputed set is {0, 1}
        ([0.9, 0.5, 0.498, 0.1], [0, 2], _ties(5e-3), True),  # the runner-up for the K-th: within the tie
        ([0.9, 0.5, 0.498, 0.1], [1, 2], _ties(5e-3), False),  # expert 0, clearly chosen, left out
        ([0.9, 0.5, 0.498, 0.1], [2, 3], _ties(5e-3), False),  # no expert in common (was excused)
        ([0.9, 0.5, 0.498, 0.1], [0, 3], _ties(5e-3), False),  # expert 3 is not within the tie
        ([0.9, 0.5, 0.498, 0.1], [0, 3], _ties(0.5), True),  # ... at a tolerance of 0.5 it is
        # two groups of two, one kept: group scores 0.95 vs 0.948, a group near-tie
        ([0.5, 0.45, 0.6, 0.348], [2, 3], _ties(5e-3, 2, 2, 1), True),  # the other group's top 2
        ([0.5, 0.45, 0.6, 0.348], [0, 2], _ties(5e-3, 2, 2, 1), False),  # two groups where one is kept
        ([0.5, 0.45, 0.6, 0.348], [2, 3], _ties(1e-4, 2, 2, 1), False),  # the groups are not tied at 1e-4
    ],
)
def test_a_near_tie_excuses_only_a_choice_within_the_tie(u, x, ties, excused):
    assert tie_excused(np.array(u, np.float32), np.array(x), ties) is excused


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen3-MoE (softmax top-k: its selection scores are the router logits) on 40 tokens: the routes
    it takes and each MoE layer's router logits [40, E], read by a forward hook on the router."""
    model = build_model("qwen3_moe", "tiny", seed=0)
    tokens = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(5))
    logits = {}
    hooks = [
        info.router.register_forward_hook(
            lambda m, a, out, n=info.layer_number: logits.__setitem__(n, out[0])
        )
        for info in find_moe_layers(model)
    ]
    with torch.no_grad():
        model(tokens[None], use_cache=False)
    for h in hooks:
        h.remove()
    scores = np.stack([logits[n].float().numpy() for n in sorted(logits)], axis=1)[:-1]  # [39 rows, L, E]
    return model, tokens.numpy(), scores


def test_near_tie_rows_are_judged_unless_the_engine_chose_within_the_tie(qwen):
    model, tokens, scores = qwen
    tol, K = 0.05, 2
    order = np.argsort(-scores, axis=-1, kind="stable")
    top = np.take_along_axis(scores, order, axis=-1)
    gap = top[..., K - 1] - top[..., K]
    tie = gap <= 0.5 * tol * np.maximum(1.0, np.abs(top[..., K - 1]))  # well inside the tolerance
    assert tie.sum() >= 3
    recomputed = order[..., :K]
    runner_up = np.concatenate(
        [order[..., : K - 1], order[..., K : K + 1]], axis=-1
    )  # the K+1-th for the K-th
    routes = lambda ids: EngineRoutes(ids, tokens)  # noqa: E731
    assert check_routes(model, routes(recomputed), near_tie=tol, max_disagreement=0.0).ok
    # an engine that took the runner-up at each near-tie: excused, clean even at a threshold of 0
    ids = np.where(tie[..., None], runner_up, recomputed)
    report = check_routes(model, routes(ids), near_tie=tol, max_disagreement=0.0)
    assert report.ok and sum(c.excused for c in report.layers) == int(tie.sum()), report
    # the two lowest-scoring experts at each near-tie: was excused (never judged, "clean"); now judged
    ids = np.where(tie[..., None], order[..., -K:], recomputed)
    report = check_routes(model, routes(ids), near_tie=tol, max_disagreement=0.0)
    assert report.code == CheckCode.DISAGREEMENT and report.defect("disagreement").count == int(tie.sum())
    assert sum(c.excused for c in report.layers) == 0
    assert all(c.judged == c.rows for c in report.layers)


def _disjoint(good):
    """The good capture with each MoE row replaced by a set sharing no expert with it."""
    rec = np.sort(good["ids"][:, 1:].astype(np.int64), axis=-1)
    ids = good["ids"].copy()
    for i, j in np.ndindex(*rec.shape[:2]):
        ids[i, j + 1] = [e for e in range(8) if e not in rec[i, j]][:2]
    return ids


def test_routes_sharing_no_expert_are_judged_at_near_ties(good):
    # at the default tolerance ~10% of layer 2's rows are near-ties: they were excused although the engine's
    # set shares no expert with the recomputed one
    ids = _disjoint(good)
    report = check_routes(good["model"], routes_from_vllm(_chat(ids, good["prompt"], good["completion"])))
    assert report.near_tie_rate > 0 and report.code == CheckCode.DISAGREEMENT
    assert all(c.excused == 0 and c.judged == c.rows and c.disagreement == 1.0 for c in report.layers)


def test_a_layer_whose_rows_are_all_excused_is_not_clean(good, tmp_path, capsys):
    # a tolerance of 1e9 makes every row a near-tie and every set a choice within it: routes sharing no
    # expert with the recomputation were "clean" (agreement 0, none judged); was unrouted_layer (16), now
    # the layers where more than half of the compared rows were excused (1)
    path = _write(tmp_path, "r.json", _chat(_disjoint(good), good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, "--near-tie", "1e9", "--json"], capsys)
    d = json.loads(out)
    assert rc == 1 and [x["kind"] for x in d["defects"]] == ["excused"], out + err
    assert "layer 1: 31 of 31 (1.00); layer 2: 31 of 31 (1.00)" in d["defects"][0]["detail"]
    assert "near-tie tolerance of 1e+09" in d["defects"][0]["detail"]
    assert all(c["judged"] == 0 and c["excused"] == 31 for c in d["layers"])
    # the good capture at the same tolerance: every row matches, so every row is judged
    good_path = _write(tmp_path, "g.json", _chat(good["ids"], good["prompt"], good["completion"]))
    assert _run([*MODEL, good_path, "--near-tie", "1e9"], capsys)[0] == 0


# row counts, fingerprints ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, rows, extra, code, notes",
    [
        # 33 rows for 32 tokens: was exit 2 "Invalid length", no hint
        ("two_rows_more", 33, [], 16, ["33 rows, expected 31", "no prompt start gives 33 rows: 2 more"]),
        # a prompt start 2 too late: was exit 2 "Invalid length"; the rows are position i, judged there
        (
            "prompt_start_2",
            31,
            ["--prompt-start", "2"],
            48,
            ["a prompt start of 0 gives 31 rows (--prompt-start 0?)", "is the prompt start 0?"],
        ),
    ],  # fmt: skip
)
def test_rows_past_the_tokens_are_a_row_count_defect(good, tmp_path, capsys, case, rows, extra, code, notes):
    ids = np.concatenate([good["ids"], good["ids"][-2:]])[:rows]
    path = _write(tmp_path, "r.json", _chat(ids, good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, *extra, "--json"], capsys)
    d = json.loads(out)
    assert rc == code and err == "", out + err
    text = " ".join(x["first"]["note"] for x in d["defects"])
    assert all(n in text for n in notes), text
    assert "row(s) past the last token" in text and d["disagreement"] < 0.05
    assert all(c["rows"] == 32 - int(extra[1] if extra else 0) for c in d["layers"])  # the rows that fit


def _trace_only_layer_2(good, tmp_path):
    return _trace_with(good, tmp_path, ids=good["trace"].ids[:, 1:], layer_ids=[2], weights=None)


@pytest.mark.parametrize(
    "case, make, extra, code, kinds, text",
    [
        # another model's id: was "clean" although set_replay refuses it
        (
            "model_id",
            lambda g, d: _trace_with(g, d, model_id="another/model"),
            [],
            16,
            ["fingerprint"],
            "model_id 'another/model' vs",
        ),
        (
            "model_id_ignored",
            lambda g, d: _trace_with(g, d, model_id="another/model"),
            ["--ignore-model-id"],
            0,
            [],
            "clean",
        ),
        # a trace recording only MoE layer 2 of layers 1 and 2: was "clean"
        (
            "missing_layer",
            _trace_only_layer_2,
            [],
            16,
            ["unrouted_layer", "fingerprint"],
            "1 vs 2 MoE layers; MoE layers [2] vs [1, 2]",
        ),
    ],  # fmt: skip
)
def test_a_trace_of_another_model_is_a_fingerprint_defect(good, tmp_path, capsys, case, make, extra, code,
                                                          kinds, text):  # fmt: skip
    path = make(good, tmp_path)
    rc, out, err = _run([*MODEL, path, *extra], capsys)
    assert rc == code and text in out, out + err
    assert f"model {good['trace'].model_id}:" in out  # the model's id in the header
    d = json.loads(_run([*MODEL, path, *extra, "--json"], capsys)[1])
    assert [x["kind"] for x in d["defects"]] == kinds


# constant layers, misalignment ---------------------------------------------------------------------


def _prefixes(good, lengths, layer2):
    """Sequences of the first ``n`` tokens for each n in ``lengths`` (their routes are the capture's first
    n - 1 rows), MoE layer 2 set to ``layer2(i)`` in the i-th."""
    tokens = good["prompt"] + good["completion"]
    out = []
    for i, n in enumerate(lengths):
        ids = good["ids"][: n - 1].copy()
        ids[:, 2] = layer2(i)
        out += routes_from_vllm(_chat(ids, tokens[:6], tokens[6:n]), source=f"seq{i}")
    return out


@pytest.mark.parametrize(
    "layer2, code, constant",
    [
        # one set in every sequence, 10 to 15 rows each (75 in all, each below min_constant_rows 16): was
        # exit 1 with const 0, the layer judged as disagreeing
        (lambda i: [3, 5], CheckCode.DEGENERATE_ROWS, 6),
        # another set in each sequence: not one set for the layer, so its rows are judged
        (lambda i: [i, 7], CheckCode.DISAGREEMENT, 0),
    ],
    ids=["one_set", "a_set_per_sequence"],
)
def test_a_layer_constant_across_short_sequences(good, layer2, code, constant):
    report = check_routes(good["model"], _prefixes(good, range(11, 17), layer2))
    assert report.code == code, report
    assert report.layers[1].constant == constant and report.layers[0].constant == 0
    if constant:
        assert report.layers[1].judged == 0 and report.defect("constant").count == 6
        assert len(report.defect("constant").sources) == 6


def test_a_misaligned_sequence_is_judged_at_its_best_shift(good):
    # rows of positions i + 1, 40% of them random: was exit 32 alone, the disagreement left out
    rng = np.random.default_rng(0)
    ids = np.concatenate([good["ids"][1:], good["ids"][-1:]])
    for i in np.flatnonzero(rng.random(len(ids)) < 0.4):
        ids[i, 1:] = [rng.choice(8, 2, replace=False) for _ in range(2)]
    report = check_routes(good["model"], routes_from_vllm(_chat(ids, good["prompt"], good["completion"])))
    assert report.code == CheckCode.DISAGREEMENT | CheckCode.MISALIGNED, report
    assert "judged at shift +1" in report.defect("disagreement").first.note
    assert all(c.judged == c.rows for c in report.layers)


@pytest.mark.parametrize("n", range(6, 12))
def test_short_garbage_is_not_misaligned(good, n):
    # 5 to 10 rows: reversed, and random; chance matches of a few rows were called misaligned (4 of 8 trials)
    # when 4 row x layer pairs sufficed; at least 8 rows and 4 more agreeing rows are needed now
    rng = np.random.default_rng(n)
    tokens = good["prompt"] + good["completion"]
    reversed_ids = good["ids"][: n - 1].copy()
    reversed_ids[:, 1:] = reversed_ids[::-1, 1:]
    random_ids = reversed_ids.copy()
    for i, j in np.ndindex(n - 1, 2):
        random_ids[i, j + 1] = rng.choice(8, 2, replace=False)
    for ids in (reversed_ids, random_ids):
        report = check_routes(good["model"], routes_from_vllm(_chat(ids, tokens[: n - 2], tokens[n - 2 : n])))
        assert not report.code & CheckCode.MISALIGNED, report


@pytest.mark.parametrize(
    "make, says, never",
    [
        # one extra leading row (row i is position i - 1): was "is the prompt start -1?"
        (
            lambda ids: np.concatenate([ids[:1] * 0 + 1, ids[:-1]]),
            "the rows carry 1 extra leading row(s)",
            "-1?",
        ),
        (
            lambda ids: np.concatenate([ids[1:], ids[-1:]]),
            "the first 1 row(s) are missing, or the prompt start is 1",
            "start -",
        ),
    ],  # fmt: skip
    ids=["extra_leading_row", "missing_first_row"],
)
def test_the_misalignment_hint_never_names_a_negative_start(good, make, says, never):
    ids = make(good["ids"].copy())
    ids[:, 0] = 0  # the dense column stays zero
    report = check_routes(good["model"], routes_from_vllm(_chat(ids, good["prompt"], good["completion"])))
    note = report.defect("misaligned").first.note
    assert says in note and never not in note, note


# SGLang --layer-ids, API errors, sources, --seed ------------------------------------------------------


def test_sglang_columns_follow_layer_ids(good, tmp_path, capsys):
    moe = good["trace"].ids.astype(np.int32)

    def sglang(rows):
        return {"input_ids": good["prompt"], "output_ids": good["completion"],
                "meta_info": {"routed_experts": base64.b64encode(rows.tobytes()).decode()}}  # fmt: skip

    # layer 2's column alone: was exit 2 "62 values are not whole [layers, top_k=2] rows for layers in [3, 2]"
    one = _write(tmp_path, "one.json", sglang(np.ascontiguousarray(moe[:, 1:])))
    d = json.loads(_run([*MODEL, one, "--layer-ids", "2", "--json"], capsys)[1])
    assert d["exit_code"] == 16 and [x["kind"] for x in d["defects"]] == ["unrouted_layer"]
    assert d["sequences"][0]["layout"] == "layer_ids" and d["layers"][1]["agreement"] == 1.0
    both = _write(tmp_path, "both.json", sglang(moe))
    assert _run([*MODEL, both, "--layer-ids", "1,2"], capsys)[0] == 0


def _good_routes(good):
    return routes_from_vllm(_chat(good["ids"], good["prompt"], good["completion"]))


def _tokens(good):
    return np.array(good["prompt"] + good["completion"])


API_ERRORS = [
    # (case, call, message): were AttributeError, TypeError, a bare int() error, or accepted
    ("model_none", lambda g: check_routes(None, _good_routes(g)), "Invalid type of model: expected a"),
    ("model_str", lambda g: check_routes("tiny:deepseek_v3", _good_routes(g)), "Invalid type of model"),
    ("routes_none", lambda g: check_routes(g["model"], None), "Invalid type of routes: expected an"),
    ("routes_response", lambda g: check_routes(g["model"], _chat(g["ids"], g["prompt"], g["completion"])),
     "got a dict (a response: read it with routes_from_vllm"),
    ("shifts_none", lambda g: check_routes(g["model"], _good_routes(g), shifts=None), "Invalid type of"),
    ("shifts_float", lambda g: check_routes(g["model"], _good_routes(g), shifts=[0, 0.5]),
     "Invalid type of shifts: expected a sequence of ints, got 0.5"),
    ("num_experts_float", lambda g: check_routes(g["model"], _good_routes(g), num_experts=8.0),
     "Invalid type of num_experts"),
    ("expected_rows_str", lambda g: EngineRoutes(g["ids"], _tokens(g), expected_rows="x"),
     "Invalid type of expected_rows: expected an int, got str"),
    ("expected_rows_negative", lambda g: EngineRoutes(g["ids"], _tokens(g), expected_rows=-5),
     "Invalid value of expected_rows"),
    ("dtype_float", lambda g: EngineRoutes(g["ids"], _tokens(g), dtype="float32"), "Invalid value of dtype"),
    ("source_none", lambda g: EngineRoutes(g["ids"], _tokens(g), source=None), "Invalid type of source"),
    ("load_routes_none", lambda g: load_routes(None), "Invalid type of path: expected a file name"),
]  # fmt: skip


@pytest.mark.parametrize("case, call, says", API_ERRORS, ids=[a[0] for a in API_ERRORS])
def test_library_errors_name_the_argument(good, case, call, says):
    with pytest.raises(ValueError) as exc:
        call(good)
    assert says in str(exc.value)


def test_a_defect_names_every_source_having_it(good, tmp_path, capsys):
    ids = good["ids"].copy()
    ids[::2, 1:] = 0  # half the rows all zero
    paths = [_write(tmp_path, f"{n}.json", _chat(ids, good["prompt"], good["completion"])) for n in "ab"]
    rc, out, err = _run([*MODEL, *paths], capsys)
    assert rc == 8 and f"in 2 sources ({paths[0]} choices[0], {paths[1]} choices[0])" in out, out + err
    assert "(agree at a row shift: over the rows without a defect)" in out  # the zero rows left out there
    d = json.loads(_run([*MODEL, *paths, "--json"], capsys)[1])
    assert d["defects"][0]["sources"] == [f"{p} choices[0]" for p in paths]
    assert d["sequences"][0]["agreement"] == pytest.approx(15 / 31)  # 16 of the 31 rows are zero


def test_seed_is_refused_for_a_checkpoint(good, tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    path = _write(tmp_path, "r.json", _chat(good["ids"], good["prompt"], good["completion"]))
    rc, out, err = _run(["--model", str(tmp_path / "ckpt"), "--seed", "3", path], capsys)  # was ignored
    assert (
        rc == 2
        and out == ""
        and "Invalid value of --seed: expected none for the checkpoint" in _one_error_line(err)
    )
    with pytest.raises(ValueError, match="Invalid value of seed"):
        load_model(str(tmp_path / "ckpt"), seed=0)


# --------------------------------------------------------------------------------------------
# re-audit: a layer unrouted in one file, rows of -1, SGLang's layout guess, near-ties excusing most of
# a layer, --layer-ids in inspect's form, the fingerprint's exit, a row under one defect, the tables
# --------------------------------------------------------------------------------------------


def _sglang(rows, prompt, completion, **meta):
    """An SGLang response: the flat int32 payload, the request's input_ids beside its output_ids."""
    raw = np.ascontiguousarray(rows, dtype="<i4").tobytes()
    return {"input_ids": prompt, "output_ids": completion,
            "meta_info": {"routed_experts": base64.b64encode(raw).decode(), **meta}}  # fmt: skip


@pytest.mark.parametrize("order", ["missing_first", "good_first"])
@pytest.mark.parametrize("form", ["vllm", "sglang"])
def test_a_layer_unrouted_in_one_file_is_not_hidden_by_another(good, tmp_path, capsys, order, form):
    # MoE layer 2 all -1 in one file, routed in the other: was clean (exit 0) when both were checked, the
    # other file's rows making the layer "judged"; a file's verdict no longer depends on the other files
    p, c = good["prompt"], good["completion"]
    make = (lambda ids: _chat(ids, p, c)) if form == "vllm" else (lambda ids: _sglang(ids, p, c))
    files = [
        _write(tmp_path, "missing.json", make(_with(good["ids"], np.s_[:, 2], -1))),
        _write(tmp_path, "good.json", make(good["ids"].astype(np.int32))),
    ]
    rc, out, err = _run([*MODEL, *(files if order == "missing_first" else files[::-1]), "--json"], capsys)
    d = json.loads(out)
    assert rc == 16 and [x["kind"] for x in d["defects"]] == ["unrouted_layer"], out + err
    first = d["defects"][0]["first"]
    assert first["source"].startswith(files[0]) and (first["layer"], first["column"]) == (2, 2)
    assert d["defects"][0]["sources"] == [first["source"]]  # the file, not "all 2 sources"
    assert d["layers"][1]["judged"] == 31  # the good file's rows of layer 2 are still judged


MISSING_ROWS = [
    # (case, fabricate, extra args, exit, rows counted, first (position, layer)): were clean although
    # replay's default missing="error" refuses them
    ("last_row", lambda ids: _with(ids, np.s_[-1, 1:], -1), [], 8, 2, (30, 1)),  # the last row's
    ("middle_rows", lambda ids: _with(ids, np.s_[5:10, 1:], -1), [], 8, 10, (5, 1)),
    # one layer at one row, the other layer routed there
    ("one_pair", lambda ids: _with(ids, np.s_[12, 2], -1), [], 8, 1, (12, 2)),
    # the first row: no row before it to tell it from a later prompt start
    ("first_row", lambda ids: _with(ids, np.s_[0, 1:], -1), [], 8, 2, (0, 1)),
    # a dense layer's -1 is no route replay needs
    ("dense_column", lambda ids: _with(ids, np.s_[:, 0], -1), [], 0, 0, None),
    # rows from position 4 (--prompt-start 4): positions 0..3 are not rows, never counted missing
    ("prompt_start", lambda ids: ids[4:].astype(np.int32), ["--prompt-start", "4"], 0, 0, None),
]


@pytest.mark.parametrize("case, fabricate, extra, code, count, first", MISSING_ROWS,
                         ids=[m[0] for m in MISSING_ROWS])  # fmt: skip
def test_rows_of_minus_one_within_a_sequence_are_missing_rows(good, tmp_path, capsys, case, fabricate, extra,
                                                             code, count, first):  # fmt: skip
    path = _write(
        tmp_path, "r.json", _chat(fabricate(good["ids"].copy()), good["prompt"], good["completion"])
    )
    rc, out, err = _run([*MODEL, path, *extra, "--json"], capsys)
    d = json.loads(out)
    assert rc == code and err == "", out + err
    assert [x["kind"] for x in d["defects"]] == (["missing_rows"] if count else [])
    assert sum(c["missing"] for c in d["layers"]) == count
    if count:
        x = d["defects"][0]
        assert (x["code"], x["count"], x["unit"]) == (8, count, "rows")
        assert (x["first"]["position"], x["first"]["layer"]) == first and x["first"]["ids"] == [-1, -1]
        assert 'missing="native"' in x["first"]["note"]
        assert "missing_rows [8]" in _run([*MODEL, path, *extra], capsys)[1]


@pytest.mark.parametrize(
    "case, payload, hint, layout, guess",
    [
        # decoder-layout rows from position 11, no routed_experts_start_len: 120 values are also 30 rows of
        # the 2 MoE columns, nearer the 31 rows the tokens want: were read so (false all_zero, the hint
        # "--prompt-start 1" leading to more false defects); the dense column's zeros decide now
        ("decoder_from_11", lambda g: g["ids"][11:], 11, "decoder", None),
        # MoE-only rows from position 1: 30 rows of 2 columns or 20 of 3, no zero column to decide: the
        # nearest is read, and the other reading named with the prompt start that fits it
        ("moe_from_1", lambda g: g["trace"].ids[1:], 1, "moe",
         "also 20 rows of 3 columns from a prompt start of 11"),
    ],
)  # fmt: skip
def test_sglang_layout_is_decided_by_dense_zeros_or_named_as_a_guess(good, tmp_path, capsys, case, payload,
                                                                     hint, layout, guess):  # fmt: skip
    path = _write(tmp_path, "s.json", _sglang(payload(good), good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, "--json"], capsys)
    d = json.loads(out)
    kinds = [x["kind"] for x in d["defects"]]
    assert d["sequences"][0]["layout"] == layout and "all_zero" not in kinds and "row_count" in kinds, out
    note = d["defects"][kinds.index("row_count")]["first"]["note"]
    assert f"(--prompt-start {hint}?)" in note and (guess is None or guess in note), note
    assert _run([*MODEL, path, "--prompt-start", str(hint)], capsys)[0] == 0  # the hint followed: clean
    if layout == "decoder":  # the MoE layers' numbers, inspect's form, read it the same way
        assert _run([*MODEL, path, "--prompt-start", str(hint), "--layer-ids", "1,2"], capsys)[0] == 0


def _random_sets(good, seed=0):
    """The good capture with every MoE row replaced by 2 random distinct experts."""
    rng = np.random.default_rng(seed)
    ids = good["ids"].copy()
    for i, j in np.ndindex(ids.shape[0], 2):
        ids[i, j + 1] = rng.choice(8, 2, replace=False)
    return ids


@pytest.mark.parametrize(
    "case, make, near_tie, code, kinds",
    [
        # random routes at --near-tie 2: 58 of 62 rows excused, 4 judged and agreeing by chance: was clean
        ("random_wide_tie", _random_sets, "2", 1, ["excused"]),
        ("random_default_tie", _random_sets, "5e-3", 1, ["disagreement"]),
        # the good capture at the same tolerance: its rows match, so they are judged, none excused
        ("good_wide_tie", lambda g: g["ids"], "2", 0, []),
    ],
)
def test_a_layer_mostly_excused_as_near_ties_is_not_vouched_for(good, tmp_path, capsys, case, make, near_tie,
                                                               code, kinds):  # fmt: skip
    path = _write(tmp_path, "r.json", _chat(make(good), good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, "--near-tie", near_tie, "--json"], capsys)
    d = json.loads(out)
    assert rc == code and [x["kind"] for x in d["defects"]] == kinds, out + err
    if kinds == ["excused"]:
        detail = d["defects"][0]["detail"]
        assert "near-tie tolerance of 2 (--near-tie)" in detail and "layer 1: " in detail, detail
        assert all(2 * c["excused"] > c["excused"] + c["judged"] for c in d["layers"])
        assert "excused at a near-tie" in d["defects"][0]["first"]["note"]
    if case == "good_wide_tie":
        assert all(c["excused"] == 0 and c["judged"] == 31 for c in d["layers"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])  # grouped routing, with a group near-tie
def test_a_half_precision_engine_stays_clean(arch, dtype):
    # an engine whose router runs in bf16/fp16 flips a few near-tie rows: far from half of a layer excused
    model = build_model(arch, "tiny", seed=0)
    tokens = torch.randint(3, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(1))
    half = build_model(arch, "tiny", seed=0).to(dtype)
    moe = rh.enable(half, capture=True)
    with torch.no_grad():
        half(tokens[:, :-1], use_cache=False)
    (t,) = moe.traces()
    moe.disable()
    report = check_routes(model, EngineRoutes(t.ids.astype(np.int64), tokens[0].numpy(),
                                              layer_ids=t.layer_ids))  # fmt: skip
    assert report.ok, report
    assert all(c.excused <= 0.1 * (c.excused + c.judged) for c in report.layers)


@pytest.mark.parametrize(
    "case, make, layer_ids, code, kinds",
    [
        # one column per decoder layer, the MoE layers named as inspect and demo --from-vllm take them: was
        # exit 2 ("expected 3 layer numbers"), while inspect refused check's 0,1,2
        ("moe_layers", lambda g: g["ids"], "1,2", 0, []),
        ("moe_layers_in_any_order", lambda g: g["ids"], "2,1", 0, []),
        # the other column is a dense layer's: checked to be zero, as in the decoder layout
        ("dense_not_zero", lambda g: _with(g["ids"], np.s_[3, 0], [1, 4]), "1,2", 16, ["dense_column"]),
        # one number per column, as before
        ("every_column", lambda g: g["ids"], "0,1,2", 0, []),
        ("moe_only_payload", lambda g: g["trace"].ids.astype(np.uint8), "1,2", 0, []),
    ],
)
def test_layer_ids_take_inspects_form_too(good, tmp_path, capsys, case, make, layer_ids, code, kinds):
    path = _write(tmp_path, "r.json", _chat(make(good), good["prompt"], good["completion"]))
    rc, out, err = _run([*MODEL, path, "--layer-ids", layer_ids, "--json"], capsys)
    d = json.loads(out)
    assert rc == code and [x["kind"] for x in d["defects"]] == kinds, out + err
    assert d["sequences"][0]["layout"] == "layer_ids"
    if case == "moe_layers":  # the same value in inspect
        assert cli.main(["inspect", path, "--layer-ids", layer_ids]) == 0
        assert "layers: 2" in capsys.readouterr().out
    help_text = " ".join(_parser().format_help().split())
    assert (
        "the MoE layers' numbers, naming their columns, as inspect and demo --from-vllm take them"
        in help_text
    )


def test_the_fingerprint_docs_say_what_each_difference_does(good, tmp_path, capsys):
    # the docs said experts or top-k differences exit 16 (fingerprint); check_fit refuses them first: exit 2
    assert "its model id or MoE layers differ" in DEFECT_KINDS["fingerprint"][1]
    assert "other experts or top-k is refused before the check (exit 2)" in DEFECT_KINDS["fingerprint"][1]
    epilog = " ".join(_parser().epilog.split())
    assert "a trace whose model id or MoE layers are another model's" in epilog
    assert "a trace of other experts or top-k" in epilog.split("; 2 ")[1]
    rc, out, err = _run([*MODEL, _trace_with(good, tmp_path, num_experts=16)], capsys)
    assert rc == 2 and "num_experts of" in _one_error_line(err)
    assert _run([*MODEL, _trace_with(good, tmp_path, model_id="another/model")], capsys)[0] == 16


def test_tables_align_the_shifts_and_show_no_shift_without_judged_rows(good):
    ids = good["ids"].copy()
    ids[:, 2] = [3, 5]  # layer 2 constant: no judged row, its best shift (was -2 or +2 by chance) is "-"
    text = str(check_routes(good["model"], routes_from_vllm(_chat(ids, good["prompt"], good["completion"]))))
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if "at -2" in ln)
    for s in ("at -2", "at -1", "at +0", "at +1", "at +2"):  # each value ends under its label's end
        end = lines[head].index(s) + len(s)
        value = lines[head + 1][end - 4 : end + 1]
        assert value[:4].replace(".", "").isdigit() and value[4:] in ("", " "), (s, lines[head : head + 2])
    shift = {ln.split()[0]: ln.split()[-1] for ln in lines if ln.split()[:1] in (["1"], ["2"], ["all"])}
    assert shift == {"1": "+0", "2": "-", "all": "+0"}, text

"""RoutingTrace: construction checks, the file format (round trips, every corruption case,
atomic writes), vLLM / SGLang wire formats against payloads built here with numpy + base64,
and concatenation / merging."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import zipfile

import numpy as np
import pytest

from replaymoe.record.trace import FORMAT_VERSION, RoutingTrace, TraceFormatError

# ----------------------------------------------------------------------------- helpers


def random_ids(rng, n, L, K, E, missing=()):
    """[n, L, K] int64 of distinct ids per row; rows listed in ``missing`` (token, layer) are -1."""
    ids = np.argsort(rng.random((n, L, E)), axis=-1)[..., :K].astype(np.int64)
    for t, layer in missing:
        ids[t, layer] = -1
    return ids


def npy_b64(arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(generator.initial_seed()))


@pytest.fixture
def trace(rng):
    ids = random_ids(rng, 7, 3, 4, 16, missing=[(0, 0), (0, 1), (0, 2), (5, 1)])
    return RoutingTrace(ids, num_experts=16, top_k=4, layer_ids=[1, 3, 4], model_id="toy/moe", token_offset=2)


# ----------------------------------------------------------------------------- construction


def test_basic_properties(trace):
    assert trace.ids.dtype == np.int16 and trace.ids.flags.c_contiguous
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.end) == (7, 3, 4, 9)
    assert trace.missing_mask().sum() == 4
    assert trace.missing_fraction() == pytest.approx(4 / 21)
    assert trace.model_layer_ids() == (1, 3, 4)
    assert "tokens=7" in repr(trace)


@pytest.mark.parametrize(
    "ids, kw, match",
    [
        (np.zeros((3, 2)), {}, "dtype of ids"),  # float array
        (np.zeros((3, 2), dtype=np.int64), {}, "shape of ids"),  # 2-D
        (np.zeros((3, 2, 3), dtype=np.int64), {}, "shape of ids"),  # K != top_k
        (np.full((2, 1, 2), 16), {}, "ids.*16"),  # id == E
        (np.full((2, 1, 2), -2), {}, "ids.*-2"),  # below the -1 sentinel
        (np.array([[[0, -1]]]), {}, "all -1"),  # row mixing -1 and an id
        (np.array([[[3, 3]]]), {}, "distinct"),  # duplicate id in a row
        (np.array([[[0, 1]]]), {"layer_ids": [0, 1]}, "layer_ids"),  # wrong length
        (np.array([[[0, 1], [2, 3]]]), {"layer_ids": [5, 5]}, "layer_ids"),  # not distinct
        (np.array([[[0, 1]]]), {"top_k": 0}, "top_k"),
        (np.array([[[0, 1]]]), {"num_experts": 1}, "top_k"),  # K > E
        (np.array([[[0, 1]]]), {"token_offset": -1}, "token_offset"),
        (np.array([[[0, 1]]]), {"model_id": 3}, "model_id"),
    ],
)
def test_constructor_rejects(ids, kw, match):
    args = {"num_experts": 16, "top_k": 2, **kw}
    with pytest.raises(ValueError, match=match):
        RoutingTrace(ids, **args)


def test_accepts_torch_and_unknown_num_experts(rng):
    import torch

    ids = random_ids(rng, 3, 2, 2, 300)
    t = RoutingTrace(torch.from_numpy(ids), num_experts=None, top_k=2)
    np.testing.assert_array_equal(t.ids, ids)
    assert t.num_experts is None


# ----------------------------------------------------------------------------- file round trips


@pytest.mark.parametrize("compress", [True, False])
def test_save_load_round_trip(tmp_path, trace, compress):
    path = tmp_path / "run.trace"  # no suffix is added
    trace.save(path, compress=compress)
    assert os.listdir(tmp_path) == ["run.trace"]
    back = RoutingTrace.load(path)
    assert back == trace
    assert back.layer_ids == (1, 3, 4) and back.model_id == "toy/moe" and back.token_offset == 2
    # the documented layout: numpy can read it without pickle
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == ["ids", "meta"]
        meta = json.loads(z["meta"].tobytes())
        np.testing.assert_array_equal(z["ids"], trace.ids)
    assert meta["version"] == FORMAT_VERSION and meta["shape"] == [7, 3, 4]


def test_save_load_empty_and_unknown_e(tmp_path):
    t = RoutingTrace(np.zeros((0, 5, 2), dtype=np.int16), num_experts=None, top_k=2)
    t.save(tmp_path / "e.npz")
    assert RoutingTrace.load(tmp_path / "e.npz") == t


def test_save_overwrites_atomically(tmp_path, trace):
    path = tmp_path / "t.trace"
    trace.save(path)
    other = trace.replace(token_offset=0)
    other.save(path)
    assert RoutingTrace.load(path) == other
    assert os.listdir(tmp_path) == ["t.trace"]


# patched over the private _write_payload: a writer failing half-way is the case under test
def _failing_writer(f, ids, meta, compress):
    f.write(b"PK\x03\x04 partial")
    raise OSError("disk full (simulated)")


def test_failed_save_leaves_nothing(tmp_path, trace, monkeypatch):
    import replaymoe.record.trace.file as trace_mod

    monkeypatch.setattr(trace_mod, "_write_payload", _failing_writer)
    with pytest.raises(OSError, match="disk full"):
        trace.save(tmp_path / "new.trace")
    assert os.listdir(tmp_path) == []  # no target, no temp file


def test_failed_save_keeps_existing_file(tmp_path, trace, monkeypatch):
    import replaymoe.record.trace.file as trace_mod

    path = tmp_path / "keep.trace"
    trace.save(path)
    before = path.read_bytes()
    monkeypatch.setattr(trace_mod, "_write_payload", _failing_writer)
    with pytest.raises(OSError):
        trace.replace(token_offset=0).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.trace"]


def test_save_into_missing_directory(tmp_path, trace):
    with pytest.raises(FileNotFoundError):
        trace.save(tmp_path / "nope" / "t.trace")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- corruption


def _load_fails(path, match):
    with pytest.raises(TraceFormatError, match=re.escape(str(path)) + ".*" + match) as info:
        RoutingTrace.load(path)
    assert info.value.path == str(path)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("keep", [0, 3, 30, 0.5, -1])  # empty, inside magic, inside header, half, last byte
def test_truncated(tmp_path, trace, keep):
    path = tmp_path / "t.trace"
    trace.save(path)
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    path.write_bytes(data[:n])
    _load_fails(path, "")


@pytest.mark.parametrize("where", ["ids", "meta"])
def test_flipped_byte_in_payload(tmp_path, trace, where):
    # uncompressed so the member bytes can be located; the zip CRC or our sha256 must catch it
    path = tmp_path / "t.trace"
    trace.save(path, compress=False)
    data = bytearray(path.read_bytes())
    needle = trace.ids.astype("<i2").tobytes() if where == "ids" else b'"sha256"'
    at = data.find(needle)
    assert at > 0
    data[at + len(needle) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _load_fails(path, "corrupt")


@pytest.mark.parametrize("offset_frac", [0.25, 0.5, 0.75])
def test_flipped_byte_compressed(tmp_path, trace, offset_frac):
    path = tmp_path / "t.trace"
    trace.save(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("ids.npy")
    # inside the ids member's deflate stream: after its local header (30 bytes + name + extra)
    h = info.header_offset
    start = (
        h
        + 30
        + int.from_bytes(data[h + 26 : h + 28], "little")
        + int.from_bytes(data[h + 28 : h + 30], "little")
    )
    data[start + int(info.compress_size * offset_frac)] ^= 0xFF
    path.write_bytes(bytes(data))
    _load_fails(path, "")


def _write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _meta_bytes(**meta):
    return np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)


def test_consistent_zip_with_tampered_ids(tmp_path, trace):
    # a well-formed archive (valid zip CRCs) whose ids differ from the recorded checksum
    path = tmp_path / "t.trace"
    trace.save(path)
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        ids = z["ids"].copy()
    ids[1, 0, 0] = (ids[1, 0, 0] + 1) % 16
    _write_npz(path, ids=ids, meta=_meta_bytes(**meta))
    _load_fails(path, "checksum")


@pytest.mark.parametrize("version, match", [(FORMAT_VERSION + 1, "newer"), (0, "version"), ("1", "version")])
def test_wrong_version(tmp_path, trace, version, match):
    path = tmp_path / "t.trace"
    trace.save(path)
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        ids = z["ids"]
    meta["version"] = version
    _write_npz(path, ids=ids, meta=_meta_bytes(**meta))
    _load_fails(path, match)


@pytest.mark.parametrize(
    "arrays",
    [
        {"weights": np.ones(3)},  # someone else's npz
        {"ids": np.zeros((1, 1, 1), np.int16), "meta": np.array("{}")},  # meta not bytes
        {"ids": np.zeros((1, 1, 1), np.int16), "meta": np.frombuffer(b'{"format": "x"}', np.uint8)},
        {"ids": np.zeros((1, 1, 1), np.int16), "meta": np.frombuffer(b"not json", np.uint8)},
    ],
)
def test_foreign_npz(tmp_path, arrays):
    path = tmp_path / "foreign.npz"
    _write_npz(path, **arrays)
    _load_fails(path, "")


def test_shape_mismatch_with_meta(tmp_path, trace):
    path = tmp_path / "t.trace"
    trace.save(path)
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
    ids = trace.ids[:3]
    meta["sha256"] = __import__("hashlib").sha256(ids.astype("<i2").tobytes()).hexdigest()
    _write_npz(path, ids=ids, meta=_meta_bytes(**meta))
    _load_fails(path, "do not match")


@pytest.mark.parametrize(
    "content",
    [b"hello world\n", b"", None],  # text, empty, a plain .npy file
)
def test_not_a_zip(tmp_path, content):
    path = tmp_path / "x.trace"
    if content is None:
        np.save(path.with_suffix(".npy"), np.zeros(3))
        path = path.with_suffix(".npy")
    else:
        path.write_bytes(content)
    _load_fails(path, "not a replaymoe routing trace")


def test_zip_without_npz_members(tmp_path):
    path = tmp_path / "x.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hi")
    _load_fails(path, "")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        RoutingTrace.load(tmp_path / "absent.trace")


# ----------------------------------------------------------------------------- vLLM


@pytest.mark.parametrize("dtype", ["int16", "int32", "int64", "uint8", "uint16"])
def test_to_vllm_readable_by_numpy(rng, dtype):
    ids = random_ids(rng, 5, 3, 2, 200)
    t = RoutingTrace(ids, num_experts=200, top_k=2)
    arr = np.load(io.BytesIO(base64.b64decode(t.to_vllm(dtype))), allow_pickle=False)
    assert arr.dtype == np.dtype(dtype) and arr.shape == (5, 3, 2)
    np.testing.assert_array_equal(arr, ids)


def test_to_vllm_unsigned_rejects_missing_and_large(rng, trace):
    with pytest.raises(ValueError, match="signed dtype"):
        trace.to_vllm("uint8")
    big = RoutingTrace(np.array([[[300, 1]]]), num_experts=512, top_k=2)
    with pytest.raises(ValueError, match="300"):
        big.to_vllm("uint8")
    with pytest.raises(ValueError, match="dtype"):
        big.to_vllm("float32")


@pytest.mark.parametrize(
    "dtype, E",
    [("uint8", 256), ("uint16", 384), ("int32", 128), ("int16", 64)],  # vLLM's compact and wide wire dtypes
)
def test_from_vllm_b64_dtypes(rng, dtype, E):
    ids = random_ids(rng, 6, 4, 8, E)
    ids[2, 1] = np.arange(E - 8, E)  # the largest ids survive the dtype
    t = RoutingTrace.from_vllm(npy_b64(ids.astype(dtype)), num_experts=E)
    np.testing.assert_array_equal(t.ids, ids)
    assert (t.num_tokens, t.num_layers, t.top_k, t.num_experts, t.token_offset) == (6, 4, 8, E, 0)


def test_from_vllm_wrapped_base64(rng):
    ids = random_ids(rng, 4, 2, 2, 8)
    buf = io.BytesIO()
    np.save(buf, ids.astype(np.int32))
    wrapped = base64.encodebytes(buf.getvalue()).decode()  # MIME style: a newline every 76 chars
    assert "\n" in wrapped
    np.testing.assert_array_equal(RoutingTrace.from_vllm(wrapped).ids, ids)
    with pytest.raises(TraceFormatError, match="base64"):
        RoutingTrace.from_vllm("défaut")


def test_from_vllm_int16_sentinel_rows_stay_missing(rng):
    # legacy payload (MoE columns only, int16, -1 for prefix-cache hits); vLLM 0.33 never sends -1
    ids = random_ids(rng, 5, 2, 2, 8, missing=[(0, 0), (0, 1), (1, 0), (1, 1)])  # 2-token prefix hit
    t = RoutingTrace.from_vllm(npy_b64(ids.astype(np.int16)))
    assert t.missing_mask()[:2].all() and not t.missing_mask()[2:].any()


DENSE_FIRST = (4, [1, 2, 3])  # num_hidden_layers, the MoE layers' numbers: layer 0 dense


def _all_layers(moe_rows, num_layers, moe, dtype):
    """vLLM 0.33's layer axis: one column per decoder layer, dense layers all zero."""
    out = np.zeros((len(moe_rows), num_layers, moe_rows.shape[2]), dtype)
    out[:, moe] = moe_rows
    return out


def _response(
    prompt_len, completion_len, L, K, E, rng, *, layout="vllm_0_33", endpoint="chat", n=1, start=0, dtype=None
):
    """A vLLM response with routing and ``return_token_ids: true``.

    layout: "vllm_0_33" (one column per decoder layer of a model whose layer 0 is dense, uint8/uint16
    by E, rows from ``start``), "moe_only" (the legacy MoE-columns layout) or "legacy_split" (vLLM
    v0.21's ``prompt_routed_experts`` + per-choice completion rows). endpoint: "chat" (prompt ids at
    the top level) or "completions" (prompt ids in each choice). Returns (response, the MoE rows of
    each choice from ``start``).
    """
    total = prompt_len + completion_len - 1  # the last sampled token has no routing
    full = [random_ids(rng, total, L, K, E) for _ in range(n)]
    for f in full[1:]:
        f[:prompt_len] = full[0][:prompt_len]  # the n choices share the prompt
    dtype = dtype or ("uint8" if E <= 256 else "uint16")
    moe = list(range(1, L + 1))

    def wire(rows):
        return _all_layers(rows, L + 1, moe, dtype) if layout == "vllm_0_33" else rows.astype(dtype)

    prompt_ids = list(range(100, 100 + prompt_len))
    resp = {"id": "cmpl-1", "model": "Qwen/Qwen3-30B-A3B", "choices": []}
    if endpoint == "chat":
        resp["prompt_token_ids"] = prompt_ids
    if layout == "legacy_split":
        resp["prompt_routed_experts"] = npy_b64(wire(full[0][start:prompt_len]))
    for i in range(n):
        rows = full[i][prompt_len:] if layout == "legacy_split" else full[i][start:]
        choice = {
            "index": i,
            "token_ids": list(range(200, 200 + completion_len)),
            "routed_experts": npy_b64(wire(rows)),
        }
        if endpoint == "completions":
            choice["prompt_token_ids"] = prompt_ids
        resp["choices"].append(choice)
    return resp, [f[start:] for f in full]


@pytest.mark.parametrize(
    "layout, endpoint, E",
    [
        ("vllm_0_33", "chat", 64),  # all-layer columns (layer 0 dense), uint8, prompt ids at the top level
        ("vllm_0_33", "completions", 64),  # /v1/completions: prompt_token_ids inside the choice
        ("vllm_0_33", "chat", 300),  # E > 256: uint16
        ("moe_only", "chat", 64),  # legacy: one column per MoE layer
        ("legacy_split", "chat", 64),  # legacy: v0.21's prompt_routed_experts + completion rows
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_from_vllm_response(rng, layout, endpoint, E, as_json):
    resp, full = _response(5, 4, 3, 2, E, rng, layout=layout, endpoint=endpoint)
    obj = json.dumps(resp) if as_json else resp
    t = RoutingTrace.from_vllm(obj, num_experts=E, layer_ids=[1, 2, 3])
    assert t.num_tokens == 5 + 4 - 1  # (num_tokens - 1, L, K)
    np.testing.assert_array_equal(t.ids, full[0])
    assert t.model_id == "Qwen/Qwen3-30B-A3B" and t.token_offset == 0 and t.layer_ids == (1, 2, 3)
    assert t.token_ids.tolist() == [100, 101, 102, 103, 104, 200, 201, 202]  # the fed positions' tokens


def test_from_vllm_choice_dict_and_array(rng):
    resp, full = _response(3, 3, 2, 2, 16, rng, layout="moe_only", dtype="int32")
    t = RoutingTrace.from_vllm(resp["choices"][0])  # a chat choice: no prompt ids, nothing to check
    np.testing.assert_array_equal(t.ids, full[0])
    assert t.token_ids is None
    np.testing.assert_array_equal(RoutingTrace.from_vllm(full[0]).ids, full[0])  # offline API array
    np.testing.assert_array_equal(RoutingTrace.from_vllm(full[0].tolist()).ids, full[0])  # JSON lists


@pytest.mark.parametrize("layout", ["vllm_0_33", "legacy_split"])
def test_from_vllm_n_choices_share_prompt(rng, layout):
    resp, full = _response(4, 3, 2, 2, 16, rng, layout=layout, n=2)
    t0 = RoutingTrace.from_vllm(resp, choice=0, layer_ids=[1, 2])
    t1 = RoutingTrace.from_vllm(resp, choice=1, layer_ids=[1, 2])
    np.testing.assert_array_equal(t1.ids, full[1])
    np.testing.assert_array_equal(t0.ids[:4], t1.ids[:4])
    with pytest.raises(ValueError, match="choice.*below the response's 2 choices, got 2"):
        RoutingTrace.from_vllm(resp, choice=2, layer_ids=[1, 2])


@pytest.mark.parametrize(
    "layout, start",
    [
        ("vllm_0_33", 4),  # routed_experts_prompt_start = 4 of a 6-token prompt
        ("vllm_0_33", 6),  # = the prompt's length: the completion's fed positions only
        ("legacy_split", 4),
    ],
)
def test_from_vllm_prompt_start_is_passed_never_read(rng, layout, start):
    resp, full = _response(6, 3, 2, 2, 16, rng, layout=layout, start=start)
    t = RoutingTrace.from_vllm(resp, prompt_start=start, layer_ids=[1, 2])
    assert t.token_offset == start and t.num_tokens == 6 + 3 - 1 - start
    np.testing.assert_array_equal(t.ids, full[0])
    assert t.token_ids.tolist() == ([*range(100, 106), 200, 201])[start:]
    # vLLM does not echo the start: without it the rows do not fit, and the error says which start would
    says = rf"expected 8 .*routed_experts_prompt_start={start} gives"
    if layout == "legacy_split":
        says = rf"prompt_routed_experts has {6 - start} rows but the prompt has 6 tokens \(prompt_start 0\)"
    with pytest.raises(TraceFormatError, match=says):
        RoutingTrace.from_vllm(resp, layer_ids=[1, 2])
    resp["routed_experts_prompt_start"] = start  # a field vLLM never writes is not read either
    with pytest.raises(TraceFormatError, match=says):
        RoutingTrace.from_vllm(resp, layer_ids=[1, 2])
    resp.pop("prompt_token_ids")  # without token ids nothing is checked
    assert RoutingTrace.from_vllm(resp, prompt_start=start, layer_ids=[1, 2]).token_offset == start


def test_from_vllm_one_token_completion(rng):
    # completion of one token: its routing does not exist yet, the choice carries 0 rows (legacy split)
    resp, full = _response(4, 1, 2, 2, 16, rng, layout="legacy_split")
    t = RoutingTrace.from_vllm(resp, layer_ids=[1, 2])
    assert t.num_tokens == 4
    np.testing.assert_array_equal(t.ids, full[0])


@pytest.mark.parametrize(
    "obj, match",
    [
        (
            {"choices": [{"index": 0, "routed_experts": None}], "prompt_routed_experts": None},
            "no routed_experts",
        ),
        ({"choices": []}, r"has no choices \(\"choices\": \[\]\)"),  # not blamed on the choice index
        ({"choices": {"0": {}}}, "choices is not a list"),
        ({"choices": [{"routed_experts": "AAAA", "token_ids": "abc"}]}, "token_ids is not a list"),
        ("!!!not base64", "base64"),
        (base64.b64encode(b"garbage bytes").decode(), "npy"),
        (npy_b64(np.zeros((2, 3))), "integer"),  # float payload
        (npy_b64(np.zeros((2, 3), np.int32)), "shape"),  # 2-D payload
        ("{not json", "JSON"),
        (3.5, "unsupported"),
    ],
)
def test_from_vllm_rejects(obj, match):
    with pytest.raises(TraceFormatError, match=match):
        RoutingTrace.from_vllm(obj)


@pytest.mark.parametrize(
    "endpoint, extra_rows",
    [
        ("chat", 1),  # one row too many (the last sampled token's)
        ("completions", 11),  # /v1/completions: its per-choice prompt ids are checked too
        ("chat", -2),  # rows missing
    ],
)
def test_from_vllm_rows_must_fit_the_token_counts(rng, endpoint, extra_rows):
    resp, full = _response(5, 3, 2, 2, 16, rng, endpoint=endpoint, layout="moe_only")
    rows = random_ids(rng, 7 + extra_rows, 2, 2, 16)
    resp["choices"][0]["routed_experts"] = npy_b64(rows.astype(np.uint8))
    with pytest.raises(
        TraceFormatError, match=rf"{7 + extra_rows} rows, expected 7 \(5 prompt \+ 3 completion"
    ):
        RoutingTrace.from_vllm(resp)


def test_from_vllm_prompt_start_past_the_prompt(rng):
    resp, _ = _response(5, 3, 2, 2, 16, rng, layout="moe_only")
    with pytest.raises(ValueError, match="prompt_start: expected at most the prompt's 5 tokens, got 6"):
        RoutingTrace.from_vllm(resp, prompt_start=6)


def test_from_vllm_prompt_length_mismatch(rng):
    resp, _ = _response(5, 3, 2, 2, 16, rng, layout="legacy_split")
    resp["prompt_token_ids"] = list(range(7))
    with pytest.raises(TraceFormatError, match="5 rows but the prompt has 7"):
        RoutingTrace.from_vllm(resp)


@pytest.mark.parametrize(
    "columns, layer_ids, match",
    [
        (
            "dense_zero",
            None,
            r"layer column\(s\) 0 of 4 are all zero.*dense.*pass layer_ids",
        ),  # never guessed
        ("dense_nonzero", [1, 2, 3], r"layer column 0 is not in layer_ids \[1, 2, 3\].*at row 1"),
        ("dense_zero", [2, 3], r"layer column 1 is not in layer_ids \[2, 3\]"),  # a MoE layer left out
        ("dense_zero", [1, 2, 7], r"4 layer columns, but layer_ids \[1, 2, 7\]"),  # past the columns
        (  # as many layer_ids as columns: the MoE-only layout, but column 0 is a dense layer's zeros
            "dense_zero",
            [0, 1, 2, 3],
            r"column\(s\) 0 of 4 are all zero, and layer_ids \[0, 1, 2, 3\] take all 4 columns",
        ),
        ("dense_zero", [1, 1, 2], "distinct non-negative"),
    ],
)
def test_from_vllm_layer_columns(rng, columns, layer_ids, match):
    moe_rows = random_ids(rng, 5, 3, 2, 16)
    payload = _all_layers(moe_rows, *DENSE_FIRST, np.uint8)
    if columns == "dense_nonzero":
        payload[1, 0] = [4, 9]
    with pytest.raises(ValueError, match=match):
        RoutingTrace.from_vllm(npy_b64(payload), layer_ids=layer_ids)


def test_from_vllm_layer_ids_select_the_moe_columns(rng):
    moe_rows = random_ids(rng, 5, 3, 2, 16)
    t = RoutingTrace.from_vllm(npy_b64(_all_layers(moe_rows, *DENSE_FIRST, np.uint8)), layer_ids=[1, 2, 3])
    np.testing.assert_array_equal(t.ids, moe_rows)
    # the legacy MoE-only layout with the same layer_ids: taken as is
    legacy = RoutingTrace.from_vllm(npy_b64(moe_rows.astype(np.int32)), layer_ids=[1, 2, 3])
    assert legacy == t


def test_vllm_round_trip(trace):
    back = RoutingTrace.from_vllm(
        trace.to_vllm("int32"), num_experts=16, layer_ids=[1, 3, 4], model_id="toy/moe"
    )
    assert back == trace.replace(token_offset=0)


# ----------------------------------------------------------------------------- SGLang


@pytest.mark.parametrize(
    "dtype, tag, E",
    [
        ("int32", "int32", 512),  # SGLang's default
        ("int32", "torch.int32", 512),  # the tag spelled as torch prints it
        ("uint8", "uint8", 256),  # SGLANG_ROUTED_EXPERTS_DTYPE=uint8
        ("uint8", "torch.uint8", 256),
        ("uint16", "uint16", 1000),
        ("uint16", "torch.uint16", 1000),
    ],
)
def test_from_sglang(rng, dtype, tag, E):
    ids = random_ids(rng, 7, 3, 4, E)
    ids[3, 2] = np.arange(E - 4, E)  # the largest ids survive the dtype
    b64 = base64.b64encode(ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()  # flat
    t = RoutingTrace.from_sglang(b64, 3, 4, dtype=dtype, num_experts=E)
    np.testing.assert_array_equal(t.ids, ids)
    assert t.num_experts == E
    # the meta_info dict with its dtype tag (which overrides the dtype argument), and the start offset
    t2 = RoutingTrace.from_sglang({"routed_experts": b64, "routed_experts_dtype": tag}, 3, 4, start=5)
    np.testing.assert_array_equal(t2.ids, ids)
    assert t2.token_offset == 5
    assert RoutingTrace.from_sglang(t.to_sglang(dtype), 3, 4, dtype=dtype, num_experts=E) == t


def test_from_sglang_layer_columns(rng):
    moe_rows = random_ids(rng, 5, 3, 2, 16)
    flat = _all_layers(moe_rows, *DENSE_FIRST, np.int32).astype("<i4").tobytes()
    b64 = base64.b64encode(flat).decode()
    t = RoutingTrace.from_sglang(b64, 4, 2, layer_ids=[1, 2, 3])
    np.testing.assert_array_equal(t.ids, moe_rows)
    assert t.layer_ids == (1, 2, 3)
    with pytest.raises(TraceFormatError, match=r"layer column\(s\) 0 of 4 are all zero"):
        RoutingTrace.from_sglang(b64, 4, 2)


def test_from_sglang_rejects(rng):
    ids = random_ids(rng, 2, 3, 4, 16).astype("<i4")
    b64 = base64.b64encode(ids.tobytes()).decode()
    with pytest.raises(TraceFormatError, match="whole number"):
        RoutingTrace.from_sglang(b64, 5, 4)  # 96 bytes is not a multiple of 5*4*4
    with pytest.raises(TraceFormatError, match="whole number"):
        RoutingTrace.from_sglang(base64.b64encode(ids.tobytes()[:-2]).decode(), 3, 4)
    with pytest.raises(ValueError, match="dtype"):
        RoutingTrace.from_sglang(b64, 3, 4, dtype="float32")
    with pytest.raises(ValueError, match="meta_info.routed_experts_dtype.*bfloat16"):  # the tag named
        RoutingTrace.from_sglang({"routed_experts": b64, "routed_experts_dtype": "torch.bfloat16"}, 3, 4)
    with pytest.raises(TraceFormatError, match="routed_experts"):
        RoutingTrace.from_sglang({"foo": 1}, 3, 4)
    with pytest.raises(ValueError, match="ids"):
        RoutingTrace.from_sglang(b64, 3, 4, num_experts=8)  # ids up to 15 do not fit E=8


@pytest.mark.parametrize(
    "prompt, completion, start",
    [
        (4, 4, 0),  # 7 rows = 4 + 4 - 1: the last sampled token has no routing
        (5, 3, 0),  # another split of the same 8 tokens
        (6, 4, 2),  # from start 2: 6 + 4 - 1 - 2 = 7 rows
        (4, 5, 0),  # one completion token more than the rows cover: refused
        (6, 4, 3),  # a start off by one: refused
    ],
)
def test_from_sglang_rows_checked_against_meta_info_token_counts(rng, prompt, completion, start):
    ids = random_ids(rng, 7, 3, 4, 16)
    meta = {
        "routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode(),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }
    if prompt + completion - 1 - start == 7:
        assert RoutingTrace.from_sglang(meta, 3, 4, start=start).num_tokens == 7
    else:
        with pytest.raises(TraceFormatError, match=r"7 rows, expected \d+ .*prompt .*completion"):
            RoutingTrace.from_sglang(meta, 3, 4, start=start)


# ----------------------------------------------------------------------------- concat / merge


def test_concat_prompt_and_completion(rng):
    a = RoutingTrace(random_ids(rng, 4, 2, 2, 8), num_experts=8, top_k=2, model_id="m")
    b = RoutingTrace(random_ids(rng, 3, 2, 2, 8), num_experts=None, top_k=2, token_offset=4)
    c = RoutingTrace.concat([a, b])
    assert (c.num_tokens, c.token_offset, c.num_experts, c.model_id) == (7, 0, 8, "m")
    np.testing.assert_array_equal(c.ids, np.concatenate([a.ids, b.ids]))
    with pytest.raises(ValueError, match="consecutive"):
        RoutingTrace.concat([a, b.replace(token_offset=5)])
    with pytest.raises(ValueError, match="top_k"):
        RoutingTrace.concat(
            [a, RoutingTrace(random_ids(rng, 1, 2, 3, 8), num_experts=8, top_k=3, token_offset=4)]
        )
    with pytest.raises(ValueError, match="model_id"):
        RoutingTrace.concat([a, b.replace(model_id="other")])
    with pytest.raises(ValueError, match="at least one"):
        RoutingTrace.concat([])


def test_merge_multi_turn(rng):
    # turn 1: positions 0..5; turn 2 re-sends positions 4..9 (prompt_start=4), prefix-cache rows missing
    full = random_ids(rng, 10, 2, 2, 8)
    t1 = RoutingTrace(full[:6], num_experts=8, top_k=2)
    turn2 = full[4:].copy()
    turn2[0] = -1  # position 4 served from the prefix cache in turn 2
    t2 = RoutingTrace(turn2, num_experts=8, top_k=2, token_offset=4)
    m = RoutingTrace.merge([t1, t2])
    assert (m.token_offset, m.num_tokens) == (0, 10)
    np.testing.assert_array_equal(m.ids, full)
    # a gap stays missing
    g = RoutingTrace.merge([t1, RoutingTrace(full[8:], num_experts=8, top_k=2, token_offset=8)])
    assert g.missing_mask()[6:8].all() and not g.missing_mask()[:6].any() and not g.missing_mask()[8:].any()


def test_merge_conflicts(rng):
    a_ids = random_ids(rng, 3, 1, 2, 8)
    b_ids = a_ids.copy()
    b_ids[1, 0] = [7, 6] if tuple(a_ids[1, 0]) != (7, 6) else [5, 4]
    a = RoutingTrace(a_ids, num_experts=8, top_k=2)
    b = RoutingTrace(b_ids, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="position 1, layer 0"):
        RoutingTrace.merge([a, b])
    np.testing.assert_array_equal(RoutingTrace.merge([a, b], on_conflict="first").ids, a_ids)
    np.testing.assert_array_equal(RoutingTrace.merge([a, b], on_conflict="last").ids, b_ids)
    with pytest.raises(ValueError, match="on_conflict"):
        RoutingTrace.merge([a, b], on_conflict="newest")


@pytest.mark.parametrize(
    "layer_ids, hidden",
    [
        ([1, 3], 4),  # dense layers 0 and 2 between the MoE layers: zero columns
        (None, 2),  # every layer MoE: the 0.33 layout equals the MoE-column one
        ([2, 3], 5),  # a dense tail after the last MoE layer
    ],
)
def test_to_vllm_writes_the_0_33_layout_that_from_vllm_reads(layer_ids, hidden):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(6)]).reshape(3, 2, 2)
    t = RoutingTrace(ids, num_experts=8, top_k=2, layer_ids=layer_ids)
    raw = np.load(io.BytesIO(base64.b64decode(t.to_vllm("uint8", num_hidden_layers=hidden))))
    assert raw.dtype == np.uint8 and raw.shape == (3, hidden, 2)
    moe = list(t.model_layer_ids())
    assert (raw[:, [c for c in range(hidden) if c not in moe]] == 0).all()
    back = RoutingTrace.from_vllm(t.to_vllm("uint8", num_hidden_layers=hidden), layer_ids=moe, num_experts=8)
    assert np.array_equal(back.ids, t.ids)


def _batch(rng, R=3, n=5, L=2, K=2, E=6):
    ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(R * n)])
    return ids.reshape(R, n, L, K).astype(np.int64)


def test_from_batch_equals_one_constructor_call_per_row(rng):
    # a captured batch, checked in one pass: each row's trace is the constructor's on that row's prefix
    ids = _batch(rng)
    ids[1, 3:] = -1  # row 1 is 3 positions long: the rest is padding
    tokens = rng.integers(0, 50, size=ids.shape[:2])
    tokens[1, 3:] = -1
    weights = rng.random(ids.shape).astype(np.float32)
    kw = dict(num_experts=6, top_k=2, layer_ids=[1, 3], model_id="m")
    got = RoutingTrace.from_batch(ids, [5, 3, 4], token_ids=tokens, weights=weights, **kw)
    for b, (t, length) in enumerate(zip(got, [5, 3, 4])):
        want = RoutingTrace(ids[b, :length], token_ids=tokens[b, :length], weights=weights[b, :length], **kw)
        assert t == want and t.ids.flags.c_contiguous and t.ids.dtype == np.int16
        np.testing.assert_array_equal(t.weights, want.weights)
        assert t.layer_ids == (1, 3) and t.model_id == "m" and t.token_offset == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ids: ids.__setitem__((2, 4, 1, 0), 6), r"ids: expected expert ids in \[0, 5\]"),  # in a row
        (lambda ids: ids.__setitem__((0, 1, 0), [3, 3]), "ids: expected distinct expert ids"),  # duplicate
    ],
)
def test_from_batch_checks_every_row(rng, change, match):
    ids = _batch(rng)
    change(ids)
    with pytest.raises(ValueError, match=match):
        RoutingTrace.from_batch(ids, [5, 5, 5], num_experts=6, top_k=2)


def test_from_batch_of_no_rows_is_empty():
    # a batch that recorded no row (edge: nothing to split)
    assert RoutingTrace.from_batch(np.zeros((0, 4, 2, 2), np.int16), [], num_experts=6, top_k=2) == []


def test_from_batch_owns_its_arrays(rng):
    # the traces never alias the caller's arrays (on the CPU a capture buffer's numpy view is written
    # again by the next batch)
    ids = _batch(rng).astype(np.int16)
    tokens = np.arange(15, dtype=np.int64).reshape(3, 5)
    got = RoutingTrace.from_batch(ids, [5, 5, 5], num_experts=6, top_k=2, token_ids=tokens)
    ids[:] = -1
    tokens[:] = -1
    assert (got[0].ids >= 0).all() and got[2].token_ids.tolist() == [10, 11, 12, 13, 14]


# ----------------------------------------------------------------------------- no silent conversions


def _ok_ids(rng):
    return random_ids(rng, 2, 2, 2, 8)


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"layer_ids": "13"}, "Invalid type of layer_ids"),  # a str: was (1, 3)
        ({"layer_ids": [0.9, 1.9]}, "0.9 (float)"),  # floats: were truncated to (0, 1)
        ({"layer_ids": [True, 2]}, "True (bool)"),
        ({"token_ids": [5.9, 6.9]}, "Invalid dtype of token_ids"),  # were truncated to [5, 6]
        ({"token_ids": ["5", "6"]}, "Invalid dtype of token_ids"),  # were accepted
        ({"token_ids": "ab"}, "Invalid type of token_ids"),  # was numpy's bare ValueError
        (
            {"ids": [[[0, 1], [2, 3]], [[4, 5]]]},
            "Invalid shape of ids: expected a rectangular array",
        ),  # ragged
        ({"top_k": 2.0}, "Invalid type of top_k"),
    ],
)
def test_constructor_refuses_values_of_the_wrong_type(rng, kw, says):
    args = {"ids": _ok_ids(rng), "num_experts": 8, "top_k": 2, **kw}
    with pytest.raises(ValueError) as exc:
        RoutingTrace(args.pop("ids"), **args)
    assert says in str(exc.value)


def test_constructor_takes_numpy_ints_and_bf16_weights(rng):
    import torch

    ids = _ok_ids(rng)
    w = torch.rand(2, 2, 2, dtype=torch.bfloat16)  # was TypeError: Got unsupported ScalarType BFloat16
    t = RoutingTrace(ids, num_experts=np.int64(8), top_k=np.int32(2), layer_ids=np.array([3, 4]), weights=w)
    assert (t.num_experts, t.top_k, t.layer_ids) == (8, 2, (3, 4)) and type(t.top_k) is int
    assert t.weights.dtype == np.float32 and np.array_equal(t.weights, w.float().numpy())


def test_save_compress_must_be_a_bool(rng, tmp_path):
    t = RoutingTrace(_ok_ids(rng), num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="Invalid type of compress"):  # "no" was truthy: compressed
        t.save(tmp_path / "t.rmtrace", compress="no")
    assert not (tmp_path / "t.rmtrace").exists()


def _rewrite_meta(path, **changes):
    """Rewrite a saved trace's metadata (checksums stay right: only the metadata is wrong)."""
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    meta = json.loads(members["meta"].tobytes())
    meta.update(changes)
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:  # (np.savez adds .npz to a name that lacks it)
        np.savez(f, **members)


def test_load_names_the_file_for_bad_token_ids_and_non_finite_weights(rng, tmp_path):
    path = tmp_path / "t.rmtrace"
    RoutingTrace(_ok_ids(rng), num_experts=8, top_k=2).save(path)
    _rewrite_meta(path, token_ids={"a": 1})  # a dict: was a raw TypeError
    with pytest.raises(TraceFormatError, match=re.escape(str(path))):
        RoutingTrace.load(path)
    # a NaN in a recorded row's weights, written by hand with the right checksum: was "invalid metadata"
    w = np.ones((2, 2, 2), np.float32)
    RoutingTrace(_ok_ids(rng), num_experts=8, top_k=2, weights=w).save(path)
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    members["weights"] = members["weights"].copy()
    members["weights"][0, 0, 0] = np.nan
    meta = json.loads(members["meta"].tobytes())
    import hashlib

    meta["weights_sha256"] = hashlib.sha256(members["weights"].astype("<f4").tobytes()).hexdigest()
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:  # (np.savez adds .npz to a name that lacks it)
        np.savez(f, **members)
    with pytest.raises(TraceFormatError) as exc:
        RoutingTrace.load(path)
    assert str(path) in str(exc.value) and "non-finite weights" in str(exc.value)
    assert "invalid metadata" not in str(exc.value)


@pytest.mark.parametrize(
    "payload, kw, says",
    [
        ("PAYLOAD", {"layer_ids": [1.7, 2.2]}, "Invalid type of layer_ids"),  # were (1, 2)
        ("PAYLOAD", {"layer_ids": "12"}, "Invalid type of layer_ids"),
        ("PAYLOAD", {"layer_ids": [True, 2]}, "Invalid type of layer_ids"),
        ("TORCH_FLOAT", {}, "expected integer expert ids, got dtype float32"),  # was truncated
        (
            [[[1, 2]], [[3]]],
            {},
            "vLLM routed_experts: expected a (tokens, layers, top_k) nested list",
        ),  # ragged
        ("UINT64", {}, f"got {2**63 + 5} at"),  # was reported as -9223372036854775803
        (np.zeros((3, 0, 2), np.uint8), {}, "got shape (3, 0, 2)"),  # no layers: was accepted
    ],
)
def test_from_vllm_refuses_silent_conversions(rng, payload, kw, says):
    import torch

    if isinstance(payload, np.ndarray):
        pass
    elif payload == "PAYLOAD":
        payload = npy_b64(_all_layers(random_ids(rng, 3, 2, 2, 8), 3, [1, 2], np.uint8))
    elif payload == "TORCH_FLOAT":
        payload = torch.tensor([[[1.9, 3.7]], [[2.2, 5.5]]])
    elif payload == "UINT64":
        payload = np.array([[[2**63 + 5, 1]]], dtype=np.uint64)
    with pytest.raises(ValueError) as exc:
        RoutingTrace.from_vllm(payload, **kw)
    assert says in str(exc.value)


@pytest.mark.parametrize(
    "meta_changes, kw, says",
    [
        ({"prompt_tokens": "24"}, {}, "meta_info.prompt_tokens: expected a token count"),  # was: no row check
        ({}, {"start": -1}, "Invalid value of start"),  # was "of token_offset"
        ({}, {"layer_ids": [1.7, 2.2]}, "Invalid type of layer_ids"),
    ],
)
def test_from_sglang_refuses_silent_conversions(rng, meta_changes, kw, says):
    ids = _all_layers(random_ids(rng, 3, 2, 2, 8), 3, [1, 2], np.int32)
    meta = {"routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode(), "completion_tokens": 3,
            **meta_changes}  # fmt: skip
    with pytest.raises(ValueError) as exc:
        RoutingTrace.from_sglang(meta, 3, 2, **{"layer_ids": [1, 2], **kw})
    assert says in str(exc.value)

"""Messages that used to mislead, each checked through the code that prints it (issue 60).

* a full disk: ``error: : No space left on device`` (no file) -> the file being written and the reason;
  real ``ENOSPC`` errors from writing ``/dev/full`` (a symlink in ``--out``), not simulated ones;
* ``RoutingTrace.save`` into a missing folder named its temporary file -> the target and the folder;
* bad ids inside a ``.rmtrace`` were "invalid metadata" -> the constructor's words plus the file;
* "N token(s) per layer without routing" printed a maximum -> per-layer figures;
* the demo picture's agreement panel had no layer labels -> the model's layer numbers.
"""

from __future__ import annotations

import errno
import os
import re
import sys

import numpy as np
import pytest

from replaymoe.bench._text import os_error_text
from replaymoe.record.trace import RoutingTrace, TraceFormatError
from replaymoe.record.trace import file as trace_file

FULL = "/dev/full"  # Linux: every write fails with ENOSPC, as on a full disk
needs_dev_full = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists(FULL), reason="needs Linux's /dev/full"
)


def _enospc() -> OSError:
    """The OSError a full disk raises: from a real write to /dev/full (no file name in it)."""
    try:
        with open(FULL, "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
    except OSError as exc:
        return exc
    raise AssertionError("writing /dev/full did not fail")


def _trace(seed=0, n=5, layers=3, e=8, k=2):
    ids = np.argsort(np.random.default_rng(seed).random((n, layers, e)), axis=-1)[..., :k]
    return RoutingTrace(ids, num_experts=e, top_k=k, layer_ids=[1, 3, 5][:layers], model_id="m")


_META = dict(num_experts=8, top_k=2, layer_ids=[1, 3, 5], model_id="m", token_offset=0)


# --------------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------------


@needs_dev_full
@pytest.mark.parametrize(
    "path, action, says",
    [
        ("out/x.png", "write", "cannot write out/x.png: No space left on device"),  # the caller's name
        (None, "write", "cannot write: No space left on device"),  # no name anywhere: no ": :"
    ],
)
def test_os_error_text_names_the_file_and_reason(path, action, says):
    exc = _enospc()
    assert exc.errno == errno.ENOSPC and exc.filename is None  # why the caller must name the file
    assert os_error_text(exc, path, action=action) == says


def test_os_error_text_falls_back_to_the_errors_own_file(tmp_path):
    missing = tmp_path / "absent.json"
    with pytest.raises(OSError) as info:
        missing.read_bytes()
    assert os_error_text(info.value, action="read") == f"cannot read {missing}: No such file or directory"


@needs_dev_full
@pytest.mark.parametrize(
    "name",
    [
        "heatmap.png",  # matplotlib's savefig (was a traceback, exit 1)
        "vllm_response_seq0.json",  # pathlib write_text
        "summary.json",  # the last file, after the whole run
    ],
)
def test_demo_full_disk_names_the_file(name, tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from replaymoe.apps import cli

    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(FULL)  # passes the checks before the run (a writable file)
    rc = cli.main(["demo", "--fast", "--quiet", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line == f"replaymoe demo: error: cannot write {out / name}: No space left on device"


@needs_dev_full
def test_plot_heatmap_full_disk_names_the_file():
    pytest.importorskip("matplotlib")
    from replaymoe.record.stats import plot_heatmap

    with pytest.raises(OSError) as info:
        plot_heatmap(_trace(), FULL)  # no suffix: PNG
    assert info.value.errno == errno.ENOSPC and info.value.filename == FULL


@needs_dev_full
def test_inspect_full_disk_heatmap_names_the_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from replaymoe.apps import cli

    path = tmp_path / "t.rmtrace"
    _trace().save(path)
    rc = cli.main(["inspect", str(path), "--heatmap", FULL])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line == f"replaymoe inspect: error: cannot write {FULL}: No space left on device"


@needs_dev_full
def test_trace_save_full_disk_names_the_target(tmp_path, monkeypatch):
    # the payload writer is swapped for one whose first write hits a real full disk (ENOSPC from the
    # kernel): write_trace's own error handling is what is under test
    real = trace_file._write_payload

    def onto_full_disk(f, ids, meta, compress):
        with open(FULL, "wb") as full:
            real(full, ids, meta, compress)

    monkeypatch.setattr(trace_file, "_write_payload", onto_full_disk)
    target = tmp_path / "t.rmtrace"
    with pytest.raises(OSError) as info:
        _trace().save(target)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert os_error_text(info.value) == f"cannot write {target}: No space left on device"
    assert os.listdir(tmp_path) == []  # no target, no temporary file


# --------------------------------------------------------------------------------------------------
# RoutingTrace.save into a folder that is not there
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, error, says",
    [
        ("nope/t.rmtrace", FileNotFoundError, "the folder {d} does not exist"),  # one level missing
        ("a/b/t.rmtrace", FileNotFoundError, "the folder {d} does not exist"),  # nested, none created
        ("file/t.rmtrace", NotADirectoryError, "Not a directory"),  # the "folder" is a file
    ],
)
def test_trace_save_into_missing_folder_names_the_target(tmp_path, where, error, says):
    (tmp_path / "file").write_text("x")
    target = tmp_path / where
    with pytest.raises(error) as info:
        _trace().save(target)
    msg = str(info.value)
    assert info.value.filename == str(target) and str(target) in msg
    assert says.format(d=target.parent) in msg
    assert ".tmp" not in msg  # the temporary file never existed: not named
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing created, nothing left behind


# --------------------------------------------------------------------------------------------------
# bad ids inside a .rmtrace: named as such, with the file
# --------------------------------------------------------------------------------------------------


def _bad_ids(kind):
    ids = _trace().ids.astype(np.int16)
    if kind == "out of range":
        ids[3, 1, 0] = 8  # E = 8: ids in [0, 7]
    elif kind == "duplicate":
        ids[2, 2] = [4, 4]
    elif kind == "half missing":
        ids[1, 0] = [-1, 5]  # a row is all -1 or all valid
    return ids


@pytest.mark.parametrize(
    "kind, says",
    [
        ("out of range", "expected expert ids in [0, 7] or -1 (missing), got 8 at [token, layer, k] = [3, 1"),
        ("duplicate", "expected distinct expert ids in a row, got row [4, 4] at token 2, layer 2"),
        ("half missing", "all -1 (missing) or all valid ids, got row [-1, 5] at token 1, layer 0"),
    ],
)
def test_bad_ids_in_a_file_are_named_with_the_file(tmp_path, kind, says):
    path = tmp_path / "bad.rmtrace"
    # the real writer: its checksum covers the bad ids, so the checksum check passes and the
    # constructor's check is what catches them
    trace_file.write_trace(path, _bad_ids(kind), _META, compress=True)
    with pytest.raises(TraceFormatError) as info:
        RoutingTrace.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: Invalid value of ids: ") and says in msg
    assert "invalid metadata" not in msg and info.value.path == str(path)


@pytest.mark.parametrize(
    "meta, says",
    [
        ({**_META, "top_k": 0}, "Invalid value of top_k"),  # the metadata itself is wrong
        ({k: v for k, v in _META.items() if k != "model_id"}, "KeyError: 'model_id'"),  # a key missing
        ({**_META, "layer_ids": [1, 1, 5]}, "layer_ids"),  # not distinct
        ({**_META, "token_ids": [1, 2]}, "token_ids"),  # 2 token ids for 5 positions
    ],
)
def test_malformed_metadata_still_says_invalid_metadata(tmp_path, meta, says):
    path = tmp_path / "meta.rmtrace"
    trace_file.write_trace(path, _trace().ids, meta, compress=False)
    with pytest.raises(TraceFormatError, match=re.escape(f"{path}: invalid metadata (")) as info:
        RoutingTrace.load(path)
    assert says in str(info.value)


# --------------------------------------------------------------------------------------------------
# the demo: tokens without routing per layer; the agreement panel's layer labels
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fallback, layer_ids, says",
    [
        ([1, 1, 1], [0, 1, 2], "1 token(s) in each MoE layer without routing"),  # the last token only
        ([3, 1, 1], [1, 2, 3], "tokens per MoE layer without routing in the response L1:3  L2:1  L3:1"),
        ([0, 2, 0], [0, 1, 2], "L0:0  L1:2  L2:0"),  # was "2 token(s) per layer": a maximum
    ],
)
def test_demo_unrouted_tokens_are_per_layer(fallback, layer_ids, says):
    pytest.importorskip("transformers")
    from replaymoe.apps.demo_run import _unrouted

    assert says in _unrouted(np.asarray(fallback), layer_ids)


def _panel_texts(svg: str, title: str) -> list[str]:
    """The text of the axes (matplotlib's ``<g id="axes_N">``) whose title is ``title``."""
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    for g in ET.fromstring(svg).iter(f"{ns}g"):
        if re.fullmatch(r"axes_\d+", g.get("id", "")):
            texts = ["".join(t.itertext()) for t in g.iter(f"{ns}text")]
            if title in texts:
                return texts
    raise AssertionError(f"no axes titled {title!r}")


@pytest.mark.parametrize(
    "layer_ids, labels, axis",
    [
        ([1, 3, 5], ["L1", "L3", "L5"], "model layer"),  # layer numbers, not MoE indices (dense layers)
        (None, ["0", "1", "2"], "MoE layer"),  # unknown: the MoE index, said as such
    ],
)
def test_agreement_panel_names_the_layers(tmp_path, layer_ids, labels, axis):
    mpl = pytest.importorskip("matplotlib")
    from replaymoe.record.stats import plot_heatmap

    tr = _trace().replace(layer_ids=layer_ids)
    path = tmp_path / "h.svg"
    with mpl.rc_context({"svg.fonttype": "none"}):  # text as <text> elements, not glyph paths
        plot_heatmap(
            tr, path, agreement={"native": [0.5, 0.9, 1.0], "replay": [1.0] * 3}, agreement_title="A"
        )
    texts = _panel_texts(path.read_text(), "A")
    assert all(label in texts for label in labels) and axis in texts, texts

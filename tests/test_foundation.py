"""The boundary-check helper, the testing helpers and the CLI dispatcher."""

from __future__ import annotations

import pytest
import torch

import replaymoe
import replaymoe.apps.cli as cli_mod
from replaymoe._validation import check_choice, check_int, check_tensor  # private module: under test here
from replaymoe.apps.cli import main
from replaymoe.testing import assert_close, poison, tie_free_logits


@pytest.mark.parametrize(
    "kwargs, x, match",
    [
        ({}, [1, 2], r"Invalid type of arg: expected a torch.Tensor, got list"),
        ({"ndim": 2}, torch.zeros(3), r"Invalid shape of arg: expected a 2-D tensor, got 1-D"),
        (
            {"shape": (None, 4)},
            torch.zeros(3, 5),
            r"Invalid shape of arg: expected \('\*', 4\), got \(3, 5\)",
        ),
        ({"dtype": torch.int32}, torch.zeros(3), r"Invalid dtype of arg: expected int32, got float32"),
        (
            {"dtype": (torch.float16, torch.bfloat16)},
            torch.zeros(3),
            r"expected one of \(float16, bfloat16\), got float32",
        ),
        ({"device": "meta"}, torch.zeros(3), r"Invalid device of arg: expected a tensor on meta"),
        ({"contiguous": True}, torch.zeros(3, 4).t(), r"Invalid layout of arg: expected a contiguous tensor"),
    ],
)
def test_check_tensor_rejects(kwargs, x, match):
    with pytest.raises(ValueError, match=match):
        check_tensor("arg", x, **kwargs)


def test_check_tensor_accepts_and_returns():
    x = torch.zeros(2, 4, dtype=torch.int16)
    assert check_tensor("x", x, shape=(None, 4), dtype=torch.int16, device="cpu", contiguous=True) is x


@pytest.mark.parametrize(
    "value, match", [(True, "type"), (1.5, "type"), (0, r"\[1, 8\], got 0"), (9, "got 9")]
)
def test_check_int_rejects(value, match):
    with pytest.raises(ValueError, match=match):
        check_int("top_k", value, low=1, high=8)


def test_check_choice():
    assert check_choice("backend", "torch", ("auto", "torch")) == "torch"
    with pytest.raises(
        ValueError, match="Invalid value of backend: expected one of 'auto', 'torch', got 'cuda'"
    ):
        check_choice("backend", "cuda", ("auto", "torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_experts", [8, 256, 512])  # 512: finer grid, still exact in bf16
def test_tie_free_logits_distinct_in_dtype(dtype, num_experts, generator):
    x = tie_free_logits(5, num_experts, dtype=dtype, generator=generator)
    assert x.dtype == dtype
    for row in x.float():
        assert row.unique().numel() == num_experts


def test_assert_close_reports_and_rejects_nan():
    a = torch.ones(4)
    assert_close(a, a.clone())
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close(a + 1, a)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(poison(torch.empty(4)), a)


def test_poison_integers():
    assert (poison(torch.empty(3, dtype=torch.int32)) == -12345).all()


def test_cli_help_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "bench" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert replaymoe.__version__ in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "nonsense"],  # unknown benchmark
        ["bench"],  # no benchmark named
        ["bench", "--out"],  # --out without its value
        ["bench", "--tokens", "1"],  # an option before the benchmark's name
    ],
)
def test_cli_bench_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: replaymoe bench" in capsys.readouterr().err


BENCHES = sorted(cli_mod._BENCHES)  # private: the CLI's table of benchmarks, one case per entry


@pytest.mark.parametrize("name", BENCHES)
@pytest.mark.parametrize("out_first", [False, True])  # `bench --out D NAME` and `bench NAME --out D`
def test_cli_bench_without_gpu_same_code_and_wording(name, out_first, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    out = ["--out", str(tmp_path)]
    rc = main(["bench", *out, name] if out_first else ["bench", name, *out])
    assert rc == cli_mod.EXIT_USAGE == 2
    cap = capsys.readouterr()
    assert cap.err == (
        f"replaymoe bench {name}: error: needs a CUDA GPU, and torch sees none "
        "(torch.cuda.is_available() is False)\n"
    )
    assert cap.out == "" and not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_cli_bench_help_lists_out_and_the_benchmarks(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--out DIR" in text and all(name in text for name in BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_cli_bench_sub_help_is_plain_text(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # help needs no GPU
    assert main(["bench", name, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"usage: replaymoe bench {name}" in text and "--out" in text
    for markup in ("``", ":func:", ":class:", ":meth:", "::"):
        assert markup not in text, (name, markup)


@pytest.mark.parametrize(
    "rest, plain",
    [
        ("``replaymoe bench moe``: x", "replaymoe bench moe: x"),  # inline literal
        (
            ":func:`replaymoe.hf.enable` and :class:`~replaymoe.MoeAlltoAll`",
            "replaymoe.hf.enable and MoeAlltoAll",
        ),
        ("``generate``\\ s", "generates"),  # escaped space after a literal
        ("Run it::\n\n    cmd", "Run it:\n\n    cmd"),  # literal-block marker
        ("a `link`_ and `x`", "a link and x"),  # default role and a reference
        ("no markup: a*b, [1, 2]", "no markup: a*b, [1, 2]"),  # left alone
    ],
)
def test_strip_rest(rest, plain):
    assert cli_mod.strip_rest(rest) == plain


def test_lazy_exports_unknown_name():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        replaymoe.nope  # noqa: B018


def test_every_public_name_resolves_to_its_module():
    # replaymoe and replaymoe.record: each lazy name is the object of the real module it points to
    import importlib

    import replaymoe.record

    for package in (replaymoe, replaymoe.record):
        assert set(package.__all__) - {"__version__"} == set(package._EXPORTS)
        for name, module in package._EXPORTS.items():
            owner = importlib.import_module(f"{package.__name__}.{module}")
            assert getattr(package, name) is getattr(owner, name), (package.__name__, name)


@pytest.mark.parametrize("files", [(), ("vllm_moe_peer.py",)])  # empty folder; the kernel file missing
def test_cli_bench_moe_peer_dir_rejected_before_anything_runs(files, tmp_path, capsys):
    for f in files:
        (tmp_path / f).write_text("")
    from replaymoe.bench import moe as bench_moe

    with pytest.raises(SystemExit) as exc:  # the module checks the folder before it asks for a GPU
        bench_moe.main(["--peer-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--peer-dir: expected a folder holding" in err and "vllm_fused_moe_kernels.py" in err
    assert str(tmp_path) in err and not (tmp_path / "out").exists()

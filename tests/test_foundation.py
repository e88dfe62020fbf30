"""The boundary-check helper, the testing helpers and the CLI dispatcher."""

from __future__ import annotations

import pytest
import torch

import replaymoe
from replaymoe._validation import check_choice, check_int, check_tensor
from replaymoe.cli import main
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


def test_cli_rejects_unknown_bench():
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_lazy_exports_unknown_name():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        replaymoe.nope  # noqa: B018

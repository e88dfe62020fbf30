"""Helpers for tests and benchmarks: tie-free inputs, tolerances, comparisons.

Public because users writing their own kernels against replaymoe's references need
the same tools.
"""

from __future__ import annotations

import torch

__all__ = [
    "TOLERANCES",
    "tolerance",
    "assert_close",
    "assert_same_sums",
    "tie_free_logits",
    "poison",
    "POISON_INT",
]

# dtype -> (atol, rtol) for results computed in that dtype against an fp32 reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

POISON_INT = -12345


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for ``dtype`` from :data:`TOLERANCES`."""
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    name: str = "output",
) -> None:
    """Compare floats by the dtype's tolerance, reporting the worst element; NaN never passes."""
    dt = dtype or actual.dtype
    a_tol, r_tol = TOLERANCES.get(dt, (1e-5, 1e-5))
    atol = a_tol if atol is None else atol
    rtol = r_tol if rtol is None else rtol
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if torch.isnan(a).any() and not torch.isnan(e).any():
        bad = torch.nonzero(torch.isnan(a))[0].tolist()
        raise AssertionError(f"{name}: NaN at {bad}")
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    over = err > bound
    if over.any():
        idx = torch.nonzero(over)[0].tolist()
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name}: {int(over.sum())} of {a.numel()} elements out of tolerance (atol={atol}, rtol={rtol}); "
            f"first at {idx}: got {a[tuple(idx)].item()}, expected {e[tuple(idx)].item()}; "
            f"max abs err {err.flatten()[worst].item():.3g}"
        )


def assert_same_sums(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "output") -> None:
    """Compare two results of the same sums taken in possibly different orders.

    Under ``TRITON_INTERPRET=1``, ``tl.dot`` is a numpy matmul whose summation order depends on the
    CPU's OpenBLAS kernel and on the operands' memory layout, so two kernel paths that are bitwise
    equal on the GPU (e.g. TMA against pointer loads) may differ in the last bits on some CPUs. This
    check allows that and nothing more: a few units in the last place of the result's dtype, relative
    to the tensor's largest magnitude (fp32: 1e-5; fp16: 4 ulps; bf16: 4 ulps). Bitwise claims about
    the real kernels belong in the GPU tests.

    Parameters
    ----------
    actual, expected : torch.Tensor
        Same shape; any float dtype (compared in fp32 on the CPU).
    name : str
        Named in the assertion message.
    """
    eps = {torch.float16: 4 * 2.0**-10, torch.bfloat16: 4 * 2.0**-7}.get(expected.dtype, 1e-5)
    scale = float(expected.detach().float().abs().max()) if expected.numel() else 0.0
    assert_close(actual, expected, atol=eps * max(scale, 1e-30), rtol=eps, name=name)


def tie_free_logits(
    num_tokens: int,
    num_experts: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Logits [T, E] whose values in each row are distinct and exactly representable in ``dtype``.

    Each row is a random permutation of an evenly spaced grid, so no two experts tie
    and ranking is unambiguous in every dtype (bf16 has 8 mantissa bits: the grid has
    step ``scale / 64`` around 0 and |values| < 4·scale, which bf16 represents exactly
    for E ≤ 512).
    """
    g = generator
    rows = torch.argsort(torch.rand(num_tokens, num_experts, generator=g), dim=1)
    step = 1.0 / 64 if num_experts <= 256 else 1.0 / 128
    values = (rows.to(torch.float32) - num_experts / 2) * step * scale
    return values.to(dtype).to(device)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel should produce (NaN for floats) and return it."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(POISON_INT if t.dtype not in (torch.uint8, torch.int8) else 0x7F)
    return t

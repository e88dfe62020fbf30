"""One backend resolver for every op: ``"auto"`` | ``"triton"`` | ``"torch"`` -> what runs.

``auto`` runs the Triton kernels on CUDA tensors and the torch reference elsewhere. ``triton`` with
CPU tensors runs the kernels in Triton's interpreter, which Triton reads from ``TRITON_INTERPRET`` when
it is imported: the variable is read once too, at import (:data:`replaymoe._switches.INTERPRET`), so
that the answer never disagrees with what Triton will do.
"""

from __future__ import annotations

import torch

from replaymoe._switches import INTERPRET
from replaymoe._validation import check_choice, fail

__all__ = ["BACKENDS", "INTERPRET", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: object, x: torch.Tensor, *, name: str = "backend") -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` on tensors like ``x``.

    Raises
    ------
    ValueError
        ``backend`` not one of :data:`BACKENDS`, or ``"triton"`` with CPU tensors in a process not
        started with ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        check_choice(name, backend, BACKENDS)
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend == "triton" and not x.is_cuda and not INTERPRET:
        fail(
            name,
            "'triton' with CUDA tensors, or with CPU tensors in a process started with "
            "TRITON_INTERPRET=1 (Triton's interpreter; use 'torch' or 'auto' on CPU)",
            "'triton' with CPU tensors and TRITON_INTERPRET unset",
        )
    return str(backend)

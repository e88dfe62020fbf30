"""Launch a Triton kernel whose specialization is fixed, skipping Triton's per-call dispatch.

``kernel[grid](*args)`` spends several microseconds of host time per launch binding arguments,
computing the specialization key and looking the compiled kernel up. The all-to-all launches the
same few kernels with the same specialization on every steady-state call (the plan cached by the
call's signature fixes every integer, constexpr and pointer alignment; only the addresses change),
so a :class:`Launcher` made for one such plan launches through Triton once, keeps the compiled
kernel, and afterwards calls its launcher directly.

The caller must pass every parameter of the kernel positionally, constexprs included, in the
kernel's order, and must make a new :class:`Launcher` whenever anything but a tensor's address
may change (a tensor's alignment modulo 16 included: Triton specializes on it). The direct path is
used only on CUDA, on the device the kernel was compiled for, and when no Triton launch hook
(profiler) is installed; ``REPLAYMOE_EP_FAST_LAUNCH=0`` turns it off.
"""

from __future__ import annotations

import os

import torch

from replaymoe._launch import hooks_off as _hooks_off

ENABLED = os.environ.get("REPLAYMOE_EP_FAST_LAUNCH", "1") != "0"


class Launcher:
    """One kernel with one fixed specialization; ``launcher(grid, args)``."""

    __slots__ = ("fn", "num_warps", "compiled", "device")

    def __init__(self, fn, num_warps: int = 4) -> None:
        self.fn = fn
        self.num_warps = num_warps
        self.compiled = None
        self.device = -1

    def ready(self) -> bool:
        """Whether :meth:`fast` may be used now (compiled here, on the current device, no hooks)."""
        return self.compiled is not None and _hooks_off() and torch._C._cuda_getDevice() == self.device

    def fast(self, grid: tuple[int, ...], args: tuple) -> None:
        """Launch the compiled kernel directly (only after :meth:`ready`). Pointer arguments may be
        given as integer addresses: Triton's launcher then skips its per-pointer driver query."""
        ck = self.compiled
        g1 = grid[1] if len(grid) > 1 else 1
        ck.run(grid[0], g1, 1, torch._C._cuda_getCurrentRawStream(self.device), ck.function,
               ck.packed_metadata, None, None, None, *args)  # fmt: skip

    def __call__(self, grid: tuple[int, ...], args: tuple) -> None:
        if self.compiled is not None and self.ready():
            self.fast(grid, args)
            return
        ck = self.fn[grid](*args, num_warps=self.num_warps)
        if ENABLED and ck is not None and self.compiled is None and torch.cuda.is_available():
            if hasattr(ck, "result"):  # an asynchronous compile's future
                ck = ck.result()
            if getattr(ck, "function", None) is not None and hasattr(ck, "packed_metadata"):
                self.compiled = ck
                self.device = torch.cuda.current_device()

    def registers(self) -> tuple[int, int] | None:
        """(registers per thread, spills) of the compiled kernel, once launched on a GPU."""
        ck = self.compiled
        if ck is None:
            return None
        return getattr(ck, "n_regs", -1), getattr(ck, "n_spills", -1)


def addresses(args: tuple) -> tuple:
    """``args`` with every tensor replaced by its address (for :meth:`Launcher.fast`)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

"""Device-to-host transfer of captured rows for :class:`replaymoe.record.capture.RoutedExpertsCapturer`.

The only device-specific part of the capturer. Data path per step on CUDA (:class:`CudaTransfer`):

1. On the stream that ran the step, one small device copy gathers rows ``[start, start+T)``
   of the [L, N, K] buffer into a contiguous token-major [T, L, K] staging buffer (the only
   work added to the step's stream: a few µs, no host synchronisation). After it the step's
   buffer may be overwritten by the next step.
2. A side stream waits for that copy (an event) and copies the staging buffer into pinned
   host memory with ``non_blocking=True``; an event marks completion.
3. The host scatter into per-request storage happens lazily, at a later ``end_step`` (for
   every copy whose event has completed) or at ``finish``. Staging is ``num_buffers``-fold
   (default 2, double-buffered): ``end_step`` blocks only when the copy issued
   ``num_buffers`` steps earlier has still not completed (back-pressure: the host is then
   more than ``num_buffers`` steps ahead of the GPU, which a loop that reads the sampled
   tokens every step never is).

On the CPU (:class:`SyncTransfer`) there are no streams or pinned memory: steps 1-2 are a plain
copy at ``end_step``; step 3 is still deferred, so CI exercises the same bookkeeping.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["CudaTransfer", "SyncTransfer"]


class SyncTransfer:
    """CPU: copy at once into plain host staging buffers; every handle is complete."""

    def __init__(self, buffer: torch.Tensor, num_buffers: int):
        L, N, K = buffer.shape
        self.buffer = buffer
        self.staging = [np.empty(N * L * K, dtype=np.int16) for _ in range(num_buffers)]

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.staging)

    def start(self, slot: int, start: int, T: int) -> Any:
        L, _, K = self.buffer.shape
        src = self.buffer[:, start : start + T].numpy()  # [L, T, K] view, no copy
        np.copyto(self.staging[slot][: T * L * K].reshape(T, L, K), src.transpose(1, 0, 2))
        return None

    def ready(self, handle: Any) -> bool:
        return True

    def wait(self, handle: Any) -> None:
        pass

    def view(self, slot: int, T: int) -> np.ndarray:
        L, _, K = self.buffer.shape
        return self.staging[slot][: T * L * K].reshape(T, L, K)


class CudaTransfer:
    """CUDA: gather on the step's stream, device-to-pinned copy on a side stream, events."""

    def __init__(self, buffer: torch.Tensor, num_buffers: int):
        L, N, K = buffer.shape
        self.buffer = buffer
        self.device = buffer.device
        self.dev_stage = [
            torch.empty(N * L * K, dtype=torch.int16, device=self.device) for _ in range(num_buffers)
        ]
        self.pinned = [torch.empty(N * L * K, dtype=torch.int16, pin_memory=True) for _ in range(num_buffers)]
        self.np_pinned = [p.numpy() for p in self.pinned]
        self.stream = torch.cuda.Stream(self.device)
        self.gathered = [torch.cuda.Event() for _ in range(num_buffers)]
        self.copied = [torch.cuda.Event() for _ in range(num_buffers)]

    def nbytes(self) -> int:
        return sum(p.numel() * 2 for p in self.pinned)

    def start(self, slot: int, start: int, T: int) -> Any:
        L, _, K = self.buffer.shape
        n = T * L * K
        main = torch.cuda.current_stream(self.device)
        # (1) on the step's stream: rows [start, start+T) of [L, N, K] -> token-major [T, L, K]
        self.dev_stage[slot][:n].view(T, L, K).copy_(self.buffer[:, start : start + T].transpose(0, 1))
        self.gathered[slot].record(main)
        # (2) side stream: device staging -> pinned host, asynchronous
        self.stream.wait_event(self.gathered[slot])
        with torch.cuda.stream(self.stream):
            self.pinned[slot][:n].copy_(self.dev_stage[slot][:n], non_blocking=True)
        self.copied[slot].record(self.stream)
        # the staging slot is produced on `main` and consumed on the side stream
        return self.copied[slot]

    def ready(self, handle: Any) -> bool:
        return handle.query()

    def wait(self, handle: Any) -> None:
        handle.synchronize()

    def view(self, slot: int, T: int) -> np.ndarray:
        L, _, K = self.buffer.shape
        return self.np_pinned[slot][: T * L * K].reshape(T, L, K)

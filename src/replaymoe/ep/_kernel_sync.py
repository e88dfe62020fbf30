"""Triton helpers every kernel of the all-to-all shares: the rank's base pointer and the symm transport's
in-kernel barrier (signal, wait, spin) and flag polls. Only ``@triton.jit`` code lives here.

Every kernel takes up to eight destination (or source) base pointers ``p0 .. p7`` and a
compile-time ``EP``; the loop over ranks is unrolled with ``tl.static_range`` and the pointer
for rank ``r`` is chosen at compile time (:func:`pick`), so that each base keeps the 16-byte alignment
that Triton infers for tensor arguments and the row copies compile to 128-bit loads and stores.
With the ``symm`` transport the pointers are peers' symmetric-memory buffers (the stores cross
NVLink); with the ``nccl`` transport they are all the same local send buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pick(r: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """Base pointer of rank ``r`` (compile-time choice among the eight arguments)."""
    p = p0
    if r == 1:
        p = p1
    if r == 2:
        p = p2
    if r == 3:
        p = p3
    if r == 4:
        p = p4
    if r == 5:
        p = p5
    if r == 6:
        p = p6
    if r == 7:
        p = p7
    return p


# ----------------------------------------------------------------------------------------------
# In-kernel barrier of the symm transport (no extra launch): the producing kernel's last program
# to finish publishes a new epoch into every peer's signal pad (release, system scope, after a
# CTA barrier and an acq_rel arrival so that every program's stores are covered); every program
# of the consuming kernel first waits until each peer's flag in its own pad reaches its epoch
# (acquire, system scope). Epochs count up in device memory, so CUDA-graph replays stay in step.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _globaltimer(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trap(x):
    return tl.inline_asm_elementwise(
        "trap; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def signal_done(arrive_ptr, epoch_ptr, q0, q1, q2, q3, q4, q5, q6, q7, pad_off,
                EP: tl.constexpr, RANK: tl.constexpr):  # fmt: skip
    """Called by every program after its stores; the last to arrive bumps this rank's epoch (a
    release store: a program that sees it sees every program's stores) and stores it into slot
    ``pad_off`` of every peer's signal pad. Returns this program's arrival index (the last:
    ``num_programs - 1``)."""
    total = tl.num_programs(0) * tl.num_programs(1)
    tl.debug_barrier()
    old = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="sys")
    if old == total - 1:
        tl.store(arrive_ptr, 0)
        e = tl.load(epoch_ptr) + 1
        tl.atomic_xchg(epoch_ptr, e, sem="release", scope="gpu")
        for r in tl.static_range(EP):
            if r != RANK:
                base = pick(r, q0, q1, q2, q3, q4, q5, q6, q7)
                tl.atomic_xchg(base + pad_off, e, sem="release", scope="sys")
    return old


@triton.jit
def wait_peers(e, pad_ptr, pad_base, timeout_ns, EP: tl.constexpr, RANK: tl.constexpr,
               TIMER: tl.constexpr):  # fmt: skip
    """Wait until every peer's flag ``pad_ptr[pad_base + r]`` reaches ``e``, this rank's epoch of the
    phase (the caller reads it: a kernel after the producing one loads it; a program of the producing
    launch knows it, as its L1 may hold the value from before the bump). With ``TIMER``, print and trap
    after ``timeout_ns``."""
    for r in tl.static_range(EP):
        if r != RANK:
            v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")
            if TIMER:
                t0 = _globaltimer(v)
                while v < e:
                    v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")
                    if _globaltimer(v) - t0 > timeout_ns:
                        tl.device_print("replaymoe MoeAlltoAll(symm): barrier timeout, rank/peer", RANK, r)
                        v = _trap(v) + e
            else:
                while v < e:
                    v = tl.atomic_add(pad_ptr + pad_base + r, 0, sem="acquire", scope="sys")


@triton.jit
def _ld_acquire(ptr):
    """``*ptr`` as an acquire load at system scope (no read-modify-write)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _ld_acquire_gpu(ptr):
    """``*ptr`` as an acquire load at GPU scope (no read-modify-write)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _nanosleep(ptr):
    """``ptr``, after this thread sleeps about 100 ns (a poll's back-off)."""
    return tl.inline_asm_elementwise(
        "nanosleep.u32 100; mov.b64 $0, $1;", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
    ).to(tl.pointer_type(tl.int32))


@triton.jit
def spin_gpu(ptr, target, ASM: tl.constexpr):
    """Spin until ``*ptr >= target`` (acquire, GPU scope: other programs of the same launch store it with
    release). ``ASM`` (CUDA): acquire loads with a 100 ns back-off; else acquire atomics."""
    if ASM:
        v = _ld_acquire_gpu(ptr)
        while v < target:
            v = _ld_acquire_gpu(_nanosleep(ptr))
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while v < target:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def wait_flag(ptr, e, timeout_ns, RANK: tl.constexpr, PEER: tl.constexpr, TIMER: tl.constexpr):
    """Spin until ``*ptr >= e`` (acquire, system scope); with ``TIMER`` (CUDA) print and trap after the
    timeout. On CUDA the polls are acquire loads, in the interpreter acquire atomics."""
    if TIMER:
        v = _ld_acquire(ptr)
        t0 = _globaltimer(v)
        while v < e:
            v = _ld_acquire(ptr)
            if _globaltimer(v) - t0 > timeout_ns:
                tl.device_print("replaymoe MoeAlltoAll(symm): combine flag timeout, rank/peer", RANK, PEER)
                v = _trap(v) + e
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        while v < e:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")

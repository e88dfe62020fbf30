"""The host profile of ``replaymoe bench ep --host-profile``: where the host time of a steady-state
eager dispatch + combine call goes (rank 0 prints): per-call host µs with and without the direct
launches (mean over calls; without: Triton's own launch path, which :mod:`replaymoe._launch` takes
while a launch hook is installed, here a no-op one, :func:`triton_launch_path`), the pieces alone (event
record, symm barrier, a bare plan launch, ``torch.empty``: median per call,
:func:`replaymoe.bench._timing.host_us`), and a cProfile of many calls. It reaches into the
all-to-all's internals on purpose (its plan cache, transport barrier, direct launches): they are what is
profiled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ._timing import host_us
from .ep_shape import Shape, a2a_kwargs, inputs
from .ep_timing import HostEvent, device, on_cuda, sync


def host_profile(
    tokens, transports, *, shape: Shape, calls: int, log, num_sms=(0,), a2a_options: dict | None = None
) -> None:
    """Where the host time of a steady-state eager call goes (rank 0 prints): per call host µs with
    and without the direct launches, the pieces alone (event record, barrier, a bare launch), and a
    cProfile of ``calls`` dispatch+combine calls. ``symm`` / ``symm_2k`` / ``symm_pipe`` (the combine
    forced) run at every ``num_sms`` (0 = unset), so the pipelined combine's host time shows at a cap.
    ``shape``: the layer's :class:`~replaymoe.bench.ep_shape.Shape`.
    ``a2a_options``: more :class:`MoeAlltoAll` keywords (``fused_plan`` / ``fused_barrier``)."""
    from ..ep import MoeAlltoAll

    for t in transports:
        if t == "naive":
            continue
        kw = {**a2a_kwargs(t), **(a2a_options or {})}  # symm_2k / symm_pipe: the combine forced one way
        a2a = MoeAlltoAll(None, max(tokens), shape.K, shape.E, shape.H, **kw)
        for n in num_sms if t.startswith("symm") else (0,):
            a2a.num_sms = n or None
            for T in tokens:
                _host_profile_one(a2a, shape, f"{t} num_sms={n}" if n else t, T, calls)


@contextmanager
def triton_launch_path() -> Iterator[None]:
    """Inside: every kernel through Triton's own launch path (``kernel[grid](...)``), as with
    ``REPLAYMOE_FAST_LAUNCH=0``, by a no-op Triton launch hook (``FastLaunch`` and ``Launcher`` step aside
    while a hook is installed, :func:`replaymoe._launch.hooks_off`; the hook's call adds one Python call
    per launch to that path). Nothing of the package's own is changed."""
    from triton import knobs

    rt = knobs.runtime

    def noop(*args, **kwargs) -> None:
        return None

    chain = rt.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.6: a hook chain
        chain.add(noop)
        try:
            yield
        finally:
            chain.remove(noop)
    else:  # one hook
        rt.launch_enter_hook = noop
        try:
            yield
        finally:
            rt.launch_enter_hook = chain


def _host_profile_one(a2a, shape: Shape, t: str, T: int, calls: int) -> None:
    import cProfile
    import io
    import pstats

    ep, rank = dist.get_world_size(), dist.get_rank()
    dev = device()

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    ids, x, wts, *_ = inputs(shape, T, rank, dev)
    comb = torch.randn(ep, T + 1, shape.H, device=dev, dtype=torch.bfloat16)[:, :T]
    pays = [x, ids, wts]

    def one():
        a2a.dispatch(ids, pays, T, expert_id_payload_index=1)
        return a2a.combine(comb, T)

    def timed(n):  # two phases per call and a sync after each: not host_us's one span
        hd = hc = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            a2a.dispatch(ids, pays, T, expert_id_payload_index=1)
            t1 = time.perf_counter()
            a2a.combine(comb, T)
            hc += time.perf_counter() - t1
            hd += t1 - t0
            sync()
        return hd / n * 1e6, hc / n * 1e6

    def fresh(n=3):
        a2a.core.dispatch_plans.clear()
        a2a.core.transport.drop_combine_plans()
        for _ in range(n):
            one()
        sync()
        dist.barrier()

    fresh(5)
    fast = timed(calls)
    st = next(iter(a2a.core.dispatch_plans.values()))
    compiled = regs = grid = None
    if st.triton:  # the plan launch and the pack variant that runs (dense, narrow or wide grid)
        grid = a2a.core.pack_grid(st.T)
        packs = [v[grid].launch for v in st.packs]
        compiled = [st.plan_launch.compiled is not None] + [p.compiled is not None for p in packs]
        regs = [st.plan_launch.registers()] + [p.registers() for p in packs]
    with triton_launch_path():
        fresh()
        slow = timed(calls)
    fresh()
    say(f"[host] {t} T={T}: dispatch/combine host µs per call: direct launches {fast[0]:.1f}/{fast[1]:.1f}, "
        f"Triton's launch path {slow[0]:.1f}/{slow[1]:.1f}; direct launch active {compiled}; "
        f"regs {regs}; pack grid {grid}")  # fmt: skip
    ev = torch.cuda.Event(enable_timing=True) if on_cuda() else HostEvent()
    t_ev = host_us(ev.record, calls=calls)
    t_bar = float("nan")
    if a2a.transport == "symm":
        dist.barrier()
        t_bar = host_us(a2a.core.transport.barrier, calls=calls)  # every rank makes the same calls
        sync()
    st = next(iter(a2a.core.dispatch_plans.values()))
    t_plan = float("nan")
    if st.triton:
        t_plan = host_us(lambda: st.plan_launch((1,), (ids, *st.plan_args)), calls=calls)
    sync()
    t_empty = host_us(lambda: torch.empty(T, shape.H, dtype=torch.bfloat16, device=dev), calls=calls)
    say(f"[host] {t} T={T}: event record {t_ev:.1f} µs, symm barrier {t_bar:.1f} µs, plan launch "
        f"{t_plan:.1f} µs, torch.empty {t_empty:.1f} µs")  # fmt: skip
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    for _ in range(calls):
        one()
    if rank == 0:
        prof.disable()
    sync()
    dist.barrier()
    if rank != 0:
        return
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    say(f"[host] {t} T={T}: cProfile of {calls} dispatch+combine calls (rank 0)\n{buf.getvalue()[-4000:]}")

"""Run a function in ``world_size`` spawned processes joined by a torch.distributed group.

Spawning is slow (each child imports torch), so a test should run many cases inside one spawn.
``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by reference).
An exception in any child fails the call with that child's traceback; the others are terminated.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, backend, timeout_s, env, fn, args):
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        # what still refers to the group (FSDP states, DTensors, work handles in reference cycles) goes
        # first: destroying the group under them aborted children at exit ("terminate called without an
        # active exception") on loaded CPUs
        gc.collect()
        dist.destroy_process_group()


def run_distributed(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 300.0,  # generous: a loaded 2-core CI machine runs 2-8 ranks of interpreted kernels
    env: dict[str, str] | None = None,
) -> None:
    """Spawn ``world_size`` processes, init ``backend`` (gloo on CPU, nccl one GPU per rank), run
    ``fn(rank, world_size, *args)`` in each, and re-raise the first failure."""
    port = free_port()
    mp.spawn(
        _child,
        args=(world_size, port, backend, timeout_s, dict(env or {}), fn, args),
        nprocs=world_size,
        join=True,
    )

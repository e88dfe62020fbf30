"""The process defaults of replaymoe's switches: the one module that reads settings from the environment.

Every switch is chosen per call (or per object) by an argument: a :class:`~replaymoe.moe.MoEConfig` /
:class:`~replaymoe.moe.MoEBwdConfig` field or a :class:`~replaymoe.MoeAlltoAll` keyword. Where the
argument is left to its default, the process default in :data:`DEFAULTS` applies. :data:`DEFAULTS` is
read from the environment once, when this module is first imported (:meth:`Switches.from_env`), and is
never changed by the package afterwards (a frozen dataclass; tests may swap it for a
``dataclasses.replace`` copy with ``monkeypatch``). The kernels' results are the same bits for every
value of every switch (``fast_launch`` and ``ep_fused`` change launches, the others data movement).

Variables are ``REPLAYMOE_`` and the field's name in capitals, set to ``0`` or ``1`` (anything else is a
ValueError naming the variable). A variable removed or merged into another (:data:`REMOVED`) is a
ValueError naming its replacement, so that a setting is never lost silently; any other ``REPLAYMOE_*``
variable (a typo) is reported by a warning. ``REPLAYMOE_PEERS`` (:data:`NOT_SWITCHES`) is not read by
replaymoe.

:data:`INTERPRET` is Triton's own ``TRITON_INTERPRET`` (``1``: Triton runs its CPU interpreter), read here
at import too, so that replaymoe's answer never disagrees with what Triton will do.

:func:`multicast_off` is the library's only write to the environment: the ``symm`` all-to-all transport
calls it when it is created (before any symmetric-memory or NVSHMEM initialization), ``replaymoe bench
ep`` before it creates its process group. Nothing is written at import. (Besides: ``replaymoe bench moe``
sets ``REPLAYMOE_PEERS`` for the external peer driver it loads; the benchmarks read torchrun's rank
variables; the demo passes ``TRITON_INTERPRET=1`` to the child process it starts.)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["DEFAULTS", "INTERPRET", "NOT_SWITCHES", "REMOVED", "Switches", "multicast_off", "variable"]

PREFIX = "REPLAYMOE_"


@dataclass(frozen=True)
class Switches:
    """The process defaults of the switches (each field: its variable ``REPLAYMOE_<FIELD>``).

    * ``fast_launch`` (``REPLAYMOE_FAST_LAUNCH``, default 1): launch Triton kernels through
      :mod:`replaymoe._launch`'s direct paths (``FastLaunch`` and the all-to-all's ``Launcher``); 0:
      Triton's plain ``kernel[grid](...)`` for every kernel (launcher debugging). Process-wide only:
      no per-call field (read once, into ``_launch.ENABLED``, when ``_launch`` is imported; off in
      Triton's interpreter whatever the value).
    * ``tma`` (``REPLAYMOE_TMA``, default 1): the tile-mode GEMMs, the backward's dW GEMMs and its dA / dX
      GEMMs may read their operands through TMA tensor descriptors on Hopper and newer (bf16 / fp16), the
      default of the configuration chosen for a call (``moe_config`` through ``tma_ok``,
      ``moe_bwd_config`` through ``dw_tma_ok``); 0: pointer loads. Per call: ``MoEConfig.tma``,
      ``MoEBwdConfig.dw_tma``, ``MoEBwdConfig.gemm_tma`` (a configuration given explicitly keeps its
      fields).
    * ``half_tiles`` (``REPLAYMOE_HALF_TILES``, default 1): a tile-mode tile with at most half its rows
      real computes only that half (GEMM1, GEMM2, dA, dX). Per call: ``MoEConfig.half_tiles``,
      ``MoEBwdConfig.half_tiles`` (``None``: this default).
    * ``pdl`` (``REPLAYMOE_PDL``, default 0): the decode (direct-mode) kernels as programmatic dependent
      launches on Hopper and newer (measured slower: opt-in). Per call: ``MoEConfig.pdl`` (``None``: this
      default).
    * ``ep_fused`` (``REPLAYMOE_EP_FUSED``, default 1): the all-to-all's pack kernel computes the dispatch
      plan itself, and the ``symm`` transport's barrier runs inside its kernels; 0: the plan kernel
      first, and torch's signal-pad barrier kernel between the phases (must be the same on every rank).
      Per object: ``MoeAlltoAll(fused_plan=, fused_barrier=)`` (``None``: this default).
    """

    fast_launch: bool = True
    tma: bool = True
    half_tiles: bool = True
    pdl: bool = False
    ep_fused: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Switches:
        """The switches set by ``environ`` (default ``os.environ``); unset variables keep the defaults.

        Raises
        ------
        ValueError
            A switch's variable set to anything but ``0`` or ``1``, or a removed variable set (the
            message names what replaces it).

        Warns
        -----
        RuntimeWarning
            Another ``REPLAYMOE_*`` variable is set (replaymoe does not read it).
        """
        env = os.environ if environ is None else environ
        values: dict[str, bool] = {}
        for f in fields(cls):
            name = variable(f.name)
            raw = env.get(name)
            if raw is None:
                continue
            if raw not in ("0", "1"):
                raise ValueError(f"environment variable {name}: expected 0 or 1, got {raw!r}")
            values[f.name] = raw == "1"
        known = {variable(f.name) for f in fields(cls)} | set(NOT_SWITCHES)
        for name in sorted(k for k in env if k.startswith(PREFIX) and k not in known):
            if name in REMOVED:
                raise ValueError(f"environment variable {name} was removed: {REMOVED[name]} (unset {name})")
            warnings.warn(
                f"environment variable {name} is not read by replaymoe (its switches: "
                f"{', '.join(sorted(variable(f.name) for f in fields(cls)))})",
                RuntimeWarning,
                stacklevel=2,
            )
        return cls(**values)


def variable(field: str) -> str:
    """The environment variable of :class:`Switches` field ``field``."""
    return PREFIX + field.upper()


# removed or merged variables -> what replaces them (the message of Switches.from_env's ValueError)
REMOVED = {
    "REPLAYMOE_DW_TMA": "REPLAYMOE_TMA is the one process default of the forward's and the backward's "
    "TMA loads; per call, MoEBwdConfig(dw_tma=...)",
    "REPLAYMOE_BWD_GEMM_TMA": "REPLAYMOE_TMA is the one process default of the forward's and the "
    "backward's TMA loads; per call, MoEBwdConfig(gemm_tma=...)",
    "REPLAYMOE_EP_FUSED_PLAN": "REPLAYMOE_EP_FUSED is the one process default of the fused plan and the "
    "fused barrier; per object, MoeAlltoAll(fused_plan=...)",
    "REPLAYMOE_EP_FUSED_BARRIER": "REPLAYMOE_EP_FUSED is the one process default of the fused plan and "
    "the fused barrier; per object, MoeAlltoAll(fused_barrier=...)",
    "REPLAYMOE_EP_FAST_LAUNCH": "REPLAYMOE_FAST_LAUNCH turns every direct launch off",
    "REPLAYMOE_HF_DEVICE_DECODE": "pass replaymoe.hf.enable(..., device_decode=False)",
    "REPLAYMOE_DEEPEP": "pass replaymoe bench ep --deepep-dir PATH",
}
# REPLAYMOE_* variables that are not switches of replaymoe: never reported
NOT_SWITCHES = {
    "REPLAYMOE_PEERS": "the vLLM peer driver's folder (../shared/peers), read by that driver; "
    "replaymoe bench moe sets it for the driver it loads",
}

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
DEFAULTS: Switches = Switches.from_env()

# NVLink multicast stays off for the symm transport (it never uses multimem): what multicast_off sets
# where the process left it unset
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off() -> None:
    """Set ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
    where unset (a value the process set first wins). Called by the ``symm`` transport when it is
    created, before its first symmetric-memory allocation (torch and NVSHMEM read them at their
    initialization), and by ``replaymoe bench ep`` before it creates its process group (NCCL reads
    ``NCCL_NVLS_ENABLE`` when a communicator is created: a process group made earlier, with NVLS, keeps
    it; set them before ``init_process_group``, as ``scripts/gpu_ep.sh`` does, to be sure)."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)

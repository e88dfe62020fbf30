"""Kernel configurations of the fused MoE: the tuned tables, the heuristics and the hardware switches.

:class:`MoEConfig` / :func:`moe_config` (forward) and :class:`MoEBwdConfig` / :func:`moe_bwd_config`
(backward) pick the tiles of a call from its shape: the forward from the device's tuned table
(:mod:`replaymoe.moe.tuned`) and heuristics tuned on the H200 (what each choice measured:
docs/TUNING.md), the backward from heuristics.

Which hardware features the kernels use is chosen per call by fields of those configurations, all
bit-neutral (the same results either way): :attr:`MoEConfig.tma`, :attr:`MoEConfig.half_tiles`,
:attr:`MoEConfig.pdl`, :attr:`MoEBwdConfig.dw_tma`, :attr:`MoEBwdConfig.gemm_tma` and
:attr:`MoEBwdConfig.half_tiles`. Their process defaults are the fields ``tma``, ``half_tiles`` (on by
default) and ``pdl`` (off) of :data:`replaymoe._switches.DEFAULTS` (``REPLAYMOE_TMA``,
``REPLAYMOE_HALF_TILES``, ``REPLAYMOE_PDL``), read here where a configuration is chosen
(:func:`moe_config` through :func:`tma_ok`, :func:`moe_bwd_config` through :func:`dw_tma_ok`) or where a
field is left ``None`` (:func:`uses_half_tiles`, :func:`uses_pdl`); a field given explicitly wins.
:func:`tma_ok`, :func:`dw_tma_ok` and :func:`_hopper` say what the device allows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import _switches


@dataclass(frozen=True)
class MoEConfig:
    """Kernel configuration of one fused-MoE call (chosen by :func:`moe_config` from the shape).

    ``direct``: decode mode (one tile per slot, no layout; GEMM2 writes one row per slot and sums
    each token's rows, ``fused_reduce``, or the reduce kernel does); otherwise tiles of ``block_m`` rows from
    :func:`replaymoe.moe.layout.expert_layout`. ``*1`` = GEMM1 (gate/up
    + SwiGLU, its ``block_n1`` is per half), ``*2`` = GEMM2 (down projection).

    The data-movement switches (the same bits either way; ``tma``, ``half_tiles`` and ``pdl`` are the
    per-call forms of process defaults, :mod:`replaymoe._switches`, DESIGN "Switches"):

    * ``tma`` (tile mode): read the weights (both GEMMs) and GEMM2's SwiGLU rows through TMA tensor
      descriptors where the operands allow it (bf16 / fp16 / fp32, unit stride along K, 16-byte
      aligned rows; otherwise, and for fp8, pointer loads). :func:`moe_config` sets it for the
      prefill tiles where the device allows it (:func:`tma_ok`, whose process default is
      ``_switches.DEFAULTS.tma``, ``REPLAYMOE_TMA``); a configuration built by hand says it explicitly.
    * ``half_tiles`` (tile mode, not fp8, ``block_m >= 32``): a tile with at most half its rows real
      (an expert's last) computes only that half; ``None``: the process default
      ``_switches.DEFAULTS.half_tiles`` (``REPLAYMOE_HALF_TILES``).
    * ``pdl`` (direct mode, not fp8, Hopper and newer outside the interpreter): GEMM1, GEMM2 and the
      reduce as programmatic dependent launches; ``None``: the process default
      ``_switches.DEFAULTS.pdl`` (``REPLAYMOE_PDL``, off).
    * ``swap_ab`` (fp8): the kernels of ``_kernel_swapped.py``, which put the weight rows on the MMA's
      64-row side and the tokens on its narrow side (a quarter of the MMA work of a 64-row tile with
      one real row at decode), which lets GEMM1 run 32- or 64-column blocks and tile mode run 16- or
      32-row tiles without changing bits; ``None``: on for the invariant decode (direct mode, 64-row
      tiles), off elsewhere (:func:`swaps_ab`); :func:`moe_config`'s small-batch fp8 tiles set it.
    * ``fused_reduce`` (direct mode): GEMM2 sums each token's rows itself instead of the reduce
      kernel: the program that finishes the last of a token's local slots for its column block (a
      per-token, per-block ticket, zeroed by GEMM1) reads the token's rows in k order and writes the
      sum, the reduce kernel's arithmetic (the same bits), one launch fewer; ``None``: on in the
      direct mode (:func:`uses_fused_reduce`).
    * ``merge_slots`` (direct mode): the slots that share an expert run as the rows of one tile (up to
      its height, in slot order), so that expert's weights are read once per tile instead of once per
      slot; the program of a tile's first slot computes it and the others of that expert exit. A row's
      dot does not depend on the tile's other rows, so the same bits. Up to :data:`MERGE_MAX_SLOTS`
      slots; ``None``: where the reads it saves pay for every program's scan of the batch's ids
      (:func:`merges_slots`).
    """

    direct: bool
    block_m: int
    block_n1: int
    block_k1: int
    warps1: int
    stages1: int
    block_n2: int
    block_k2: int
    warps2: int
    stages2: int
    group_m: int = 8
    tma: bool = False
    half_tiles: bool | None = None
    pdl: bool | None = None
    swap_ab: bool | None = None
    fused_reduce: bool | None = None
    merge_slots: bool | None = None


def _switch_code(v: bool | None) -> int:
    """An optional switch as an int of a config list: -1 = None (the process default), 0, 1."""
    return -1 if v is None else int(v)


def _switch_value(v: int) -> bool | None:
    return None if v < 0 else bool(v)


def config_from_list(config: list[int]) -> MoEConfig:
    """The inverse of :func:`config_tuple` (shorter lists, from before later switches, are accepted
    too: 11 entries, without the switches; 12, without ``half_tiles`` and after; 14, without
    ``swap_ab`` and after; 15, without ``fused_reduce`` and after; 16, without ``merge_slots``)."""
    # the fields in order, as many as the list holds (ints, then the bool and optional switches)
    values: list[Any] = [bool(config[0]), *config[1:11], *(bool(v) for v in config[11:12]),
                         *(_switch_value(v) for v in config[12:17])]  # fmt: skip
    return MoEConfig(*values)


def config_tuple(c: MoEConfig) -> list[int]:
    """``c`` as the int list the ``replaymoe::moe_experts*`` custom ops take (a dataclass cannot
    cross the op boundary; a switch left ``None`` travels as -1 and is resolved by the launcher)."""
    return [int(c.direct), c.block_m, c.block_n1, c.block_k1, c.warps1, c.stages1, c.block_n2, c.block_k2,
            c.warps2, c.stages2, c.group_m, int(c.tma), _switch_code(c.half_tiles),
            _switch_code(c.pdl), _switch_code(c.swap_ab), _switch_code(c.fused_reduce),
            _switch_code(c.merge_slots)]  # fmt: skip


# Every fp8 configuration uses tiles of this many rows: Hopper's fp8 dot at >= 64 rows (wgmma) and at
# fewer rows (the mma.sync path, through fp16) round differently, so one tile height for every T is
# what keeps the fp8 path batch-invariant (a token's bits do not depend on T); see DESIGN. The swapped
# kernels (MoEConfig.swap_ab) put the tokens on the MMA's other side, so their 16- or 32-row tiles (and
# the decode's one row) still run 64-row wgmma instructions: the same bits.
FP8_BLOCK_M = 64


def fp8_invariant(c: MoEConfig) -> bool:
    """Whether fp8 configuration ``c`` keeps the batch-invariance guarantee: every dot is a wgmma of
    :data:`FP8_BLOCK_M` or more rows, either on :data:`FP8_BLOCK_M`-row token tiles or with the weights on
    the MMA's rows (:func:`swaps_ab`: the direct mode's one token, or 16- / 32-row tiles on its N side)."""
    return c.block_m == FP8_BLOCK_M or swaps_ab(c, True)


class ConfigTable(Protocol):
    """What :func:`moe_config` reads of a tuned table (:class:`replaymoe.moe.tuned.TunedTable`)."""

    def lookup(self, key: tuple, *, fp8_fast: bool = False) -> MoEConfig | None: ...


def token_bucket(T: int) -> int:
    """T rounded up to a power of two: the token count a tuned-table entry stands for."""
    return 1 << max(0, (T - 1).bit_length())


def table_key(H: int, I: int, E_local: int, K: int, fp8: bool, T: int) -> tuple:  # noqa: E741
    """The tuned-table key of a problem of ``T`` tokens (T rounded up to a power of two, its token bucket)."""
    return (H, I, E_local, K, bool(fp8), token_bucket(T))


# Eager calls: the host time that the direct mode saves (the 2 layout launches and their buffers) at
# decode sizes on an H200 host (docs/TUNING.md, "Launch overhead").
EAGER_LAUNCH_SAVING_S = 40e-6
_HBM_BYTES_PER_S = 4.27e12


def _direct_pays_off_eagerly(slots: int, H: int, I: int, E_local: int, fp8: bool) -> bool:  # noqa: E741
    """Eager decode: the direct mode reads an expert once per slot instead of once per expert; take
    it when the expected extra weight reads cost less GPU time than the launches it saves on the host
    (an eager decode step is bound by the host)."""
    if slots > 256:
        return False
    distinct = E_local * (1.0 - (1.0 - 1.0 / E_local) ** slots)  # expected experts hit, random routing
    expert_bytes = 3 * H * I * (1 if fp8 else 2)
    return (slots - distinct) * expert_bytes / _HBM_BYTES_PER_S < EAGER_LAUNCH_SAVING_S


# shared memory a fitted configuration's staged GEMM tiles may take per program (Hopper has 227 KiB; the
# rest is left to the epilogue's layout conversions and the compiler's scratch)
SHARED_BUDGET = 160 * 1024


def fit_shared_memory(c: MoEConfig, itemsize: int, budget: int = SHARED_BUDGET) -> MoEConfig:
    """``c`` with GEMM1's and GEMM2's pipeline stages (and, where two stages would not fit, their K
    chunks) cut so that each GEMM's staged tiles take at most ``budget`` bytes at ``itemsize`` bytes per
    element. A GEMM with ``s`` stages keeps ``s - 1`` tiles in flight (Triton's pipeliner: fp32 at
    bf16's prefill tiles asked for 3 x 96 KiB with 4 stages). GEMM1 stages an x tile [block_m,
    block_k1] and the gate and up tiles [2 * block_n1, block_k1]; GEMM2 an intermediate tile [block_m,
    block_k2] and a w2 tile [block_n2, block_k2]. Fewer stages leave the arithmetic as it is; shallower
    K chunks change fp32's summation order."""

    k1, s1 = _fit_stages(c.block_m + 2 * c.block_n1, c.block_k1, c.stages1, itemsize, budget)
    k2, s2 = _fit_stages(c.block_m + c.block_n2, c.block_k2, c.stages2, itemsize, budget)
    return dataclasses.replace(c, block_k1=k1, stages1=s1, block_k2=k2, stages2=s2)


def _fit_stages(rows: int, block_k: int, stages: int, itemsize: int, budget: int) -> tuple[int, int]:
    """``(block_k, stages)`` of a GEMM staging ``rows`` rows of ``block_k`` elements per step: K halved
    while one step exceeds ``budget`` bytes, then as many stages as keep ``stages - 1`` steps within it
    (at least 2, at most ``stages``)."""
    while block_k > 16 and rows * block_k * itemsize > budget:
        block_k //= 2
    return block_k, max(2, min(stages, budget // (rows * block_k * itemsize) + 1))


def moe_config(
    T: int,
    K: int,
    H: int,
    I: int,  # noqa: E741
    E_local: int,
    *,
    fp8: bool = False,
    eager: bool = False,
    batch_invariant: bool = True,
    tma: bool = False,
    table: ConfigTable | None = None,
    itemsize: int = 2,
) -> MoEConfig:
    """Kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of size H×I.

    ``eager``: the call launches its kernels one by one from Python (not inside a CUDA graph or a
    compiled graph), so host time counts too: small batches may take the direct (decode) mode, which
    launches 2 kernels instead of 4-5 (no layout, no reduce; fp8: one more each), where its extra weight
    reads cost less. Every mode gives a token the same bits (batch invariance), so this changes time,
    never results.

    ``batch_invariant`` (fp8 only; bf16/fp16 are invariant in every configuration): every fp8
    configuration runs the same MMA kind (:func:`fp8_invariant`: :data:`FP8_BLOCK_M`-row tiles, or the
    swapped kernels with the weights on the MMA's 64 rows), so a token's output does not depend on T.
    ``False`` lets small batches take 16/32-row tiles (Hopper's mma.sync path), faster at decode
    (e.g. DeepSeek-V3 T=8) but rounding differently from the prefill tiles.

    ``tma``: the device can use TMA tensor descriptors (``experts_triton`` passes :func:`tma_ok`):
    the bf16/fp16 prefill configuration (128-row tiles) then sets :attr:`MoEConfig.tma` (faster at
    T >= 4096: docs/TUNING.md, "TMA in tile mode"); the bits are the same either way.

    ``table``: the :class:`~replaymoe.moe.tuned.TunedTable` of the device (the launchers pass
    :func:`~replaymoe.moe.tuned.table_for`); None: no tuned entries, the heuristics alone. Its
    entries override the heuristics for the problems they name; every one keeps the batch-invariance
    guarantee (fp8: :func:`fp8_invariant`) unless ``batch_invariant=False``. A tuned tile-mode entry yields to
    the eager direct mode where that applies (``eager``). The heuristics were tuned on the H200.

    ``itemsize``: bytes per element of the activations and weights (2: bf16 / fp16; 4: fp32, whose
    tiles take twice the shared memory: the 16-bit choice, tuned entries included, with fewer pipeline
    stages or shallower K chunks where it would not fit, :func:`fit_shared_memory`).
    """
    if not fp8 and itemsize > 2:  # fp32: the 16-bit choice (a tuned entry too), fitted to the shared memory
        return fit_shared_memory(moe_config(T, K, H, I, E_local, eager=eager, tma=tma, table=table), itemsize)
    tuned = None
    if table is not None:
        tuned = table.lookup(table_key(H, I, E_local, K, fp8, T), fp8_fast=fp8 and not batch_invariant)
    slots = T * K
    eager_direct = eager and _direct_pays_off_eagerly(slots, H, I, E_local, fp8)
    if tuned is not None and (tuned.direct or not eager_direct):  # an eager decode keeps the direct mode
        # a tuned TMA entry where the device or the caller says no TMA: the same tiles, pointer loads
        return tuned if tma or not tuned.tma else dataclasses.replace(tuned, tma=False)
    if T == 1 or slots * 4 <= E_local or eager_direct:
        # decode: one tile per slot, each active expert's weights streamed once, split along N
        if fp8 and batch_invariant:
            # the swapped decode kernels (swap_ab) with GEMM1 on 32-column blocks (gate and up rows stacked
            # in one 64-row dot), both GEMMs on 4 warps: faster than the unswapped 128-column blocks on 8
            # warps (H100; docs/TUNING.md, "fp8 decode with swapped operands")
            return MoEConfig(True, FP8_BLOCK_M, 32, 128, 4, 4, 64, 128, 4, 4)
        if fp8:
            return MoEConfig(True, 16, 128, 128, 4, 3, 128, 128, 4, 3)
        return MoEConfig(True, 16, 32, 128, 4, 4, 32, 128, 4, 4)
    m_avg = slots / min(E_local, slots)  # rows per active expert
    if fp8 and batch_invariant and m_avg <= 8:
        # 1-8 rows per expert: 16-row tiles on the swapped kernels' N side (the bits of the 64-row tiles),
        # GEMM1 on 32 columns (gate and up rows stacked in one 64-row dot), GEMM2 on 64, 3 stages, 4 warps:
        # better or equal to the 64-row tiles at every such point measured (H100; docs/TUNING.md, "fp8
        # decode with swapped operands")
        return MoEConfig(False, 16, 32, 128, 4, 3, 64, 128, 4, 3, swap_ab=True)
    if fp8 and batch_invariant and m_avg < 48:  # H200 sweep: 4 stages, GEMM2 on 4 warps (2-8 % faster)
        return MoEConfig(False, FP8_BLOCK_M, 128, 128, 8, 4, 128, 128, 4, 4)
    if fp8 and (batch_invariant or m_avg >= 48):
        return MoEConfig(False, FP8_BLOCK_M, 128, 128, 8, 3, 128, 128, 8, 3)
    if fp8:
        return MoEConfig(False, 16 if m_avg < 12 else 32, 128, 128, 4, 3, 128, 128, 4, 3)
    if m_avg < 12:  # H200 sweep: memory-bound, deep K tiles
        return MoEConfig(False, 16, 64, 256, 4, 3, 64, 256, 4, 3)
    if m_avg < 48:
        return MoEConfig(False, 32, 64, 128, 4, 4, 64, 128, 4, 4)
    if tma and m_avg >= 256:
        # Hopper, long expert segments: GEMM1 in 32-deep K chunks, 6 stages (the same shared memory as
        # 64 x 4; the same bits): faster at every such point of an H200 sweep, slower at 64 rows per
        # expert, so not below 256 rows (docs/TUNING.md, "Long expert segments")
        return MoEConfig(False, 128, 128, 32, 8, 6, 256, 64, 8, 4, 4, tma=tma)
    return MoEConfig(False, 128, 128, 64, 8, 4, 256, 64, 8, 4, 4, tma=tma)


@dataclass(frozen=True)
class MoEBwdConfig:
    """Kernel configuration of one fused-MoE backward (chosen by :func:`moe_bwd_config`).

    ``block_m``: rows per tile of the backward's layout; ``*_a`` = the dA GEMM (``dO @ W2``, N over
    I, K over H), ``*_x`` = the dX GEMM (N over H, K over 2I), ``*_w`` = the weight-gradient GEMMs
    (a ``bm_w × bn_w`` block of one expert's dW, K over its rows). ``dw_mode``: 0 = the token rows
    of x and dO gathered inside the dW loop; 1 = gathered once into layout order first; 2 = gathered
    once, transposed (K-major A operands). ``dw_tma`` (``dw_mode`` 1, bf16 / fp16 / fp32): the dW
    GEMMs read their operands through TMA tensor descriptors (``moe_bwd_dw_tma_kernel``; the same
    bits as the pointer kernel); where a buffer does not meet TMA's alignment the pointer kernel runs.
    ``dw_progs`` (with ``dw_tma``): 0 = one program per (expert, block) tile; n > 0 = a persistent
    grid of at most n programs walking the tiles in expert-major order; -1 = that grid with one
    program per SM of the device (every tile is still one program's K loop in row order: same
    bits). ``dw_c_desc`` (with ``dw_tma``): store C through a descriptor where BLOCK_M divides M
    (else pointer stores; on sm_90 the descriptor store takes more registers: 199 vs 172 at
    128×128×32, 4 warps). ``gemm_tma``: the dA GEMM reads W2, and the dX GEMM W13 and dh, through TMA
    descriptors where the weights have unit stride along their last dimension and the K loop has no
    partial step (else pointer loads; the same operand values either way). ``maxnreg_w`` (with
    ``dw_tma``): a cap on the dW kernel's registers per thread (0: the compiler's choice); 168 lets
    three 4-warp programs share an SM (65536 / (3 * 128) = 170) where the compiler's 199 allowed two.

    The data-movement switches (the same bits either way): ``dw_tma`` and ``gemm_tma`` (both with the
    process default ``_switches.DEFAULTS.tma``, ``REPLAYMOE_TMA``, through :func:`dw_tma_ok`), set by
    :func:`moe_bwd_config`; ``half_tiles``: the dA and dX GEMMs (and GEMM1 recomputed) take half tiles as
    the forward does (:attr:`MoEConfig.half_tiles`), ``None``: the process default
    ``_switches.DEFAULTS.half_tiles``.
    """

    block_m: int
    bn_a: int
    bk_a: int
    warps_a: int
    stages_a: int
    bn_x: int
    bk_x: int
    warps_x: int
    stages_x: int
    bm_w: int
    bn_w: int
    bk_w: int
    warps_w: int
    stages_w: int
    group_m: int = 8
    dw_mode: int = 0
    dw_tma: bool = False
    dw_progs: int = 0
    dw_c_desc: bool = True
    gemm_tma: bool = False
    maxnreg_w: int = 0
    half_tiles: bool | None = None


# the fields of MoEBwdConfig a tuned table's backward entry holds (its kernel tiles); the rest are the
# device's data-movement switches (dw_tma, dw_c_desc, gemm_tma, half_tiles), kept from the heuristics
BWD_TILE_FIELDS = ("block_m", "bn_a", "bk_a", "warps_a", "stages_a", "bn_x", "bk_x", "warps_x", "stages_x",
                   "bm_w", "bn_w", "bk_w", "warps_w", "stages_w", "group_m", "dw_mode", "dw_progs",
                   "maxnreg_w")  # fmt: skip


def moe_bwd_config(
    T: int,
    K: int,
    H: int,
    I: int,  # noqa: E741
    E_local: int,
    tma: bool = False,
    table=None,
    itemsize: int = 2,
) -> MoEBwdConfig:
    """Backward kernel configuration for ``T`` tokens of top-``K`` over ``E_local`` experts of H×I.

    ``tma``: the device and dtype allow TMA descriptors (:func:`dw_tma_ok`); sets
    :attr:`MoEBwdConfig.dw_tma`, and for the large-expert tiles a persistent dW grid (one program
    per SM): faster than the pointer kernel, bitwise the same (docs/TUNING.md, "Backward dW through
    TMA"). ``table``: a :class:`~replaymoe.moe.tuned.TunedTable`; where its ``backward``
    section has the problem's token bucket, its kernel tiles (:data:`BWD_TILE_FIELDS`) replace the
    heuristics' and the switches stay as chosen here. ``itemsize``: bytes per element (4: fp32, whose
    tiles are fitted to the shared memory, :func:`fit_bwd_shared_memory`).
    """
    c = _bwd_heuristics(T, K, H, I, E_local, tma)
    tiles = table.lookup_backward(table_key(H, I, E_local, K, False, T)) if table is not None else None
    c = c if tiles is None else dataclasses.replace(c, **tiles)
    return c if itemsize <= 2 else fit_bwd_shared_memory(c, itemsize)


def fit_bwd_shared_memory(c: MoEBwdConfig, itemsize: int, budget: int = SHARED_BUDGET) -> MoEBwdConfig:
    """:func:`fit_shared_memory` for the backward's GEMMs: dA stages a dO tile [block_m, bk_a] and a w2
    tile [bn_a, bk_a]; dX a dh tile [block_m, bk_x] and a w13 tile [bn_x, bk_x]; dW an A tile [bm_w,
    bk_w] and a B tile [bn_w, bk_w]."""
    bk_a, stages_a = _fit_stages(c.block_m + c.bn_a, c.bk_a, c.stages_a, itemsize, budget)
    bk_x, stages_x = _fit_stages(c.block_m + c.bn_x, c.bk_x, c.stages_x, itemsize, budget)
    bk_w, stages_w = _fit_stages(c.bm_w + c.bn_w, c.bk_w, c.stages_w, itemsize, budget)
    return dataclasses.replace(c, bk_a=bk_a, stages_a=stages_a, bk_x=bk_x, stages_x=stages_x, bk_w=bk_w,
                               stages_w=stages_w)  # fmt: skip


def _bwd_heuristics(T: int, K: int, H: int, I: int, E_local: int, tma: bool) -> MoEBwdConfig:  # noqa: E741
    slots = max(T * K, 1)
    m_avg = slots / min(E_local, slots)
    # H200 sweeps (docs/TUNING.md, "Training backward"): dW over pre-gathered rows
    if m_avg < 12:
        return MoEBwdConfig(16, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1, tma)
    if m_avg < 40:
        return MoEBwdConfig(32, 64, 128, 4, 3, 64, 128, 4, 3, 64, 64, 32, 4, 3, 8, 1, tma)
    g = tma and _switches.DEFAULTS.tma
    if m_avg <= 256:  # dW's K loop (an expert's rows) is short: 4-warp 128x128x32 tiles, 4 stages
        # Hopper (bitwise the same, faster at Qwen3 T = 1024 / 4096 on the H200): dA 128x256 tiles; dW capped
        # at 168 registers, three programs per SM (docs/TUNING.md, "Small experts")
        bn_a = 256 if tma else 128
        return MoEBwdConfig(128, bn_a, 64, 8, 4, 256, 64, 8, 4, 128, 128, 32, 4, 4, 8, 1, tma, gemm_tma=g,
                            maxnreg_w=168 if tma else 0)  # fmt: skip
    if tma:  # Hopper (H200 sweep; bitwise the same): dA 128x256 tiles, dW 32-deep K chunks in 6 stages
        # (docs/TUNING.md, "Long expert segments")
        return MoEBwdConfig(128, 256, 64, 8, 4, 256, 64, 8, 4, 128, 256, 32, 8, 6, 8, 1, tma, -1, gemm_tma=g)
    return MoEBwdConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, 128, 256, 64, 8, 3, 8, 1, tma, 0, gemm_tma=g)


# Decode (direct mode) kernels as programmatic dependent launches on Hopper and newer: opt-in (per call
# MoEConfig.pdl=True; process default _switches.DEFAULTS.pdl, REPLAYMOE_PDL=1). Results are the same
# either way. Off by default because it is slower at every decode point measured (H200 and H100;
# docs/TUNING.md, "Launch overhead"): GEMM2's programs sit resident while GEMM1 still runs, and its L2
# prefetch of weights larger than L2 reads them twice.


def uses_pdl(c, fp8: bool, dev: torch.device) -> bool:
    """Configuration ``c``'s kernels run as programmatic dependent launches on ``dev``: ``c.pdl``
    (``None``: ``_switches.DEFAULTS.pdl``), direct mode, not fp8, a CUDA device of compute capability
    9.0 or newer, and not Triton's interpreter."""
    want = _switches.DEFAULTS.pdl if c.pdl is None else c.pdl
    return want and c.direct and not fp8 and _hopper(dev)


def swaps_ab(c, fp8: bool) -> bool:
    """Configuration ``c`` runs the fp8 kernels with swapped operands (``_kernel_swapped.py``): fp8,
    128-deep K chunks in both GEMMs, GEMM1 on 32, 64 or 128 columns and GEMM2 on 64 or 128 (one weight
    scale per dot, and at least 64 weight rows per dot: Hopper's narrower fp8 MMA rounds differently);
    ``c.swap_ab=True`` in the direct mode or with 16-, 32- or 64-row tiles (the tile's rows are the
    MMA's N side); ``None``: on in the direct mode with :data:`FP8_BLOCK_M`-row tiles (the invariant
    decode; ``batch_invariant=False``'s 16/32-row decode tiles keep their mma.sync kernels), off
    otherwise. The same bits as the unswapped 64-row-tile kernels (GPU test), on any device."""
    if c.swap_ab is None:
        want = c.direct and c.block_m == FP8_BLOCK_M
    else:
        want = c.swap_ab and (c.direct or c.block_m in (16, 32, 64))
    return (
        want and fp8 and c.block_n1 in (32, 64, 128) and c.block_k1 == 128 and c.block_k2 == 128
        and c.block_n2 in (64, 128)
    )  # fmt: skip


# merged direct tiles (MoEConfig.merge_slots): each program scans the batch's T * K expert ids, so only
# where they are few (a [tile rows, slots] comparison in registers)
MERGE_MAX_SLOTS = 256
# merge_slots=None merges where random routing is expected to leave at least one slot sharing an expert
# with another and the weight reads saved take at least this long: the scan costs 1.5-5 us where nothing
# merges, and merging lost with 4 us of reads saved and won with 8 (H100; docs/TUNING.md, "Merged direct
# tiles")
MERGE_MIN_SAVED_S = 6e-6


def merges_slots(c, T: int, K: int, H: int, I: int, E_local: int, fp8: bool) -> bool:  # noqa: E741
    """Configuration ``c`` merges the slots that share an expert into one direct tile
    (:attr:`MoEConfig.merge_slots`) for ``T`` tokens of top-``K`` over ``E_local`` experts of size H×I:
    direct mode, 2 tokens or more (one token's top-k experts are distinct), at most
    :data:`MERGE_MAX_SLOTS` slots, and ``c.merge_slots``; ``None``: where random routing is expected to
    give at least one duplicate expert read and the reads merging saves take at least
    :data:`MERGE_MIN_SAVED_S` at :data:`_HBM_BYTES_PER_S`."""
    slots = T * K
    if not c.direct or T < 2 or slots > MERGE_MAX_SLOTS or c.merge_slots is False:
        return False
    if c.merge_slots:
        return True
    repeats = slots - E_local * (1.0 - (1.0 - 1.0 / E_local) ** slots)  # slots beyond the distinct experts
    return repeats >= 1.0 and repeats * 3 * H * I * (1 if fp8 else 2) / _HBM_BYTES_PER_S >= MERGE_MIN_SAVED_S


def uses_fused_reduce(c) -> bool:
    """Configuration ``c`` sums each token's rows in GEMM2 (:attr:`MoEConfig.fused_reduce`): direct mode
    only; ``None``: on there."""
    return c.direct and (c.fused_reduce is None or c.fused_reduce)


# Tile-mode (prefill) GEMM operands through TMA tensor descriptors on Hopper and newer
# (:attr:`MoEConfig.tma`, chosen by :func:`moe_config` where :func:`tma_ok`); the process default
# _switches.DEFAULTS.tma off (REPLAYMOE_TMA=0) keeps pointer loads where the configuration is chosen for
# the call (a configuration given with tma=True still uses TMA). Results are the same either way; faster
# at T >= 4096 (docs/TUNING.md, "TMA in tile mode").


def tma_ok(dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Tile mode may read its operands through TMA descriptors on ``dev``: ``_switches.DEFAULTS.tma``
    (``REPLAYMOE_TMA``), a CUDA device of compute capability 9.0 or newer, not Triton's interpreter
    (tests that want the TMA kernels there pass a configuration with ``tma=True``), and bf16 / fp16
    activations (fp32's ``ieee`` dot, no tensor cores, spills hundreds of bytes once its tiles come from
    TMA: ``scripts/fwd_tma_ptx_check.py``'s notes)."""
    return _switches.DEFAULTS.tma and dtype in (torch.bfloat16, torch.float16) and _hopper(dev)


# The weight-gradient GEMMs through TMA tensor descriptors on Hopper and newer (MoEBwdConfig.dw_tma,
# set by moe_bwd_config where dw_tma_ok); the process default _switches.DEFAULTS.tma off
# (REPLAYMOE_TMA=0) keeps the pointer kernel. The bits are the same either way (docs/TUNING.md,
# "Backward dW through TMA"). The dA / dX GEMMs' weight (and dX's dh) tiles through TMA descriptors
# where dw_tma_ok and that default is on (MoEBwdConfig.gemm_tma; the same bits as the pointer loads,
# H200 test; a small gain at every Qwen3 point, peaks unchanged: docs/TUNING.md, "Backward dA / dX
# through TMA").
# Tile mode, bf16 / fp16 / fp32: a tile with at most half its rows real (an expert's last) computes
# only that half (the kernels' HALF_TILES; the same bits). Its process default off
# (_switches.DEFAULTS.half_tiles, REPLAYMOE_HALF_TILES=0) turns it off where a configuration leaves
# MoEConfig.half_tiles / MoEBwdConfig.half_tiles None (the default).


def uses_half_tiles(c, fp8: bool) -> bool:
    """The tile kernels of configuration ``c`` (a :class:`MoEConfig` or :class:`MoEBwdConfig`) take
    HALF_TILES: ``c.half_tiles`` (``None``: ``_switches.DEFAULTS.half_tiles``), tile mode, not fp8,
    >= 32-row tiles."""
    want = _switches.DEFAULTS.half_tiles if c.half_tiles is None else c.half_tiles
    return want and not fp8 and not getattr(c, "direct", False) and c.block_m >= 32


_HOPPER_DEVICES: dict = {}
_SM_COUNTS: dict = {}


def sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of CUDA device ``dev`` (cached; 1 elsewhere)."""
    n = _SM_COUNTS.get(dev)
    if n is None:
        n = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        _SM_COUNTS[dev] = n
    return n


def dw_tma_ok(dev: torch.device, dtype: torch.dtype) -> bool:
    """The backward's dW GEMMs may use TMA descriptors: ``_switches.DEFAULTS.tma`` (``REPLAYMOE_TMA``),
    bf16 / fp16, a CUDA device of compute capability 9.0 or newer, and not Triton's interpreter (tests
    that want the TMA kernel there pass a configuration with ``dw_tma=True``)."""
    return _switches.DEFAULTS.tma and dtype in (torch.bfloat16, torch.float16) and _hopper(dev)


def _hopper(dev: torch.device) -> bool:
    """``dev`` is a CUDA device of compute capability 9.0 or newer and the process does not run
    Triton's interpreter (cached per device): where TMA descriptors and PDL may be used."""
    ok = _HOPPER_DEVICES.get(dev)
    if ok is None:
        from .._backend import INTERPRET

        ok = dev.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(dev)[0] >= 9
        _HOPPER_DEVICES[dev] = ok
    return ok

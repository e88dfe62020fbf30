"""Compile the tile-mode (prefill) GEMM kernels for sm_90 with and without TMA (no GPU needed).

For the configurations :func:`replaymoe.moe.configs.moe_config` picks for bf16 prefill (128-row tiles,
GEMM1 128×(2×128)×64, GEMM2 128×256×64, 8 warps, 4 stages; on Hopper at >= 256 rows per expert GEMM1
128×(2×128)×32 in 6 stages) and the variants that may take TMA
(standard, training forward, interleaved gate/up with biases, w2 bias), this compiles both kernels as
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` does for a Hopper launch and checks:

* ``TMA=True`` emits ``cp.async.bulk.tensor`` (TMA copies); GEMM2 then has no other asynchronous copy
  (``cp.async.cg``), GEMM1 keeps them for its gathered x rows only; ``TMA=False`` emits none;
* the TMA kernels need no global scratch (Triton's in-kernel descriptors would: ``triton.set_allocator``)
  and carry one launcher-side descriptor encoding (``tensordesc_meta``) per descriptor argument;
* spills: ``ptxas -v -arch=sm_90a`` (Triton's bundled ptxas) on the PTX reports registers and spill
  bytes; the inference kernels must not spill. The training forward's GEMM1 (``SAVE_H``: gate and up
  pre-activations stored too) sits at 255 registers and already spills 4 bytes with pointer loads
  (8 with TMA): allowed up to 8 bytes, and printed. The long-segment Hopper configuration (32-deep K
  chunks, 6 stages, TMA) takes 190 registers and does not spill; its pointer-load twin (never picked)
  spills 8 bytes. Triton 3.6 fills ``n_regs`` / ``n_spills`` only
  when it loads a kernel onto a GPU, so they are not available from a compile-only run.

Not chosen, hence not checked here: fp32 activations. Their ``ieee`` dot (no tensor cores) with TMA
tiles compiled for sm_90 at 64-row tiles spilled 370–630 bytes per thread (255 registers; 128–160
without TMA, no spill), so ``replaymoe.moe.configs.tma_ok`` leaves fp32 on pointer loads.

Exit status 1 on a mismatch (tests/test_moe.py runs it in a subprocess).

Usage: PYTHONPATH=src python3 scripts/fwd_tma_ptx_check.py [gemm1|gemm2 ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

import sm90_compile as sm90
from sm90_compile import F32, I16, I32, ONE, P16, P32, PI
from triton import knobs

from replaymoe.moe._kernel_gemm1 import moe_gemm1_kernel
from replaymoe.moe._kernel_gemm2 import moe_gemm2_kernel

COMMON = dict(ids_ptr=PI, num_pid_m=I32, H=I16, I=I16, num_slots=I32, expert_offset=I32, num_local=I16,
              stride_we=I16, stride_wn=I16, stride_wk=ONE, stride_se=I32, stride_sn=I32, stride_be=I32,
              stride_bn=I32, sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI, w_ptr=P16, ws_ptr=P16,
              b_ptr=P16, inter_ptr=P16, inter_s_ptr=P16)  # fmt: skip
G1_ARGS = dict(COMMON, x_ptr=P16, xs_ptr=P16, h_ptr=P16, TOP_K=I32, alpha=F32, limit=F32, stride_xm=I16,
               stride_im=I16, stride_hm=I16)  # fmt: skip
G2_ARGS = dict(COMMON, y_ptr=P16, wts_ptr=P32, stride_im=I16, stride_ym=I16)
TILE = dict(DIRECT=False, FP8=False, EVEN_K=True, BLOCK_M=128, BLOCK_K=64, GROUP_M=4, DOT_PREC="tf32")
G1 = dict(TILE, PREQ_X=False, PREQ=False, SAVE_H=False, STORE_ACT=True, HAS_BIAS=False, INTERLEAVED=False,
          ACT=0, BLOCK_N=128)  # fmt: skip
G2 = dict(TILE, PREQ=False, HAS_BIAS=False, BLOCK_N=256)
D2 = dict(a_desc=(128, 64), w_desc=(256, 64))
# bytes of spill stores allowed (0 elsewhere); see the docstring
MAX_SPILL = {"gemm1-training": 8, "gemm1-training-half": 8, "gemm1-training-k32": 8}
CASES = {  # name: (kernel, arguments, constexprs, descriptor block shapes (TMA only)[, warps, stages])
    "gemm1": (moe_gemm1_kernel, G1_ARGS, G1, dict(w_desc=(128, 64))),
    "gemm1-training": (moe_gemm1_kernel, G1_ARGS, dict(G1, SAVE_H=True), dict(w_desc=(128, 64))),
    "gemm1-interleaved-bias": (moe_gemm1_kernel, G1_ARGS, dict(G1, INTERLEAVED=True, HAS_BIAS=True, ACT=1),
                               dict(w_desc=(256, 64))),
    # the long-segment Hopper configuration (moe_config, >= 256 rows per expert): 32-deep K chunks, 6 stages
    "gemm1-training-k32": (moe_gemm1_kernel, G1_ARGS, dict(G1, SAVE_H=True, BLOCK_K=32, HALF_TILES=True),
                           dict(w_desc=(128, 32)), 8, 6),
    "gemm1-ragged-H": (moe_gemm1_kernel, G1_ARGS, dict(G1, EVEN_K=False), dict(w_desc=(128, 64))),
    "gemm2": (moe_gemm2_kernel, G2_ARGS, G2, D2),
    "gemm2-bias": (moe_gemm2_kernel, G2_ARGS, dict(G2, HAS_BIAS=True), D2),
    # half tiles (HALF_TILES): both tile heights in one kernel, the half one through its own descriptor
    "gemm1-training-half": (moe_gemm1_kernel, G1_ARGS, dict(G1, SAVE_H=True, HALF_TILES=True),
                            dict(w_desc=(128, 64))),
    "gemm2-half": (moe_gemm2_kernel, G2_ARGS, dict(G2, HALF_TILES=True), dict(D2, a_desc_half=(64, 64))),
    # the mid-size tiles (16/32 rows, 4 warps), which moe_config does not give TMA yet but
    # the H200 A/B timed with it (scripts/fwd_tma_check.py --all-tiles, in git at 3cc3db5)
    "gemm1-mid32": (moe_gemm1_kernel, G1_ARGS, dict(G1, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128),
                    dict(w_desc=(64, 128)), 4, 4),
    "gemm2-mid16": (moe_gemm2_kernel, G2_ARGS, dict(G2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256),
                    dict(a_desc=(16, 256), w_desc=(64, 256)), 4, 3),
}  # fmt: skip


def compile_sm90(fn, args: dict, consts: dict, descs: dict, tma: bool, warps: int = 8, stages: int = 4):
    """The kernel compiled for sm_90 (default: 8 warps, 4 stages, as the prefill configuration)."""
    consts = dict(consts, TMA=tma)
    return sm90.compile_sm90(fn, args, consts, warps=warps, stages=stages, descs=descs if tma else None)


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers and spill bytes of the kernel (``ptxas -v -arch=sm_90a``, Triton's bundled ptxas)."""
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"regs": int(regs.group(1)), "spill_st": int(stores.group(1)), "spill_ld": int(stores.group(2))}


def main(names: list[str]) -> int:
    bad = 0
    print(f"{'kernel':24s} {'TMA':5s} {'bulk.tensor':>11s} {'cp.async':>8s} {'wgmma/mma':>9s} {'regs':>4s} "
          f"{'spill st/ld B':>13s} {'smem KB':>7s}  ok")  # fmt: skip
    for name in [n for n in CASES if not names or n.split("-")[0] in names or n in names]:
        fn, args, consts, descs, *launch = CASES[name]
        for tma in (False, True):
            k = compile_sm90(fn, args, consts, descs, tma, *launch)
            ptx = k.asm["ptx"]
            bulk, cp = ptx.count("cp.async.bulk.tensor"), ptx.count("cp.async.cg")
            mma = f"{ptx.count('wgmma.mma_async')}/{ptx.count('mma.sync')}"  # wgmma (>= 64 rows) / mma.sync
            u = ptxas_usage(ptx)
            ok = u["spill_st"] <= MAX_SPILL.get(name, 0) and mma != "0/0"
            if tma:  # host-side descriptors: encoded by the launcher, no device scratch (allocator) needed
                ok &= bulk > 0 and (cp == 0 if fn is moe_gemm2_kernel else cp > 0)
                ok &= k.metadata.global_scratch_size == 0 and len(k.metadata.tensordesc_meta) == len(descs)
            else:
                ok &= bulk == 0 and cp > 0
            spill = f"{u['spill_st']}/{u['spill_ld']}"
            print(f"{name:24s} {str(tma):5s} {bulk:11d} {cp:8d} {mma:>9s} {u['regs']:4d} {spill:>13s} "
                  f"{k.metadata.shared / 1024:7.1f}  {'ok' if ok else 'MISMATCH'}")  # fmt: skip
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

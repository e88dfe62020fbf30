"""Compile the backward's TMA dW kernel for sm_90 (no GPU needed) and check its instructions.

For each configuration :func:`replaymoe.moe.configs.moe_bwd_config` picks with ``tma=True`` (and the
deeper-pipelined / persistent variants the removed dw_tma_check.py timed), bf16, descriptor and pointer
stores: the PTX must load through TMA (``cp.async.bulk.tensor``) and use wgmma, and a picked
configuration must fit Hopper's 227 KiB of shared memory per block without spilling (a variant over
it is only reported: it could not launch). A configuration with a register cap (``maxnreg_w``) may keep
a stack frame of at most :data:`CAPPED_STACK_MAX` bytes and no local memory: the cap is a measured trade
(at 168 registers three 4-warp programs share an SM; the H200 ran that dW kernel 1.17x faster with its
16-byte frame than uncapped, bitwise the same). Prints shared memory (the compiled kernel's metadata),
registers and spills (stack / local bytes, from Triton's bundled ``cuobjdump -res-usage``). Exit
status 1 on a failed check (tests/test_moe_backward.py runs ``--quick``: the picked configurations).

Usage: PYTHONPATH=src python3 scripts/dw_tma_ptx_check.py [--quick]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import replaymoe.moe._kernel_bwd_dw as kb
import replaymoe.moe.configs as MT

SMEM_MAX = 232448  # bytes of shared memory one block may use on sm_90
CAPPED_STACK_MAX = 32  # stack bytes allowed under an explicit register cap (none without one)

# (bm, bn, bk, warps, stages, maxnreg) of the dW GEMMs: what moe_bwd_config picks over the bench shapes
# (Qwen3, Mixtral, DSv3-like; E, K) and token counts from decode to T=16384 (maxnreg 0: the compiler's
# choice), then the variants the H200 A/B timed (deeper pipelines; scripts/dw_tma_check.py, git 3cc3db5)
PICKED = sorted(
    {
        (c.bm_w, c.bn_w, c.bk_w, c.warps_w, c.stages_w, c.maxnreg_w)
        for E, K in ((128, 8), (8, 2), (64, 8))
        for T in (1, 64, 512, 4096, 16384)
        for c in [MT.moe_bwd_config(T, K, 2048, 768, E, tma=True)]
    }
)
VARIANTS = [
    (128, 256, 64, 8, 4, 0),
    (128, 256, 64, 8, 5, 0),
    (128, 128, 64, 8, 5, 0),
    (128, 128, 32, 4, 5, 0),
]


def compile_dw(bm, bn, bk, warps, stages, maxnreg, c_desc, progs):
    fn = kb.moe_bwd_dw_tma_kernel
    types = dict(
        a_desc=f"tensordesc<bf16[{bk}, {bm}]>",
        b_desc=f"tensordesc<bf16[{bk}, {bn}]>",
        a_tail_desc=f"tensordesc<bf16[{min(bk, 16)}, {bm}]>",
        b_tail_desc=f"tensordesc<bf16[{min(bk, 16)}, {bn}]>",
        c_desc=f"tensordesc<bf16[{bm}, {bn}]>" if c_desc else "constexpr",
        c_ptr="*bf16",
        starts_ptr="*i32",
        counts_ptr="*i32",
        M="i32",
        N="i32",
        num_tiles="i32",
        stride_ce="i32",
        stride_cm="i32",
    )
    consts = dict(
        C_DESC=c_desc,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        TAIL_K=min(bk, 16),
        GROUP_M=8,
        DOT_PREC="tf32",
        NUM_PROGS=progs,
    )
    if not c_desc:
        consts["c_desc"] = None
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = types[name]
            if name.endswith("_ptr") or name in ("M", "N", "stride_ce", "stride_cm"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def compile_ptr(bm, bn, bk, warps, stages, _maxnreg=0):
    """The pointer dW kernel (pre-gathered rows, ``dw_mode`` 1) at the same configuration, for comparison."""
    fn = kb.moe_bwd_dw_kernel
    consts = dict(A_T=False, A_GATHER=False, B_GATHER=False, C_T=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  GROUP_M=8, DOT_PREC="tf32")  # fmt: skip
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = (
                "*bf16" if name in ("a_ptr", "b_ptr", "c_ptr") else "*i32" if name.endswith("_ptr") else "i32"
            )
            if name != "TOP_K":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def resources(cubin: bytes) -> tuple:
    """(registers, stack bytes, local bytes) from Triton's bundled ``cuobjdump -res-usage``; Nones
    where it cannot run (stack / local memory > 0 = spills)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run(
                [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return None, None, None
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return tuple(int(v) for v in m.groups()) if m else (None, None, None)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    bad = 0
    cases = [(cfg, True, 0) for cfg in PICKED] + [(cfg, False, 0) for cfg in PICKED]
    if not quick:
        cases += [(cfg, True, 0) for cfg in VARIANTS] + [(cfg, True, 132) for cfg in PICKED + VARIANTS]
    for (bm, bn, bk, warps, stages, maxnreg), c_desc, progs in cases:
        cap = f" maxnreg {maxnreg}" if maxnreg else ""
        label = f"{bm}x{bn}x{bk} w{warps} s{stages}{cap} {'desc' if c_desc else 'ptr'}-store progs={progs}"
        try:
            k = compile_dw(bm, bn, bk, warps, stages, maxnreg, c_desc, progs)
        except Exception as exc:  # a configuration that does not compile is a failed check
            print(f"{label}: compile FAILED: {type(exc).__name__}: {str(exc)[:200]}")
            bad += 1
            continue
        ptx = k.asm["ptx"]
        md = k.metadata
        n_tma = ptx.count("cp.async.bulk.tensor")
        n_wgmma = ptx.count("wgmma.mma_async")
        regs, stack, local = resources(k.asm["cubin"])
        smem = getattr(md, "shared", None)
        fits = smem is None or smem <= SMEM_MAX
        picked = (bm, bn, bk, warps, stages, maxnreg) in PICKED
        no_spill = not local and (not stack or (maxnreg and stack is not None and stack <= CAPPED_STACK_MAX))
        ok = n_tma > 0 and n_wgmma > 0 and (not picked or (fits and no_spill))
        print(
            f"{label}: cp.async.bulk.tensor {n_tma}, wgmma {n_wgmma}, shared {smem} B"
            f"{'' if fits else ' (OVER 227 KiB: cannot launch)'}, regs {regs}, stack {stack} B,"
            f" local {local} B"
            f"{'' if picked else ' [variant]'} -> {'ok' if ok else 'FAILED'}"
        )
        bad += not ok
    for cfg in PICKED:  # for comparison (registers decide how many programs share an SM)
        k = compile_ptr(*cfg)
        regs, stack, local = resources(k.asm["cubin"])
        print(f"pointer kernel {cfg[0]}x{cfg[1]}x{cfg[2]} w{cfg[3]} s{cfg[4]}: shared {k.metadata.shared} B, "
              f"regs {regs}, stack {stack} B, local {local} B")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

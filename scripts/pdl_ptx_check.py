"""Compile the decode kernels' PDL path for sm_90 (no GPU needed) and check its instructions.

With ``PDL=True``: GEMM1 waits for its inputs' producer and then releases GEMM2
(``griddepcontrol.wait``, ``griddepcontrol.launch_dependents``); GEMM2 prefetches its weight rows
(``prefetch.global.L2``), waits and releases the reduction; the reduction waits. With ``PDL=False``
none of these instructions is emitted. Exit status 1 on a mismatch (tests/test_moe.py runs it).

Usage: PYTHONPATH=src python3 scripts/pdl_ptx_check.py [gemm1|gemm2|reduce ...]
"""

from __future__ import annotations

import sys

from sm90_compile import F32, I16, I32, P16, P32, PI, compile_sm90

from replaymoe.moe._kernel_gemm1 import moe_gemm1_kernel
from replaymoe.moe._kernel_gemm2 import moe_gemm2_kernel, moe_reduce_kernel

COMMON = dict(ids_ptr=PI, num_pid_m=I32, H=I16, I=I16, num_slots=I16, expert_offset=I32, num_local=I16,
              stride_we=I16, stride_wn=I16, stride_wk=I32, stride_se=I32, stride_sn=I32, stride_be=I32,
              stride_bn=I32, sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI, w_ptr=P16, ws_ptr=P16,
              b_ptr=P16, inter_ptr=P16, inter_s_ptr=P16)  # fmt: skip
DIRECT = dict(DIRECT=True, FP8=False, HAS_BIAS=False, EVEN_K=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
              GROUP_M=8, DOT_PREC="tf32")  # fmt: skip
CASES = {  # kernel: (function, argument types, constexprs, expected instruction counts with PDL)
    "gemm1": (
        moe_gemm1_kernel,
        dict(COMMON, x_ptr=P16, xs_ptr=P16, h_ptr=P16, TOP_K=I32, alpha=F32, limit=F32, stride_xm=I16,
             stride_im=I16, stride_hm=I16),
        dict(DIRECT, PREQ_X=False, PREQ=False, SAVE_H=False, STORE_ACT=True, INTERLEAVED=False, ACT=0),
        {"griddepcontrol.wait": 1, "griddepcontrol.launch_dependents": 1, "prefetch.global.L2": 0},
    ),
    "gemm2": (
        moe_gemm2_kernel,
        dict(COMMON, y_ptr=P16, wts_ptr=P32, stride_im=I16, stride_ym=I16),
        dict(DIRECT, PREQ=False),
        {"griddepcontrol.wait": 1, "griddepcontrol.launch_dependents": 1, "prefetch.global.L2": 1},
    ),
    "reduce": (
        moe_reduce_kernel,
        dict(y_ptr=P16, ids_ptr=PI, out_ptr=P16, H=I16, TOP_K=I32, expert_offset=I32, num_local=I16,
             stride_ym=I16, stride_om=I16),
        dict(BLOCK_H=1024),
        {"griddepcontrol.wait": 1, "griddepcontrol.launch_dependents": 0, "prefetch.global.L2": 0},
    ),
}  # fmt: skip


def ptx(fn, args: dict, consts: dict) -> str:
    return compile_sm90(fn, args, consts, warps=4, stages=4).asm["ptx"]


def main(kernels: list[str]) -> int:
    bad = 0
    for name in kernels or list(CASES):
        fn, args, consts, want = CASES[name]
        on, off = ptx(fn, args, dict(consts, PDL=True)), ptx(fn, args, dict(consts, PDL=False))
        got = {k: on.count(k) for k in want}
        clean = "griddepcontrol" not in off and "prefetch.global" not in off
        print(f"{name}: PDL=True {got} (want {want}); PDL=False free of them: {clean}")
        bad += got != want or not clean
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Compare the sm_90 PTX of the fused-MoE GEMM kernels on the standard path with a git revision's.

The gpt-oss options (weight strides along K, biases, interleaved gate/up rows, clamped SwiGLU) are
constexprs or Triton-specialized arguments (``stride_wk == 1``); this checks, without a GPU, that the
standard experts (contiguous weights, gate/up halves, no bias, SwiGLU) compile to the same instructions
as before: it compiles both versions for ``GPUTarget("cuda", 90, 32)`` with bf16 / fp8 inputs in the
wrapper's configurations and diffs the instructions (debug locations, parameter loads and register
numbering aside): in order, and as multisets (the backward's SwiGLU kernel now reads the row stride of
its d topk_weights partials from an argument instead of the grid size: 2 instructions fewer, the rest
the same instructions scheduled in another order). Exit status 1 if a kernel has more instructions.

Usage: .venv/bin/python scripts/moe_ptx_diff.py [REV]   (REV default: aa1f5ce, before the options)
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from sm90_compile import F32 as F
from sm90_compile import I16, I32, ONE, P8, P16, P32, PI, compile_sm90

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
import replaymoe._kernels.moe as new  # noqa: E402
import replaymoe._kernels.moe_bwd as new_bwd  # noqa: E402


def _old_modules(rev: str):
    """``rev``'s ``_kernels/moe.py`` and ``_kernels/moe_bwd.py`` as the package ``old_kernels``."""
    pkg = Path(tempfile.mkdtemp()) / "old_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("moe", "moe_bwd"):
        src = subprocess.run(["git", "show", f"{rev}:src/replaymoe/_kernels/{name}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("old_kernels.moe"), importlib.import_module("old_kernels.moe_bwd")


def _ptx(fn, args: dict, consts: dict, warps: int, stages: int) -> list[str]:
    ptx = compile_sm90(fn, args, consts, warps=warps, stages=stages).asm["ptx"]
    body = ptx[ptx.index(".entry") :]
    body = body[: body.index("\n}\n")]
    out = []
    for line in body.split("\n"):
        t = line.strip()
        if not t or t.startswith((".loc", "//", "$L__tmp")) or ".param" in t:
            continue
        out.append(re.sub(r"%(r|rd|p|f|rs|hs|h|fd)\d+", r"%\1", re.sub(r"\s+//.*", "", t)))
    return out


def main(rev: str) -> int:
    old, old_bwd = _old_modules(rev)
    g1 = dict(x_ptr=P16, xs_ptr=P16, w_ptr=P16, ws_ptr=P16, inter_ptr=P16, inter_s_ptr=P16, h_ptr=P16,
              ids_ptr=PI, sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI, num_pid_m=I32, H=I16, I=I16,
              TOP_K=I32, num_slots=I16, expert_offset=I32, num_local=I16, stride_xm=I16, stride_we=I16,
              stride_wn=I16, stride_se=I32, stride_sn=I32, stride_im=I16, stride_hm=I16)  # fmt: skip
    g1_new = dict(g1, b_ptr=P16, alpha=F, limit=F, stride_wk=ONE, stride_be=I32, stride_bn=I32)
    g1_fp8 = dict(x_ptr=P8, w_ptr=P8, xs_ptr=P32, ws_ptr=P32, inter_ptr=P8, inter_s_ptr=P32)
    g2 = dict(inter_ptr=P16, inter_s_ptr=P16, w_ptr=P16, ws_ptr=P16, y_ptr=P16, ids_ptr=PI, wts_ptr=P32,
              sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI, num_pid_m=I32, H=I16, I=I16, num_slots=I16,
              expert_offset=I32, num_local=I16, stride_im=I16, stride_we=I16, stride_wn=I16, stride_se=I32,
              stride_sn=I32, stride_ym=I16)  # fmt: skip
    g2_new = dict(g2, b_ptr=P16, stride_wk=ONE, stride_be=I32, stride_bn=I32)
    base1 = dict(DIRECT=False, FP8=False, PREQ_X=False, PREQ=False, SAVE_H=False, STORE_ACT=True, EVEN_K=True,
                 BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PREC="tf32")  # fmt: skip
    std1 = dict(HAS_BIAS=False, INTERLEAVED=False, ACT=0)
    std2 = dict(HAS_BIAS=False)
    base2 = dict(DIRECT=False, FP8=False, PREQ=False, EVEN_K=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                 GROUP_M=8, DOT_PREC="tf32")  # fmt: skip
    cases = [  # (name, kernel, old args, new args, constexprs, new constexprs, warps, stages)
        ("gemm1 tiles", "moe_gemm1_kernel", g1, g1_new, base1, std1, 8, 4),
        (
            "gemm1 direct",
            "moe_gemm1_kernel",
            g1,
            g1_new,
            dict(base1, DIRECT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128),
            std1,
            4,
            4,
        ),  # fmt: skip
        ("gemm1 training", "moe_gemm1_kernel", g1, g1_new, dict(base1, SAVE_H=True), std1, 8, 4),
        (
            "gemm1 fp8",
            "moe_gemm1_kernel",
            dict(g1, **g1_fp8),
            dict(g1_new, **g1_fp8),
            dict(base1, FP8=True, PREQ_X=True, PREQ=True, BLOCK_M=64, BLOCK_K=128),
            std1,
            8,
            3,
        ),  # fmt: skip
        ("gemm2 tiles", "moe_gemm2_kernel", g2, g2_new, base2, std2, 8, 4),
        (
            "gemm2 direct",
            "moe_gemm2_kernel",
            g2,
            g2_new,
            dict(base2, DIRECT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128),
            std2,
            4,
            4,
        ),  # fmt: skip
    ]
    # the backward's kernels (training; contiguous weights)
    da = dict(dout_ptr=P16, w2_ptr=P16, da_ptr=P16, sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI,
              num_pid_m=I32, H=I16, I=I16, TOP_K=I32, num_slots=I16, stride_dm=I16, stride_w2e=I16,
              stride_w2h=I16, stride_am=I16)  # fmt: skip
    da_new = dict(da, stride_w2i=ONE)
    gemm_cst = dict(EVEN_K=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PREC="tf32")
    sw = dict(dh_ptr=P16, h_ptr=P16, wts_ptr=P32, aw_ptr=P16, dwp_ptr=P32, sorted_ptr=PI, num_tiles_ptr=PI,
              I=I16, num_slots=I16, stride_dhm=I16, stride_hm=I16, stride_awm=I16)  # fmt: skip
    sw_new = dict(sw, alpha=F, limit=F, stride_dwp=I32)
    dx = dict(dh_ptr=P16, w13_ptr=P16, dxs_ptr=P16, sorted_ptr=PI, tile_expert_ptr=PI, num_tiles_ptr=PI,
              num_pid_m=I32, H=I16, I2=I16, num_slots=I16, stride_dhm=I16, stride_we=I16, stride_wn=I16,
              stride_xm=I16)  # fmt: skip
    bwd_cases = [
        ("bwd dA", "moe_bwd_da_kernel", da, da_new, gemm_cst, dict(INTERLEAVED=False), 8, 4),
        (
            "bwd swiglu",
            "moe_bwd_swiglu_kernel",
            sw,
            sw_new,
            dict(TILE_M=128, BLOCK_R=16, BLOCK_N=128),
            dict(INTERLEAVED=False, ACT=0),
            4,
            1,
        ),  # fmt: skip
        ("bwd dX", "moe_bwd_dx_kernel", dx, dict(dx, stride_wk=ONE), dict(gemm_cst, BLOCK_N=256), {}, 8, 4),
    ]
    bad = 0
    for name, kname, a_old, a_new, cst, extra, warps, stages in cases + bwd_cases:
        src_old, src_new = (old, new) if name.startswith("gemm") else (old_bwd, new_bwd)
        a = _ptx(getattr(src_old, kname), a_old, cst, warps, stages)
        b = _ptx(getattr(src_new, kname), a_new, {**cst, **extra}, warps, stages)
        diff = difflib.unified_diff(a, b, lineterm="", n=0)
        diff = [d for d in diff if not d.startswith(("@@", "---", "+++"))]
        ca, cb = Counter(a), Counter(b)
        extra_old, extra_new = sum((ca - cb).values()), sum((cb - ca).values())
        print(f"{name:15s} instructions {rev}: {len(a):5d}  now: {len(b):5d}  lines out of order or changed: "
              f"{len(diff):4d}  only in {rev}: {extra_old:3d}  only now: {extra_new:3d}")  # fmt: skip
        bad += len(b) > len(a)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "aa1f5ce"))

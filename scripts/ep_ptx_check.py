"""Compile the expert-parallel kernels for Hopper (sm_90) without a GPU, with the arguments the CPU tests
launch them with: front-end and ptxas errors (a constexpr reassigned in a ``static_range``, a bad inline
asm) show up here instead of in a device call.

    PYTHONPATH=src python scripts/ep_ptx_check.py [pytest -k expression]

A child process runs ``tests/test_ep_kernels.py`` under Triton's interpreter and records every launch of a
``Launcher`` (the kernel, its ``num_warps`` and each argument's kind or constexpr value); this process then
compiles each distinct launch for sm_90 twice: as recorded, and with the switches the interpreter runs
differently set as on a GPU (:data:`ON_GPU`: acquire polls in inline asm, the barrier's timer, several
sanitizers, ``ROLES`` 0). Exit status 1 if any compile fails. Takes about two minutes on two cores.
``EP_PTX_DIGESTS=FILE`` writes a digest of each launch's PTX, one line each: two trees' files compare a
refactor that should not change the machine code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

ON_GPU = {"PL_ASM": True, "TIMER": True, "Z_SANITIZERS": 16, "ROLES": 0}


def _record(path: str, k_expr: str) -> None:
    """(child, interpreter) Run the EP kernel tests, writing every Launcher launch to ``path``."""
    import pytest
    import torch

    import replaymoe._launch as launch

    kinds = {torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.int8: "i8", torch.int64: "i64",
             torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
    calls = []
    call = launch.Launcher.__call__

    def record(self, grid, args):
        enc = []
        for a in args:
            if isinstance(a, torch.Tensor):
                enc.append(["ptr", kinds[a.dtype]])
            elif isinstance(a, bool) or a is None:
                enc.append(["bool", a])
            elif isinstance(a, int):
                enc.append(["int", a])
            else:
                enc.append(["float", float(a)])
        calls.append({"kernel": self.fn.__name__, "warps": self.num_warps, "args": enc})
        return call(self, grid, args)

    launch.Launcher.__call__ = record
    tests = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "test_ep_kernels.py"
    )
    # (the compile test itself runs this script: deselected, or it would record in a grandchild)
    skip = "not test_ep_kernels_compile_for_sm90"
    argv = ["-q", "-p", "no:cacheprovider", tests, "-k", f"({k_expr}) and {skip}" if k_expr else skip]
    rc = pytest.main(argv)
    with open(path, "w") as f:
        json.dump(calls, f)
    sys.exit(int(rc))


def _digest(ptx: str) -> str:
    """Digest of the PTX's instructions: source locations, comments and debug sections left out (they
    move with every edit of the file)."""
    body = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    keep = [ln for ln in body.splitlines() if not ln.lstrip().startswith((".loc", ".file", "//", "$L__"))]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def _signature(fn, args: list) -> tuple[dict, dict]:
    sig, consts = {}, {}
    for p, (kind, v) in zip(fn.params, args):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif kind == "ptr":
            sig[p.name] = "*" + v
        elif kind == "bool":
            sig[p.name] = "i1"
        elif kind == "int":
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
        else:
            sig[p.name] = "fp32"
    for p in fn.params[len(args) :]:
        sig[p.name], consts[p.name] = "constexpr", p.default
    return sig, consts


def main() -> int:
    k_expr = sys.argv[1] if len(sys.argv) > 1 else ""
    if os.environ.get("_EP_PTX_RECORD"):
        _record(os.environ["_EP_PTX_RECORD"], k_expr)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1", _EP_PTX_RECORD=path)
        rc = subprocess.run([sys.executable, __file__, k_expr], env=env, stdout=subprocess.DEVNULL).returncode
        if rc != 0:  # pytest's status: 1 a test failed, 5 none selected
            print(f"the recording run of tests/test_ep_kernels.py ended with pytest status {rc}")
            return 2
        with open(path) as f:
            calls = json.load(f)
    import triton
    from triton.compiler import ASTSource

    from replaymoe.ep import _kernel_combine, _kernel_pack, _kernel_plan, _kernel_sanitize

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import TARGET

    out = os.environ.get("EP_PTX_DIGESTS")  # a file: one line per distinct launch, its PTX's digest
    modules = (_kernel_plan, _kernel_pack, _kernel_sanitize, _kernel_combine)  # every launched EP kernel
    seen, failed, digests = set(), 0, []
    for c in calls:
        fn = next(getattr(m, c["kernel"]) for m in modules if hasattr(m, c["kernel"]))
        sig, consts = _signature(fn, c["args"])
        for over in ({}, {k: v for k, v in ON_GPU.items() if k in consts}):
            cs = dict(consts, **over)
            key = (c["kernel"], c["warps"], tuple(sorted(sig.items())), tuple(sorted(map(repr, cs.items()))))
            if key in seen:
                continue
            seen.add(key)
            try:
                src = ASTSource(fn, sig, constexprs=cs)
                ptx = triton.compile(src, target=TARGET, options={"num_warps": c["warps"]}).asm["ptx"]
            except Exception as e:  # noqa: BLE001 (every failure is reported, the run goes on)
                failed += 1
                what = over or "as recorded"
                print(f"FAIL {c['kernel']} warps={c['warps']} {what}: {type(e).__name__}: {e}"[:2000])
                continue
            digests.append(f"{_digest(ptx)} {c['kernel']} {len(seen)}")
    if out:
        with open(out, "w") as f:
            f.write("\n".join(digests) + "\n")
    print(f"{len(seen) - failed} of {len(seen)} distinct launches compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile a Triton kernel for Hopper (sm_90) without a GPU: the signature builder shared by the
compile-only check scripts (fwd_tma_ptx_check.py, pdl_ptx_check.py).

Arguments are described by kind, ``(type, divisibility)``: a divisibility of 16 marks the argument as
Triton specializes a pointer or integer divisible by 16 (``tt.divisibility``). :data:`ONE` is an
integer equal to 1, which Triton turns into a constexpr.
"""

from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
P16, PI, P32, P8 = ("*bf16", 16), ("*i32", 16), ("*fp32", 16), ("*fp8e4nv", 16)
I16, I32, F32 = ("i32", 16), ("i32", 0), ("fp32", 0)
ONE = ("i32", 1)


def compile_sm90(fn, args: dict, consts: dict, *, warps: int, stages: int, descs: dict | None = None):
    """``fn`` (a ``@triton.jit`` function) compiled for sm_90.

    ``args``: argument name -> kind; ``consts``: constexpr values (constexprs not named there, and
    absent from ``args``, take their defaults); ``descs``: argument name -> block shape of a bf16
    tensor descriptor passed in that argument's place.
    """
    descs = descs or {}
    sig, constexprs, attrs = {}, {}, {}
    defaults = {p.name: p.default for p in fn.params if p.default is not inspect.Parameter.empty}
    for i, name in enumerate(fn.arg_names):
        if name in descs:
            sig[name] = "tensordesc<bf16[{}, {}]>".format(*descs[name])
        elif name in consts or (name not in args and name in defaults):
            sig[name], constexprs[(i,)] = "constexpr", consts.get(name, defaults.get(name))
        elif args[name] is ONE:
            sig[name], constexprs[(i,)] = "constexpr", 1
        else:
            sig[name] = args[name][0]
            if args[name][1]:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})

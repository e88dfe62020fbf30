"""``replaymoe._launch`` host helpers on the CPU: the host ``cdiv`` / ``next_power_of_2`` equal Triton's,
and the launch memo's argument key separates whatever Triton's binder specializes on."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from replaymoe._launch import _UNKEYED, _arg_key, _call_key, cdiv, next_power_of_2


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 1000, 4096, 4097, 2**31 + 5])  # 0 and 1 are edges
def test_next_power_of_2_is_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@pytest.mark.parametrize("a,b", [(0, 7), (1, 7), (7, 7), (8, 7), (4096, 128), (4097, 128), (2**40 + 1, 3)])
def test_cdiv_is_tritons(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@pytest.mark.parametrize(
    "a,b",
    [
        (1, True),  # equal in Python, specialized differently by Triton
        (1, 1.0),
        (1, 2),  # 1 is a specialization
        (16, 32),  # both divisible by 16, still other values: keyed apart (a superset)
        (None, 0),
        ("tf32", "ieee"),
    ],
)
def test_scalar_keys_differ(a, b):
    assert _arg_key(a) != _arg_key(b)
    assert _arg_key(a) == _arg_key(a)


def test_tensor_keys_are_dtype_and_alignment():
    buf = torch.zeros(64, dtype=torch.float32)
    other = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(buf) == _arg_key(other)  # another tensor, same dtype and alignment: one key
    assert _arg_key(buf[1:]) != _arg_key(buf)  # 4 bytes off: not 16-byte aligned
    assert _arg_key(buf[4:]) == _arg_key(buf)  # 16 bytes off: aligned again
    assert _arg_key(buf.view(torch.int32)) != _arg_key(buf)


def test_descriptor_keys_are_dtype_block_padding_alignment():
    t = torch.zeros(64, 64, dtype=torch.float16)
    d = TensorDescriptor(t, [64, 64], [64, 1], [16, 32])
    assert _arg_key(d) == _arg_key(
        TensorDescriptor(torch.zeros(64, 64, dtype=torch.float16), [64, 64], [64, 1], [16, 32])
    )
    assert _arg_key(d) != _arg_key(TensorDescriptor(t, [64, 64], [64, 1], [32, 32]))  # block
    assert _arg_key(d) != _arg_key(TensorDescriptor(t.float(), [64, 64], [64, 1], [16, 32]))  # dtype
    assert _arg_key(d) != _arg_key(TensorDescriptor(t, [64, 64], [64, 1], [16, 32], padding="nan"))


@pytest.mark.parametrize("arg", [(1, 2), [torch.zeros(2)], object()])  # tuples, lists, anything else
def test_unknown_arguments_are_not_keyed(arg):
    assert _arg_key(arg) is _UNKEYED


def _flat(*args, **kwargs):
    return _call_key(0, args, kwargs)


@pytest.mark.parametrize(
    "a,b",
    [
        ((1,), (True,)),  # equal in Python, specialized differently by Triton
        ((1,), (1.0,)),
        ((16,), (32,)),  # other values: keyed apart (a superset of the binder's == 1 / % 16)
        ((torch.zeros(8),), (torch.zeros(8)[1:],)),  # 16-byte alignment
        ((torch.zeros(8),), (torch.zeros(8, dtype=torch.int32),)),  # dtype
        ((torch.zeros(8), 1), (1, torch.zeros(8))),  # positions
        ((None, 0), (0, None)),
    ],
)
def test_call_keys_separate_what_the_binder_reads(a, b):
    assert _flat(*a) != _flat(*b)
    assert _flat(*a) == _flat(*a)


def test_call_key_reads_keywords_and_parameters():
    t = torch.zeros(8)
    assert _flat(t, n=4) == _flat(torch.ones(8), n=4)  # another tensor, same dtype and alignment
    assert _flat(t, n=4) != _flat(t, m=4)  # the keyword's name counts
    assert _flat(t, 4) != _flat(t, n=4)  # positional and keyword bind differently
    assert _flat(torch.nn.Parameter(t))[3] == _flat(t)[3]  # a parameter is keyed as its tensor
    d = TensorDescriptor(torch.zeros(64, 64, dtype=torch.float16), [64, 64], [64, 1], [16, 32])
    assert _flat(d, 1) == (0, (), (TensorDescriptor, int), (_arg_key(d), 1))  # else: its _arg_key
    assert _flat(d, 1) == _flat(TensorDescriptor(d.base.clone(), [64, 64], [64, 1], [16, 32]), 1)


@pytest.mark.parametrize("arg", [(1, 2), [torch.zeros(2)], object()])
def test_call_key_of_an_unkeyable_argument_is_none(arg):
    assert _flat(torch.zeros(2), arg) is None
    assert _flat(torch.zeros(2), x=arg) is None


def test_the_fast_launch_switch():
    # REPLAYMOE_FAST_LAUNCH=0 turns both launchers off (one constant, replaymoe._launch.ENABLED, from the
    # process default _switches.DEFAULTS.fast_launch read when replaymoe is first imported); the removed
    # REPLAYMOE_EP_FAST_LAUNCH is an error naming its replacement (tests/test_switches.py)
    import os
    import subprocess
    import sys

    code = """
import importlib, os, sys
import replaymoe._switches as switches
import replaymoe._launch as launch
for case in sys.argv[1:]:
    os.environ.pop("REPLAYMOE_FAST_LAUNCH", None)
    os.environ.update(kv.split("=") for kv in case.split(",") if kv)
    importlib.reload(switches)
    importlib.reload(launch)
    print(f"{case}|{launch.ENABLED}")
"""
    cases = {  # environment -> ENABLED
        "": "True",
        "REPLAYMOE_FAST_LAUNCH=0": "False",
        "REPLAYMOE_FAST_LAUNCH=1": "True",
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("REPLAYMOE_")}
    run = subprocess.run(
        [sys.executable, "-c", code, *cases], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert dict(line.split("|", 1) for line in run.stdout.splitlines()) == cases

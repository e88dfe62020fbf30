"""The switches: one module (``replaymoe._switches``) reads the process defaults from the environment,
at most six of them, each documented in docs/DESIGN.md; removed variables fail loudly, unknown ones warn;
importing the package changes nothing in the environment."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from replaymoe._switches import NOT_SWITCHES, REMOVED, Switches, variable

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "replaymoe"
FIELDS = [f.name for f in dataclasses.fields(Switches)]


def test_defaults_and_values():
    assert Switches.from_env({}) == Switches()
    assert Switches() == Switches(fast_launch=True, tma=True, half_tiles=True, pdl=False, ep_fused=True)
    for name in FIELDS:
        for raw, want in (("0", False), ("1", True)):
            got = Switches.from_env({variable(name): raw, "PATH": "/bin"})
            assert got == dataclasses.replace(Switches(), **{name: want})


@pytest.mark.parametrize("raw", ["", "true", "2", " 1", "off", "yes"])
def test_a_value_other_than_0_or_1_is_an_error_naming_the_variable(raw):
    with pytest.raises(ValueError, match="REPLAYMOE_TMA: expected 0 or 1"):
        Switches.from_env({"REPLAYMOE_TMA": raw})


@pytest.mark.parametrize(
    "old, new",
    [
        ("REPLAYMOE_DW_TMA", "REPLAYMOE_TMA"),
        ("REPLAYMOE_BWD_GEMM_TMA", "REPLAYMOE_TMA"),
        ("REPLAYMOE_EP_FUSED_PLAN", "REPLAYMOE_EP_FUSED"),
        ("REPLAYMOE_EP_FUSED_BARRIER", "REPLAYMOE_EP_FUSED"),
        ("REPLAYMOE_EP_FAST_LAUNCH", "REPLAYMOE_FAST_LAUNCH"),
        ("REPLAYMOE_HF_DEVICE_DECODE", "device_decode="),
        ("REPLAYMOE_DEEPEP", "--deepep-dir"),
    ],
)
def test_a_removed_variable_is_an_error_naming_its_replacement(old, new):
    assert old in REMOVED
    for value in ("0", "1"):
        with pytest.raises(ValueError, match=f"{old} was removed: .*{new}"):
            Switches.from_env({old: value})


def test_an_unknown_variable_warns_and_the_peers_folder_does_not():
    with pytest.warns(RuntimeWarning, match="REPLAYMOE_TMAA is not read by replaymoe.*REPLAYMOE_TMA"):
        assert Switches.from_env({"REPLAYMOE_TMAA": "0"}) == Switches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Switches.from_env({"REPLAYMOE_PEERS": ".peers"}) == Switches()
    assert set(NOT_SWITCHES) == {"REPLAYMOE_PEERS"}


def test_at_most_six_switches_each_in_design_and_in_the_docstring():
    assert len(FIELDS) <= 6
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    section = design.split("\n## Switches\n", 1)[1].split("\n## ", 1)[0]
    for name in FIELDS:
        assert f"`{variable(name)}`" in section, name
        assert f"``{variable(name)}``" in (Switches.__doc__ or ""), name
    # the removed names only in the table of what replaced them, never as a live switch
    for old in REMOVED:
        assert old not in section.split("Removed", 1)[0], old


# modules that may touch os.environ / os.getenv, and why: the one switch module; the demo's
# subprocess environment (TRITON_INTERPRET for its child); the EP benchmark's torchrun variables
# (RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK: inputs of init_process_group); the MoE benchmark sets
# REPLAYMOE_PEERS for the external vLLM peer driver it loads (read by that driver, not by replaymoe)
ENV_MODULES = {"_switches.py", "apps/demo.py", "bench/ep.py", "bench/moe.py"}


def test_only_the_switch_module_reads_the_environment():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.add(path.relative_to(PACKAGE).as_posix())
    assert found <= ENV_MODULES, found - ENV_MODULES
    assert "_switches.py" in found


def test_importing_the_package_leaves_the_environment_alone():
    code = """
import importlib, os, sys
before = dict(os.environ)
for m in sys.argv[1:]:
    importlib.import_module(m)
assert dict(os.environ) == before, sorted(set(os.environ.items()) ^ set(before.items()))
print("ok")
"""
    modules = ["replaymoe", "replaymoe._switches", "replaymoe._launch", "replaymoe.routing", "replaymoe.moe",
               "replaymoe.ep", "replaymoe.ep.transport_symm", "replaymoe.bench.ep",
               "replaymoe.bench.routing"]  # fmt: skip
    drop = ("REPLAYMOE_", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    run = subprocess.run(
        [sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"

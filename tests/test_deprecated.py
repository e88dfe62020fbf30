"""The old import paths of the move to one package per op (``routing/``, ``moe/``, the ``ep/`` and
``hf/`` kernels, the record/replay layer in ``record/``) keep working for one release: each shim module
warns (DeprecationWarning naming the new path) and re-exports the same objects as the modules that now
hold the code, including every name the old module exported."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

# old path -> (new modules, the names the old module exported before the move; None: the first new
# module's ``__all__``)
SHIMS = {
    "replaymoe.routing_table": (
        ["replaymoe.routing.methods"],
        [
            "EPS",
            "GRAD_KIND",
            "METHODS",
            "MethodSpec",
            "Params",
            "select_torch",
            "selection_scores",
            "weights_torch",
        ],
    ),  # fmt: skip
    "replaymoe.routing_triton": (
        ["replaymoe.routing._triton"],
        ["CONFIG_OVERRIDE", "route_triton", "weights_backward"],
    ),
    "replaymoe._routing_method": (["replaymoe.routing.methods"], ["RoutingMethod"]),
    "replaymoe.routing_config": (
        ["replaymoe.routing", "replaymoe.routing._checks"],
        ["BIAS_DTYPES", "RoutingConfig", "as_config", "validate_config"],
    ),
    "replaymoe.routing_checks": (
        ["replaymoe.routing._checks"],
        ["check_replay_ids", "compiled_replay_check", "validate"],
    ),
    "replaymoe.moe_triton": (
        ["replaymoe.moe.configs", "replaymoe.moe._forward", "replaymoe.moe._backward"],
        [
            "ExpertsVariant",
            "MoEBwdConfig",
            "MoEConfig",
            "STANDARD",
            "config_from_list",
            "config_tuple",
            "dw_tma_ok",
            "experts_triton",
            "experts_triton_train",
            "launch_bwd",
            "launch_bwd_config",
            "moe_bwd_config",
            "moe_config",
            "tma_ok",
            "FP8_BLOCK_M",
            "TMA_ENABLED",
            "DW_TMA_ENABLED",
            "BWD_GEMM_TMA_ENABLED",
            "HALF_TILES_ENABLED",
            "PDL_ENABLED",
        ],
    ),  # fmt: skip
    # moved unchanged: the old names are the new module's __all__
    "replaymoe.layout": (["replaymoe.moe.layout"], None),
    "replaymoe.quant": (["replaymoe.moe.quant"], None),
    "replaymoe._kernels.routing": (["replaymoe.routing._kernel"], ["route_kernel"]),
    "replaymoe._kernels.routing_grad": (["replaymoe.routing._kernel_grad"], ["route_weights_grad_kernel"]),
    "replaymoe._kernels.moe": (
        ["replaymoe.moe._kernel_fwd"],
        ["moe_gemm1_kernel", "moe_gemm2_kernel", "moe_reduce_kernel", "quant_groups_kernel"],
    ),
    "replaymoe._kernels.moe_bwd": (
        ["replaymoe.moe._kernel_bwd"],
        [
            "moe_bwd_bias_kernel",
            "moe_bwd_da_kernel",
            "moe_bwd_dw_kernel",
            "moe_bwd_dw_tma_kernel",
            "moe_bwd_dx_kernel",
            "moe_bwd_gather_rows_kernel",
            "moe_bwd_swiglu_kernel",
        ],
    ),  # fmt: skip
    "replaymoe._kernels.layout": (
        ["replaymoe.moe._kernel_layout"],
        ["layout_compact_kernel", "layout_hist_kernel", "layout_scatter_kernel"],
    ),
    "replaymoe._kernels.ep": (
        ["replaymoe.ep._kernel"],
        [
            "ep_combine_reduce_kernel",
            "ep_combine_send_kernel",
            "ep_pack_kernel",
            "ep_plan_kernel",
            "ep_sanitize_kernel",
        ],
    ),  # fmt: skip
    "replaymoe._kernels.step_rows": (
        ["replaymoe.hf._kernel_step_rows"],
        ["decode_rows_kernel", "step_rows_kernel"],
    ),
    # the all-to-all's launcher joined the one fast launcher
    "replaymoe.ep._launch": (["replaymoe._launch"], ["ENABLED", "Launcher", "addresses"]),
    # the record/replay layer, moved unchanged into replaymoe.record (the trace package with its modules)
    "replaymoe.capture": (["replaymoe.record.capture"], None),
    "replaymoe.capture_transfer": (["replaymoe.record.transfer"], None),
    "replaymoe.trace": (["replaymoe.record.trace"], None),
    "replaymoe.trace.core": (["replaymoe.record.trace.core"], None),
    "replaymoe.trace.file": (["replaymoe.record.trace.file"], None),
    "replaymoe.trace.wire": (["replaymoe.record.trace.wire"], None),
    "replaymoe.replay": (["replaymoe.record.replay"], None),
    "replaymoe.stats": (["replaymoe.record.stats"], None),
}
# names a shim defines itself, keeping an old result where the new function changed (see the shim)
OWN = {
    "replaymoe.routing_table": {"GRAD_KIND"},
    "replaymoe.routing_checks": {"validate", "compiled_replay_check"},
    "replaymoe.routing_config": {"as_config"},
}


def _fresh_import(name: str):
    """Import ``name`` anew (a shim warns once, when it is first imported)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if child in vars(sys.modules.get(parent, object)):  # the parent's own attribute, never a forwarded one
        delattr(sys.modules[parent], child)
    return importlib.import_module(name)


def _is_submodule(module, name: str) -> bool:
    value = vars(module)[name]
    return isinstance(value, type(sys)) and value.__name__ == f"{module.__name__}.{name}"


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_shim_warns_and_reexports_the_same_objects(old):
    new_names, old_exports = SHIMS[old]
    new = [importlib.import_module(n) for n in new_names]
    if (parent := old.rpartition(".")[0]) in SHIMS:  # a module of an old package: the package warns itself
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(parent)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*import {new_names[0]}"):
        shim = _fresh_import(old)
    own = OWN.get(old, set())
    for name in new[0].__all__ if old_exports is None else old_exports:
        assert hasattr(shim, name), f"{old}.{name} is gone"
    for module in reversed(new):  # an earlier module's name wins
        for name, value in vars(module).items():
            if name.startswith("__") or name in own or any(name in vars(m) for m in new[: new.index(module)]):
                continue
            if hasattr(shim, "__path__") and _is_submodule(module, name):
                continue  # an old package's submodules are old paths (test_an_old_package_keeps_...)
            assert getattr(shim, name) is value, f"{old}.{name} is not {module.__name__}.{name}"


def test_an_old_package_keeps_its_submodules_as_old_paths():
    # replaymoe.trace was a package: replaymoe.trace.core, .file and .wire are deprecated paths too,
    # reached by import or as attributes, and importing one leaves replaymoe.record.trace's own
    # submodules alone; a RoutingTrace pickled before the move (its class at replaymoe.trace.core) loads
    import subprocess

    code = """
import pickle, warnings
import numpy as np
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import replaymoe.trace.core as core
    import replaymoe.trace as trace
    from replaymoe.trace.wire import encode_vllm
    file = trace.file
import replaymoe.record.trace as new
assert trace.core is core and core.__name__ == "replaymoe.trace.core"
assert file.__name__ == "replaymoe.trace.file" and trace.wire.__name__ == "replaymoe.trace.wire"
assert [m.__name__ for m in (new.core, new.file, new.wire)] == [
    "replaymoe.record.trace.core", "replaymoe.record.trace.file", "replaymoe.record.trace.wire"]
assert core.RoutingTrace is trace.RoutingTrace is new.RoutingTrace
assert file.TraceFormatError is trace.TraceFormatError is new.TraceFormatError
assert encode_vllm is new.wire.encode_vllm
assert not hasattr(trace, "missing")
t = new.RoutingTrace(np.array([[[0, 1]], [[2, 3]]], dtype=np.int16), num_experts=4, top_k=2)
old = pickle.dumps(t, protocol=0).replace(b"replaymoe.record.trace.core\\n", b"replaymoe.trace.core\\n")
assert b"replaymoe.trace.core" in old
back = pickle.loads(old)
assert type(back) is new.RoutingTrace and (back.ids == t.ids).all()
print(sorted({str(w.message).split()[0] for w in seen if w.category is DeprecationWarning}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[0] == str([f"replaymoe.trace{s}" for s in ("", ".core", ".file", ".wire")])


def test_a_switch_set_on_a_shim_reaches_the_new_module(monkeypatch):
    # replaymoe.moe_triton.TMA_ENABLED = False was the documented switch: it still turns the TMA off
    import replaymoe.moe.configs as configs

    with pytest.warns(DeprecationWarning):
        mt = _fresh_import("replaymoe.moe_triton")
    for value in (not configs.TMA_ENABLED, configs.TMA_ENABLED):
        monkeypatch.setattr(mt, "TMA_ENABLED", value)
        assert configs.TMA_ENABLED is value and mt.TMA_ENABLED is value
    monkeypatch.undo()
    assert configs.TMA_ENABLED is mt.TMA_ENABLED
    monkeypatch.setattr(configs, "HALF_TILES_ENABLED", not configs.HALF_TILES_ENABLED)
    assert mt.HALF_TILES_ENABLED is configs.HALF_TILES_ENABLED  # read when asked for, never stale


def test_shims_keep_their_old_results():
    import torch

    from replaymoe.routing import RoutingConfig, RoutingMethod
    from replaymoe.routing.methods import METHODS, Params

    with pytest.warns(DeprecationWarning):
        table = _fresh_import("replaymoe.routing_table")
    assert table.GRAD_KIND[METHODS[RoutingMethod.RENORMALIZE].grad] == 1  # the backward kernel's number
    with pytest.warns(DeprecationWarning):
        checks = _fresh_import("replaymoe.routing_checks")
    x = torch.zeros(3, 8)
    p = checks.validate(x, RoutingConfig(2), None, None)
    assert isinstance(p, Params) and p.top_k == 2  # the old validate: Params only
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]]).t().contiguous().t()  # not contiguous
    assert checks.compiled_replay_check(ids, 8).is_contiguous()
    assert checks.compiled_replay_check(None, 8) is None
    with pytest.warns(DeprecationWarning):
        config = _fresh_import("replaymoe.routing_config")
    cfg = RoutingConfig(2)  # as_config, now routing.as_routing: the object, or one built from keywords
    assert config.as_config(cfg, None, None, None, None, None, None) is cfg
    assert config.as_config(None, 2, None, None, None, None, None) == cfg


def test_the_ep_fast_launch_switch_is_a_deprecated_synonym():
    # REPLAYMOE_FAST_LAUNCH=0 turns both launchers off (one attribute, replaymoe._launch.ENABLED); the
    # old REPLAYMOE_EP_FAST_LAUNCH=0 still turns the all-to-all's off (the others too now), and setting
    # it at all warns when replaymoe._launch is imported
    import os
    import subprocess

    code = """
import importlib, os, sys, warnings
import replaymoe._launch as launch
for case in sys.argv[1:]:
    for name in ("REPLAYMOE_FAST_LAUNCH", "REPLAYMOE_EP_FAST_LAUNCH"):
        os.environ.pop(name, None)
    os.environ.update(kv.split("=") for kv in case.split(",") if kv)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        importlib.reload(launch)
    warned = [w for w in seen if "EP_FAST_LAUNCH is deprecated" in str(w.message)]
    assert all(w.category is DeprecationWarning for w in warned)
    print(f"{case}|{launch.ENABLED}|{len(warned)}")
"""
    cases = {  # environment -> (ENABLED, deprecation warnings)
        "": "True|0",
        "REPLAYMOE_FAST_LAUNCH=0": "False|0",
        "REPLAYMOE_FAST_LAUNCH=1": "True|0",
        "REPLAYMOE_EP_FAST_LAUNCH=0": "False|1",
        "REPLAYMOE_EP_FAST_LAUNCH=1": "True|1",
        "REPLAYMOE_FAST_LAUNCH=1,REPLAYMOE_EP_FAST_LAUNCH=0": "False|1",
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.endswith("FAST_LAUNCH")}
    run = subprocess.run(
        [sys.executable, "-c", code, *cases], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert dict(line.split("|", 1) for line in run.stdout.splitlines()) == cases

    from replaymoe import _launch

    with pytest.warns(DeprecationWarning):
        old = _fresh_import("replaymoe.ep._launch")
    assert old.Launcher is _launch.Launcher and old.ENABLED is _launch.ENABLED


def test_nothing_in_the_repository_warns_on_import():
    # the package's own modules import the new paths only (test_structure checks the source too)
    import subprocess

    code = (
        "import warnings; warnings.filterwarnings('error', 'replaymoe.* is deprecated', DeprecationWarning); "
        "import replaymoe, replaymoe.routing, replaymoe.moe, replaymoe.ep, replaymoe.hf, replaymoe.hf.step, "
        "replaymoe.bench.moe, replaymoe.bench.routing, replaymoe.bench.train, replaymoe.apps.cli, "
        "replaymoe.record, replaymoe.record.capture, replaymoe.record.trace, replaymoe.record.replay, "
        "replaymoe.record.stats; "
        "[getattr(m, n) for m in (replaymoe, replaymoe.record) for n in m.__all__]"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

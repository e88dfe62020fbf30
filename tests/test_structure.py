"""The package's shape, checked by parsing its imports (no module is imported).

* no import cycle among the modules of ``src/replaymoe`` (function-local imports included: a
  lazy import hides a cycle from Python, not from the reader);
* one-way layering, kernels ← ops ← record (capture/trace/replay/stats) ← hf ← bench ← apps: no module
  imports from a layer above its own (the CLI in ``apps`` may import the benchmarks' entry points; a
  benchmark never imports ``replaymoe.apps``);
* no source module over ``MAX_LINES`` lines unless its docstring says why (a line starting
  ``Size:``);
* the kernels of an op inside its package: Triton code (``@triton.jit``) lives only in the
  ``_kernel*.py`` modules of its op's package (``routing``, ``moe``, ``ep``, ``hf``);
* the package root holds only its listed modules and packages (``ROOT_FILES``, ``ROOT_PACKAGES``), and
  the old deep import paths, deleted before any release (``REMOVED``: ``replaymoe.moe_triton``,
  ``replaymoe._kernels.*``, ...), stay gone: no module of the package, and no test, script or benchmark
  tool imports one or names one in a string.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "replaymoe"
MAX_LINES = 600
MAX_CLASS_LINES = 400  # a class's lines, docstrings included (issue 61: the 742-line handle)

# layer of a module by its first name below the package; higher layers may import lower ones
LAYERS = {
    # Triton code, the helpers every op uses, the packages' lazy facade (``_lazy``) and the switches'
    # process defaults (``_switches``)
    0: {"_launch", "_validation", "_backend", "_lazy", "_switches"},
    # ops
    1: {
        "routing",
        "moe",
        "ep",
        "testing",
    },
    # record and replay: capture, transfer, trace, replay, stats
    2: {"record"},
    3: {"hf"},
    4: {"bench", "integrations"},  # benchmarks (their entry points are run by the CLI); trainer integrations
    5: {"apps", "__main__"},  # applications: the CLI, demo, inspect
}
# ``replaymoe/__init__.py``: the lazy facade (``__version__``), importable by benchmarks and applications
ROOT_LAYER = 4
# ops that are one package each, their Triton code in ``<op>/_kernel*.py``
OP_PACKAGES = {"routing", "moe", "ep", "hf"}
# what the package root holds: these modules (and the package marker) and these packages, nothing else
ROOT_FILES = {"__init__.py", "__main__.py", "_backend.py", "_launch.py", "_lazy.py", "_validation.py"}
ROOT_FILES |= {"_switches.py", "testing.py", "py.typed"}
ROOT_PACKAGES = {"routing", "moe", "ep", "hf", "record", "integrations", "apps", "bench"}
# the old deep import paths (and their submodules), deleted before any release: see CHANGELOG.md
REMOVED = {
    f"{PACKAGE}.{m}"
    for m in (
        "_deprecated",
        "_routing_method",
        "routing_table",
        "routing_config",
        "routing_checks",
        "routing_triton",
        "moe_triton",
        "layout",
        "quant",
        "_kernels",
        "ep._launch",
        "capture",
        "capture_transfer",
        "trace",
        "replay",
        "stats",
    )
}
# folders outside the package whose Python files must not import a removed path either
OUTSIDE = ("tests", "scripts", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """Modules of the package that one ``from ... import ...`` statement reads."""
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith(PACKAGE):
        return []
    found = []
    for alias in node.names:  # `from pkg import submodule` reads the submodule
        sub = f"{target}.{alias.name}"
        found.append(sub if sub in MODULES else target)
    return found


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            deps.update(_resolve(module, node))
    deps = {d if d in MODULES else d.rsplit(".", 1)[0] for d in deps}
    deps.discard(module)
    return {d for d in deps if d in MODULES}


GRAPH = {m: _imports(m) for m in MODULES}


def _has_kernels(module: str) -> bool:
    """The module defines a ``@triton.jit`` function."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    return True
    return False


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT_LAYER
    for layer, names in LAYERS.items():
        if parts[1] in names:
            return layer
    raise AssertionError(f"{module}: no layer assigned; add its name to LAYERS in {__file__}")


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def _is_package_parent(module: str, dep: str) -> bool:
    """A package's own ``__init__`` importing its submodules (re-exports) is not a cycle."""
    return _is_package(module) and dep.startswith(module + ".")


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_import_cycle():
    # a package __init__ re-exporting its submodules is the one allowed back edge
    global GRAPH
    saved = GRAPH
    GRAPH = {m: {d for d in deps if not _is_package_parent(d, m)} for m, deps in saved.items()}
    try:
        assert _cycles() == []
    finally:
        GRAPH = saved


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    up = sorted(d for d in GRAPH[module] if _layer(d) > _layer(module))
    assert up == [], f"{module} (layer {_layer(module)}) imports from a higher layer: {up}"


def test_bench_never_imports_apps():
    # apps/cli.py runs the benchmarks; a benchmark importing replaymoe.apps would close a cycle
    # (it once imported strip_rest from apps.cli, now in bench/_text.py)
    bench = [m for m in MODULES if m.startswith(f"{PACKAGE}.bench")]
    assert bench
    bad = {m: sorted(d for d in GRAPH[m] if d.startswith(f"{PACKAGE}.apps")) for m in bench}
    assert {m: d for m, d in bad.items() if d} == {}
    assert _layer(f"{PACKAGE}.bench.ep") < _layer(f"{PACKAGE}.apps.cli")


def test_record_sits_between_the_ops_and_hf():
    # record (capture, transfer, trace, replay, stats) is one layer: above the shared helpers and the
    # ops (routing, moe, ep), below hf, the integrations, the benchmarks and the applications, none of
    # which any of its modules imports
    record = [m for m in MODULES if m.split(".")[1:2] == ["record"]]
    moved = ("capture", "transfer", "trace", "trace.core", "trace.file", "trace.wire", "replay", "stats")
    assert {f"{PACKAGE}.record.{m}" for m in moved} <= set(record)
    assert all(_layer(m) == _layer(f"{PACKAGE}.record") for m in record)
    for below in ("_validation", "routing", "moe", "ep"):
        assert _layer(f"{PACKAGE}.{below}") < _layer(f"{PACKAGE}.record"), below
    above = {"hf", "integrations", "bench", "apps"}
    for name in above:
        assert _layer(f"{PACKAGE}.record") < _layer(f"{PACKAGE}.{name}"), name
    up = {m: sorted(d for d in GRAPH[m] if d.split(".")[1] in above) for m in record}
    assert {m: d for m, d in up.items() if d} == {}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert any(line.strip().startswith("Size:") for line in doc.splitlines()), (
        f"{path.relative_to(SRC)} has {lines} lines (> {MAX_LINES}) and no 'Size:' reason in its docstring"
    )


def _class_sizes(source: str) -> dict[str, int]:
    """Every class of ``source`` (nested ones too) by name: its lines, decorators aside."""
    return {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.end_lineno is not None
    }


@pytest.mark.parametrize("module", sorted(MODULES))
def test_class_size(module):
    # a class past the limit is split by role: a collaborator, or a mixin in a module of its own
    # (RoutingTrace's engine formats, ReplayTable's coverage counters)
    big = {c: n for c, n in _class_sizes(MODULES[module].read_text()).items() if n > MAX_CLASS_LINES}
    assert big == {}, f"{module}: classes over {MAX_CLASS_LINES} lines: {big}"


def test_class_size_checker_counts_a_whole_class():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))  # the class line makes it 401
    sizes = _class_sizes(f"class Big:\n{body}\nclass Small:\n    pass\n")
    assert sizes == {"Big": MAX_CLASS_LINES + 1, "Small": 2}


def test_checker_sees_a_cycle_and_an_upward_import():
    # the checker itself: a made-up graph with a cycle and an ops module importing hf
    global GRAPH
    saved = GRAPH
    GRAPH = {"replaymoe.a": {"replaymoe.b"}, "replaymoe.b": {"replaymoe.a"}, "replaymoe.c": set()}
    try:
        assert _cycles() == [["replaymoe.a", "replaymoe.b"]]
    finally:
        GRAPH = saved
    assert _layer("replaymoe.routing") < _layer("replaymoe.hf.session")


def test_the_root_holds_only_the_listed_modules_and_packages():
    root = SRC / PACKAGE
    entries = {p.name for p in root.iterdir() if p.name != "__pycache__"}
    assert entries == ROOT_FILES | ROOT_PACKAGES, (
        f"unexpected: {sorted(entries - ROOT_FILES - ROOT_PACKAGES)}, "
        f"missing: {sorted((ROOT_FILES | ROOT_PACKAGES) - entries)}"
    )
    assert all((root / p / "__init__.py").is_file() for p in ROOT_PACKAGES)
    removed = {m for m in MODULES if _is_removed(m)}
    assert removed == set(), f"a removed path is back: {sorted(removed)}"


def test_the_kernels_of_an_op_live_in_its_package():
    placed = {}
    for m in MODULES:
        if not _has_kernels(m):
            continue
        parts = m.split(".")
        # an op's kernels in its package; the benchmarks' measurement kernels (not ops) in bench/_kernel*
        home = parts[1] in OP_PACKAGES or parts[1] == "bench"
        placed[m] = len(parts) == 3 and home and parts[-1].startswith("_kernel")
    assert {m for m, ok in placed.items() if not ok} == set()
    for op in OP_PACKAGES:  # every op package has its kernels inside it
        assert any(m.startswith(f"{PACKAGE}.{op}._kernel") for m in placed), op


def _is_removed(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in REMOVED)


def _named_paths(path: Path, module: str | None = None) -> set[str]:
    """The dotted ``replaymoe`` paths a file names: what it imports (``from pkg import sub`` counted as
    ``pkg.sub`` too; relative imports resolved for ``module``, a module of the package) and its string
    constants that start with the package's name (``monkeypatch.setattr("replaymoe.x.Y", ...)``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if module is None:
                    continue
                base = module.split(".") if _is_package(module) else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return {m for m in found if m.startswith(f"{PACKAGE}.")}


def test_nothing_names_a_removed_path():
    outside = [
        p for d in OUTSIDE for p in sorted((SRC.parent / d).rglob("*.py"))
    ]  # listed now, not at import
    assert outside
    users = {}
    for module, path in MODULES.items():
        if bad := sorted(m for m in _named_paths(path, module) if _is_removed(m)):
            users[str(path.relative_to(SRC))] = bad
    for path in outside:
        if path == Path(__file__).resolve():  # REMOVED above lists them
            continue
        if bad := sorted(m for m in _named_paths(path) if _is_removed(m)):
            users[str(path.relative_to(SRC.parent))] = bad
    assert users == {}, f"files naming a removed path: {users}"


def test_the_removed_path_checker_sees_old_paths_only():
    for old in (
        "replaymoe.moe_triton",
        "replaymoe._kernels.moe",
        "replaymoe.trace.core",
        "replaymoe.ep._launch",
    ):
        assert _is_removed(old), old
    for new in (
        "replaymoe.moe.configs",
        "replaymoe.record.trace.core",
        "replaymoe._launch",
        "replaymoe.moe.layout",
    ):
        assert not _is_removed(new), new


@pytest.mark.parametrize(
    "module",
    [
        "replaymoe.record.capture",
        "replaymoe.record.trace",
        "replaymoe.record.replay",
        "replaymoe.record.stats",
    ],
)
def test_record_imports_without_triton(module):
    # triton is a Linux-only dependency: elsewhere the capturer, traces, replay sources and stats work
    import subprocess
    import sys

    code = f"import sys; sys.modules['triton'] = None; sys.path.insert(0, {str(SRC)!r}); import {module}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# private names stay private: no module reads another object's ``_name`` (issue 61)
# ---------------------------------------------------------------------------------------------------------
# ``x._name`` is allowed where ``x`` is ``self`` / ``cls``; where ``x`` comes from a library the module
# imports (``torch._C``, ``torch.cuda._sleep``, ``GptOssExperts._apply_gate``: its internals, not ours);
# inside a class that defines ``_name`` itself (its own private name, read off another instance:
# ``other._meta()`` in ``RoutingTrace.__eq__``); and for these names of other libraries' objects, which no
# class of ours defines:
FOREIGN_PRIVATE = {
    "_version": "torch.Tensor's version counter (routing's replay-id checks)",
    "_parameters": "torch.nn.Module's registries (hf.graphs walks a block's tensors and hooks)",
    "_buffers": "torch.nn.Module",
    "_modules": "torch.nn.Module",
    "_forward_hooks": "torch.nn.Module",
    "_forward_pre_hooks": "torch.nn.Module",
    "_backward_hooks": "torch.nn.Module",
    "_backward_pre_hooks": "torch.nn.Module",
    "_replace": "namedtuple's public API (underscored so as not to clash with field names)",
    "_apply_gate": "transformers' experts classes (hf.experts recognizes GptOss's gate)",
    "_experts_implementation": "transformers' PretrainedConfig (hf._patching restores it)",
    "_gradient_checkpointing_func": "transformers' layers (hf.recompute wraps it)",
    "_prepare_static_cache": "transformers' GenerationMixin (hf.static_cache replaces it)",
    "_previous_max_cache_length": "transformers' GenerationMixin (hf.static_cache)",
    "_use_prefix_sharing": "transformers' ContinuousBatchingManager (hf._paged turns prefix sharing off)",
    "_replaymoe_patch": "our marker on the aux-loss function hf.aux_loss builds (a function, no class)",
}
# reads of our own classes' private names that are known and left for now, as (file under src/replaymoe,
# the expression), each with its reason
KNOWN_PRIVATE_READS: set[tuple[str, str]] = set()


def _external_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing from outside the package (anywhere in it, lazy imports too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            outside = [a for a in node.names if not a.name.startswith(PACKAGE)]
            names.update((a.asname or a.name).split(".")[0] for a in outside)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if not (node.module or "").startswith(PACKAGE):
                names.update(a.asname or a.name for a in node.names)
    return names


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods and class attributes, and what it assigns to ``self.``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    for node in cls.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _root(node: ast.expr) -> ast.expr:
    """Where an attribute chain starts (``torch`` of ``torch.cuda._sleep``, ``a`` of ``a.b[0]._c``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_reads(path: Path, module: str, rel: str) -> list[str]:
    """``rel:line: expression`` for every access (read, write or delete) of another object's private
    attribute in ``path`` (the source of ``module``), and for every private name it imports from another
    module of the package (a private module is fine: ``from .. import _switches``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    external = _external_names(tree)
    found = []

    def visit(node: ast.AST, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | _own_names(node)
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base, root, text = node.value, _root(node.value), ast.unparse(node)
            allowed = (
                (isinstance(base, ast.Name) and base.id in ("self", "cls"))
                or (isinstance(root, ast.Name) and root.id in external)
                or node.attr in own
                or node.attr in FOREIGN_PRIVATE
                or (rel, text) in KNOWN_PRIVATE_READS
            )
            if not allowed:
                found.append(f"{rel}:{node.lineno}: {text}")
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
            for alias, target in zip(node.names, _resolve(module, node)):
                if _is_private(alias.name) and not target.endswith("." + alias.name):  # a name, no module
                    found.append(f"{rel}:{node.lineno}: from {target} import {alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, set())
    return found


def test_no_module_reads_another_objects_private_names():
    found = []
    for module, path in MODULES.items():
        found += _private_reads(path, module, str(path.relative_to(SRC / PACKAGE)))
    assert found == [], "private names read across objects or modules:\n" + "\n".join(found)


def test_the_private_name_checker_sees_cross_object_reads(tmp_path):
    # the checker itself, on a made-up module of the ep package: what it flags and what it lets through
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\n"
        "from .. import _switches\n"  # a private module of the package: fine
        "from .partition import _helper\n"  # a private name of another module: flagged
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._x = 1\n"
        "    def same(self, other):\n"  # its own private name off another instance: fine
        "        return other._x + self._x + torch._C.y + torch.cuda._sleep + _switches.DEFAULTS\n"
        "def reach(a2a, t):\n"
        "    a2a.core.phase = a2a._phase + a2a.core._cache[0] + t._version\n"
        "    a2a._x = 0\n"  # a write counts too (Own's _x is no licence outside Own)
    )
    found = _private_reads(probe, f"{PACKAGE}.ep.probe", "ep/probe.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        f"from {PACKAGE}.ep.partition import _helper",
        "a2a._phase",
        "a2a.core._cache",
        "a2a._x",
    ], found


def test_custom_ops_pass_mutated_arguments_without_defaults():
    # the dispatcher hands a Python kernel its trailing arguments that equal their schema defaults as
    # missing; torch 2.11's custom ops then index a mutated argument past the end of the call's
    # arguments (IndexError under torch.compile, seen on the GPU machine's torch): no mutated argument
    # of a replaymoe op may have a default, or come after one that has
    import torch

    import replaymoe.moe  # noqa: F401  (registers the ops)
    import replaymoe.routing  # noqa: F401

    ops = [
        getattr(torch.ops.replaymoe, name) for name in dir(torch.ops.replaymoe) if not name.startswith("_")
    ]
    schemas = [op.default._schema for op in ops if hasattr(op, "default")]
    assert any(s.name == "replaymoe::route" for s in schemas)
    for schema in schemas:
        seen_default = False
        for arg in schema.arguments:
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if mutated:
                assert not seen_default and not arg.has_default_value(), f"{schema.name}: {arg.name}"
            seen_default = seen_default or arg.has_default_value()


BENCH = SRC.parent / "bench"


def test_bench_results_are_one_current_table_each():
    # bench/results holds the current tables only (history stays in git): at most 15 files, each listed
    # in bench/README.md's table of current tables, and the notes one README of at most 40 KB
    files = sorted(p.name for p in (BENCH / "results").iterdir() if p.is_file())
    readme = (BENCH / "README.md").read_text()
    assert len(files) <= 15, files
    assert [f for f in files if f"| `{f}` |" not in readme] == []
    assert len(readme.encode()) <= 40_000
    assert sorted(p.name for p in BENCH.iterdir() if p.suffix == ".md") == ["README.md"]

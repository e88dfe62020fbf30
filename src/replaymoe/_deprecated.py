"""Old import paths kept for one release after the move to one package per op (``routing/``, ``moe/``).

Each old module (``replaymoe.moe_triton``, ``replaymoe.routing_table``, ``replaymoe._kernels.moe``, ...)
is a shim that calls :func:`alias`: from then on each name it does not define itself is an attribute
of the module that now holds the code, read when asked for (the same object, never stale) and written
there (``replaymoe.moe_triton.TMA_ENABLED = False`` still switches the forward's TMA off; monkeypatching
a shim patches the new module and undoes cleanly); importing a shim emits a ``DeprecationWarning`` naming
the new path. An old package (``replaymoe.trace``) is a shim too, and so is each of its submodules
(``replaymoe.trace.core``): its submodule names are those old paths, imported when first asked for,
never forwarded (importing ``replaymoe.trace.core`` must not rebind ``replaymoe.record.trace.core``).
Nothing in the package imports a shim (``tests/test_structure.py`` checks it);
``tests/test_deprecated.py`` checks each one.
"""

from __future__ import annotations
import __future__

import importlib
import sys
import warnings
from types import ModuleType

__all__ = ["alias"]

_NOT_NAMES = (ModuleType, __future__._Feature)  # imported modules and `from __future__` features


def _forward(name: str, owner: ModuleType) -> property:
    """The attribute ``name`` of ``owner``, as a property of the shim's module type."""

    def get(_shim):
        return getattr(owner, name)

    def set_(_shim, value):
        setattr(owner, name, value)

    def delete(_shim):
        delattr(owner, name)

    return property(get, set_, delete)


def _is_submodule(module: ModuleType, name: str) -> bool:
    value = vars(module)[name]
    return isinstance(value, ModuleType) and value.__name__ == f"{module.__name__}.{name}"


def _submodule_getter(package: str, submodules: set[str]):
    """The old package's module ``__getattr__``: a submodule name imports the old submodule (a shim)."""

    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def alias(namespace: dict, *modules: ModuleType) -> None:
    """Make the shim module whose ``globals()`` is ``namespace`` an alias of ``modules`` (an earlier
    module's name wins; names the shim has defined before the call stay its own) and warn, at the
    importer's line, that the shim's path is deprecated."""
    own = set(namespace)
    owners: dict[str, ModuleType] = {}
    for module in reversed(modules):
        owners.update({k: module for k in vars(module) if not k.startswith("__") and k not in own})
    names = sorted(own | set(owners))
    if "__path__" in namespace:  # an old package: its submodules are old paths, shims of their own
        submodules = {k for k, m in owners.items() if _is_submodule(m, k)}
        for k in submodules:
            del owners[k]
        namespace["__getattr__"] = _submodule_getter(namespace["__name__"], submodules)
    attrs = {k: _forward(k, m) for k, m in owners.items()}
    attrs["__dir__"] = lambda _shim: names
    sys.modules[namespace["__name__"]].__class__ = type("DeprecatedModule", (ModuleType,), attrs)
    exported: list[str] = []
    for module in modules:  # its __all__, or (as a star import would take) its public names
        public = [
            k for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, _NOT_NAMES)
        ]
        exported += [n for n in getattr(module, "__all__", public) if n not in exported]
    namespace.setdefault("__all__", exported)
    new = " and ".join(m.__name__ for m in modules)
    warnings.warn(
        f"{namespace['__name__']} is deprecated and will be removed in the next release; import {new}",
        DeprecationWarning,
        stacklevel=3,  # the importer's line (Python skips importlib's frames)
    )

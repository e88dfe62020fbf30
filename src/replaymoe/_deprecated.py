"""Old import paths kept for one release after the move to one package per op (``routing/``, ``moe/``).

Each old module (``replaymoe.moe_triton``, ``replaymoe.routing_table``, ``replaymoe._kernels.moe``, ...)
is a shim that calls :func:`alias`: it re-exports every name of the module(s) that now hold its code
(the same objects) and emits a ``DeprecationWarning`` naming the new path. Nothing in the package
imports a shim (``tests/test_structure.py`` checks it); ``tests/test_deprecated.py`` checks that each
one warns and re-exports. Setting an attribute on a shim changes nothing: patch the new module.
"""

from __future__ import annotations

import warnings
from types import ModuleType

__all__ = ["alias"]


def alias(namespace: dict, *modules: ModuleType) -> None:
    """Fill the shim module whose ``globals()`` is ``namespace`` with every name of ``modules`` (an
    earlier module's name wins) and warn, at the importer's line, that the shim's path is deprecated."""
    exported: list[str] = []
    for module in reversed(modules):
        namespace.update(
            {k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))}
        )
    for module in modules:
        exported += [n for n in getattr(module, "__all__", ()) if n not in exported]
    namespace["__all__"] = exported
    new = " and ".join(m.__name__ for m in modules)
    warnings.warn(
        f"{namespace['__name__']} is deprecated and will be removed in the next release; import {new}",
        DeprecationWarning,
        stacklevel=3,  # the importer's line (Python skips importlib's frames)
    )

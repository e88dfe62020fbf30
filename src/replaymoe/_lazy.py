"""The lazy facade of a package: its public names resolved on first use (``replaymoe``,
``replaymoe.record``), so that importing it imports none of its submodules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``exports`` (public name -> submodule
    below ``package``) is read from its submodule on first use and kept in ``namespace`` (the
    package's ``globals()``), so the next read skips this hook; any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__

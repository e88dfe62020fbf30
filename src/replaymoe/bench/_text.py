"""Plain text for the benchmarks' ``--help`` (shared with :mod:`replaymoe.apps.cli`).

It lives in the bench package because the benchmarks need it and never import :mod:`replaymoe.apps`
(apps may import bench's entry points, not the reverse; ``tests/test_structure.py`` enforces it).
"""

from __future__ import annotations

import re

__all__ = ["strip_rest"]


def strip_rest(text: str) -> str:
    """Plain text from the reStructuredText of a docstring (for ``--help``).

    ``:func:`~a.b``` -> ``b``, ``:class:`a.B``` -> ``a.B``, double and single backquotes dropped,
    ``\\ `` escapes removed, a paragraph-ending ``::`` shortened to ``:``, directive lines dropped.
    """
    text = re.sub(r":[a-z]+:`~[\w.]*?(\w+)`", r"\1", text)  # :func:`~mod.name` -> name
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)  # :class:`mod.Name` -> mod.Name
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"(?<![\w`])`([^`\n]+)`(?:_)?", r"\1", text)
    text = text.replace("\\ ", "")
    text = re.sub(r"\s*::$", ":", text, flags=re.M)  # "Run it::" -> "Run it:"
    text = re.sub(r"^\s*\.\. [\w-]+::.*\n", "", text, flags=re.M)
    return text

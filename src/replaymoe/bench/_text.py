"""Plain text for the benchmarks' command lines: ``--help`` (shared with :mod:`replaymoe.apps.cli`) and
the comma-list options.

It lives in the bench package because the benchmarks need it and never import :mod:`replaymoe.apps`
(apps may import bench's entry points, not the reverse; ``tests/test_structure.py`` enforces it).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable

__all__ = ["choice_list", "strip_rest"]


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


def choice_list(parser: argparse.ArgumentParser, text: str, allowed: Iterable[str], what: str) -> list[str]:
    """The items of the comma list ``text`` (empty items dropped); ``parser.error`` (exit 2) naming the
    ones not in ``allowed``: ``unknown {what} [...]; choose from [...]``."""
    allowed = list(allowed)
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in allowed]
    if bad:
        parser.error(f"unknown {what} {bad}; choose from {allowed}")
    return items

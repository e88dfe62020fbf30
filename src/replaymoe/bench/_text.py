"""Plain text for the benchmarks' command lines: ``--help`` (shared with :mod:`replaymoe.apps.cli`),
the comma-list options, and the ``error:`` line of a failed file write or read (:func:`os_error_text`).

It lives in the bench package because the benchmarks need it and never import :mod:`replaymoe.apps`
(apps may import bench's entry points, not the reverse; ``tests/test_structure.py`` enforces it).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable

__all__ = ["choice_list", "os_error_text", "strip_rest"]


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


def os_error_text(exc: OSError, path: str | os.PathLike | None = None, *, action: str = "write") -> str:
    """One line for a command's ``error:`` message: ``cannot {action} {file}: {reason}``.

    ``file`` is ``path`` (the file the command was writing or reading, as the user named it) or else
    the error's own file name; a failed ``write()`` (``No space left on device``) carries none, which
    is why the caller names it. ``reason`` is the system's words (``strerror``).
    """
    name = path if path is not None else exc.filename
    reason = exc.strerror or str(exc) or type(exc).__name__
    if name is None or name == "":
        return f"cannot {action}: {reason}"
    return f"cannot {action} {os.fsdecode(name)}: {reason}"

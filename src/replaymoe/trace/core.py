"""Deprecated: moved to :mod:`replaymoe.record.trace.core` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record.trace import core

alias(globals(), core)

"""Deprecated: moved to :mod:`replaymoe.record.trace.file` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record.trace import file

alias(globals(), file)

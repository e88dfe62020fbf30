"""Deprecated: moved to :mod:`replaymoe.record.replay` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record import replay

alias(globals(), replay)

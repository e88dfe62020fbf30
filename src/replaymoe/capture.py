"""Deprecated: moved to :mod:`replaymoe.record.capture` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record import capture

alias(globals(), capture)

"""Deprecated: moved to :mod:`replaymoe.record.transfer` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record import transfer

alias(globals(), transfer)

"""Deprecated: moved to :mod:`replaymoe.record.stats` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record import stats

alias(globals(), stats)

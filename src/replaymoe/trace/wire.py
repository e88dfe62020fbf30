"""Deprecated: moved to :mod:`replaymoe.record.trace.wire` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.record.trace import wire

alias(globals(), wire)

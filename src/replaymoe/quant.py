"""Deprecated: moved to :mod:`replaymoe.moe.quant` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.moe import quant

alias(globals(), quant)

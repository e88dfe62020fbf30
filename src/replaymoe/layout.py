"""Deprecated: moved to :mod:`replaymoe.moe.layout` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.moe import layout

alias(globals(), layout)

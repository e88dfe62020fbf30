"""Deprecated: moved to :mod:`replaymoe.routing._triton` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.routing import _triton

alias(globals(), _triton)

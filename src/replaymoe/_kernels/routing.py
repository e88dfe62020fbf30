"""Deprecated: moved to :mod:`replaymoe.routing._kernel` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.routing import _kernel

alias(globals(), _kernel)

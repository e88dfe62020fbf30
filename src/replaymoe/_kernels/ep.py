"""Deprecated: moved to :mod:`replaymoe.ep._kernel` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.ep import _kernel

alias(globals(), _kernel)

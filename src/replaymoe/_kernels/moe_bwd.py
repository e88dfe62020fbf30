"""Deprecated: moved to :mod:`replaymoe.moe._kernel_bwd` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.moe import _kernel_bwd

alias(globals(), _kernel_bwd)

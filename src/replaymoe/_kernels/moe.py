"""Deprecated: moved to :mod:`replaymoe.moe._kernel_fwd` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.moe import _kernel_fwd

alias(globals(), _kernel_fwd)

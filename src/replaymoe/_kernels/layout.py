"""Deprecated: moved to :mod:`replaymoe.moe._kernel_layout` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.moe import _kernel_layout

alias(globals(), _kernel_layout)

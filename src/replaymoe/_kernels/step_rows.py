"""Deprecated: moved to :mod:`replaymoe.hf._kernel_step_rows` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.hf import _kernel_step_rows

alias(globals(), _kernel_step_rows)

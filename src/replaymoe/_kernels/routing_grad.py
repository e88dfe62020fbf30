"""Deprecated: moved to :mod:`replaymoe.routing._kernel_grad` (this alias is kept for one release)."""

from replaymoe._deprecated import alias
from replaymoe.routing import _kernel_grad

alias(globals(), _kernel_grad)

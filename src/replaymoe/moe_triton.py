"""Deprecated: moved to :mod:`replaymoe.moe.configs` (configurations, switches), :mod:`replaymoe.moe._forward`
and :mod:`replaymoe.moe._backward`. Patch those modules: setting a switch here changes nothing.

This alias is kept for one release.
"""

from replaymoe._deprecated import alias
from replaymoe.moe import _backward, _forward, configs

alias(globals(), configs, _forward, _backward)

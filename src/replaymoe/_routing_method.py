"""Deprecated: moved to :mod:`replaymoe.routing.methods` (``RoutingMethod``; also :mod:`replaymoe.routing`).

This alias is kept for one release.
"""

from replaymoe._deprecated import alias
from replaymoe.routing import methods

alias(globals(), methods)

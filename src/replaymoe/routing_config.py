"""Deprecated: moved to :mod:`replaymoe.routing` (``RoutingConfig``; ``as_config`` is now
``as_routing``) and :mod:`replaymoe.routing._checks` (``validate_config``, ``BIAS_DTYPES``).

This alias is kept for one release.
"""

import replaymoe.routing as routing
from replaymoe._deprecated import alias
from replaymoe.routing import _checks

as_config = routing.as_routing  # its old name (the first argument was called config)

alias(globals(), routing, _checks)

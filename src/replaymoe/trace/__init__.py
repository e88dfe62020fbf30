"""Deprecated: moved to :mod:`replaymoe.record.trace` (this alias is kept for one release).

Its submodules ``core``, ``file`` and ``wire`` are deprecated aliases too (of
:mod:`replaymoe.record.trace.core`, ``.file`` and ``.wire``), imported when first asked for.
"""

from replaymoe._deprecated import alias
from replaymoe.record import trace

alias(globals(), trace)

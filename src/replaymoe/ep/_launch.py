"""Deprecated: moved to :mod:`replaymoe._launch`, the one fast launcher (an alias kept for one release)."""

from replaymoe import _launch
from replaymoe._deprecated import alias

alias(globals(), _launch)

"""Deprecated: moved to :mod:`replaymoe.routing._checks` (this alias is kept for one release).

``validate`` and ``compiled_replay_check`` keep their old results here: ``_checks.validate`` now
also returns the replay ids as the kernels read them (what ``compiled_replay_check`` did).
"""

from replaymoe._deprecated import alias
from replaymoe.routing import _checks

__all__ = [*_checks.__all__, "compiled_replay_check"]


def validate(router_logits, config, routing_replay_out, replay_ids, check_replay=True):
    """The old ``validate``: :func:`replaymoe.routing._checks.validate`'s ``Params`` only."""
    return _checks.validate(router_logits, config, routing_replay_out, replay_ids, check_replay)[0]


def compiled_replay_check(replay_ids, num_experts, check=True):
    """Replay ids as the kernels read them (None stays None)."""
    return None if replay_ids is None else _checks._replay_ids_for_kernels(replay_ids, num_experts, check)


alias(globals(), _checks)

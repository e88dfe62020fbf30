"""Validation of :func:`replaymoe.routing.route`'s arguments, and the replay-id check.

:func:`validate` checks the logits and the other per-call arguments at the public boundary
(cheap predicates first: it runs on every eager call) against an already validated
:class:`~replaymoe.routing.config.RoutingConfig`, and returns the normalised
:class:`~replaymoe.routing.methods.Params`. Replay ids
are checked by value where that needs a host sync: eagerly here, and under ``torch.compile`` through
the custom op ``replaymoe::check_replay_ids``, skipped while a CUDA graph is being captured.
"""

from __future__ import annotations

from typing import Optional

import torch

from replaymoe._validation import check_int, check_tensor, fail, is_capturing, tensor_ok
from replaymoe.routing.config import BIAS_DTYPES, RoutingConfig
from replaymoe.routing.methods import Params

__all__ = ["check_replay_ids", "compiled_replay_check", "validate"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int16, torch.int32, torch.int64)


def validate(
    router_logits: object,
    config: RoutingConfig,
    routing_replay_out: object,
    replay_ids: object,
    check_replay: bool = True,
) -> Params:
    """The per-call checks of ``route``: the logits, and ``config`` against their number of experts."""
    # fast predicates first (host cost matters at decode sizes); check_tensor builds the error
    x = router_logits
    if not tensor_ok(x, 2, _LOGIT_DTYPES, None, False):
        check_tensor("router_logits", router_logits, ndim=2, dtype=_LOGIT_DTYPES)
    if x.shape[1] > 1 and x.stride(1) != 1:
        fail(
            "router_logits",
            "a tensor with unit stride along experts (dim 1)",
            f"strides {tuple(x.stride())}",
            what="layout",
        )
    num_tokens, num_experts = x.shape
    if num_experts < 1:
        fail("router_logits", "at least one expert (shape[1] >= 1)", tuple(x.shape), what="shape")
    dev = x.device
    top_k, bias, ng, tg = config.top_k, config.bias, config.num_groups, config.groups_kept
    if top_k > num_experts:
        check_int("top_k", top_k, low=1, high=num_experts)
    if bias is not None and not (bias.device == dev and bias.shape[0] == num_experts):
        check_tensor("bias", bias, shape=(num_experts,), dtype=BIAS_DTYPES, device=dev, contiguous=True)
    if ng > 1 or config.n_group is not None:
        if num_experts % ng != 0:
            fail("n_group", f"a divisor of the number of experts {num_experts}", ng)
        if top_k > tg * (num_experts // ng):
            fail(
                "top_k",
                f"at most topk_group * E / n_group = {tg * (num_experts // ng)} "
                "(the experts left after group masking)",
                top_k,
            )

    if routing_replay_out is not None:
        r = routing_replay_out
        if not tensor_ok(r, 2, (torch.int16,), dev, True):
            check_tensor(
                "routing_replay_out",
                routing_replay_out,
                ndim=2,
                dtype=torch.int16,
                device=dev,
                contiguous=True,
            )
        if r.shape[1] != top_k:
            fail("routing_replay_out", f"shape (>= {num_tokens}, {top_k})", tuple(r.shape), what="shape")
        if r.shape[0] < num_tokens:
            fail(
                "routing_replay_out",
                f"shape (>= {num_tokens}, {top_k}) (at least T rows)",
                tuple(r.shape),
                what="shape",
            )
        if num_experts > 32768:
            fail("routing_replay_out", "E <= 32768 experts (ids are stored as int16)", num_experts)

    if replay_ids is not None:
        if not (
            tensor_ok(replay_ids, 2, _ID_DTYPES, dev, False)  # any strides: copied when needed
            and tuple(replay_ids.shape) == (num_tokens, top_k)
        ):
            check_tensor("replay_ids", replay_ids, shape=(num_tokens, top_k), dtype=_ID_DTYPES, device=dev)
        if check_replay and not is_capturing() and not torch.compiler.is_compiling():
            _check_replay_values(replay_ids, num_experts)
        # under torch.compile the check runs inside the graph, in the op from _compiled_replay_check

    return Params(config.method, top_k, ng, tg, config.scale)


@torch.library.custom_op("replaymoe::check_replay_ids", mutates_args=())
def _check_replay_ids_op(replay_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The replay-id check as an opaque op for compiled graphs: a copy of ``replay_ids`` once valid.

    Returning a copy that the routing consumes keeps the op from being dropped as dead code; the
    check itself is skipped while a CUDA graph is being captured (it needs a host sync).
    """
    if not is_capturing():
        _check_replay_values(replay_ids, num_experts)
    return replay_ids.clone()


@_check_replay_ids_op.register_fake
def _check_replay_ids_fake(replay_ids, num_experts):
    return torch.empty_like(replay_ids)


def compiled_replay_check(
    replay_ids: Optional[torch.Tensor], num_experts: int, check: bool = True
) -> Optional[torch.Tensor]:
    """Replay ids as the kernels read them: contiguous, and under torch.compile routed through the
    checking op (eager validation is skipped there).

    Any strides are accepted (e.g. ``trace.ids[:, l]``, a per-layer slice of a recorded trace); the
    small ``[T, K]`` tensor is copied when it is not contiguous.
    """
    if replay_ids is None:
        return None
    if not replay_ids.is_contiguous():
        replay_ids = replay_ids.contiguous()
    if not check or not torch.compiler.is_compiling():
        return replay_ids
    return torch.ops.replaymoe.check_replay_ids(replay_ids, num_experts)


def check_replay_ids(replay_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError unless every row of ``replay_ids`` is all -1 or ``K`` distinct ids in ``[0, E)``.

    Parameters
    ----------
    replay_ids : torch.Tensor
        ``[T, K]`` integer expert ids, on any device (one host sync).
    num_experts : int
        ``E``.
    """
    check_tensor("replay_ids", replay_ids, ndim=2, dtype=_ID_DTYPES)
    _check_replay_values(replay_ids, num_experts)


def _check_replay_values(replay_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if a row of replay_ids has ids outside [0, E), mixes -1 with ids, or repeats an id.

    One host sync for all three checks.
    """
    if replay_ids.numel() == 0:
        return
    ids = replay_ids.long()
    neg = ids == -1
    native = neg.all(dim=1)
    out_of_range = ((ids < -1) | (ids >= num_experts)).any(dim=1)
    mixed = neg.any(dim=1) & ~native
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1) & ~native
    bad = torch.stack([out_of_range, mixed, dup])  # [3, T]
    flags = bad.any(dim=1).tolist()
    if not any(flags):
        return
    kind = flags.index(True)
    row = int(torch.nonzero(bad[kind])[0, 0])
    got = f"row {row} = {ids[row].tolist()}"
    if kind == 0:
        fail("replay_ids", f"expert ids in [0, {num_experts}) (or a row of all -1)", got)
    if kind == 1:
        fail("replay_ids", "each row either all -1 (route natively) or all valid ids", got)
    fail("replay_ids", "distinct expert ids within each row", got)

"""Validation of the routing arguments, at the public boundary, and the replay-id check.

Two moments, each checked once: :func:`validate_config` when a
:class:`~replaymoe.routing.RoutingConfig` is built (everything that needs no logits), and
:func:`validate` per call of :func:`replaymoe.routing.route` (or of ``fused_moe`` with routing inside):
the logits and the other per-call arguments (cheap predicates first: it runs on every eager call)
against the routing, returning the normalised :class:`~replaymoe.routing.methods.Params` and the
replay ids as the kernels read them. Replay ids are checked by value where that needs a host sync:
eagerly here, and under ``torch.compile`` through the custom op ``replaymoe::check_replay_ids``,
skipped while a CUDA graph is being captured. What the checks say about a method comes from its row
in :data:`~replaymoe.routing.methods.METHODS`.

The value check itself (:func:`check_id_values`) also serves ``fused_moe``'s caller-given
``topk_ids`` (through the custom op ``replaymoe::check_topk_ids`` under ``torch.compile``): one
implementation, parameterised by the argument's name and by what ``-1`` means there.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from replaymoe._validation import check_int, check_tensor, fail, is_capturing, tensor_ok
from replaymoe.routing.methods import METHODS, Params, RoutingMethod, methods_where, nonnegative_weights

if TYPE_CHECKING:
    from replaymoe.routing import RoutingConfig

__all__ = [
    "BIAS_DTYPES",
    "check_id_values",
    "check_replay_ids",
    "mark_valid_ids",
    "check_replay_weights",
    "topk_ids_for_kernels",
    "validate",
    "validate_config",
    "validate_weights",
]

BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int16, torch.int32, torch.int64)
_MAX_N_GROUP = 32
_METHOD_VALUES = tuple(int(m) for m in METHODS)
_METHOD_CHOICES = ", ".join(f"{m.name}={int(m)}" for m in METHODS)  # every method of the table


# RoutingConfig's fields spelled out (as in as_routing)
def validate_config(
    top_k: object,
    method: object,
    bias: object,
    n_group: object,
    topk_group: object,
    routed_scaling_factor: object,
) -> tuple[RoutingMethod, int, int, float]:
    """The checks of the routing arguments that need no logits: (method, n_group, topk_group, scale).

    The number of experts is checked against them per call (:func:`validate`). Called by
    ``RoutingConfig.__post_init__``.
    """
    # membership by ==, not chained <: torch 2.11's dynamo rejects `<` on enum constants
    if isinstance(method, bool) or not isinstance(method, int) or method not in _METHOD_VALUES:
        fail("method", f"a RoutingMethod ({_METHOD_CHOICES})", repr(method))
    if not isinstance(method, RoutingMethod):  # torch 2.11's dynamo cannot trace the enum constructor
        method = RoutingMethod(method)
    if type(top_k) is not int or top_k < 1:
        check_int("top_k", top_k, low=1)
    spec = METHODS[method]
    if spec.single_expert and top_k != 1:
        fail("top_k", f"1 for RoutingMethod.{method.name}", top_k)
    if spec.biased:
        if bias is not None and not tensor_ok(bias, 1, BIAS_DTYPES, None, True):
            check_tensor("bias", bias, ndim=1, dtype=BIAS_DTYPES, contiguous=True)
        if routed_scaling_factor is None:
            scale = 1.0
        else:
            if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
                fail(
                    "routed_scaling_factor",
                    "a float or None",
                    type(routed_scaling_factor).__name__,
                    what="type",
                )
            try:
                scale = float(routed_scaling_factor)
            except OverflowError:  # an int past float's range (10**400)
                scale = math.inf
            if not math.isfinite(scale):
                fail("routed_scaling_factor", "a finite float", scale)
    else:
        if bias is not None:
            fail("bias", f"None for {method.name} (bias applies to {methods_where('biased')})", "a tensor")
        if routed_scaling_factor is not None:
            fail(
                "routed_scaling_factor",
                f"None for {method.name} (it applies to {methods_where('biased')})",
                routed_scaling_factor,
            )
        scale = 1.0
    if spec.grouped:
        ng = 1 if n_group is None else check_int("n_group", n_group, low=1, high=_MAX_N_GROUP)
        if topk_group is None:
            if ng > 1:
                fail("topk_group", f"an int in [1, {ng}] when n_group > 1", None)
            tg = 1
        else:
            tg = check_int("topk_group", topk_group, low=1, high=ng)
    else:
        for name, val in (("n_group", n_group), ("topk_group", topk_group)):
            if val is not None and (type(val) is not int or val != 1):  # (True and 1.0 equal 1)
                grouped = methods_where("grouped")
                fail(name, f"None or 1 for {method.name} (grouping applies to {grouped})", val)
        ng, tg = 1, 1
    return method, ng, tg, scale


def validate(
    router_logits: object,
    routing: RoutingConfig,
    routing_replay_out: object,
    replay_ids: object,
    check_replay: bool = True,
    *,
    defer: bool = False,
) -> tuple[Params, Optional[torch.Tensor]]:
    """The per-call checks of ``route``: the logits, and ``routing`` against their number of experts.

    Returns the normalised :class:`Params` and ``replay_ids`` as the kernels read them
    (:func:`_replay_ids_for_kernels`). ``defer`` (the caller runs
    :func:`replaymoe.routing._dispatch.run_route` next): replay ids on CUDA are not checked here but
    flagged (``Params.check_replay``) for the backend, which checks them without a host sync on the
    Triton path (the routing kernel, :mod:`._id_mailbox`) and on the host on the torch path
    (:func:`replay_ids_for_torch`).
    """
    # fast predicates first (host cost matters at decode sizes); check_tensor builds the error
    if check_replay is not True and check_replay is not False:  # (None or 0 would turn the check off)
        fail("check_replay", "a bool", type(check_replay).__name__, what="type")
    x = router_logits
    if not tensor_ok(x, 2, _LOGIT_DTYPES, None, False):
        x = check_tensor("router_logits", router_logits, ndim=2, dtype=_LOGIT_DTYPES)
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
    top_k, bias, ng, tg = routing.top_k, routing.bias, routing.num_groups, routing.groups_kept
    if top_k > num_experts:
        check_int("top_k", top_k, low=1, high=num_experts)
    if bias is not None and not (bias.device == dev and bias.shape[0] == num_experts):
        check_tensor("bias", bias, shape=(num_experts,), dtype=BIAS_DTYPES, device=dev, contiguous=True)
    if ng > 1 or routing.n_group is not None:
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
            r = check_tensor(
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
            replay_ids = check_tensor(
                "replay_ids", replay_ids, shape=(num_tokens, top_k), dtype=_ID_DTYPES, device=dev
            )
        if check_replay and defer and replay_ids.is_cuda:  # the backend checks them
            if not replay_ids.is_contiguous():
                replay_ids = replay_ids.contiguous()
            return Params(routing.method, top_k, ng, tg, routing.scale, True), replay_ids
        if check_replay and not is_capturing() and not torch.compiler.is_compiling():
            check_id_values(replay_ids, num_experts)
        # under torch.compile the check runs inside the graph, in the op from _replay_ids_for_kernels
        replay_ids = _replay_ids_for_kernels(replay_ids, num_experts, check_replay)

    return Params(routing.method, top_k, ng, tg, routing.scale), replay_ids


def validate_weights(
    router_logits: torch.Tensor,
    routing: RoutingConfig,
    routing_weights_out: object,
    replay_ids: Optional[torch.Tensor],
    replay_weights: object,
    check_replay: bool = True,
    *,
    defer: bool = False,
) -> Optional[torch.Tensor]:
    """The per-call checks of ``route``'s combine-weight tensors, after :func:`validate` passed for the
    same call: ``routing_weights_out`` (capture) as ``routing_replay_out`` but float32, and
    ``replay_weights`` (only with ``replay_ids``) float32 ``[T, K]`` on the logits' device.

    ``check_replay``: also check the values of ``replay_weights`` (:func:`check_replay_weights`),
    here on the host (skipped while a CUDA graph is captured and under ``torch.compile``), or, with
    ``defer`` and CUDA tensors, by the backend with the replay ids (``Params.check_replay``, which
    :func:`validate` with ``defer`` sets for them): the routing kernel on the device, into the error
    mailbox, the torch path on the host. Returns ``replay_weights`` as the kernels read them
    (contiguous), or None.
    """
    num_tokens, num_experts = router_logits.shape
    dev, top_k = router_logits.device, routing.top_k
    if routing_weights_out is not None:
        w = routing_weights_out
        if not tensor_ok(w, 2, (torch.float32,), dev, True):
            w = check_tensor(
                "routing_weights_out", w, ndim=2, dtype=torch.float32, device=dev, contiguous=True
            )
        if w.shape[1] != top_k or w.shape[0] < num_tokens:
            fail("routing_weights_out", f"shape (>= {num_tokens}, {top_k})", tuple(w.shape), what="shape")
        if (  # (eager: a compiled graph owns its buffers)
            not torch.compiler.is_compiling()
            and w.untyped_storage().data_ptr() == router_logits.untyped_storage().data_ptr()
            and w.numel()
        ):
            fail("routing_weights_out", "a buffer of its own (the weights are written into it)",
                 "the memory of router_logits", what="memory")  # fmt: skip
    if replay_weights is None:
        return None
    if replay_ids is None:
        fail("replay_weights", "None without replay_ids (weights are replayed with their ids)", "a tensor")
    rw = replay_weights
    if not (tensor_ok(rw, 2, (torch.float32,), dev, False) and tuple(rw.shape) == (num_tokens, top_k)):
        rw = check_tensor("replay_weights", rw, shape=(num_tokens, top_k), dtype=torch.float32, device=dev)
    deferred = defer and rw.is_cuda  # (validate deferred the ids of the same call alike)
    if check_replay and not deferred and not is_capturing() and not torch.compiler.is_compiling():
        check_replay_weights(rw, replay_ids, nonnegative=weights_nonnegative(routing))
    return rw if rw.is_contiguous() else rw.contiguous()


def weights_nonnegative(routing: RoutingConfig) -> bool:
    """Whether every weight ``routing`` can produce is >= 0: all methods but TOPK (the raw logits),
    and a non-negative ``routed_scaling_factor``."""
    return nonnegative_weights(routing.method, routing.scale)


def check_replay_weights(
    replay_weights: torch.Tensor, replay_ids: torch.Tensor, *, nonnegative: bool = True
) -> None:
    """Raise ValueError (naming ``replay_weights`` and the first bad row) unless every row whose
    ``replay_ids`` are not all -1 holds finite weights (and, with ``nonnegative``, weights >= 0).
    Rows of all -1 ids route natively: their weights are not read (NaN there is fine). One host sync.

    Parameters
    ----------
    replay_weights : torch.Tensor
        float32 ``[T, K]``.
    replay_ids : torch.Tensor
        ``[T, K]`` integer ids of the same rows.
    nonnegative : bool
        Also require weights >= 0 (every method but TOPK, whose weights are the raw logits).
    """
    if replay_weights.numel() == 0:
        return
    w = replay_weights.float()
    ok = torch.isfinite(w) & (w >= 0) if nonnegative else torch.isfinite(w)
    bad = ~ok.all(dim=1) & (replay_ids != -1).any(dim=1).to(ok.device)
    if not bool(bad.any()):
        return
    row = int(torch.nonzero(bad)[0, 0])
    rule = "finite weights >= 0" if nonnegative else "finite weights"
    fail(
        "replay_weights",
        f"{rule} in every replayed row (rows of all -1 ids excepted)",
        f"row {row} = {w[row].tolist()}",
    )


def replay_ids_for_torch(replay_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The torch path's check of replay ids that :func:`validate` deferred (``Params.check_replay``):
    eagerly on the host (one sync; skipped while a CUDA graph is captured), under ``torch.compile``
    through the op ``replaymoe::check_replay_ids``."""
    if not is_capturing() and not torch.compiler.is_compiling():
        check_id_values(replay_ids, num_experts)
    return _replay_ids_for_kernels(replay_ids, num_experts, True)


@torch.library.custom_op("replaymoe::check_replay_ids", mutates_args=())
def _check_replay_ids_op(replay_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The replay-id check as an opaque op for compiled graphs: a copy of ``replay_ids`` once valid.

    Returning a copy that the routing consumes keeps the op from being dropped as dead code; the
    check itself is skipped while a CUDA graph is being captured (it needs a host sync).
    """
    if not is_capturing():
        check_id_values(replay_ids, num_experts)
    return replay_ids.clone()


@_check_replay_ids_op.register_fake
def _check_replay_ids_fake(replay_ids, num_experts):
    return torch.empty_like(replay_ids)


def _replay_ids_for_kernels(replay_ids: torch.Tensor, num_experts: int, check: bool) -> torch.Tensor:
    """Replay ids as the kernels read them: contiguous, and under torch.compile routed through the
    checking op (eager validation is skipped there).

    Any strides are accepted (e.g. ``trace.ids[:, l]``, a per-layer slice of a recorded trace); the
    small ``[T, K]`` tensor is copied when it is not contiguous (here only, once per call).
    """
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
    check_id_values(replay_ids, num_experts)


@torch.library.custom_op("replaymoe::check_topk_ids", mutates_args=())
def _check_topk_ids_op(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``fused_moe``'s caller-id check (:func:`check_id_values` with ``name="topk_ids"``,
    ``minus_one="slots"``) as an opaque op for compiled graphs: a copy of ``topk_ids`` once valid.

    As ``replaymoe::check_replay_ids``: the copy, which the experts consume, keeps the op from being
    dropped as dead code, and the check is skipped while a CUDA graph is being captured.
    """
    if not is_capturing():
        check_id_values(topk_ids, num_experts, "topk_ids", minus_one="slots")
    return topk_ids.clone()


@_check_topk_ids_op.register_fake
def _check_topk_ids_fake(topk_ids, num_experts):
    return torch.empty_like(topk_ids)


_VALID_MARK = "_replaymoe_valid_ids"  # (experts E, the tensor's version counter when marked)


def mark_valid_ids(ids: torch.Tensor, num_experts: int) -> None:
    """Mark ``ids`` (``route``'s output) as valid for models of at least ``num_experts`` experts: a
    later :func:`topk_ids_for_kernels` of the same, unmodified tensor (its version counter unchanged:
    any in-place write, through a view too, changes it) skips the by-value check. Eager only.

    Inference tensors (made under ``torch.inference_mode()``) have no version counter: they are not
    marked, and are checked by value like any other caller's ids. Writes that bypass the version
    counter (``ids.data[...] = ``, through DLPack or ``__cuda_array_interface__``) are not seen on CUDA:
    ids written that way must be passed as a copy (``ids.clone()``). On the CPU, where the check costs no
    host sync, the mark is not used: CPU ids are always checked by value."""
    if ids.is_inference():
        return
    setattr(ids, _VALID_MARK, (num_experts, ids._version))


def _marked_valid(ids: torch.Tensor, num_experts: int) -> bool:
    mark = getattr(ids, _VALID_MARK, None)
    return mark is not None and mark[0] <= num_experts and mark[1] == ids._version


def topk_ids_for_kernels(
    topk_ids: torch.Tensor, num_experts: int, check: bool, *, on_device: bool = False
) -> tuple[torch.Tensor, int]:
    """``fused_moe``'s caller-given ``topk_ids`` checked by value, once, at the public boundary:
    ``(ids as the experts read them, id_bound)``.

    ``on_device`` (the Triton experts on CUDA): the ids come back as they are with ``id_bound = E``,
    and the kernel that reads them first checks them on the device, without a host sync, in eager,
    compiled and CUDA-graph calls alike (:mod:`replaymoe.routing._id_mailbox`): nothing else runs on
    the host here, since this is every decode call's path. Otherwise (the CPU, the torch backend)
    ``id_bound`` is 0 and the check runs here: eagerly :func:`check_id_values` (one host sync on a GPU),
    under ``torch.compile`` the op ``replaymoe::check_topk_ids``, which checks them inside the graph
    (skipped while a CUDA graph is being captured).

    On that host path, CUDA ids that :func:`route` returned and nobody modified since
    (:func:`mark_valid_ids`) were valid when made: eagerly they are not checked again, which saves the
    sync (CPU ids always are: no sync to save). ``check=False`` returns them untouched on every path.
    """
    if not check:
        return topk_ids, 0
    if on_device:  # (the device's check costs less than reading the mark)
        return topk_ids, num_experts
    compiling = torch.compiler.is_compiling()
    if not compiling and topk_ids.is_cuda and _marked_valid(topk_ids, num_experts):
        return topk_ids, 0
    if compiling:
        return torch.ops.replaymoe.check_topk_ids(topk_ids, num_experts), 0
    if not is_capturing():
        check_id_values(topk_ids, num_experts, "topk_ids", minus_one="slots")
    return topk_ids, 0


def check_id_values(
    ids: torch.Tensor, num_experts: int, name: str = "replay_ids", *, minus_one: str = "rows"
) -> None:
    """Raise ValueError (naming ``name``, the rule and the first bad row with its values) unless every
    id of ``ids`` [T, K] lies in ``[0, num_experts)`` with no id twice in a row, ``-1`` aside.

    ``minus_one`` says what ``-1`` means:

    * ``"rows"`` (``replay_ids``): a row of all ``-1`` routes natively; ``-1`` mixed with ids in a
      row is an error;
    * ``"slots"`` (``fused_moe``'s ``topk_ids``): a ``-1`` slot has no expert (contributes nothing:
      expert-parallel padding rows and the slots of other ranks' experts), anywhere; several ``-1`` in
      a row are not duplicates.

    Other negative ids are always out of range. One host sync for all the checks together.
    """
    if ids.numel() == 0:
        return
    ids = ids.long()  # int16 ids against E > 32767; int64 compares exactly
    srt = ids.sort(dim=1).values
    lo, hi = srt[:, 0], srt[:, -1]
    out_of_range = (lo < -1) | (hi >= num_experts)
    same = srt[:, 1:] == srt[:, :-1]
    if minus_one == "rows":  # lo == -1: the row holds a -1; hi == -1: it is all -1 (or out of range)
        native = hi == -1
        mixed = (lo == -1) & ~native
        dup = same.any(dim=1) & ~native
    else:
        assert minus_one == "slots", minus_one
        mixed = torch.zeros_like(out_of_range)
        dup = (same & (srt[:, 1:] != -1)).any(dim=1)
    bad = torch.stack([out_of_range, mixed, dup])  # [3, T]
    flags = bad.any(dim=1).tolist()
    if not any(flags):
        return
    kind = flags.index(True)
    row = int(torch.nonzero(bad[kind])[0, 0])
    got = f"row {row} = {ids[row].tolist()}"
    if kind == 0:
        allowed = "(or a row of all -1)" if minus_one == "rows" else "(or -1: a slot with no expert)"
        fail(name, f"expert ids in [0, {num_experts}) {allowed}", got)
    if kind == 1:
        fail(name, "each row either all -1 (route natively) or all valid ids", got)
    fail(name, "distinct expert ids within each row", got)

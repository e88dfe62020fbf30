"""MoE routing: top-k expert selection and weights, with capture and replay.

Ten routers with FlashInfer's numbering (:class:`RoutingMethod`); one fused Triton
kernel per :func:`route` call on the GPU; :func:`route_torch` is the pure-PyTorch
reference (fp32, CPU or GPU, differentiable) that defines the semantics.

Semantics shared by every method and backend
--------------------------------------------
* Selection is on a per-method *selection score* (below), in fp32. NaN scores are
  treated as ``-inf``; ties go to the smaller expert index (the order is the total
  order of the key ``(score, -index)``), so ids in a row are always distinct and in
  ``[0, E)``. Columns come in descending selection-score order.
* Weights are computed in fp32 from the logits at the chosen ids by the method's
  formula (below). With ``replay_ids`` the selection is skipped and the weights are
  recomputed over the forced ids, in the column order given.

=====================  ======================  =====================================================
method                 selection score         weights over the selected set S
=====================  ======================  =====================================================
DEFAULT (0)            x                       softmax(x) over all E experts, at S (no renorm)
RENORMALIZE (1)        x                       softmax over x_S
DEEPSEEK_V3 (2)        b = sigmoid(x) + bias   s_S / (sum s_S + 1e-20) * routed_scaling_factor,
                       (grouped, see below)    s = sigmoid(x) (unbiased)
LLAMA4 (3)             x  (top_k must be 1)    sigmoid(x_S)
RENORMALIZE_NAIVE (4)  x                       p_S / sum p_S with p = softmax(x) over all E
TOPK (5)               x                       x_S (raw logits)
SIGMOID_RENORM (6)     x                       s_S / max(sum s_S, 1e-20), s = sigmoid(x)
MINIMAX2 (7)           b = sigmoid(x) + bias   s_S / (sum s_S + 1e-20) * routed_scaling_factor
SIGMOID (8)            x                       sigmoid(x_S)
TOPK_SIGMOID (9)       x                       sigmoid(x_S)
=====================  ======================  =====================================================

Softmax and sigmoid are monotonic, so the methods that FlashInfer describes as
"top-k of softmax(x)" or "top-k of sigmoid(x)" select on the raw logits here: the same
set, except that values which round to the same probability in fp32 (sigmoid(x) = 1.0
for x > ~17) are still ordered by their logits instead of by index.

DeepSeek-V3 grouping (``n_group > 1``): the E experts form ``n_group`` contiguous
groups; a group's score is the sum of its two largest ``b`` (fp32, largest + second;
the single value when a group has one expert; NaN counts as ``-inf``); the
``topk_group`` best groups are kept (ties to the smaller group index) and every
expert of another group gets the score ``-inf``; then the top-k of ``b`` is selected.
With ``n_group`` 1 (or None) it is plain top-k of ``b``.
"""

from __future__ import annotations

import math
import os
from enum import IntEnum
from typing import NamedTuple, Optional

import torch

from replaymoe._validation import check_choice, check_int, check_tensor, fail, is_capturing

__all__ = ["RoutingMethod", "RoutingOutput", "check_replay_ids", "route", "route_torch"]

# Read once, as Triton does: the interpreter is only usable when the process started with it.
_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int16, torch.int32, torch.int64)
_MAX_N_GROUP = 32
_MAX_KERNEL_EXPERTS = 4096  # the kernel holds a token's experts in registers
_EPS = 1e-20


class RoutingMethod(IntEnum):
    """Routing methods, numbered as FlashInfer's ``RoutingMethodType`` (see the module docstring)."""

    DEFAULT = 0
    RENORMALIZE = 1
    DEEPSEEK_V3 = 2
    LLAMA4 = 3
    RENORMALIZE_NAIVE = 4
    TOPK = 5
    SIGMOID_RENORM = 6
    MINIMAX2 = 7
    SIGMOID = 8
    TOPK_SIGMOID = 9


# methods whose selection score is sigmoid(x) + bias and that take a routed_scaling_factor
_BIASED = (RoutingMethod.DEEPSEEK_V3, RoutingMethod.MINIMAX2)
_METHOD_VALUES = tuple(range(10))


class RoutingOutput(NamedTuple):
    """Result of :func:`route`.

    Attributes
    ----------
    topk_ids : torch.Tensor
        int32 ``[T, K]``: global expert ids in ``[0, E)``, distinct within a row, columns in
        descending selection-score order (replay: the forced ids in the order given).
    topk_weights : torch.Tensor
        float32 ``[T, K]``: the routing weights of those experts (method's formula, fp32).
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class _Params(NamedTuple):
    """Validated, normalised routing arguments (internal)."""

    method: RoutingMethod
    top_k: int
    n_group: int
    topk_group: int
    scale: float


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _validate(
    router_logits: object,
    top_k: object,
    method: object,
    bias: object,
    n_group: object,
    topk_group: object,
    routed_scaling_factor: object,
    routing_replay_out: object,
    replay_ids: object,
    check_replay: bool = True,
) -> _Params:
    # fast predicates first (host cost matters at decode sizes); check_tensor builds the error
    x = router_logits
    if not _tensor_ok(x, 2, _LOGIT_DTYPES, None, False):
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

    # membership by ==, not chained <: torch 2.11's dynamo rejects `<` on enum constants
    if isinstance(method, bool) or not isinstance(method, int) or method not in _METHOD_VALUES:
        fail("method", "a RoutingMethod (0..9)", repr(method))
    if not isinstance(method, RoutingMethod):  # torch 2.11's dynamo cannot trace the enum constructor
        method = RoutingMethod(method)

    if type(top_k) is not int or not 1 <= top_k <= num_experts:
        check_int("top_k", top_k, low=1, high=num_experts)
    if method == RoutingMethod.LLAMA4 and top_k != 1:
        fail("top_k", "1 for RoutingMethod.LLAMA4", top_k)

    if method in _BIASED:
        if bias is not None and not (
            _tensor_ok(bias, 1, _BIAS_DTYPES, dev, True) and bias.shape[0] == num_experts
        ):
            check_tensor("bias", bias, shape=(num_experts,), dtype=_BIAS_DTYPES, device=dev, contiguous=True)
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
            scale = float(routed_scaling_factor)
            if not math.isfinite(scale):
                fail("routed_scaling_factor", "a finite float", scale)
    else:
        if bias is not None:
            fail("bias", f"None for {method.name} (bias applies to DEEPSEEK_V3 and MINIMAX2)", "a tensor")
        if routed_scaling_factor is not None:
            fail(
                "routed_scaling_factor",
                f"None for {method.name} (it applies to DEEPSEEK_V3 and MINIMAX2)",
                routed_scaling_factor,
            )
        scale = 1.0

    if method == RoutingMethod.DEEPSEEK_V3:
        ng = 1 if n_group is None else check_int("n_group", n_group, low=1, high=_MAX_N_GROUP)
        if num_experts % ng != 0:
            fail("n_group", f"a divisor of the number of experts {num_experts}", ng)
        if topk_group is None:
            if ng > 1:
                fail("topk_group", f"an int in [1, {ng}] when n_group > 1", None)
            tg = 1
        else:
            tg = check_int("topk_group", topk_group, low=1, high=ng)
        if top_k > tg * (num_experts // ng):
            fail(
                "top_k",
                f"at most topk_group * E / n_group = {tg * (num_experts // ng)} "
                "(the experts left after group masking)",
                top_k,
            )
    else:
        for name, val in (("n_group", n_group), ("topk_group", topk_group)):
            if val is not None and val != 1:
                fail(name, f"None or 1 for {method.name} (grouping applies to DEEPSEEK_V3)", val)
        ng, tg = 1, 1

    if routing_replay_out is not None:
        r = routing_replay_out
        if not _tensor_ok(r, 2, (torch.int16,), dev, True):
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
            _tensor_ok(replay_ids, 2, _ID_DTYPES, dev, False)  # any strides: copied when needed
            and tuple(replay_ids.shape) == (num_tokens, top_k)
        ):
            check_tensor("replay_ids", replay_ids, shape=(num_tokens, top_k), dtype=_ID_DTYPES, device=dev)
        if check_replay and not is_capturing() and not torch.compiler.is_compiling():
            _check_replay_values(replay_ids, num_experts)
        # under torch.compile the check runs inside the graph, in the op from _compiled_replay_check

    return _Params(method, top_k, ng, tg, scale)


def _tensor_ok(t: object, ndim: int, dtypes: tuple, device: Optional[torch.device], contiguous: bool) -> bool:
    """Cheap predicate for the common valid case (check_tensor then explains a failure)."""
    return (
        isinstance(t, torch.Tensor)
        and t.dim() == ndim
        and t.dtype in dtypes
        and (device is None or t.device == device)
        and (not contiguous or t.is_contiguous())
    )


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


def _compiled_replay_check(
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


# --------------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------------


def _selection_scores(x32: torch.Tensor, p: _Params, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 [T, E] selection scores (NaN -> -inf, group masking applied). No grad."""
    if p.method in _BIASED:
        b = torch.sigmoid(x32)
        if bias is not None:
            b = b + bias.float()
    else:
        b = x32.clone()
    neg_inf = float("-inf")  # a Python scalar: no host->device copy (CUDA-graph capturable)
    b = torch.where(torch.isnan(b), neg_inf, b)
    if p.method == RoutingMethod.DEEPSEEK_V3 and p.n_group > 1:
        t, e = b.shape
        grouped = b.view(t, p.n_group, e // p.n_group)
        top2 = grouped.topk(min(2, e // p.n_group), dim=2).values  # descending
        gscore = top2[:, :, 0] + top2[:, :, 1] if top2.shape[2] == 2 else top2[:, :, 0]
        gscore = torch.where(torch.isnan(gscore), neg_inf, gscore)
        keep_groups = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, : p.topk_group]
        keep = torch.zeros(t, p.n_group, dtype=torch.bool, device=b.device)
        keep.scatter_(1, keep_groups, True)
        b = torch.where(keep.repeat_interleave(e // p.n_group, dim=1), b, neg_inf)
    return b


def _select_torch(x32: torch.Tensor, p: _Params, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 [T, K] ids: top-k of the selection score, ties to the smaller index."""
    b = _selection_scores(x32, p, bias)
    return torch.sort(b, dim=1, descending=True, stable=True).indices[:, : p.top_k]


def _weights_torch(x32: torch.Tensor, ids: torch.Tensor, p: _Params) -> torch.Tensor:
    """fp32 [T, K] weights of the method at ``ids`` (int64), differentiable w.r.t. ``x32``."""
    m = p.method
    if m in (RoutingMethod.DEFAULT, RoutingMethod.RENORMALIZE_NAIVE):
        probs = torch.softmax(x32, dim=1).gather(1, ids)
        if m == RoutingMethod.DEFAULT:
            return probs
        return probs / probs.sum(dim=1, keepdim=True)
    xs = x32.gather(1, ids)
    if m == RoutingMethod.RENORMALIZE:
        return torch.softmax(xs, dim=1)
    if m == RoutingMethod.TOPK:
        return xs
    s = torch.sigmoid(xs)
    if m in (RoutingMethod.LLAMA4, RoutingMethod.SIGMOID, RoutingMethod.TOPK_SIGMOID):
        return s
    if m == RoutingMethod.SIGMOID_RENORM:
        return s / s.sum(dim=1, keepdim=True).clamp_min(_EPS)
    # DEEPSEEK_V3, MINIMAX2
    return s / (s.sum(dim=1, keepdim=True) + _EPS) * p.scale


def _route_torch_impl(
    router_logits: torch.Tensor,
    p: _Params,
    bias: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
) -> RoutingOutput:
    x32 = router_logits.float()
    with torch.no_grad():
        ids = _select_torch(x32.detach(), p, bias)
        if replay_ids is not None:
            forced = replay_ids.long()
            native = (forced == -1).all(dim=1, keepdim=True)
            ids = torch.where(native, ids, forced)
    weights = _weights_torch(x32, ids, p)
    ids32 = ids.to(torch.int32)
    if routing_replay_out is not None:
        with torch.no_grad():
            routing_replay_out[: ids32.shape[0]].copy_(ids32)
    return RoutingOutput(ids32, weights)


def route_torch(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod = RoutingMethod.RENORMALIZE,
    *,
    bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: Optional[float] = None,
    routing_replay_out: Optional[torch.Tensor] = None,
    replay_ids: Optional[torch.Tensor] = None,
) -> RoutingOutput:
    """Pure-PyTorch reference of :func:`route` (the executable spec).

    Same arguments, validation and results as :func:`route` (see there); computes in fp32
    with plain torch ops on any device and is differentiable with respect to
    ``router_logits`` (with and without ``replay_ids``).
    """
    p = _validate(
        router_logits,
        top_k,
        method,
        bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        routing_replay_out,
        replay_ids,
    )
    replay_ids = _compiled_replay_check(replay_ids, router_logits.shape[1])
    return _route_torch_impl(router_logits, p, bias, routing_replay_out, replay_ids)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------


def _resolve_backend(backend: object, x: torch.Tensor) -> str:
    if backend not in ("auto", "triton", "torch"):
        check_choice("backend", backend, ("auto", "triton", "torch"))
    if backend == "auto":
        return "triton" if x.is_cuda and x.shape[1] <= _MAX_KERNEL_EXPERTS else "torch"
    if backend == "triton" and x.shape[1] > _MAX_KERNEL_EXPERTS:
        fail(
            "router_logits",
            f"at most {_MAX_KERNEL_EXPERTS} experts for backend='triton' (one register tile per "
            "token; 'auto' uses the torch path beyond that)",
            x.shape[1],
        )
    if backend == "triton" and not x.is_cuda and not _INTERPRET_AT_IMPORT:
        fail(
            "backend",
            "'triton' with CPU tensors only when the process was started with "
            "TRITON_INTERPRET=1 (Triton's interpreter; use backend='torch' or 'auto' on CPU)",
            "'triton' with CPU tensors and TRITON_INTERPRET unset",
        )
    return str(backend)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    method: RoutingMethod = RoutingMethod.RENORMALIZE,
    *,
    bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: Optional[float] = None,
    routing_replay_out: Optional[torch.Tensor] = None,
    replay_ids: Optional[torch.Tensor] = None,
    backend: str = "auto",
    check_replay: bool = True,
) -> RoutingOutput:
    """Select the top-k experts of every token and their weights (one fused kernel on the GPU).

    Parameters
    ----------
    router_logits : torch.Tensor
        ``[T, E]`` float32, bfloat16 or float16, unit stride along experts (rows may be strided).
    top_k : int
        Experts per token, ``1 <= top_k <= E`` (LLAMA4: exactly 1; DEEPSEEK_V3: at most
        ``topk_group * E / n_group``).
    method : RoutingMethod
        The router (module docstring has the math of every method).
    bias : torch.Tensor, optional
        ``[E]`` float32/bfloat16/float16 selection bias, DEEPSEEK_V3 and MINIMAX2 only
        (None = zero bias). Affects selection only, never the weights.
    n_group, topk_group : int, optional
        DEEPSEEK_V3 grouping: ``E % n_group == 0``, ``n_group <= 32``,
        ``1 <= topk_group <= n_group`` (required when ``n_group > 1``). None = no grouping.
    routed_scaling_factor : float, optional
        Weight scale of DEEPSEEK_V3 and MINIMAX2 (None = 1.0).
    routing_replay_out : torch.Tensor, optional
        Capture buffer: int16 ``[>= T, K]``, contiguous, on the logits' device. Rows ``< T``
        receive ``topk_ids`` (same column order); rows ``>= T`` are untouched, so one max-size
        buffer serves every step of a CUDA graph. When None the write is compiled out of the
        kernel; results are bit-identical either way.
    replay_ids : torch.Tensor, optional
        ``[T, K]`` int16/int32/int64 expert ids to force (any strides; copied when not
        contiguous, e.g. ``trace_ids[:, layer]``): selection is skipped and the weights
        are recomputed from the logits over these ids (in this column order). A row of all -1
        is routed natively. Any other id outside ``[0, E)``, a row mixing -1 with ids, or a
        repeated id in a row raises ValueError (checked except during CUDA-graph capture).
    backend : {"auto", "triton", "torch"}
        ``auto``: the Triton kernel on CUDA tensors (up to 4096 experts), the torch reference
        otherwise. ``triton`` on CPU tensors needs the process started with ``TRITON_INTERPRET=1``.
    check_replay : bool
        Check the values of ``replay_ids`` (one host sync per call eagerly; an op in the graph
        under ``torch.compile``). Pass False only for ids already checked once with
        :func:`check_replay_ids` (e.g. a replay table built from validated traces), so that a
        forward replaying them pays no sync.

    Returns
    -------
    RoutingOutput
        ``topk_ids`` int32 ``[T, K]`` and ``topk_weights`` float32 ``[T, K]``; differentiable
        with respect to ``router_logits`` on every backend.

    Raises
    ------
    ValueError
        Naming the argument, for any invalid dtype, shape, device, layout or value.
    """
    p = _validate(
        router_logits,
        top_k,
        method,
        bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        routing_replay_out,
        replay_ids,
        check_replay,
    )
    replay_ids = _compiled_replay_check(replay_ids, router_logits.shape[1], check_replay)
    be = _resolve_backend(backend, router_logits)
    if be == "torch":
        return _route_torch_impl(router_logits, p, bias, routing_replay_out, replay_ids)
    return _route_triton(router_logits, p, bias, routing_replay_out, replay_ids)


# --------------------------------------------------------------------------------------------------
# Triton backend
# --------------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Launch-configuration overrides for benchmarks/tuning: keys "BLOCK_T", "num_warps", "ALGO".
_CONFIG_OVERRIDE: dict[str, int] = {}


def _launch_config(ep: int) -> tuple[int, int, int]:
    """(BLOCK_T, num_warps, ALGO) for a padded expert count ``ep``."""
    block_t = _CONFIG_OVERRIDE.get("BLOCK_T", 2)
    num_warps = _CONFIG_OVERRIDE.get("num_warps", 1 if ep <= 512 else 4)
    algo = _CONFIG_OVERRIDE.get("ALGO", 3)
    return block_t, num_warps, algo


def _launch(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    top_k: int,
    method: int,
    n_group: int,
    topk_group: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and run the routing kernel once (no validation)."""
    from replaymoe._kernels.routing import route_kernel
    from replaymoe._launch import fast

    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=dev)
    if num_tokens == 0:
        return ids, weights
    gs = num_experts // n_group
    ngp, gsp = _next_pow2(n_group), _next_pow2(gs)
    block_t, num_warps, algo = _launch_config(ngp * gsp)
    grid = ((num_tokens + block_t - 1) // block_t,)
    fast(route_kernel)[grid](
        router_logits,
        router_logits.stride(0),
        router_logits if bias is None else bias,
        router_logits if replay_ids is None else replay_ids,
        ids,
        weights,
        router_logits if routing_replay_out is None else routing_replay_out,
        num_tokens,
        scale,
        METHOD=int(method),
        K=top_k,
        KP=_next_pow2(top_k),
        NG=n_group,
        GS=gs,
        NGP=ngp,
        GSP=gsp,
        TOPK_GROUP=topk_group,
        HAS_BIAS=bias is not None,
        HAS_REPLAY=replay_ids is not None,
        HAS_CAPTURE=routing_replay_out is not None,
        BLOCK_T=block_t,
        ALGO=algo,
        KEY32=router_logits.dtype != torch.float32 and method not in _BIASED,
        LOG_EP=(ngp * gsp).bit_length() - 1,
        num_warps=num_warps,
    )
    return ids, weights


@torch.library.custom_op("replaymoe::route", mutates_args=("routing_replay_out",))
def _route_op(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    top_k: int,
    method: int,
    n_group: int,
    topk_group: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.replaymoe.route``: the routing kernel as a custom op (for torch.compile)."""
    return _launch(
        router_logits, bias, replay_ids, routing_replay_out, top_k, method, n_group, topk_group, scale
    )


@_route_op.register_fake
def _route_op_fake(
    router_logits, bias, replay_ids, routing_replay_out, top_k, method, n_group, topk_group, scale
):
    t = router_logits.shape[0]
    return (
        router_logits.new_empty((t, top_k), dtype=torch.int32),
        router_logits.new_empty((t, top_k), dtype=torch.float32),
    )


def _kernel(router_logits, bias, replay_ids, routing_replay_out, p: _Params):
    args = (
        router_logits,
        bias,
        replay_ids,
        routing_replay_out,
        p.top_k,
        int(p.method),
        p.n_group,
        p.topk_group,
        p.scale,
    )
    if torch.compiler.is_compiling():
        return torch.ops.replaymoe.route(*args)
    return _launch(*args)  # eager: skip the custom-op dispatch overhead, same code


def _weights_backward(
    router_logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor, method: int, scale: float
) -> torch.Tensor:
    """Gradient of the weights w.r.t. the logits at fixed ids (closed form of :func:`_weights_torch`)."""
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32  # fp32 or wider
    x = router_logits.to(acc)
    idl = ids.long()
    g = grad_w.to(acc)
    xs = x.gather(1, idl)
    m = RoutingMethod(method)
    extra = None
    if m == RoutingMethod.DEFAULT:
        probs = torch.softmax(x, dim=1)
        gw = g * probs.gather(1, idl)
        gxs = gw
        extra = -probs * gw.sum(dim=1, keepdim=True)
    elif m in (RoutingMethod.RENORMALIZE, RoutingMethod.RENORMALIZE_NAIVE):
        w = torch.softmax(xs, dim=1)
        gxs = w * (g - (g * w).sum(dim=1, keepdim=True))
    elif m == RoutingMethod.TOPK:
        gxs = g
    else:
        s = torch.sigmoid(xs)
        if m == RoutingMethod.SIGMOID_RENORM:
            z = s.sum(dim=1, keepdim=True)
            zc = z.clamp_min(_EPS)
            ds = g / zc - torch.where(z > _EPS, (g * s).sum(dim=1, keepdim=True) / (zc * zc), 0.0)
        elif m in _BIASED:
            z = s.sum(dim=1, keepdim=True) + _EPS
            ds = scale * (g / z - (g * s).sum(dim=1, keepdim=True) / (z * z))
        else:  # LLAMA4, SIGMOID, TOPK_SIGMOID
            ds = g
        gxs = ds * s * (1.0 - s)
    gx = torch.zeros_like(x).scatter_add_(1, idl, gxs)
    if extra is not None:
        gx = gx + extra
    return gx.to(router_logits.dtype)


class _RouteFunction(torch.autograd.Function):
    """route() on the Triton backend with a backward w.r.t. the logits (ids are not differentiable)."""

    @staticmethod
    def forward(
        ctx, router_logits, bias, replay_ids, routing_replay_out, top_k, method, n_group, topk_group, scale
    ):
        p = _Params(RoutingMethod(method), top_k, n_group, topk_group, scale)
        ids, weights = _kernel(router_logits, bias, replay_ids, routing_replay_out, p)
        ctx.save_for_backward(router_logits, ids)
        ctx.method, ctx.scale = method, scale
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, grad_ids, grad_w):
        router_logits, ids = ctx.saved_tensors
        gx = _weights_backward(router_logits, ids, grad_w, ctx.method, ctx.scale)
        return gx, None, None, None, None, None, None, None, None


def _route_triton(
    router_logits: torch.Tensor,
    p: _Params,
    bias: Optional[torch.Tensor],
    routing_replay_out: Optional[torch.Tensor],
    replay_ids: Optional[torch.Tensor],
) -> RoutingOutput:
    if torch.is_grad_enabled() and router_logits.requires_grad:
        ids, weights = _RouteFunction.apply(
            router_logits,
            bias,
            replay_ids,
            routing_replay_out,
            p.top_k,
            int(p.method),
            p.n_group,
            p.topk_group,
            p.scale,
        )
    else:
        ids, weights = _kernel(router_logits, bias, replay_ids, routing_replay_out, p)
    return RoutingOutput(ids, weights)

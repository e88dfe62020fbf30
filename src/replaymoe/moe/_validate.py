"""Validation of :func:`replaymoe.moe.fused_moe`'s arguments, once, at the public boundary.

:func:`validate_call` checks the tensors, their shapes, dtypes and devices and the options against each
other, and with routing inside (``router_logits``) runs the routing's own per-call checks
(:func:`replaymoe.routing._checks.validate`) so that the routing after it
(:func:`replaymoe.routing._dispatch.run_route`) checks nothing again; ``fused_moe`` folds the loose
routing keywords into the :class:`~replaymoe.routing.RoutingConfig` it passes here. Caller-given
``topk_ids`` are checked by value unless ``check_ids`` is False
(:func:`replaymoe.routing._checks.topk_ids_for_kernels`): for the Triton experts on CUDA by the
kernels that read them, on the device without a host sync (``_Problem.id_bound``; eager, compiled and
CUDA-graph calls alike); otherwise here, by the routing's own id check (on the CPU, and the torch
backend: eagerly on the host, under ``torch.compile`` the op ``replaymoe::check_topk_ids``). It
returns the sizes of the call (:class:`_Problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validation import check_choice, check_int, check_tensor, fail
from ..routing import RoutingConfig
from ..routing._checks import topk_ids_for_kernels, validate_weights
from ..routing._checks import validate as validate_routing
from ..routing.methods import Params
from ._reference import ClampedSwiGLU

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REF_DTYPES = ACT_DTYPES + (torch.float64,)  # torch backend only: fp64 is the gradient reference
_ID_DTYPES = (torch.int32, torch.int64)
_FP8 = torch.float8_e4m3fn
GATE_UP_LAYOUTS = ("halves", "interleaved")


def check_activation(activation) -> None:
    if not isinstance(activation, ClampedSwiGLU):
        if not isinstance(activation, str) or activation != "swiglu":
            fail("activation", "'swiglu' or a ClampedSwiGLU", repr(activation))


@dataclass(frozen=True)
class _Problem:
    """Validated sizes of one call."""

    T: int  # tokens
    H: int  # hidden size
    I: int  # intermediate size (per expert)  # noqa: E741
    E_local: int  # experts held by this rank
    fp8: bool  # fp8 block-scale weights
    out_dtype: torch.dtype
    routing: RoutingConfig | None = None  # with router_logits: the routing, validated once
    route_params: Params | None = None  # with router_logits: the routing's checked arguments
    replay_ids: torch.Tensor | None = None  # with router_logits: replay ids as the kernels read them
    replay_weights: torch.Tensor | None = None  # with router_logits: replayed weights (full recall)
    topk_ids: torch.Tensor | None = None  # with given routing: the ids as the kernels read them
    id_bound: int = 0  # E when the kernels check topk_ids on the device, else 0


def check_experts(
    hidden_states,
    w13,
    w2,
    *,
    w13_scale=None,
    w2_scale=None,
    w13_bias=None,
    w2_bias=None,
    gate_up_layout="halves",
    activation="swiglu",
    act_dtypes=ACT_DTYPES,
    w13_name="w13",
    w2_name="w2",
) -> tuple[int, int, int, bool]:
    """The experts' arguments of a ``fused_moe`` call checked (:func:`validate_call`'s first part; also
    ``ep_moe``'s, before it routes or dispatches anything, with its own names ``w13_local`` and
    ``w2_local``): ``(E_local, H, I, fp8)``."""
    check_activation(activation)
    check_choice("gate_up_layout", gate_up_layout, GATE_UP_LAYOUTS)
    check_tensor("hidden_states", hidden_states, ndim=2, dtype=act_dtypes)
    dev = hidden_states.device
    H = hidden_states.shape[1]
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8 and (w13_scale is None or w2_scale is None):
        fail(
            "w13_scale" if w13_scale is None else "w2_scale",
            "both w13_scale and w2_scale (fp8 block-scale) or neither",
            "only one of them",
            what="value",
        )
    wdt = (_FP8,) if fp8 else (hidden_states.dtype,)
    check_tensor(w13_name, w13, ndim=3, dtype=wdt, device=dev)
    E_local, two_i, h13 = w13.shape
    if h13 != H:
        fail(w13_name, f"[E_local, 2I, H={H}] (H from hidden_states)", tuple(w13.shape), what="shape")
    if two_i % 2 or two_i == 0:
        fail(
            w13_name,
            "[E_local, 2I, H] with an even, non-zero 2I (gate rows then up rows)",
            tuple(w13.shape),
            what="shape",
        )
    I = two_i // 2  # noqa: E741
    if E_local < 1:
        fail(w13_name, "at least one local expert", tuple(w13.shape), what="shape")
    check_tensor(w2_name, w2, shape=(E_local, H, I), dtype=wdt, device=dev)
    bias_dt = (torch.float32, w13.dtype)
    if w13_bias is not None:
        check_tensor("w13_bias", w13_bias, shape=(E_local, two_i), dtype=bias_dt, device=dev)
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, shape=(E_local, H), dtype=bias_dt, device=dev)
    if fp8:  # the block-scale kernels take the standard experts only
        for name, other, std in (
            ("w13_bias", w13_bias is not None, "None"),
            ("w2_bias", w2_bias is not None, "None"),
            ("gate_up_layout", gate_up_layout != "halves", "'halves'"),
            ("activation", not isinstance(activation, str), "'swiglu'"),
        ):
            if other:
                fail(name, f"{std} with fp8 block-scale weights (w13_scale given)", "another value")
        if H % 128 or I % 128:
            fail(w13_name, "H and I multiples of 128 for fp8 block-scale", f"H={H}, I={I}", what="shape")
        # contiguous: the kernels step through the scale blocks with unit stride along the last dim
        for name, scale, rows, cols in (("w13_scale", w13_scale, two_i, H), ("w2_scale", w2_scale, H, I)):
            shape = (E_local, rows // 128, cols // 128)
            check_tensor(name, scale, shape=shape, dtype=torch.float32, device=dev, contiguous=True)
    return E_local, H, I, fp8


def validate_call(
    hidden_states,
    w13,
    w2,
    *,
    router_logits,
    routing,
    topk_ids,
    topk_weights,
    routing_replay_out,
    replay_ids,
    activation,
    w13_scale,
    w2_scale,
    local_expert_offset,
    num_experts,
    out,
    w13_bias=None,
    w2_bias=None,
    gate_up_layout="halves",
    act_dtypes=ACT_DTYPES,
    check_ids=True,
    triton=True,
    routing_weights_out=None,
    replay_weights=None,
) -> _Problem:
    E_local, H, I, fp8 = check_experts(  # noqa: E741
        hidden_states, w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, w13_bias=w13_bias,
        w2_bias=w2_bias, gate_up_layout=gate_up_layout, activation=activation, act_dtypes=act_dtypes,
    )  # fmt: skip
    dev = hidden_states.device
    T = hidden_states.shape[0]
    check_int("local_expert_offset", local_expert_offset, low=0)

    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            fail(
                "topk_ids",
                "None when router_logits is given (routing is done inside)",
                "both router_logits and topk tensors",
            )
        check_tensor("router_logits", router_logits, ndim=2, device=dev)
        if router_logits.shape[0] != T:
            fail("router_logits", f"[T={T}, E]", tuple(router_logits.shape), what="shape")
        E = router_logits.shape[1]
        if num_experts is not None and check_int("num_experts", num_experts, low=1) != E:
            fail("num_experts", f"router_logits.shape[1] = {E}", num_experts)
        if num_experts is None and local_expert_offset == 0 and E_local != E:
            # without expert-parallel arguments the weights are every expert's: a count that differs
            # from the logits' would silently drop experts (or leave weights unused)
            fail(
                "w13",
                f"weights for the {E} experts of router_logits [T, {E}] (w13 [{E}, 2I, H]), or "
                "num_experts / local_expert_offset for one rank's slice (expert parallelism)",
                f"router_logits over {E} experts and w13 for {E_local}",
                what="expert count",
            )
        # route()'s per-call checks, here once (the routing after validation checks nothing again):
        # top_k and the grouping against E, the capture buffer, the replay ids (any strides: the small
        # [T, K] tensor comes back contiguous)
        route_params, replay_ids = validate_routing(
            router_logits, routing, routing_replay_out, replay_ids, check_replay=check_ids, defer=True
        )
        replay_weights = validate_weights(
            router_logits, routing, routing_weights_out, replay_ids, replay_weights, check_ids, defer=True
        )
    else:
        route_params = None
        if topk_ids is None or topk_weights is None:
            fail(
                "topk_ids" if topk_ids is None else "topk_weights",
                "router_logits, or both topk_ids and topk_weights",
                "neither routing given",
            )
        given = [k for k, v in (("routing", routing), ("routing_replay_out", routing_replay_out),
                                ("replay_ids", replay_ids), ("routing_weights_out", routing_weights_out),
                                ("replay_weights", replay_weights)) if v is not None]  # fmt: skip
        if given:
            fail(
                given[0],
                "None when topk_ids/topk_weights are given (routing arguments apply only with router_logits)",
                f"{given[0]} given",
            )
        check_tensor("topk_ids", topk_ids, ndim=2, dtype=_ID_DTYPES, device=dev)
        if topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
            fail("topk_ids", f"[T={T}, K>=1]", tuple(topk_ids.shape), what="shape")
        check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtype=act_dtypes, device=dev)
        E = (
            local_expert_offset + E_local
            if num_experts is None
            else check_int("num_experts", num_experts, low=1)
        )
    if local_expert_offset + E_local > E:
        fail(
            "local_expert_offset",
            f"local_expert_offset + E_local <= num_experts = {E}",
            f"{local_expert_offset} + {E_local}",
        )
    out_dtype = torch.bfloat16 if fp8 else hidden_states.dtype
    if out is not None:
        check_tensor("out", out, shape=(T, H), dtype=out_dtype, device=dev, contiguous=True)
    id_bound = 0
    if router_logits is None:
        # last: global ids in [0, E) of the whole model (ids outside this rank's slice are legal: other
        # ranks own them), -1 for a slot with no expert, no id twice in a row; on the device for the
        # Triton experts on CUDA, else here (the CPU, the torch backend)
        on_device = triton and topk_ids.is_cuda
        topk_ids, id_bound = topk_ids_for_kernels(topk_ids, E, check_ids, on_device=on_device)
    return _Problem(T=T, H=H, I=I, E_local=E_local, fp8=fp8, out_dtype=out_dtype, routing=routing,
                    route_params=route_params, replay_ids=replay_ids, replay_weights=replay_weights,
                    topk_ids=None if router_logits is not None else topk_ids, id_bound=id_bound)  # fmt: skip

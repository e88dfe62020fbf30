"""``replaymoe bench moe --launches``: how many device operations one decode layer call makes.

For each shape, token count and weight type (bf16, fp8 block-scale): the whole layer as the transformers
integration runs it at decode, ``fused_moe`` with the router's logits, routing and capture inside (the
router's ids written into a capture slab, ``routing_replay_out``), counted under the torch profiler.
Every kernel, memset and memcpy the call puts on the device counts as one operation; the rows list
them by name. Issue 63 asks for at most :data:`LAUNCH_GOAL` at T <= 8 (routing, capture, layout, both
GEMMs and the top-k sum). The counts do not depend on timing, so one profiled run of a few calls
suffices.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from ._timing import profile_calls

LAUNCH_GOAL = 3  # device operations per decode layer call at T <= 8 (issue 63, goal 2)
LAUNCH_COLUMNS = ["shape", "T", "dtype", "launches", "within_goal", "kernels"]


def device_ops(fn: Callable[[], object], calls: int = 3) -> tuple[float, list[str]]:
    """The device operations (kernels, memsets, memcpys) per call of ``fn``: ``(count, names)``.

    ``fn`` runs once, then ``calls`` times under the profiler (:func:`._timing.profile_calls`);
    ``count`` is the operations of those calls divided by ``calls`` (a fraction when calls differ) and
    ``names`` one call's worth, in the order first seen, with a suffix ``×n`` where a name repeats within a
    call.
    """
    from torch.autograd import DeviceType

    prof = profile_calls(fn, calls)
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    per_call = Counter(names)
    listed = [f"{n}×{c // calls}" if c // calls > 1 else n for n, c in per_call.items()]
    return len(names) / calls, listed


def run_launches(
    shapes: dict, tokens: list[int], make_weights: Callable, routing_inputs: Callable
) -> list[dict]:
    """One row per (shape, T, dtype): :func:`device_ops` of ``fused_moe`` with routing and capture
    inside. ``shapes``: ``bench moe``'s ``SHAPES``; ``make_weights`` and ``routing_inputs`` its helpers
    (passed in: this module does not import ``bench.moe``)."""
    from ..moe import fused_moe

    rows: list[dict] = []
    for name, (H, inter, E, K, _) in shapes.items():
        weights = {"bf16": make_weights(H, inter, E, fp8=False), "fp8": make_weights(H, inter, E, fp8=True)}
        for T in tokens:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            logits, method, bias, kw, _, _ = routing_inputs(name, T)
            slab = torch.empty(T, K, device="cuda", dtype=torch.int16)  # the capture slab
            rkw = dict(router_logits=logits, top_k=K, method=method, bias=bias, routing_replay_out=slab, **kw)
            for dtype, (w13, w2, s13, s2) in weights.items():
                scales = dict(w13_scale=s13, w2_scale=s2) if dtype == "fp8" else {}

                def call(x=x, w13=w13, w2=w2, scales=scales, rkw=rkw):
                    return fused_moe(x, w13, w2, **scales, **rkw)

                count, kernels = device_ops(call)
                rows.append({"shape": name, "T": T, "dtype": dtype, "launches": count,
                             "within_goal": count <= LAUNCH_GOAL, "kernels": "; ".join(kernels)})  # fmt: skip
                print({k: rows[-1][k] for k in LAUNCH_COLUMNS}, flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows

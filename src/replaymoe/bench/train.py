"""``replaymoe bench train``: training an MoE layer (forward and forward+backward) on the GPU.

Layer rows (routing given: ids from random logits' top-k, weights a softmax over them, bf16 weights
and activations, one expert block), per shape and T, each timed as the median of eager calls with
the L2 flushed (``replaymoe.bench._timing.time_eager``, i.e. ``triton.testing.do_bench``):

* ``grouped_mm``      transformers' ``grouped_mm`` experts function (``transformers.integrations.moe
  .grouped_mm_experts_forward``) on an experts module holding the same weights, as transformers runs
  it in training; autograd through ``torch._grouped_mm``;
* ``rmoe``            :func:`replaymoe.fused_moe` (Triton forward, registered Triton backward);
* ``rmoe_recompute``  the same with ``recompute=True`` (GEMM1 recomputed in the backward);
* ``grouped_mm_recompute``  grouped_mm under ``torch.utils.checkpoint`` (non-reentrant), as a trainer
  with activation checkpointing runs it: the experts' forward recomputed in the backward. It is the
  like-for-like peer of ``rmoe_recompute`` (both trade recomputation for activation memory):
  ``rmoe_recompute`` rows also carry ``fwdbwd_speedup_vs_recompute`` (its time over this row's) and
  ``peak_vs_grouped_mm_recompute``.

``fwd`` is the forward with gradients enabled (what a training step runs), ``fwdbwd`` the forward plus
``torch.autograd.grad`` of all of x, w13, w2 and topk_weights; TFLOP/s count 6·T·K·H·I for the
forward and three times that for forward+backward (recomputation not counted); ``peak_gib`` is
``torch.cuda.max_memory_allocated`` over one forward+backward with the layer's weights, inputs and
output gradient resident (the allocation peak of the call over what was allocated before it, plus
those tensors' bytes). ``err_*`` is the relative norm error of each gradient against grouped_mm's.

HF rows: one training step (forward with labels, backward; no optimizer) of
``replaymoe.hf.models.build_model(arch, "bench")`` in bf16 at ``--batch`` × ``--seq`` tokens, with
transformers' ``grouped_mm`` experts, with :func:`replaymoe.hf.enable` (``replaymoe``) and with
``enable(model, replay=traces)`` replaying traces captured in one forward (``replaymoe+replay``),
timed by the same ``time_eager`` (the L2 flush before each step is ``do_bench``'s own and cannot be
turned off; next to a step of many milliseconds a cold 60 MiB L2 costs little) in ``HF_ROUNDS``
rounds of rotated order, each implementation's timed steps after ``HF_WARMUP_MS`` of untimed ones: the
eager step is bound by the host, whose speed drifts over a run, so the figures are medians over
rounds and the speed-up a median of same-round ratios. ``--checkpointing`` turns on transformers'
gradient checkpointing (``use_reentrant=False``) for every HF row; ``--replay`` runs the
``replaymoe`` row's step inside ``moe.replaying(traces)`` (the traces of a no-grad forward of the
same batch, so that loading and gathering them each step is timed; the backward's recomputes replay
through the session's checkpoint bindings) and drops the ``replaymoe+replay`` row it would repeat;
grouped_mm never replays. Each HF row records ``checkpointing`` and ``replay``. ``--compile [BACKEND]``
steps every HF row through ``torch.compile(model, backend=BACKEND)`` (default inductor): one model per
implementation, enabled once and compiled by its first step (``compile_s``). Every HF row also records
``device_ms``, the GPU's busy time per step (the sum of its kernel times under the torch profiler), and
``device_speedup`` = grouped_mm's ``device_ms`` / the row's: what a host fast enough to keep the GPU busy
would time (the eager step at 4096 tokens is bound by the host; docs/TUNING.md), ``host_ms``, the host's
time to issue one step with the device idle at its start (about ``fwdbwd_ms`` where the host bounds the
step, below it where the device does), and ``held_gib``, the
memory the forward allocated and still holds when the backward starts (activations; with checkpointing,
what the checkpoints keep). The step passes
``use_cache=False``, as trainers do. ``--floor`` adds a ``free_experts`` row: the same model with its
experts replaced by a function that does no expert work (each token's output is its input scaled by its
summed routing weight, so the backward still reaches the routers), transformers' own router, so its
step is the floor that transformers' code around the experts sets on this host and card. Its
``fwdbwd_speedup`` is therefore the ceiling of any experts implementation's speed-up over grouped_mm
in the same run: where it is below a goal, no experts code can meet that goal on this machine.

Usage: ``replaymoe bench train [--out DIR] [--shapes qwen3,mixtral,dsv3] [--tokens 1024,4096,16384]
[--hf-arch qwen3_moe] [--batch 8] [--seq 512] [--rounds 5] [--no-hf] [--checkpointing] [--replay]
[--compile [BACKEND]] [--floor]``.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from ._text import choice_list
from ._timing import BF16_FLOPS_PER_S, print_table, profile_calls, time_eager, write_results

# name -> (H, I, E, K)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "dsv3": (7168, 2048, 64, 8),
}
TOKENS = (1024, 4096, 16384)
GIB = 2**30


class _HFExperts(nn.Module):
    """The attributes transformers' ``grouped_mm_experts_forward`` reads, holding our tensors."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.num_experts = w13.shape[0]
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.gate_up_proj, self.down_proj = w13, w2  # plain tensors (leaves that require grad)
        self.act_fn = F.silu

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _grouped_mm_fn():
    from transformers.integrations.moe import grouped_mm_experts_forward

    def f(x, w13, w2, ids, wts):
        return grouped_mm_experts_forward(_HFExperts(w13, w2), x, ids, wts)

    return f


LAYER_IMPLS = ("grouped_mm", "grouped_mm_recompute", "rmoe", "rmoe_recompute")


def _layer_fn(impl: str):
    """The layer function ``f(x, w13, w2, ids, wts)`` of one of :data:`LAYER_IMPLS`."""
    if impl == "grouped_mm":
        return _grouped_mm_fn()
    if impl == "grouped_mm_recompute":
        from torch.utils.checkpoint import checkpoint

        f = _grouped_mm_fn()
        return lambda *args: checkpoint(f, *args, use_reentrant=False)
    return _rmoe_fn(impl == "rmoe_recompute")


def _rmoe_fn(recompute: bool):
    from ..moe import fused_moe

    def f(x, w13, w2, ids, wts):
        return fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, recompute=recompute, check_ids=False)

    return f


def layer_weights(H, I, E, seed=0):  # noqa: E741
    """bf16 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` on the GPU (leaves requiring grad)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
    for e in range(E):
        w13[e].normal_(0, H**-0.5, generator=g)
        w2[e].normal_(0, I**-0.5, generator=g)
    return w13.requires_grad_(), w2.requires_grad_()


def layer_inputs(T, H, E, K, seed=1):
    """``(x [T, H] bf16, topk_ids [T, K], topk_weights [T, K] fp32, dout [T, H] bf16)`` on the GPU:
    ids from random logits' top-k, weights their softmax; x and the weights require grad."""
    g = torch.Generator(device="cuda").manual_seed(seed + T)
    x = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
    vals, ids = torch.randn(T, E, generator=g, device="cuda").topk(K, dim=1)
    wts = torch.softmax(vals, dim=1).requires_grad_()
    dout = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16)
    return x, ids.to(torch.int32), wts, dout


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _layer_point(name: str, T: int, w13, w2, impls) -> list[dict]:
    H, I, E, K = SHAPES[name]  # noqa: E741
    x, ids, wts, dout = layer_inputs(T, H, E, K)
    leaves = (x, w13, w2, wts)
    flops = 6.0 * T * K * H * I
    resident = sum(t.numel() * t.element_size() for t in (x, w13, w2, ids, wts, dout))
    rows, ref, ref_rc = [], None, None
    for impl in impls:
        f = _layer_fn(impl)

        def fwd(f=f):
            return f(x, w13, w2, ids, wts)

        def fwdbwd(f=f):
            return torch.autograd.grad(f(x, w13, w2, ids, wts), leaves, dout)

        fwdbwd()  # compile / warm up outside the peak measurement
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = fwdbwd()
        torch.cuda.synchronize()
        # peak of one forward+backward over what was allocated before it, plus the resident layer
        peak = (torch.cuda.max_memory_allocated() - before + resident) / GIB
        t_f = time_eager(fwd, warmup_ms=10, rep_ms=300) / 1e3
        t_fb = time_eager(fwdbwd, warmup_ms=10, rep_ms=300) / 1e3
        same = all(torch.equal(a, b) for a, b in zip(grads, fwdbwd()))
        row = {"shape": name, "T": T, "impl": impl, "fwd_ms": t_f, "fwdbwd_ms": t_fb,
               "fwd_tflops": flops / t_f / 1e9, "fwdbwd_tflops": 3 * flops / t_fb / 1e9,
               "fwdbwd_frac_700": 3 * flops / (t_fb * 1e-3) / BF16_FLOPS_PER_S, "peak_gib": peak,
               "bitwise_repeatable": same}  # fmt: skip
        if impl == "grouped_mm_recompute":
            ref_rc = {"fwdbwd": t_fb, "peak": peak}
        if impl == "rmoe_recompute" and ref_rc is not None:
            row["fwdbwd_speedup_vs_recompute"] = ref_rc["fwdbwd"] / t_fb
            row["peak_vs_grouped_mm_recompute"] = peak / ref_rc["peak"]
        if impl == "grouped_mm":
            ref = {"fwd": t_f, "fwdbwd": t_fb, "peak": peak, "grads": grads}
        elif ref is not None:
            row["fwd_speedup"] = ref["fwd"] / t_f
            row["fwdbwd_speedup"] = ref["fwdbwd"] / t_fb
            row["peak_vs_grouped_mm"] = peak / ref["peak"]
            for n, a, b in zip(("dx", "dw13", "dw2", "dwts"), grads, ref["grads"]):
                row[f"err_{n}"] = _rel_err(a, b)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def _layer_rows(name: str, tokens, impls) -> list[dict]:
    H, I, E, K = SHAPES[name]  # noqa: E741
    w13, w2 = layer_weights(H, I, E)
    rows = []
    for T in tokens:
        rows += _layer_point(name, T, w13, w2, impls)
        torch.cuda.empty_cache()
    return rows


HF_ROUNDS = 5  # rounds of the HF rows, each implementation once per round in a rotated order
FREE_EXPERTS = "replaymoe_bench_free"  # the --floor row's experts implementation (ExpertsInterface key)
HF_REP_MS = 500  # timed steps per implementation and round (the host-bound step drifts: more samples)
HF_WARMUP_MS = 250  # untimed steps before each implementation's timed steps in a round


def _free_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``--floor`` row's experts function (transformers' ``ExpertsInterface`` signature): no expert
    work. ``hidden_states [T, H]`` scaled by each token's summed ``top_k_weights [T, K]``, so that the
    router's logits still get a gradient and the step's backward keeps its shape."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def _register_free_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(FREE_EXPERTS, _free_experts_forward)


def _hf_rows(
    arch: str,
    B: int,
    S: int,
    rounds: int = HF_ROUNDS,
    *,
    checkpointing: bool = False,
    replay: bool = False,
    compile: str | None = None,
    size: str = "bench",
    device: str = "cuda",
    floor: bool = False,
) -> list[dict]:
    """The HF training-step rows: each implementation timed once per round, the order rotated
    round to round (a host that slows down over a run no longer penalises the one timed last);
    ``fwdbwd_ms`` is the median over rounds and ``fwdbwd_speedup`` the median of the per-round
    ratios to grouped_mm's step of the same round.

    Parameters
    ----------
    checkpointing : bool
        Gradient checkpointing (non-reentrant) on for every row.
    replay : bool
        The ``replaymoe`` row steps inside ``moe.replaying(traces)``; no ``replaymoe+replay`` row.
    compile : str or None
        A ``torch.compile`` backend (``"inductor"``; graph breaks allowed): every row steps through
        ``torch.compile(model, backend=compile)``, one model
        per implementation (same seed, same weights), enabled once and compiled by its first step
        (``compile_s``), so that rotating the rounds recompiles nothing. No ``replaymoe+replay`` row
        (``replay`` decides whether the ``replaymoe`` row replays).
    size, device : str
        The model's ``build_model`` size and device (``"tiny"`` / ``"cpu"`` for the CPU test).
    floor : bool
        Add the ``free_experts`` row (experts that do no work; the module docstring): the floor of the
        step around the experts, whose speed-up over grouped_mm is the ceiling of any experts code's.
    """
    import statistics

    import replaymoe.hf as rhf
    from replaymoe.hf.models import build_model

    gc.collect()  # the layer rows' buffers, then their cached blocks: the model starts on a clean pool
    torch.cuda.empty_cache()

    def new_model():
        torch.manual_seed(0)
        m = build_model(arch, size, dtype=torch.bfloat16, device=device)
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    if floor:
        _register_free_experts()
    model = new_model()
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (B, S), generator=g).to(device)
    model.set_experts_implementation("grouped_mm")
    cap = rhf.enable(model, capture=True, max_batch_size=B, max_positions=S)
    with torch.no_grad():
        model(input_ids=ids)
    traces = cap.traces()
    cap.disable()

    held: dict[str, float] = {}  # GiB allocated by the forward and still held when the backward starts
    measuring = [None]  # the implementation whose next step records held[...]

    def step_of(m, moe=None):
        def step():
            impl = measuring[0]
            before = torch.cuda.memory_allocated() if impl is not None else 0
            out = m(input_ids=ids, labels=ids, use_cache=False)
            if impl is not None:
                held[impl] = (torch.cuda.memory_allocated() - before) / 2**30
            out.loss.backward()
            model_of[id(m)].zero_grad(set_to_none=True)
            return out.loss.detach()

        if moe is None or not replay:
            return step

        def replayed_step():
            with moe.replaying(traces):
                return step()

        return replayed_step

    model_of = {id(model): model}
    if compile:  # one compiled model per implementation, enabled once: nothing recompiles across rounds
        steps, compile_s, handles = {}, {}, []
        for impl in ("grouped_mm", "replaymoe") + (("free_experts",) if floor else ()):
            m = model if impl == "grouped_mm" else new_model()
            m.set_experts_implementation(FREE_EXPERTS if impl == "free_experts" else "grouped_mm")
            moe = rhf.enable(m) if impl == "replaymoe" else None
            handles.append(moe)
            compiled = torch.compile(m, backend=compile)
            model_of[id(compiled)] = m
            steps[impl] = step_of(compiled, moe)
            t0 = time.perf_counter()
            steps[impl]()
            if device == "cuda":
                torch.cuda.synchronize()
            compile_s[impl] = time.perf_counter() - t0
        impls = list(steps)
        enable = {impl: (lambda: None) for impl in impls}
    else:
        enable = {
            "grouped_mm": lambda: None,
            "replaymoe": lambda: rhf.enable(model),
            "replaymoe+replay": lambda: rhf.enable(model, replay=traces, max_batch_size=B, max_positions=S),
        }
        if replay:  # the replaymoe row replays: the enable(replay=) row would repeat it
            del enable["replaymoe+replay"]
        if floor:
            enable["free_experts"] = lambda: (model.set_experts_implementation(FREE_EXPERTS), None)[1]
        impls = list(enable)

    times: dict[str, list[float]] = {impl: [] for impl in impls}
    losses: dict[str, float] = {}
    device_ms: dict[str, float] = {}
    host_ms: dict[str, float] = {}
    for r in range(rounds):
        for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
            if not compile:
                model.set_experts_implementation("grouped_mm")
            moe = enable[impl]()
            run = steps[impl] if compile else step_of(model, moe)
            try:
                if impl not in losses:
                    losses[impl] = float(run())
                # warm-up of a few steps after each switch of implementation: the first steps of an
                # implementation grow the caching allocator's segments (cudaMalloc, synchronous); the
                # figure is the steady state of a training loop
                times[impl].append(time_eager(run, warmup_ms=HF_WARMUP_MS, rep_ms=HF_REP_MS) / 1e3)
                if r == rounds - 1:
                    host_ms[impl] = _host_ms(run, cuda=device == "cuda")
                if r == rounds - 1 and device == "cuda":
                    device_ms[impl] = _device_ms(run)
                    measuring[0] = impl
                    try:
                        run()
                    finally:
                        measuring[0] = None
            finally:
                if moe is not None:
                    moe.disable()
    if compile:
        for h in handles:
            if h is not None:
                h.disable()
    rows = []
    for impl in impls:
        t = statistics.median(times[impl])
        row = {"shape": f"hf:{arch}", "T": B * S, "impl": impl, "fwdbwd_ms": t,
               "tokens_per_s": B * S / t * 1e3, "loss": losses[impl], "checkpointing": checkpointing,
               "replay": impl == "replaymoe+replay" or (replay and impl.startswith("replaymoe")),
               "compiled": compile or "", "fwdbwd_ms_rounds": times[impl]}  # fmt: skip
        if compile:
            row["compile_s"] = compile_s[impl]
        if impl in host_ms:
            row["host_ms"] = host_ms[impl]
        if impl in device_ms:
            row["device_ms"] = device_ms[impl]
        if impl in held:
            row["held_gib"] = held[impl]
        if impl != "grouped_mm":
            row["fwdbwd_speedup"] = statistics.median(a / b for a, b in zip(times["grouped_mm"], times[impl]))
            if impl in device_ms and "grouped_mm" in device_ms:
                row["device_speedup"] = device_ms["grouped_mm"] / device_ms[impl]
        rows.append(row)
        print(row, flush=True)
    return rows


def _host_ms(run, steps: int = 5, *, cuda: bool = True) -> float:
    """The host's time to issue one ``run()`` in ms: from the call to its return, the device idle at the
    call (a synchronize before each, none inside), median of ``steps``. Next to ``fwdbwd_ms``: a step whose
    host time is about its wall time is bound by the host; one whose host time is well below it, by the
    device (any host synchronization inside the step counts as host time)."""
    import statistics

    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def _device_ms(run, steps: int = 3) -> float:
    """The GPU's busy time per ``run()`` in ms: the sum of its kernels' durations under the torch
    profiler (what the step costs the device with the host's launch gaps taken out: the step a fast
    enough host would time)."""
    prof = profile_calls(run, steps)
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench train", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory for train.csv / train.json")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of token counts")
    p.add_argument("--impls", default=",".join(LAYER_IMPLS), help="comma list of " + ",".join(LAYER_IMPLS))
    p.add_argument("--hf-arch", default="qwen3_moe", help="architecture of the HF training-step rows")
    p.add_argument("--batch", type=int, default=8, help="HF rows: sequences per step")
    p.add_argument("--seq", type=int, default=512, help="HF rows: tokens per sequence")
    p.add_argument("--no-hf", action="store_true", help="skip the HF training-step rows")
    p.add_argument(
        "--rounds",
        type=int,
        default=HF_ROUNDS,
        help=f"HF rows: rounds, each implementation once per round in a rotated order (default {HF_ROUNDS})",
    )
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="HF rows: gradient checkpointing on (non-reentrant) for every implementation",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="HF rows: the replaymoe row steps inside moe.replaying(traces) (traces of a no-grad forward "
        "of the same batch; grouped_mm never replays); no separate replaymoe+replay row",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="HF rows: step through torch.compile(model, backend=BACKEND) (default inductor; one model per "
        "implementation, compiled once)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="HF rows: add a free_experts row (experts that do no work): the floor of the step around the "
        "experts on this machine; its speed-up is the ceiling of any experts implementation's",
    )
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: expected an int >= 1, got {a.rounds}")
    shapes = choice_list(p, a.shapes, SHAPES, "shapes")
    tokens = [int(t) for t in a.tokens.split(",") if t]
    impls = choice_list(p, a.impls, LAYER_IMPLS, "impls")
    if not torch.cuda.is_available():
        print("replaymoe bench train needs a CUDA GPU", file=sys.stderr)
        return 2
    rows: list[dict] = []
    for name in shapes:
        rows += _layer_rows(name, tokens, impls)
        write_results(rows, a.out, "train")
    if not a.no_hf:
        rows += _hf_rows(
            a.hf_arch,
            a.batch,
            a.seq,
            a.rounds,
            checkpointing=a.checkpointing,
            replay=a.replay,
            compile=a.compile,
            floor=a.floor,
        )
    write_results(rows, a.out, "train")
    cols = ["shape", "T", "impl", "fwd_ms", "fwdbwd_ms", "fwdbwd_speedup", "fwdbwd_speedup_vs_recompute",
            "fwdbwd_frac_700", "peak_gib",
            "peak_vs_grouped_mm", "tokens_per_s", "host_ms", "device_ms", "device_speedup", "held_gib",
            "checkpointing", "replay", "compiled", "err_dx", "err_dw13", "bitwise_repeatable"]  # fmt: skip
    print_table(rows, cols)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``replaymoe bench hf``: transformers ``generate`` speed and logits error, replaymoe vs grouped_mm.

One random-weight MoE model (default: Qwen3-MoE with Qwen3-30B-A3B's MoE shape — hidden 2048, 128
experts, top-8, expert width 768 — and 8 layers, bf16) generates ``--new`` tokens greedily after a
``--prompt``-token prompt, per cache mode and batch size, with:

* ``grouped_mm``        transformers' own routers and ``experts_implementation="grouped_mm"``;
* ``replaymoe``         :func:`replaymoe.hf.enable`: routers through the Triton routing kernel,
  experts through the fused Triton MoE kernels;
* ``replaymoe+capture`` the same with routing capture on (traces collected after each generate);
* ``replaymoe+replay``  the same replaying the traces of the capture row in the same cache mode
  (prompt and completion); ``same_tokens_as_rollout`` tells whether it generated the rollout again;
* ``replaymoe/no-graphs`` (only when named in ``--impls``) plain replaymoe with ``enable(...,
  graphs=False)``: every MoE block eager (by default eager decode-size forwards replay each block
  as a CUDA graph, :mod:`replaymoe.hf.graphs`);
* ``replaymoe+rollout`` (only when named) the rollout as ``R3GRPOTrainer`` generates it:
  ``set_rollout_replay(True)``, so each ``generate`` captures and, when it returns, loads its
  traces for the training forwards to replay (matched by content): capture plus what R3 adds
  around ``generate``, without TRL.

``--train-mode`` generates with the models in training mode (under ``no_grad``), as TRL's
``GRPOTrainer`` does with its policy; the fp32 reference of the logits error stays in eval mode.

Cache modes: ``eager`` (the default dynamic cache, no compile) and ``static``
(``cache_implementation="static"``: transformers compiles the decode step, inductor with CUDA
graphs).

Timing: each implementation runs on its own copy of the model (modules copied, weights shared),
and after a warm-up the copies are timed in interleaved rounds: round ``r`` runs one ``generate``
of each implementation in turn (the order rotated by one each round), ``--repeats`` rounds. A
drift of the host's speed (the eager rows are bound by Python launch cost) then falls on every
implementation alike, and the speed-up is the median over rounds of the paired ratio (grouped_mm's
time / this time, same round), with the smallest and largest round beside it. ``vs_replaymoe`` is
the same paired ratio against plain ``replaymoe`` (what capture and replay cost: 0.97 = 3 %
slower), and ``vs_replaymoe_best`` the ratio of the best rounds. An eager row is bound by the
host, whose speed changes in episodes of about a second (every decode step of a ``generate`` then
slower alike, by up to a half), so round totals differ by 10-20 % and a paired median over 20-30
rounds is good to about 2 %. Each decode step is therefore also timed (a no-op logits processor
stamps the host clock once per token): ``step_ms_p10`` is the 10th percentile of every decode step
of the timed rounds, and ``vs_replaymoe_step_p10`` plain replaymoe's over this row's. An episode
only adds time, and hundreds of pooled steps make that percentile steady, so it is the per-step cost
of capture or replay read where the host ran at its own speed (``vs_replaymoe_step_median`` is the
same with the pooled medians).

Reported per row: median wall time of ``generate``, generated tokens/s, the paired speed-up over
``grouped_mm``, graph breaks, recompiles and CUDA-graph skips seen by dynamo/inductor during the
cell's timed rounds, the CUDA graphs captured during the row's own timed rounds
(``cuda_graph_captures``: replaymoe's block graphs and inductor's cudagraph trees; 0 in a steady
state, and a static row above 0 means the compiled decode step was recorded again), and the logits
error: the logits ``generate`` returned at every step against
an fp32 forward of the same weights over the same tokens (``‖Δ‖ / ‖ref‖``; for replay rows the
fp32 forward replays the same traces), so speed and correctness are read together. Static cells
start from a reset dynamo, so every cell compiles its own graphs.

Usage: ``replaymoe bench hf [--out DIR] [--arch qwen3_moe] [--batch 1,8,32] [--prompt 128] [--new 64]
[--modes eager,static] [--impls ...] [--train-mode]`` (or ``python -m replaymoe.bench.hf``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time

import torch

from ._timing import NO_CUDA_EXIT, no_cuda, print_table, write_results
from .hf_timing import GraphCaptureCount, quantile, shared_copy, timed_generate

IMPLS = ("grouped_mm", "replaymoe", "replaymoe+capture", "replaymoe+replay")
OPTIONAL_IMPLS = ("replaymoe/no-graphs", "replaymoe+rollout")
MODES = ("eager", "static")


def _parse(argv):
    from replaymoe.hf.models import ARCHITECTURES, SIZES

    p = argparse.ArgumentParser(prog="replaymoe bench hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory (CSV + JSON)")
    p.add_argument(
        "--arch", default="qwen3_moe", choices=ARCHITECTURES, help="model architecture (default qwen3_moe)"
    )
    p.add_argument(
        "--size",
        default="bench",
        choices=sorted(SIZES),
        help="model size (default bench: Qwen3-30B-A3B's MoE shape, 8 layers)",
    )
    p.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds, each one generate per implementation (default 5)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of eager, static")
    p.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS + OPTIONAL_IMPLS)
    )
    p.add_argument("--no-error", action="store_true", help="skip the fp32 logits-error column")
    p.add_argument(
        "--train-mode", action="store_true", help="generate in training mode (under no_grad), as TRL does"
    )
    args = p.parse_args(argv)
    args.impl_list = [s for s in args.impls.split(",") if s]
    args.mode_list = [s for s in args.modes.split(",") if s]
    for name, got, allowed in (
        ("--impls", args.impl_list, IMPLS + OPTIONAL_IMPLS),
        ("--modes", args.mode_list, MODES),
    ):
        bad = [x for x in got if x not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    try:
        args.batches = [int(b) for b in args.batch.split(",") if b]
        if any(b < 1 for b in args.batches):
            raise ValueError(args.batch)
    except ValueError:
        p.error(f"--batch: expected comma-separated positive integers, got {args.batch!r}")
    for name, got in (("--batch", args.batches), ("--impls", args.impl_list), ("--modes", args.mode_list)):
        if not got:
            p.error(f"{name}: expected at least one entry, got none")
    return args


def _block_captures(session) -> int:
    """MoE-block CUDA graphs a session has captured so far (:mod:`replaymoe.hf.graphs`)."""
    return session.block_graph_captures


def _logits_error(model, ref_model, ids, mask, new, mode, traces=None):
    """‖generate's step logits − fp32 teacher-forced logits‖ / ‖fp32‖ over all generated steps.

    The fp32 forward routes natively, or replays ``traces`` (routers forced, transformers' own fp32
    experts) when the measured implementation replays them.
    """
    import replaymoe.hf as rhf

    _, out, _ = timed_generate(model, ids, mask, new, mode, output_logits=True, return_dict_in_generate=True)
    got = torch.stack(out.logits, dim=1).float()  # [B, new, V]
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1] :])], dim=1)
    ref_moe = None if traces is None else rhf.enable(ref_model, replay=traces, experts=False)
    try:
        with torch.no_grad():
            ref = ref_model(input_ids=seq, attention_mask=full_mask).logits.float()
    finally:
        if ref_moe is not None:
            ref_moe.disable()
    ref = ref[:, ids.shape[1] - 1 : -1]
    return float((got - ref).norm() / ref.norm())


def _counters():
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), sum(counters["recompiles"].values())


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class _SkipLog(logging.Handler):
    """Keeps inductor's "skipping cudagraphs due to ..." messages (why a compiled step is not graphed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "skipping cudagraphs" in msg:
            self.messages.append(msg.splitlines()[0][:200])


def _raise_recompile_limit(n_copies: int) -> None:
    """One compiled decode step per model copy shares the model class's code objects: let dynamo
    keep them all (its default limit is 8 entries per code object)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 4 * n_copies))


def _bench_cell(
    copies, ref_model, impls, ids, mask, mode, args, skip_log, *, graphs: GraphCaptureCount
) -> list[dict]:
    """Rows of one (batch, cache mode) cell: every implementation on its own shared-weight copy of
    the model (``copies``: implementation -> model), timed in interleaved rounds (round r times
    each implementation once, in turn), so that drifts of the host's speed fall on all alike.
    ``graphs``: the CUDA-graph capture counter main has entered (a row's ``cuda_graph_captures``)."""
    import replaymoe.hf as rhf

    B = ids.shape[0]
    cap = {"max_batch_size": B, "max_positions": args.prompt + args.new}
    if mode == "static":
        torch._dynamo.reset()  # the cell compiles its own graphs
    sessions: dict = {}
    traces = rollout = None
    try:
        if "replaymoe+replay" in impls:  # the rollout to replay: captured in this mode
            moe = rhf.enable(copies["replaymoe+replay"], capture=True, **cap)
            timed_generate(copies["replaymoe+replay"], ids, mask, args.new, mode)
            _, rollout, _ = timed_generate(copies["replaymoe+replay"], ids, mask, args.new, mode)
            rollout, traces = rollout[:, ids.shape[1] :], moe.traces()[-B:]
            moe.disable()
            if mode == "static":
                torch._dynamo.reset()
        for impl in impls:
            if impl.startswith("replaymoe"):
                sessions[impl] = rhf.enable(
                    copies[impl],
                    capture=impl == "replaymoe+capture",
                    replay=traces if impl == "replaymoe+replay" else None,
                    graphs=impl != "replaymoe/no-graphs",
                    **cap,
                )
                if impl == "replaymoe+rollout":
                    sessions[impl].set_rollout_replay(True)
        skips0 = _cudagraph_skips()
        skip_log.messages.clear()
        # a short first warm-up generate eagerly (block graphs, autotune); none with a static cache,
        # where another length means another cache size: one more compile and graph, never used again
        first = args.new if mode == "static" else min(8, args.new)
        for impl in impls:  # warm-up: compile, autotune, allocator
            timed_generate(copies[impl], ids, mask, first, mode)
            timed_generate(copies[impl], ids, mask, args.new, mode)
            if impl in sessions:
                sessions[impl].traces()
        breaks0, recompiles0 = _counters()
        captures0 = {impl: _block_captures(s) for impl, s in sessions.items()}
        times: dict = {impl: [] for impl in impls}
        steps: dict = {impl: [] for impl in impls}  # every decode step of every timed round
        graph_captures: dict = {impl: 0 for impl in impls}  # CUDA graphs captured in its timed rounds
        outs: dict = {}
        for r in range(args.repeats):
            # rotated order: no implementation always runs right after the same other one
            for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
                before = graphs.count
                dt, out, step_s = timed_generate(copies[impl], ids, mask, args.new, mode)
                graph_captures[impl] += graphs.count - before
                times[impl].append(dt)
                steps[impl] += step_s
                outs[impl] = out[:, ids.shape[1] :]
                if impl == "replaymoe+capture":
                    got = sessions[impl].traces()
                    assert len(got) == B and got[0].num_tokens == args.prompt + args.new - 1
        breaks1, recompiles1 = _counters()
        captures = {impl: _block_captures(s) - captures0[impl] for impl, s in sessions.items()}
        skips = _cudagraph_skips() - skips0
        errors = {}
        for impl in impls:
            errors[impl] = float("nan")
            if ref_model is not None:
                errors[impl] = _logits_error(
                    copies[impl], ref_model, ids, mask, args.new, mode,
                    traces if impl == "replaymoe+replay" else None,
                )  # fmt: skip
                if impl in sessions:
                    sessions[impl].traces()
    finally:
        for moe in sessions.values():
            moe.disable()
    rows = []
    base = times.get("grouped_mm")
    plain_impl = "replaymoe"
    plain = times.get(plain_impl)
    for impl in impls:
        t, t_best = statistics.median(times[impl]), min(times[impl])
        paired = [b / x for b, x in zip(base, times[impl])] if base else [float("nan")]
        vs_plain = [p / x for p, x in zip(plain, times[impl])] if plain else [float("nan")]
        toks = outs[impl]
        row = {
            "arch": args.arch,
            "size": args.size,
            "mode": mode,
            "impl": impl,
            "batch": B,
            "prompt": args.prompt,
            "new_tokens": args.new,
            "train_mode": args.train_mode,
            "generate_s": t,
            "tokens_per_s": B * args.new / t,
            # median over rounds of (grouped_mm time / this time) in the same round
            "speedup_vs_grouped_mm": statistics.median(paired),
            "speedup_min_round": min(paired),
            "speedup_max_round": max(paired),
            # median over rounds of (plain replaymoe's time / this time) in the same round
            "vs_replaymoe": statistics.median(vs_plain),
            "generate_s_best": t_best,
            # best round of plain replaymoe / best round of this (host-speed episodes only add time)
            "vs_replaymoe_best": (min(plain) / t_best) if plain else float("nan"),
            "round_s": [round(x, 5) for x in times[impl]],  # this row's time in each round, in order
            # decode steps pooled over the timed rounds: their median and 10th percentile (ms)
            "step_ms_median": statistics.median(steps[impl]) * 1e3,
            "step_ms_p10": quantile(steps[impl], 0.1) * 1e3,
            # plain replaymoe's step percentile / this row's: the per-step cost of capture or replay
            # read where the host ran at its own speed (a slow-host episode only adds time, and
            # pooling hundreds of steps makes the 10th percentile steady where round totals are not)
            "vs_replaymoe_step_p10": (
                quantile(steps[plain_impl], 0.1) / quantile(steps[impl], 0.1) if plain else float("nan")
            ),
            "vs_replaymoe_step_median": (
                statistics.median(steps[plain_impl]) / statistics.median(steps[impl])
                if plain
                else float("nan")
            ),
            "speedup_vs_grouped_mm_step_p10": (
                quantile(steps["grouped_mm"], 0.1) / quantile(steps[impl], 0.1) if base else float("nan")
            ),
            # MoE-block CUDA graphs captured during the timed rounds (0 in a steady state)
            "block_graph_captures": captures.get(impl, 0),
            # every CUDA graph captured in this row's timed rounds (block graphs and inductor's
            # cudagraph trees; 0 in a steady state, > 0 where the compiled step was re-recorded)
            "cuda_graph_captures": graph_captures[impl],
            "speedup_best_vs_best": (min(base) / t_best) if base else float("nan"),
            "logits_rel_err_vs_fp32": errors[impl],
            "same_tokens_as_grouped_mm": (
                float((toks == outs["grouped_mm"]).float().mean()) if "grouped_mm" in outs else float("nan")
            ),
            # replay of the rollout: the tokens it generates again (1.0 = all)
            "same_tokens_as_rollout": (
                float((toks == rollout).float().mean()) if impl == "replaymoe+replay" else float("nan")
            ),
            # counted over the whole cell's timed rounds (all implementations)
            "graph_breaks": breaks1 - breaks0,
            "cudagraph_skips": skips,
            "recompiles": recompiles1 - recompiles0,
        }
        rows.append(row)
        print(
            f"  batch {B:3d} {mode:6s} {impl:18s} {t:7.3f} s  {row['tokens_per_s']:9.1f} tok/s  "
            f"x{row['speedup_vs_grouped_mm']:.2f} (rounds {row['speedup_min_round']:.2f}-"
            f"{row['speedup_max_round']:.2f})  vs replaymoe x{row['vs_replaymoe']:.3f} "
            f"(best {row['vs_replaymoe_best']:.3f}, step p10 {row['vs_replaymoe_step_p10']:.3f}, "
            f"step median {row['vs_replaymoe_step_median']:.3f})  "
            f"err {errors[impl]:.2e}  "
            f"breaks {row['graph_breaks']} recompiles {row['recompiles']} cudagraph skips {skips}  "
            f"block graphs captured {row['block_graph_captures']}, "
            f"all CUDA graphs {row['cuda_graph_captures']}",
            flush=True,
        )
    for msg in sorted(set(skip_log.messages)):
        print(f"    inductor: {msg}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)  # bad arguments exit (2) here, before the GPU is looked for
    if no_cuda("replaymoe bench hf"):
        return NO_CUDA_EXIT
    from replaymoe.hf.models import build_model

    batches, impls, modes = args.batches, args.impl_list, args.mode_list
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(args.arch, args.size, dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation("grouped_mm")
    ref_model = None
    if not args.no_error:
        ref_model = copy.deepcopy(model).float()
        ref_model.set_experts_implementation("eager")
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {type(model).__name__} {args.size}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, {n_params / 1e9:.2f}B params bf16 (built in "
        f"{time.perf_counter() - t0:.1f} s); prompt {args.prompt}, new {args.new}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        flush=True,
    )
    skip_log = _SkipLog()
    logging.getLogger("torch._inductor").addHandler(skip_log)
    _raise_recompile_limit(len(impls))
    # made before any generate: a copy must not inherit another copy's compiled call or cache
    copies = {impl: (model if impl == "grouped_mm" else shared_copy(model)) for impl in impls}
    for m in copies.values():
        m.train(args.train_mode)
    g = torch.Generator().manual_seed(1)
    rows = []
    with GraphCaptureCount() as graphs:
        for B in batches:
            ids = torch.randint(3, cfg.vocab_size, (B, args.prompt), generator=g).cuda()
            mask = torch.ones_like(ids)
            for mode in modes:
                rows += _bench_cell(copies, ref_model, impls, ids, mask, mode, args, skip_log, graphs=graphs)
                # written after every cell: a run cut short (a time limit) keeps the cells it finished
                csv_path, json_path = write_results(rows, args.out, "hf_generate")
    print()
    print_table(
        rows,
        [
            "mode",
            "impl",
            "batch",
            "tokens_per_s",
            "speedup_vs_grouped_mm",
            "speedup_min_round",
            "speedup_max_round",
            "vs_replaymoe",
            "vs_replaymoe_best",
            "step_ms_p10",
            "vs_replaymoe_step_p10",
            "vs_replaymoe_step_median",
            "speedup_vs_grouped_mm_step_p10",
            "logits_rel_err_vs_fp32",
            "same_tokens_as_grouped_mm",
            "same_tokens_as_rollout",
            "graph_breaks",
            "recompiles",
            "cudagraph_skips",
            "cuda_graph_captures",
        ],
    )
    print(f"\nwrote {csv_path} and {json_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

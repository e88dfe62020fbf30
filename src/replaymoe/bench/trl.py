"""``replaymoe bench trl``: TRL GRPO training steps, stock against replaymoe and R3, on the GPU, with
where each step's time goes.

Three trainers on the same :func:`replaymoe.hf.models.build_model` model (bf16, ``--size``), the
same in-memory prompts, tokenizer and reward (:mod:`replaymoe.bench.trl_workload`) and the same
``GRPOConfig`` (one generation and one optimizer step per training step: generation, scoring,
loss forward and backward, AdamW):

* ``grouped_mm``  ``trl.GRPOTrainer`` with transformers' ``grouped_mm`` experts (stock);
* ``replaymoe``   ``trl.GRPOTrainer`` after :func:`replaymoe.hf.enable` (fused routing and experts,
  no capture, no replay);
* ``r3``          :class:`replaymoe.integrations.trl.R3GRPOTrainer` (capture in generate, replay in
  every scoring and loss forward and their recomputes, mismatch counters on).

**Alternating.** The trainers are built first, then each ``trainer.train()`` runs in its own thread
and a turn passes between them at every step's start: step 1 of each, then step 2 of each, and so
on, one trainer on the GPU at a time. So a drift of the card (clocks, heat, another tenant) touches
every trainer alike. The first ``--warmup`` steps of each are not counted. Trainers too big to share
the card run one after the other (``--sequential``), in ``--rounds`` rounds of fresh trainers whose
order is reversed every other round (each round's warm-up steps are not counted either).

**Where the step goes.** TRL times its own sections (``trl.extras.profiling``: generation, the
scoring forwards, the rewards, the loss forward); this benchmark reads them, with a device
synchronize at each section's start and end so a section's time is its work, not its launches, and
adds the backward (``accelerator.backward``) and the optimizer step. Each section's time is its own
(time in a nested section counts there, not in its parent), and the scoring forwards run inside
the loss forward count as the loss forward. ``rest`` is the step less every section: data, advantages,
gradient clipping, logging (R3's mismatch read) and host time between sections. The step runs
from one step's start to the next (its logging included), synchronized at both ends; the
synchronizes cost every trainer alike, and make the figures a little slower than TRL's own
unsynchronized ``step_time``.

Reported per trainer: median step and median of each section (ms), ``speedup_vs_stock``
(grouped_mm's median step over this one's), and for r3 ``generate_vs_enable`` (its median
generation over replaymoe's: the cost of capture inside TRL's generate; the goal is <= 1.05) and
``r3_overhead`` (step over replaymoe's, minus 1). Needs CUDA and the ``trl`` extra (``--device cpu``:
a smoke run only).

**Loss curve** (``--loss-curve``, instead of the timing): :class:`~replaymoe.integrations.trl.R3GRPOTrainer`
trains twice from the same seed and the same initial weights, once with ``R3Config(replay="ids")`` (R3:
the rollout's expert ids, the weights from the policy's router) and once with
``R3Config(replay="ids+weights")`` (full recall: the rollout's combine weights too, no gradient to the
router through them), ``--steps`` steps each, every step counted (no warm-up). Read from each
trainer's ``state.log_history`` (``logging_steps=1``), per step and mode: TRL's ``loss``, ``reward``
(the mean), R3's ``r3/native_vs_rollout``, ``r3/replayed_vs_rollout`` and ``r3/fallback``,
``grad_norm`` and ``aux_loss`` (the routers' load-balancing loss, which TRL adds to ``loss`` times the
architecture's ``router_aux_loss_coef``), each empty where a step did not log it. Written to
``trl_loss.csv`` and ``trl_loss.json`` and drawn in ``trl_loss.png`` (loss and reward against the step,
both modes; needs matplotlib, the ``plot`` extra); exit code 1 when a step's ``r3/replayed_vs_rollout``
is not 0 (replay did not hold). ``--impls``, ``--warmup``, ``--rounds`` and ``--sequential`` belong to
the timing and are refused with it. It runs on the CPU too (``--device cpu``).

Usage: ``replaymoe bench trl [--out DIR] [--arch qwen3_moe] [--size bench] [--batch 16]
[--generations 4] [--completion 64] [--steps 5] [--warmup 2] [--rounds 1] [--sequential]
[--checkpointing] [--cache dynamic|static] [--compile-generate] [--lr 1e-6] [--impls ...]
[--device cuda|cpu]``, or
``replaymoe bench trl --loss-curve [--out DIR] [--arch ...] [--size ...] [--batch ...]
[--generations ...] [--completion ...] [--steps 5] [--checkpointing] [--cache ...] [--lr ...]
[--device cuda|cpu]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._text import choice_list
from ._timing import NO_CUDA_EXIT, no_cuda, print_table, write_results

IMPLS = ("grouped_mm", "replaymoe", "r3")

# TRL's section names (after the trainer class's name) -> the column they count in
GENERATE_SECTIONS = ("transformers.generate", "transformers.generate_batch", "vLLM.generate", "sync_weights")
SECTIONS = ("generate", "scoring", "rewards", "loss_forward", "backward", "optimizer", "prepare", "rest")


def section_of(name: str, inside_loss: bool) -> str:
    """The column of a TRL section named ``name`` (``"<TrainerClass>.<what>"``); ``inside_loss``:
    whether it runs inside ``compute_loss``."""
    what = name.split(".", 1)[1] if "." in name else name
    if inside_loss or what == "compute_loss":
        return "loss_forward"
    if what in GENERATE_SECTIONS:
        return "generate"
    if what == "_get_per_token_logps_and_entropies":
        return "scoring"
    if what == "_prepare_inputs":
        return "prepare"
    return "rewards"  # _calculate_rewards and each reward function's own section


@dataclass
class StepClock:
    """One trainer's sections and steps (seconds), filled by the hooks below on its own thread."""

    sync: Callable[[], None]
    steps: list[float] = field(default_factory=list)
    timed: list[bool] = field(default_factory=list)  # per step: False for a run's warm-up steps
    warmup_left: int = 0  # steps of the current run still to be marked warm-up
    starts: list[float] = field(default_factory=list)  # perf_counter at each step's start
    sections: list[dict[str, float]] = field(default_factory=list)
    _current: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _stack: list[list] = field(default_factory=list)  # [column, start, time in nested sections]
    _step_start: float | None = None

    def enter(self, column: str) -> None:
        self.sync()
        self._stack.append([column, time.perf_counter(), 0.0])

    def exit(self) -> None:
        self.sync()
        column, start, nested = self._stack.pop()
        spent = time.perf_counter() - start
        self._current[column] += spent - nested
        if self._stack:
            self._stack[-1][2] += spent

    def inside(self, column: str) -> bool:
        return any(frame[0] == column for frame in self._stack)

    def start_step(self) -> None:
        self.sync()
        self._current = defaultdict(float)
        self._step_start = time.perf_counter()
        self.starts.append(self._step_start)

    def end_step(self) -> None:
        if self._step_start is None:
            return
        self.sync()
        step = time.perf_counter() - self._step_start
        self._step_start = None
        row = {c: self._current.get(c, 0.0) for c in SECTIONS if c != "rest"}
        row["rest"] = step - sum(row.values())
        self.steps.append(step)
        self.sections.append(row)
        self.timed.append(self.warmup_left == 0)
        self.warmup_left = max(self.warmup_left - 1, 0)


_clocks = threading.local()  # .clock: the StepClock of the trainer running on this thread


@contextmanager
def _trl_sections_timed() -> Iterator[None]:
    """While open: TRL's ``ProfilingContext`` also times into the running thread's clock."""
    from trl.extras.profiling import ProfilingContext

    enter, exit_ = ProfilingContext.__enter__, ProfilingContext.__exit__

    def timed_enter(self: Any) -> Any:
        clock = getattr(_clocks, "clock", None)
        if clock is not None:
            clock.enter(section_of(self.name, clock.inside("loss_forward")))
        return enter(self)

    def timed_exit(self: Any, *exc: Any) -> Any:
        out = exit_(self, *exc)
        clock = getattr(_clocks, "clock", None)
        if clock is not None:
            clock.exit()
        return out

    ProfilingContext.__enter__, ProfilingContext.__exit__ = timed_enter, timed_exit  # type: ignore[method-assign]
    try:
        yield
    finally:
        ProfilingContext.__enter__, ProfilingContext.__exit__ = enter, exit_  # type: ignore[method-assign]


class Turns:
    """Whose step runs: trainer ``i`` waits at its step's start until the turn is ``i``; ending a step
    hands the turn to the next trainer still training. Nobody starts before every trainer has
    reached its first step (or died)."""

    def __init__(self, n: int):
        self.n, self.turn, self.arrived = n, 0, 0
        self.alive = [True] * n
        self.cond = threading.Condition()

    def _pass_on(self, i: int) -> None:
        for j in range(1, self.n + 1):
            if self.alive[(i + j) % self.n]:
                self.turn = (i + j) % self.n
                return

    def wait(self, i: int, first: bool) -> None:
        with self.cond:
            if first:
                self.arrived += 1
            else:
                self._pass_on(i)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == i and self.arrived + self.alive.count(False) >= self.n)

    def done(self, i: int, arrived: bool) -> None:
        with self.cond:
            self.alive[i] = False
            if not arrived:
                self.arrived += 1
            if self.turn == i:
                self._pass_on(i)
            self.cond.notify_all()


def _clock_callback(i: int, clock: StepClock, turns: Turns) -> Any:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        started = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end_step()  # the previous step, its logging included
            turns.wait(i, first=not self.started)
            self.started = True
            clock.start_step()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.enter("optimizer")

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.exit()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end_step()

    return Clock()


def _build(impl: str, a: argparse.Namespace, out: str) -> tuple[Any, Any]:
    """``impl``'s trainer on a fresh model, and its replaymoe handle (``replaymoe`` only)."""
    import trl
    from transformers.trainer_callback import PrinterCallback

    from replaymoe.bench.trl_workload import make_trainer
    from replaymoe.hf import enable
    from replaymoe.hf.models import build_model
    from replaymoe.integrations.trl import R3Config, R3GRPOTrainer

    model = build_model(a.arch, a.size, device=a.device, dtype=torch.bfloat16)
    if impl == "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    cls = R3GRPOTrainer if impl == "r3" else trl.GRPOTrainer
    r3 = {"r3": R3Config(compile_generate=True)} if impl == "r3" and a.compile_generate else None
    config = _grpo_config(a, max_steps=a.warmup + a.steps)
    config["cache_implementation"] = None if _cache(impl, a) == "dynamic" else a.cache
    trainer = make_trainer(cls, model, out, trainer_kwargs=r3, **config)
    if impl == "replaymoe" and a.compile_generate:  # as R3Config(compile_generate=True) does
        trainer.generation_config.disable_compile = False
    trainer.remove_callback(PrinterCallback)
    return trainer, enable(trainer.model) if impl == "replaymoe" else None


def _cache(impl: str, a: argparse.Namespace) -> str:
    """``impl``'s generation cache: ``--cache``, but with ``--compile-generate`` stock runs as TRL
    does by default (a dynamic cache, nothing compiled), the baseline the fast setting is held to."""
    return "dynamic" if impl == "grouped_mm" and a.compile_generate else a.cache


def _grpo_config(a: argparse.Namespace, max_steps: int) -> dict[str, Any]:
    """The ``GRPOConfig`` overrides every trainer here gets (timing and loss curve alike)."""
    return dict(
        max_steps=max_steps,
        per_device_train_batch_size=a.batch,
        num_generations=a.generations,
        max_completion_length=a.completion,
        optim="adamw_torch",
        learning_rate=a.lr,
        bf16=True,
        gradient_checkpointing=a.checkpointing,
        cache_implementation=None if a.cache == "dynamic" else a.cache,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=a.device == "cpu",
    )


def _timed_backward(trainer: Any, clock: StepClock) -> None:
    backward = trainer.accelerator.backward

    def timed(*args: Any, **kwargs: Any) -> Any:
        clock.enter("backward")
        try:
            return backward(*args, **kwargs)
        finally:
            clock.exit()

    trainer.accelerator.backward = timed


def run_rounds(impls: list[str], a: argparse.Namespace) -> dict[str, StepClock]:
    """``a.rounds`` rounds, the trainers' order reversed in every other one; in each, fresh trainers
    train ``a.warmup + a.steps`` steps, all of them alternating step by step
    (:func:`run_alternating`), or with ``a.sequential`` one after the other (when they do not fit
    in memory together). Each trainer's clock holds every round's steps."""
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    clocks = {impl: StepClock(sync) for impl in impls}
    for r in range(a.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for group in [[impl] for impl in order] if a.sequential else [order]:
            for impl in group:
                clocks[impl].warmup_left = a.warmup
            run_alternating(group, a, clocks)
    return clocks


def run_alternating(impls: list[str], a: argparse.Namespace, clocks: dict[str, StepClock]) -> None:
    """Build one trainer per ``impl``, then train them all, one step each in turn (module
    docstring), into their ``clocks``."""
    turns = Turns(len(impls))
    errors: dict[str, BaseException] = {}
    with tempfile.TemporaryDirectory() as out, _trl_sections_timed():
        built = {impl: _build(impl, a, f"{out}/{impl}") for impl in impls}
        callbacks = [_clock_callback(i, clocks[impl], turns) for i, impl in enumerate(impls)]
        for impl, callback in zip(impls, callbacks):
            built[impl][0].add_callback(callback)
            _timed_backward(built[impl][0], clocks[impl])

        def train(i: int, impl: str) -> None:
            _clocks.clock = clocks[impl]
            try:
                built[impl][0].train()
            except BaseException as exc:  # reported after every thread ends
                errors[impl] = exc
            finally:
                turns.done(i, arrived=callbacks[i].started)

        threads = [threading.Thread(target=train, args=(i, impl)) for i, impl in enumerate(impls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _, moe in built.values():
            if moe is not None:
                moe.disable()
        built.clear()  # free the models before the next benchmark
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if errors:
        impl, exc = next(iter(errors.items()))
        raise RuntimeError(f"bench trl: the {impl} trainer failed: {exc!r}") from exc


def summarize(clocks: dict[str, StepClock], a: argparse.Namespace) -> list[dict]:
    """One row per trainer: median step and sections (ms) over the timed steps, and the ratios."""
    rows: list[dict] = []
    med: dict[str, dict[str, float]] = {}
    for impl, clock in clocks.items():
        steps = [t for t, timed in zip(clock.steps, clock.timed) if timed]
        sections = [row for row, timed in zip(clock.sections, clock.timed) if timed]
        m = {"step": statistics.median(steps) if steps else float("nan")}
        m.update(
            {c: statistics.median(s[c] for s in sections) if sections else float("nan") for c in SECTIONS}
        )
        med[impl] = m
        row: dict[str, Any] = {"impl": impl, "steps": len(steps), "step_ms": 1e3 * m["step"]}
        row.update({f"{c}_ms": 1e3 * m[c] for c in SECTIONS})
        row["min_step_ms"] = 1e3 * min(steps, default=float("nan"))
        card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        row.update(
            checkpointing=a.checkpointing,
            cache=_cache(impl, a),
            compile_generate=a.compile_generate and impl != "grouped_mm",  # stock keeps TRL's defaults
            completion=a.completion,
            size=a.size,
            card=card,
        )
        rows.append(row)
    for row in rows:
        if "grouped_mm" in med:
            row["speedup_vs_stock"] = med["grouped_mm"]["step"] / med[row["impl"]]["step"]
        if row["impl"] == "r3" and "replaymoe" in med:
            row["r3_overhead"] = med["r3"]["step"] / med["replaymoe"]["step"] - 1
            row["generate_vs_enable"] = med["r3"]["generate"] / med["replaymoe"]["generate"]
    return rows


# --loss-curve: R3's two replay modes, and what is read of each step's log (keys as TRL and
# R3GRPOTrainer.log write them)
LOSS_MODES = ("ids", "ids+weights")
MODE_LABELS = {"ids": "ids (R3)", "ids+weights": "ids+weights (full recall)"}
MISMATCH_KEYS = ("r3/native_vs_rollout", "r3/replayed_vs_rollout", "r3/fallback")
LOGGED_KEYS = ("loss", "reward", *MISMATCH_KEYS, "grad_norm", "aux_loss")


def loss_rows(log_history: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """One row per logged training step of a trainer's ``state.log_history`` (``logging_steps=1``):
    ``step``, ``mode`` and :data:`LOGGED_KEYS` (None where the step did not log the key)."""
    rows = []
    for entry in log_history:
        if "loss" not in entry:  # the run's summary (train_loss, train_runtime, ...), or an eval
            continue
        rows.append({"step": entry["step"], "mode": mode, **{k: entry.get(k) for k in LOGGED_KEYS}})
    return rows


def _weights_sum(model: Any) -> float:
    """A fingerprint of the initial weights (both modes must start from the same ones)."""
    with torch.no_grad():
        return float(sum(p.sum(dtype=torch.float64) for p in model.parameters()))  # no fp64 copies


def run_loss_curve(a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Train :class:`R3GRPOTrainer` ``a.steps`` steps in each of :data:`LOSS_MODES`, one after the other,
    each on a fresh model of the same seed (same weights) with the same ``GRPOConfig`` (seed 0).
    Returns the :func:`loss_rows` of both runs and each run's wall time (``train()``, seconds)."""
    from transformers.trainer_callback import PrinterCallback

    from replaymoe.bench.trl_workload import make_trainer
    from replaymoe.hf.models import build_model
    from replaymoe.integrations.trl import R3Config, R3GRPOTrainer

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    start_weights: dict[str, float] = {}
    for mode in LOSS_MODES:
        model = build_model(a.arch, a.size, device=a.device, dtype=torch.bfloat16)
        start_weights[mode] = _weights_sum(model)
        with tempfile.TemporaryDirectory() as out:
            trainer = make_trainer(
                R3GRPOTrainer,
                model,
                out,
                trainer_kwargs={"r3": R3Config(replay=mode)},
                **_grpo_config(a, max_steps=a.steps),
            )
            trainer.remove_callback(PrinterCallback)
            sync()
            t0 = time.perf_counter()
            trainer.train()
            sync()
            seconds[mode] = time.perf_counter() - t0
            rows += loss_rows(trainer.state.log_history, mode)
        del trainer, model  # free the model before the next mode's
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(set(start_weights.values())) != 1:
        raise RuntimeError(
            f"bench trl --loss-curve: the modes started from different weights: {start_weights}"
        )
    return rows, seconds


def plot_loss_curve(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """``rows`` (:func:`loss_rows` of both modes) as two panels against the step: loss, and mean reward."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    panels = fig.subplots(1, 2)
    styles = {"ids": dict(marker="o", linestyle="-"), "ids+weights": dict(marker="x", linestyle="--")}
    for ax, key, label in zip(panels, ("loss", "reward"), ("GRPO loss (TRL's loss)", "mean reward")):
        for mode in LOSS_MODES:
            mine = [r for r in rows if r["mode"] == mode]
            values = [float("nan") if r[key] is None else r[key] for r in mine]
            ax.plot([r["step"] for r in mine], values, label=MODE_LABELS[mode], **styles.get(mode, {}))
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def _print_loss_table(rows: list[dict[str, Any]], seconds: dict[str, float]) -> None:
    """Per step: loss, reward, native_vs_rollout, replayed_vs_rollout and grad_norm of each mode."""
    short = {"ids": "ids", "ids+weights": "full"}
    columns = [("loss", "loss"), ("reward", "reward"), ("r3/native_vs_rollout", "native"),
               ("r3/replayed_vs_rollout", "replayed"), ("grad_norm", "grad")]  # fmt: skip
    by_step: dict[int, dict[str, Any]] = defaultdict(dict)
    for r in rows:
        line = by_step[r["step"]]
        line["step"] = r["step"]
        for key, name in columns:
            line[f"{name}:{short[r['mode']]}"] = "" if r[key] is None else r[key]
    header = ["step", *(f"{name}:{short[m]}" for _, name in columns for m in LOSS_MODES)]
    print_table([by_step[s] for s in sorted(by_step)], header)
    print("  ".join(f"{short[m]} = {m}: {seconds[m]:.1f} s" for m in LOSS_MODES))


def loss_curve_main(a: argparse.Namespace) -> int:
    """``--loss-curve``: train both modes, write ``trl_loss.csv`` / ``.json`` / ``.png``, print them."""
    import matplotlib  # noqa: F401  (before the runs: a missing plot extra fails at once, exit 2)

    rows, seconds = run_loss_curve(a)
    card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    for row in rows:
        row.update(arch=a.arch, size=a.size, lr=a.lr, seconds=seconds[row["mode"]], card=card)
    csv_path, _ = write_results(rows, a.out, "trl_loss")
    png_path = Path(a.out) / "trl_loss.png"
    title = (f"R3GRPOTrainer, {a.arch} {a.size}, {a.batch} rows x {a.completion} tokens, "
             f"AdamW lr {a.lr:g}, {card}")  # fmt: skip
    plot_loss_curve(rows, png_path, title)
    _print_loss_table(rows, seconds)
    print(f"wrote {csv_path} and {png_path}")
    broken = [r for r in rows if (r["r3/replayed_vs_rollout"] or 0) > 0]
    if broken:
        print(f"replaymoe bench trl: replay did not hold: r3/replayed_vs_rollout > 0 at {len(broken)} "
              f"step(s) (first: {broken[0]['mode']}, step {broken[0]['step']})", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench trl", description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        default="bench_results",
        help="output directory for trl.csv / trl.json (--loss-curve: trl_loss.csv / .json / .png)",
    )
    p.add_argument(
        "--loss-curve",
        action="store_true",
        help="instead of the timing: R3GRPOTrainer with replay 'ids' and 'ids+weights', same seed and "
        "weights, --steps steps each; loss, reward, R3's mismatch and grad norm per step",
    )
    p.add_argument("--arch", default="qwen3_moe", help="model architecture (replaymoe.hf.models)")
    p.add_argument("--size", default="bench", help="model size (replaymoe.hf.models.SIZES; default bench)")
    p.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (rows per step)")
    p.add_argument("--generations", type=int, default=4, help="num_generations (completions per prompt)")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per trainer (--loss-curve: steps per mode)"
    )
    # the timing's own options: None when not given, so that --loss-curve can refuse them
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2)")
    p.add_argument(
        "--rounds", type=int, help="rounds of fresh trainers (order reversed every other; default 1)"
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="in each round, one trainer after the other (trainers too big to share the card)",
    )
    p.add_argument("--impls", help="comma list of " + ",".join(IMPLS) + " (default: all)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="generation's KV cache (GRPOConfig.cache_implementation; TRL's default)")  # fmt: skip
    p.add_argument("--compile-generate", action="store_true",
                   help="with --cache static: replaymoe's and R3's generate compiled by transformers "
                   "(R3Config(compile_generate=True)); stock runs TRL's defaults (dynamic cache, no "
                   "compile)")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (cpu: a smoke run of the timing; --loss-curve runs there too)")  # fmt: skip
    a = p.parse_args(argv)
    if a.loss_curve:
        timing_only = {"--impls": a.impls is not None, "--warmup": a.warmup is not None,
                       "--rounds": a.rounds is not None, "--sequential": a.sequential}  # fmt: skip
        given = [flag for flag, on in timing_only.items() if on]
        if given:
            p.error(
                f"--loss-curve trains R3GRPOTrainer in its two replay modes, every step counted: "
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the timing comparison only"
            )
    if a.compile_generate and (a.cache != "static" or a.loss_curve):
        p.error("--compile-generate needs --cache static (transformers compiles generate with a static cache "
                "only) and the timing, not --loss-curve")  # fmt: skip
    a.warmup = 2 if a.warmup is None else a.warmup
    a.rounds = 1 if a.rounds is None else a.rounds
    for name in ("steps", "batch", "generations", "completion", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be at least 0, got {a.warmup}")
    if not a.lr > 0:
        p.error(f"--lr must be positive, got {a.lr}")
    impls = choice_list(p, ",".join(IMPLS) if a.impls is None else a.impls, IMPLS, "impls")
    if a.device == "cuda" and no_cuda("replaymoe bench trl"):
        return NO_CUDA_EXIT
    if a.loss_curve:
        return loss_curve_main(a)
    rows = summarize(run_rounds(impls, a), a)
    write_results(rows, a.out, "trl")
    columns = ["impl", "step_ms", *(f"{c}_ms" for c in SECTIONS), "steps", "speedup_vs_stock"]
    print_table(rows, [*columns, "generate_vs_enable", "r3_overhead"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rollout routing replay (R3) in TRL: ``R3GRPOTrainer`` is ``trl.GRPOTrainer`` whose MoE routing in
every training-side forward is the rollout's.

Replace the class, keep the arguments::

    from replaymoe.integrations.trl import R3GRPOTrainer
    trainer = R3GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()

What it does, on top of :func:`replaymoe.hf.enable`:

* the policy runs its routers and experts through replaymoe, in rollout-replay mode
  (:meth:`~replaymoe.hf.ReplayMoE.set_rollout_replay`): TRL's ``generate`` captures, and every
  later forward -- old log-probs, reference log-probs, the loss forward and its gradient-checkpoint
  recomputes -- replays the rollout's experts. Rows are matched to the rollout by content, so TRL's
  shuffling, micro-batch split and ``batch_size`` scoring chunks need nothing;
* the reference model (``beta > 0``) is attached to the same handle and replays the same traces
  (``R3Config(replay_reference=False)`` leaves its routing native);
* the load-balancing aux loss counts the replayed ids (:mod:`replaymoe.hf.aux_loss`);
* ``R3Config(replay="ids+weights")`` (full recall, or "router recall"): ``generate`` also captures each
  token's combine weights, and the training forwards replay them with the ids, so the experts get
  the rollout's exact weights and the router gets no gradient through them (its weights are frozen
  in effect; the aux loss, if on, still reaches it). Transformers generation only: vLLM returns
  expert ids only, so the vLLM colocate mode is refused with it at construction;
* each logging step adds ``r3/native_vs_rollout`` (replayed token-layer lookups whose native
  top-k now differs from the rollout's: how far the policy drifted), ``r3/replayed_vs_rollout``
  (whose used ids differ from the rollout's: 0.0 when replay holds) and ``r3/fallback`` (lookups
  routed natively: each row's last token, never fed back in the rollout) to TRL's metrics.

Generation may be transformers' ``generate`` (captured by replaymoe), transformers' continuous batching
(``use_transformers_continuous_batching=True``: TRL's ``generate_batch`` over its repeated prompts, paged
cache; each request is captured into the round by :mod:`replaymoe.hf._paged`, which turns the manager's
prefix sharing off while it captures; ids only: ``R3Config(replay="ids+weights")`` is refused there at
the first generation) or vLLM in TRL's colocate mode
(``use_vllm=True, vllm_mode="colocate"``): the trainer then starts TRL's engine with
``enable_return_routed_experts=True`` and turns each ``LLM.generate`` output's ``routed_experts`` into
the round's traces (:mod:`replaymoe.integrations.vllm_outputs`): vLLM 0.33's one column per decoder
layer is mapped to the policy's MoE layers by layer number (dense layers' columns must be zero), and
each request's ``routed_experts_prompt_start`` is read from the ``sampling_params`` given to
``generate`` (positions below it replay natively); an engine that returns none is an error at that
generation. TRL's server mode (``vllm_mode="server"``) is refused at start: its ``vllm-serve``
answers with token ids and log-probs only, so the routing never reaches the trainer. So is
``vllm_tensor_parallel_size > 1``: vLLM 0.33 keeps the routing buffer on the first tensor-parallel
rank only, and that set-up has not been run.

Tested with trl 1.7.1 to 1.16.0 (``pip install 'replaymoe[trl]'``; ``scripts/check_range.sh trl`` runs
the TRL tests against each release given); the vLLM colocate path is tested with an in-process
stand-in engine, not a real vLLM.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

try:
    import trl
    import trl.generation.vllm_generation as trl_vllm
except ModuleNotFoundError as _exc:  # the trl extra: say how to install it, keep the missing module's name
    if _exc.name == "trl":
        raise ModuleNotFoundError(
            "replaymoe.integrations.trl needs trl, which is not installed: pip install 'replaymoe[trl]'",
            name=_exc.name,
        ) from _exc
    if (_exc.name or "").startswith("trl."):
        raise ModuleNotFoundError(
            f"replaymoe.integrations.trl needs trl >= 1.7.1 ({_exc.name} is missing from the trl "
            "installed): pip install 'replaymoe[trl]'",
            name=_exc.name,
        ) from _exc
    raise

from replaymoe._backend import BACKENDS
from replaymoe._validation import check_bool, check_choice, fail
from replaymoe.hf import ReplayMoE, enable
from replaymoe.integrations.vllm_outputs import traces_from_vllm_outputs
from replaymoe.record.replay import MISSING_MODES, REPLAY_MODES

__all__ = ["R3Config", "R3GRPOTrainer"]


@dataclass(frozen=True)
class R3Config:
    """Settings of :class:`R3GRPOTrainer`.

    Attributes
    ----------
    replay_reference : bool
        The reference model (``beta > 0``) replays the rollout's experts too (default); False keeps
        its routing native.
    log_mismatch : bool
        Count routing agreement and log it each logging step (one extra routing per replayed layer
        call, one host sync per logging step).
    backend : {"auto", "triton", "torch"}
        replaymoe's backend (``auto``: Triton kernels on CUDA, torch references elsewhere).
    missing : {"error", "native"}
        What replay does with a token the rollout has no routing for (each row's last sampled
        token excepted): raise (default), or route it natively and count it in ``r3/fallback``.
        A vLLM request with ``routed_experts_prompt_start > 0`` (set through ``generation_kwargs``)
        leaves the prompt positions below it without routing: it needs ``"native"``.
    replay : {"ids", "ids+weights"}
        What the training forwards replay: the rollout's expert ids, with weights recomputed from
        the policy's router (R3, the default: the router is trained through the weights), or the
        ids and the rollout's combine weights (full recall: the experts see the rollout's exact
        mixture, and no gradient reaches the router through the weights). ``"ids+weights"`` needs
        transformers generation (vLLM returns expert ids only).
    compile_generate : bool
        Let transformers compile generation's decoding steps (``torch.compile``, CUDA graphs), which
        TRL turns off (``GenerationConfig(disable_compile=True)``). Needs a static KV cache
        (``GRPOConfig(cache_implementation="static")``: transformers compiles nothing else) and
        transformers generation (not vLLM, not continuous batching); capture runs inside the
        compiled steps. Off by default: TRL's setting, until a measurement shows it faster
        (``replaymoe bench trl --cache static --compile-generate``).
    """

    replay_reference: bool = True
    log_mismatch: bool = True
    backend: str = "auto"
    missing: str = "error"
    replay: str = "ids"
    compile_generate: bool = False

    def __post_init__(self) -> None:
        check_bool("replay_reference", self.replay_reference)
        check_bool("log_mismatch", self.log_mismatch)
        check_choice("backend", self.backend, BACKENDS)
        check_choice("missing", self.missing, MISSING_MODES)
        check_choice("replay", self.replay, REPLAY_MODES)
        check_bool("compile_generate", self.compile_generate)


class R3GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with rollout routing replay (module docstring). Same arguments, plus
    ``r3`` (:class:`R3Config`, keyword-only).

    Attributes
    ----------
    r3 : R3Config
    r3_session : replaymoe.hf.ReplayMoE
        The policy's handle (``r3_session.rollout_traces()``: the current rollout's traces).
    r3_reference : replaymoe.hf.ReplayMoE or None
        The reference model's handle, when there is one.
    """

    def __init__(self, *args: Any, r3: R3Config | None = None, **kwargs: Any) -> None:
        if r3 is not None and not isinstance(r3, R3Config):
            fail("r3", "an R3Config or None", type(r3).__name__, what="type")
        self.r3 = r3 or R3Config()
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        use_vllm = bool(getattr(config, "use_vllm", False))
        if use_vllm and getattr(config, "vllm_mode", None) != "colocate":  # before TRL starts an engine
            fail(
                "args.vllm_mode",
                "'colocate' with use_vllm=True (or transformers generation)",
                f"{getattr(config, 'vllm_mode', None)!r}: TRL's vllm-serve returns token ids and log-probs "
                "only, so vLLM's routed_experts never reach the trainer",
            )
        if use_vllm and self.r3.replay == "ids+weights":  # before TRL starts an engine
            fail(
                "r3.replay",
                "'ids' with use_vllm=True (or transformers generation for 'ids+weights')",
                "'ids+weights': vLLM (and SGLang) return expert ids only, not the combine weights",
            )
        paged = bool(getattr(config, "use_transformers_continuous_batching", False))
        if paged and self.r3.replay == "ids+weights":  # before TRL builds anything
            fail(
                "r3.replay",
                "'ids' with use_transformers_continuous_batching=True",
                "'ids+weights': the continuous-batching capture records expert ids only",
            )
        tp = getattr(config, "vllm_tensor_parallel_size", 1)
        if use_vllm and isinstance(tp, int) and tp > 1:  # before TRL starts an engine
            fail(
                "args.vllm_tensor_parallel_size",
                "1 with R3 (vLLM 0.33 keeps routed experts on the first tensor-parallel rank only, "
                "and R3 with vLLM tensor parallelism has not been run)",
                tp,
            )
        if self.r3.compile_generate:  # before TRL builds anything
            _check_compile_generate(config, use_vllm or paged)
        with _engine_returns_routing(use_vllm):
            super().__init__(*args, **kwargs)
        if self.r3.compile_generate:  # TRL builds its GenerationConfig with disable_compile=True
            self.generation_config.disable_compile = False
        policy = self.accelerator.unwrap_model(self.model)
        self.r3_session: ReplayMoE = enable(policy, backend=self.r3.backend)
        self.r3_session.set_rollout_replay(True, missing=self.r3.missing, replay=self.r3.replay)
        if use_vllm:
            self.r3_watch_engine(self.vllm_generation.llm)
        if self.r3.log_mismatch:
            self.r3_session.track_mismatch()
        self.r3_reference: ReplayMoE | None = None
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            self.r3_reference = self.r3_session.attach(reference, replay=self.r3.replay_reference)

    def r3_watch_engine(self, engine: Any) -> None:
        """Route every ``engine.generate`` output's ``routed_experts`` into the rollout round (done for
        TRL's colocated vLLM engine at construction; call it for another in-process engine whose
        ``generate(prompts, sampling_params=None, ...)`` returns vLLM's ``RequestOutput`` objects).

        Each call's ``sampling_params`` (one ``SamplingParams`` or a list, one per prompt;
        positional or keyword) gives each request's ``routed_experts_prompt_start`` (absent on
        older vLLM: 0), which vLLM does not echo in its outputs. The payload's columns are mapped to
        the policy's MoE layers by their layer numbers (``r3_session.layer_ids``)."""
        generate = engine.generate
        session = self.r3_session

        @functools.wraps(generate)
        def generate_and_record(*args: Any, **kwargs: Any) -> Any:
            params = kwargs["sampling_params"] if "sampling_params" in kwargs else (args[1:2] or [None])[0]
            starts = _prompt_starts(params)
            start = max(starts, default=0) if isinstance(starts, list) else starts
            if start and self.r3.missing == "error":  # before generating rows no forward could replay
                fail(
                    "sampling_params.routed_experts_prompt_start",
                    "0 with R3Config(missing='error'): the prompt positions below it have no routing "
                    "to replay (R3Config(missing='native') routes them natively)",
                    start,
                )
            outputs = generate(*args, **kwargs)
            session.add_rollout_traces(
                traces_from_vllm_outputs(
                    outputs,
                    num_experts=session.num_experts,
                    layer_ids=session.layer_ids,
                    prompt_starts=starts,
                )
            )
            return outputs

        engine.generate = generate_and_record

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        """TRL's rollout of a generation batch (train or eval) as a round of its own: the round starts
        here, whatever forwards ran before (compiled ones, an evaluation's), not at a guess."""
        self.r3_session.set_rollout_replay(True, missing=self.r3.missing, replay=self.r3.replay)
        return super()._generate_and_score_completions(inputs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's evaluation (its own rollouts and rounds), then the training round back: with
        ``num_iterations > 1`` or ``steps_per_generation > 1`` the next optimizer steps reuse the
        buffered rollout, whose traces must still be the ones replayed."""
        kept = self.r3_session.rollout_traces()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.r3_session.set_rollout_replay(True, missing=self.r3.missing, replay=self.r3.replay)
            if kept:
                self.r3_session.add_rollout_traces(kept)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's logging, with the routing-agreement metrics of the steps since the last call."""
        if self.r3.log_mismatch and self.model.training:
            stats = self.r3_session.mismatch()
            report = self.r3_session.report()
            if stats["tokens"]:
                logs["r3/native_vs_rollout"] = stats["native_vs_rollout"]
                logs["r3/replayed_vs_rollout"] = stats["replayed_vs_rollout"]
            if report is not None and report.tokens_seen:
                logs["r3/fallback"] = report.fallback_fraction
                self.r3_session.reset_report()
        super().log(logs, start_time)


def _check_compile_generate(config: Any, engine: bool) -> None:
    """``R3Config(compile_generate=True)`` needs transformers generation with a static KV cache."""
    if engine:
        fail(
            "r3.compile_generate",
            "False with use_vllm=True or use_transformers_continuous_batching=True (it compiles "
            "transformers' generate)",
            True,
        )
    cache = getattr(config, "cache_implementation", None)
    if cache != "static":
        fail(
            "r3.compile_generate",
            "GRPOConfig(cache_implementation='static') (transformers compiles generation's decoding "
            "steps with a static KV cache only)",
            f"cache_implementation={cache!r}",
        )


def _prompt_starts(params: Any) -> int | list[int]:
    """``routed_experts_prompt_start`` of ``generate``'s ``sampling_params`` (None, one
    ``SamplingParams`` or a list of them): one int, or one per request; 0 where unset or absent."""

    def one(p: Any) -> int:
        return getattr(p, "routed_experts_prompt_start", None) or 0

    if isinstance(params, (list, tuple)):
        return [one(p) for p in params]
    return one(params)


@contextlib.contextmanager
def _engine_returns_routing(use_vllm: bool) -> Iterator[None]:
    """While TRL builds its colocated engine: ``vllm.LLM`` with ``enable_return_routed_experts=True``."""
    engine = getattr(trl_vllm, "LLM", None)
    if not use_vllm or engine is None:  # (no vllm installed: TRL itself says so)
        yield
        return
    trl_vllm.LLM = functools.partial(engine, enable_return_routed_experts=True)
    try:
        yield
    finally:
        trl_vllm.LLM = engine

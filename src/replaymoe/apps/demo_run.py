"""The run of ``replaymoe demo`` (:mod:`replaymoe.apps.demo` parses the options,
:mod:`replaymoe.apps.demo_inputs` checks the files before the run).

Build the model, generate the rollout with capture, perturb the routers, run the trainer forwards with
native routing and with replay, and print and write the figures (see :mod:`replaymoe.apps.demo`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from replaymoe.apps.demo_inputs import NO_PLOT, TRITON_CPU_TIME, DemoError, can_plot, prepare_out, read_vllm
from replaymoe.bench._text import os_error_text
from replaymoe.hf.models import build_model

__all__ = ["run"]

LN2 = math.log(2.0)


class _Progress:
    """A tqdm bar on stderr driven as a transformers LogitsProcessor (one call per generation step).

    tqdm names the unit and, when stderr is not a terminal, prints nothing (no ``\\r`` lines).
    """

    def __init__(self, total: int, desc: str, enabled: bool = True):
        from tqdm.auto import tqdm

        # disable=None: tqdm turns itself off when stderr is not a TTY
        self.bar = tqdm(
            total=total, desc=desc, unit="step", file=sys.stderr, disable=None if enabled else True
        )

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update(1)
        return scores

    def close(self) -> None:
        self.bar.close()


def _prompts(num: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for _ in range(num):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    return out


def _left_pad(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s) :] = torch.tensor(s)
        mask[i, n - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _completion_logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= start, fp32 [B, S - start]."""
    lp = torch.log_softmax(logits[:, start - 1 : -1].float(), dim=-1)
    return lp.gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1)


def _write(path: Path, write: Callable[[], object]) -> None:
    """Run ``write``, which writes ``path``: a failure the checks before the run could not foresee
    (a full disk) is a DemoError naming the file and the reason (one line on stderr, exit 2)."""
    try:
        write()
    except OSError as exc:
        raise DemoError(os_error_text(exc, path)) from None


def _fmt_layers(values, layer_ids: list[int], spec: str = "6.3f") -> str:
    return "  ".join(f"L{n}:{format(v, spec)}" for n, v in zip(layer_ids, values))


def _backend_words(backend: str, device: str) -> str:
    if backend == "torch" or (backend == "auto" and device != "cuda"):
        hint = (
            " (on the CPU; the Triton kernels run on a GPU, or here with --backend triton in Triton's "
            f"interpreter, {TRITON_CPU_TIME})"
            if device != "cuda"
            else ""
        )
        return "torch reference" + hint
    if device == "cuda":
        return "Triton kernels (GPU)"
    return "Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1)"


def _r3_figures(agreements, lp_trainer, lp_rollout, logits_trainer, logits_rollout) -> dict[str, float]:
    """The R3 paper's figures for one trainer forward against the rollout.

    agreements: one AgreementReport per sequence; lp_*: [B, N] log-probs of the generated tokens;
    logits_*: [B, N, V] the distributions those tokens were sampled from / scored under.
    """
    same_dec = sum(float(np.nansum(r.per_layer * r.compared_per_layer)) for r in agreements)
    n_dec = sum(int(r.compared_per_layer.sum()) for r in agreements)
    same_tok = sum(float(r.all_layers) * r.compared_tokens for r in agreements if r.compared_tokens)
    n_tok = sum(r.compared_tokens for r in agreements)
    logp = torch.log_softmax(logits_rollout.float(), -1)
    logq = torch.log_softmax(logits_trainer.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [B, N]
    dlp = (lp_trainer.detach() - lp_rollout).abs()
    return {
        "decisions_differ": 1.0 - same_dec / n_dec if n_dec else float("nan"),
        "tokens_differ_any_layer": 1.0 - same_tok / n_tok if n_tok else float("nan"),
        "mean_kl_rollout_trainer": float(kl.mean()),
        "extreme_token_share": float((dlp > LN2).float().mean()),
        "max_abs_dlogprob": float(dlp.max()),
    }


def run(args: argparse.Namespace, device: str) -> int:
    t_start = time.perf_counter()
    import replaymoe.hf as rhf

    vllm = _read_vllm(args) if args.from_vllm else None  # before any work, and before --out is created
    plot = can_plot()  # the picture only needs matplotlib (the plot extra); everything else is written
    if not plot:
        print(f"replaymoe demo: warning: {NO_PLOT}; no heatmap.png, every other output is written",
              file=sys.stderr)  # fmt: skip
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(
        args.model_config, "tiny" if args.fast else "demo", seed=args.seed, dtype=dtype, device=device
    )
    moe = rhf.enable(model, capture=True, backend=args.backend)
    try:
        if vllm is not None:
            _check_fit(args, vllm, moe)
        out_dir = prepare_out(args.out, args.prompts)  # a bad --out fails before the run
        return _run_enabled(args, device, out_dir, vllm, model, moe, t_start, plot)
    finally:
        moe.disable()


def _check_fit(args: argparse.Namespace, vllm, moe) -> None:
    """DemoError unless the ``--from-vllm`` response fits the model (before --out is created)."""
    from replaymoe.record.replay import ReplaySource

    try:
        ReplaySource(vllm[2]).check_model(len(moe.layers), moe.top_k, moe.num_experts)
    except ValueError as exc:
        raise DemoError(f"--from-vllm {args.from_vllm}: {exc}") from None
    missing = np.argwhere(vllm[2].ids[:, :, 0] < 0)  # [position, MoE layer] of rows of -1
    if len(missing):  # replay (missing="error", as the demo replays) would refuse them mid-run
        pos, layer = (int(v) for v in missing[0])
        raise DemoError(
            f"--from-vllm {args.from_vllm}: {len(missing)} (row, MoE layer) pair(s) of -1 (no routing), "
            f"the first at position {vllm[2].token_offset + pos}, MoE layer {layer}: the demo replays every "
            "routed position "
            "(`replaymoe check` reports such rows)"
        )
    if list(vllm[2].layer_ids) != list(moe.layer_ids):  # a --layer-ids other than the model's MoE layers
        raise DemoError(
            f"--from-vllm {args.from_vllm}: --layer-ids {','.join(map(str, vllm[2].layer_ids))} are not "
            f"the demo model's MoE layers {','.join(map(str, moe.layer_ids))}"
        )


def _run_enabled(args, device, out_dir: Path, vllm, model, moe, t_start: float, plot: bool) -> int:
    from replaymoe.record.stats import agreement, plot_heatmap

    cfg, dtype = model.config, next(model.parameters()).dtype
    new_tokens = args.tokens or (8 if args.fast else 24)
    L, K, E = len(moe.layers), moe.top_k, moe.num_experts
    ids_of = moe.layer_ids
    n_params = sum(p.numel() for p in model.parameters())
    backend_words = _backend_words(args.backend, device)
    print(
        f"model: {type(model).__name__} ({args.model_config}, random weights, seed {args.seed}), "
        f"{cfg.num_hidden_layers} layers ({L} MoE: {', '.join(f'L{i}' for i in ids_of)}), {E} experts, "
        f"top-{K}, hidden {cfg.hidden_size}, {n_params / 1e6:.2f}M params, {dtype} on {device}"
    )
    print(f"backend: {backend_words}")

    # ---------------------------------------------------------------- rollout (generate + capture)
    prompts = _prompts(args.prompts, cfg.vocab_size, (4, 12) if args.fast else (6, 20), args.seed)
    ids, mask = _left_pad(prompts, device)
    progress = _Progress(new_tokens, "rollout: generate", enabled=not args.quiet)
    torch.manual_seed(args.seed)
    t_gen = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            logits_processor=[progress],
            return_dict_in_generate=True,
            output_logits=True,
        )
    progress.close()
    t_gen = time.perf_counter() - t_gen
    seqs = gen.sequences  # [B, P + new]
    P = ids.shape[1]
    rollout_logits = torch.stack([lg.float() for lg in gen.logits], dim=1)  # [B, new, V], sampled from
    rollout_lp = torch.log_softmax(rollout_logits, -1).gather(-1, seqs[:, P:, None]).squeeze(-1)  # [B, new]
    rollout = moe.traces()
    assert len(rollout) == len(prompts), (len(rollout), len(prompts))
    for i, tr in enumerate(rollout):
        path = out_dir / "traces" / f"seq{i}.rmtrace"
        _write(path, functools.partial(tr.save, path))
    lengths = [t.num_tokens for t in rollout]
    routed = sum(lengths)
    print(
        f"rollout: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(left-padded to {P}), {new_tokens} new tokens each, in {t_gen:.1f} s; captured {len(rollout)} "
        f"traces of {', '.join(map(str, lengths))} positions = {routed} routed tokens "
        "(prompt + completion - 1: the last sampled token is never fed back, so it has no routing)"
    )

    # ---------------------------------------------------------------- trainer: one "optimizer step"
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], new_tokens, dtype=mask.dtype, device=device)], 1)
    g = torch.Generator().manual_seed(args.seed + 11)
    with torch.no_grad():
        for info in moe.layers:
            w = info.router.weight
            noise = torch.randn(w.shape, generator=g).to(device=w.device, dtype=torch.float32)
            w.add_((noise * args.perturb * w.float().std()).to(w.dtype))
    print(
        f"trainer: router weights perturbed by {args.perturb:.0%} of their std (as one optimizer step would)"
    )

    def trainer_forward(replay, *, grad: bool):
        model.train(grad)
        with torch.set_grad_enabled(grad), moe.replaying(replay):
            logits = model(input_ids=seqs, attention_mask=full_mask).logits
            report = moe.report()
        return logits, moe.traces(), report

    native_logits, native_traces, _ = trainer_forward(None, grad=False)
    model.zero_grad(set_to_none=True)
    replay_logits, replay_traces, report = trainer_forward(rollout, grad=True)
    lp_native = _completion_logprobs(native_logits, seqs, P)
    lp_replay = _completion_logprobs(replay_logits, seqs, P)
    loss = -lp_replay.mean()
    loss.backward()
    model.eval()

    def agree(trainer_traces):
        reports = [
            agreement(a, b.replace(ids=b.ids[: a.num_tokens])) for a, b in zip(rollout, trainer_traces)
        ]
        weights = [a.num_tokens for a in rollout]
        per_layer = np.sum([np.asarray(r.per_layer) * w for r, w in zip(reports, weights)], axis=0) / sum(
            weights
        )
        return reports, per_layer

    rep_nat, a_nat = agree(native_traces)
    rep_rep, a_rep = agree(replay_traces)
    trainer_span = slice(P - 1, -1)  # the trainer's distributions over the generated tokens
    r3_nat = _r3_figures(
        rep_nat, lp_native, rollout_lp, native_logits[:, trainer_span].detach(), rollout_logits
    )
    r3_rep = _r3_figures(
        rep_rep, lp_replay, rollout_lp, replay_logits[:, trainer_span].detach(), rollout_logits
    )
    gnorms = [
        float(info.router.weight.grad.float().norm()) if info.router.weight.grad is not None else 0.0
        for info in moe.layers
    ]
    n_gen = rollout_lp.numel()

    print()
    print("router agreement per layer, rollout vs trainer (share of tokens with the same expert set)")
    print(f"  native routing : {_fmt_layers(a_nat, ids_of)}")
    print(f"  with replay    : {_fmt_layers(a_rep, ids_of)}")
    print(
        f"R3 figures, trainer vs rollout ({n_gen} generated tokens, {routed} routed tokens x {L} MoE layers)"
    )
    rows = [
        ("router decisions (token, layer) that differ", "decisions_differ", ".1%"),
        ("tokens that differ in >= 1 layer", "tokens_differ_any_layer", ".1%"),
        ("mean KL(rollout || trainer), generated tokens", "mean_kl_rollout_trainer", ".2e"),
        ("extreme tokens: |Δ log-prob| > ln 2", "extreme_token_share", ".1%"),
        ("max |Δ log-prob| of the generated tokens", "max_abs_dlogprob", ".3g"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"  {'':{w}}  {'native routing':>14}  {'with replay':>12}")
    for label, key, spec in rows:
        print(f"  {label:{w}}  {format(r3_nat[key], spec):>14}  {format(r3_rep[key], spec):>12}")
    print(
        "  (under replay |Δ log-prob| is not 0: the experts are the rollout's, but their gate weights\n"
        "   are recomputed from the perturbed router's logits, so each token's mix of the same experts\n"
        "   moves a little)"
    )
    print(
        "gradients reach the router under replay: ||∂loss/∂W_router|| per layer "
        + _fmt_layers(gnorms, ids_of)
    )
    seen = np.asarray(getattr(report, "tokens_seen_per_layer", []), dtype=np.int64)
    fb = np.asarray(getattr(report, "fallback_tokens_per_layer", []), dtype=np.int64)
    if seen.size == L and fb.size == L:
        if (seen == seen[0]).all() and (fb == fb[0]).all():
            counts = f"{int(seen[0])} tokens in each MoE layer"
            fallback = f"{int(fb[0])} tokens per layer"
        else:
            counts = "tokens per layer " + _fmt_layers(seen, ids_of, "d")
            fallback = "per layer " + _fmt_layers(fb, ids_of, "d")
        print(
            f"replay: {counts} ({routed} with the rollout's routing); {fallback} had none and were routed "
            f"natively: each sequence's last sampled token ({len(rollout)} sequences)"
        )
    elif report is not None:
        print(f"  {report}".replace("\n", "\n  "))
    print(
        f"=> without replay the trainer routes {r3_nat['tokens_differ_any_layer']:.0%} of the tokens "
        "differently from the rollout in at least one layer;\n   with replay "
        f"{r3_rep['tokens_differ_any_layer']:.0%}, and the router still gets gradients "
        "(R3, rollout routing replay)."
    )
    ok_grad = all(g > 0 and np.isfinite(g) for g in gnorms)

    # ---------------------------------------------------------------- picture: load + agreement
    heat_path = out_dir / "heatmap.png"
    all_rollout = rollout[0].replace(ids=np.concatenate([t.ids for t in rollout]))  # sequences stacked
    picture = f"{heat_path} (rollout expert load per layer, beside agreement with and without replay)"
    try:
        if not plot:
            raise ImportError(NO_PLOT)
        _write(
            heat_path,
            lambda: plot_heatmap(
                all_rollout,
                heat_path,
                title=f"rollout expert load: {routed} routed tokens, {len(rollout)} sequences, top-{K}",
                agreement={"native routing": a_nat, "with replay": a_rep},
                agreement_title="rollout vs trainer",
            ),
        )
    except ImportError as exc:  # matplotlib missing (warned before the run) or broken: the rest is written
        picture = f"none ({exc})".replace("\n", " ")

    # ---------------------------------------------------------------- optional: vLLM response
    if vllm is not None:
        print(_replay_vllm(args.from_vllm, vllm, model, moe, device))

    # example vLLM-style response of sequence 0 (round trip: --from-vllm this file)
    resp_path = out_dir / "vllm_response_seq0.json"
    response = {
        "model": moe.model_id,
        "prompt_token_ids": prompts[0],
        "choices": [
            {
                "index": 0,
                "token_ids": seqs[0, P:].tolist(),
                "routed_experts": _vllm_payload(rollout[0], cfg.num_hidden_layers),
            }
        ],
    }
    _write(resp_path, lambda: resp_path.write_text(json.dumps(response)))
    seconds = time.perf_counter() - t_start
    summary = {
        "architecture": args.model_config,
        "backend": backend_words,
        "device": device,
        "layer_ids": ids_of,
        "generated_tokens": n_gen,
        "rollout_routed_tokens": routed,
        "agreement_native": a_nat.tolist(),
        "agreement_replay": a_rep.tolist(),
        "agreement_native_all_layers": 1.0 - r3_nat["tokens_differ_any_layer"],
        "agreement_replay_all_layers": 1.0 - r3_rep["tokens_differ_any_layer"],
        "r3_native": r3_nat,
        "r3_replay": r3_rep,
        "max_abs_dlogprob_native": r3_nat["max_abs_dlogprob"],
        "max_abs_dlogprob_replay": r3_rep["max_abs_dlogprob"],
        "replay_tokens_per_layer": seen.tolist(),
        "replay_fallback_tokens_per_layer": fb.tolist(),
        "router_grad_norm_replay": gnorms,
        "seconds": seconds,
    }
    summary_path = out_dir / "summary.json"
    _write(summary_path, lambda: summary_path.write_text(json.dumps(summary, indent=2)))

    print()
    print(f"traces     : {out_dir / 'traces'}/seq*.rmtrace ({len(rollout)} files; RoutingTrace.load)")
    print(f"picture    : {picture}")
    print(f"vLLM-style : {resp_path} (try: replaymoe demo --from-vllm {resp_path})")
    print(f"summary    : {out_dir / 'summary.json'} (the figures above)")
    print(f"time       : {seconds:.1f} s for the demo (model, rollout, trainer forwards, files)")
    return 0 if ok_grad else 1


def _vllm_payload(trace, num_hidden_layers: int) -> str:
    """vLLM 0.33's ``routed_experts`` for a captured ``trace`` (from position 0, nothing missing): base64
    of an ``.npy`` [N, num_hidden_layers, K], one column per decoder layer with dense layers all zero,
    uint8 when E <= 256 else uint16."""
    from replaymoe.record.trace.wire import encode_vllm

    full = np.zeros((trace.num_tokens, num_hidden_layers, trace.top_k), dtype=np.int64)
    full[:, list(trace.model_layer_ids())] = trace.ids
    return encode_vllm(full, "uint8" if trace.num_experts <= 256 else "uint16")


def _read_vllm(args: argparse.Namespace):
    """``read_vllm`` of ``--from-vllm`` with ``--prompt-start`` and ``--layer-ids``; the layer ids
    default to the demo model's MoE layers (read from its config on the meta device, before the
    model is built, so that a bad response fails before any work)."""
    from replaymoe.hf.models import build_config
    from replaymoe.integrations.vllm_outputs import moe_layer_ids

    cfg = build_config(args.model_config, "tiny" if args.fast else "demo")
    layer_ids = getattr(args, "layer_ids", None)
    given = layer_ids is not None
    if not given:
        layer_ids = moe_layer_ids(cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return read_vllm(
        args.from_vllm,
        prompt_start=getattr(args, "prompt_start", None),
        layer_ids=layer_ids,
        vocab_size=getattr(text, "vocab_size", None),
        layer_ids_given=given,
    )


def _replay_vllm(path: str, vllm, model, moe, device) -> str:
    """Replay a vLLM response's routed_experts into a trainer forward over its tokens."""
    prompt, completion, trace = vllm
    if trace.num_layers == len(moe.layers):
        trace = trace.replace(layer_ids=moe.layer_ids)  # vLLM's layers are the MoE layers, in order
    seq = torch.tensor([prompt + completion], device=device)
    moe.traces()  # drop anything captured before
    missing = "native" if trace.token_offset else "error"  # --prompt-start: the positions below it
    # the response's model (a real server's "model" field) is not this random one: its shape is what
    # the demo replays, checked before the run
    with torch.no_grad(), moe.replaying(trace, missing=missing, check_model_id=False):
        model(input_ids=seq)
        rep = moe.report()
    (used,) = moe.traces()
    n = trace.num_tokens
    same = bool(np.array_equal(used.ids[trace.token_offset : trace.token_offset + n], trace.ids))
    fb = np.asarray(getattr(rep, "fallback_tokens_per_layer", [0] * len(moe.layers)), dtype=np.int64)
    return (
        f"vLLM response {path}: {trace!r}\n"
        f"  trainer forward over its {seq.shape[1]} tokens: ids identical to the response's: {same}; "
        f"{_unrouted(fb, moe.layer_ids)} (routed natively)"
    )


def _unrouted(fallback: np.ndarray, layer_ids: list[int]) -> str:
    """The tokens of a replayed forward that had no routing, per MoE layer (``fallback`` [L], the
    layers' model numbers ``layer_ids``): one figure when every layer has the same, else each layer's."""
    if len(fallback) and (fallback == fallback[0]).all():
        return f"{int(fallback[0])} token(s) in each MoE layer without routing in the response"
    return f"tokens per MoE layer without routing in the response {_fmt_layers(fallback, layer_ids, 'd')}"

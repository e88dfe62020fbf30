"""``replaymoe demo``: rollout with routing capture, then trainer forwards without and with replay.

Runs on a fresh machine with no GPU and no downloads (about 10-30 s on 2 CPU cores):

1. builds a small MoE model from a config (Qwen3-MoE by default; ``--model-config`` picks another
   supported architecture) with seeded random weights and a tiny vocabulary — no tokenizer, the
   prompts are token ids;
2. ``generate``\\ s completions for a few left-padded prompts with capture on
   (:func:`replaymoe.hf.enable`) and saves one :class:`~replaymoe.trace.RoutingTrace` per sequence
   and a heatmap of expert load;
3. perturbs the router weights slightly (as one optimizer step would) and runs the "trainer"
   forward over prompt + completion twice: with native routing and with the rollout's routing
   replayed;
4. prints router agreement per layer between rollout and trainer, the max |Δ log-prob| of the
   generated tokens, and the router's gradient norm under replay.

``python -m replaymoe.demo --help`` lists the options. :func:`build_model` is reused by the tests
and the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from replaymoe.hf.models import ARCHITECTURES, SIZES, build_config, build_model

__all__ = ["ARCHITECTURES", "SIZES", "build_config", "build_model", "main"]

# --------------------------------------------------------------------------------------------------
# the demo
# --------------------------------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on stderr, driven as a transformers LogitsProcessor (one call per step)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled, self.n = total, label, enabled, 0
        self.t0 = time.perf_counter()
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * self.n / max(self.total, 1))
        rate = self.n / max(time.perf_counter() - self.t0, 1e-9)
        sys.stderr.write(
            f"\r{self.label} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} steps {rate:5.1f}/s"
        )
        sys.stderr.flush()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.n += 1
        self._draw()
        return scores

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


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


def _fmt_layers(values: np.ndarray, layer_ids: list[int]) -> str:
    return "  ".join(f"L{n}:{v:6.3f}" for n, v in zip(layer_ids, values))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="replaymoe demo",
        description="Rollout with routing capture, then trainer forwards with and without routing replay.",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument(
        "--model-config",
        default="qwen3_moe",
        choices=ARCHITECTURES,
        help="architecture of the small random model (default qwen3_moe)",
    )
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate per prompt (default 24)")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--out", default="./replaymoe_out", help="output directory (default ./replaymoe_out)")
    p.add_argument("--fast", action="store_true", help="smaller model and fewer tokens (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--perturb", type=float, default=0.05, help="relative size of the router perturbation (default 0.05)"
    )
    p.add_argument(
        "--backend",
        choices=("auto", "triton", "torch"),
        default="auto",
        help="replaymoe backend (default auto)",
    )
    p.add_argument(
        "--from-vllm",
        metavar="RESPONSE.json",
        default=None,
        help="also replay a vLLM response's routed_experts (one sequence; its prompt_token_ids and "
        "choices[0].token_ids must be present, and the model must have the trace's shape)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens < 2:
        p.error("--tokens must be >= 2")
    if args.prompts < 1:
        p.error("--prompts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 on success (see the module docstring)."""
    args = _parse(argv)
    threads = torch.get_num_threads()
    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        # a model this small is latency-bound: one intra-op thread avoids OpenMP barrier costs
        # (10-100x per op when the cores are shared, e.g. under pytest -n 2)
        torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    import replaymoe.hf as rhf
    from replaymoe.stats import agreement, plot_heatmap

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("replaymoe demo: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    size = "tiny" if args.fast else "demo"
    new_tokens = args.tokens or (8 if args.fast else 24)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out_dir = Path(args.out)
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)

    model = build_model(args.model_config, size, seed=args.seed, dtype=dtype, device=device)
    cfg = model.config
    moe = rhf.enable(model, capture=True, backend=args.backend)
    L, K, E = len(moe.layers), moe.top_k, moe.num_experts
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {type(model).__name__} ({args.model_config}, random weights, seed {args.seed}), "
        f"{cfg.num_hidden_layers} layers ({L} MoE: layer_ids {moe.layer_ids}), {E} experts, top-{K}, "
        f"hidden {cfg.hidden_size}, {n_params / 1e6:.2f}M params, {dtype} on {device}"
    )

    # ---------------------------------------------------------------- rollout (generate + capture)
    prompts = _prompts(args.prompts, cfg.vocab_size, (4, 12) if args.fast else (6, 20), args.seed)
    ids, mask = _left_pad(prompts, device)
    progress = _Progress(new_tokens, "rollout: generate", enabled=not args.quiet)
    torch.manual_seed(args.seed)
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
    seqs = gen.sequences  # [B, P + new]
    P = ids.shape[1]
    rollout_lp = torch.stack(
        [
            torch.log_softmax(lg.float(), -1).gather(-1, seqs[:, P + i, None]).squeeze(-1)
            for i, lg in enumerate(gen.logits)
        ],
        dim=1,
    )  # [B, new]
    rollout = moe.traces()
    assert len(rollout) == len(prompts), (len(rollout), len(prompts))
    paths = []
    for i, tr in enumerate(rollout):
        path = out_dir / "traces" / f"seq{i}.rmtrace"
        tr.save(path)
        paths.append(path)
    heat_path = out_dir / "heatmap.png"
    # all sequences' tokens stacked into one trace for the expert-load heatmap
    plot_heatmap(rollout[0].replace(ids=np.concatenate([t.ids for t in rollout])), heat_path)
    print(
        f"rollout: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(left-padded to {P}), {new_tokens} new tokens each; captured {len(rollout)} traces, "
        f"positions {[t.num_tokens for t in rollout]} (prompt + completion - 1)"
    )

    # ---------------------------------------------------------------- trainer: one "optimizer step"
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], new_tokens, dtype=mask.dtype, device=device)], 1)
    g = torch.Generator().manual_seed(args.seed + 11)
    with torch.no_grad():
        for info in moe.layers:
            w = info.router.weight
            noise = torch.randn(w.shape, generator=g).to(device=w.device, dtype=torch.float32)
            w.add_((noise * args.perturb * w.float().std()).to(w.dtype))
    print(f"trainer: router weights perturbed by {args.perturb:.0%} of their std (one optimizer step)")

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
        per_layer, all_layers = [], []
        for a, b in zip(rollout, trainer_traces):
            b = b.replace(ids=b.ids[: a.num_tokens])
            r = agreement(a, b)
            per_layer.append(np.asarray(r.per_layer, dtype=np.float64) * a.num_tokens)
            all_layers.append(float(r.all_layers) * a.num_tokens)
        n = sum(t.num_tokens for t in rollout)
        return np.sum(per_layer, axis=0) / n, sum(all_layers) / n

    a_nat, a_nat_all = agree(native_traces)
    a_rep, a_rep_all = agree(replay_traces)
    d_native = (lp_native - rollout_lp).abs().max().item()
    d_replay = (lp_replay.detach() - rollout_lp).abs().max().item()
    gnorms = [
        float(info.router.weight.grad.float().norm()) if info.router.weight.grad is not None else 0.0
        for info in moe.layers
    ]

    print()
    print("router agreement, rollout vs trainer (fraction of tokens with the same expert set)")
    print(f"  native routing : {_fmt_layers(a_nat, moe.layer_ids)}   all layers: {a_nat_all:.3f}")
    print(f"  with replay    : {_fmt_layers(a_rep, moe.layer_ids)}   all layers: {a_rep_all:.3f}")
    print("max |Δ log-prob| of the generated tokens, trainer vs rollout")
    print(f"  native routing : {d_native:.4g}")
    print(f"  with replay    : {d_replay:.4g}")
    print(
        "gradients reach the router under replay: ||∂loss/∂W_router|| per layer "
        + _fmt_layers(np.asarray(gnorms), moe.layer_ids)
    )
    print(f"  {report}".replace("\n", "\n  "))
    print("  (the fallback is each sequence's last token: it was sampled, never fed back, so has no routing)")
    print(
        f"=> without replay the trainer routes {1 - a_nat_all:.0%} of the tokens differently from the "
        "rollout in at least one layer;\n   with replay it uses the rollout's experts "
        f"({a_rep_all:.0%} agreement) and the router still gets gradients (R3, rollout routing replay)."
    )
    ok_grad = all(g > 0 and np.isfinite(g) for g in gnorms)

    # ---------------------------------------------------------------- optional: vLLM response
    vllm_note = None
    if args.from_vllm:
        try:
            vllm_note = _replay_vllm(args.from_vllm, model, moe, device)
        except (OSError, ValueError) as exc:  # unreadable file, not a vLLM response, other model shape
            print(f"replaymoe demo: --from-vllm {args.from_vllm}: {exc}", file=sys.stderr)
            moe.disable()
            return 2
        print(vllm_note)

    # example vLLM-style response of sequence 0 (round trip: --from-vllm this file)
    resp_path = out_dir / "vllm_response_seq0.json"
    prompt0 = prompts[0]
    completion0 = seqs[0, P:].tolist()
    resp_path.write_text(
        json.dumps(
            {
                "model": moe.model_id,
                "prompt_token_ids": prompt0,
                "choices": [{"index": 0, "token_ids": completion0, "routed_experts": rollout[0].to_vllm()}],
            }
        )
    )
    summary = {
        "architecture": args.model_config,
        "layer_ids": moe.layer_ids,
        "agreement_native": a_nat.tolist(),
        "agreement_replay": a_rep.tolist(),
        "agreement_native_all_layers": a_nat_all,
        "agreement_replay_all_layers": a_rep_all,
        "max_abs_dlogprob_native": d_native,
        "max_abs_dlogprob_replay": d_replay,
        "router_grad_norm_replay": gnorms,
        "seconds": time.perf_counter() - t_start,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    moe.disable()

    print()
    print(f"traces     : {out_dir / 'traces'}/seq*.rmtrace ({len(paths)} files; RoutingTrace.load)")
    print(f"heatmap    : {heat_path}")
    print(f"vLLM-style : {resp_path} (try: replaymoe demo --from-vllm {resp_path})")
    print(f"summary    : {out_dir / 'summary.json'}  ({summary['seconds']:.1f} s)")
    return 0 if ok_grad else 1


def _replay_vllm(path: str, model, moe, device) -> str:
    """Replay a vLLM response's routed_experts into a trainer forward over its tokens."""
    from replaymoe.trace import RoutingTrace

    obj = json.loads(Path(path).read_text())
    choice = (obj.get("choices") or [{}])[0]
    prompt, completion = obj.get("prompt_token_ids"), choice.get("token_ids")
    if prompt is None or completion is None:
        raise ValueError(
            f"Invalid value of --from-vllm: expected a response with prompt_token_ids and "
            f"choices[0].token_ids, got keys {sorted(obj)} / {sorted(choice)}"
        )
    trace = RoutingTrace.from_vllm(obj)  # vLLM sends neither E nor layer numbers
    if trace.num_layers == len(moe.layers):
        trace = trace.replace(layer_ids=moe.layer_ids)  # vLLM's layers are the MoE layers, in order
    seq = torch.tensor([list(prompt) + list(completion)], device=device)
    moe.traces()  # drop anything captured before
    with torch.no_grad(), moe.replaying(trace):
        model(input_ids=seq)
        rep = moe.report()
    (used,) = moe.traces()
    n = trace.num_tokens
    same = bool(np.array_equal(used.ids[trace.token_offset : trace.token_offset + n], trace.ids))
    return (
        f"vLLM response {path}: {trace!r}\n"
        f"  trainer forward over its {seq.shape[1]} tokens: ids identical to the response's: {same}\n"
        f"  {rep}".replace("\n  most", "\n    most")
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

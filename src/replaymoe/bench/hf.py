"""``replaymoe bench hf``: transformers ``generate`` throughput, replaymoe vs transformers' experts.

One random-weight MoE model (default: Qwen3-MoE with Qwen3-30B-A3B's MoE shape — hidden 2048, 128
experts, top-8, expert width 768 — and 8 layers, bf16) generates ``--new`` tokens greedily after a
``--prompt``-token prompt, per batch size, with:

* ``grouped_mm``        transformers' own routers and ``experts_implementation="grouped_mm"``;
* ``replaymoe``         :func:`replaymoe.hf.enable`: routers through the Triton routing kernel, experts
  through the fused Triton MoE kernels;
* ``replaymoe+capture`` the same with routing capture on (one trace per sequence collected after
  each generate);
* ``replaymoe+replay``  the same replaying the captured traces (prompt and completion forced).

Reported: median wall time of ``generate`` over ``--repeats`` runs after one warm-up, generated
tokens/s (batch × new tokens / time), the speed-up over ``grouped_mm``, and the fraction of generated
tokens equal to ``grouped_mm``'s (greedy; bf16 rounding differences may flip near-ties).

Usage: ``replaymoe bench hf [--out DIR] [--arch qwen3_moe] [--batch 1,8,32] [--prompt 128] [--new 64]``
(or ``python -m replaymoe.bench.hf``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ._timing import print_table, write_results


def _parse(argv):
    from replaymoe.hf.models import ARCHITECTURES, SIZES

    p = argparse.ArgumentParser(prog="replaymoe bench hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory (CSV + JSON)")
    p.add_argument("--arch", default="qwen3_moe", choices=ARCHITECTURES)
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--impls",
        default="grouped_mm,replaymoe,replaymoe+capture,replaymoe+replay",
        help="comma-separated subset of grouped_mm, replaymoe, replaymoe+capture, replaymoe+replay",
    )
    return p.parse_args(argv)


def _generate(model, ids, mask, new):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, ids.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("replaymoe bench hf: needs a CUDA GPU", file=sys.stderr)
        return 2
    import replaymoe.hf as rhf
    from replaymoe.hf.models import build_model

    batches = [int(b) for b in args.batch.split(",") if b]
    impls = [s for s in args.impls.split(",") if s]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(args.arch, args.size, dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation("grouped_mm")
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {type(model).__name__} {args.size}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, "
        f"{n_params / 1e9:.2f}B params bf16 (built in {time.perf_counter() - t0:.1f} s); "
        f"prompt {args.prompt}, new {args.new}, {torch.cuda.get_device_name()}",
        flush=True,
    )
    g = torch.Generator().manual_seed(1)
    rows = []
    for B in batches:
        ids = torch.randint(3, cfg.vocab_size, (B, args.prompt), generator=g).cuda()
        mask = torch.ones_like(ids)
        ref_tokens, ref_time, traces = None, None, None
        for impl in impls:
            moe = None
            if impl.startswith("replaymoe"):
                moe = rhf.enable(model, capture=impl == "replaymoe+capture")
                if impl == "replaymoe+replay":
                    if traces is None:  # capture once, outside the timing
                        moe.set_capture(True)
                        _generate(model, ids, mask, args.new)
                        traces = moe.traces()
                        moe.set_capture(False)
                    moe.set_replay(traces)
            elif impl != "grouped_mm":
                raise SystemExit(f"unknown implementation {impl!r}")
            try:
                _generate(model, ids, mask, min(8, args.new))  # warm-up: kernels compiled, caches sized
                if moe is not None:
                    moe.traces()
                times = []
                for _ in range(args.repeats):
                    dt, toks = _generate(model, ids, mask, args.new)
                    times.append(dt)
                    if impl == "replaymoe+capture":
                        got = moe.traces()
                        assert len(got) == B and got[0].num_tokens == args.prompt + args.new - 1
                        if traces is None:
                            traces = got
            finally:
                if moe is not None:
                    moe.disable()
            t = statistics.median(times)
            if impl == "grouped_mm":
                ref_tokens, ref_time = toks, t
            row = {
                "arch": args.arch,
                "size": args.size,
                "impl": impl,
                "batch": B,
                "prompt": args.prompt,
                "new_tokens": args.new,
                "generate_s": t,
                "tokens_per_s": B * args.new / t,
                "speedup_vs_grouped_mm": (ref_time / t) if ref_time else float("nan"),
                "same_tokens_as_grouped_mm": (
                    float((toks == ref_tokens).float().mean()) if ref_tokens is not None else float("nan")
                ),
            }
            rows.append(row)
            print(
                f"  batch {B:3d} {impl:18s} {t:7.3f} s  {row['tokens_per_s']:9.1f} tok/s  "
                f"x{row['speedup_vs_grouped_mm']:.2f}",
                flush=True,
            )
    csv_path, json_path = write_results(rows, args.out, "hf_generate")
    print()
    print_table(
        rows,
        ["impl", "batch", "generate_s", "tokens_per_s", "speedup_vs_grouped_mm", "same_tokens_as_grouped_mm"],
    )
    print(f"\nwrote {csv_path} and {json_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

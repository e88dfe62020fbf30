"""``replaymoe bench moe``: whole fused-MoE layers on the GPU against their peers.

Each point times one whole layer (routing inside where the call does it, layout, both GEMMs,
activation, top-k reduction) as the median of CUDA-graph replays with L2 flushed, plus eager
(``*_eager_ms``: ``triton.testing.do_bench``, device time) and the host time of an eager bf16 call
(``rmoe_bf16_eager_host_ms``, ``bench._timing.host_us``):

* ``rmoe_bf16`` / ``rmoe_fp8`` — :func:`replaymoe.fused_moe` with ``router_logits`` (fp8: block-scale
  weights, activations quantized inside);
* ``grouped_mm`` — a torch layer: sort / offsets / ``torch._grouped_mm`` / SwiGLU / ``_grouped_mm`` /
  ``index_add_`` (graph-capturable);
* ``naive`` — the per-expert Python loop of Hugging Face eager MoE blocks (eager only: it syncs);
* ``floor`` — max(distinct active experts' weight bytes / 4.27 TB/s, FLOPs / 700 TFLOP/s);
* ``vllm_kernels`` — vLLM's Triton fused-MoE kernel, its two GEMM launches alone (alignment and
  SwiGLU done beforehand: a lower bound on vLLM's layer), graph replay with L2 flushed. With
  ``--peer-dir DIR`` it is measured in this run on the same weights and routing
  (``vllm_source = "measured"``); otherwise a stored figure from an earlier H200 run is shown
  (``"stored"``). ``vs_vllm`` = ``rmoe_bf16_ms / vllm_kernels_ms`` (below 1: replaymoe faster).

``--check-ids`` measures something else instead: the cost of ``fused_moe``'s check of caller-given
``topk_ids``, bf16, at ``--tokens`` (default 1: decode), for each shape, in three variants
(:data:`CHECK_VARIANTS`): ``off`` (``check_ids=False``, the behaviour before the check), ``route``
(``route``'s ids as it returned them) and ``caller`` (a copy of the same ids, as an engine or a file
hands them); both checked on the device by the kernel that reads them first, plus the host's read of the
error mailbox (the mark ``route`` leaves serves only the torch backend's host check). Each is timed as
CUDA-graph replay (``graph_*``: the check runs in every replay; :data:`CHECK_ROUNDS` rounds of
``do_bench``, the variants in alternating order), eager device time (``eager_*``: CUDA events, the L2
flushed before each call) and eager host time
(``host_*``: the CPU thread). Eager and host calls are timed in turn, one call of each variant per turn
(:func:`~replaymoe.bench._timing.interleaved_us`, :data:`CHECK_CALLS` turns), so that the host's drift,
which reads as a few percent between two stretches of calls, touches every variant alike. Each figure
is a median; ``*_ratio`` is a variant's median over ``off``'s, and ``*_ratio_q1`` / ``*_ratio_q3`` the
quartiles of that ratio over blocks of :data:`CHECK_BLOCK` turns. Written to ``moe_check_ids.csv`` /
``.json``.

``--read-floors`` measures the bare-read floor of each decode point instead (:mod:`replaymoe.bench.floors`):
the bytes of the experts the bench's routing hits, read by one plain kernel. Written to
``read_floors.csv`` / ``.json``.

``--peer-dir`` names a git-ignored folder prepared as ``../shared/peers/README.md`` says: vLLM's
kernel extracted from the vLLM wheel at run time plus the peer driver ``vllm_moe_peer.py``, which
this module imports from there (nothing of vLLM is part of replaymoe).

Usage: ``replaymoe bench moe [--out DIR] [--shapes qwen3,mixtral,deepseek] [--tokens 1,8,64]
[--peer-dir .peers] [--check-ids | --read-floors]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from replaymoe.bench._text import choice_list, strip_rest  # strip_rest: plain-text --help as python -m

from ._timing import (
    BF16_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    NO_CUDA_EXIT,
    host_us,
    interleaved_us,
    no_cuda,
    print_table,
    time_eager,
    time_graph,
    write_results,
)

# name -> (H, I, E, K, routing kwargs)
SHAPES: dict[str, tuple[int, int, int, int, dict]] = {
    "deepseek": (
        7168,
        2048,
        256,
        8,
        {"method": 2, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    ),
    "qwen3": (2048, 768, 128, 8, {"method": 1}),
    "mixtral": (4096, 14336, 8, 2, {"method": 1}),
}
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
NAIVE_TOKENS = {"deepseek": (1, 64), "qwen3": (1, 64, 4096), "mixtral": (1, 64, 4096)}
CHECK_ROUNDS = 6  # --check-ids: graph replays, rounds of the variants in alternating order
CHECK_CALLS = 2000  # --check-ids: eager and host, calls of each variant, one of each per turn
CHECK_BLOCK = 200  # --check-ids: samples per block of the ratio's quartiles
CHECK_MODES = ("graph", "eager", "host")
CHECK_VARIANTS = ("off", "route", "caller")  # check_ids=False; route's ids; a copy (both checked)
CHECK_COLUMNS = ["shape", "T"] + [
    f"{m}_{k}"
    for m in CHECK_MODES
    for k in [f"{v}_us" for v in CHECK_VARIANTS] + [f"{v}_ratio" for v in CHECK_VARIANTS[1:]]
]

# vLLM 0.33 Triton fused MoE on this H200, bf16, graph replay, L2 cold: two GEMM kernels alone (ms).
VLLM_KERNELS_MS: dict[tuple[str, int], float] = {
    ("qwen3", 1): 0.035, ("qwen3", 8): 0.127, ("qwen3", 64): 0.290, ("qwen3", 256): 0.318,
    ("qwen3", 1024): 0.361, ("qwen3", 4096): 0.777, ("qwen3", 16384): 2.570,
    ("mixtral", 1): 0.186, ("mixtral", 8): 0.573, ("mixtral", 64): 0.652, ("mixtral", 256): 0.719,
    ("mixtral", 1024): 1.720, ("mixtral", 4096): 5.273, ("mixtral", 16384): 20.19,
    ("deepseek", 1): 0.194, ("deepseek", 8): 1.229, ("deepseek", 64): 4.162, ("deepseek", 256): 5.121,
    ("deepseek", 1024): 5.887, ("deepseek", 4096): 8.816, ("deepseek", 16384): 26.35,
}  # fmt: skip


def make_weights(H: int, I: int, E: int, *, fp8: bool, device="cuda", seed: int = 0):  # noqa: E741
    """Random expert weights (std 1/sqrt(fan_in)); fp8: block-quantized per expert (bounded memory)."""
    from ..moe.quant import quantize_fp8_block

    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)
    for e in range(E):
        w13[e].normal_(0, H**-0.5, generator=g)
        w2[e].normal_(0, I**-0.5, generator=g)
    if not fp8:
        return w13, w2, None, None
    q13 = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device=device)
    q2 = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device=device)
    s13 = torch.empty(E, 2 * I // 128, H // 128, dtype=torch.float32, device=device)
    s2 = torch.empty(E, H // 128, I // 128, dtype=torch.float32, device=device)
    for e in range(0, E, 16):
        q13[e : e + 16], s13[e : e + 16] = quantize_fp8_block(w13[e : e + 16])
        q2[e : e + 16], s2[e : e + 16] = quantize_fp8_block(w2[e : e + 16])
    del w13, w2
    return q13, q2, s13, s2


def grouped_mm_layer(x, w13, w2, ids, wts):
    """The torch peer: sort / offsets / _grouped_mm / SwiGLU / _grouped_mm / index_add_ (no host sync)."""
    T, K = ids.shape
    E, two_i, _ = w13.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // K
    xs = x.index_select(0, tok)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    i = two_i // 2
    a = F.silu(h[:, :i]) * h[:, i:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * wts.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y)
    return out


def naive_layer(x, w13, w2, ids, wts):
    """Per-expert loop as in Hugging Face eager MoE blocks (host-synchronizing)."""
    out = torch.zeros_like(x)
    i = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        tok, kk = torch.nonzero(ids == e, as_tuple=True)
        h = x[tok] @ w13[e].T
        y = (F.silu(h[:, :i]) * h[:, i:]) @ w2[e].T
        out.index_add_(0, tok, y * wts[tok, kk, None].to(y.dtype))
    return out


def layer_floor_ms(name: str, T: int, ids: torch.Tensor, bytes_per_weight: float) -> tuple[float, str]:
    """Roofline floor (ms) of one layer and which term bounds it ("hbm" or "flops")."""
    H, inter, E, K, _ = SHAPES[name]
    distinct = int(torch.unique(ids).numel())
    mem = distinct * 3 * H * inter * bytes_per_weight / HBM_BYTES_PER_S * 1e3
    flops = 2 * T * K * 3 * H * inter / BF16_FLOPS_PER_S * 1e3
    return (mem, "hbm") if mem >= flops else (flops, "flops")


def routing_inputs(name: str, T: int, device="cuda", seed: int = 1):
    """Router logits (and the model's routing args) plus the resulting (ids, weights)."""
    from ..routing import RoutingMethod, route

    H, inter, E, K, kw = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(seed + T)
    logits = torch.randn(T, E, generator=g, device=device, dtype=torch.float32)
    kw = dict(kw)
    method = RoutingMethod(kw.pop("method"))
    bias = None
    if method == RoutingMethod.DEEPSEEK_V3:
        bias = (torch.randn(E, generator=g, device=device) * 0.1).float()
    ids, wts = route(logits, K, method, bias=bias, backend="torch", **kw)
    return logits, method, bias, kw, ids, wts


def check_peer_dir(peer_dir: str) -> Path:
    """``peer_dir`` resolved; ValueError naming what is missing unless it holds the peer driver and
    vLLM's extracted kernel."""
    root = Path(peer_dir).resolve()
    missing = [f for f in ("vllm_moe_peer.py", "vllm_fused_moe_kernels.py") if not (root / f).is_file()]
    if missing:
        raise ValueError(
            f"--peer-dir: expected a folder holding {missing} (prepared as ../shared/peers/README.md "
            f"says), got {str(root)!r}"
        )
    return root


def load_vllm_peer(root: Path):
    """The peer driver ``vllm_moe_peer`` imported from the checked folder ``root`` (it loads vLLM's
    extracted kernel from the same folder)."""
    os.environ["REPLAYMOE_PEERS"] = str(root)  # where the driver finds vLLM's files
    spec = importlib.util.spec_from_file_location("replaymoe_bench_vllm_peer", root / "vllm_moe_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _point(name: str, T: int, bf16w, fp8w, peer=None) -> dict:
    from ..moe import fused_moe

    H, inter, E, K, _ = SHAPES[name]
    w13, w2, _, _ = bf16w
    q13, q2, s13, s2 = fp8w
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits, method, bias, kw, ids, wts = routing_inputs(name, T)
    rkw = dict(router_logits=logits, top_k=K, method=method, bias=bias, **kw)
    floor_ms, bound = layer_floor_ms(name, T, ids, 2)
    floor8, _ = layer_floor_ms(name, T, ids, 1)
    from ..moe.tuned import table_for

    table = table_for(x.device).name
    row = {"shape": name, "T": T, "table": table, "floor_ms": floor_ms, "bound": bound}

    def fb():
        return fused_moe(x, w13, w2, **rkw)

    def f8():
        return fused_moe(x, q13, q2, w13_scale=s13, w2_scale=s2, **rkw)

    def fg():
        return grouped_mm_layer(x, w13, w2, ids, wts)

    row["rmoe_bf16_ms"] = time_graph(fb) / 1e3
    row["rmoe_bf16_eager_ms"] = time_eager(fb) / 1e3
    row["rmoe_bf16_eager_host_ms"] = host_us(fb, calls=20) / 1e3
    row["rmoe_fp8_ms"] = time_graph(f8) / 1e3
    row["rmoe_fp8_eager_ms"] = time_eager(f8) / 1e3
    row["grouped_mm_ms"] = time_graph(fg) / 1e3
    if T in NAIVE_TOKENS.get(name, ()):
        row["naive_ms"] = time_eager(lambda: naive_layer(x, w13, w2, ids, wts), warmup_ms=1, rep_ms=50) / 1e3
    row["frac_floor_bf16"] = floor_ms / row["rmoe_bf16_ms"]
    row["frac_floor_fp8"] = floor8 / row["rmoe_fp8_ms"] if bound == "hbm" else float("nan")
    row["tflops_bf16"] = 2 * T * K * 3 * H * inter / (row["rmoe_bf16_ms"] * 1e-3) / 1e12
    row["fp8_speedup"] = row["rmoe_bf16_ms"] / row["rmoe_fp8_ms"]
    if peer is not None:  # vLLM's two GEMM launches on the same weights and routing, this run
        cfg, _ = peer.pick_config(H, inter, E, K, T)
        vk, _ = peer.vllm_kernels_only(x, w13, w2, wts.float().contiguous(), ids.to(torch.int32), cfg)
        bar, source = time_graph(vk) / 1e3, "measured"
    else:
        bar, source = VLLM_KERNELS_MS.get((name, T)), "stored"
    if bar is not None:
        row["vllm_kernels_ms"] = bar
        row["vllm_source"] = source
        row["vs_vllm"] = row["rmoe_bf16_ms"] / bar
    return row


def _check_ids_point(name: str, T: int, bf16w) -> dict:
    """``--check-ids``: one (shape, T) row, ``fused_moe`` with caller ``topk_ids``: the check off
    (``off``), ids straight from ``route`` (``route``) and the same ids as another producer hands them
    (``caller``: a copy), both checked on the device, in alternating order."""

    from ..moe import fused_moe

    H, _, _, _, _ = SHAPES[name]
    w13, w2, _, _ = bf16w
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, _, _, _, ids, wts = routing_inputs(name, T)  # route's ids: int32 [T, K], valid, marked
    caller = ids.clone()  # the same values from elsewhere (an engine, a file)

    def call(variant: str):
        topk, check = {"off": (ids, False), "route": (ids, True), "caller": (caller, True)}[variant]
        return lambda: fused_moe(x, w13, w2, topk_ids=topk, topk_weights=wts, check_ids=check)

    fns = {v: call(v) for v in CHECK_VARIANTS}
    row: dict = {"shape": name, "T": T}
    times: dict[str, list[float]] = {v: [] for v in CHECK_VARIANTS}
    for r in range(CHECK_ROUNDS):  # graph replays: whole do_bench runs, in alternating order
        for variant in CHECK_VARIANTS if r % 2 == 0 else CHECK_VARIANTS[::-1]:
            times[variant].append(time_graph(fns[variant]))
    _check_ratios(row, "graph", times)
    for mode, clock in (("eager", "device"), ("host", "host")):  # call by call, in turn
        _check_ratios(row, mode, interleaved_us(fns, clock=clock, calls=CHECK_CALLS))
    return row


def _check_ratios(row: dict, mode: str, times: dict[str, list[float]]) -> None:
    """``row``'s columns for one timing mode: each variant's median (``{mode}_{variant}_us``), its
    ratio to ``off``'s median (``_ratio``) and the quartiles of that ratio over blocks of
    :data:`CHECK_BLOCK` consecutive samples (``_ratio_q1`` / ``_ratio_q3``: how steady it is)."""
    import statistics

    for variant, ts in times.items():
        row[f"{mode}_{variant}_us"] = statistics.median(ts)
    off = times["off"]
    for variant in CHECK_VARIANTS[1:]:
        ts = times[variant]
        row[f"{mode}_{variant}_ratio"] = statistics.median(ts) / statistics.median(off)
        step = CHECK_BLOCK if len(ts) >= 2 * CHECK_BLOCK else 1
        blocks = [
            statistics.median(ts[i : i + step]) / statistics.median(off[i : i + step])
            for i in range(0, len(ts) - step + 1, step)
        ]
        q = statistics.quantiles(blocks, n=4, method="inclusive") if len(blocks) > 1 else blocks * 3
        row[f"{mode}_{variant}_ratio_q1"], row[f"{mode}_{variant}_ratio_q3"] = q[0], q[2]


def run_check_ids(shapes, tokens) -> list[dict]:
    """``--check-ids``: :func:`_check_ids_point` for every (shape, T); one row per point."""
    rows: list[dict] = []
    for name in shapes:
        H, inter, E, _, _ = SHAPES[name]
        bf16w = make_weights(H, inter, E, fp8=False)
        for T in tokens:
            row = _check_ids_point(name, T, bf16w)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del bf16w
        torch.cuda.empty_cache()
    return rows


def run(shapes, tokens, peer=None) -> list[dict]:
    """Measure every (shape, T) point (``peer``: :func:`load_vllm_peer`'s module, or None); returns
    one row per point."""
    rows: list[dict] = []
    for name in shapes:
        H, inter, E, K, _ = SHAPES[name]
        bf16w = make_weights(H, inter, E, fp8=False)
        fp8w = make_weights(H, inter, E, fp8=True)
        for T in tokens:
            row = _point(name, T, bf16w, fp8w, peer)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del bf16w, fp8w
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench moe", description=strip_rest(__doc__.split("\n")[0]))
    p.add_argument("--out", default="bench_results", help="output directory for moe.csv / moe.json")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    p.add_argument(
        "--tokens",
        default=None,
        help=f"comma list of token counts (default {','.join(map(str, TOKENS))}; with --check-ids 1; "
        "with --read-floors 1,8,64)",
    )
    p.add_argument("--peer-dir", default=None, help="folder with vLLM's extracted kernel (time it too)")
    p.add_argument(
        "--check-ids",
        action="store_true",
        help="instead of the layer table: fused_moe with caller topk_ids, its id check on against off "
        "(graph, eager, host; alternating rounds) -> moe_check_ids.csv",
    )
    p.add_argument(
        "--read-floors",
        action="store_true",
        help="instead of the layer table: a plain one-kernel read of each point's active expert bytes "
        "(bf16 and fp8), the floor the decode times are held to -> read_floors.csv",
    )
    p.add_argument(
        "--launches",
        action="store_true",
        help="instead of the layer table: the device operations of one decode layer call (routing and "
        "capture inside, bf16 and fp8), counted under the torch profiler -> moe_launches.csv",
    )
    a = p.parse_args(argv)
    modes = [f for f, on in (("--check-ids", a.check_ids), ("--read-floors", a.read_floors),
                             ("--launches", a.launches)) if on]  # fmt: skip
    if len(modes) > 1:
        p.error(f"{' and '.join(modes)} are different measurements: give one")
    for flag, on in (
        ("--check-ids", a.check_ids),
        ("--read-floors", a.read_floors),
        ("--launches", a.launches),
    ):
        if on and a.peer_dir:
            p.error(f"{flag} times replaymoe alone: --peer-dir does not apply")
    if a.peer_dir:
        try:
            peer_root = check_peer_dir(a.peer_dir)
        except ValueError as exc:
            p.error(str(exc))
    shapes = choice_list(p, a.shapes, SHAPES, "shapes")
    default_tokens = (
        "1"
        if a.check_ids
        else "1,8,64"
        if a.read_floors
        else "1,8"
        if a.launches
        else ",".join(map(str, TOKENS))
    )
    try:
        tokens = [int(t) for t in (a.tokens or default_tokens).split(",") if t]
    except ValueError:
        p.error(f"--tokens expects comma-separated token counts, got {a.tokens!r}")
    if not tokens or min(tokens) < 1:
        p.error(f"--tokens expects token counts >= 1, got {a.tokens!r}")
    if no_cuda("replaymoe bench moe"):  # (after the options: a bad one is named on any machine)
        return NO_CUDA_EXIT
    from ..moe.tuned import table_for

    dev = torch.device("cuda", torch.cuda.current_device())
    table = table_for(dev)
    base = f", base {table.base}" if table.base else ""
    print(f"card: {torch.cuda.get_device_name(dev)}; tuned table: {table.name} (tuned on "
          f"{table.tuned_on or 'nothing'}{base})", flush=True)  # fmt: skip
    if a.read_floors:
        from .floors import FLOOR_COLUMNS, run_read_floors

        rows = run_read_floors({n: SHAPES[n][:4] for n in shapes}, tokens)
        write_results(rows, a.out, "read_floors")
        print_table(rows, FLOOR_COLUMNS)
        return 0
    if a.launches:
        from .launches import LAUNCH_COLUMNS, run_launches

        rows = run_launches({n: SHAPES[n] for n in shapes}, tokens, make_weights, routing_inputs)
        write_results(rows, a.out, "moe_launches")
        print_table(rows, LAUNCH_COLUMNS)
        return 0
    if a.check_ids:
        rows = run_check_ids(shapes, tokens)
        write_results(rows, a.out, "moe_check_ids")
        print_table(rows, CHECK_COLUMNS)
        return 0
    rows = run(shapes, tokens, load_vllm_peer(peer_root) if a.peer_dir else None)
    write_results(rows, a.out, "moe")
    cols = ["shape", "T", "floor_ms", "rmoe_bf16_ms", "rmoe_fp8_ms", "grouped_mm_ms", "naive_ms",
            "vllm_kernels_ms", "vllm_source", "vs_vllm", "frac_floor_bf16", "tflops_bf16", "fp8_speedup",
            "rmoe_bf16_eager_ms", "rmoe_bf16_eager_host_ms"]  # fmt: skip
    print_table(rows, cols)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

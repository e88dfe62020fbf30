"""``replaymoe bench ep``: expert-parallel dispatch / combine / whole ep_moe layer across GPUs.

Run under torchrun, one process per GPU (NVLink multicast off: the three variables below are set where
unset before the process group is created, :func:`replaymoe._switches.multicast_off`)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 -m replaymoe bench ep --out DIR

DeepSeek-V3 shapes: hidden 7168, 256 experts, top-8 (uniform random routing), I = 2048 for the
layer. Payloads: ``bf16`` = hidden bf16 + ids int32 + weights fp32 (14400 B/token); ``fp8`` = hidden
fp8 + 1x128 fp32 scales + ids + weights (7456 B/token). Combine payload: bf16 [ep, T, 7168].

Implementations: ``nccl`` and ``symm`` (:class:`replaymoe.MoeAlltoAll`), timed as CUDA-graph replays
(``graph``), eagerly (``eager``: one call at a time, each after the ranks line up) and as back-to-back
eager pairs (``eager_loop``: dispatch + combine rows only, per pair); ``naive`` = the usual NCCL recipe
(exchange counts, host sync, variable-size ``all_to_all_single``, index_add), eager only.

Each iteration: all ranks synchronize (a host barrier, then a one-element all-reduce on the stream so
that the ranks start together on the devices; before a CUDA-graph replay a device-side wait long
enough for every host to enqueue it and a second all-reduce: ``bench.ep_timing.align_ranks``;
``--no-align`` keeps the host barrier alone), then CUDA events around dispatch and combine (and
around the whole layer). The reported time is the **median over iterations of the maximum over
ranks**.
Algorithmic bandwidth per rank counts only bytes that must cross between ranks: for each (token,
remote destination rank) pair, the dispatch payload bytes, and 2·H bytes for the combine; the
``floor`` is those bytes at 450 GB/s (NVLink 4, one direction), ``pct_floor`` = floor / time.
Rank 0 prints the table and writes ``ep.csv`` / ``ep.json`` under ``--out``.

``--cpu-dry-run`` checks the script on the CPU (gloo, host timers) in seconds: a tiny shape (hidden
128, 8 experts, top-2, I = 64; 4 and 16 tokens per rank), 2 iterations, the nccl and naive recipes
and the bf16 payload, unless the options say otherwise. Run it under torchrun too::

    torchrun --nproc-per-node 2 -m replaymoe bench ep --cpu-dry-run --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .. import _switches
from .ep_deepep import DEEPEP_DIR, DeepEPPeer
from .ep_host import host_profile
from .ep_layer import time_layer, time_layer_train, time_local, weights_floor_us
from .ep_naive import NaiveEP, time_naive
from .ep_shape import Shape, a2a_kwargs, inputs
from .ep_summary import NAIVE_ANCHOR_MS, print_summary
from .ep_timing import device, err, graph, on_cuda, sync, time_phases, time_replays

__all__ = ["NAIVE_ANCHOR_MS", "DeepEPPeer", "NaiveEP", "host_profile", "main", "run"]

TOKENS = (1, 32, 128, 1024, 4096)
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (18 links), one direction
_GPU_SHAPE = Shape()  # DeepSeek-V3's: the GPU run's default (main builds the run's own from the options)
# option -> (GPU default, --cpu-dry-run default); the dry run's shapes keep it to seconds and a few
# hundred MB per rank (DeepSeek-V3's layer weights alone are 7.5 GB per rank of 2)
_DEFAULTS = {
    "tokens": (",".join(map(str, TOKENS)), "4,16"),
    "iters": (20, 2),
    "warmup": (3, 1),
    "impls": ("nccl,symm,naive", "nccl,naive"),
    "payloads": ("bf16,fp8", "bf16"),
    "hidden": (_GPU_SHAPE.H, 128),
    "experts": (_GPU_SHAPE.E, 8),
    "top_k": (_GPU_SHAPE.K, 2),
    "inter": (_GPU_SHAPE.INTER, 64),
}
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what init_process_group reads


def _remote_pairs(ids: torch.Tensor, num_experts: int, ep: int, rank: int) -> int:
    from ..ep import expert_owner

    owner = expert_owner(ids, num_experts, ep)
    pairs = 0
    for r in range(ep):
        if r != rank:
            pairs += int((owner == r).any(1).sum())
    return pairs


def run(
    tokens,
    *,
    shape: Shape,
    align: bool,
    iters: int,
    warmup: int,
    transports,
    layer: bool,
    graphs: bool,
    log,
    save,
    payloads=("bf16", "fp8"),
    num_sms=(0,),
    peer: str | None = None,
    peer_sms: int = 24,
    prewarm: bool = True,
    deepep_dir: str = DEEPEP_DIR,
    a2a_options: dict | None = None,
) -> list[dict]:
    """All points; ``save(rows)`` is called after each one (so a timeout still leaves results).

    ``shape``: the layer's :class:`~replaymoe.bench.ep_shape.Shape` (hidden, experts, top-k, I).
    ``align``: line the ranks up on the device before every timed iteration
    (:func:`~replaymoe.bench.ep_timing.time_phases`; ``--no-align`` passes False).

    ``prewarm``: before the first timed row, every implementation runs its eager calls once at every
    size, untimed, so that no timed row is the process's first call of its kind (and the implementation
    timed first at a size is not the only one that can pay a first call's cost there).

    ``num_sms``: values of :attr:`MoeAlltoAll.num_sms` to time symm with (0 = unset: dense grids over
    every SM; rows report 0 then).
    ``peer="deepep"``: DeepEP's intranode dispatch/combine on the same tokens and routing, with
    ``peer_sms`` SMs (see :class:`DeepEPPeer`), from the built tree ``deepep_dir``.
    ``a2a_options``: more :class:`MoeAlltoAll` keywords for every implementation (``fused_plan`` /
    ``fused_barrier``: ``--unfused-plan`` / ``--unfused-barrier``).
    """
    from ..ep import MoeAlltoAll, expert_partition
    from ..routing import RoutingMethod

    H, E, K, INTER = shape.H, shape.E, shape.K, shape.INTER
    ep, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    graphs = graphs and on_cuda()
    maxT = max(tokens)
    rows: list[dict] = []
    a2as = {}
    for t in transports:
        if t == "naive":
            continue
        try:
            kw = {**a2a_kwargs(t), **(a2a_options or {})}  # symm_2k / symm_pipe: the combine forced
            a2as[t] = MoeAlltoAll(None, maxT, K, E, H, payload_bytes_per_token=2 * H + 256,
                                  timeout=120 if t.startswith("symm") else None, **kw)  # fmt: skip
        except Exception as e:  # report and go on with the others
            log(f"[rank {rank}] transport {t} unavailable: {err(e)}")
            rows.append({"impl": t, "error": err(e)})
    impls = [t for t in transports if t == "naive" or t in a2as]
    _spin_up(dev)
    naive = NaiveEP(ep, rank, shape)
    deepep = None
    if peer == "deepep":
        try:
            deepep = DeepEPPeer(ep, rank, peer_sms, maxT, log, deepep_dir, shape=shape, align=align)
            rows += deepep.tune(inputs(shape, maxT, rank, dev), iters=max(5, iters // 2), warmup=warmup)
            save(rows)
        except Exception as e:  # report; ours still run
            log(f"[rank {rank}] DeepEP unavailable: {err(e)}\n{traceback.format_exc()}")
            rows.append({"impl": "deepep", "error": err(e)})
            deepep = None
    route_kw = {
        "method": RoutingMethod.DEEPSEEK_V3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
    }

    def pairs_of(ids):
        pairs_t = torch.tensor([_remote_pairs(ids, E, ep, rank)], dtype=torch.float64, device=dev)
        dist.all_reduce(pairs_t)
        return pairs_t.item() / ep  # mean over ranks of (token, remote rank) pairs

    def runs_of(vname):  # (impl, num_sms: 0 = every SM)
        runs = [(impl, n_sms) for impl in impls for n_sms in (num_sms if impl.startswith("symm") else (0,))]
        return runs + ([("deepep", peer_sms)] if deepep is not None and vname == "bf16" else [])

    def time_one(impl, n_sms, T, ids, x, wts, pays, comb, n_iters, n_warmup, with_graphs):
        if impl == "naive":
            return {"eager": time_naive(naive, ids, pays, n_iters, n_warmup, align=align)}
        if impl == "deepep":
            return deepep.time(ids, x, wts, T, n_iters, n_warmup, with_graphs)
        return _time_ours(a2as[impl], ids, pays, comb, T, n_iters, n_warmup, with_graphs, log,
                          num_sms=n_sms or None, align=align)  # fmt: skip

    def point(T):  # the inputs of one size: (ids, x, wts, payload variants, combine input, its buffer)
        ids, x, wts, x8, s8, logits = inputs(shape, T, rank, dev)
        variants = {
            "bf16": ([x, ids, wts], H * 2 + 8 * K),
            "fp8": ([x8, s8, ids, wts], H + 4 * (H // 128) + 8 * K),
        }
        comb_buf = torch.randn(ep * (T + 1), H, device=dev, dtype=torch.bfloat16)
        return ids, x, wts, variants, comb_buf.view(ep, T + 1, H)[:, :T]  # the layout ep_moe hands to combine

    # --- every eager path once at every size, untimed (see ``prewarm``)
    if prewarm:
        t0 = time.perf_counter()
        for T in tokens:
            ids, x, wts, variants, comb = point(T)
            for vname in payloads:
                for impl, n_sms in runs_of(vname):
                    try:
                        time_one(impl, n_sms, T, ids, x, wts, variants[vname][0], comb, 1, 1, False)
                    except Exception:  # the timed pass reports it
                        pass
            del comb
        log(f"[rank {rank}] prewarm: {time.perf_counter() - t0:.1f} s")

    # --- dispatch / combine alone
    for T in tokens:
        ids, x, wts, variants, comb = point(T)
        pairs = pairs_of(ids)
        for vname in payloads:
            pays, bpt = variants[vname]
            d_bytes, c_bytes = pairs * bpt, pairs * 2 * H
            for impl, n_sms in runs_of(vname):
                try:
                    results = time_one(impl, n_sms, T, ids, x, wts, pays, comb, iters, warmup, graphs)
                except Exception as e:
                    log(f"[rank {rank}] {impl} {vname} T={T}: {err(e)}\n{traceback.format_exc()}")
                    rows.append({"impl": impl, "payload": vname, "tokens": T, "error": err(e)})
                    continue
                base = {"impl": impl, "payload": vname, "tokens": T, "num_sms": n_sms}
                for mode, ((td, tc), host) in results.items():
                    if tc is None:  # eager_loop: per dispatch + combine pair only
                        hp = host[0] if host is not None else None
                        rows.append(_row(base, "dispatch+combine", mode, td, d_bytes + c_bytes, hp))
                        continue
                    hd, hc = host if host is not None else (None, None)
                    for op, us, nbytes, h in (
                        ("dispatch", td, d_bytes, hd),
                        ("combine", tc, c_bytes, hc),
                        ("dispatch+combine", td + tc, d_bytes + c_bytes, None if hd is None else hd + hc),
                    ):
                        rows.append(_row(base, op, mode, us, nbytes, h))
                log(f"[rank {rank}] done {impl} {vname} T={T} sms={n_sms}")
                save(rows)
        del comb
    if not layer:
        return rows

    # --- the whole layer: route -> dispatch -> fused_moe (this rank's experts of H x INTER) -> combine,
    # and the same compute without communication (ep_layer's module docstring)
    lo, n = expert_partition(E, ep)[rank]
    g = torch.Generator(device=dev).manual_seed(99 + rank)
    w13 = torch.randn(n, 2 * INTER, H, generator=g, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(n, H, INTER, generator=g, device=dev, dtype=torch.bfloat16) / INTER**0.5
    wfloor = round(weights_floor_us(w13, w2), 2)
    timing = {"shape": shape, "iters": iters, "warmup": warmup, "graphs": graphs, "align": align, "log": log}
    for T in tokens:
        ids, x, wts, x8, s8, logits = inputs(shape, T, rank, dev)
        from ..routing import route

        pairs = pairs_of(route(logits, K, **route_kw).topk_ids)
        nbytes = pairs * (2 * H + 8 * K) + pairs * 2 * H
        for impl in impls:
            base = {"impl": impl, "payload": "bf16", "tokens": T, "weights_floor_us": wfloor}
            ops = ["layer"]
            if impl != "naive":
                ops += ["layer_local", "layer_local_split", "layer_train"]
            for op in ops:
                try:
                    if op == "layer":
                        res = time_layer(impl, naive, a2as.get(impl), x, logits, w13, w2, lo, n, T, route_kw,
                                         **timing)  # fmt: skip
                    elif op == "layer_train":
                        res = time_layer_train(a2as[impl], x, logits, w13, w2, T, route_kw, **timing)
                    else:
                        res = time_local(a2as[impl], x, logits, w13, w2, T, route_kw,
                                         split=op == "layer_local_split", **timing)  # fmt: skip
                except Exception as e:
                    log(f"[rank {rank}] {op} {impl} T={T}: {err(e)}\n{traceback.format_exc()}")
                    rows.append({**base, "op": op, "error": err(e)})
                    continue
                for mode, us in res.items():
                    rows.append(_row(base, op, mode, us, nbytes if op == "layer" else 0))
            log(f"[rank {rank}] done layer {impl} T={T}")
            save(rows)
    return rows


def _spin_up(dev, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while before the first measurement (clocks leave their idle state;
    the first points of a run otherwise came out slower, DeepEP's as much as ours)."""
    if not on_cuda():
        return
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    dist.barrier()


def _row(base, op, mode, us, nbytes, host_us=None) -> dict:
    floor_us = nbytes / NVLINK_BYTES_PER_S * 1e6
    return {
        **base,
        "op": op,
        "mode": mode,
        "us": round(us, 2),
        "host_us": None if host_us is None else round(host_us, 1),
        "GBps_per_rank": round(nbytes / (us * 1e-6) / 1e9, 1) if us > 0 else 0.0,
        "MB_per_rank": round(nbytes / 1e6, 3),
        "floor_us": round(floor_us, 2),
        "pct_floor": round(100 * floor_us / us, 1) if us > 0 else 0.0,
    }


LOOP_CALLS = 10  # dispatch + combine pairs per timed span of the eager_loop mode


def _time_ours(a2a, ids, pays, comb, T, iters, warmup, graphs, log, *, num_sms=None, align: bool):
    """{mode: ((dispatch µs, combine µs), (host µs per call) or None)} for eager and graph, and
    ``eager_loop``: ((µs per dispatch + combine pair, None), (host µs per pair, None)), the pairs issued
    back to back (:data:`LOOP_CALLS` of them between two events after the ranks line up, no sync between
    them), as an eager training or serving loop issues them: the host's issue of one pair overlaps the
    device's work of the one before. Its host time is the steady-state host work per pair (the calls
    never wait for the device), where the ``eager`` rows' host time is that of one call on a host that
    has just synchronized. ``align``: :func:`~replaymoe.bench.ep_timing.time_phases`."""
    a2a.num_sms = num_sms

    def d():
        return a2a.dispatch(ids, pays, T, expert_id_payload_index=len(pays) - 2)

    def c():
        return a2a.combine(comb, T)

    def it(ev):  # host times exclude the event records
        ev[0].record()
        t0 = time.perf_counter()
        d()
        t1 = time.perf_counter()
        ev[1].record()
        t2 = time.perf_counter()
        c()
        t3 = time.perf_counter()
        ev[2].record()
        return (t1 - t0, t3 - t2)

    dev, host = time_phases(it, 2, iters, warmup, align=align)
    res = {"eager": (tuple(dev), tuple(host))}

    def loop(ev):  # (the host time excludes the event records, as above)
        ev[0].record()
        t0 = time.perf_counter()
        for _ in range(LOOP_CALLS):
            d()
            c()
        t1 = time.perf_counter()
        ev[1].record()
        return (t1 - t0,)

    span, host_span = time_phases(loop, 1, max(3, iters // 4), 1, align=align)
    res["eager_loop"] = ((span[0] / LOOP_CALLS, None), (host_span[0] / LOOP_CALLS, None))
    if not graphs:
        return res
    sync()
    d()
    c()  # the steady-state plan exists before capture
    sync()
    try:
        gd, _ = graph(d)
        gc, _ = graph(c, pool=gd.pool())
    except Exception as e:  # eager figures stand; say why there is no graph row
        log(f"graph capture failed ({a2a.transport}): {err(e)}")
        a2a.core.phase, a2a.core.in_flight = "idle", None  # a capture that failed mid-dispatch left them set
        return res

    res["graph"] = (time_replays([gd, gc], iters, warmup, align=align), None)
    return res


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the defaults of a GPU run or of ``--cpu-dry-run`` (``_DEFAULTS``) filled in."""
    p = argparse.ArgumentParser(prog="replaymoe bench ep", description=__doc__.split("\n")[0])

    def default(name: str) -> str:
        gpu, dry = _DEFAULTS[name]
        return f"default {gpu}; {dry} with --cpu-dry-run"

    p.add_argument("--out", default="bench_results", help="output directory for ep.csv / ep.json")
    p.add_argument("--tokens", help="tokens per rank, comma list (" + default("tokens") + ")")
    p.add_argument("--iters", type=int, help="timed iterations per point (" + default("iters") + ")")
    p.add_argument("--warmup", type=int, help="untimed iterations before them (" + default("warmup") + ")")
    p.add_argument(
        "--impls",
        help="comma list of nccl, symm, symm_2k / symm_pipe (symm with the two-kernel / pipelined combine "
        "forced; symm chooses by size), naive (" + default("impls") + ")",
    )
    p.add_argument("--payloads", help="comma list of bf16, fp8 (" + default("payloads") + ")")
    p.add_argument("--num-sms", default="0", help="comma list of num_sms for symm (0 = every SM)")
    p.add_argument(
        "--peer",
        choices=("none", "deepep"),
        default="none",
        help="deepep: DeepEP v1.2.1 intranode side by side (its built source tree: --deepep-dir)",
    )
    p.add_argument(
        "--deepep-dir", default=DEEPEP_DIR, help="DeepEP's built source tree (default %(default)s)"
    )
    p.add_argument("--peer-sms", type=int, default=24, help="SMs given to DeepEP (even)")
    p.add_argument("--no-layer", action="store_true", help="skip the whole ep_moe layer")
    p.add_argument(
        "--unfused-barrier",
        action="store_true",
        help="symm: torch's signal-pad barrier kernel between the phases (MoeAlltoAll(fused_barrier=False))",
    )
    p.add_argument(
        "--unfused-plan",
        action="store_true",
        help="the plan kernel before the pack (MoeAlltoAll(fused_plan=False))",
    )
    p.add_argument("--no-graph", action="store_true", help="eager timings only")
    p.add_argument(
        "--no-prewarm",
        action="store_true",
        help="skip the untimed pass of every implementation at every size before the first timed row",
    )
    p.add_argument(
        "--no-align",
        action="store_true",
        help="start timed iterations after the host barrier only (a rank's time then includes how much later "
        "its peers left the barrier)",
    )
    p.add_argument("--hidden", type=int, help="hidden size (" + default("hidden") + ", DeepSeek-V3's)")
    p.add_argument("--experts", type=int, help="experts over all ranks (" + default("experts") + ")")
    p.add_argument("--top-k", type=int, help="experts per token (" + default("top_k") + ")")
    p.add_argument("--inter", type=int, help="expert intermediate size, layer (" + default("inter") + ")")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run on the CPU with gloo and a tiny shape, to check the script in seconds (under torchrun)",
    )
    p.add_argument("--name", default="ep", help="result file stem (NAME.csv / NAME.json)")
    p.add_argument("--summary-from", metavar="DIR", help="only print the summary of DIR/*.json (no GPU)")
    p.add_argument("--host-profile", action="store_true", help="only profile the host time of eager calls")
    a = p.parse_args(argv)
    for name, (gpu, dry) in _DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, dry if a.cpu_dry_run else gpu)
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.summary_from:
        import json
        from pathlib import Path

        rows = []
        for f in sorted(Path(a.summary_from).glob("*.json")):
            rows += json.loads(f.read_text()).get("rows", [])
        print_summary(rows)
        return 0
    shape = Shape(H=a.hidden, E=a.experts, K=a.top_k, INTER=a.inter)
    align = not a.no_align
    if not torch.cuda.is_available() and not a.cpu_dry_run:
        print(
            "replaymoe bench ep: error: needs CUDA GPUs, and torch sees none (--cpu-dry-run checks the "
            "script on the CPU)",
            file=sys.stderr,
        )
        return 2
    if not dist.is_initialized() and not all(k in os.environ for k in _TORCHRUN_ENV):
        unset = ", ".join(k for k in _TORCHRUN_ENV if k not in os.environ)
        example = "--cpu-dry-run" if a.cpu_dry_run else "--out DIR"
        print(
            f"replaymoe bench ep: error: run it under torchrun, one process per rank ({unset} unset), "
            f"e.g. torchrun --nproc-per-node 2 -m replaymoe bench ep {example}",
            file=sys.stderr,
        )
        return 2
    own_pg = not dist.is_initialized()
    _switches.multicast_off()  # before the process group (NCCL reads NCCL_NVLS_ENABLE at its creation)
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        if own_pg:
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    elif own_pg:
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if a.cpu_dry_run and rank == 0:
        log(
            f"replaymoe bench ep: CPU dry run, {dist.get_world_size()} gloo ranks: hidden {shape.H}, "
            f"{shape.E} experts, top-{shape.K}, I = {shape.INTER}, tokens {a.tokens}, {a.iters} iterations"
        )

    a2a_options = {"fused_barrier": False} if a.unfused_barrier else {}
    if a.unfused_plan:
        a2a_options["fused_plan"] = False

    def save(rows):
        if rank == 0:
            from ._timing import write_results

            write_results([{**r, "ep": dist.get_world_size()} for r in rows], a.out, a.name)

    if a.host_profile:
        try:
            host_profile([int(t) for t in a.tokens.split(",") if t], [t for t in a.impls.split(",") if t],
                         shape=shape, calls=max(50, a.iters * 5), log=log, a2a_options=a2a_options,
                         num_sms=[int(v) for v in a.num_sms.split(",") if v])  # fmt: skip
        finally:
            if own_pg:
                _destroy()
        return 0
    try:
        rows = run(
            [int(t) for t in a.tokens.split(",") if t],
            shape=shape,
            align=align,
            iters=a.iters,
            warmup=a.warmup,
            transports=[t for t in a.impls.split(",") if t],
            layer=not a.no_layer,
            graphs=not a.no_graph,
            log=log,
            save=save,
            payloads=[v for v in a.payloads.split(",") if v],
            num_sms=[int(v) for v in a.num_sms.split(",") if v],
            peer=None if a.peer == "none" else a.peer,
            peer_sms=a.peer_sms,
            prewarm=not a.no_prewarm,
            deepep_dir=a.deepep_dir,
            a2a_options=a2a_options,
        )
        save(rows)
        if rank == 0:
            print_summary([{**r, "ep": dist.get_world_size()} for r in rows])
    finally:
        if own_pg:
            _destroy()
    return 0


def _destroy() -> None:
    """Tear the process group down with nothing left holding it: the benchmark's objects (all-to-all
    buffers, the naive recipe) are freed first (``gc``: some sit in reference cycles), so that no
    gloo / NCCL group is destroyed later during interpreter shutdown (where gloo aborted the process,
    "terminate called without an active exception", in about half of the CPU dry runs)."""
    import gc

    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())

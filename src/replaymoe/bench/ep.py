"""``replaymoe bench ep``: expert-parallel dispatch / combine / whole ep_moe layer across GPUs.

Run under torchrun, one process per GPU (NVLink multicast off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 -m replaymoe.cli bench ep --out DIR

DeepSeek-V3 shapes: hidden 7168, 256 experts, top-8 (uniform random routing), I = 2048 for the
layer. Payloads: ``bf16`` = hidden bf16 + ids int32 + weights fp32 (14400 B/token); ``fp8`` = hidden
fp8 + 1x128 fp32 scales + ids + weights (7456 B/token). Combine payload: bf16 [ep, T, 7168].

Implementations: ``nccl`` and ``symm`` (:class:`replaymoe.MoeAlltoAll`), timed as CUDA-graph replays
(``graph``) and eagerly (``eager``); ``naive`` = the usual NCCL recipe (exchange counts, host sync,
variable-size ``all_to_all_single``, index_add), eager only.

Each iteration: all ranks synchronize, then CUDA events around dispatch and combine (and around the
whole layer). The reported time is the **median over iterations of the maximum over ranks**.
Algorithmic bandwidth per rank counts only bytes that must cross between ranks: for each (token,
remote destination rank) pair, the dispatch payload bytes, and 2·H bytes for the combine; the
``floor`` is those bytes at 450 GB/s (NVLink 4, one direction), ``pct_floor`` = floor / time.
Rank 0 prints the table and writes ``ep.csv`` / ``ep.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

H, E, K, INTER = 7168, 256, 8, 2048
TOKENS = (1, 32, 128, 1024, 4096)
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (18 links), one direction
# naive NCCL dispatch measured on this machine before (reference/toolchain.md), ms
NAIVE_ANCHOR_MS = {128: 0.43, 4096: 0.94}


# ----------------------------------------------------------------------------------------------
# timing helpers (max over ranks per iteration, then median)
# ----------------------------------------------------------------------------------------------


class _HostEvent:
    """CPU stand-in for ``torch.cuda.Event`` (the gloo dry run of this script)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def _cuda() -> bool:
    return torch.cuda.is_available()


def _event():
    return torch.cuda.Event(enable_timing=True) if _cuda() else _HostEvent()


def _sync():
    if _cuda():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _cuda() else torch.device("cpu")


def _time_phases(run_iter, n_phases: int, iters: int, warmup: int) -> list[float]:
    """``run_iter(events)`` records ``n_phases + 1`` events; returns per phase the median over
    iterations of the max over ranks, in microseconds."""
    for _ in range(warmup):
        ev = [_event() for _ in range(n_phases + 1)]
        run_iter(ev)
    _sync()
    times = torch.zeros(iters, n_phases, dtype=torch.float64, device=_device())
    for i in range(iters):
        ev = [_event() for _ in range(n_phases + 1)]
        _sync()
        dist.barrier()
        run_iter(ev)
        ev[-1].synchronize()
        for p in range(n_phases):
            times[i, p] = ev[p].elapsed_time(ev[p + 1]) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [statistics.median(times[:, p].tolist()) for p in range(n_phases)]


def _graph(fn, pool=None):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


# ----------------------------------------------------------------------------------------------
# the naive NCCL peer
# ----------------------------------------------------------------------------------------------


class NaiveEP:
    """Counts exchange + host sync + variable-size ``all_to_all_single`` (the common first recipe)."""

    def __init__(self, ep: int, rank: int):
        self.ep, self.rank = ep, rank

    def dispatch(self, ids: torch.Tensor, payloads: list[torch.Tensor]):
        from ..ep import expert_owner

        T = ids.shape[0]
        owner = expert_owner(ids, E, self.ep)
        mask = torch.zeros(T, self.ep + 1, dtype=torch.bool, device=ids.device)
        mask.scatter_(1, owner, True)
        mask = mask[:, : self.ep]
        dest_tok = [torch.nonzero(mask[:, r]).flatten() for r in range(self.ep)]  # host syncs
        order = torch.cat(dest_tok)
        send_counts = torch.tensor([len(d) for d in dest_tok], dtype=torch.int64, device=ids.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        rc = recv_counts.tolist()  # host sync
        sc = send_counts.tolist()
        rows = torch.cat([p.reshape(T, -1).view(torch.uint8) for p in payloads], dim=1)
        send = rows[order]
        recv = torch.empty(sum(rc), rows.shape[1], dtype=torch.uint8, device=ids.device)
        dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)
        self.state = (order, sc, rc, T)
        return recv

    def combine(self, back: torch.Tensor) -> torch.Tensor:
        order, sc, rc, T = self.state
        ret = torch.empty(sum(sc), back.shape[1], dtype=back.dtype, device=back.device)
        dist.all_to_all_single(ret, back.contiguous(), output_split_sizes=sc, input_split_sizes=rc)
        out = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
        out.index_add_(0, order, ret.float())
        return out.to(back.dtype)


def _naive_layer(naive, x, logits, w13, w2, lo, n, route_kw):
    from ..moe import fused_moe
    from ..routing import route

    r = route(logits, K, **route_kw)
    recv = naive.dispatch(r.topk_ids, [x, r.topk_ids, r.topk_weights])
    hb = H * 2
    hid = recv[:, :hb].view(torch.bfloat16)
    ids = recv[:, hb : hb + 4 * K].contiguous().view(torch.int32)
    wts = recv[:, hb + 4 * K : hb + 8 * K].contiguous().view(torch.float32)
    ids = torch.where((ids >= lo) & (ids < lo + n), ids, torch.full_like(ids, -1))
    y = fused_moe(hid, w13, w2, topk_ids=ids, topk_weights=wts, local_expert_offset=lo, num_experts=E)
    return naive.combine(y)


# ----------------------------------------------------------------------------------------------


def _inputs(T: int, rank: int, dev):
    g = torch.Generator(device=dev).manual_seed(1234 + 17 * rank + T)
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices.to(torch.int32)
    x = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
    wts = torch.rand(T, K, generator=g, device=dev)
    x8 = (torch.randn(T, H, generator=g, device=dev) * 4).to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, generator=g, device=dev)
    logits = torch.randn(T, E, generator=g, device=dev)
    return ids, x, wts, x8, s8, logits


def _remote_pairs(ids: torch.Tensor, ep: int, rank: int) -> int:
    from ..ep import expert_owner

    owner = expert_owner(ids, E, ep)
    pairs = 0
    for r in range(ep):
        if r != rank:
            pairs += int((owner == r).any(1).sum())
    return pairs


def run(tokens, *, iters: int, warmup: int, transports, layer: bool, graphs: bool, log, save) -> list[dict]:
    """All points; ``save(rows)`` is called after each one (so a timeout still leaves results)."""
    from ..ep import MoeAlltoAll, expert_partition
    from ..routing import RoutingMethod

    ep, rank = dist.get_world_size(), dist.get_rank()
    dev = _device()
    graphs = graphs and _cuda()
    maxT = max(tokens)
    rows: list[dict] = []
    a2as = {}
    for t in transports:
        if t == "naive":
            continue
        try:
            a2as[t] = MoeAlltoAll(None, maxT, K, E, H, transport=t, payload_bytes_per_token=2 * H + 256)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            log(f"[rank {rank}] transport {t} unavailable: {_err(e)}")
            rows.append({"impl": t, "error": _err(e)})
    impls = [t for t in transports if t == "naive" or t in a2as]
    naive = NaiveEP(ep, rank)
    route_kw = {
        "method": RoutingMethod.DEEPSEEK_V3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
    }

    def pairs_of(ids):
        pairs_t = torch.tensor([_remote_pairs(ids, ep, rank)], dtype=torch.float64, device=dev)
        dist.all_reduce(pairs_t)
        return pairs_t.item() / ep  # mean over ranks of (token, remote rank) pairs

    # --- dispatch / combine alone
    for T in tokens:
        ids, x, wts, x8, s8, logits = _inputs(T, rank, dev)
        pairs = pairs_of(ids)
        variants = {
            "bf16": ([x, ids, wts], H * 2 + 8 * K),
            "fp8": ([x8, s8, ids, wts], H + 4 * (H // 128) + 8 * K),
        }
        comb_buf = torch.randn(ep * (T + 1), H, device=dev, dtype=torch.bfloat16)
        comb = comb_buf.view(ep, T + 1, H)[:, :T]  # the layout ep_moe hands to combine
        for vname, (pays, bpt) in variants.items():
            d_bytes, c_bytes = pairs * bpt, pairs * 2 * H
            for impl in impls:
                base = {"impl": impl, "payload": vname, "tokens": T}
                try:
                    if impl == "naive":
                        results = {"eager": _time_naive(naive, ids, pays, iters, warmup)}
                    else:
                        results = _time_ours(a2as[impl], ids, pays, comb, T, iters, warmup, graphs, log)
                except Exception as e:  # noqa: BLE001
                    log(f"[rank {rank}] {impl} {vname} T={T}: {_err(e)}\n{traceback.format_exc()}")
                    rows.append({**base, "error": _err(e)})
                    continue
                for mode, (td, tc) in results.items():
                    for op, us, nbytes in (
                        ("dispatch", td, d_bytes),
                        ("combine", tc, c_bytes),
                        ("dispatch+combine", td + tc, d_bytes + c_bytes),
                    ):
                        rows.append(_row(base, op, mode, us, nbytes))
                log(f"[rank {rank}] done {impl} {vname} T={T}")
                save(rows)
        del comb_buf
    if not layer:
        return rows

    # --- the whole layer: route -> dispatch -> fused_moe (64 local experts of 7168x2048) -> combine
    lo, n = expert_partition(E, ep)[rank]
    g = torch.Generator(device=dev).manual_seed(99 + rank)
    w13 = torch.randn(n, 2 * INTER, H, generator=g, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(n, H, INTER, generator=g, device=dev, dtype=torch.bfloat16) / INTER**0.5
    for T in tokens:
        ids, x, wts, x8, s8, logits = _inputs(T, rank, dev)
        from ..routing import route

        pairs = pairs_of(route(logits, K, **route_kw).topk_ids)
        for impl in impls:
            base = {"impl": impl, "payload": "bf16", "tokens": T}
            try:
                res = _time_layer(impl, naive, a2as.get(impl), x, logits, w13, w2, lo, n, T, route_kw,
                                  iters=iters, warmup=warmup, graphs=graphs, log=log)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"[rank {rank}] layer {impl} T={T}: {_err(e)}\n{traceback.format_exc()}")
                rows.append({**base, "op": "layer", "error": _err(e)})
                continue
            for mode, us in res.items():
                rows.append(_row(base, "layer", mode, us, pairs * (2 * H + 8 * K) + pairs * 2 * H))
            log(f"[rank {rank}] done layer {impl} T={T}")
            save(rows)
    return rows


def _set_shape(hidden: int, experts: int, top_k: int, inter: int) -> None:
    global H, E, K, INTER
    H, E, K, INTER = hidden, experts, top_k, inter


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _time_layer(impl, naive, a2a, x, logits, w13, w2, lo, n, T, route_kw, *, iters, warmup, graphs, log):
    """Median (over iterations) of the max (over ranks) time of one whole layer, per mode (µs)."""
    from ..ep import ep_moe

    if impl == "naive":

        def fn():
            return _naive_layer(naive, x, logits, w13, w2, lo, n, route_kw)
    else:

        def fn():
            return ep_moe(x, logits, w13, w2, a2a, top_k=K, runtime_max_tokens_per_rank=T, **route_kw)

    def it(ev):
        ev[0].record()
        fn()
        ev[1].record()

    res = {"eager": _time_phases(it, 1, iters, warmup)[0]}
    if graphs and impl != "naive":
        try:
            g, _ = _graph(fn)
        except Exception as e:  # noqa: BLE001
            log(f"layer graph capture failed for {impl} T={T}: {_err(e)}")
            return res

        def itg(ev):
            ev[0].record()
            g.replay()
            ev[1].record()

        res["graph"] = _time_phases(itg, 1, iters, warmup)[0]
    return res


def _row(base, op, mode, us, nbytes) -> dict:
    floor_us = nbytes / NVLINK_BYTES_PER_S * 1e6
    return {
        **base,
        "op": op,
        "mode": mode,
        "us": round(us, 2),
        "GBps_per_rank": round(nbytes / (us * 1e-6) / 1e9, 1) if us > 0 else 0.0,
        "MB_per_rank": round(nbytes / 1e6, 3),
        "floor_us": round(floor_us, 2),
        "pct_floor": round(100 * floor_us / us, 1) if us > 0 else 0.0,
    }


def _time_ours(a2a, ids, pays, comb, T, iters, warmup, graphs, log):
    def d():
        return a2a.dispatch(ids, pays, T, expert_id_payload_index=len(pays) - 2)

    def c():
        return a2a.combine(comb, T)

    def it(ev):
        ev[0].record()
        d()
        ev[1].record()
        c()
        ev[2].record()

    res = {"eager": tuple(_time_phases(it, 2, iters, warmup))}
    if not graphs:
        return res
    _sync()
    d()
    c()  # buffers exist before capture
    _sync()
    try:
        gd, _ = _graph(d)
        keep = a2a._plan  # the combine graph reads the plan made in the dispatch graph
        gc, _ = _graph(c, pool=gd.pool())
    except Exception as e:  # noqa: BLE001 - eager figures stand; say why there is no graph row
        log(f"graph capture failed ({a2a.transport}): {_err(e)}")
        a2a._phase, a2a._plan = "idle", None
        return res

    def itg(ev):
        ev[0].record()
        gd.replay()
        ev[1].record()
        gc.replay()
        ev[2].record()

    res["graph"] = tuple(_time_phases(itg, 2, iters, warmup))
    del keep
    return res


def _time_naive(naive, ids, pays, iters, warmup):
    back = {}

    def it(ev):
        ev[0].record()
        recv = naive.dispatch(ids, pays)
        if "y" not in back or back["y"].shape[0] != recv.shape[0]:
            back["y"] = torch.randn(recv.shape[0], H, device=recv.device, dtype=torch.bfloat16)
        ev[1].record()
        naive.combine(back["y"])
        ev[2].record()

    return tuple(_time_phases(it, 2, iters, warmup))


def _print_summary(rows: list[dict]) -> None:
    from ._timing import print_table

    ok = [r for r in rows if "error" not in r]
    print("\n# replaymoe bench ep — median over iterations of the max over ranks (µs)")
    print_table(
        ok, ["impl", "payload", "tokens", "op", "mode", "us", "GBps_per_rank", "floor_us", "pct_floor"]
    )
    errs = [r for r in rows if "error" in r]
    for r in errs:
        where = f"{r.get('impl')} {r.get('payload', '')} T={r.get('tokens', '')} {r.get('op', '')}"
        print(f"ERROR {where}: {r['error']}")
    # the short tables: per implementation, best mode (g = graph, e = eager)
    impls = sorted({r["impl"] for r in ok})
    tokens = sorted({r["tokens"] for r in ok})
    for payload, op, title in (
        ("bf16", "dispatch", "dispatch alone, bf16 payload"),
        ("fp8", "dispatch", "dispatch alone, fp8 payload + scales"),
        ("bf16", "dispatch+combine", "dispatch+combine, bf16 payload"),
        ("bf16", "layer", "whole ep_moe layer (route + dispatch + fused_moe + combine)"),
    ):
        print(f"\n# {title}: µs [GB/s per rank, % of the 450 GB/s NVLink floor]")
        print("tokens " + " ".join(f"{i:>26}" for i in impls))
        for T in tokens:
            cells = []
            for i in impls:
                c = [r for r in ok if (r["impl"], r["tokens"], r["payload"], r["op"]) == (i, T, payload, op)]
                if c:
                    b = min(c, key=lambda r: r["us"])
                    cells.append(
                        f"{b['us']:>9.1f} [{b['GBps_per_rank']:>6.1f},{b['pct_floor']:>5.1f}%] {b['mode'][0]}"
                    )
                else:
                    cells.append("-")
            print(f"{T:>6} " + " ".join(f"{c:>26}" for c in cells))
    anchors = ", ".join(f"{t} tok: {ms * 1e3:.0f} µs" for t, ms in NAIVE_ANCHOR_MS.items())
    print(f"(earlier naive NCCL dispatch alone on this machine: {anchors})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench ep", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory for ep.csv / ep.json")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per rank, comma list")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default="nccl,symm,naive", help="comma list of nccl, symm, naive")
    p.add_argument("--no-layer", action="store_true", help="skip the whole ep_moe layer")
    p.add_argument("--no-graph", action="store_true", help="eager timings only")
    p.add_argument("--hidden", type=int, default=H, help="hidden size (default DeepSeek-V3's 7168)")
    p.add_argument("--experts", type=int, default=E)
    p.add_argument("--top-k", type=int, default=K)
    p.add_argument("--inter", type=int, default=INTER, help="expert intermediate size (layer)")
    p.add_argument("--cpu-dry-run", action="store_true", help="run on CPU with gloo (checks the script)")
    p.add_argument("--name", default="ep", help="result file stem (NAME.csv / NAME.json)")
    p.add_argument("--summary-from", metavar="DIR", help="only print the summary of DIR/*.json (no GPU)")
    a = p.parse_args(argv)
    if a.summary_from:
        import json
        from pathlib import Path

        rows = []
        for f in sorted(Path(a.summary_from).glob("*.json")):
            rows += json.loads(f.read_text()).get("rows", [])
        _print_summary(rows)
        return 0
    _set_shape(a.hidden, a.experts, a.top_k, a.inter)
    if not torch.cuda.is_available() and not a.cpu_dry_run:
        print("replaymoe bench ep needs CUDA GPUs (run it under torchrun)", file=sys.stderr)
        return 2
    own_pg = not dist.is_initialized()
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

    def save(rows):
        if rank == 0:
            from ._timing import write_results

            write_results([{**r, "ep": dist.get_world_size()} for r in rows], a.out, a.name)

    try:
        rows = run(
            [int(t) for t in a.tokens.split(",") if t],
            iters=a.iters,
            warmup=a.warmup,
            transports=[t for t in a.impls.split(",") if t],
            layer=not a.no_layer,
            graphs=not a.no_graph,
            log=log,
            save=save,
        )
        save(rows)
        if rank == 0:
            _print_summary(rows)
    finally:
        if own_pg:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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


def _time_phases(run_iter, n_phases: int, iters: int, warmup: int):
    """``run_iter(events)`` records ``n_phases + 1`` events and may return the host seconds of each
    phase; returns (per phase the median over iterations of the max over ranks of the device time,
    the same for the host time or None), in microseconds."""
    for _ in range(warmup):
        ev = [_event() for _ in range(n_phases + 1)]
        run_iter(ev)
    _sync()
    times = torch.zeros(iters, 2 * n_phases, dtype=torch.float64, device=_device())
    host = False
    for i in range(iters):
        ev = [_event() for _ in range(n_phases + 1)]
        _sync()
        dist.barrier()
        h = run_iter(ev)
        ev[-1].synchronize()
        for p in range(n_phases):
            times[i, p] = ev[p].elapsed_time(ev[p + 1]) * 1e3
        if h is not None:
            host = True
            for p in range(n_phases):
                times[i, n_phases + p] = h[p] * 1e6
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    med = [statistics.median(times[:, p].tolist()) for p in range(2 * n_phases)]
    return med[:n_phases], (med[n_phases:] if host else None)


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


def run(
    tokens,
    *,
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
) -> list[dict]:
    """All points; ``save(rows)`` is called after each one (so a timeout still leaves results).

    ``num_sms``: values of :attr:`MoeAlltoAll.num_sms` to time symm with (0 = unset: dense grids over
    every SM; rows report 0 then).
    ``peer="deepep"``: DeepEP's intranode dispatch/combine on the same tokens and routing, with
    ``peer_sms`` SMs (see :class:`DeepEPPeer`).
    """
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
            a2as[t] = MoeAlltoAll(None, maxT, K, E, H, transport=t, payload_bytes_per_token=2 * H + 256,
                                  timeout=120 if t == "symm" else None)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            log(f"[rank {rank}] transport {t} unavailable: {_err(e)}")
            rows.append({"impl": t, "error": _err(e)})
    impls = [t for t in transports if t == "naive" or t in a2as]
    _spin_up(dev)
    naive = NaiveEP(ep, rank)
    deepep = None
    if peer == "deepep":
        try:
            deepep = DeepEPPeer(ep, rank, peer_sms, maxT, log)
            rows += deepep.tune(_inputs(maxT, rank, dev), iters=max(5, iters // 2), warmup=warmup)
            save(rows)
        except Exception as e:  # noqa: BLE001 - report; ours still run
            log(f"[rank {rank}] DeepEP unavailable: {_err(e)}\n{traceback.format_exc()}")
            rows.append({"impl": "deepep", "error": _err(e)})
            deepep = None
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
        for vname in payloads:
            pays, bpt = variants[vname]
            d_bytes, c_bytes = pairs * bpt, pairs * 2 * H
            runs = []  # (impl, num_sms: 0 = every SM)
            for impl in impls:
                for n_sms in num_sms if impl == "symm" else (0,):
                    runs.append((impl, n_sms))
            if deepep is not None and vname == "bf16":
                runs.append(("deepep", peer_sms))
            for impl, n_sms in runs:
                try:
                    if impl == "naive":
                        results = {"eager": _time_naive(naive, ids, pays, iters, warmup)}
                    elif impl == "deepep":
                        results = deepep.time(ids, x, wts, T, iters, warmup, graphs)
                    else:
                        results = _time_ours(a2as[impl], ids, pays, comb, T, iters, warmup, graphs, log,
                                             num_sms=n_sms or None)  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    log(f"[rank {rank}] {impl} {vname} T={T}: {_err(e)}\n{traceback.format_exc()}")
                    rows.append({"impl": impl, "payload": vname, "tokens": T, "error": _err(e)})
                    continue
                base = {"impl": impl, "payload": vname, "tokens": T, "num_sms": n_sms}
                for mode, ((td, tc), host) in results.items():
                    hd, hc = host if host is not None else (None, None)
                    for op, us, nbytes, h in (
                        ("dispatch", td, d_bytes, hd),
                        ("combine", tc, c_bytes, hc),
                        ("dispatch+combine", td + tc, d_bytes + c_bytes, None if hd is None else hd + hc),
                    ):
                        rows.append(_row(base, op, mode, us, nbytes, h))
                log(f"[rank {rank}] done {impl} {vname} T={T} sms={n_sms}")
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


def _spin_up(dev, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while before the first measurement (clocks leave their idle state;
    the first points of a run otherwise came out slower, DeepEP's as much as ours)."""
    if not _cuda():
        return
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    dist.barrier()


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

    res = {"eager": _time_phases(it, 1, iters, warmup)[0][0]}
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

        res["graph"] = _time_phases(itg, 1, iters, warmup)[0][0]
    return res


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


def _time_ours(a2a, ids, pays, comb, T, iters, warmup, graphs, log, *, num_sms=None):
    """{mode: ((dispatch µs, combine µs), (host µs per call) or None)} for eager and graph."""
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

    dev, host = _time_phases(it, 2, iters, warmup)
    res = {"eager": (tuple(dev), tuple(host))}
    if not graphs:
        return res
    _sync()
    d()
    c()  # the steady-state plan exists before capture
    _sync()
    try:
        gd, _ = _graph(d)
        gc, _ = _graph(c, pool=gd.pool())
    except Exception as e:  # noqa: BLE001 - eager figures stand; say why there is no graph row
        log(f"graph capture failed ({a2a.transport}): {_err(e)}")
        a2a._phase, a2a._st = "idle", None
        return res

    def itg(ev):
        ev[0].record()
        gd.replay()
        ev[1].record()
        gc.replay()
        ev[2].record()

    res["graph"] = (tuple(_time_phases(itg, 2, iters, warmup)[0]), None)
    return res


def _time_naive(naive, ids, pays, iters, warmup):
    back = {}

    def it(ev):
        t0 = time.perf_counter()
        ev[0].record()
        recv = naive.dispatch(ids, pays)
        if "y" not in back or back["y"].shape[0] != recv.shape[0]:
            back["y"] = torch.randn(recv.shape[0], H, device=recv.device, dtype=torch.bfloat16)
        ev[1].record()
        t1 = time.perf_counter()
        naive.combine(back["y"])
        ev[2].record()
        return (t1 - t0, time.perf_counter() - t1)

    dev, host = _time_phases(it, 2, iters, warmup)
    return (tuple(dev), tuple(host))


# ----------------------------------------------------------------------------------------------
# DeepEP (benchmark peer, loaded at run time from a git-ignored build; never a dependency)
# ----------------------------------------------------------------------------------------------


def _import_deepep():
    """``deep_ep`` from ``$REPLAYMOE_DEEPEP`` (default: where ``build_deepep.sh`` builds it)."""
    path = os.environ.get("REPLAYMOE_DEEPEP", "/tmp/deepep/DeepEP-1.2.1")
    if path not in sys.path:
        sys.path.insert(0, path)
    import deep_ep

    return deep_ep


class DeepEPPeer:
    """DeepEP v1.2.1 intranode ``Buffer.dispatch`` / ``Buffer.combine`` on the same tokens, routing
    and weights as ours (hidden bf16, top-k ids as int64, weights fp32), with ``num_sms`` SMs.

    Modes:
    * ``eager``: ``get_dispatch_layout`` + ``dispatch`` (the host waits for the received counts: that
      is DeepEP's normal mode) and ``combine`` with the handle;
    * ``graph``: the same with ``num_worst_tokens = ep * T`` (no host sync; DeepEP's CUDA-graph
      mode), dispatch and combine each captured in a CUDA graph;
    * ``cached``: ``dispatch`` of the hidden states alone with a previous call's handle (the mode
      DeepEP's own tuning times), eager.
    The NVLink chunk sizes are tuned once at the largest token count, like DeepEP's test does
    (:meth:`tune`); the SM count stays fixed.
    """

    def __init__(self, ep: int, rank: int, num_sms: int, max_tokens: int, log) -> None:
        deep_ep = _import_deepep()
        self.deep_ep, self.ep, self.rank, self.num_sms, self.log = deep_ep, ep, rank, num_sms, log
        deep_ep.Buffer.set_num_sms(num_sms)
        self.dcfg = deep_ep.Buffer.get_dispatch_config(ep)
        self.ccfg = deep_ep.Buffer.get_combine_config(ep)
        nvl = 0
        for chunk in (4, 8, 12, 16, 24, 32):
            cfg = deep_ep.Config(num_sms, chunk, 256, 6, 128)
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(H * 2, ep))
        for cfg in (self.dcfg, self.ccfg):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(H * 2, ep))
        self.buf = deep_ep.Buffer(dist.group.WORLD, nvl, 0)
        self.chunks = ("default", "default")

    def _dispatch(self, idx, x, w, cfg, worst=0):
        b = self.buf
        ntr, _, nte, in_rank, _ = b.get_dispatch_layout(idx, E)
        out = b.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=nte,
                         topk_idx=idx, topk_weights=w, config=cfg, num_worst_tokens=worst)  # fmt: skip
        return out[0], out[4]  # recv_x, handle

    def tune(self, inputs, *, iters: int, warmup: int) -> list[dict]:
        """Best NVLink chunk sizes (cached mode at the largest T), as DeepEP's test tunes them."""
        ids, x, w = inputs[0], inputs[1], inputs[2]
        idx = ids.long()
        deep_ep = self.deep_ep
        recv_x, handle = self._dispatch(idx, x, w, self.dcfg)
        rows = []
        best_d, best_c = (None, float("inf")), (None, float("inf"))
        for chunk in (8, 16, 24, 32):
            cfg = deep_ep.Config(self.num_sms, chunk, 256, 6, 128)

            def it(ev, cfg=cfg):
                ev[0].record()
                self.buf.dispatch(x, handle=handle, config=cfg)
                ev[1].record()

            us = _time_phases(it, 1, iters, warmup)[0][0]
            rows.append({"impl": "deepep-tune", "op": "dispatch", "mode": "cached", "nvl_chunk": chunk,
                         "num_sms": self.num_sms, "tokens": ids.shape[0], "us": round(us, 2)})  # fmt: skip
            if us < best_d[1]:
                best_d = (cfg, us, chunk)
        for chunk in (4, 8, 12, 16):
            cfg = deep_ep.Config(self.num_sms, chunk, 256, 6, 128)

            def itc(ev, cfg=cfg):
                ev[0].record()
                self.buf.combine(recv_x, handle, config=cfg)
                ev[1].record()

            us = _time_phases(itc, 1, iters, warmup)[0][0]
            rows.append({"impl": "deepep-tune", "op": "combine", "mode": "cached", "nvl_chunk": chunk,
                         "num_sms": self.num_sms, "tokens": ids.shape[0], "us": round(us, 2)})  # fmt: skip
            if us < best_c[1]:
                best_c = (cfg, us, chunk)
        self.dcfg, self.ccfg = best_d[0], best_c[0]
        self.chunks = (best_d[2], best_c[2])
        self.log(f"[rank {self.rank}] DeepEP tuned: dispatch chunk {best_d[2]}, combine chunk {best_c[2]}")
        return rows

    def time(self, ids, x, w, T, iters, warmup, graphs):
        idx = ids.long()
        b = self.buf
        st = {}

        def it(ev):
            ev[0].record()
            t0 = time.perf_counter()
            st["rx"], st["h"] = self._dispatch(idx, x, w, self.dcfg)
            t1 = time.perf_counter()
            ev[1].record()
            t2 = time.perf_counter()
            b.combine(st["rx"], st["h"], config=self.ccfg)
            t3 = time.perf_counter()
            ev[2].record()
            return (t1 - t0, t3 - t2)

        dev, host = _time_phases(it, 2, iters, warmup)
        res = {"eager": (tuple(dev), tuple(host))}
        rx, h = st["rx"], st["h"]

        def itc(ev):
            ev[0].record()
            t0 = time.perf_counter()
            b.dispatch(x, handle=h, config=self.dcfg)
            t1 = time.perf_counter()
            ev[1].record()
            t2 = time.perf_counter()
            b.combine(rx, h, config=self.ccfg)
            t3 = time.perf_counter()
            ev[2].record()
            return (t1 - t0, t3 - t2)

        dev, host = _time_phases(itc, 2, iters, warmup)
        res["cached"] = (tuple(dev), tuple(host))
        if not graphs:
            return res
        worst = T * self.ep
        try:
            _sync()
            rxw, hw = self._dispatch(idx, x, w, self.dcfg, worst)
            b.combine(rxw, hw, config=self.ccfg)
            _sync()
            gd, outs = _graph(lambda: self._dispatch(idx, x, w, self.dcfg, worst))
            gc, _ = _graph(lambda: b.combine(outs[0], outs[1], config=self.ccfg), pool=gd.pool())
        except Exception as e:  # noqa: BLE001 - DeepEP may refuse capture: eager figures stand
            self.log(f"[rank {self.rank}] DeepEP graph capture failed: {_err(e)}")
            return res

        def itg(ev):
            ev[0].record()
            gd.replay()
            ev[1].record()
            gc.replay()
            ev[2].record()

        res["graph"] = (tuple(_time_phases(itg, 2, iters, warmup)[0]), None)
        return res


def _print_summary(rows: list[dict]) -> None:
    from ._timing import print_table

    ok = [r for r in rows if "error" not in r and r.get("impl") != "deepep-tune"]
    print(
        "\n# replaymoe bench ep — median over iterations of the max over ranks "
        "(µs; host_us: host time per call, event records excluded)"
    )
    print_table(
        ok,
        ["impl", "payload", "tokens", "num_sms", "op", "mode", "us", "host_us", "GBps_per_rank", "pct_floor"],
    )
    tune = [r for r in rows if r.get("impl") == "deepep-tune"]
    if tune:
        print("\n# DeepEP NVLink chunk tuning (cached mode, largest T)")
        print_table(tune, ["op", "nvl_chunk", "num_sms", "tokens", "us"])
    for r in [r for r in rows if "error" in r]:
        where = f"{r.get('impl')} {r.get('payload', '')} T={r.get('tokens', '')} {r.get('op', '')}"
        print(f"ERROR {where}: {r['error']}")

    def get(impl, T, op, mode, sms=None, payload="bf16"):
        want = (impl, T, op, mode, payload)
        c = [r for r in ok if (r["impl"], r["tokens"], r["op"], r["mode"], r["payload"]) == want
             and (sms is None or r.get("num_sms") == sms)]  # fmt: skip
        return min(c, key=lambda r: r["us"]) if c else None

    tokens = sorted({r["tokens"] for r in ok})
    ours = sorted({(r["impl"], r.get("num_sms", 0)) for r in ok if r["impl"] in ("nccl", "symm")})
    # goal 1: eager <= 1.3 x graph + 20 µs, host <= 30 µs per call
    print("\n# goal 1 (eager calls): eager µs / graph µs -> bound 1.3*graph+20; host µs per call (bf16)")
    print(f"{'impl':>6} {'sms':>4} {'tokens':>6} {'op':>9} {'eager':>8} {'graph':>8} {'bound':>8} "
          f"{'host':>6} ok")  # fmt: skip
    for impl, sms in ours:
        for T in tokens:
            for op in ("dispatch", "combine"):
                e, g = get(impl, T, op, "eager", sms), get(impl, T, op, "graph", sms)
                if e is None or g is None:
                    continue
                bound = 1.3 * g["us"] + 20
                good = e["us"] <= bound and (e.get("host_us") or 0) <= 30
                print(f"{impl:>6} {sms:>4} {T:>6} {op:>9} {e['us']:>8.1f} {g['us']:>8.1f} {bound:>8.1f} "
                      f"{e.get('host_us') or 0:>6.1f} {'yes' if good else 'NO'}")  # fmt: skip
    # goal 2: ours <= DeepEP, no more SMs
    peer = [r for r in ok if r["impl"] == "deepep"]
    if peer:
        psms = peer[0]["num_sms"]
        print(f"\n# goal 2 (vs DeepEP, {psms} SMs; ours symm with num_sms <= {psms}): µs, ours / DeepEP")
        print(f"{'tokens':>6} {'op':>9} {'mode':>6} {'ours':>8} {'deepep':>8} {'ratio':>6}  deepep cached")
        cands = [s for i, s in ours if i == "symm" and 0 < s <= psms]
        for T in tokens:
            for op in ("dispatch", "combine", "dispatch+combine"):
                for mode in ("eager", "graph"):
                    o = [get("symm", T, op, mode, s) for s in cands]
                    o = [r for r in o if r is not None]
                    d = get("deepep", T, op, mode)
                    if not o or d is None:
                        continue
                    b = min(o, key=lambda r: r["us"])
                    dc = get("deepep", T, op, "cached")
                    ratio = b["us"] / d["us"]
                    print(f"{T:>6} {op:>9} {mode:>6} {b['us']:>8.1f} {d['us']:>8.1f} {ratio:>6.2f}  "
                          f"{dc['us'] if dc else float('nan'):.1f}")  # fmt: skip
    # goal 3: bandwidth at the largest T
    T = tokens[-1] if tokens else None
    if T is not None:
        print(f"\n# goal 3 (bandwidth at {T} tokens/rank, graph, remote bytes only): GB/s per rank")
        for impl, sms in ours + sorted({("deepep", r["num_sms"]) for r in peer}):
            for op in ("dispatch", "combine"):
                r = get(impl, T, op, "graph", sms) or get(impl, T, op, "cached", sms)
                if r is not None:
                    print(f"{impl:>6} {sms:>4} {op:>9} {r['mode']:>6} {r['us']:>8.1f} µs "
                          f"{r['GBps_per_rank']:>7.1f} GB/s")  # fmt: skip
    anchors = ", ".join(f"{t} tok: {ms * 1e3:.0f} µs" for t, ms in NAIVE_ANCHOR_MS.items())
    print(f"(earlier naive NCCL dispatch alone on this machine: {anchors})")


def host_profile(tokens, transports, *, calls: int, log) -> None:
    """Where the host time of a steady-state eager call goes (rank 0 prints): per call host µs with
    and without the direct launches, the pieces alone (event record, barrier, a bare launch), and a
    cProfile of ``calls`` dispatch+combine calls."""
    from ..ep import MoeAlltoAll

    for t in transports:
        if t != "naive":
            a2a = MoeAlltoAll(None, max(tokens), K, E, H, transport=t)
            for T in tokens:
                _host_profile_one(a2a, t, T, calls)


def _host_profile_one(a2a, t: str, T: int, calls: int) -> None:
    import cProfile
    import io
    import pstats

    from ..ep import _launch

    ep, rank = dist.get_world_size(), dist.get_rank()
    dev = _device()

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    ids, x, wts, *_ = _inputs(T, rank, dev)
    comb = torch.randn(ep, T + 1, H, device=dev, dtype=torch.bfloat16)[:, :T]
    pays = [x, ids, wts]

    def one():
        a2a.dispatch(ids, pays, T, expert_id_payload_index=1)
        return a2a.combine(comb, T)

    def timed(n):
        hd = hc = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            a2a.dispatch(ids, pays, T, expert_id_payload_index=1)
            t1 = time.perf_counter()
            a2a.combine(comb, T)
            hc += time.perf_counter() - t1
            hd += t1 - t0
            _sync()
        return hd / n * 1e6, hc / n * 1e6

    def fresh(n=3):
        a2a._dcache.clear()
        a2a._transport.__dict__.get("_ckeys", {}).clear()
        for _ in range(n):
            one()
        _sync()
        dist.barrier()

    fresh(5)
    fast = timed(calls)
    st = next(iter(a2a._dcache.values()))
    compiled = regs = None
    if st.triton:
        compiled = [st.plan_launch.compiled is not None] + [
            v[False].launch.compiled is not None for v in st.packs
        ]
        regs = [st.plan_launch.registers()] + [v[False].launch.registers() for v in st.packs]
    _launch.ENABLED = False
    fresh()
    slow = timed(calls)
    _launch.ENABLED = True
    fresh()
    say(f"[host] {t} T={T}: dispatch/combine host µs per call: direct launches {fast[0]:.1f}/{fast[1]:.1f}, "
        f"Triton's launch path {slow[0]:.1f}/{slow[1]:.1f}; direct launch active {compiled}; "
        f"regs {regs}")  # fmt: skip
    ev = torch.cuda.Event(enable_timing=True) if _cuda() else _HostEvent()
    t0 = time.perf_counter()
    for _ in range(calls):
        ev.record()
    t_ev = (time.perf_counter() - t0) / calls * 1e6
    t_bar = float("nan")
    if t == "symm":
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            a2a._transport._barrier()
        t_bar = (time.perf_counter() - t0) / calls * 1e6
        _sync()
    st = next(iter(a2a._dcache.values()))
    t_plan = float("nan")
    if st.triton:
        t0 = time.perf_counter()
        for _ in range(calls):
            st.plan_launch((1,), (ids, *st.plan_args))
        t_plan = (time.perf_counter() - t0) / calls * 1e6
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    t_empty = (time.perf_counter() - t0) / calls * 1e6
    say(f"[host] {t} T={T}: event record {t_ev:.1f} µs, symm barrier {t_bar:.1f} µs, plan launch "
        f"{t_plan:.1f} µs, torch.empty {t_empty:.1f} µs")  # fmt: skip
    dist.barrier()
    prof = cProfile.Profile()
    if rank == 0:
        prof.enable()
    for _ in range(calls):
        one()
    if rank == 0:
        prof.disable()
    _sync()
    dist.barrier()
    if rank != 0:
        return
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    say(f"[host] {t} T={T}: cProfile of {calls} dispatch+combine calls (rank 0)\n{buf.getvalue()[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replaymoe bench ep", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results", help="output directory for ep.csv / ep.json")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per rank, comma list")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default="nccl,symm,naive", help="comma list of nccl, symm, naive")
    p.add_argument("--payloads", default="bf16,fp8", help="comma list of bf16, fp8")
    p.add_argument("--num-sms", default="0", help="comma list of num_sms for symm (0 = every SM)")
    p.add_argument(
        "--peer",
        choices=("none", "deepep"),
        default="none",
        help="deepep: DeepEP v1.2.1 intranode side by side ($REPLAYMOE_DEEPEP: its built source tree)",
    )
    p.add_argument("--peer-sms", type=int, default=24, help="SMs given to DeepEP (even)")
    p.add_argument("--no-layer", action="store_true", help="skip the whole ep_moe layer")
    p.add_argument("--no-graph", action="store_true", help="eager timings only")
    p.add_argument("--hidden", type=int, default=H, help="hidden size (default DeepSeek-V3's 7168)")
    p.add_argument("--experts", type=int, default=E)
    p.add_argument("--top-k", type=int, default=K)
    p.add_argument("--inter", type=int, default=INTER, help="expert intermediate size (layer)")
    p.add_argument("--cpu-dry-run", action="store_true", help="run on CPU with gloo (checks the script)")
    p.add_argument("--name", default="ep", help="result file stem (NAME.csv / NAME.json)")
    p.add_argument("--summary-from", metavar="DIR", help="only print the summary of DIR/*.json (no GPU)")
    p.add_argument("--host-profile", action="store_true", help="only profile the host time of eager calls")
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

    if a.host_profile:
        try:
            host_profile([int(t) for t in a.tokens.split(",") if t], [t for t in a.impls.split(",") if t],
                         calls=max(50, a.iters * 5), log=log)  # fmt: skip
        finally:
            if own_pg:
                dist.destroy_process_group()
        return 0
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
            payloads=[v for v in a.payloads.split(",") if v],
            num_sms=[int(v) for v in a.num_sms.split(",") if v],
            peer=None if a.peer == "none" else a.peer,
            peer_sms=a.peer_sms,
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

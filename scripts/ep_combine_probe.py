"""Where the ``symm`` combine's time goes, per phase, at 2 or 4 ranks.

Predictions to check: bench/results/ep_combine_scaling_notes.md.

Run under torchrun, one process per GPU, NVLink multicast off, from the repository root::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
    python3 -m torch.distributed.run --nproc-per-node 4 scripts/ep_combine_probe.py --out DIR

DeepSeek-V3 shape (H 7168, 256 experts, top-8, bf16, uniform random routing from
``replaymoe.bench.ep_shape.inputs``), 4096 and 128 tokens per rank, ``num_sms`` 24 and unset (0).
For each point, eager and as CUDA-graph replays, CUDA events give (median over iterations of the
max over ranks, as ``replaymoe bench ep``; per-rank medians go to the JSON):

* ``dispatch``, ``combine``: the public ``MoeAlltoAll.dispatch`` / ``combine`` (the bench's figures);
* ``send``: the combine's send kernel alone (``ep_combine_send_kernel`` + its fused signal), run
  while the peers run theirs (incast included);
* ``wait+red``: the reduce kernel as the combine runs it (its in-kernel wait for every peer's
  signal, then the fp32 sum); ``wait+red - reduce`` ~ the wait for the slowest peer;
* ``reduce``: the same reduce launched once more without the wait (local reads only);
* ``v_*`` (symm, graph): a copy of the send kernel, defined here, with another row order, alone
  and without signal (the rows it writes are the ones the library wrote: identical bytes). ``lib`` =
  the library's order (flattened by source: every program writes to one peer at a time, all ranks
  in the same peer order); ``rot`` = each rank starts at the peer after itself (a permutation per
  step: no incast); ``ilv`` = tiles interleaved over the peers (every program cycles through all
  peers); ``ilv+live`` = ``ilv`` with the loop bounded by the largest count (no iterations over rows
  past the counts); ``_pf`` = the next tile loaded before this tile's stores (two tiles in flight per
  program), ``_ttN`` = N rows per tile, ``_w32`` = 32 warps. Each variant is checked once against the
  library's rows (``ok`` column). ``--send-variants`` / ``--reduce-variants`` choose which run.

Phase timing uses internals (kept to the minimum, marked ``# internal``): the transport's
``combine`` (the send launch) and ``receive.combine_reduce`` (the reduce launch), which are the two
halves of ``MoeAlltoAll.combine``, plus resetting ``_phase`` / ``_st`` after a split round (what
``combine`` itself does at its end), and the symm combine buffer's peer mappings for the variants.

``r_*`` (graph): copies of the combine's reduce without its wait (``probe_reduce_kernel``): ``r_lib`` the
library's, ``r_slots`` the slots of all ranks loaded first, ``r_tt8`` 8 tokens per iteration,
``r_slots_tt8_nb2k`` both on 2048-column chunks; each checked bitwise against the library's reduce of
the same rows (a ``!`` marks a mismatch; on the CPU dry run every bf16 reduce variant shows one,
as Triton's interpreter rounds bf16 otherwise: the check means something on the GPU only).

``--cpu-dry-run``: gloo ranks, the nccl transport with torch ops, a tiny shape, host timers, and the
variant kernel under Triton's interpreter on local stand-ins for the peers' buffers (checked against
the expected rows). ``python3 -m torch.distributed.run --nproc-per-node 2 scripts/ep_combine_probe.py
--cpu-dry-run --out DIR``.
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
if "--cpu-dry-run" in sys.argv:  # CPU only; the variant kernel then runs in Triton's interpreter
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from replaymoe import MoeAlltoAll  # noqa: E402
from replaymoe._launch import cdiv  # noqa: E402
from replaymoe.bench._timing import print_table, write_results  # noqa: E402
from replaymoe.bench.ep_shape import SHAPE, inputs, set_shape  # noqa: E402
from replaymoe.bench.ep_timing import device, err, graph, on_cuda, phase_samples, sync  # noqa: E402
from replaymoe.ep._kernel import _pick  # noqa: E402  (the library's peer-pointer choice)
from replaymoe.ep.packing import row_tiling  # noqa: E402
from replaymoe.ep.receive import combine_reduce  # noqa: E402

# name -> (row order, loop bounded by the largest count, prefetch the next tile, rows per tile, warps (None:
# the library's)); lib / rot were the session-18 comparison (the library now runs ilv's order)
VARIANTS = {
    "lib": (0, False, False, None, None),
    "rot": (1, False, False, None, None),
    "ilv": (2, False, False, None, None),
    "ilv+live": (2, True, False, None, None),
    "ilv_pf": (2, False, True, None, None),
    "ilv_tt8": (2, False, False, 8, None),
    "ilv_tt8_w32": (2, False, False, 8, 32),
    "ilv_pf_tt2": (2, False, True, 2, None),
    "ilv_pf_tt8": (2, False, True, 8, None),
    "ilv_pf_w32": (2, False, True, None, 32),
}
SEND_VARIANTS_DEFAULT = "ilv,ilv_pf,ilv_tt8,ilv_tt8_w32,ilv_pf_tt2,ilv_pf_tt8,ilv_pf_w32"


# ----------------------------------------------------------------------------------------------
# the send with another row order (probe only; the library's kernel is untouched)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _send_item(k, src_ptr, counts_ptr, rows, ntj, stride_src_block, stride_src_row, cm,
               EP: tl.constexpr, RANK: tl.constexpr, TT: tl.constexpr, ORDER: tl.constexpr):  # fmt: skip
    """Work item ``k``: its peer ``s``, its rows ``j`` [TT] and the tile's source offsets / mask."""
    if ORDER == 2:
        q = k % (EP - 1)
        jt = k // (EP - 1)
    else:
        q = k // ntj
        jt = k % ntj
    if ORDER == 1:
        s = (RANK + 1 + q) % EP
    else:
        s = q + (q >= RANK).to(tl.int32)
    j = (jt * TT + tl.arange(0, TT)).to(tl.int64)
    cnt = tl.load(counts_ptr + s)
    m = ((j < rows) & (j < cnt))[:, None] & cm[None, :]
    off = s.to(tl.int64) * stride_src_block + j[:, None] * stride_src_row
    return s, j, m, off


@triton.jit
def _store_peer(v, s, j, m, cols, p0, p1, p2, p3, p4, p5, p6, p7, dst_offset, stride_dst_row,
                EP: tl.constexpr, RANK: tl.constexpr):  # fmt: skip
    """Store tile ``v`` (rows ``j`` of source ``s``) into peer ``s``'s buffer (one live masked store)."""
    dst = dst_offset + j * stride_dst_row
    for r in tl.static_range(EP):
        if r != RANK:
            base = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
            tl.store(base + dst[:, None] + cols[None, :], v, mask=m & (s == r))


@triton.jit
def probe_send_kernel(src_ptr, counts_ptr, p0, p1, p2, p3, p4, p5, p6, p7, rows, n_cols, stride_src_block,
                      stride_src_row, dst_offset, stride_dst_row, EP: tl.constexpr, EP_P2: tl.constexpr,
                      RANK: tl.constexpr, NB: tl.constexpr, TT: tl.constexpr, ORDER: tl.constexpr,
                      LIVE: tl.constexpr, PF: tl.constexpr):  # fmt: skip
    """Row ``[s, j]`` (``j < counts[s]``, ``s != RANK``) of ``src`` to ``p_s`` at
    ``dst_offset + j * stride_dst_row``.
    Work item ``k`` = (peer index ``q`` in ``[0, EP-1)``, row tile ``jt``); ORDER 0: ``q``-major, peers in
    rank order (the library's order when ``rows % TT == 0``); 1: ``q``-major, peer ``(RANK + 1 + q) % EP``;
    2: ``jt``-major (consecutive items go to different peers). LIVE: ``jt`` only up to the largest count.
    PF: the next item's tile is loaded before this one's stores (two tiles in registers), so its load
    latency overlaps the stores' drain."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1) * NB + tl.arange(0, NB)
    cm = cols < n_cols
    if LIVE:
        rk = tl.arange(0, EP_P2)
        c = tl.load(counts_ptr + rk, mask=(rk < EP) & (rk != RANK), other=0)
        ntj = (tl.max(c, axis=0) + TT - 1) // TT
    else:
        ntj = (rows + TT - 1) // TT
    total = (EP - 1) * ntj
    if PF:
        s, j, m, off = _send_item(pid, src_ptr, counts_ptr, rows, ntj, stride_src_block, stride_src_row, cm,
                                  EP, RANK, TT, ORDER)  # fmt: skip
        m = m & (pid < total)
        v = tl.load(src_ptr + off + cols[None, :], mask=m)
        for k in range(pid, total, nprog):
            kn = k + nprog
            sn, jn, mn, offn = _send_item(kn, src_ptr, counts_ptr, rows, ntj, stride_src_block,
                                          stride_src_row, cm, EP, RANK, TT, ORDER)  # fmt: skip
            mn = mn & (kn < total)
            vn = tl.load(src_ptr + offn + cols[None, :], mask=mn)
            _store_peer(v, s, j, m, cols, p0, p1, p2, p3, p4, p5, p6, p7, dst_offset, stride_dst_row,
                        EP, RANK)  # fmt: skip
            v, s, j, m = vn, sn, jn, mn
    else:
        for k in range(pid, total, nprog):
            s, j, m, off = _send_item(k, src_ptr, counts_ptr, rows, ntj, stride_src_block, stride_src_row, cm,
                                      EP, RANK, TT, ORDER)  # fmt: skip
            v = tl.load(src_ptr + off + cols[None, :], mask=m)
            _store_peer(v, s, j, m, cols, p0, p1, p2, p3, p4, p5, p6, p7, dst_offset, stride_dst_row,
                        EP, RANK)  # fmt: skip


def variant_launch(a2a, comb, T, dsts, order, live, pf=False, tt_v=None, warps_v=None):
    """A launcher of :func:`probe_send_kernel` with the library's tiling and grid for this ``num_sms``
    (``tt_v``: another number of rows per tile, the warps scaled as the library scales them, or
    ``warps_v``)."""
    ep, rank, H = a2a.ep, a2a.rank, comb.shape[2]
    persistent = a2a.num_sms is not None
    nb, chunks, tt, warps = row_tiling(H, persistent)
    if tt_v is not None:
        tt = tt_v
        warps = 16 if tt * nb >= 8192 else 8 if tt * nb >= 2048 else 4
    warps = warps_v or warps
    work = cdiv((ep - 1) * T, tt)
    nprog = (
        a2a._programs(work * chunks, chunks) if persistent else a2a._dense_programs(work, chunks)
    )  # internal
    d = list(dsts) + [dsts[0]] * (8 - len(dsts))
    ep_p2 = max(2, triton.next_power_of_2(ep))

    def launch():
        probe_send_kernel[(nprog, chunks)](
            comb, a2a.recv_counts, *d, T, H, comb.stride(0), comb.stride(1), rank * T * H, H,
            EP=ep, EP_P2=ep_p2, RANK=rank, NB=nb, TT=tt, ORDER=order, LIVE=live, PF=pf, num_warps=warps,
        )  # fmt: skip

    return launch, (nprog, chunks, tt, nb, warps)


REDUCE_VARIANTS = {  # name -> (slots first, rows per iteration (None: the library's), columns per chunk)
    "r_lib": (False, None, None),
    "r_slots": (True, None, None),
    "r_tt8": (False, 8, None),
    "r_slots_tt8": (True, 8, None),
    "r_slots_tt8_nb2k": (True, 8, 2048),
}


@triton.jit
def probe_reduce_kernel(recv_ptr, slot_ptr, out_ptr, own_ptr, T, H, stride_recv_block, stride_recv_row,
                        stride_own_row, EP: tl.constexpr, EP_P2: tl.constexpr, OWN: tl.constexpr,
                        NB: tl.constexpr, TT: tl.constexpr, SLOTS_FIRST: tl.constexpr):  # fmt: skip
    """The library's ``ep_combine_reduce_kernel`` without its wait, with two knobs: SLOTS_FIRST loads
    the tokens' slots on every rank as one [TT, EP] tile before any row load (so the EP row loads do not
    each wait for their own slot load), and TT / NB set the tile. The same fp32 sum in rank order, so
    the same bits as the library's."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1) * NB + tl.arange(0, NB)
    cm = cols < H
    rk = tl.arange(0, EP_P2)
    for t0 in range(pid * TT, T, nprog * TT):
        toks = (t0 + tl.arange(0, TT)).to(tl.int64)
        tmask = toks < T
        slots = tl.load(slot_ptr + toks[:, None] * EP + rk[None, :], mask=tmask[:, None] & (rk[None, :] < EP),
                        other=-1)  # fmt: skip
        acc = tl.zeros([TT, NB], dtype=tl.float32)
        for r in tl.static_range(EP):
            if SLOTS_FIRST:
                slot = tl.sum(tl.where(rk[None, :] == r, slots, 0), axis=1).to(tl.int64)
            else:
                slot = tl.load(slot_ptr + toks * EP + r, mask=tmask, other=-1).to(tl.int64)
            m = (slot >= 0)[:, None] & cm[None, :]
            if r == OWN:
                v = tl.load(own_ptr + (slot * stride_own_row)[:, None] + cols[None, :], mask=m, other=0.0)
            else:
                row = stride_recv_block.to(tl.int64) * r + slot * stride_recv_row
                v = tl.load(recv_ptr + row[:, None] + cols[None, :], mask=m, other=0.0)
            acc += v.to(tl.float32)
        om = tmask[:, None] & cm[None, :]
        tl.store(out_ptr + toks[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=om)


def reduce_variant_launch(a2a, rows, bs, slot, own, out, slots_first, tt_v, nb_v):
    """A launcher of :func:`probe_reduce_kernel` on the grid the library would use for this tile."""
    T, H = out.shape
    persistent = a2a.num_sms is not None
    nb, chunks, tt, warps = row_tiling(H, persistent)
    if nb_v is not None:
        nb, chunks = nb_v, cdiv(H, nb_v)
    tt = tt_v or tt
    warps = 16 if tt * nb >= 8192 else 8 if tt * nb >= 2048 else 4
    work = max(1, cdiv(T, tt))
    nprog = (
        a2a._programs(work * chunks, chunks) if persistent else a2a._dense_programs(work, chunks)
    )  # internal
    own_t, own_rs, own_r = (rows, 0, -1) if own is None else (own, own.stride(0), a2a.rank)
    ep_p2 = max(2, triton.next_power_of_2(a2a.ep))

    def launch():
        probe_reduce_kernel[(nprog, chunks)](
            rows, slot, out, own_t, T, H, bs, rows.stride(0), own_rs, EP=a2a.ep, EP_P2=ep_p2, OWN=own_r,
            NB=nb, TT=tt, SLOTS_FIRST=slots_first, num_warps=warps,
        )  # fmt: skip

    return launch, (nprog, chunks, tt, nb, warps)


# ----------------------------------------------------------------------------------------------
# timing: per phase the median over iterations of the max over ranks, and each rank's median
# ----------------------------------------------------------------------------------------------
def time_iters(run_iter, n: int, iters: int, warmup: int) -> list[dict]:
    """``run_iter(events)`` records ``n + 1`` events (and may return n host seconds); the samples of
    ``bench.ep_timing.phase_samples`` (whose figure ``us`` is), with each rank's median as well."""
    td, has_host = phase_samples(run_iter, n, iters, warmup)
    allt = [torch.zeros_like(td) for _ in range(dist.get_world_size())]
    dist.all_gather(allt, td)
    a = torch.stack(allt).cpu()  # [ranks, iters, 2n]
    res = []
    for p in range(n):
        res.append({
            "us": statistics.median(a[:, :, p].max(0).values.tolist()),
            "per_rank_us": [round(statistics.median(a[r, :, p].tolist()), 2) for r in range(a.shape[0])],
            "host_us": statistics.median(a[:, :, n + p].max(0).values.tolist()) if has_host else None,
        })  # fmt: skip
    return res


def replays(graphs):
    def run_iter(ev):
        ev[0].record()
        for i, g in enumerate(graphs):
            g.replay()
            ev[i + 1].record()

    return run_iter


def time_launch(launch, a) -> dict:
    """One launch timed as :func:`time_iters` does: CUDA-graph replays on the GPU, else eager."""
    if on_cuda() and not a.no_graph:
        gv, _ = graph(launch)
        res = time_iters(replays([gv]), 1, a.iters, a.warmup)[0]
        del gv
        return res

    def one(ev):
        ev[0].record()
        launch()
        ev[1].record()

    return time_iters(one, 1, a.iters, a.warmup)[0]


# ----------------------------------------------------------------------------------------------
def probe_point(a2a, T, n_sms, a, log) -> list[dict]:
    ep, rank, H = a2a.ep, a2a.rank, SHAPE.H
    dev = device()
    a2a.num_sms = n_sms or None
    ids, x, wts, *_ = inputs(T, rank, dev)
    pays = [x, ids, wts]
    comb_buf = torch.randn(ep * (T + 1), H, device=dev, dtype=torch.bfloat16)
    comb = comb_buf.view(ep, T + 1, H)[:, :T]  # the layout ep_moe hands to combine (as bench ep)
    out_r = torch.empty(T, H, device=dev, dtype=comb.dtype)

    def d():
        return a2a.dispatch(ids, pays, T, expert_id_payload_index=len(pays) - 2)

    def c():
        return a2a.combine(comb, T)

    def whole(ev):
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

    def split(ev):  # MoeAlltoAll.combine cut in its two launches (internal), then the reduce once more
        ev[0].record()
        d()
        ev[1].record()
        st = a2a._st  # internal: the dispatch state (slot plan, reduce launch plans)
        rows, bs, own, wait = a2a._transport.combine(comb, T)  # internal: send (+ fused signal)
        ev[2].record()
        out = torch.empty(T, H, device=dev, dtype=comb.dtype)
        combine_reduce(a2a, rows, bs, st.slot, out, st.reduce, own, wait)  # wait + reduce
        ev[3].record()
        combine_reduce(a2a, rows, bs, st.slot, out_r, st.reduce, own, None)  # reduce alone
        ev[4].record()
        a2a._phase, a2a._st = "idle", None  # internal: what combine does at its end
        return None

    # bytes this rank sends in the combine (remote rows it received in the dispatch)
    d()
    c()
    sync()
    cnt = a2a.recv_counts.tolist()
    send_mb = sum(n for s, n in enumerate(cnt) if s != rank) * H * comb.element_size() / 1e6
    mb = torch.tensor([send_mb], dtype=torch.float64, device=dev)
    dist.all_reduce(mb, op=dist.ReduceOp.MAX)
    base = {
        "tokens": T,
        "num_sms": n_sms,
        "ep": ep,
        "transport": a2a.transport,
        "send_MB_max": round(mb.item(), 4),
    }
    rows_out = []

    def add(mode, names, res, **extra):
        r = {**base, "mode": mode, **extra}
        for name, v in zip(names, res):
            r[name] = round(v["us"], 2)
            r[name + "_per_rank"] = v["per_rank_us"]
            if v["host_us"] is not None:
                r[name + "_host"] = round(v["host_us"], 1)
        rows_out.append(r)

    add("eager", ["dispatch", "combine"], time_iters(whole, 2, a.iters, a.warmup))
    add("eager_split", ["dispatch", "send", "wait+red", "reduce"], time_iters(split, 4, a.iters, a.warmup))

    gs_all = []
    if on_cuda() and not a.no_graph:
        try:
            sync()
            gd, _ = graph(d)
            st = a2a._st  # internal
            gc, _ = graph(c, pool=gd.pool())
            held = {}

            def send_only():
                held["r"] = a2a._transport.combine(comb, T)  # internal

            gs, _ = graph(send_only, pool=gd.pool())
            rows, bs, own, wait = held["r"]
            out_w = torch.empty(T, H, device=dev, dtype=comb.dtype)
            gw, _ = graph(
                lambda: combine_reduce(a2a, rows, bs, st.slot, out_w, st.reduce, own, wait), pool=gd.pool()
            )
            gr, _ = graph(
                lambda: combine_reduce(a2a, rows, bs, st.slot, out_r, st.reduce, own, None), pool=gd.pool()
            )
            gs_all = [gd, gc, gs, gw, gr]
            add("graph", ["dispatch", "combine"], time_iters(replays([gd, gc]), 2, a.iters, a.warmup))
            add("graph_split", ["dispatch", "send", "wait+red", "reduce"],
                time_iters(replays([gd, gs, gw, gr]), 4, a.iters, a.warmup))  # fmt: skip
        except Exception as e:
            log(f"[rank {rank}] graph T={T} sms={n_sms}: {err(e)}\n{traceback.format_exc()}")
            rows_out.append({**base, "mode": "graph", "error": err(e)})
        finally:
            a2a._phase, a2a._st = "idle", None  # internal (captures leave them as a failed call would)

    if a.no_variants or (on_cuda() and a2a.transport != "symm"):
        return rows_out
    # ---- variants of the send's row order (after one library round, so the counts are this round's)
    d()
    c()
    sync()
    cnt = a2a.recv_counts.tolist()
    H_es = comb.element_size()
    if on_cuda():
        tr = a2a._transport  # internal: the symm combine buffer and its peers' mappings
        dsts = [p.view(comb.dtype) for p in tr.comb.peers]
        local = tr.comb.local[: ep * T * H * H_es].view(comb.dtype).view(ep, T, H)
    else:  # CPU: local stand-ins for the peers' buffers, checked right here
        dsts = [torch.zeros(ep * T * H, dtype=comb.dtype) for _ in range(ep)]
        local = None
    vres = {}
    for name in a.send_variants:
        launch, geo = variant_launch(a2a, comb, T, dsts, *VARIANTS[name])
        ok = True
        try:
            if local is not None:  # every rank: zero its buffer, all send, compare with the library's rows
                saved = local.clone()
                local.zero_()
                sync()
                dist.barrier()
                launch()
                sync()
                dist.barrier()
                sc = a2a.send_counts.tolist()
                ok = all(torch.equal(local[q, : sc[q]], saved[q, : sc[q]]) for q in range(ep) if q != rank)
                local.copy_(saved)
            else:
                for dd in dsts:
                    dd.zero_()
                launch()
                for s in range(ep):
                    if s != rank:
                        got = dsts[s].view(ep * T, H)[rank * T : rank * T + cnt[s]]
                        ok = ok and torch.equal(got, comb[s, : cnt[s]])
            okt = torch.tensor([0 if ok else 1], device=dev)
            dist.all_reduce(okt)
            ok = okt.item() == 0
            res = time_launch(launch, a)
            vres[name] = (res, ok, geo)
        except Exception as e:
            log(f"[rank {rank}] variant {name} T={T} sms={n_sms}: {err(e)}\n{traceback.format_exc()}")
            vres[name] = None
    r = {**base, "mode": "variants_graph" if on_cuda() and not a.no_graph else "variants_eager"}
    for name, v in vres.items():
        if v is None:
            r["v_" + name] = "error"
            continue
        res, ok, geo = v
        r["v_" + name] = round(res["us"], 2)
        r["v_" + name + "_per_rank"] = res["per_rank_us"]
        r["v_" + name + "_ok"] = ok
        r["v_" + name + "_grid_tt_nb_warps"] = list(geo)
    rows_out.append(r)
    rows_out.append(reduce_variants(a2a, T, comb, pays, ids, a, log, base))
    del gs_all
    return rows_out


def reduce_variants(a2a, T, comb, pays, ids, a, log, base) -> dict:
    """Variants of the combine's reduce (no wait) on one library round's rows, each checked bitwise
    against the library's reduce of the same rows, then timed (graph replays on the GPU)."""
    H, dev = SHAPE.H, device()
    a2a.dispatch(ids, pays, T, expert_id_payload_index=len(pays) - 2)
    st = a2a._st  # internal: the dispatch state
    rows, bs, own, wait = a2a._transport.combine(comb, T)  # internal: the send (+ fused signal)
    out_w = torch.empty(T, H, device=dev, dtype=comb.dtype)
    combine_reduce(a2a, rows, bs, st.slot, out_w, st.reduce, own, wait)  # the round's own wait + reduce
    ref = torch.empty_like(out_w)
    combine_reduce(a2a, rows, bs, st.slot, ref, st.reduce, own, None)
    sync()
    r = {**base, "mode": "reduce_variants_graph" if on_cuda() and not a.no_graph else "reduce_variants_eager"}
    try:
        for name in a.reduce_variants:
            sf, tt, nb = REDUCE_VARIANTS[name]
            out = torch.full_like(ref, float("nan"))
            launch, geo = reduce_variant_launch(a2a, rows, bs, st.slot, own, out, sf, tt, nb)
            try:
                launch()
                sync()
                okt = torch.tensor([0 if torch.equal(out, ref) else 1], device=dev)
                dist.all_reduce(okt)
                res = time_launch(launch, a)
                r[name] = round(res["us"], 2)
                r[name + "_per_rank"] = res["per_rank_us"]
                r[name + "_ok"] = okt.item() == 0
                r[name + "_grid_tt_nb_warps"] = list(geo)
            except Exception as e:
                log(f"[rank {a2a.rank}] reduce variant {name} T={T}: {err(e)}\n{traceback.format_exc()}")
                r[name] = "error"
    finally:
        a2a._phase, a2a._st = "idle", None  # internal: what combine does at its end
    return r


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="ep_combine_probe_out")
    p.add_argument("--tokens", help="tokens per rank (default 4096,128; 16,4 with --cpu-dry-run)")
    p.add_argument("--num-sms", default="24,0", help="num_sms values (0 = unset: dense grids)")
    p.add_argument("--iters", type=int, help="default 20 (2 with --cpu-dry-run)")
    p.add_argument("--warmup", type=int, help="default 3 (1 with --cpu-dry-run)")
    p.add_argument("--transport", help="symm (default on GPU) or nccl (default with --cpu-dry-run)")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--send-variants", default=SEND_VARIANTS_DEFAULT, help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--reduce-variants", default=",".join(REDUCE_VARIANTS), help="of the r_* names")
    p.add_argument(
        "--cpu-dry-run", action="store_true", help="gloo, tiny shape, host timers (under torchrun)"
    )
    a = p.parse_args(argv)
    dry = a.cpu_dry_run
    a.tokens = [int(t) for t in (a.tokens or ("16,4" if dry else "4096,128")).split(",") if t]
    a.num_sms = [int(v) for v in a.num_sms.split(",") if v]
    a.iters = a.iters or (2 if dry else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if dry else 3)
    a.transport = a.transport or ("nccl" if dry else "symm")
    a.send_variants = [v for v in a.send_variants.split(",") if v]
    a.reduce_variants = [v for v in a.reduce_variants.split(",") if v]
    for v in a.send_variants:
        if v not in VARIANTS:
            p.error(f"--send-variants: {v!r} is not one of {', '.join(VARIANTS)}")
    for v in a.reduce_variants:
        if v not in REDUCE_VARIANTS:
            p.error(f"--reduce-variants: {v!r} is not one of {', '.join(REDUCE_VARIANTS)}")
    return a


def main(argv=None) -> int:
    a = _parse(argv)
    if a.cpu_dry_run:
        set_shape(128, 8, 2, 64)
    elif not torch.cuda.is_available():
        print("ep_combine_probe: needs CUDA GPUs (or --cpu-dry-run)", file=sys.stderr)
        return 2
    if on_cuda() and not a.cpu_dry_run:
        lr = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(lr)
        dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
    else:
        dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    try:
        a2a = MoeAlltoAll(None, max(a.tokens), SHAPE.K, SHAPE.E, SHAPE.H, transport=a.transport,
                          payload_bytes_per_token=2 * SHAPE.H + 256,
                          timeout=120 if a.transport == "symm" else None)  # fmt: skip
        for T in a.tokens:
            for n in a.num_sms:
                try:
                    rows += probe_point(a2a, T, n, a, log)
                except Exception as e:
                    log(f"[rank {rank}] T={T} sms={n}: {err(e)}\n{traceback.format_exc()}")
                    rows.append({"tokens": T, "num_sms": n, "error": err(e)})
                if rank == 0:
                    write_results(rows, a.out, "ep_combine_probe")
                    log(f"done T={T} num_sms={n}")
        if rank == 0:
            write_results(rows, a.out, "ep_combine_probe")
            _print(rows, ep)
    finally:
        import gc

        a2a = None
        gc.collect()
        dist.destroy_process_group()
    return 0


def _print(rows, ep):
    print(f"\nep_combine_probe, ep={ep}: µs, median over iterations of the max over ranks "
          "(per-rank figures in ep_combine_probe.json)")  # fmt: skip
    cols = ["tokens", "num_sms", "mode", "dispatch", "combine", "combine_host", "send", "wait+red", "reduce",
            *("v_" + v for v in VARIANTS), *REDUCE_VARIANTS, "send_MB_max"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]
    table = []
    for r in rows:
        r = dict(r)
        for name in (*("v_" + v for v in VARIANTS), *REDUCE_VARIANTS):
            if name in r and r.get(name + "_ok") is False:
                r[name] = f"{r[name]}!"  # a variant whose rows did not match the library's
        table.append(r)
    print_table(table, cols)
    for r in rows:
        if "send_per_rank" in r and r["mode"] == "graph_split":
            print(f"  T={r['tokens']} sms={r['num_sms']} graph send per rank: {r['send_per_rank']}, "
                  f"wait+red per rank: {r['wait+red_per_rank']}")  # fmt: skip
    if any("error" in r for r in rows):
        print(
            "errors:",
            [(r.get("tokens"), r.get("num_sms"), r.get("mode"), r["error"]) for r in rows if "error" in r],
        )


if __name__ == "__main__":
    raise SystemExit(main())

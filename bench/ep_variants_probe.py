"""Device script (torchrun, 2+ GPUs): variants of the symm transport's pack and pipelined combine against the
library's defaults, in one process: dispatch and combine µs in CUDA graphs (median over iterations of the max
over ranks), DeepSeek-V3 rows (bf16 hidden, int32 ids, fp32 weights), ``--num-sms`` programs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python3 -m torch.distributed.run --nproc-per-node 4 bench/ep_variants_probe.py --tokens 2048,4096

A trailing ``!`` marks a variant whose received rows, sanitized ids or combined tokens differ from the
default's. The variants reach into ``ep.alltoall`` / ``ep.transport_symm`` module attributes (the pack's
tiling, grids and store order, the receive side's sanitize, the combine's tiles), so they follow the code
they probe.
"""

import argparse

import torch
import torch.distributed as dist

import replaymoe.ep.alltoall as A
import replaymoe.ep.transport_symm as S
from replaymoe.bench.ep_shape import SHAPE, inputs
from replaymoe.bench.ep_timing import device, graph, sync, time_replays
from replaymoe.ep import MoeAlltoAll


def pack_tiles(nb=None, tt=None, warps=None):
    """``_pack_tiles`` with the persistent grids' column chunk, tokens per iteration or warps replaced."""
    orig = A._pack_tiles

    def f(Ns, grid, T):
        NBs, chunks, TT, w = orig(Ns, grid, T)
        if grid == "dense":
            return NBs, chunks, TT, w
        if nb is not None:
            NBs = [min(A.next_power_of_2(n), nb) for n in Ns]
            chunks = max(A.cdiv(n, b) for n, b in zip(Ns, NBs))
        return NBs, chunks, tt or TT, warps or w

    return f


def send_tiles(nb: int, warps: int):
    """``send_tiling`` with the dense grid's one-row programs of ``nb`` columns on ``warps`` warps."""
    orig = S.send_tiling

    def f(W, persistent):
        if persistent:
            return orig(W, persistent)
        b = min(nb, A.next_power_of_2(W))
        return b, A.cdiv(W, b), 1, warps

    return f


def variants(a2a: MoeAlltoAll):
    """(name, {(object, attribute): value}) of every variant; the first and last are the defaults. The
    objects are modules, or ``a2a``'s transport (its pipelined combine's rows per arrival flag, ``chunk``:
    None = ``pipe_chunk``'s rule, else a multiple of the tall tiles' 16 rows from ``PIPE_CHUNK`` up, for
    which the signal pads are sized)."""
    tr = a2a._transport
    return [
        ("default", {}),
        ("send 1024x1 w4 (before)", {(S, "send_tiling"): send_tiles(1024, 4)}),
        ("send 4096x1 w8", {(S, "send_tiling"): send_tiles(4096, 8)}),
        ("send row w16", {(S, "send_tiling"): send_tiles(8192, 16)}),
        ("send row w4", {(S, "send_tiling"): send_tiles(8192, 4)}),
        ("comb chunk 16", {(tr, "chunk"): 16}),
        ("comb chunk 32", {(tr, "chunk"): 32}),
        ("comb chunk 64", {(tr, "chunk"): 64}),
        ("sanitize launch > 2048", {(A, "_FUSED_SANITIZE_MAX_ROWS"): 2048, (A, "_FUSED_SANITIZERS"): 1}),
        ("sanitize fused, 32", {(A, "_FUSED_SANITIZERS"): 32}),
        ("pack rank order", {(A, "_PACK_PEERS_FIRST"): False}),
        ("pack TT=2", {(A, "_pack_tiles"): pack_tiles(tt=2)}),
        ("comb 2048x8 w16", {(S, "pipe_tiling"): lambda W, programs, rt: (2048, 8, 16)}),
        ("default (again)", {}),
    ]


def chosen(a2a: MoeAlltoAll, only: str) -> list:
    """:func:`variants` whose name contains ``only`` (every one if empty), the two defaults always."""
    return [(n, p) for n, p in variants(a2a) if not only or only in n or n.startswith("default")]


def time_variant(a2a: MoeAlltoAll, T: int, ids, x, wts, comb) -> tuple[float, float, tuple]:
    """(dispatch µs, combine µs, what was received and combined) of the current code at ``T`` tokens."""
    a2a._dcache.clear()  # the dispatch plans (the pack's tiling) and the combine plans are rebuilt
    for attr in ("_pshape", "_pkeys", "_ckeys"):
        cache = a2a._transport.__dict__.get(attr)
        if isinstance(cache, dict):
            cache.clear()

    def d():
        return a2a.dispatch(ids, [x, ids, wts], T, expert_id_payload_index=1)

    def c():
        return a2a.combine(comb, T)

    for _ in range(3):
        views = d()
        out = c()
    sync()
    rc = a2a.recv_counts.tolist()
    got = (
        tuple(views[0][s, : rc[s]].float().sum().item() for s in range(a2a.ep)),
        views[1].long().sum().item(),  # the sanitized ids, padding rows included
        out.float().sum().item(),
    )
    gd, _ = graph(d)
    gc, _ = graph(c, pool=gd.pool())
    t_d, t_c = time_replays([gd, gc], 20, 3)
    return t_d, t_c, got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--num-sms", type=int, default=24, help="programs per kernel; 0: unbounded (dense)")
    ap.add_argument(
        "--only", default="", help="run only the variants whose name contains this (and the defaults)"
    )
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = device()
    Ts = [int(t) for t in a.tokens.split(",")]
    H, E, K = SHAPE.H, SHAPE.E, SHAPE.K
    a2a = MoeAlltoAll(None, max(Ts), K, E, H, payload_bytes_per_token=2 * H + 256, timeout=120,
                      transport="symm", num_sms=a.num_sms or None)  # fmt: skip
    res = {}
    for T in Ts:
        ids, x, wts, *_ = inputs(T, rank, dev)
        comb = torch.randn(ep * (T + 1), H, device=dev, dtype=torch.bfloat16).view(ep, T + 1, H)[:, :T]
        ref = None
        for name, patch in chosen(a2a, a.only):
            saved = {key: getattr(*key) for key in patch}
            for (mod, attr), value in patch.items():
                setattr(mod, attr, value)
            t_d, t_c, got = time_variant(a2a, T, ids, x, wts, comb)
            for (mod, attr), value in saved.items():
                setattr(mod, attr, value)
            ref = ref or got
            res[(T, name)] = f"{t_d:12.1f} {t_c:12.1f}" + ("" if got == ref else "!")
            sync()
            dist.barrier()
    if rank == 0:
        print(f"# ep = {ep}, {a.num_sms} programs; dispatch / combine µs in CUDA graphs")
        print(f"{'variant':22s} " + " ".join(f"{T:>7d} disp {T:>7d} comb" for T in Ts))
        for name, _ in chosen(a2a, a.only):
            print(f"{name:22s} " + " ".join(res[(T, name)] for T in Ts))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

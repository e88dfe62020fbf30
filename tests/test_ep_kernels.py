"""EP pieces that need no process group: the expert split, the routing plan, the references, and
the ``symm`` transport's Triton kernels run under the interpreter with plain local tensors standing
in for the peers' symmetric-memory buffers (a real kernel run: every simulated rank stores into the
other ranks' buffers at the offsets the GPU run uses; only the signal-pad barrier is replaced, by
running the ranks' phases one after the other)."""

from __future__ import annotations

import re
import types

import pytest
import torch

from _scripts import run_script
from replaymoe.ep import combine_torch, dispatch_torch, expert_owner, expert_partition
from replaymoe.ep._core import AlltoAllCore
from replaymoe.ep._dispatch import receive, send
from replaymoe.ep._dispatch_plan import build_dispatch, validate_dispatch
from replaymoe.ep.packing import recv_views, row_layout, row_tiling
from replaymoe.ep.partition import make_plan
from replaymoe.ep.receive import combine_reduce
from replaymoe.testing import poison


@pytest.mark.parametrize(
    "E, ep, expect",
    [
        (8, 1, [(0, 8)]),  # one rank owns all
        (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),  # divisible
        (10, 3, [(0, 4), (4, 3), (7, 3)]),  # first E % ep ranks own one more
        (6, 4, [(0, 2), (2, 2), (4, 1), (5, 1)]),
        (5, 5, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]),  # E == ep
    ],
)
def test_expert_partition_and_owner(E, ep, expect):
    assert expert_partition(E, ep) == expect
    ids = torch.tensor([-1, *range(E), E, 1000], dtype=torch.int32)
    owner = expert_owner(ids, E, ep)
    want = [ep] + [r for r, (lo, n) in enumerate(expect) for _ in range(n)] + [ep, ep]
    assert owner.tolist() == want


def test_expert_partition_rejects():
    with pytest.raises(ValueError, match="num_experts"):
        expert_partition(3, 4)  # fewer experts than ranks
    with pytest.raises(ValueError, match="ep"):
        expert_partition(8, 0)


def test_plan_invariants(generator):
    """One slot per distinct (token, rank); slots are 0..count-1 in token order; -1 ids ignored."""
    E, ep, T, K = 10, 3, 40, 4
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).to(torch.int32)
    ids[5] = -1  # a token sent nowhere
    ids[6, 1:] = -1
    plan = make_plan(ids, E, ep)
    owner = expert_owner(ids, E, ep)
    for r in range(ep):
        sent = [t for t in range(T) if (owner[t] == r).any()]
        assert plan.slot[sent, r].tolist() == list(range(len(sent)))
        others = [t for t in range(T) if t not in sent]
        assert (plan.slot[others, r] == -1).all()
        assert int(plan.send_counts[r]) == len(sent)
    assert (plan.slot[5] == -1).all()
    empty = make_plan(torch.zeros(0, K, dtype=torch.int32), E, ep)
    assert empty.slot.shape == (0, ep) and empty.send_counts.tolist() == [0] * ep


# ----------------------------------------------------------------------------------------------
# symm transport, simulated in one process under the Triton interpreter
# ----------------------------------------------------------------------------------------------


def _fake_core(rank, ep, max_tokens, K, E, H, num_sms=None, fused_plan=True, fused_barrier=None,
               fused_sanitize=False, device_sms=4, transport="symm", kernel_backend="auto"):  # fmt: skip
    """The shared state of a ``MoeAlltoAll`` of rank ``rank`` without a process group (no transport yet:
    the tests attach theirs; ``pipelined_combine=True``). ``fused_sanitize`` (on in real objects): the
    pack's last program waits for the peers' signals, so only a rank whose peers have all signalled may
    run with it in a test that runs the ranks in turn. Ranks simulated in one process drive dispatch
    phase by phase through the core's collaborators, which no public API does."""
    return AlltoAllCore(
        group=None, ep=ep, rank=rank, device=torch.device("cpu"), max_num_tokens=max_tokens, top_k=K,
        num_experts=E, hidden_size=H, transport_name=transport, kernel_backend=kernel_backend,
        device_sms=device_sms, num_sms=num_sms, fused_plan=fused_plan, fused_barrier=fused_barrier,
        pipelined_combine=True, fused_sanitize=fused_sanitize,
    )  # fmt: skip


def _fake_buffers(ep, nbytes):
    bufs = [poison(torch.empty(nbytes, dtype=torch.uint8)) for _ in range(ep)]
    handle = types.SimpleNamespace(barrier=lambda channel=0, timeout_ms=0: None)
    return [types.SimpleNamespace(local=bufs[r], peers=bufs, handle=handle, nbytes=nbytes) for r in range(ep)]


@pytest.mark.interpret
@pytest.mark.parametrize(
    "ep, E, K, Ts, num_sms, fused, mixed, plan",
    [
        (2, 8, 2, [3, 4], None, True, True, True),  # two ranks, dense grids, in-kernel barrier
        (3, 10, 4, [5, 0, 2], 1, True, True, True),  # uneven split, a rank without tokens; 1 program
        (4, 8, 8, [1, 3, 2, 4], 2, True, True, True),  # top-8 of 8: every token goes to every rank
        (2, 8, 2, [0, 4], None, False, True, True),  # torch's barrier kernel (fused_barrier=False)
        (3, 10, 4, [5, 0, 2], None, True, False, True),  # int32 units: the pack computes the plan
        (2, 8, 2, [0, 4], 1, True, False, True),  # the same, no tokens on rank 0 (counts zeroed by the pack)
        (3, 10, 4, [5, 0, 2], None, False, False, True),  # plan in the pack, torch's barrier kernel
        (3, 10, 4, [5, 0, 2], None, True, False, False),  # int32 units, fused_plan=False: the plan kernel
        # num_sms unset: rank 0 (> 256 tokens) on the wide grid, the pack's look-back over 3 blocks; ranks
        # 1 and 2 on the dense grid, the scan
        (3, 10, 4, [300, 0, 140], None, True, False, True),
        (2, 8, 2, [257, 129], 2, True, False, True),  # narrow grid: the look-back at any T (3 / 2 blocks)
    ],
)
def test_symm_transport_kernels(ep, E, K, Ts, num_sms, fused, mixed, plan, generator, monkeypatch):
    import dataclasses

    from replaymoe import _switches
    from replaymoe.ep.transport_symm import SymmTransport

    # the process default (REPLAYMOE_EP_FUSED); the argument wins
    monkeypatch.setattr(_switches, "DEFAULTS", dataclasses.replace(_switches.DEFAULTS, ep_fused=not fused))
    import replaymoe.ep._dispatch_plan as dispatch_plan

    # the three-rank cases store each tile to the peers first and to the own block last
    monkeypatch.setattr(dispatch_plan, "PACK_PEERS_FIRST", ep == 3)

    H, rt = 16, max(5, *Ts)
    max_tokens = rt + 1
    ids = [
        torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).to(torch.int32)
        if T
        else torch.zeros(0, K, dtype=torch.int32)
        for T in Ts
    ]
    pays = [
        [
            torch.randn(T, H, generator=generator),  # fp32 rows (int32 units)
            torch.randn(T, 3, generator=generator).to(torch.float16),  # 6 bytes: int16 units
            (torch.randn(T, 3, generator=generator) * 9).to(torch.float8_e4m3fn),  # 3 bytes: uint8 units
            ids[s].clone(),
        ]
        for s, T in enumerate(Ts)
    ]
    if not mixed:  # hidden fp32, ids, bf16 pairs: int32 units throughout
        bf = [torch.randn(p[0].shape[0], 4, generator=generator).to(torch.bfloat16) for p in pays]
        pays = [[p[0], p[3], b] for p, b in zip(pays, bf)]
    layout = row_layout(pays[0])
    # the last rank, fused: its pack's last program waits (every peer has signalled by then) and sanitizes
    cores = [
        _fake_core(r, ep, max_tokens, K, E, H, num_sms, plan, fused, fused and r == ep - 1) for r in range(ep)
    ]
    idx = len(pays[0]) - 1 if mixed else 1  # the ids payload: sanitized on the receive side
    trs = [SymmTransport(c) for c in cores]
    assert all(t.fused is fused for t in trs)
    disp = _fake_buffers(ep, ep * (max_tokens + 1) * layout.row_bytes)
    comb = _fake_buffers(ep, ep * max_tokens * H * 2)  # fp16 combine payload
    pads = [torch.zeros(16, dtype=torch.int32) for _ in range(ep)]  # the ranks' signal pads
    for r in range(ep):
        trs[r].disp, trs[r].row_cap, trs[r].comb = disp[r], layout.row_bytes, comb[r]
        if fused:
            trs[r]._set_sync_args(pads, torch.zeros(8, dtype=torch.int32))
        cores[r].transport = trs[r]
    # dispatch: every rank's plan + pack (each stores into all peers and, fused, signals them), then
    # every rank's receive side (fused: waits for the signals, which are all there)
    states = []
    for s in range(ep):
        assert validate_dispatch(cores[s], ids[s], pays[s], rt, -1, idx) == (Ts[s], K)
        st = build_dispatch(cores[s], Ts[s], K, pays[s], rt, -1, idx)  # the call's launch plan
        assert st.fused_plan == (not mixed and plan and Ts[s] <= 256)
        assert st.fused_sanitize == (fused and s == ep - 1)  # at every size (no sanitize launch)
        assert (st.sanitize is None) == st.fused_sanitize
        grid = cores[s].pack_grid(Ts[s])
        want = "narrow" if num_sms is not None else "dense" if Ts[s] <= 256 else "wide"
        assert grid == want
        assert st.lookback == (plan and not mixed)
        lookback = plan and not mixed and grid != "dense"
        assert st.packs[0][grid].consts_b[-4] is lookback
        assert st.packs[0][grid].consts_b[-2] is (grid != "dense")  # PREFETCH on the persistent grids
        assert st.packs[0][grid].consts_b[-1] == ((s + 1) % ep if ep == 3 else 0)  # the first rank stored to
        poison(st.slot)  # the plan (separate kernel or inside the pack) must write every slot
        poison(st.send_counts)
        send(cores[s], st, ids[s], pays[s])  # plan + pack (fused: the last program signals the peers)
        states.append(st)
        if lookback:  # the plan by look-back: scratch reset, epoch 1
            sc = cores[s].plan_scratch
            assert int(sc[0]) == int(sc[1]) == int(sc[-1]) == 0 and int(sc[2]) == 1, sc[:3]
    for s in range(ep):
        receive(cores[s], states[s])  # (wait for the peers,) sanitize the ids, copy the counts
        if fused:  # each peer's flag in s's pad holds epoch 1, and s's own dispatch epoch is 1
            assert [int(pads[s][r]) for r in range(ep) if r != s] == [1] * (ep - 1)
            assert int(trs[s].state[0]) == 1 and int(trs[s].state[2]) == 0  # arrivals reset
    ref, counts = dispatch_torch(ids, pays, E, rt)
    for s in range(ep):
        plan = make_plan(ids[s], E, ep)
        assert torch.equal(states[s].slot, plan.slot) and torch.equal(states[s].send_counts, plan.send_counts)
    views = []
    for r in range(ep):
        v, c = states[r].views, states[r].counts
        assert torch.equal(c, counts[r]), (r, c, counts[r])
        lo, n_local = cores[r].local_expert_offset, cores[r].num_local_experts
        for p in range(len(layout.specs)):
            for s in range(ep):
                n = int(counts[r, s])
                want = ref[r][p][s, :n]
                if p == idx:  # ids of other ranks' experts and of padding rows: -1
                    want = torch.where((want >= lo) & (want < lo + n_local), want, -1)
                    assert (v[p][s, n:] == -1).all(), (r, s)
                got = v[p][s, :n].contiguous().view(torch.uint8)
                assert torch.equal(got, want.contiguous().view(torch.uint8)), (r, p, s)
        assert torch.equal(cores[r].recv_counts, c), r  # copied by the sanitize (kernel or fused)
        views.append(v)
    plans = [types.SimpleNamespace(slot=st.slot) for st in states]
    # combine phase: payload rows f(x) (padding NaN must not be read), then each rank's reduction
    payloads = []
    for r in range(ep):
        p = (views[r][0] * (r + 2)).to(torch.float16)
        for s in range(ep):
            p[s, int(counts[r, s]) :] = float("nan")
        payloads.append(p)
    rows = [trs[r].combine(payloads[r], rt) for r in range(ep)]  # every rank's send (and signal)
    if fused:  # the combine flags (slots 8 + source) and epochs
        assert all(int(pads[s][8 + r]) == 1 for s in range(ep) for r in range(ep) if r != s)
        assert all(int(trs[s].state[1]) == 1 and int(trs[s].state[3]) == 0 for s in range(ep))
    expect = combine_torch([(ref[r][0] * (r + 2)).to(torch.float16) for r in range(ep)], ids, E)
    for s in range(ep):
        out = poison(torch.empty(Ts[s], H, dtype=torch.float16))
        combine_reduce(cores[s], rows[s][0], rows[s][1], plans[s].slot, out, None, rows[s][2], rows[s][3])
        torch.testing.assert_close(out, expect[s], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "n, ep, senders",
    [
        (24, 2, 8),  # ep = 2: a third send (one peer to send to, two rows to sum per token)
        (24, 4, 12),  # larger ep: half
        (2, 2, 1),  # the fewest: one sender and one reducer
        (3, 8, 2),  # rounding never leaves no reducer
    ],
)
def test_pipelined_combine_sender_split(n, ep, senders):
    from replaymoe.ep.transport_symm import pipe_senders

    assert pipe_senders(n, ep) == senders


@pytest.mark.parametrize(
    "mode, fused, num_sms, ep, rt, capturing, pipelined",
    [
        (None, True, 24, 2, 128, True, False),  # captured: by size; ep = 2, 128 tokens/rank: two kernels
        (None, True, 24, 2, 129, True, True),  # one token past it: the pipelined launch
        (None, True, 24, 2, 1, False, True),  # eager: the one launch at any size
        (None, True, 24, 4, 128, True, False),  # ep = 4: 384 rows back, at its threshold: two kernels
        (None, True, 24, 4, 129, True, True),  # 387 rows: pipelined
        (None, True, 24, 8, 129, True, True),  # ep = 8 (unmeasured): the same rule
        (True, True, 24, 2, 1, True, True),  # forced on: any size
        (False, True, 24, 4, 4096, False, False),  # forced off, eager too
        (None, True, None, 2, 4096, True, True),  # no num_sms cap, ep = 2: one program per SM (4 on the CPU)
        (None, True, None, 2, 128, True, False),  # ... and the dense two kernels at the threshold
        (None, True, None, 4, 4096, True, True),  # no cap at ep = 4: the rule is the same on every grid
        (None, True, None, 4, 64, True, False),  # ... small: the dense two kernels
        (None, True, None, 4, 64, False, True),  # ... unless eager
        (True, True, None, 4, 4096, True, True),  # forced
        (True, True, 1, 4, 4096, False, False),  # one program cannot both send and reduce
        (True, False, 24, 4, 4096, False, False),  # torch's barrier kernel: the phases are separate launches
    ],
)
def test_pipelined_combine_by_size(mode, fused, num_sms, ep, rt, capturing, pipelined, monkeypatch):
    import replaymoe.ep.transport_symm as symm
    from replaymoe.ep.transport_symm import SymmTransport, pipe_min_rows

    # the cases' edges: (ep - 1) * 128 rows sent back, on any grid
    assert [pipe_min_rows(e) for e in (2, 4, 8)] == [128, 384, 896]
    monkeypatch.setattr(symm, "is_capturing", lambda: capturing)  # (no CUDA graph on the CPU)
    core = _fake_core(0, ep, 4096, 2, 2 * ep, 16, num_sms, True, fused)
    core.pipelined_combine = mode
    core.transport = SymmTransport(core)
    assert core.combine_pipelines(rt) is pipelined


@pytest.mark.parametrize(
    "num_sms, device_sms, T, grid, TT",
    [
        (None, 132, 128, "dense", 1),  # decode, no cap: one short program per token
        (None, 132, 256, "dense", 1),  # the dense grid's last size
        (None, 132, 257, "wide", 1),  # one token more: a persistent program per SM, one token each
        (None, 132, 4096, "wide", 1),
        (24, 132, 128, "narrow", 2),  # DeepEP's 24 SMs: two tokens per iteration below 2048 ...
        (24, 132, 2047, "narrow", 2),
        (24, 132, 2048, "narrow", 4),  # ... four from there
        (63, 132, 4096, "narrow", 4),  # below 64 programs: narrow
        (64, 132, 128, "wide", 1),  # 64 programs: wide at any size
        (200, 132, 4096, "wide", 1),  # a cap above the device's SMs: every SM
        (200, 48, 4096, "narrow", 4),  # a small device: its 48 SMs are a narrow grid
    ],
)
def test_pack_grid_and_tiles(num_sms, device_sms, T, grid, TT):
    """The pack's grid by ``num_sms`` and tokens, and its tokens per iteration for DeepSeek-V3 rows
    (7168 bf16 = 3584 int32 units; the measurements behind them are in ``_dispatch_plan``'s comments)."""
    from replaymoe.ep._dispatch_plan import pack_tiles as _pack_tiles

    core = _fake_core(0, 4, 4096, 8, 256, 7168, num_sms, device_sms=device_sms)
    assert core.pack_grid(T) == grid
    NBs, chunks, tt, warps = _pack_tiles([3584], grid, T)
    assert tt == TT
    assert NBs == [4096] and chunks == 1  # a whole row per program and iteration
    assert warps == {("dense", 1): 8, ("wide", 1): 8, ("narrow", 2): 16, ("narrow", 4): 16}[grid, tt]


@pytest.mark.parametrize(
    "T, reducers, group",
    [
        (4096, 12, 8),  # large: the most tiles per step (fewest flag waits), still >= 8 steps each
        (1024, 12, 2),  # mid: steps shrink to keep ~8 per reducer (an even tail)
        (128, 12, 1),  # decode sizes: one tile per step
        (0, 12, 1),  # no tokens
    ],
)
def test_pipelined_combine_reducer_group(T, reducers, group):
    from replaymoe.ep.transport_symm import pipe_group

    assert pipe_group(T, 4, reducers) == group


@pytest.mark.interpret
@pytest.mark.parametrize(
    "ep, Ts, K, max_tokens, num_sms, dtype, tall, narrow",
    [
        # up to 150 rows back to rank 0: 10 chunks, the last partial
        (2, [150, 70], 2, 160, 4, torch.float16, False, False),
        # a rank without tokens; one sender, one reducer
        (3, [5, 0, 130], 3, 140, 2, torch.float16, False, False),
        # fp32 rows (the backward's combine); a rank with one token
        (4, [40, 3, 70, 1], 4, 80, 6, torch.float32, False, False),
        # tall tiles (16 rows: one flag chunk each)
        (4, [40, 3, 70, 1], 4, 80, 6, torch.float16, True, False),
        # tall tiles and 32-row chunks: two tiles per flag
        (4, [40, 3, 70, 1], 4, 80, 6, torch.float16, True, True),
        # 32-row chunks of row_tiling's tiles, ranks of 150, 9 and 64 tokens
        (3, [150, 9, 64], 3, 160, 2, torch.float16, False, True),
        # nothing anywhere: the epoch still moves
        (2, [0, 0], 2, 8, 2, torch.float16, False, False),
    ],
)
def test_pipelined_combine_matches_two_kernel_combine(
    ep, Ts, K, max_tokens, num_sms, dtype, tall, narrow, generator, monkeypatch
):
    """``ep_combine_kernel`` (send, then reduce as chunks land) gives the two-kernel combine's rows,
    flags every chunk a reducer waits for, and moves the epoch. The ranks run one after another
    (Triton's interpreter runs one program at a time): every rank's send (roles 1), then every rank's
    reduce (roles 2), which finds every flag it waits for already set."""
    import replaymoe.ep.transport_symm as symm
    from replaymoe.ep.transport_symm import FLAG_BASE, PIPE_CHUNK, PIPE_CHUNK_NARROW, SymmTransport

    E, H, rt = 2 * ep, 24, max(max(Ts), 1)
    if tall:  # the tall tiles' threshold lowered to this test's runtime_max (2048 tokens: too slow here)
        monkeypatch.setattr(symm, "PIPE_TALL_MIN_TOKENS", rt)
    # the narrow grids' wider chunks from this test's runtime_max (1024 tokens: too slow here), or never
    monkeypatch.setattr(symm, "PIPE_CHUNK_NARROW_MIN_TOKENS", rt if narrow else rt + 1)
    chunk = PIPE_CHUNK_NARROW if narrow else PIPE_CHUNK
    cores = [_fake_core(r, ep, max_tokens, K, E, H, num_sms, True, True) for r in range(ep)]
    trs = [SymmTransport(c) for c in cores]
    for c, t in zip(cores, trs):
        c.transport = t
    assert all(c.combine_pipelines(rt) for c in cores)  # _fake_core: pipelined_combine=True
    es = torch.tensor([], dtype=dtype).element_size()
    comb = _fake_buffers(ep, ep * max_tokens * H * es)
    pads = [torch.zeros(FLAG_BASE + 8 * trs[0].ncmax, dtype=torch.int32) for _ in range(ep)]
    ids, plans = [], []
    for r, T in enumerate(Ts):
        ids.append(torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).to(torch.int32)
                   if T else torch.zeros(0, K, dtype=torch.int32))  # fmt: skip
        plans.append(make_plan(ids[r], E, ep))
    for r in range(ep):
        trs[r].comb = comb[r]
        trs[r]._set_sync_args(pads, torch.zeros(8, dtype=torch.int32))
        # rows rank r received from each source s in the dispatch: s's send count to r
        cores[r].recv_counts.copy_(torch.stack([plans[s].send_counts[r] for s in range(ep)]))
    # payload rows: any values for live rows, NaN past each source's count (never sent, never read)
    payloads = []
    for r in range(ep):
        p = torch.randn(ep, rt, H, generator=generator).to(dtype)
        for s in range(ep):
            p[s, int(cores[r].recv_counts[s]) :] = float("nan")
        payloads.append(p)
    outs = [poison(torch.empty(T, H, dtype=dtype)) for T in Ts]
    for r in range(ep):
        trs[r].combine_pipelined(payloads[r], rt, plans[r].slot, outs[r], roles=1)
    for r in range(ep):  # every live chunk of every (source, receiver) pair is flagged with epoch 1
        for s in range(ep):
            if s != r:
                n = int(cores[s].recv_counts[r])  # rows s sends back to r
                flags = pads[r][FLAG_BASE + s * trs[0].ncmax :][: trs[0].ncmax].tolist()
                assert flags == [1] * -(-n // chunk) + [0] * (len(flags) + n // -chunk), (r, s, flags)
        assert int(trs[r].state[1]) == 1 and int(trs[r].state[3]) == 0  # epoch moved, arrivals reset
        # every peer's "sends done" flag (what the reducers wait on last), sender arrivals reset
        assert [int(pads[r][8 + s]) for s in range(ep) if s != r] == [1] * (ep - 1), r
        assert int(trs[r].state[4]) == 0
    for r in range(ep):
        trs[r].combine_pipelined(payloads[r], rt, plans[r].slot, outs[r], roles=2)
    for r in range(ep):  # the same sums as the torch reduction of the same rows, in rank order
        expect = torch.zeros(Ts[r], H, dtype=torch.float32)
        for t in range(Ts[r]):
            for q in range(ep):
                j = int(plans[r].slot[t, q])
                if j >= 0:
                    expect[t] += payloads[q][r, j].float()
        torch.testing.assert_close(outs[r], expect.to(dtype), atol=0, rtol=0)
    tts = {shape[2] for t in trs for shape in t._pshape.values()}  # (senders, nb, tt, warps)
    assert tts == ({16} if tall else {row_tiling(H, True)[2]}), tts
    assert {key[-1] for t in trs for key in t._pshape} == {chunk}  # the rows per flag the launches took


@pytest.mark.parametrize("chunk", [8, 24])  # fewer rows than the pads' flags hold; not whole 16-row tiles
def test_pipelined_combine_chunk_checked(chunk, monkeypatch):
    import replaymoe.ep.transport_symm as symm

    monkeypatch.setattr(symm, "PIPE_TALL_MIN_TOKENS", 1)  # 16-row tiles at this test's size
    core = _fake_core(0, 2, 64, 2, 4, 16, 4, True, True)
    tr = core.transport = symm.SymmTransport(core)
    tr.chunk = chunk
    payload = torch.zeros(2, 64, 16)
    with pytest.raises(ValueError, match="SymmTransport.chunk"):  # before anything is launched
        tr.combine_pipelined(payload, 64, torch.zeros(64, 2, dtype=torch.int32), torch.empty(64, 16), roles=1)


@pytest.mark.parametrize(
    "W, persistent, want",
    [
        (7168, False, (8192, 1, 1, 8)),  # DeepSeek-V3 rows, no cap: one program per whole row
        (7176, False, (8192, 1, 1, 8)),  # the backward's [H + K] fp32 rows
        (16384, False, (8192, 2, 1, 8)),  # wider than SEND_DENSE_MAX_COLS: two programs per row
        (64, False, (64, 1, 1, 4)),  # narrow rows: 4 warps
        (7168, True, (4096, 2, 4, 16)),  # a num_sms cap: row_tiling's persistent tiles
    ],
)
def test_combine_send_tiling(W, persistent, want):
    from replaymoe.ep.transport_symm import send_tiling

    assert send_tiling(W, persistent) == want


@pytest.mark.parametrize(
    "programs, rt, want",
    [
        (24, 1024, 32),  # a narrow grid from 1024 tokens/rank: 32 rows per flag
        (24, 1023, 16),  # one token less
        (63, 4096, 32),  # the widest narrow grid
        (64, 4096, 16),  # 64 programs and more (every SM): 16 (32 measured slower there)
        (2, 128, 16),  # decode sizes
    ],
)
def test_pipelined_combine_chunk(programs, rt, want):
    from replaymoe.ep.transport_symm import PIPE_CHUNK, pipe_chunk, pipe_tiling

    got = pipe_chunk(programs, rt)
    assert got == want
    assert got % PIPE_CHUNK == 0  # the pads hold PIPE_CHUNK-row flags: wider chunks fit
    assert got % pipe_tiling(7168, programs, rt)[1] == 0  # whole tiles per flag


@pytest.mark.parametrize(
    "W, programs, rt, want",
    [
        (7168, 24, 2048, (1024, 16, 16)),  # DeepSeek-V3 rows, 24 SMs, from 2048 tokens/rank: tall
        (7168, 24, 2047, (4096, 4, 16)),  # one token less: row_tiling's tiles
        (7168, 63, 4096, (1024, 16, 16)),  # the widest narrow grid
        (7168, 64, 4096, (4096, 4, 16)),  # 64 programs and more (every SM): row_tiling's
        (64, 24, 4096, (64, 16, 4)),  # narrow rows: 64 columns, 4 warps
    ],
)
def test_pipelined_combine_tiling(W, programs, rt, want):
    from replaymoe.ep.transport_symm import PIPE_CHUNK, pipe_tiling

    got = pipe_tiling(W, programs, rt)
    assert got == want
    assert PIPE_CHUNK % got[1] == 0  # a tile's rows never cross a flag chunk


@pytest.mark.interpret
def test_combine_reduce_kernel_matches_torch(generator):
    """The Triton reduction and the torch reduction agree (fp32 sums in rank order)."""
    ep, T, H, rt = 3, 7, 40, 5
    slot = torch.full((T, ep), -1, dtype=torch.int32)
    nxt = [0] * ep
    for t in range(T):
        for r in torch.randperm(ep, generator=generator)[: 1 + t % ep].tolist():
            slot[t, r] = nxt[r]
            nxt[r] += 1
    rows = torch.randn(ep * (rt + 1), H, generator=generator)
    for r in range(ep):
        rows[r * (rt + 1) + nxt[r] : (r + 1) * (rt + 1)] = float("nan")  # padding: never read
    core_t = _fake_core(0, ep, rt, 1, ep, H)  # symm -> Triton
    core_r = _fake_core(0, ep, rt, 1, ep, H, transport="nccl", kernel_backend="torch")
    assert core_t.use_triton() and not core_r.use_triton()
    out_t = poison(torch.empty(T, H))
    combine_reduce(core_t, rows, (rt + 1) * H, slot, out_t)
    out_r = poison(torch.empty(T, H))
    combine_reduce(core_r, rows, (rt + 1) * H, slot, out_r)
    torch.testing.assert_close(out_t, out_r, atol=1e-6, rtol=1e-6)
    expect = torch.zeros(T, H)
    for t in range(T):
        for r in range(ep):
            if slot[t, r] >= 0:
                expect[t] += rows[r * (rt + 1) + slot[t, r]]
    torch.testing.assert_close(out_r, expect, atol=1e-6, rtol=1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "E, ep, T, K",
    [
        (8, 1, 5, 2),  # one rank
        (10, 3, 40, 4),  # uneven split
        (6, 4, 1500, 1),  # 12 blocks of 128 tokens, the last partial: the look-back prefix
        (256, 4, 33, 8),  # DeepSeek-V3 experts, top-8
        (16, 4, 0, 8),  # no tokens: counts are zero
        (16, 2, 128, 2),  # exactly one full block
        (16, 8, 129, 3),  # one token into a second block; ep = 8
        (12, 3, 16385, 2),  # past PLAN_BLOCKS x 128 tokens: 256-token blocks, 65 programs
    ],
)
def test_plan_kernel_matches_torch(E, ep, T, K, generator):
    ids = torch.zeros(0, K, dtype=torch.int32)
    if T:
        ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).to(torch.int32)
    if T > 3:
        ids[1] = -1  # a token sent nowhere
        ids[2, 0] = E  # an out-of-range id is ignored
    ref = make_plan(ids, E, ep)
    got = make_plan(ids, E, ep, use_triton=True)
    assert torch.equal(got.slot, ref.slot)
    assert torch.equal(got.send_counts, ref.send_counts)


@pytest.mark.interpret
def test_plan_kernel_reuses_its_scratch(generator):
    """Three calls of different sizes on one scratch (as one MoeAlltoAll makes them): each gives the
    torch plan, and each leaves the ticket and arrivals at zero and the epoch one higher, so the next
    call's flags wait for its own blocks."""
    from replaymoe.ep._kernel_plan import ep_plan_kernel
    from replaymoe.ep.partition import PLAN_BLOCKS, PLAN_SCRATCH, plan_grid

    E, ep, K = 16, 4, 2
    scratch = torch.zeros(PLAN_SCRATCH, dtype=torch.int32)
    for call, T in enumerate((300, 129, 700)):
        ids = torch.randint(0, E, (T, K), generator=generator, dtype=torch.int32)
        slot = poison(torch.empty(T, ep, dtype=torch.int32))
        counts = poison(torch.empty(ep, dtype=torch.int32))
        bt, nprog = plan_grid(T)
        ep_plan_kernel[(nprog,)](ids, slot, counts, *([counts] * 8), 0, 0, T, E, E // ep, E % ep, scratch,
                                 K=K, EP=ep, EP_P2=ep, BLOCK_T=bt, NBLK=PLAN_BLOCKS, PUT=False)  # fmt: skip
        ref = make_plan(ids, E, ep)
        assert torch.equal(slot, ref.slot) and torch.equal(counts, ref.send_counts), call
        assert scratch[:3].tolist() == [0, 0, call + 1]
        assert scratch[3 : 3 + nprog].tolist() == [call + 1] * nprog  # this call's flags


@pytest.mark.parametrize(
    "T, block, programs",
    [
        (0, 128, 1),  # no tokens: one program stores the zero counts
        (1, 128, 1),  # decode
        (4096, 128, 32),  # the EP bench's largest: 32 programs in parallel
        (16384, 128, 128),  # PLAN_BLOCKS blocks of the smallest size
        (16385, 256, 65),  # past it: larger blocks, never more than PLAN_BLOCKS programs
    ],
)
def test_plan_grid(T, block, programs):
    from replaymoe.ep.partition import plan_grid

    assert plan_grid(T) == (block, programs)


@pytest.mark.interpret
def test_sanitize_kernel_matches_torch(generator):
    """The received-id sanitization (padding rows, header rows, remote experts -> invalid) and the
    counts copy, Triton vs torch, on a hand-built receive buffer."""
    from replaymoe.ep.receive import sanitize_triton

    ep, E, K, rt = 3, 10, 4, 5
    ids = [torch.randint(-1, E, (rt, K), generator=generator, dtype=torch.int32) for _ in range(ep)]
    layout = row_layout([ids[0]])
    block = (rt + 1) * layout.row_bytes
    recv = torch.zeros(ep * block + layout.row_bytes, dtype=torch.uint8)
    views, counts = recv_views(recv, layout, ep, rt, block)
    for s in range(ep):
        views[0][s] = ids[s]
    counts.copy_(torch.tensor([5, 0, 2], dtype=torch.int32))
    recv2 = recv.clone()
    outs = []
    for r, buf in enumerate((recv, recv2)):
        core = _fake_core(1, ep, rt, K, E, 16)
        v, c = recv_views(buf, layout, ep, rt, block)
        n = ep * (rt + 1) - 1
        flat = torch.as_strided(v[0], (n, K), v[0].stride()[1:])
        if r == 0:
            sanitize_triton(core, flat, buf, c, rt, 4, 7, -9)
        else:
            i = torch.arange(n)
            pad = (i % (rt + 1)) >= c[i // (rt + 1)]
            drop = pad[:, None] | (flat < 4) | (flat >= 7)
            flat.copy_(torch.where(drop, torch.full_like(flat, -9), flat))
            core.recv_counts.copy_(c)
        outs.append((flat.clone(), core.recv_counts.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], torch.tensor([5, 0, 2], dtype=torch.int32))
    assert (outs[0][0][5] == -9).all() and (outs[0][0][6:12] == -9).all()  # header row, empty source


def test_ep_kernels_compile_for_sm90():
    # Hopper compiles (no GPU needed) of the launches two transport cases make: the narrow grid's pack with
    # the look-back, PREFETCH and the fused sanitize (two ranks), the dense grid's pack with its scan and
    # peers-first stores (three ranks), the combine kernels; each as launched here and with the GPU-only
    # switches (16 sanitizers, asm polls, the barrier's timer). A separate process, since this one runs
    # the kernels in Triton's interpreter. A constexpr reassigned in a static_range got past every
    # interpreter test and failed only on the GPU (session 32).
    run = run_script("ep_ptx_check.py", "symm_transport_kernels and (Ts4 or Ts9)")
    assert run.returncode == 0, run.stdout + run.stderr
    done, total = map(int, re.search(r"(\d+) of (\d+) distinct launches compiled", run.stdout).groups())
    assert done == total >= 20, run.stdout

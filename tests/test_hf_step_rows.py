"""One forward's capture rows and replay ids in one kernel (``replaymoe.hf.step.step_rows``) against
their reference: ``token_positions`` then ``CaptureBuffer.slots`` and ``ReplayTable.gather``.

Runs the kernel in Triton's interpreter on the CPU (integer-only arithmetic, so exact there) and
natively on the GPU. Every output is poisoned first; integers compare exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaymoe.hf.positions import token_positions
from replaymoe.hf.state import CaptureBuffer, ReplayTable, TraceMeta
from replaymoe.hf.step import fused_rows_ok, step_rows
from replaymoe.record.trace import RoutingTrace

L, K, E = 3, 4, 16

CASES = [
    # (kept-token pattern per row as (left pad, kept, right pad), S, past, seq_cap, trace lengths/offsets)
    pytest.param([(3, 9, 0), (0, 12, 0)], 12, 0, 16, [(12, 0), (12, 0)], id="prefill-left-padding"),
    pytest.param([(0, 7, 5), (0, 12, 0)], 12, 0, 16, [(7, 0), (10, 0)], id="trainer-right-padding"),
    pytest.param([(2, 19, 0), (0, 21, 0)], 1, 20, 32, [(20, 0), (21, 0)], id="decode-step"),
    pytest.param([(0, 5, 0), (5, 0, 0)], 5, 0, 8, [(5, 0), (0, 0)], id="all-padding-row"),
    pytest.param([(0, 200, 0), (0, 200, 0)], 200, 0, 64, [(150, 30), (250, 0)], id="overflow-and-offsets"),
    # mask narrower than cache + new tokens: the missing left columns count as kept
    pytest.param([(0, 6, 0), (1, 5, 0)], 2, 10, 32, [(9, 4), (20, 0)], id="missing-left-columns"),
]


def _mask(pattern):
    rows = [[0] * a + [1] * b + [0] * c for a, b, c in pattern]
    assert len({len(r) for r in rows}) == 1
    return torch.tensor(rows, dtype=torch.int64)


def _tables(rng, traces_spec, device):
    traces = []
    for n, off in traces_spec:
        ids = np.array([rng.permutation(E)[:K] for _ in range(n * L)], dtype=np.int16).reshape(n, L, K)
        traces.append(RoutingTrace(ids.astype(np.int16), num_experts=E, top_k=K, token_offset=off))
    table = ReplayTable()
    table.load(traces, list(range(L)), torch.device(device))
    return table


@pytest.mark.parametrize("capture,replay", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("pattern,S,past,seq_cap,traces_spec", CASES)
def test_step_rows_matches_reference(device, pattern, S, past, seq_cap, traces_spec, capture, replay):
    from replaymoe._backend import INTERPRET

    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the kernel needs CUDA or TRITON_INTERPRET=1")
    rng = np.random.default_rng(len(pattern) * 1000 + S + past)
    mask = _mask(pattern).to(device)
    B = mask.shape[0]
    assert fused_rows_ok(mask, S, past, mask.device, "triton")
    meta = TraceMeta(L, K, E, tuple(range(L)), "test")
    cap = CaptureBuffer(meta, mask.device, B, seq_cap) if capture else None
    table = _tables(rng, traces_spec, device) if replay else None

    positions = token_positions(B, S, attention_mask=mask, past_length=past, device=mask.device)
    slot_ref = cap.slots(positions, check_overflow=True) if capture else None
    overflow_ref = bool(cap.overflow.item()) if capture else None
    if capture:
        cap.overflow.zero_()
    forced_ref = seen_ref = fallback_ref = uncovered_ref = None
    if replay:
        forced_ref = table.gather(positions)
        seen_ref, fallback_ref = table.seen.clone(), table.fallback.clone()
        table.count_uncovered(forced_ref, positions, by_content=False)  # the coverage counts' reference
        uncovered_ref = table.uncovered.clone()
        table.reset_report()
        table._clear_uncovered()

    poison = torch.full((L, B * S, K), 12345, dtype=torch.int32, device=device) if replay else None
    slot, forced = step_rows(mask, S, past, capture=cap, replay=table, forced_out=poison)
    if capture:
        torch.testing.assert_close(slot, slot_ref, rtol=0, atol=0)
        assert bool(cap.overflow.item()) == overflow_ref
    else:
        assert slot is None
    if replay:
        assert forced is poison  # written in place
        torch.testing.assert_close(forced, forced_ref, rtol=0, atol=0)
        torch.testing.assert_close(table.seen, seen_ref, rtol=0, atol=0)
        torch.testing.assert_close(table.fallback, fallback_ref, rtol=0, atol=0)
        torch.testing.assert_close(table.uncovered, uncovered_ref, rtol=0, atol=0)  # counts and first key
    else:
        assert forced is None


@pytest.mark.parametrize(
    "mask,S,past,backend,ok",
    [
        (torch.ones(2, 5, dtype=torch.int64), 5, 0, "triton", True),  # the eager 2-D case
        (torch.ones(2, 5, dtype=torch.int64), 5, 0, "torch", False),  # torch backend: the reference path
        (torch.ones(2, 4, dtype=torch.int64), 5, 0, "triton", False),  # mask shorter than the tokens
        (torch.ones(2, 1, 5, 5, dtype=torch.bool), 5, 0, "triton", False),  # 4-D static-cache mask
        (torch.ones(5, 2, dtype=torch.int64).t(), 5, 0, "triton", False),  # columns not unit-stride
        (torch.ones(2, 5, dtype=torch.int64), 5, torch.tensor(0), "triton", False),  # cache length on device
        (None, 5, 0, "triton", False),  # no mask
    ],
)
def test_fused_rows_ok(mask, S, past, backend, ok):
    from replaymoe._backend import INTERPRET

    got = fused_rows_ok(mask, S, past, torch.device("cpu"), backend)
    assert got == (ok and INTERPRET)


@pytest.mark.parametrize(
    "B,S,Tp,replay",
    [
        (2, 1, 2, False),  # decode step after a decode step: one pending row per program
        (1, 1, 300, False),  # after a prefill: one program strides over 3 blocks of pending rows
        (3, 4, 5, True),  # with replay on: the pending rows ride along with the replay gather
    ],
)
def test_step_rows_writes_the_deferred_commit(device, B, S, Tp, replay):
    from replaymoe._backend import INTERPRET

    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the kernel needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(B * 100 + Tp)
    meta = TraceMeta(L, K, E, tuple(range(L)), "test")
    cap = CaptureBuffer(meta, device, 4, 128)
    staged = torch.randint(0, E, (L, Tp, K), generator=g, dtype=torch.int16).to(device)
    rows = cap.batch_cap * cap.seq_cap + 1
    slot = torch.randperm(rows, generator=g)[:Tp].to(device)  # distinct rows, the dump row included
    expect = cap.ids.clone()
    expect.index_copy_(1, slot, staged)
    cap.defer(staged, slot)
    table = _tables(np.random.default_rng(Tp), [(S + 4, 0)] * B, device) if replay else None
    mask = torch.ones(B, S + 4, dtype=torch.int64, device=device)
    new_slot, _ = step_rows(mask, S, 4, capture=cap, replay=table)
    assert cap.pending is None
    torch.testing.assert_close(cap.ids, expect, rtol=0, atol=0)
    assert new_slot.shape == (B * S,)


def test_deferred_commit_is_flushed_before_the_buffer_is_read():
    # harvest, a new batch and growth each write the pending ids first (nothing is lost)
    meta = TraceMeta(L, K, E, tuple(range(L)), "test")
    cap = CaptureBuffer(meta, torch.device("cpu"), 1, 8)
    cap.prepare(1, 0, 8, new_batch=True, eager=True)
    ids = torch.arange(L * 3 * K, dtype=torch.int16).reshape(L, 3, K) % E
    cap.defer(ids, torch.arange(3))
    cap.ensure(1, 64)  # growth keeps the contents: the pending rows are written before the copy
    assert cap.pending is None and cap.seq_cap == 64
    cap.defer(ids[:, :1], torch.tensor([3]))
    (trace,), lost = cap.harvest()
    assert lost == 0 and trace.num_tokens == 4
    np.testing.assert_array_equal(trace.ids[:3], ids.permute(1, 0, 2).numpy())
    np.testing.assert_array_equal(trace.ids[3], ids[:, 0].numpy())


@pytest.mark.parametrize("capture,replay", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize(
    "pattern,S,seq_cap,steps",
    [
        # after a prefill with left padding: the head continues every row's positions
        pytest.param([(3, 5, 0), (0, 8, 0)], 8, 16, 5, id="after-prefill"),
        # positions run past the capture capacity (dump row, overflow) and past the replay traces
        pytest.param([(0, 6, 0), (2, 4, 0)], 6, 8, 5, id="past-capacity"),
        # a row that is all padding so far: its first kept token is position 0
        pytest.param([(0, 3, 0), (3, 0, 0)], 3, 16, 3, id="empty-row"),
    ],
)
def test_decode_head_continues_step_rows(device, pattern, S, seq_cap, steps, capture, replay):
    # step_rows on every forward (mask growing by a column of ones each decode step) is the reference
    # of step_rows(next_pos_out=) once and then DecodeHead on the fixed buffers: slots, forced ids,
    # replay counters and the capture buffer after the deferred commits, all exact
    from replaymoe._backend import INTERPRET
    from replaymoe.hf.step import DecodeHead

    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the kernel needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(len(pattern) * 10 + S + steps)
    mask = _mask(pattern).to(device)
    B = mask.shape[0]
    meta = TraceMeta(L, K, E, tuple(range(L)), "test")
    caps = [CaptureBuffer(meta, device, B, seq_cap) if capture else None for _ in range(2)]
    spec = [(S + 2, 0), (S, 1)]  # the traces end before the last decode steps (fallback rows)
    tables = [_tables(np.random.default_rng(7), spec, device) if replay else None for _ in range(2)]
    next_pos = torch.full((B,), -99, dtype=torch.int64, device=device)
    slot_buf = torch.full((B,), -99, dtype=torch.int64, device=device)
    staged_slab = torch.full((L, B, K), -7, dtype=torch.int16, device=device)
    forced_slab = torch.full((L, B, K), 12345, dtype=torch.int32, device=device)
    # the forward that starts the chain (its slots go to a buffer of its own: S tokens per row)
    ref_slot, ref_forced = step_rows(mask, S, 0, capture=caps[0], replay=tables[0])
    slot, forced = step_rows(mask, S, 0, capture=caps[1], replay=tables[1], next_pos_out=next_pos)
    if capture:
        torch.testing.assert_close(slot, ref_slot, rtol=0, atol=0)
        first = torch.randint(0, E, (L, B * S, K), generator=g, dtype=torch.int16).to(device)
        caps[0].defer(first.clone(), ref_slot)
        caps[1].defer(first.clone(), slot)
    head = None
    for step in range(steps):
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
        past = mask.shape[1] - 1
        ref_slot, ref_forced = step_rows(mask, 1, past, capture=caps[0], replay=tables[0])
        if step == 0 and capture:  # the prefill's pending rows: step_rows writes them (S > 1)
            slot, _ = step_rows(mask, 1, past, capture=caps[1], replay=tables[1], forced_out=forced_slab,
                                slot_out=slot_buf, next_pos_out=next_pos)  # fmt: skip
        else:
            if capture:
                assert caps[1].take_pending()[1] is slot_buf
            if head is None:
                head = DecodeHead(next_pos, slot_buf, staged_slab, caps[1], tables[1], forced_slab)
            head.launch()
            slot = slot_buf
        if capture:
            torch.testing.assert_close(slot, ref_slot, rtol=0, atol=0)
            ids = torch.randint(0, E, (L, B, K), generator=g, dtype=torch.int16).to(device)
            staged_slab.copy_(ids)  # what this step's routers write
            caps[0].defer(ids.clone(), ref_slot)
            caps[1].defer(staged_slab, slot_buf)
        if replay:
            torch.testing.assert_close(forced_slab, ref_forced, rtol=0, atol=0)
            torch.testing.assert_close(tables[1].seen, tables[0].seen, rtol=0, atol=0)
            torch.testing.assert_close(tables[1].fallback, tables[0].fallback, rtol=0, atol=0)
            torch.testing.assert_close(tables[1].uncovered, tables[0].uncovered, rtol=0, atol=0)
    if replay:  # the traces end before the last steps: uncovered lookups, counted alike by both kernels
        assert int(tables[0].uncovered[:-1].sum()) > 0
    if capture:
        for c in caps:
            c.flush()
        torch.testing.assert_close(caps[1].ids, caps[0].ids, rtol=0, atol=0)
        assert bool(caps[1].overflow.item()) == bool(caps[0].overflow.item())


def test_decode_chain_decides_which_forward_takes_the_head():
    # the host-side rules of DecodeChain (no launch): which forward continues the chain, the pending
    # commit it needs, the alternating capture-row buffers, and a head rebuilt when its tensors change
    from replaymoe.hf.step import DecodeChain, StepBuffers

    dev = torch.device("cpu")
    B, P, past = 2, 9, 8
    buffers = StepBuffers(L, K)
    chain = DecodeChain(buffers)
    meta = TraceMeta(L, K, E, tuple(range(L)), "test")
    cap = CaptureBuffer(meta, dev, B, 32)
    staged = buffers.get("staged", B, torch.int16, dev)
    slot, next_pos = chain.outputs(B, B, dev, cap)
    assert next_pos.shape == (B,) and slot.shape == (B,)
    chain.served(1, B, P, past + 1, slot)  # a graphed decode step that step_rows served
    cap.defer(staged, slot)
    # the next decode step of the same generate continues; anything else does not
    others = [
        (2, B, 1, P + 1, past + 1),  # another generate call
        (1, B + 1, 1, P + 1, past + 1),  # another batch
        (1, B, 2, P + 1, past + 1),  # two new tokens
        (1, B, 1, P + 2, past + 1),  # a mask wider by two
        (1, B, 1, P + 1, past),  # a cache that did not grow
        (None, B, 1, P + 1, past + 1),  # outside generate
    ]
    for args in others:
        assert chain.head(*args, cap, None, staged, None) is None, args
    cap.pending = (staged.clone(), slot)  # a commit pending elsewhere (e.g. the slab of another forward)
    assert chain.head(1, B, 1, P + 1, past + 1, cap, None, staged, None) is None
    cap.pending = (staged, slot)
    head = chain.head(1, B, 1, P + 1, past + 1, cap, None, staged, None)
    assert head is not None and head.slot is slot and chain.heads == 1
    # the step after continues with the same head; a step_rows forward now writes the other buffer
    cap.pending = (staged, slot)
    assert chain.head(1, B, 1, P + 2, past + 2, cap, None, staged, None) is head
    assert chain.outputs(B, B, dev, cap)[0] is not slot
    # replay only: a reloaded (pooled) table gets a new head
    table = _tables(np.random.default_rng(0), [(40, 0)] * B, "cpu")
    forced = buffers.get("forced", B, torch.int32, dev)
    chain.served(2, B, P, past + 1, None)
    h1 = chain.head(2, B, 1, P + 1, past + 1, None, table, None, forced)
    h2 = chain.head(2, B, 1, P + 2, past + 2, None, table, None, forced)
    assert h1 is not None and h2 is h1
    table.table = table.table.clone()
    assert chain.head(2, B, 1, P + 3, past + 3, None, table, None, forced) is not h1
    chain.reset()
    assert chain.head(2, B, 1, P + 4, past + 4, None, table, None, forced) is None


@pytest.mark.parametrize(
    "position_ids,want",
    [
        ([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]], [[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]]),  # left pads start at 0
        ([[0, 0, 0, 0, 0], [0, 1, 2, 3, 4]], [[-1, -1, -1, -1, 0], [0, 1, 2, 3, 4]]),  # one real token
        ([[5], [3]], [[5], [3]]),  # a decode step: the unpadded positions as they are
    ],
)
def test_padding_in_positions(position_ids, want):
    # transformers >= 5.24's generate passes no attention mask: a left pad token gets position 0 (a
    # sequence of its own), so a row's tokens before its last position 0 are padding
    from replaymoe.hf.positions import token_positions

    pos = torch.tensor(position_ids)
    B, S = pos.shape
    got = token_positions(B, S, attention_mask=None, past_length=0, device="cpu", position_ids=pos,
                          padding_in_positions=True)  # fmt: skip
    assert got.tolist() == want
    plain = token_positions(B, S, attention_mask=None, past_length=0, device="cpu", position_ids=pos)
    assert plain.tolist() == position_ids  # the switch off (older transformers): positions as given

"""RoutedExpertsCapturer on device='cpu' with real route() calls writing its buffers:
the serving protocol (prefix-cache hit, decode steps, abort, id reuse), the two DP layouts,
deferred scatter / double buffering (with a transfer whose copies complete on demand),
host-memory accounting and its bound, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaymoe.record.capture import CaptureMemoryError, RoutedExpertsCapturer
from replaymoe.record.trace import RoutingTrace
from replaymoe.record.transfer import SyncTransfer as _SyncTransfer
from replaymoe.routing import RoutingMethod, route

L, K, E, N = 3, 2, 8, 16


def run_step(cap, generator, token_requests, token_positions, expected, *, rows=None, dp_span=None, skip=()):
    """Route T rows through every layer into the capturer's buffers, remember what each
    (request, position, layer) got, then end the step. ``rows`` = how many buffer rows the
    kernels route (defaults to the number of tokens); layers in ``skip`` are not routed."""
    T = rows if rows is not None else len(token_requests)
    start = dp_span[0] if dp_span else 0
    ids = []
    for layer in range(L):
        logits = torch.randn(T, E, generator=generator)
        if layer in skip:
            ids.append(None)
            continue
        out = route(logits, K, RoutingMethod.RENORMALIZE, routing_replay_out=cap.layer_buffer(layer))
        ids.append(out.topk_ids)
    for i, (req, pos) in enumerate(zip(token_requests, token_positions)):
        if req is None:
            continue
        pos = int(pos)
        for layer in range(L):
            if ids[layer] is not None:
                expected.setdefault(req, {})[(pos, layer)] = ids[layer][start + i].tolist()
    cap.end_step(token_requests, token_positions, dp_span=dp_span)


def expected_array(exp, n):
    out = np.full((n, L, K), -1, dtype=np.int16)
    for (pos, layer), row in exp.items():
        if pos < n:
            out[pos, layer] = row
    return out


def make(**kw):
    args = dict(num_layers=L, max_num_tokens=N, top_k=K, device="cpu", num_experts=E, layer_ids=[1, 3, 5])
    args.update(kw)
    return RoutedExpertsCapturer(**args)


def test_serving_protocol(generator):
    cap = make(model_id="toy", page_size=4, slab_pages=4)
    staging = cap.host_bytes()
    exp: dict = {}
    # prefill: A has a 4-position prefix-cache hit (computes positions 4..6), B computes 0..4,
    # C computes 0..2; two padding rows at the end of the (graph-padded) batch
    reqs = ["A"] * 3 + ["B"] * 5 + ["C"] * 3 + [None, None]
    poss = [4, 5, 6] + [0, 1, 2, 3, 4] + [0, 1, 2] + [0, 0]
    run_step(cap, generator, reqs, poss, exp)
    assert cap.host_bytes() > staging
    assert sorted(cap.live_requests) == ["A", "B", "C"]
    # decode steps: one token per live request
    run_step(cap, generator, ["A", "B", "C"], [7, 5, 3], exp)
    cap.abort("C")  # preempted / cancelled
    run_step(cap, generator, ["B", "A", None], [6, 8, 0], exp)
    run_step(cap, generator, ["A", "B"], [9, 7], exp)

    a = cap.finish("A")
    assert isinstance(a, RoutingTrace)
    assert (a.num_tokens, a.num_layers, a.top_k, a.num_experts) == (10, L, K, E)
    assert a.layer_ids == (1, 3, 5) and a.model_id == "toy" and a.token_offset == 0
    assert (a.ids[:4] == -1).all()  # the prefix-cache hit stays missing
    np.testing.assert_array_equal(a.ids, expected_array(exp["A"], 10))
    b = cap.finish("B")
    np.testing.assert_array_equal(b.ids, expected_array(exp["B"], 8))
    assert not b.missing_mask().any()

    with pytest.raises(ValueError, match="request_id"):
        cap.finish("C")  # aborted: nothing to return
    with pytest.raises(ValueError, match="request_id"):
        cap.finish("A")  # already finished
    cap.abort("unknown")  # ignored
    assert cap.live_requests == [] and cap.memory_stats()["used_page_bytes"] == 0

    # the id "C" can be reused by a new request: it sees none of the aborted one's rows
    exp2: dict = {}
    run_step(cap, generator, ["C", "C"], [5, 6], exp2)
    c = cap.finish("C")
    assert c.num_tokens == 7 and (c.ids[:5] == -1).all()
    np.testing.assert_array_equal(c.ids, expected_array(exp2["C"], 7))


def test_finish_num_positions_and_page_reuse(generator):
    cap = make(page_size=2, slab_pages=2)
    exp: dict = {}
    run_step(cap, generator, ["r"] * 5, list(range(5)), exp)
    pool = cap.memory_stats()["pool_bytes"]
    t = cap.finish("r", num_positions=3)  # e.g. trailing rejected speculative tokens
    np.testing.assert_array_equal(t.ids, expected_array(exp["r"], 3))
    # freed pages are reused: a second request of the same size needs no new slab
    exp2: dict = {}
    run_step(cap, generator, ["s"] * 5, list(range(5)), exp2)
    assert cap.memory_stats()["pool_bytes"] == pool
    t2 = cap.finish("s", num_positions=8)  # padded with -1
    assert (t2.ids[5:] == -1).all()
    np.testing.assert_array_equal(t2.ids[:5], expected_array(exp2["s"], 5))


def test_dp_all_ranks_tokens_with_span(generator):
    # the MoE runs on all DP ranks' tokens concatenated (rank 0: 3 tokens, rank 1: 4 tokens);
    # this is rank 1's capturer: its rows are [3, 7)
    cap = make()
    exp: dict = {}
    run_step(cap, generator, ["x", "x", "y", "y"], [0, 1, 0, 1], exp, rows=7, dp_span=(3, 4))
    run_step(cap, generator, ["y", "x"], [2, 2], exp, rows=5, dp_span=(3, 2))
    for r in ("x", "y"):
        np.testing.assert_array_equal(cap.finish(r).ids, expected_array(exp[r], 3))


def test_dp_all_ranks_tokens_with_none_entries(generator):
    # same layout, described with one entry per row and None for the other rank's tokens
    cap = make()
    exp: dict = {}
    run_step(cap, generator, [None] * 3 + ["x", "x", "y", "y"], [0, 0, 0, 0, 1, 0, 1], exp)
    np.testing.assert_array_equal(cap.finish("y").ids, expected_array(exp["y"], 2))
    np.testing.assert_array_equal(cap.finish("x").ids, expected_array(exp["x"], 2))


def test_dp_this_rank_only(generator):
    # only this rank's tokens reach the MoE: rows 0..T-1, no span
    cap = make()
    exp: dict = {}
    run_step(cap, generator, ["x", "y", "x"], [0, 0, 1], exp)
    np.testing.assert_array_equal(cap.finish("x").ids, expected_array(exp["x"], 2))


def test_clear_after_copy_exposes_skipped_writes(generator):
    for clear in (False, True):
        cap = make(clear_after_copy=clear)
        exp: dict = {}
        run_step(cap, generator, ["r", "r"], [0, 1], exp)
        before = cap.buffer[1, :2].clone()
        run_step(cap, generator, ["r", "r"], [2, 3], exp, skip=(1,))  # layer 1's kernel never writes
        t = cap.finish("r")
        if clear:
            assert (t.ids[2:, 1] == -1).all()  # shows up as missing
        else:
            np.testing.assert_array_equal(t.ids[2:, 1], before.numpy())  # stale rows: the hazard


# ----------------------------------------------------------------------------- deferred copies


class _Handle:
    def __init__(self, step):
        self.step, self.done = step, False


class _ManualTransfer(_SyncTransfer):
    """Copies at start (like the gather on the step's stream) but reports completion only when
    the test says so, like a side-stream copy still in flight."""

    def __init__(self, buffer, num_buffers):
        super().__init__(buffer, num_buffers)
        self.handles, self.waited = [], []

    def start(self, slot, start, T):
        super().start(slot, start, T)
        h = _Handle(len(self.handles))
        self.handles.append(h)
        return h

    def ready(self, handle):
        return handle.done

    def wait(self, handle):
        self.waited.append(handle.step)
        handle.done = True


class _ManualCapturer(RoutedExpertsCapturer):
    # private hook on purpose: the copy's completion is what these tests control (no public seam)
    def _make_transfer(self):
        return _ManualTransfer(self.buffer, self.num_buffers)


def test_scatter_waits_for_copy_events(generator):
    cap = _ManualCapturer(L, N, K, device="cpu", num_experts=E, page_size=4, slab_pages=8)
    tr = cap._transfer  # private: the test's own _ManualTransfer, read back to see who waited
    exp: dict = {}
    run_step(cap, generator, ["a", "b"], [0, 0], exp)  # step 0
    run_step(cap, generator, ["b"], [1], exp)  # step 1
    assert cap.pending_steps == 2 and tr.waited == []  # nothing scattered, nobody waited
    cap.poll()
    assert cap.pending_steps == 2
    tr.handles[0].done = True
    cap.poll()  # the completed copy is scattered, in order
    assert cap.pending_steps == 1 and tr.waited == []
    # a third step reuses step 0's staging slot (double buffering): no wait, step 0 is done
    run_step(cap, generator, ["a"], [1], exp)  # step 2
    assert tr.waited == []
    # a fourth step reuses step 1's slot, whose copy is still in flight: back-pressure waits
    run_step(cap, generator, ["b"], [2], exp)  # step 3
    assert tr.waited == [1]
    # finish waits only for the copies of steps that carried the request (a: steps 0 and 2)
    a = cap.finish("a")
    assert tr.waited == [1, 2]
    np.testing.assert_array_equal(a.ids, expected_array(exp["a"], 2))
    b = cap.finish("b")
    assert tr.waited == [1, 2, 3]
    np.testing.assert_array_equal(b.ids, expected_array(exp["b"], 3))


def test_abort_with_copy_in_flight_keeps_pages_until_it_lands(generator):
    cap = _ManualCapturer(L, N, K, device="cpu", num_experts=E, page_size=4, slab_pages=8)
    tr = cap._transfer  # private: the test's own _ManualTransfer, read back to see who waited
    exp: dict = {}
    run_step(cap, generator, ["a"] * 4, [0, 1, 2, 3], exp)  # step 0, in flight
    used = cap.memory_stats()["used_page_bytes"]
    cap.abort("a")  # never waits
    assert tr.waited == [] and cap.memory_stats()["used_page_bytes"] == used  # still targeted
    exp2: dict = {}
    run_step(cap, generator, ["a"] * 4, [0, 1, 2, 3], exp2)  # a new request reusing the id
    assert cap.memory_stats()["used_page_bytes"] == 2 * used  # got other pages
    tr.handles[0].done = True
    cap.poll()
    assert cap.memory_stats()["used_page_bytes"] == used  # the aborted one's page came back
    t = cap.finish("a")
    np.testing.assert_array_equal(t.ids, expected_array(exp2["a"], 4))


# ----------------------------------------------------------------------------- memory


def test_host_bytes_and_bound(generator):
    row = L * K * 2
    staging = 2 * N * row  # two staging buffers of [N, L, K] int16
    cap = make(
        page_size=4, slab_pages=2, max_host_bytes=staging + 2 * 2 * 4 * row + 8 * 8
    )  # + 8 table entries
    assert cap.host_bytes() == staging
    exp: dict = {}
    run_step(cap, generator, ["a"] * 9, list(range(9)), exp)  # 3 pages -> 2 slabs of 2 pages
    assert cap.host_bytes() == staging + 2 * 2 * 4 * row + 3 * 8  # a's page table: 3 entries of 8 bytes
    assert cap.memory_stats()["used_page_bytes"] == 3 * 4 * row
    assert cap.memory_stats()["page_table_bytes"] == 3 * 8
    with pytest.raises(CaptureMemoryError, match="max_host_bytes"):
        run_step(cap, generator, ["b"] * 8, list(range(8)), {})  # 2 more pages: only 1 free
    assert cap.live_requests == ["a"]  # nothing of the failed step was recorded
    run_step(cap, generator, ["a"], [9], exp)  # position 9 is on a's page 2: no new page needed
    np.testing.assert_array_equal(cap.finish("a").ids, expected_array(exp["a"], 10))
    assert cap.memory_stats()["page_table_bytes"] == 0  # finish gives the table back
    with pytest.raises(CaptureMemoryError, match="staging"):
        make(max_host_bytes=100)


@pytest.mark.parametrize(
    "reqs, poss",
    [
        (["b"], [2**35]),  # a new request's table of 2**33 entries (64 GiB): was allocated unbounded
        (["b", "c"], [0, 2**40]),  # after a page was taken for b: the rollback returns it
        (["a", "a"], [5, 2**35]),  # an existing request whose table grew first (page 1): shrunk back
    ],
)
def test_page_table_counts_against_max_host_bytes(reqs, poss):
    # with a bound, a position far past any real context is a CaptureMemoryError before its page table
    # is allocated, naming the position and the bound; the step is rolled back, table bytes included
    cap = make(page_size=4, slab_pages=4, max_host_bytes=2 * N * L * K * 2 + 4 * 4 * L * K * 2 + 4096)
    cap.end_step(["a"], [0])
    before = _state(cap)
    for _ in range(2):  # nothing leaks, call after call
        with pytest.raises(CaptureMemoryError, match=rf"position {poss[-1]} of request .*max_host_bytes="):
            cap.end_step(reqs, poss)
        assert _state(cap) == before
    cap.end_step(["a"], [100])  # a real position still fits the bound
    assert cap.finish("a").num_tokens == 101


# ----------------------------------------------------------------------------- checks


def test_rejections():
    cap = make()
    with pytest.raises(ValueError, match="layer"):
        cap.layer_buffer(L)
    assert cap.layer_buffer(2).shape == (N, K) and cap.layer_buffer(2).is_contiguous()
    assert cap.layer_buffer(2).dtype == torch.int16
    with pytest.raises(ValueError, match="token_positions"):
        cap.end_step(["a", "b"], [0])
    with pytest.raises(ValueError, match="token_positions"):
        cap.end_step(["a"], [-1])
    with pytest.raises(ValueError, match="token_positions"):
        cap.end_step(["a"], [0.5])
    with pytest.raises(ValueError, match="max_num_tokens"):
        cap.end_step(["a"] * (N + 1), list(range(N + 1)))
    with pytest.raises(ValueError, match="max_num_tokens"):
        cap.end_step(["a"] * 2, [0, 1], dp_span=(N - 1, 2))
    with pytest.raises(ValueError, match="dp_span"):
        cap.end_step(["a"] * 2, [0, 1], dp_span=(0, 3))
    with pytest.raises(ValueError, match="top_k"):
        make(top_k=E + 1)
    with pytest.raises(ValueError, match="layer_ids"):
        make(layer_ids=[0, 1])
    with pytest.raises(ValueError, match="device"):
        make(device="meta")
    assert cap.live_requests == []
    cap.end_step([None, None], [0, 0])  # a step of padding only records nothing
    assert cap.pending_steps == 0 and cap.live_requests == []


def test_positions_as_tensor_and_numpy(generator):
    cap = make()
    exp: dict = {}
    run_step(cap, generator, ["a", "a"], torch.tensor([0, 1]), exp)
    run_step(cap, generator, ["a"], np.array([2], dtype=np.int32), exp)
    np.testing.assert_array_equal(cap.finish("a").ids, expected_array(exp["a"], 3))


def test_recompute_after_preemption_overwrites(generator):
    # vLLM-style recompute preemption without abort: the request's positions are computed again
    # later (same id); the trace holds the latest routing of every position, nothing missing
    cap = make()
    first: dict = {}
    run_step(cap, generator, ["r"] * 4, [0, 1, 2, 3], first)
    again: dict = {}
    run_step(cap, generator, ["r"] * 6, [0, 1, 2, 3, 4, 5], again)
    t = cap.finish("r")
    np.testing.assert_array_equal(t.ids, expected_array(again["r"], 6))
    assert not t.missing_mask().any()


def test_all_zero_kernel_output_is_rejected_at_finish():
    # a fused kernel that "captures" zeros (vLLM #44116) gives rows of duplicate ids: finish refuses
    # them loudly instead of returning a plausible-looking trace, and keeps the request (nothing lost)
    cap = make()
    cap.buffer.zero_()
    cap.end_step(["r", "r"], [0, 1])
    used = cap.memory_stats()["used_page_bytes"]
    with pytest.raises(ValueError, match="request 'r'.*distinct expert ids"):
        cap.finish("r")
    assert cap.live_requests == ["r"] and cap.memory_stats()["used_page_bytes"] == used
    cap.abort("r")
    assert cap.memory_stats()["used_page_bytes"] == 0


# ----------------------------------------------------------------------------- the CUDA transfer, faked


class _FakeCuda:
    """Just enough of torch.cuda for CudaTransfer on CPU tensors, logging stream/event calls."""

    def __init__(self):
        self.log = []
        self.current = self.Stream("main", self)

    class Stream:
        def __init__(self, name="side", owner=None):
            self.name, self.owner = name, owner

        def wait_event(self, ev):
            self.owner.log.append(("wait", self.name, ev.name))

    class Event:
        count = 0

        def __init__(self):
            _FakeCuda.Event.count += 1
            self.name, self.owner, self.done = f"ev{_FakeCuda.Event.count}", None, True

        def record(self, stream):
            stream.owner.log.append(("record", self.name, stream.name))

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True


def _fake_cuda_capturer(monkeypatch, **kw):
    import contextlib
    import types

    import replaymoe.record.capture as capmod
    import replaymoe.record.transfer as transfer_mod

    fake = _FakeCuda()

    def stream_ctx(s):
        @contextlib.contextmanager
        def cm():
            fake.log.append(("enter", s.name))
            yield
            fake.log.append(("exit", s.name))

        return cm()

    cuda = types.SimpleNamespace(
        Stream=lambda device=None: _FakeCuda.Stream("side", fake),
        Event=_FakeCuda.Event,
        current_stream=lambda device=None: fake.current,
        stream=stream_ctx,
        is_available=lambda: False,
    )

    class TorchProxy:
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = TorchProxy()
    proxy.cuda = cuda
    proxy.empty = lambda *a, pin_memory=False, **k: torch.empty(*a, **k)
    monkeypatch.setattr(capmod, "torch", proxy)
    monkeypatch.setattr(transfer_mod, "torch", proxy)
    monkeypatch.setattr(
        RoutedExpertsCapturer,
        "_make_transfer",
        lambda self: transfer_mod.CudaTransfer(self.buffer, self.num_buffers),
    )
    return make(**kw), fake


def test_cuda_transfer_path_on_cpu(generator, monkeypatch):
    # the real CudaTransfer (gather on the step's stream, event, side-stream copy, event) with a fake
    # torch.cuda: the protocol gives the same traces, and the stream/event calls come in safe order
    cap, fake = _fake_cuda_capturer(monkeypatch, num_buffers=2)
    exp: dict = {}
    run_step(cap, generator, ["a", "b", None], [0, 0, 0], exp)
    run_step(cap, generator, ["a", "x", "x", "b"], [1, 7, 8, 1], exp, rows=6, dp_span=(2, 4))
    run_step(cap, generator, ["b"], [2], exp)
    first = fake.log[:5]
    gathered = first[0][1]
    assert first[0] == ("record", gathered, "main")  # after the gather, on the step's stream
    assert first[1] == ("wait", "side", gathered)  # the side stream waits for it ...
    assert first[2] == ("enter", "side") and first[3] == ("exit", "side")  # ... copies under it ...
    assert first[4][0] == "record" and first[4][2] == "side"  # ... and marks completion there
    assert all(entry[1] != "main" for entry in fake.log if entry[0] == "wait")  # main never waits
    for r, n in (("a", 2), ("b", 3), ("x", 9)):
        np.testing.assert_array_equal(cap.finish(r).ids, expected_array(exp[r], n))
    # staging: num_buffers slots of N rows in pinned memory (here plain CPU) and on the device
    assert cap.memory_stats()["staging_bytes"] == 2 * N * L * K * 2


# ----------------------------------------------------------------------------- boundary: nothing lost


def _fill(cap, rows=N):
    """Valid ids in the buffer's first ``rows`` rows: row r of layer l holds (r + l) % E, (r + l + 1) % E."""
    for layer in range(L):
        for r in range(rows):
            cap.buffer[layer, r] = torch.tensor([(r + layer) % E, (r + layer + 1) % E], dtype=torch.int16)


def _state(cap):
    """What a failed call must leave as it was (all through the public surface)."""
    return sorted(cap.live_requests, key=repr), cap.memory_stats(), cap.pending_steps


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(layer_ids=[3, 3, 5]), "layer_ids"),  # repeated: every finish failed after freeing the request
        (dict(layer_ids=[-1, 0, 1]), "layer_ids"),  # negative: the same loss at finish
        (dict(layer_ids=[0.7, 1.9, 2.2]), "layer_ids"),  # floats: int() truncated them
        (dict(layer_ids=["1", "3", "5"]), "layer_ids"),  # strings: int() parsed them
        (dict(layer_ids=[True, False, 2]), "layer_ids"),  # bools: taken as 1 and 0
        (dict(layer_ids=5), "layer_ids"),  # not a sequence: a bare TypeError from len()
        (dict(model_id=123), "model_id"),  # not a str: every finish failed after freeing the request
        (dict(num_experts=0), "num_experts"),  # was reported as a top_k error (checked before num_experts)
        (dict(num_experts="8"), "num_experts"),  # a str: a bare TypeError from a comparison
        (dict(num_experts=8.0), "num_experts"),  # a float: refused before too (kept by the reordered checks)
        (dict(clear_after_copy="no"), "clear_after_copy"),  # bool("no") is True
        (dict(clear_after_copy=1), "clear_after_copy"),  # an int taken as a bool
    ],
)
def test_constructor_checks_what_the_trace_checks(kw, name):
    with pytest.raises(ValueError, match=rf"^Invalid (type|value) of {name}: expected "):
        make(**kw)


def test_constructor_takes_numpy_ints_as_the_trace_does():
    cap = make(num_experts=np.int64(E), layer_ids=np.array([1, 3, 5]))
    cap.end_step(["r"], [0])
    t = cap.finish("r")
    assert t.num_experts == E and type(t.num_experts) is int and t.layer_ids == (1, 3, 5)


@pytest.mark.parametrize(
    "bad_id, match",
    [
        (E, r"got 8 at \[token, layer, k\] = \[1, 2, 1\]"),  # one past the last expert
        (-2, r"got -2 at \[token, layer, k\] = \[1, 2, 1\]"),  # below the -1 of missing rows
    ],
)
def test_failed_finish_keeps_the_request(bad_id, match):
    # the trace is built before the request is dropped: an invalid id loses nothing, the error names
    # the request, the position and the layer, and the caller can still finish a shorter trace or abort
    cap = make(page_size=4, slab_pages=4)
    _fill(cap)
    cap.buffer[2, 1, 1] = bad_id  # position 1 (row 1), MoE layer 2, slot 1
    cap.end_step(["r", "r", "s"], [0, 1, 0])
    before = _state(cap)
    for _ in range(2):  # and again: the first failure changed nothing
        with pytest.raises(ValueError, match=r"request 'r'.*token = position.*" + match):
            cap.finish("r")
        assert _state(cap) == before
    t = cap.finish("r", num_positions=1)  # the positions before the bad one
    np.testing.assert_array_equal(t.ids[0, :, 0], [0, 1, 2])
    cap.abort("s")
    assert cap.live_requests == [] and cap.memory_stats()["used_page_bytes"] == 0


@pytest.mark.parametrize(
    "reqs, poss, got",
    [
        (["a", "a"], [5, 5], "request 'a' at position 5 at indices 0 and 1"),  # adjacent rows
        (["a", "b", "a"], [0, 0, 0], "request 'a' at position 0 at indices 0 and 2"),  # another id between
        (["b", "c", "c", "b"], [9, 1, 2, 9], "request 'b' at position 9 at indices 0 and 3"),  # a new page
        (["a", None, "a"], [3, 3, 3], "request 'a' at position 3 at indices 0 and 2"),  # a recorded position
        ([7, 7], np.array([1, 1]), "request 7 at position 1 at indices 0 and 1"),  # numpy positions, int ids
    ],
)
def test_one_position_twice_in_a_step_records_nothing(reqs, poss, got):
    # the second row silently overwrote the first; now one error naming both rows, the step rolled back
    # (pages it took returned, the earlier step's rows of the same position untouched)
    cap = make(page_size=4, slab_pages=1)
    _fill(cap)
    cap.end_step(["a"], [3])  # a holds position 3 from an earlier step: row 0's ids
    before = _state(cap)
    with pytest.raises(ValueError, match=r"^Invalid value of token_positions: .*, got " + got + "$"):
        cap.end_step(reqs, poss)
    assert _state(cap) == before
    cap.end_step(["b", "b"], [0, 1])  # the capturer goes on as if the bad step never came
    np.testing.assert_array_equal(cap.finish("a").ids[3, :, 0], [0, 1, 2])  # row 0 of the first step
    np.testing.assert_array_equal(cap.finish("b").ids[:, 0, 0], [0, 1])
    assert cap.live_requests == [] and cap.memory_stats()["used_page_bytes"] == 0


@pytest.mark.parametrize(
    "reqs, poss",
    [
        (["b"], [2**62]),  # past the longest trace the host can address: was a bare MemoryError('')
        (["b"], np.array([2**63 + 5], dtype=np.uint64)),  # past int64 too
        (["b", "c"], [0, 2**62]),  # after a page was taken for b: the rollback returns it
        (["a", "a"], [9, 2**62]),  # an existing request whose page table grew first
    ],
)
def test_absurd_position_is_named_and_takes_no_page(reqs, poss):
    cap = make(page_size=4, slab_pages=4)
    cap.end_step(["a"], [0])
    before = _state(cap)
    for _ in range(2):  # no page leaks, call after call
        with pytest.raises(
            ValueError, match=r"^Invalid value of token_positions: expected positions in \[0, "
        ):
            cap.end_step(reqs, poss)
        assert _state(cap) == before
    assert cap.finish("a").num_tokens == 1


def test_page_table_the_host_cannot_allocate_is_named_and_rolled_back():
    # below the addressable limit, but a page table of 2**55 entries: a CaptureMemoryError naming the
    # position, and the page taken for the step's first token comes back
    cap = make(page_size=4, slab_pages=4)
    cap.end_step(["a"], [0])
    before = _state(cap)
    with pytest.raises(
        CaptureMemoryError, match=rf"request 'b' up to position {2**57} \(index 1 of token_positions\)"
    ):
        cap.end_step(["c", "b"], [0, 2**57])
    assert _state(cap) == before


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda c: c.end_step([["x"]], [0]), r"token_requests\[0\]"),  # unhashable id: a bare TypeError
        (lambda c: c.end_step(["r", {"x": 1}], [1, 0]), r"token_requests\[1\]"),  # after r was touched
        (lambda c: c.end_step(5, [0]), "token_requests"),  # not a sequence: len() of an int
        (lambda c: c.end_step("ab", [0, 1]), "token_requests"),  # a str: its letters taken as two ids
        (lambda c: c.end_step({"r"}, [0]), "token_requests"),  # a set: no row order
        (lambda c: c.end_step(torch.tensor([1, 2]), [0, 1]), "token_requests"),  # 0-d tensors: by identity
        (lambda c: c.end_step(["r"], [0], dp_span=3), "dp_span"),  # len() of an int
        (lambda c: c.end_step(["r"], [0], dp_span="01"), "dp_span"),  # a str of two characters
        (lambda c: c.finish(["r"]), "request_id"),  # unhashable: a bare TypeError
        (lambda c: c.abort(["r"]), "request_id"),  # the same
        (lambda c: c.finish("r", num_positions=2**62), "num_positions"),  # past the longest trace
    ],
)
def test_bad_arguments_are_named_and_change_nothing(call, name):
    cap = make()
    cap.end_step(["r"], [0])
    before = _state(cap)
    with pytest.raises(ValueError, match=rf"^Invalid (type|value) of {name}: expected "):
        call(cap)
    assert _state(cap) == before
    assert cap.finish("r").num_tokens == 1

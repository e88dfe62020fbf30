"""The device-side checks of caller ids on the GPU: fused_moe's ``topk_ids`` in every kernel family
that reads them first (bf16 direct and tile modes, fp8 swapped and tile, the training forward) and
route's ``replay_ids`` in the routing kernel (and its backward, which must not read out of the row),
eager, CUDA graphs and ``torch.compile``, without a host sync.

A bad id writes the mailbox during the call; the ValueError comes at the next checked call on the
device, or at ``replaymoe.moe.raise_id_errors()``. The kernels' arithmetic under the interpreter:
``tests/test_id_check.py``.

Run with ``PYTHONPATH=src python3 -m pytest -m gpu tests/test_id_check_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from replaymoe.moe import fused_moe, raise_id_errors
from replaymoe.routing import _id_mailbox

pytestmark = pytest.mark.gpu

E, K = 16, 4
_RANGE = r"topk_ids: expected expert ids in \[0, 16\) \(or -1: a slot with no expert\), got "
_DISTINCT = r"topk_ids: expected distinct expert ids within each row \(-1 aside\), got "


def _weights(H, I, fp8):  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
    if not fp8:
        return w13, w2, {}
    from replaymoe.moe.quant import quantize_fp8_block

    q13, s13 = quantize_fp8_block(w13)
    q2, s2 = quantize_fp8_block(w2)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2)


def _inputs(T, H, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    ids = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
    wts = torch.rand(T, K, generator=g, device="cuda")
    return x, ids, wts


# (T, fp8, grad): the kernel that checks is the layout's scatter in tile mode, GEMM1's program 0 in
# direct mode (bf16, or the swapped fp8 GEMM1)
PATHS = [
    pytest.param(1, False, False, id="bf16-decode"),  # direct mode, T = 1
    pytest.param(6, False, False, id="bf16-direct"),  # several rows, merged slots
    pytest.param(700, False, False, id="bf16-tiles"),  # the layout, several chunks
    pytest.param(2, True, False, id="fp8-decode"),  # swapped fp8 GEMM1, direct
    pytest.param(700, True, False, id="fp8-tiles"),  # the layout (with x's quantization)
    pytest.param(300, False, True, id="train"),  # the training forward's layout
]


@pytest.fixture(autouse=True)
def _clean_mailbox():
    raise_id_errors_quietly()
    yield
    raise_id_errors_quietly()


def raise_id_errors_quietly():
    try:
        raise_id_errors()
    except ValueError:
        pass


def _call(x, w13, w2, ids, wts, grad=False, **kw):
    if grad:
        x = x.detach().requires_grad_()
    return fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, **kw)


@pytest.mark.parametrize("T,fp8,grad", PATHS)
@pytest.mark.parametrize(
    "bad,match",
    [
        ((0, 1, 10**6), _RANGE + r"1000000 at row 0, slot 1 "),  # (row, slot, value) written
        ((0, 2, -3), _RANGE + r"-3 at row 0, slot 2 "),
        ((0, 3, 16), _RANGE + r"16 at row 0, slot 3 "),  # one past the end
        ("dup", _DISTINCT + r"id \d+ again at row 0, slot 1 "),  # slot 1 repeats slot 0
    ],
    ids=["high", "negative", "E", "duplicate"],
)
def test_bad_ids_raise_at_the_next_call(T, fp8, grad, bad, match):
    H, I = 256, 256  # noqa: E741
    w13, w2, scales = _weights(H, I, fp8)
    x, ids, wts = _inputs(T, H)
    bad_ids = ids.clone()
    if bad == "dup":
        bad_ids[0, 1] = bad_ids[0, 0]
    else:
        bad_ids[bad[0], bad[1]] = bad[2]
    _call(x, w13, w2, bad_ids, wts, grad, **scales)  # no error here: nothing waits for the GPU
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=match + "of an earlier fused_moe call on cuda:0"):
        _call(x, w13, w2, ids, wts, grad, **scales)  # the next call reads the mailbox first
    good = _call(x, w13, w2, ids, wts, grad, **scales)  # read once: this call runs
    assert torch.equal(good, _call(x, w13, w2, ids, wts, grad, check_ids=False, **scales))
    _call(x, w13, w2, bad_ids, wts, grad, **scales)
    with pytest.raises(ValueError, match=match):
        raise_id_errors()  # waits for the device, raises at once
    raise_id_errors()  # nothing left


@pytest.mark.parametrize("T,fp8,grad", PATHS)
def test_valid_ids_no_sync_no_error_same_bits(T, fp8, grad):
    # ids from a copy (not route's marked output): checked on the device; -1 slots are legal
    H, I = 256, 256  # noqa: E741
    w13, w2, scales = _weights(H, I, fp8)
    x, ids, wts = _inputs(T, H, seed=3)
    ids[::5, 1] = -1
    ref = _call(x, w13, w2, ids, wts, grad, check_ids=False, **scales)
    _call(x, w13, w2, ids, wts, grad, **scales)  # compile the checking variants first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        out = _call(x, w13, w2, ids, wts, grad, **scales)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, ref)
    raise_id_errors()


def test_checked_inside_a_cuda_graph():
    # a captured call keeps the check: each replay reads the ids in the static buffer
    H, I = 256, 256  # noqa: E741
    w13, w2, _ = _weights(H, I, False)
    x, ids, wts = _inputs(2, H)
    static = ids.clone()
    fused_moe(x, w13, w2, topk_ids=static, topk_weights=wts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_ids=static, topk_weights=wts)
    graph.replay()
    raise_id_errors()  # valid ids: nothing
    ref = out.clone()
    static[1, 2] = 99
    graph.replay()
    with pytest.raises(ValueError, match=_RANGE + r"99 at row 1, slot 2 "):
        raise_id_errors()
    static.copy_(ids)
    graph.replay()
    raise_id_errors()
    assert torch.equal(out, ref)


def test_checked_under_torch_compile():
    torch._dynamo.reset()
    H, I = 256, 256  # noqa: E741
    w13, w2, _ = _weights(H, I, False)
    x, ids, wts = _inputs(4, H)

    @torch.compile(fullgraph=True)
    def layer(x, ids, wts):
        return fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts) * 2

    ref = layer(x, ids, wts)
    raise_id_errors()
    bad = ids.clone()
    bad[3, 0] = bad[3, 3]
    layer(x, bad, wts)
    with pytest.raises(ValueError, match=_DISTINCT + r"id \d+ again at row 3, slot 3 "):
        raise_id_errors()
    assert torch.equal(layer(x, ids, wts), ref)
    torch._dynamo.reset()


def test_route_ids_on_the_device_and_host_paths():
    # the Triton experts check every caller's ids on the device, route()'s own output too (reading the
    # mark would cost the host more than the check costs the device); the torch backend, whose check
    # syncs, skips ids that route() made and nobody modified since (the mark)
    from replaymoe import route
    from replaymoe.routing._checks import topk_ids_for_kernels

    ids, wts = route(torch.randn(3, E, device="cuda"), K)
    assert topk_ids_for_kernels(ids, E, True, on_device=True)[1] == E
    assert topk_ids_for_kernels(ids.clone(), E, True, on_device=True)[1] == E
    assert topk_ids_for_kernels(ids, E, False, on_device=True)[1] == 0  # check_ids=False
    ids.data[0, 0] = E + 5  # bypasses the version counter: the mark stays, so the host path trusts it
    assert topk_ids_for_kernels(ids, E, True, on_device=False)[1] == 0
    ids[0, 0] = E + 5  # an in-place write moves the version counter: checked on the host again
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 16\)"):
        topk_ids_for_kernels(ids, E, True, on_device=False)
    assert _id_mailbox.mailbox(0).is_pinned()


# ---------------------------------------------------------------- route's replay_ids (the routing kernel)

_R_RANGE = r"replay_ids: expected expert ids in \[0, 16\) \(or a row of all -1\), got "


@pytest.mark.parametrize(
    "bad,match",
    [
        ((1, 2, 99), _R_RANGE + r"99 at row 1, slot 2 of an earlier route call"),
        ((1, 2, -1), r"replay_ids: expected each row either all -1 .* got -1 at row 1, slot 2 "),
        ("dup", r"replay_ids: expected distinct expert ids .* got id \d+ again at row 1, slot 1 "),
    ],
    ids=["high", "mixed", "duplicate"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_bad_replay_ids_raise_at_the_next_route(bad, match, grad):
    from replaymoe import route

    logits = torch.randn(5, E, device="cuda", requires_grad=grad)
    _, ids, _ = _inputs(5, 8)
    replay = ids.clone()
    if bad == "dup":
        replay[1, 1] = replay[1, 0]
    else:
        replay[bad[0], bad[1]] = bad[2]
    out = route(logits, K, replay_ids=replay)  # no error here: nothing waits for the GPU
    if grad:
        out.topk_weights.sum().backward()  # bad ids read nothing out of the row in the backward either
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=match):
        route(logits, K, replay_ids=ids)
    good = route(logits, K, replay_ids=ids)
    assert torch.equal(good.topk_ids, ids)
    # through fused_moe (routing inside), too
    x, _, _ = _inputs(5, 256)
    w13, w2, _ = _weights(256, 256, False)
    fused_moe(x, w13, w2, router_logits=logits.detach(), top_k=K, replay_ids=replay)
    with pytest.raises(ValueError, match=match.replace("route call", "(route|fused_moe) call")):
        raise_id_errors()


def test_replay_ids_on_the_torch_backend_raise_at_once():
    # the torch path checks on the host, at the call
    from replaymoe import route

    logits = torch.randn(3, E, device="cuda")
    replay = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 99], [7, 8, 9, 10]], device="cuda")
    with pytest.raises(ValueError, match=r"replay_ids: expected expert ids in \[0, 16\).*row 1 = "):
        route(logits, K, replay_ids=replay, backend="torch")
    raise_id_errors()


def test_valid_replay_ids_no_host_sync():
    from replaymoe import route

    logits = torch.randn(4, E, device="cuda")
    _, ids, _ = _inputs(4, 8)
    ids[2] = -1  # a native row
    ref = route(logits, K, replay_ids=ids, check_replay=False)
    route(logits, K, replay_ids=ids)  # compile the checking variant first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = route(logits, K, replay_ids=ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.topk_ids, ref.topk_ids) and torch.equal(out.topk_weights, ref.topk_weights)
    raise_id_errors()


@pytest.mark.parametrize("bad", [float("nan"), -0.5], ids=["nan", "negative"])
def test_bad_replay_weights_raise_at_the_next_route_without_a_host_sync(bad):
    # full recall: route's replay_weights are checked by the routing kernel with the ids, into the
    # mailbox (no host sync at the call); a native row's weights are not read
    from replaymoe import route

    logits = torch.randn(4, E, device="cuda")
    _, ids, _ = _inputs(4, 8)
    ids[2] = -1  # a native row: its NaN weights are fine
    weights = torch.full((4, K), 0.25, device="cuda")
    weights[2] = float("nan")
    route(logits, K, replay_ids=ids, replay_weights=weights)  # compile the checking variant first
    raise_id_errors()
    weights[1, 3] = bad
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = route(logits, K, replay_ids=ids, replay_weights=weights)  # no error here
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the replayed row took the given weights, bit for bit (NaN included: compared as bits)
    assert torch.equal(out.topk_weights[1].view(torch.int32), weights[1].view(torch.int32))
    with pytest.raises(
        ValueError, match=r"replay_weights: expected finite weights >= 0 .* at row 1, slot 3 "
    ):
        raise_id_errors()
    # the torch backend checks on the host, at the call
    with pytest.raises(ValueError, match=r"replay_weights: expected finite weights >= 0 .*row 1 = "):
        route(logits, K, replay_ids=ids, replay_weights=weights, backend="torch")

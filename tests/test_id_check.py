"""The device-side checks of caller ids (fused_moe's topk_ids, route's replay_ids), their kernels under
Triton's interpreter (CPU).

On CUDA the Triton experts check caller ``topk_ids`` inside the kernel that reads them first: the
layout's scatter (tile mode) or GEMM1's program 0 (direct mode, both GEMM families); the routing kernel
checks ``replay_ids`` on the tile it loads. Each writes the first bad slot into the pinned error
mailbox (``replaymoe.routing._id_mailbox``). On the CPU the public paths check on the host instead, so
these tests drive the launchers themselves with the check on and read the mailbox as the host does.
The device paths on a GPU: ``tests/test_id_check_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from replaymoe.moe._forward import ExpertsVariant, launch_experts
from replaymoe.moe.configs import MoEConfig
from replaymoe.routing import _id_mailbox

pytestmark = pytest.mark.interpret

# T = 3 tokens, K = 3 slots, E = 8 experts of which this rank holds [2, 5)
_DIRECT = MoEConfig(direct=True, block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1, block_n2=16,
                    block_k2=16, warps2=4, stages2=1)  # fmt: skip
_TILES = MoEConfig(direct=False, block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1, block_n2=16,
                   block_k2=16, warps2=4, stages2=1)  # fmt: skip
MODES = [pytest.param(_DIRECT, id="direct"), pytest.param(_TILES, id="tiles")]

_RANGE = r"Invalid value of topk_ids: expected expert ids in \[0, 8\) \(or -1: a slot with no expert\), got "
_DISTINCT = r"Invalid value of topk_ids: expected distinct expert ids within each row \(-1 aside\), got "
_CLAMPED = _RANGE + r">= 2147483647 at row 1, slot 1 "
BAD = [
    # (rows, message): the mailbox names the first bad slot (smallest row, range before duplicates)
    pytest.param([[0, 1, 2], [2, 10**6, 3], [4, 5, 6]], _RANGE + r"1000000 at row 1, slot 1 ", id="high"),
    pytest.param([[0, 1, 2], [2, 3, 4], [5, -3, 6]], _RANGE + r"-3 at row 2, slot 1 ", id="negative"),
    # one past the end
    pytest.param([[0, 1, 8], [2, 3, 4], [5, 6, 7]], _RANGE + r"8 at row 0, slot 2 ", id="E"),
    pytest.param([[0, 1, 2], [6, 3, 6], [4, 5, 7]], _DISTINCT + r"id 6 again at row 1, slot 2 ", id="dup"),
    # several -1 in a row are no duplicate (row 0); row 2 repeats 3 two slots apart
    pytest.param([[-1, -1, 0], [7, -1, 1], [3, 2, 3]], _DISTINCT + r"id 3 again at row 2, slot 2 ", id="far"),
    # int64 ids past int32: clamped in the message, still out of range (the kernels read int32)
    pytest.param([[0, 1, 2], [2, 2**32 + 3, 4], [5, 6, 7]], _CLAMPED, id="i64"),
]


def _run(rows, config, id_dtype=torch.int32, id_bound=8):
    g = torch.Generator().manual_seed(0)
    T, H, I, E_local = 3, 32, 16, 3  # noqa: E741
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E_local, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E_local, H, I, generator=g) / I**0.5
    ids = torch.tensor(rows, dtype=id_dtype)
    wts = torch.rand(T, 3, generator=g)
    out = torch.empty(T, H)
    launch_experts(x, w13, w2, ids, wts, None, None, 2, out, config, v=ExpertsVariant(id_bound=id_bound))
    return out


@pytest.fixture(autouse=True)
def _empty_mailbox():
    box = _id_mailbox.mailbox(0)
    box.zero_()
    yield
    box.zero_()


@pytest.mark.parametrize("config", MODES)
@pytest.mark.parametrize("rows,match", BAD)
def test_bad_ids_leave_their_slot_in_the_mailbox(rows, match, config):
    _run(rows, config, torch.int64)
    with pytest.raises(ValueError, match=match + r"of an earlier fused_moe call"):
        _id_mailbox._raise(0, synced=True)
    assert not _id_mailbox.mailbox(0).any()  # read once: the next call starts clean


@pytest.mark.parametrize("config", MODES)
@pytest.mark.parametrize(
    "rows",
    [
        [[0, 1, 2], [3, 4, 7], [7, 6, 5]],  # every id in [0, E), some outside the slice [2, 5)
        [[-1, 3, -1], [7, -1, 2], [-1, -1, -1]],  # -1 slots anywhere, a whole -1 row (EP padding)
    ],
)
def test_valid_ids_leave_the_mailbox_empty_and_the_output_unchanged(rows, config):
    out = _run(rows, config)
    assert not _id_mailbox.mailbox(0).any()
    assert torch.equal(out, _run(rows, config, id_bound=0))  # the check changes no value


@pytest.mark.parametrize("config", MODES)
def test_the_bound_is_the_whole_model(config):
    # id 7 lies outside this rank's slice [2, 5) but inside the model's 8 experts: valid; with a bound
    # of 5 (no num_experts: offset + E_local) it is out of range
    _run([[0, 1, 2], [3, 4, 7], [5, 6, 0]], config, id_bound=8)
    assert not _id_mailbox.mailbox(0).any()
    _run([[0, 1, 2], [3, 4, 7], [5, 6, 0]], config, id_bound=5)
    with pytest.raises(ValueError, match=r"expected expert ids in \[0, 5\).*got 7 at row 1, slot 2"):
        _id_mailbox._raise(0, synced=True)


# ---------------------------------------------------------------- route's replay_ids (the routing kernel)

_R_RANGE = r"Invalid value of replay_ids: expected expert ids in \[0, 8\) \(or a row of all -1\), got "
_R_DISTINCT = r"Invalid value of replay_ids: expected distinct expert ids within each row \(-1 aside\), got "
_R_MIXED = r"replay_ids: expected each row either all -1 \(route natively\) or all valid ids, "
BAD_REPLAY = [
    pytest.param([[0, 1, 2], [2, 10**6, 3], [4, 5, 6]], _R_RANGE + r"1000000 at row 1, slot 1 ", id="high"),
    pytest.param([[0, 1, 2], [2, 3, 4], [5, -3, 6]], _R_RANGE + r"-3 at row 2, slot 1 ", id="negative"),
    pytest.param([[0, 1, 8], [2, 3, 4], [5, 6, 7]], _R_RANGE + r"8 at row 0, slot 2 ", id="E"),
    pytest.param([[0, 1, 2], [6, 3, 6], [4, 5, 7]], _R_DISTINCT + r"id 6 again at row 1, slot 2 ", id="dup"),
    # a -1 beside ids (rows of all -1 are fine: row 0)
    pytest.param([[-1, -1, -1], [7, -1, 1], [3, 2, 4]], _R_MIXED + r"got -1 at row 1, slot 1 ", id="mixed"),
]


def _route_launch(rows, check=True):
    from replaymoe.routing._triton import _launch as route_launch

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    replay = torch.tensor(rows, dtype=torch.int64)
    return route_launch(logits, None, None, replay, 3, 0, 1, 1, 1.0, check)


@pytest.mark.parametrize("rows,match", BAD_REPLAY)
def test_bad_replay_ids_leave_their_slot_in_the_mailbox(rows, match):
    _route_launch(rows)
    with pytest.raises(ValueError, match=match + r"of an earlier route call"):
        _id_mailbox._raise(0, synced=True)
    assert not _id_mailbox.mailbox(0).any()


@pytest.mark.parametrize(
    "rows",
    [
        [[0, 1, 2], [3, 4, 7], [7, 6, 5]],  # K distinct ids per row
        [[-1, -1, -1], [7, 0, 2], [-1, -1, -1]],  # whole -1 rows route natively
    ],
)
def test_valid_replay_ids_leave_the_mailbox_empty(rows):
    ids, weights = _route_launch(rows)
    assert not _id_mailbox.mailbox(0).any()
    ref_ids, ref_weights = _route_launch(rows, check=False)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)  # the check changes nothing


def test_checked_variant_one_object_eagerly_and_traced_under_compile(recwarn):
    # fused_moe's variant with the device check: one object per expert count eagerly; under
    # torch.compile a fresh one that dynamo traces without a cache warning
    from replaymoe.moe import _checked_standard

    assert _checked_standard(8) is _checked_standard(8) and _checked_standard(8).id_bound == 8
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + _checked_standard(16).id_bound, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(2)), torch.full((2,), 16.0))
    assert not [w for w in recwarn if "lru_cache" in str(w.message)]
    torch._dynamo.reset()


# ---------------------------------------------------------------- route's replay_weights (full recall)

_W_NONNEG = r"Invalid value of replay_weights: expected finite weights >= 0 in every replayed row .*, got "
_W_FINITE = r"Invalid value of replay_weights: expected finite weights in every replayed row .*, got "
_IDS = [[-1, -1, -1], [7, 0, 2], [3, 4, 5]]  # row 0 routes natively: its weights are not read


def _route_weights_launch(weights, method=0, check=True):
    from replaymoe.routing._triton import _launch as route_launch

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    replay = torch.tensor(_IDS, dtype=torch.int64)
    w = torch.tensor(weights, dtype=torch.float32)
    return route_launch(logits, None, None, replay, 3, method, 1, 1, 1.0, check, replay_weights=w)


@pytest.mark.parametrize(
    "weights,method,match",
    [
        ([[0.1] * 3, [0.5, float("nan"), 0.2], [0.3] * 3], 0, _W_NONNEG + r"nan at row 1, slot 1 "),  # NaN
        ([[0.1] * 3, [0.5, 0.3, 0.2], [0.3, 0.3, -0.5]], 0, _W_NONNEG + r"-0.5 at row 2, slot 2 "),  # < 0
        ([[0.1] * 3, [0.5, 0.3, 0.2], [float("inf"), 1.0, 1.0]], 5, _W_FINITE + r"inf at row 2, slot 0 "),
    ],
)
def test_bad_replay_weights_leave_their_slot_in_the_mailbox(weights, method, match):
    _route_weights_launch(weights, method)
    with pytest.raises(ValueError, match=match + r"of an earlier route call"):
        _id_mailbox._raise(0, synced=True)
    assert not _id_mailbox.mailbox(0).any()


@pytest.mark.parametrize(
    "weights,method",
    [
        ([[float("nan")] * 3, [0.5, 0.3, 0.2], [0.3] * 3], 0),  # NaN in the native row: not read
        ([[0.1] * 3, [0.5, -0.3, 0.2], [-1.0, 2.0, 0.0]], 5),  # TOPK's weights are signed logits
    ],
)
def test_valid_replay_weights_leave_the_mailbox_empty(weights, method):
    ids, out = _route_weights_launch(weights, method)
    assert not _id_mailbox.mailbox(0).any()
    ref_ids, ref_out = _route_weights_launch(weights, method, check=False)
    assert torch.equal(ids, ref_ids) and torch.equal(out, ref_out)  # the check changes nothing
    assert torch.equal(out[1:], torch.tensor(weights[1:]))  # the replayed rows take the given weights

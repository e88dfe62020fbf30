"""Gradients of fused_moe: torch and Triton (interpreter) backends against fp64 autograd of the
reference, replay, determinism, torch.compile of a training step, MoELayer training, rejections.

The Triton cases run the real kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest on CPU machines) at tiny fp32/fp16 shapes; bf16 runs on the GPU (test_moe_backward_gpu.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import replaymoe.moe._backward as moe_bwd
import replaymoe.moe.configs as cfgs
from _scripts import run_script
from replaymoe import _switches
from replaymoe.moe import MoELayer, fused_moe, fused_moe_torch
from replaymoe.routing import RoutingMethod
from replaymoe.testing import assert_close, assert_same_sums, tie_free_logits

# (T, H, I, E, E_local, offset, K)
CASES = [
    pytest.param(6, 32, 16, 4, 4, 0, 2, id="basic"),  # every expert local
    pytest.param(3, 32, 16, 8, 8, 0, 2, id="empty-experts"),  # 6 slots over 8 experts: some get none
    pytest.param(0, 32, 16, 4, 4, 0, 2, id="T0"),  # no tokens: zero weight gradients
    pytest.param(5, 32, 16, 4, 4, 0, 1, id="top1"),  # top-k 1
    pytest.param(3, 32, 16, 8, 8, 0, 8, id="top8"),  # top-k 8 = E: every expert gets every token
    pytest.param(7, 32, 16, 8, 3, 2, 3, id="ep-slice"),  # ids outside [2, 5) and -1 padding rows
    pytest.param(5, 40, 24, 4, 4, 0, 2, id="odd-dims"),  # H, I not multiples of the tiles
]


def _problem(T, H, I, E, E_local, offset, K, g, dtype):  # noqa: E741
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E_local, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E_local, H, I, generator=g) / I**0.5).to(dtype)
    if T:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    else:
        ids = torch.zeros(0, K, dtype=torch.int32)
    if offset and T > 1:
        ids[1] = -1  # EP dispatch padding row
    wts = torch.rand(T, K, generator=g)
    dout = torch.randn(T, H, generator=g).to(dtype)
    return x, w13, w2, ids, wts, dout


def _grads(x, w13, w2, ids, wts, dout, *, E, offset, backend, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, wts)]
    out = fused_moe(leaves[0], leaves[1], leaves[2], topk_ids=ids, topk_weights=leaves[3],
                    local_expert_offset=offset, num_experts=E, backend=backend, **kw)  # fmt: skip
    out.backward(dout)
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _reference_grads(x, w13, w2, ids, wts, dout, *, E, offset):
    """fp64 autograd of the reference (fused_moe_torch)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w13, w2, wts)]
    out = fused_moe_torch(leaves[0], leaves[1], leaves[2], topk_ids=ids, topk_weights=leaves[3],
                          local_expert_offset=offset, num_experts=E)  # fmt: skip
    out.backward(dout.double())
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _check(got, ref, dtype):
    # gradients are sums over tokens / features: compare against the reference's scale
    for name, a, e in zip(("out", "dx", "dw13", "dw2", "dtopk_weights"), got, ref):
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        tol = {torch.float32: 1e-5, torch.float16: 4e-3}[dtype]
        assert_close(a.float(), e.float(), atol=tol * scale, rtol=tol, name=name)


@pytest.mark.parametrize("T,H,I,E,E_local,offset,K", CASES)
def test_torch_backend_gradients_match_fp64(T, H, I, E, E_local, offset, K, generator):  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, torch.float32)
    got = _grads(x, w13, w2, ids, wts, dout, E=E, offset=offset, backend="torch")
    ref = _reference_grads(x, w13, w2, ids, wts, dout, E=E, offset=offset)
    _check(got, ref, torch.float32)


# every case in fp32 with the forward's saved gate/up; recompute and fp16 on the cases with most edges
TRITON_CASES = [pytest.param(*c.values, False, torch.float32, id=c.id + "-saved-fp32") for c in CASES] + [
    pytest.param(*c.values, rec, dt, id=f"{c.id}-{'recompute' if rec else 'saved'}-{str(dt)[6:]}")
    for c in CASES
    if c.id in ("empty-experts", "ep-slice", "top8")
    for rec, dt in ((True, torch.float32), (False, torch.float16), (True, torch.float16))
]


@pytest.mark.interpret
@pytest.mark.parametrize("T,H,I,E,E_local,offset,K,recompute,dtype", TRITON_CASES)
def test_triton_gradients_match_fp64(T, H, I, E, E_local, offset, K, recompute, dtype, generator):  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, dtype)
    got = _grads(x, w13, w2, ids, wts, dout, E=E, offset=offset, backend="triton", recompute=recompute)
    ref = _reference_grads(x, w13, w2, ids, wts, dout, E=E, offset=offset)
    for t, r in zip(got[1:], (x, w13, w2, wts)):
        assert t.dtype == r.dtype and t.shape == r.shape
    _check(got, ref, dtype)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` that fills floating buffers with NaN and integer ones with 0 (a valid slot id),
    so that a kernel reading a row nobody wrote (padding, another expert's rows, the rows of
    non-local slots) shows in the gradients."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 0)

    monkeypatch.setattr(torch, "empty", poisoned)


def _ids_sparse(T, K, E, block_m, g):
    # every expert gets at most one slot: T*K = 8 slots over E = 8 experts (a permutation), so the
    # padded layout is block_m times the slots
    return torch.randperm(E, generator=g)[: T * K].reshape(T, K).to(torch.int32)


def _ids_full_tile(T, K, E, block_m, g):
    # expert 0 (k = 0) of exactly block_m tokens: a segment with no padding row, followed by experts
    # with ragged counts; the last tokens skip expert 0
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] + 1 for _ in range(T)])
    ids[:block_m, 0] = 0
    return ids.to(torch.int32)


# (T, H, I, E, E_local, offset, K, ids) -- edge each hits
BWD_LAYOUTS = [
    pytest.param((13, 40, 24, 8, 3, 2, 3, None), id="ep-slice"),  # ids outside [2, 5), a -1 row, EP tail
    pytest.param((4, 32, 16, 8, 8, 0, 2, _ids_sparse), id="padding-heavy"),  # 1 slot per expert
    pytest.param((40, 32, 16, 4, 4, 0, 2, _ids_full_tile), id="full-tile"),  # a segment of exactly block_m
]


# (dw_mode, dw_tma): the weight-gradient variants
DW_MODES = [(0, False), (1, False), (2, False), (1, True)]
DW_IDS = ["gather-in-loop", "pre-gathered", "transposed", "pre-gathered-tma"]


@pytest.mark.interpret
@pytest.mark.parametrize(
    "case",
    [
        pytest.param((13, 64, 32, 8, 3, 2, 3), id="ep-slice"),  # ids outside [2, 5), a -1 row, EP tail
        pytest.param((3, 32, 16, 8, 8, 0, 2), id="empty-experts"),  # most experts without rows
        pytest.param((40, 32, 16, 2, 2, 0, 2), id="several-tiles"),  # tiles past an expert's rows
    ],
)
@pytest.mark.usefixtures("poisoned_empty")
def test_gemm_tma_equals_pointer_loads(case, generator):
    # dA (W2 through a descriptor) and dX (W13 and dh through descriptors) give the pointer loads'
    # gradients bitwise, and the closed form's; dh rows after a tile's real rows (another expert's,
    # or past the buffer) only feed output rows that are not stored
    import dataclasses

    import replaymoe.moe as M

    T, H, I, E, E_local, offset, K = case  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, torch.float32)
    ref = M.experts_backward_torch(dout, x, w13, w2, ids, wts, offset, [True] * 4)
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, I, E_local))
    base = dataclasses.replace(cfgs.moe_bwd_config(T, K, H, I, E_local), block_m=16, bn_a=16, bk_a=16,
                               bn_x=16, bk_x=16)  # fmt: skip
    got = []
    for gemm_tma in (False, True):
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
        cfg = dataclasses.replace(base, gemm_tma=gemm_tma)
        got.append(moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, [True] * 4, cfg))
    for name, a, b, e in zip(("dx", "dw13", "dw2", "dtopk_weights"), got[1], got[0], ref):
        # bitwise on the GPU (test_moe_backward_gpu); here tl.dot's order follows the CPU's BLAS
        assert_same_sums(a, b, name=name)
        assert_close(a, e, atol=1e-5 * max(1.0, float(e.abs().max())), name=name)


@pytest.mark.interpret
@pytest.mark.parametrize("dw_mode", DW_MODES, ids=DW_IDS)
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("case", BWD_LAYOUTS)
@pytest.mark.usefixtures("poisoned_empty")
def test_triton_backward_configs_match_closed_form(case, dw_mode, block_m, generator):
    # every weight-gradient mode and two tile heights (padding rows, several tiles per expert) give
    # the closed-form backward's gradients; intermediates are compact (one row per slot) and every
    # buffer is poisoned, so a row read at a wrong (padded) position or never written fails
    import dataclasses

    import replaymoe.moe as M

    T, H, I, E, E_local, offset, K, make_ids = case  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, torch.float32)
    if make_ids is not None:
        ids = make_ids(T, K, E, block_m, generator)
    ref = M.experts_backward_torch(dout, x, w13, w2, ids, wts, offset, [True] * 4)
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, I, E_local))
    _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
    cfg = dataclasses.replace(cfgs.moe_bwd_config(T, K, H, I, E_local), dw_mode=dw_mode[0], dw_tma=dw_mode[1],
                              block_m=block_m)  # fmt: skip
    got = moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, [True] * 4, cfg)
    for name, a, e in zip(("dx", "dw13", "dw2", "dtopk_weights"), got, ref):
        assert_close(a, e, atol=1e-5 * max(1.0, float(e.abs().max())), name=name)


@pytest.mark.interpret
@pytest.mark.parametrize("dw_mode", DW_MODES, ids=DW_IDS)
@pytest.mark.usefixtures("poisoned_empty")
def test_triton_backward_need_subsets_bitwise_equal(dw_mode, generator):
    # each gradient asked for alone equals (bitwise) the same gradient from the full backward: the
    # order of the steps and the freeing of dh / aw never change a value; not asked for: empty
    import dataclasses

    T, H, I, E, E_local, offset, K = 13, 40, 24, 8, 3, 2, 3  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, torch.float32)
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, I, E_local))
    cfg = dataclasses.replace(cfgs.moe_bwd_config(T, K, H, I, E_local), dw_mode=dw_mode[0], dw_tma=dw_mode[1],
                              block_m=16)  # fmt: skip

    def run(need):
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
        return moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, need, cfg)

    full = run([True] * 4)
    for i in range(4):
        got = run([j == i for j in range(4)])
        for j in range(4):
            if j == i:
                assert torch.equal(got[j], full[j]), j
            else:
                assert got[j].numel() == 0, j


@pytest.mark.interpret
def test_triton_forward_unchanged_by_training_and_backward_deterministic(generator):
    x, w13, w2, ids, wts, dout = _problem(9, 32, 16, 4, 4, 0, 2, generator, torch.float16)
    plain = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="triton")
    a = _grads(x, w13, w2, ids, wts, dout, E=4, offset=0, backend="triton")
    b = _grads(x, w13, w2, ids, wts, dout, E=4, offset=0, backend="triton")
    # the training forward is the inference forward (bitwise on the GPU; here tl.dot's order may
    # differ with the operands' layout)
    assert_same_sums(a[0], plain, name="training forward")
    for u, v in zip(a, b):
        assert torch.equal(u, v)  # two backward passes are bitwise equal


@pytest.mark.interpret
@pytest.mark.parametrize("case", [0, 5], ids=["basic", "ep-slice"])  # all local; EP slice, -1 rows
def test_eager_function_equals_custom_op_and_reuses_the_layout(case, generator, monkeypatch):
    # eager training runs an autograd.Function (no op dispatch) that hands the forward's expert
    # layout to the backward; torch.compile traces the custom op, which builds its own: same bits
    import replaymoe.moe.layout as L

    T, H, I, E, E_local, offset, K = CASES[case].values  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, torch.float16)
    calls = []
    real = L.build_layout
    monkeypatch.setattr(L, "build_layout", lambda *a, **k: calls.append(1) or real(*a, **k))
    eager = _grads(x, w13, w2, ids, wts, dout, E=E, offset=offset, backend="triton")
    assert len(calls) == 1  # one layout for forward and backward

    def via_op(*inputs):  # what torch.compile runs: the custom op and its registered autograd
        inputs = list(inputs)
        inputs[6] = cfgs.config_tuple(inputs[6])  # the eager Function takes the MoEConfig itself
        return torch.ops.replaymoe.moe_experts_train(*inputs)

    monkeypatch.setattr(moe_bwd._EagerTrain, "apply", via_op)
    calls.clear()
    op = _grads(x, w13, w2, ids, wts, dout, E=E, offset=offset, backend="triton")
    assert len(calls) == 2  # the op's backward lays the ids out again
    for name, a, b in zip(("out", "dx", "dw13", "dw2", "dtopk_weights"), eager, op):
        assert torch.equal(a, b), name


@pytest.mark.interpret
@pytest.mark.parametrize("recompute", [False, True])
def test_triton_backward_twice_through_one_graph(recompute, generator):
    # eager backward frees the forward's saved gate/up rows once read (lower peak memory): a second
    # backward through the same graph (retain_graph) raises a clear error, unless recompute=True
    x, w13, w2, ids, wts, dout = _problem(9, 32, 16, 4, 4, 0, 2, generator, torch.float32)
    w13.requires_grad_()
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, backend="triton", recompute=recompute)
    out.backward(dout, retain_graph=True)
    first = w13.grad.clone()
    if not recompute:
        with pytest.raises(RuntimeError, match="backward ran twice through the same graph"):
            out.backward(dout)
        return
    out.backward(dout)
    assert torch.equal(w13.grad, 2 * first)


def _live_rows(shape) -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == shape)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "hooks",
    [
        "checkpoint",  # torch.utils.checkpoint (non-reentrant): the rows are dropped, then recomputed
        "save_on_cpu",  # saved tensors moved to the host: the rows must go through the hooks too
    ],
)
def test_saved_rows_go_through_saved_tensor_hooks(hooks, generator):
    # the gate/up rows [T*K, 2I] are the largest thing the experts save; under saved-tensor hooks a
    # forward must not keep them on the side (a checkpointed model would hold every layer's rows until
    # its backward), and the backward through the hooks gives the unhooked gradients, twice over
    from torch.utils.checkpoint import checkpoint

    T, H, I, E, K = 9, 32, 16, 4, 2  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E, 0, K, generator, torch.float32)
    ref = _grads(x, w13, w2, ids, wts, dout, E=E, offset=0, backend="triton")
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, wts)]

    def f(a, b, c, d):
        return fused_moe(a, b, c, topk_ids=ids, topk_weights=d, backend="triton")

    before = _live_rows((T * K, 2 * I))
    if hooks == "checkpoint":
        out = checkpoint(f, *leaves, use_reentrant=False)
        assert _live_rows((T * K, 2 * I)) == before  # dropped after the forward
    else:
        with torch.autograd.graph.save_on_cpu():
            out = f(*leaves)
    out.backward(dout, retain_graph=True)
    got = [out.detach()] + [t.grad.clone() for t in leaves]
    for name, a, b in zip(("out", "dx", "dw13", "dw2", "dtopk_weights"), got, ref):
        assert torch.equal(a, b), name
    out.backward(dout)  # the hooks hold the rows: a second backward works
    assert torch.equal(leaves[1].grad, 2 * got[2])


@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_gradients_reach_the_router(backend, generator):
    # replay: ids forced from a (non-contiguous) slice of a recorded trace, weights recomputed from
    # the trainer's logits; d(logits) equals the fp64 reference's, including the all -1 row that is
    # routed natively
    T, H, I, E, K = 6, 32, 16, 8, 2  # noqa: E741
    x, w13, w2, _, _, dout = _problem(T, H, I, E, E, 0, K, generator, torch.float32)
    logits = tie_free_logits(T, E, generator=generator)
    trace = torch.stack([torch.randperm(E, generator=generator)[: K * 3] for _ in range(T)]).reshape(T, 3, K)
    replay = trace[:, 1]  # [T, K] with strides (3K, 1): not contiguous
    replay[4] = -1
    assert not replay.is_contiguous()

    def run(dt, be):
        # the fp64 reference keeps fp32 logits (routing takes fp32/bf16/fp16), the rest in fp64
        leaves = [t.detach().to(dt).requires_grad_() for t in (x, w13, w2)]
        leaves.append(logits.detach().clone().requires_grad_())
        fn = fused_moe if be != "ref" else fused_moe_torch
        kw = {} if be == "ref" else {"backend": be}
        out = fn(leaves[0], leaves[1], leaves[2], router_logits=leaves[3], top_k=K,
                 method=RoutingMethod.RENORMALIZE, replay_ids=replay, **kw)  # fmt: skip
        out.backward(dout.to(dt))
        return [out.detach()] + [t.grad for t in leaves]

    got = run(torch.float32, backend)
    ref = run(torch.float64, "ref")
    _check(got, ref, torch.float32)
    rows = [0, 1, 2, 3, 5]
    forced = torch.zeros(len(rows), E, dtype=torch.bool).scatter_(1, replay[rows].long(), True)
    assert (got[4][rows][~forced] == 0).all()  # only the forced experts' logits move
    assert (got[4][rows][forced] != 0).all()


@pytest.mark.interpret
def test_torch_compile_training_step_matches_eager(generator):
    # the custom op, its fake and its registered autograd traced by dynamo / AOTAutograd (aot_eager:
    # no C++ compiler needed on CPU); routing inside, MoELayer on the Triton backend
    torch.manual_seed(0)
    layer = MoELayer(32, 16, 4, 2, backend="triton")
    x = torch.randn(7, 32, generator=generator)

    def step(m, inp):
        loss = m(inp).square().sum()
        loss.backward()
        return loss.detach()

    eager_loss = step(layer, x)
    eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled_loss = torch.compile(step, fullgraph=False, backend="aot_eager")(layer, x)
    assert torch.equal(eager_loss, compiled_loss)
    for a, p in zip(eager, layer.parameters()):
        assert torch.equal(a, p.grad)


def test_moelayer_trains(generator):
    # a few SGD steps on the torch backend lower a regression loss; every parameter gets a gradient
    torch.manual_seed(1)
    layer = MoELayer(16, 8, 4, 2, backend="torch")
    x = torch.randn(32, 16, generator=generator)
    target = torch.randn(32, 16, generator=generator) * 0.1
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_rejections(generator):
    from replaymoe.moe.quant import quantize_fp8_block

    x, w13, w2, ids, wts, _ = _problem(3, 128, 128, 2, 2, 0, 2, generator, torch.float32)
    with pytest.raises(ValueError, match="recompute"):
        fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, recompute=1)
    with pytest.raises(ValueError, match="recompute"):
        MoELayer(16, 8, 4, 2, recompute="yes")
    q13, s13 = quantize_fp8_block(w13)
    q2, s2 = quantize_fp8_block(w2)
    with pytest.raises(ValueError, match="w13_scale.*inference-only"):
        fused_moe(x.bfloat16().requires_grad_(), q13, q2, topk_ids=ids, topk_weights=wts, w13_scale=s13,
                  w2_scale=s2)  # fmt: skip
    with pytest.raises(ValueError, match="hidden_states"):  # fp64 is for the torch reference only
        fused_moe(x.double(), w13.double(), w2.double(), topk_ids=ids, topk_weights=wts, backend="triton")


def _ids_counts(counts, E, offset, K, g):
    """Top-K ids whose local experts ``offset + j`` get exactly ``counts[j]`` slots (all in column 0),
    the other columns non-local experts, and a last all -1 row (EP dispatch padding)."""
    E_local = len(counts)
    col0 = torch.cat([torch.full((c,), offset + j) for j, c in enumerate(counts)])
    col0 = col0[torch.randperm(col0.numel(), generator=g)]  # slots of one expert spread over tokens
    T = col0.numel() + 1
    nonlocal_ids = [e for e in range(E) if not offset <= e < offset + E_local]
    ids = torch.full((T, K), -1, dtype=torch.int32)
    ids[:-1, 0] = col0
    for t in range(T - 1):
        ids[t, 1:] = torch.tensor(nonlocal_ids)[torch.randperm(len(nonlocal_ids), generator=g)[: K - 1]]
    return ids


@pytest.mark.interpret
@pytest.mark.parametrize(
    "dtype,progs,c_desc,bk",
    [(torch.float32, 0, True, 16), (torch.float16, 0, True, 16), (torch.float16, 3, False, 16),
     (torch.float16, 0, True, 32)],
    ids=["fp32-tile-grid", "fp16-tile-grid", "fp16-persistent-3-ptr-stores", "fp16-bk32-tail-pieces"],
)  # fmt: skip
@pytest.mark.usefixtures("poisoned_empty")
def test_triton_dw_tma_bitwise_equal_pointer_kernel(dtype, progs, c_desc, bk, generator):
    # the TMA dW kernel against the pointer kernel (same config, pre-gathered rows): equal up to the
    # summation order of tl.dot here (bitwise on the GPU, test_moe_backward_gpu)
    # over local experts of 0 rows, 1 row, exactly BLOCK_K rows, 21 and 5 rows (a partial last chunk,
    # the next expert's rows, NaN-poisoned rows of non-local slots and the buffer's end after it), an
    # EP slice with a -1 row; dW13's M = 2I = 48 is a multiple of BLOCK_M (descriptor stores), dW2's M
    # = H = 40 is not (pointer stores); N (H = 40, I = 24) not a multiple of BLOCK_N (zero fill);
    # persistent-3: 3 programs walk the tiles; ptr-stores: no C descriptor (dw_c_desc=False);
    # bk32-tail-pieces: 32-row chunks, so every expert's rows end in a partial chunk that the TMA
    # kernel computes in 16-row pieces (1 / 16 / 21 / 5 rows: one partial piece, one full piece, a full
    # and a partial piece, one partial piece) against the pointer kernel's one masked 32-row chunk
    import dataclasses

    H, I, E, offset, K = 40, 24, 8, 2, 2  # noqa: E741
    counts = [0, 1, 16, 21, 5]  # local experts 2..6; BLOCK_K = 16
    ids = _ids_counts(counts, E, offset, K, generator)
    T, E_local = ids.shape[0], len(counts)
    x, w13, w2, _, wts, dout = _problem(T, H, I, E, E_local, offset, K, generator, dtype)
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, I, E_local))
    base = dataclasses.replace(cfgs.moe_bwd_config(T, K, H, I, E_local), block_m=16, dw_mode=1, bm_w=16,
                               bn_w=16, bk_w=bk)  # fmt: skip
    need = [False, True, True, False]

    def run(cfg):
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
        return moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, need, cfg)

    ptr = run(base)
    tma = run(dataclasses.replace(base, dw_tma=True, dw_progs=progs, dw_c_desc=c_desc))
    assert not base.dw_tma
    for name, a, b in zip(("dw13", "dw2"), tma[1:3], ptr[1:3]):
        assert torch.isfinite(b).all(), name
        assert_same_sums(a, b, name=name)  # bitwise on the GPU; tl.dot's order follows the CPU here
    assert (tma[1][0] == 0).all() and (tma[2][0] == 0).all()  # the expert without rows: zeros
    assert (tma[1][1:] != 0).any(dim=(1, 2)).all()  # every other expert got its rows


def test_dw_tma_selection_and_descriptor_checks(monkeypatch):
    # moe_bwd_config sets dw_tma only when asked; dw_tma_ok never on CPU / in the interpreter, never for
    # fp32, never with the module switch off; _dw_desc refuses what TMA cannot address

    assert cfgs.moe_bwd_config(4096, 8, 2048, 768, 128, tma=True).dw_tma
    assert not cfgs.moe_bwd_config(4096, 8, 2048, 768, 128).dw_tma
    # small experts on Hopper: the dW register cap (three programs per SM) and 128x256 dA tiles; neither
    # without TMA (other GPUs: less shared memory), nor for large experts (one 8-warp program per SM)
    hopper_small = cfgs.moe_bwd_config(4096, 8, 2048, 768, 128, tma=True)
    assert (hopper_small.maxnreg_w, hopper_small.bn_a) == (168, 256)
    other_small = cfgs.moe_bwd_config(4096, 8, 2048, 768, 128)
    assert (other_small.maxnreg_w, other_small.bn_a) == (0, 128)
    assert cfgs.moe_bwd_config(16384, 8, 2048, 768, 128, tma=True).maxnreg_w == 0
    assert not cfgs.dw_tma_ok(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setitem(cfgs._HOPPER_DEVICES, torch.device("cuda", 7), True)  # as a Hopper GPU would
    assert cfgs.dw_tma_ok(torch.device("cuda", 7), torch.bfloat16)
    assert not cfgs.dw_tma_ok(torch.device("cuda", 7), torch.float32)
    monkeypatch.setattr(_switches, "DEFAULTS", dataclasses.replace(_switches.DEFAULTS, tma=False))
    assert not cfgs.dw_tma_ok(torch.device("cuda", 7), torch.bfloat16)  # REPLAYMOE_TMA=0
    buf = torch.zeros(64, 72, dtype=torch.float16)
    assert moe_bwd._dw_desc(buf, 64, [16, 64]) is not None  # rows of 144 bytes
    assert moe_bwd._dw_desc(buf[:, :36], 64, [16, 32]) is not None  # a column slice: same row stride
    assert moe_bwd._dw_desc(buf[:, 1:], 64, [16, 64]) is None  # base 2 bytes past 16-byte alignment
    assert moe_bwd._dw_desc(torch.zeros(64, 36, dtype=torch.float16), 64, [16, 32]) is None  # 72-byte rows
    assert moe_bwd._dw_desc(buf, 64, [16, 512]) is None  # block over TMA's 256 elements
    w = torch.zeros(4, 48, 40, dtype=torch.float16)
    assert moe_bwd._dw_desc(w, 4 * 48, [16, 16]) is not None  # [E, M, N] viewed [E*M, N]
    assert moe_bwd._dw_desc(w.transpose(1, 2), 4 * 40, [16, 16]) is None  # not unit-stride along N


def test_dw_tma_kernel_compiles_for_sm90():
    # CPU CI cannot run the TMA dW kernel as Hopper would: compile it for sm_90 at
    # the configurations moe_bwd_config picks (no GPU needed) and check that it loads through TMA, uses
    # wgmma, fits shared memory and does not spill; a separate process, since this one runs the kernels
    # in Triton's interpreter
    run = run_script("dw_tma_ptx_check.py", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("-> ok") == 6, run.stdout

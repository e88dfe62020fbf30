"""fused_moe backward on the GPU (bf16 Triton kernels): gradients against fp64 autograd of the
reference, determinism, recompute, CUDA-graph capture and torch.compile of forward + backward.

Run with ``PYTHONPATH=src python3 -m pytest -m gpu tests/test_moe_backward_gpu.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import replaymoe.moe._backward as moe_bwd
import replaymoe.moe.configs as cfgs
from replaymoe import _switches
from replaymoe.moe import MoELayer, fused_moe, fused_moe_torch

pytestmark = pytest.mark.gpu

# (T, H, I, E, E_local, offset, K)
CASES = [
    pytest.param(300, 256, 128, 16, 16, 0, 4, id="mid"),  # several tiles per expert
    pytest.param(2, 256, 128, 64, 64, 0, 8, id="few-tokens"),  # most experts without tokens
    pytest.param(700, 384, 192, 8, 3, 3, 2, id="ep-slice"),  # ids outside [3, 6), -1 rows
    pytest.param(64, 320, 96, 8, 8, 0, 1, id="top1-odd"),  # top-1, H and I not tile multiples
    pytest.param(2048, 512, 256, 32, 32, 0, 8, id="prefill"),  # 128-row tiles
]


def _problem(T, H, I, E, E_local, offset, K, seed):  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E_local, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E_local, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
    ids = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
    if offset:
        ids[::7] = -1
    wts = torch.rand(T, K, generator=g, device="cuda")
    dout = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    return x, w13, w2, ids, wts, dout


def _grads(fn, x, w13, w2, wts, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, wts)]
    out = fn(leaves[0], leaves[1], leaves[2], topk_weights=leaves[3], **kw)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, dout.to(out.dtype)))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("T,H,I,E,E_local,offset,K", CASES)
def test_bf16_gradients_match_fp64(T, H, I, E, E_local, offset, K, recompute):  # noqa: E741
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, seed=T + K)
    kw = dict(topk_ids=ids, local_expert_offset=offset, num_experts=E)
    got = _grads(fused_moe, x, w13, w2, wts, dout, recompute=recompute, **kw)
    ref = _grads(fused_moe_torch, x.double(), w13.double(), w2.double(), wts.double(), dout, **kw)
    for name, a, e in zip(("out", "dx", "dw13", "dw2", "dwts"), got, ref):
        err = float((a.double() - e).norm() / e.norm().clamp_min(1e-30))
        assert err < 1.5e-2, f"{name}: relative error {err:.3g}"  # bf16 inputs and stored rows
    assert got[1].dtype == torch.bfloat16 and got[4].dtype == torch.float32


def test_backward_bitwise_deterministic_and_forward_unchanged():
    x, w13, w2, ids, wts, dout = _problem(4096, 512, 256, 64, 64, 0, 8, seed=3)
    a = _grads(fused_moe, x, w13, w2, wts, dout, topk_ids=ids)
    b = _grads(fused_moe, x, w13, w2, wts, dout, topk_ids=ids)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert torch.equal(a[0], fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts))


def _graph_replay_equals_eager(x, w13, w2, ids, wts, dout):
    """fused_moe forward + backward captured in a CUDA graph (after a warm-up on a side stream): the
    replay rewrites every poisoned gradient and equals eager bitwise; returns the eager gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, wts)]

    def step():
        out = fused_moe(leaves[0], leaves[1], leaves[2], topk_ids=ids, topk_weights=leaves[3])
        return torch.autograd.grad(out, leaves, dout)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for st in static:
        st.fill_(float("nan"))  # poisoned: the replay must rewrite every element
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager):
        assert torch.equal(a, b)
    return eager


def test_cuda_graph_forward_and_backward():
    _graph_replay_equals_eager(*_problem(512, 256, 128, 16, 16, 0, 4, seed=5))


def test_torch_compile_training_step():
    # routing + experts forward compiled as one graph (inductor); AOTAutograd compiles the backward,
    # which calls the registered Triton backward op
    from replaymoe.testing import assert_close

    torch.manual_seed(0)
    layer = MoELayer(256, 128, 16, 4, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)

    def loss_fn(inp):
        return layer(inp).float().square().sum()

    loss_fn(x).backward()
    eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.compile(loss_fn, fullgraph=True)(x).backward()
    for a, p in zip(eager, layer.parameters()):
        assert_close(p.grad, a, atol=2e-2 * float(a.abs().max()), name="compiled grad")


# --- the dW GEMMs through TMA descriptors (MoEBwdConfig.dw_tma; Hopper and newer) -------------------


def _needs_tma():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need compute capability >= 9.0")


def _dw_pair(x, w13, w2, ids, wts, dout, offset, cfg, **extra):
    """(dw13, dw2) with ``cfg``'s dW kernel and with the same config through the other dW kernel."""
    import dataclasses

    T, H = x.shape
    E_local, two_i, _ = w13.shape
    K = ids.shape[1]
    c0 = cfgs.config_tuple(cfgs.moe_config(T, K, H, two_i // 2, E_local))
    _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
    need = [False, True, True, False]
    ptr = moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, need,
                        dataclasses.replace(cfg, dw_tma=False))  # fmt: skip
    tma = moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, need,
                        dataclasses.replace(cfg, dw_tma=True, **extra))  # fmt: skip
    return ptr[1:3], tma[1:3]


@pytest.mark.parametrize("T,H,I,E,E_local,offset,K", CASES)
def test_dw_tma_bitwise_equal_pointer_kernel(T, H, I, E, E_local, offset, K):  # noqa: E741
    # bf16 (wgmma from TMA-filled shared memory vs pointer loads): the same bits, on every layout edge
    # of CASES (EP slice, experts without rows, H / I not tile multiples: pointer stores)

    _needs_tma()
    x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, seed=T + K)
    cfg = cfgs.moe_bwd_config(T, K, H, I, E_local, tma=True)
    ptr, tma = _dw_pair(x, w13, w2, ids, wts, dout, offset, cfg)
    for name, a, b in zip(("dw13", "dw2"), tma, ptr):
        assert torch.equal(a, b), name


def _bench_problem(shape, T=4096):
    """``(x, w13, w2, ids, wts, dout, cfg)``: the bench shape's layer at T tokens (detached) and the
    backward configuration this device picks; skips without TMA."""
    from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights

    _needs_tma()
    H, I, E, K = SHAPES[shape]  # noqa: E741
    w13, w2 = (t.detach() for t in layer_weights(H, I, E))
    x, ids, wts, dout = (t.detach() for t in layer_inputs(T, H, E, K))
    cfg = cfgs.moe_bwd_config(T, K, H, I, E, tma=cfgs.dw_tma_ok(x.device, x.dtype))
    return x, w13, w2, ids, wts, dout, cfg


@pytest.mark.parametrize("shape", ["qwen3", "mixtral", "dsv3"])
def test_dw_tma_bitwise_equal_pointer_kernel_bench_shapes(shape):
    # the bench shapes at T=4096 with the configuration this device picks (TMA on), tile grid and a
    # persistent grid of one program per SM
    x, w13, w2, ids, wts, dout, cfg = _bench_problem(shape)
    assert cfg.dw_tma  # bf16 on Hopper: the default picks TMA
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for extra in ({"dw_progs": 0}, {"dw_progs": sms}, {"dw_progs": -1}):  # tile grid, persistent, per-SM
        ptr, tma = _dw_pair(x, w13, w2, ids, wts, dout, 0, cfg, **extra)
        for name, a, b in zip(("dw13", "dw2"), tma, ptr):
            assert torch.equal(a, b), (name, extra)
        del ptr, tma
    torch.cuda.empty_cache()


@pytest.mark.parametrize("shape", ["qwen3", "mixtral", "dsv3"])
def test_gemm_tma_bitwise_equal_pointer_loads_bench_shapes(shape):
    # dA / dX through TMA descriptors (the default; REPLAYMOE_TMA=0 turns it off) against
    # pointer loads: every gradient bitwise equal, at the bench shapes (T=4096)
    import dataclasses

    x, w13, w2, ids, wts, dout, cfg = _bench_problem(shape)
    assert cfg.gemm_tma == _switches.DEFAULTS.tma
    T, H = x.shape
    E, two_i, _ = w13.shape
    c0 = cfgs.config_tuple(cfgs.moe_config(T, ids.shape[1], H, two_i // 2, E))
    got = []
    for gemm_tma in (False, True):
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, c0, False)
        c = dataclasses.replace(cfg, gemm_tma=gemm_tma)
        got.append(moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, 0, False, [True] * 4, c))
        del saved
    for name, a, b in zip(("dx", "dw13", "dw2", "dtopk_weights"), got[1], got[0]):
        assert torch.equal(a, b), name
    del got
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("ep-slice", 700, 384, 192, 8, 3, 3, 2), id="ep-slice"),  # I=192: partial 128-wide tiles
        pytest.param(("qwen3", 1024), id="qwen3"),  # the bench shape, I = 768
    ],
)
def test_da_tile_width_keeps_gradient_bits(case):
    # dA's tile width, warps and W2 loads (TMA or pointers) are speed switches: tiles 64, 128 and 256
    # wide give every gradient bitwise the same (a row's dot does not depend on the tile's width)
    import dataclasses

    if case[0] == "qwen3":
        x, w13, w2, ids, wts, dout, cfg = _bench_problem("qwen3", T=case[1])
        offset = 0
    else:
        T, H, I, E, E_local, offset, K = case[1:]  # noqa: E741
        x, w13, w2, ids, wts, dout = _problem(T, H, I, E, E_local, offset, K, seed=5)
        cfg = cfgs.moe_bwd_config(T, K, H, I, E_local, tma=cfgs.dw_tma_ok(x.device, x.dtype))
    T, H = x.shape
    E_local, two_i, _ = w13.shape
    c0 = cfgs.config_tuple(cfgs.moe_config(T, ids.shape[1], H, two_i // 2, E_local))
    got = {}
    for bn_a, warps, tma in ((64, 4, False), (128, 4, True), (128, 8, False), (256, 8, True)):
        _, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, offset, c0, False)
        c = dataclasses.replace(cfg, bn_a=bn_a, warps_a=warps, gemm_tma=tma and cfg.gemm_tma)
        need = [True] * 4
        got[bn_a, warps, tma] = moe_bwd.launch_bwd(dout, x, w13, w2, ids, wts, saved, offset, False, need, c)
        del saved
    first = next(iter(got.values()))
    for key, grads in got.items():
        for name, a, b in zip(("dx", "dw13", "dw2", "dtopk_weights"), grads, first):
            assert torch.equal(a, b), (name, key)
    del got, first
    torch.cuda.empty_cache()


def test_cuda_graph_forward_and_backward_dw_tma(monkeypatch):
    # forward + backward captured in a CUDA graph with the TMA dW kernel picked (host descriptors built
    # at capture): the replay equals eager, and eager equals the pointer kernel's backward

    _needs_tma()
    x, w13, w2, ids, wts, dout = _problem(2048, 512, 256, 16, 16, 0, 4, seed=11)
    assert cfgs.moe_bwd_config(2048, 4, 512, 256, 16, tma=cfgs.dw_tma_ok(x.device, x.dtype)).dw_tma
    eager = _graph_replay_equals_eager(x, w13, w2, ids, wts, dout)
    monkeypatch.setattr(_switches, "DEFAULTS", dataclasses.replace(_switches.DEFAULTS, tma=False))
    assert not cfgs.dw_tma_ok(x.device, x.dtype)
    for a, b in zip(_grads(fused_moe, x, w13, w2, wts, dout, topk_ids=ids)[1:], eager):
        assert torch.equal(a, b)

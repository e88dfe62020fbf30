"""Fused MoE batch invariance: a token's output does not depend on T, on the other tokens, or on the
kernel mode the configuration picks (direct decode mode vs layout tiles, eager vs CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from replaymoe.moe import fused_moe
from replaymoe.moe.configs import FP8_BLOCK_M, fp8_invariant, moe_config
from replaymoe.testing import poison

# (H, I, E, K)
QWEN3 = (2048, 768, 128, 8)
MIXTRAL = (4096, 14336, 8, 2)
DSV3 = (7168, 2048, 256, 8)
# DeepSeek-V3's 256 experts in bf16 and fp8 take tens of GiB: alone, after the parallel GPU tests
_DSV3_ALONE = pytest.param(DSV3, marks=pytest.mark.gpu_alone)
SMALL = (1024, 512, 64, 8)


@pytest.mark.parametrize(
    "shape,T,eager,direct",
    [
        (QWEN3, 1, False, True),  # one token: always direct
        (QWEN3, 8, False, False),  # graph/compiled: the layout reads each expert once
        (QWEN3, 8, True, True),  # eager: 14 extra expert reads (~31 us) < the launches saved (and the
        # bucket's tuned tile entry yields to it)
        (QWEN3, 16, True, False),  # eager, but ~47 extra expert reads cost more than they save
        (MIXTRAL, 2, True, False),  # 8 experts of 176 MB: a repeat read is never worth it
        (DSV3, 8, False, True),  # 64 slots x 4 <= 256 experts: each expert hit at most once or twice
        (SMALL, 4, True, True),  # small experts: direct up to 8 tokens eagerly
        (SMALL, 64, True, False),  # beyond 256 slots: never direct
    ],
)
def test_eager_direct_mode_choice(shape, T, eager, direct):
    H, I, E, K = shape  # noqa: E741
    assert moe_config(T, K, H, I, E, eager=eager).direct is direct


@pytest.mark.parametrize("shape", [QWEN3, MIXTRAL, DSV3, SMALL], ids=["qwen3", "mixtral", "dsv3", "small"])
@pytest.mark.parametrize("T", [1, 8, 64, 256, 1024, 16384])
@pytest.mark.parametrize("eager", [False, True])
def test_fp8_configs_share_one_tile_height(shape, T, eager):
    # fp8 batch invariance rests on every configuration running one MMA kind (64-row tiles, or the
    # weights on the swapped kernels' 64 rows); batch_invariant=False may leave it at decode sizes
    # (tuned decode entry included)
    H, I, E, K = shape  # noqa: E741
    assert fp8_invariant(moe_config(T, K, H, I, E, fp8=True, eager=eager))
    fast = moe_config(T, K, H, I, E, fp8=True, eager=eager, batch_invariant=False)
    assert fast.block_m == FP8_BLOCK_M or T * K / min(E, T * K) < 48


def _weights(shape, seed=0):
    H, I, E, K = shape  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * I**-0.5
    return w13, w2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3, SMALL], ids=["qwen3", "small"])
def test_gpu_token_output_independent_of_batch_and_mode(shape):
    H, I, E, K = shape  # noqa: E741
    w13, w2 = _weights(shape)
    T_max = 256
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T_max, H, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T_max)]).int()
    wts = torch.rand(T_max, K, device="cuda", generator=g)
    probe = 4  # the first tokens, each computed alone (T=1: direct mode)
    alone = torch.cat([fused_moe(x[t : t + 1], w13, w2, topk_ids=ids[t : t + 1], topk_weights=wts[t : t + 1])
                       for t in range(probe)])  # fmt: skip
    for T in (2, 4, 8, 16, 64, 256):  # eager: direct up to the heuristic's limit, layout tiles beyond
        out = fused_moe(x[:T], w13, w2, topk_ids=ids[:T], topk_weights=wts[:T])
        n = min(T, probe)
        assert torch.equal(out[:n], alone[:n]), T
    # in a CUDA graph the configuration is the non-eager one (layout tiles at T=8)
    T = 8
    out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x[:T], w13, w2, topk_ids=ids[:T], topk_weights=wts[:T], out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x[:T], w13, w2, topk_ids=ids[:T], topk_weights=wts[:T], out=out)
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:probe], alone)
    assert torch.equal(out, fused_moe(x[:T], w13, w2, topk_ids=ids[:T], topk_weights=wts[:T]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3, SMALL], ids=["qwen3", "small"])
def test_gpu_fp8_token_output_independent_of_batch(shape):
    from replaymoe.moe.quant import quantize_fp8_block

    H, I, E, K = shape  # noqa: E741
    w13, w2 = _weights(shape)
    q13, s13 = quantize_fp8_block(w13)
    q2, s2 = quantize_fp8_block(w2)
    T_max = 2048  # past the 64-row prefill tiles' sizes
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(T_max, H, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T_max)]).int()
    wts = torch.rand(T_max, K, device="cuda", generator=g)

    def run(T, t0=0):
        sl = slice(t0, t0 + T)
        return fused_moe(x[sl], q13, q2, topk_ids=ids[sl], topk_weights=wts[sl], w13_scale=s13, w2_scale=s2)

    probe = 4
    alone = torch.cat([run(1, t) for t in range(probe)])
    for T in (2, 8, 64, 256, 1024, 2048):  # direct decode mode, mid and prefill configurations
        n = min(T, probe)
        assert torch.equal(run(T)[:n], alone[:n]), T


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", [QWEN3, MIXTRAL, _DSV3_ALONE], ids=["qwen3", "mixtral", "dsv3"])
def test_gpu_bench_shapes_token_output_independent_of_batch(shape, fp8):
    # the guarantee at the three benchmark shapes: probe tokens computed alone (T=1, the decode path)
    # equal, bitwise, the same tokens inside batches of T = 16 / 1024 / 16384 (mid and prefill
    # configurations) among other tokens, at other rows each time (the companions and the probes'
    # rows are drawn afresh per T)
    from replaymoe.moe.quant import quantize_fp8_block

    H, I, E, K = shape  # noqa: E741
    w13, w2 = _weights(shape, seed=5)
    kw = {}
    if fp8:
        (w13, kw["w13_scale"]), (w2, kw["w2_scale"]) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    g = torch.Generator(device="cuda").manual_seed(6)
    probes = 3
    px = torch.randn(probes, H, device="cuda", generator=g, dtype=torch.bfloat16)
    pids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(probes)]).int()
    pwts = torch.rand(probes, K, device="cuda", generator=g)
    alone = torch.cat(
        [fused_moe(px[i : i + 1], w13, w2, topk_ids=pids[i : i + 1], topk_weights=pwts[i : i + 1], **kw)
         for i in range(probes)]
    )  # fmt: skip
    for T in (16, 1024, 16384):
        x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].int()
        wts = torch.rand(T, K, device="cuda", generator=g)
        rows = torch.randperm(T, device="cuda", generator=g)[:probes]
        x[rows], ids[rows], wts[rows] = px, pids, pwts
        out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
        fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts, out=out, **kw)
        assert torch.equal(out[rows], alone), T


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3, MIXTRAL, _DSV3_ALONE], ids=["qwen3", "mixtral", "dsv3"])
def test_gpu_fp8_swapped_operands_same_bits(shape):
    # the swapped fp8 kernels (weights on the MMA's >= 64-row side) give the 64-row tiles' bits:
    # decode (direct mode) with GEMM1 on 128 columns (quantized SwiGLU rows), 64 (bf16 rows, GEMM2
    # quantizes them) and 32 (gate and up rows stacked into one dot), GEMM2 on 64 / 128 columns, at
    # T = 1 and 3; tile mode with 16- and 32-row tiles at T = 3, 24 and 200 (one or several rows per
    # expert); whole, and as an EP slice whose slots partly fall outside it
    import dataclasses

    from replaymoe.moe._forward import experts_triton
    from replaymoe.moe.quant import quantize_fp8_block

    H, I, E, K = shape  # noqa: E741
    w13, w2 = _weights(shape, seed=7)
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    del w13, w2
    g = torch.Generator(device="cuda").manual_seed(8)
    direct = dataclasses.replace(moe_config(1, K, H, I, E, fp8=True), block_n1=128, swap_ab=False)
    tile = dataclasses.replace(moe_config(4096, K, H, I, E, fp8=True), swap_ab=False)
    assert direct.direct and not tile.direct and tile.block_m == FP8_BLOCK_M
    swapped_direct = [
        dict(block_n1=n1, block_n2=n2, swap_ab=True)
        for n1, n2 in ((128, 128), (128, 64), (64, 128), (32, 64))
    ]
    swapped_tile = [
        dict(block_m=bm, block_n1=n1, block_n2=n2, swap_ab=True)
        for bm, n1, n2 in ((16, 128, 128), (16, 32, 64), (32, 64, 128))
    ]
    cases = [(1, (0, E), direct, swapped_direct), (3, (0, E), direct, swapped_direct),
             (3, (E // 4, E // 2 + 1), direct, swapped_direct), (3, (0, E), tile, swapped_tile),
             (24, (0, E), tile, swapped_tile), (200, (E // 4, E // 2 + 1), tile, swapped_tile)]  # fmt: skip
    for T, (lo, hi), base, variants in cases:
        x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].int()
        wts = torch.rand(T, K, device="cuda", generator=g)
        outs = []
        for kw in [{}, *variants]:
            out = poison(torch.empty(T, H, device="cuda", dtype=torch.bfloat16))
            c = dataclasses.replace(base, **kw)
            experts_triton(x, q13[lo:hi], q2[lo:hi], ids, wts, w13_scale=s13[lo:hi], w2_scale=s2[lo:hi],
                           local_expert_offset=lo, out=out, config=c)  # fmt: skip
            outs.append(out)
        assert torch.isfinite(outs[0].float()).all()
        for kw, out in zip(variants, outs[1:]):
            assert torch.equal(out, outs[0]), (T, lo, hi, kw)

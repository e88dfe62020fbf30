"""s14: training forward (SAVE_H) and backward kernel config sweep at one point: per-kernel profiler times."""
import dataclasses, statistics, sys, torch
from torch.profiler import ProfilerActivity, profile
import replaymoe.moe_triton as MT
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights

def ktimes(f, iters=3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters): f()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        out[ev.key] = out.get(ev.key, 0) + ev.device_time_total / iters
    return out
def pick(d, sub): return sum(v for k, v in d.items() if sub in k)
name, T = sys.argv[1].split(":"); T = int(T)
H, I, E, K = SHAPES[name]
w13, w2 = (t.detach() for t in layer_weights(H, I, E))
x, ids, wts, dout = (t.detach() for t in layer_inputs(T, H, E, K))
c0 = MT.moe_config(T, K, H, I, E, tma=MT.tma_ok(x.device, x.dtype))
b0 = MT.moe_bwd_config(T, K, H, I, E, tma=MT.dw_tma_ok(x.device, x.dtype))
print("fwd picked", c0); print("bwd picked", b0, flush=True)
ref_out, saved = torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, MT.config_tuple(c0), False)
ref_out = ref_out.clone(); saved0 = saved.clone()
FW = {"cur": {}, "k1 32 s6": dict(block_k1=32, stages1=6), "k1 32 s7": dict(block_k1=32, stages1=7),
      "k1 32 s8": dict(block_k1=32, stages1=8), "k1 32 s6 g8": dict(block_k1=32, stages1=6, group_m=8),
      "k2 32 s6": dict(block_k2=32, stages2=6), "k2 32 s8": dict(block_k2=32, stages2=8),
      "k1 32 s6 k2 32 s6": dict(block_k1=32, stages1=6, block_k2=32, stages2=6)}
import os
if os.environ.get("NOFWD"): FW = {}
for cn, kw in FW.items():
    cfg = MT.config_tuple(dataclasses.replace(c0, **kw))
    f = lambda cfg=cfg: torch.ops.replaymoe.moe_experts_train(x, w13, w2, ids, wts, 0, cfg, False)
    try:
        o, s = f(); torch.cuda.synchronize()
        same = torch.equal(o, ref_out) and torch.equal(s, saved0); del o, s
    except Exception as e:
        print(f"FWD {cn} FAILED {type(e).__name__} {str(e)[:100]}", flush=True); continue
    ts = [ktimes(f) for _ in range(3)]
    g1 = statistics.median(pick(t, "gemm1") for t in ts); g2 = statistics.median(pick(t, "gemm2") for t in ts)
    print(f"FWD {name} {T} {cn:16s} gemm1 {g1:7.1f} us  gemm2 {g2:7.1f} us  same={same}", flush=True)
need = [True] * 4
ref = [t.clone() for t in MT.launch_bwd(dout, x, w13, w2, ids, wts, saved0.clone(), 0, False, need, b0)]
BW = {"cur": {}, "dA 256 s4": dict(bn_a=256), "dA 256 s3": dict(bn_a=256, stages_a=3),
      "dA 256 k32 s6": dict(bn_a=256, bk_a=32, stages_a=6), "dA 256 k32 s8": dict(bn_a=256, bk_a=32, stages_a=8),
      "dX k32 s6": dict(bk_x=32, stages_x=6), "dX k32 s8": dict(bk_x=32, stages_x=8),
      "dW k32 s6": dict(bk_w=32, stages_w=6), "dW k32 s8": dict(bk_w=32, stages_w=8)}
for cn, kw in BW.items():
    cfg = dataclasses.replace(b0, **kw)
    f = lambda cfg=cfg: MT.launch_bwd(dout, x, w13, w2, ids, wts, saved0, 0, False, need, cfg)
    try:
        g = f(); torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(g, ref)); del g
    except Exception as e:
        print(f"BWD {cn} FAILED {type(e).__name__} {str(e)[:100]}", flush=True); continue
    ts = [ktimes(f) for _ in range(3)]
    med = lambda s: statistics.median(pick(t, s) for t in ts)
    print(f"BWD {name} {T} {cn:28s} dA {med('bwd_da'):7.1f} dX {med('bwd_dx'):7.1f} dW {med('dw_tma') + med('dw_kernel'):7.1f} "
          f"all {statistics.median(sum(t.values()) for t in ts):7.1f} us same={same}", flush=True)

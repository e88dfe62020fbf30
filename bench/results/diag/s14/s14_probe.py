"""s14: dA through pre-gathered dO rows (DA_ROWS) A/B: kernel profile + flushed do_bench, peaks."""
import collections, sys, torch, triton
from torch.profiler import ProfilerActivity, profile
import replaymoe.moe_triton as MT
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights
from replaymoe.moe import fused_moe

def prof(f, n=5):
    for _ in range(3): f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): f()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:40]] += e.device_time / n
    return acc

pts = sys.argv[1:] or ["qwen3:4096", "qwen3:16384", "mixtral:4096", "dsv3:4096"]
rows = []
for pt in pts:
    name, T = pt.split(":"); T = int(T)
    H, I, E, K = SHAPES[name]
    w13, w2 = layer_weights(H, I, E)
    x, ids, wts, dout = layer_inputs(T, H, E, K)
    leaves = (x, w13, w2, wts)
    f = lambda: torch.autograd.grad(fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts), leaves, dout)
    finf = lambda: fused_moe(x.detach(), w13.detach(), w2.detach(), topk_ids=ids, topk_weights=wts.detach())
    res = {}
    for flag in (False, True):
        MT.DA_ROWS_ENABLED = flag
        res[flag] = [t.clone() for t in f()]
    same = all(torch.equal(a, b) for a, b in zip(res[False], res[True]))
    del res
    for flag in (False, True):
        MT.DA_ROWS_ENABLED = flag
        acc = prof(f)
        tot = sum(acc.values())
        print(f"== {name} T={T} DA_ROWS={flag}: kernels {tot/1000:.3f} ms", flush=True)
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:12]:
            print(f"   {v/1000:8.3f} ms  {k}")
    acc = prof(finf)
    print(f"== {name} T={T} inference fwd kernels {sum(acc.values())/1000:.3f} ms: " +
          ", ".join(f"{k[:22]} {v/1000:.3f}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:4]))
    times = {False: [], True: []}; peaks = {}
    for r in range(4):
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            MT.DA_ROWS_ENABLED = flag
            torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            times[flag].append(triton.testing.do_bench(f, warmup=25, rep=200))
            peaks[flag] = (torch.cuda.max_memory_allocated() - base) / 2**30
    for flag in (False, True):
        ts = sorted(times[flag])
        rows.append((name, T, flag, ts[len(ts)//2], min(ts), peaks[flag], same))
    del w13, w2, x, ids, wts, dout, leaves; torch.cuda.empty_cache()
print("shape T da_rows median_ms min_ms peak_over_inputs_GiB bitwise_same")
for r in rows:
    print(f"{r[0]} {r[1]} {r[2]} {r[3]:.3f} {r[4]:.3f} {r[5]:.3f} {r[6]}")

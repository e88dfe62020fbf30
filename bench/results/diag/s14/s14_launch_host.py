"""s14: host time per piece of one fused_moe fwd+bwd (Qwen3 T=4096), GPU kept ahead by a sleep."""
import time, collections, torch
import replaymoe._launch as L
import replaymoe.moe_triton as MT
import replaymoe.layout as LY
from replaymoe.bench.train import SHAPES, layer_inputs, layer_weights
from replaymoe.moe import fused_moe
H, I, E, K = SHAPES["qwen3"]
w13, w2 = layer_weights(H, I, E)
x, ids, wts, dout = layer_inputs(4096, H, E, K)
leaves = (x, w13, w2, wts)
def f():
    out = fused_moe(x, w13, w2, topk_ids=ids, topk_weights=wts)
    return torch.autograd.grad(out, leaves, dout)
for _ in range(5): f()
torch.cuda.synchronize()
def host(n=30):
    ts = []
    for _ in range(n):
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize(); ts.sort(); return ts[n // 2] * 1e6
print(f"fwd+bwd host median {host():.0f} us", flush=True)
acc = collections.defaultdict(float); cnt = collections.Counter()
orig = L.FastLaunch.launch
def launch(self, grid, args, kwargs):
    t0 = time.perf_counter(); orig(self, grid, args, kwargs); acc["launch " + self.fn.__name__] += time.perf_counter() - t0; cnt["launch " + self.fn.__name__] += 1
L.FastLaunch.launch = launch
def wrap(mod, name):
    f0 = getattr(mod, name)
    def w(*a, **k):
        t0 = time.perf_counter()
        try: return f0(*a, **k)
        finally: acc[name] += time.perf_counter() - t0; cnt[name] += 1
    setattr(mod, name, w)
for nm in ("_rows_desc", "_dw_desc", "launch_bwd", "_launch", "moe_config", "moe_bwd_config", "tma_ok", "dw_tma_ok"):
    wrap(MT, nm)
wrap(LY, "compact_layout")
emp = torch.empty
n = 30
for _ in range(n):
    torch.cuda._sleep(20_000_000); f()
torch.cuda.synchronize()
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {v / n * 1e6:8.1f} us/iter  x{cnt[k] // n:<3d} {k}")
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(20):
    torch.cuda._sleep(20_000_000); f()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); print(s.getvalue()[-7000:])

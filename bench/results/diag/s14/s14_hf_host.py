"""s14: HF training step host time: no-MoE floor vs grouped_mm vs replaymoe (+replay); cProfile of ours."""
import cProfile, pstats, io, time, torch
from torch import nn
import replaymoe.hf as rhf
from replaymoe.hf.models import build_model
torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.train()
B, S = 8, 512
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, model.config.vocab_size, (B, S), generator=g).cuda()
def step():
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
class Scale(nn.Module):
    def __init__(self): super().__init__(); self.s = nn.Parameter(torch.ones((), device="cuda", dtype=torch.bfloat16))
    def forward(self, x): return x * self.s
cap = rhf.enable(model, capture=True, max_batch_size=B, max_positions=S)
with torch.no_grad():
    model(input_ids=ids)
traces = cap.traces(); cap.disable()
def measure(label, n=12):
    for _ in range(3): step()
    torch.cuda.synchronize()
    hs, ws = [], []
    for _ in range(n):
        t0 = time.perf_counter(); step(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        hs.append(t1 - t0); ws.append(t2 - t0)
    hs.sort(); ws.sort()
    # GPU time alone: a CUDA-event span of a step with the host ahead (queue pre-filled by a sleep kernel)
    print(f"{label:18s} host/step median {hs[n//2]*1e3:6.1f} ms (min {hs[0]*1e3:5.1f}); wall with sync median {ws[n//2]*1e3:6.1f} (min {ws[0]*1e3:5.1f})", flush=True)
def gpu_time(label):
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize(); torch.cuda._sleep(200_000_000)  # ~100 ms of GPU sleep: the host runs ahead
        ev0.record(); step(); ev1.record(); torch.cuda.synchronize(); ts.append(ev0.elapsed_time(ev1))
    ts.sort(); print(f"{label:18s} GPU-bound step (host ahead) median {ts[2]:6.1f} ms", flush=True)
for rep in range(2):
    mlps = [l.mlp for l in model.model.layers]
    for l in model.model.layers: l.mlp = Scale()
    measure("no-moe"); gpu_time("no-moe")
    for l, m in zip(model.model.layers, mlps): l.mlp = m
    model.set_experts_implementation("grouped_mm")
    measure("grouped_mm"); gpu_time("grouped_mm")
    moe = rhf.enable(model); measure("replaymoe"); gpu_time("replaymoe"); moe.disable()
    model.set_experts_implementation("grouped_mm")
    moe = rhf.enable(model, replay=traces, max_batch_size=B, max_positions=S); measure("replaymoe+replay"); gpu_time("replaymoe+replay")
    if rep == 1:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): step()
        torch.cuda.synchronize(); pr.disable()
        s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats("replaymoe", 30); print(s.getvalue()[-7000:])
        s = io.StringIO(); st.sort_stats("tottime").print_stats(20); print(s.getvalue()[-5000:])
    moe.disable(); model.set_experts_implementation("grouped_mm")

"""s14: host time of one HF MoE block fwd+bwd (bench model, replaymoe replay), GPU kept ahead."""
import cProfile, pstats, io, time, collections, torch
import replaymoe.hf as rhf
from replaymoe.hf.models import build_model
torch.manual_seed(0)
model = build_model("qwen3_moe", "bench", dtype=torch.bfloat16, device="cuda")
model.train()
B, S = 8, 512
ids = torch.randint(3, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1)).cuda()
cap = rhf.enable(model, capture=True, max_batch_size=B, max_positions=S)
with torch.no_grad():
    model(input_ids=ids)
traces = cap.traces(); cap.disable()
model.set_experts_implementation("grouped_mm")
mode = __import__("sys").argv[1] if len(__import__("sys").argv) > 1 else "replay"
moe = rhf.enable(model, replay=traces, max_batch_size=B, max_positions=S) if mode == "replay" else rhf.enable(model)
# the bench's step, but one block timed from inside: wrap layer 0's mlp
mlp = model.model.layers[0].mlp
x = torch.randn(B, S, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn_like(x)
# replay needs the session's per-forward state: run one model forward per measured block call? use a real step
def step():
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
for _ in range(3): step()
torch.cuda.synchronize()
# segment timers by monkeypatching
import replaymoe.moe_triton as MT, replaymoe.routing as R, replaymoe.moe as M
acc = collections.defaultdict(float); cnt = collections.Counter()
def timed(mod, name, label):
    f = getattr(mod, name)
    def w(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t0; cnt[label] += 1
    setattr(mod, name, w)
timed(MT, "launch_bwd", "launch_bwd")
timed(MT, "_launch", "fwd _launch")
timed(M, "fused_moe", "fused_moe (fwd, whole)")
import replaymoe.hf.patches as P
n = 10
for _ in range(n):
    torch.cuda._sleep(100_000_000)
    step()
torch.cuda.synchronize()
print(f"per step ({mode}):", {k: f"{v/n*1e3:.2f} ms ({cnt[k]//n}/step)" for k, v in acc.items()})
pr = cProfile.Profile(); pr.enable()
for _ in range(5):
    torch.cuda._sleep(100_000_000); step()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(45); print(s.getvalue()[-9000:])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    torch.cuda._sleep(100_000_000); step(); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))

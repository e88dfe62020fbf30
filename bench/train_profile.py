"""Device script: per-kernel device time of one training fwd+bwd, replaymoe against grouped_mm.

PYTHONPATH=src python3 bench/train_profile.py mixtral:4096 [shape:T ...]

The layer of ``replaymoe bench train`` (its weights, inputs and both implementations), three fwd+bwd
under the torch profiler after three untimed; prints each implementation's summed kernel time and its
twelve largest kernels (ms per fwd+bwd).
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from replaymoe.bench.train import SHAPES, _grouped_mm_fn, _rmoe_fn, layer_inputs, layer_weights


def profile_point(name: str, T: int) -> None:
    H, I, E, K = SHAPES[name]  # noqa: E741
    w13, w2 = layer_weights(H, I, E)
    x, ids, wts, dout = layer_inputs(T, H, E, K)
    for impl, f in (("grouped_mm", _grouped_mm_fn()), ("rmoe", _rmoe_fn(False))):

        def run(f=f):
            y = f(x, w13, w2, ids, wts)
            torch.autograd.grad(y, (x, w13, w2, wts), dout)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        events = [ev for ev in prof.key_averages() if ev.device_time_total]
        rows = sorted(((ev.device_time_total / 3 / 1e3, ev.key[:70]) for ev in events), reverse=True)
        print(f"== {name} T={T} {impl}: kernels {sum(t for t, _ in rows):.3f} ms per fwd+bwd")
        for t, key in rows[:12]:
            print(f"   {t:8.3f} ms  {key}")
        sys.stdout.flush()


if __name__ == "__main__":
    for point in sys.argv[1:] or ["mixtral:4096"]:
        shape, tokens = point.split(":")
        profile_point(shape, int(tokens))

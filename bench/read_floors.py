"""Device script: the bare-read floor of issue 36's goal 3 (decode time <= 1.10 x a read of the same bytes).

PYTHONPATH=src python3 bench/read_floors.py [--shapes qwen3,mixtral,deepseek] [--tokens 1,8,64]

For each shape and token count: the experts the bench's routing hits (random top-k from softmaxed normal
logits, seed 0, as ``bench moe``'s peer driver draws them), their weight bytes in bf16 and in fp8
(``active * 3 * H * I`` elements), and the best time of a plain one-kernel read of that many bytes over a
small config sweep, timed as every ``bench moe`` point is (one CUDA-graph replay, L2 flushed before each:
``replaymoe.bench._timing.time_graph``). The read is of one contiguous buffer, so it is a floor for the
experts' scattered weights, not their exact cost. Prints one line per point and writes
``$OUT/read_floors.txt``. Goal 3 compares the side-by-side's decode times with 1.10 x these (current
figures: bench/README.md, "Read floors").
"""

import argparse
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from replaymoe.bench._timing import time_graph
from replaymoe.bench.moe import SHAPES


@triton.jit
def read_kernel(p, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out[pid] = the fp32 sum of ``ITERS`` blocks of ``BLOCK`` bf16 elements (a read that cannot be
    optimized away)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(p + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def best_read_us(nbytes: int) -> tuple[float, tuple]:
    """The fastest read of ``nbytes`` (a bf16 buffer) over the config sweep: (µs, (block, iters, warps))."""
    n = nbytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    best = None
    for block in (1024, 2048, 4096):
        for iters in (1, 2, 4, 8):
            for warps in (4, 8):
                grid = triton.cdiv(n, block * iters)
                out = torch.empty(grid, device="cuda")
                us = time_graph(
                    lambda grid=grid, out=out, block=block, iters=iters, warps=warps: read_kernel[(grid,)](
                        x, out, n, BLOCK=block, ITERS=iters, num_warps=warps
                    ),
                    rep_ms=50,
                )
                if best is None or us < best[0]:
                    best = (us, (block, iters, warps))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3,mixtral,deepseek")
    ap.add_argument("--tokens", default="1,8,64")
    a = ap.parse_args()
    card = torch.cuda.get_device_name()
    lines = [f"# {card}: bench/read_floors.py --shapes {a.shapes} --tokens {a.tokens}"]
    print(lines[0], flush=True)
    for name in a.shapes.split(","):
        H, I, E, K = SHAPES[name][:4]  # noqa: E741
        for T in map(int, a.tokens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            logits = torch.randn(T, E, device="cuda", generator=g)
            ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1).indices
            active = int(torch.unique(ids).numel())
            for dtype, size in (("bf16", 2), ("fp8", 1)):
                nbytes = active * 3 * H * I * size
                us, cfg = best_read_us(nbytes)
                line = (
                    f"{name} T={T} {dtype}: {active} experts, {nbytes / 1e6:.2f} MB read in {us:.1f} us "
                    f"({nbytes / us / 1e6:.2f} TB/s); goal 3 bound 1.10 x = {1.1 * us:.1f} us; config {cfg}"
                )
                print(line, flush=True)
                lines.append(line)
                torch.cuda.empty_cache()
    (Path(os.environ.get("OUT", ".")) / "read_floors.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One GPU (nvidia-h100-x1 or nvidia-h200), in one go, on the GPU machine's own python3 (its CUDA torch)
# with this checkout's src first on the path; no venv is built (minutes the device budget rarely has):
#   test    the one-GPU tests: `gpu and not multigpu and not gpu_alone` in $WORKERS workers sharing the
#           card, then the `gpu_alone` ones one at a time (what `make test-gpu` runs, without the venv)
#   hf      `bench hf` as TRL generates (--train-mode): grouped_mm, replaymoe, R3's rollout, B = 16 and 64
#   keep    `bench hf` eager, B = 1 and 8: capture's and replay's cost in generate against plain replaymoe
#   trl     `bench trl` at bench size (trainers one after the other, two rounds), then with a static
#           cache and generate compiled (--compile-generate), and at medium size (alternating step by step)
#   moe     `bench moe --check-ids` (the caller-id check's cost at T = 1) and `--launches` (a decode
#           layer call's device operations)
# Each step has its own time limit and writes under $OUT (logs, CSV/JSON); a short summary is printed.
# Wheels the machine lacks (pytest-xdist, execnet, trl, datasets, dill, multiprocess) are installed from
# .whl/ when it is there (git-ignored; carry it: see the tool library's device/README.md).
# WORKERS defaults to 6 on a card of more than 100 GB (H200) and 4 below (6 ran 4 tests out of memory on an
# 80 GB H100).
# Usage (repo root):  OUT=/some/dir STEPS="test hf" bash scripts/gpu_one.sh   (default STEPS: all five)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
STEPS="${STEPS:-test hf keep trl moe}"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${MIB:-0}" -gt 100000 ]; then WORKERS="${WORKERS:-6}"; else WORKERS="${WORKERS:-4}"; fi
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_one_site \
    .whl/*.whl >/dev/null 2>&1 || echo "gpu_one: installing .whl/ failed; going on without it"
fi
export PYTHONPATH="/tmp/gpu_one_site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/card.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log under $OUT, print its last lines
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?, $((SECONDS - t0)) s"
  grep -v "^\[transformers\]" "$OUT/$name.log" | tail -6
}

for s in $STEPS; do
  case "$s" in
    test)
      step test 360 python3 -m pytest -q -n "$WORKERS" --tb=short -m "gpu and not multigpu and not gpu_alone" tests
      step test_alone 200 python3 -m pytest -q --tb=short -m "gpu_alone and not multigpu" tests ;;
    hf)
      step hf 300 python3 -m replaymoe bench hf --batch 16,64 --prompt 8 --new 64 --modes eager --train-mode \
        --impls grouped_mm,replaymoe,replaymoe+rollout --repeats 8 --no-error --out "$OUT/hf" ;;
    keep)
      step keep 330 python3 -m replaymoe bench hf --batch 1,8 --prompt 64 --new 32 --modes eager \
        --impls replaymoe,replaymoe+replay,replaymoe+capture --repeats 12 --no-error --out "$OUT/keep" ;;
    trl)
      step trl_bench 300 python3 -m replaymoe bench trl --size bench --sequential --rounds 2 --steps 3 --warmup 1 \
        --out "$OUT/trl_bench"
      step trl_compiled 300 python3 -m replaymoe bench trl --size bench --sequential --cache static --compile-generate \
        --steps 4 --warmup 2 --out "$OUT/trl_compiled"
      step trl_medium 150 python3 -m replaymoe bench trl --size medium --steps 5 --warmup 2 --out "$OUT/trl_medium" ;;
    moe)
      step moe_check_ids 120 python3 -m replaymoe bench moe --check-ids --shapes qwen3,deepseek --out "$OUT/moe"
      step moe_launches 120 python3 -m replaymoe bench moe --launches --out "$OUT/moe" ;;
    *) echo "gpu_one: unknown step $s (test, hf, keep, trl, moe)" ;;
  esac
done

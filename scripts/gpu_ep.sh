#!/usr/bin/env bash
# Expert parallelism on the 4-GPU machine (nvidia-h200-x4), in one go:
#   1. environment facts (GPUs, NVLink topology, versions)
#   2. multigpu tests on 2 GPUs, then on 4 GPUs (nccl vs symm vs references, CUDA graph, ep_moe)
#   3. `replaymoe bench ep` on 4 GPUs (DeepSeek-V3 shapes), CSV/JSON under $OUT/bench
# Each step has its own time limit (`timeout` signals the step's whole process group) and the next one
# runs whatever happened before; the total stays under 8 minutes even with every step at its limit.
# Everything is written under $OUT; a short table is printed last.
# Usage (repo root):  OUT=/some/dir bash scripts/gpu_ep.sh
set -u
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_ep_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$(date +%s)

step() {  # step NAME LIMIT_S CMD...  -> $OUT/NAME.log, one line in the summary
  local name=$1 limit=$2
  shift 2
  local start rc
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  local what="ok"
  [ "$rc" -ne 0 ] && what="FAILED"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && what="TIMEOUT"
  echo "$name: $what (rc=$rc, ${took}s)" | tee -a "$SUMMARY"
  tail -n 8 "$OUT/$name.log"
}

step env 15 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())'"

NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "GPUs: $NGPU" | tee -a "$SUMMARY"

step test_2gpu 120 "$PY" -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[2]"
if [ "$NGPU" -ge 4 ]; then
  step test_4gpu 100 "$PY" -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[4]"
  # two runs, so that a symm failure (a device trap kills every rank) cannot cost the nccl figures
  step bench_nccl 140 "$PY" -m torch.distributed.run --nproc-per-node 4 -m replaymoe.cli bench ep \
    --out "$OUT/bench" --name ep_nccl_naive --impls nccl,naive --iters 20 --warmup 3
  step bench_symm 90 "$PY" -m torch.distributed.run --nproc-per-node 4 -m replaymoe.cli bench ep \
    --out "$OUT/bench" --name ep_symm --impls symm --iters 20 --warmup 3
else
  echo "fewer than 4 GPUs: 4-GPU test and benchmark skipped" | tee -a "$SUMMARY"
fi

echo
echo "################ summary (${OUT}) — $(( $(date +%s) - T0 ))s total"
cat "$SUMMARY"
for f in test_2gpu test_4gpu; do
  [ -f "$OUT/$f.log" ] && grep -E "^PASS|passed|failed|Error|error" "$OUT/$f.log" | tail -n 6
done
for f in bench_nccl bench_symm; do
  [ -f "$OUT/$f.log" ] && grep -E "^ERROR|Error|error|capture failed" "$OUT/$f.log" | grep -v "^\[rank [1-9]" | head -n 6
done
if [ -d "$OUT/bench" ]; then
  # from the saved rows (partial results of a run that timed out included)
  "$PY" -m replaymoe.cli bench ep --summary-from "$OUT/bench" > "$OUT/bench_summary.txt" 2>&1
  sed -n '/^# dispatch alone, bf16/,$p' "$OUT/bench_summary.txt"
fi

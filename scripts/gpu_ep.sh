#!/usr/bin/env bash
# Expert parallelism on a multi-GPU machine (nvidia-h200-x2, -x4 or -x8), in one go:
#   1. environment facts (GPUs, NVLink topology, versions); DeepEP v1.2.1 built in the background
#      (from .peers_ep/, git-ignored and carried: DeepEP-v1.2.1.tar.gz + build_deepep.sh), if present
#   2. multigpu tests at world = every GPU (and 2): nccl vs symm vs references, steady state, CUDA graph, ep_moe,
#      and the EP backward (world 2 and every GPU)
#   3. `replaymoe bench ep` on every GPU, DeepSeek-V3 shape, bf16 payload, 128/1024/4096 tokens/rank, eager and
#      graph, symm at num_sms 24/32/66/132 (persistent kernels) and unset (dense grids), symm_2k (the same
#      with the two-kernel combine), nccl, DeepEP side by side (--peer deepep, 24 SMs); IMPLS= narrows ours
# Each step has its own time limit (`timeout` signals the step's whole process group) and the next one
# runs whatever happened before. Everything is written under $OUT; a short table is printed last.
#   (profile: where the host time of a steady-state eager call goes, `bench ep --host-profile`)
#   (bench2, on 3+ GPUs: the same table at ep = 2 on GPUs 0-1, DeepEP too if the bench step built it; not in
#    the default STEPS)
#   (combine: the pipelined combine against the two kernels, both forced (symm_pipe / symm_2k), 24 SMs and
#    every SM, 128 ... 4096 tokens/rank, on every GPU and on 2: the measurements behind
#    `ep.transport_symm.pipe_min_rows`; not in the default STEPS)
# Usage (repo root):  OUT=/some/dir bash scripts/gpu_ep.sh      (STEPS="test profile bench" by default)
set -u
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_ep_out}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-test profile bench}"
TOKENS="${TOKENS:-128,1024,4096}"
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
  tail -n 6 "$OUT/$name.log"
}

NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "GPUs: $NGPU" | tee -a "$SUMMARY"
PEER=none
if [ -f .peers_ep/build_deepep.sh ] && [[ " $STEPS " == *" bench "* ]]; then
  # build while the tests run (CPU-bound nvcc vs GPU tests); no self-test (its tuning run costs minutes)
  ( DEEPEP_SELFTEST=0 OUT=/tmp/deepep_out timeout -k 10 300 bash .peers_ep/build_deepep.sh > "$OUT/deepep_build_step.log" 2>&1;
    echo "rc=$?" >> "$OUT/deepep_build_step.log" ) &
  BUILD_PID=$!
  PEER=deepep
fi
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; nvidia-smi topo -m;
  $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())'; } >> "$SUMMARY" 2>&1

if [[ " $STEPS " == *" test "* ]]; then
  step test_2gpu 150 "$PY" -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[2]"
  # (REPLAYMOE_EP_FUSED sets the process default of MoeAlltoAll(fused_barrier=, fused_plan=))
  if ! grep -q "1 passed" "$OUT/test_2gpu.log"; then  # the in-kernel barrier failed: torch's barrier from here on
    export REPLAYMOE_EP_FUSED=0 REPLAYMOE_FAST_LAUNCH=0
    echo "REPLAYMOE_EP_FUSED=0 REPLAYMOE_FAST_LAUNCH=0 from here on" | tee -a "$SUMMARY"
    step test_2gpu_unfused 120 "$PY" -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[2]"
  fi
  if [ "$NGPU" -ge 4 ]; then
    step "test_${NGPU}gpu" 150 "$PY" -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[$NGPU]"
  fi
  # the EP backward (ep_moe's gradients against fp64 single-GPU autograd; nccl and symm bitwise equal)
  for w in 2 4 8; do
    if [ "$NGPU" -ge "$w" ] && { [ "$w" -eq 2 ] || [ "$w" -eq "$NGPU" ]; }; then
      step "test_backward_${w}gpu" 320 "$PY" -m pytest -q -x -rA -m multigpu \
        "tests/test_ep_backward_multigpu.py::test_ep_moe_backward_multigpu[$w]"
    fi
  done
fi
if [[ " $STEPS " == *" profile "* ]]; then
  step profile 90 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" -m replaymoe bench ep \
    --host-profile --impls symm --tokens 128,4096 --iters 20
fi
if [[ " $STEPS " == *" bench "* ]]; then
  if [ "$PEER" = deepep ]; then
    wait "$BUILD_PID"
    cat "$OUT/deepep_build_step.log"
    grep -q "DeepEP built" "$OUT/deepep_build_step.log" || PEER=none
  fi
  step bench 200 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" -m replaymoe bench ep \
    --out "$OUT/bench" --name ep_x"$NGPU" --impls "${IMPLS:-nccl,symm,symm_2k}" --payloads bf16 --tokens "$TOKENS" \
    --num-sms "${NUM_SMS:-24,32,66,132,0}" --peer "$PEER" --peer-sms 24 --no-layer --iters 20 --warmup 3
  if [ "${REPLAYMOE_EP_FUSED:-1}" != 0 ] && [ "${VARIANTS:-1}" = 1 ]; then
    # the same machine, symm without the in-kernel barrier / without the fused plan too (for comparison)
    for v in "unfused_barrier --unfused-barrier" "unfused --unfused-barrier --unfused-plan"; do
      set -- $v
      name=$1
      shift
      echo "### bench ep $*" >> "$OUT/bench.log"
      timeout -k 10 90 "$PY" -m torch.distributed.run \
        --nproc-per-node "$NGPU" -m replaymoe bench ep --out "$OUT/bench" --name "ep_x${NGPU}_$name" --impls symm \
        --payloads bf16 --tokens "$TOKENS" --num-sms 24,0 --no-layer --iters 20 --warmup 3 "$@" >> "$OUT/bench.log" 2>&1
    done
  fi
  rm -f "$OUT"/bench/*.json "$OUT/deepep_build_step.log"  # (the CSVs hold the rows; the returned files are few)
fi

if [[ " $STEPS " == *" bench2 "* ]] && [ "$NGPU" -gt 2 ]; then
  # ep = 2 on GPUs 0-1 of the same machine (the 2-GPU table when only a larger machine is lent); DeepEP if the
  # bench step built it
  step bench2 150 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m torch.distributed.run --nproc-per-node 2 -m replaymoe \
    bench ep --out "$OUT/bench" --name ep_x2 --impls "${IMPLS:-nccl,symm,symm_2k}" --payloads bf16 \
    --tokens "$TOKENS" --num-sms "${NUM_SMS:-24,32,66,132,0}" --peer "$PEER" --peer-sms 24 --no-layer --iters 20 \
    --warmup 3
  rm -f "$OUT"/bench/*.json
fi

if [[ " $STEPS " == *" combine "* ]]; then
  for n in $(printf "%s\n" "$NGPU" 2 | sort -un); do
    [ "$n" -gt "$NGPU" ] && continue
    step "combine_x$n" 150 env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" "$PY" -m torch.distributed.run \
      --nproc-per-node "$n" -m replaymoe bench ep --out "$OUT/bench" --name "combine_x$n" \
      --impls symm,symm_pipe,symm_2k --payloads bf16 --tokens 128,256,512,1024,2048,4096 --num-sms 24,0 \
      --no-layer --iters 20 --warmup 3
  done
  rm -f "$OUT"/bench/*.json
fi

echo
echo "################ summary (${OUT}) — $(( $(date +%s) - T0 ))s total"
cat "$SUMMARY"
for f in "$OUT"/test_*gpu.log; do
  [ -f "$f" ] && grep -E "^PASS|passed|failed|Error|error" "$f" | tail -n 8
done
if [ -f "$OUT/profile.log" ]; then
  grep -E "^\[host\]" "$OUT/profile.log" | grep -v cProfile
fi
for f in "$OUT/bench.log" "$OUT/bench2.log"; do
  [ -f "$f" ] || continue
  echo "## $(basename "$f" .log)"
  grep -E "^ERROR|Error|capture failed|DeepEP" "$f" | grep -v "^\[rank [1-9]" | head -n 8
  sed -n '/^# goal 1/,$p' "$f"
done
for f in "$OUT"/combine_x*.log; do
  [ -f "$f" ] && { echo "## $(basename "$f" .log)"; sed -n '/^# symm combine/,/^$/p' "$f"; }
done

# the device tool returns at most 8 files from $OUT: every log and CSV goes into one archive, beside the summary
# and the main table's CSV
( cd "$OUT" && tar czf all_logs.tgz --exclude=all_logs.tgz -- *.log bench 2>/dev/null \
    && find . -name '*.log' -delete \
    && find bench -name '*.csv' ! -name "ep_x${NGPU}.csv" ! -name ep_x2.csv -delete 2>/dev/null )
echo "files in $OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"

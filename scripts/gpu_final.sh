#!/usr/bin/env bash
# Lead's closing GPU run on nvidia-h200-x4, inside one call:
#   routing GPU tests + `bench routing` on GPU 3, concurrently with the 2-GPU EP test on GPUs 0,1;
#   then the 4-GPU EP test and `bench ep` (nccl + naive peer, then symm).
# Usage (repo root): OUT=dir bash scripts/gpu_final.sh
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
OUT="${OUT:-$PWD/gpu_final_out}"; mkdir -p "$OUT"; SUM="$OUT/summary.txt"; : > "$SUM"
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $(( $(date +%s) - s ))s" | tee -a "$SUM"; }
nvidia-smi topo -m > "$OUT/topo.log" 2>&1
( export CUDA_VISIBLE_DEVICES=3
  step routing_gpu 120 python3 -m pytest -q -x -m gpu tests/test_routing_gpu.py
  step bench_routing 60 python3 -m replaymoe bench routing --out "$OUT" ) &
RPID=$!
step ep_2gpu 110 python3 -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[2]"
wait $RPID
step ep_4gpu 80 python3 -m pytest -q -x -rA -m multigpu "tests/test_ep_multigpu.py::test_ep_multigpu[4]"
step bench_ep_nccl 95 python3 -m torch.distributed.run --nproc-per-node 4 -m replaymoe bench ep \
  --out "$OUT" --name ep_nccl_naive --impls nccl,naive --iters 10 --warmup 2
step bench_ep_symm 60 python3 -m torch.distributed.run --nproc-per-node 4 -m replaymoe bench ep \
  --out "$OUT" --name ep_symm --impls symm --iters 10 --warmup 2
echo "######## total $(( $(date +%s) - T0 ))s"; cat "$SUM"
for f in routing_gpu ep_2gpu ep_4gpu; do echo "--- $f"; grep -E "passed|failed|Error" "$OUT/$f.log" | tail -4; done
for f in bench_routing bench_ep_nccl bench_ep_symm; do echo "--- $f"; tail -n 22 "$OUT/$f.log"; done

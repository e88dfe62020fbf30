#!/usr/bin/env bash
# The `trl` extra's range, tested: the TRL tests (tests/test_trl.py, test_trl_r3.py, test_trl_vllm.py: GRPO
# with enable(), R3GRPOTrainer over checkpointing, bf16, num_iterations, gradient accumulation, beta, the
# vLLM colocate path, the demo) against each trl release given, each installed alone into a scratch folder
# that shadows the venv's trl (no other package changes). CPU, about 15 s per release.
# Usage (repo root, after `make venv`):  bash scripts/check_trl_range.sh [VERSION ...]
#   (default: the ends of the extra's range and a few between)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(1.7.1 1.9.0 1.12.0 1.14.0 1.15.0 1.16.0)
SCRATCH="${SCRATCH:-$(mktemp -d)}"
# trl before 1.16 imports requests in its vLLM client without declaring it where the venv may lack it
"$PY" -m pip install -q --target "$SCRATCH/requests" requests || { echo "could not install requests"; exit 2; }
status=0
for v in "${VERSIONS[@]}"; do
  dir="$SCRATCH/trl-$v"
  if ! "$PY" -m pip install -q --no-deps --target "$dir" "trl==$v"; then
    echo "trl $v: could not install"; status=2; continue
  fi
  line=$(PYTHONPATH="$dir:$SCRATCH/requests:src" "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_trl.py tests/test_trl_r3.py tests/test_trl_vllm.py 2>&1 | tail -n 1)
  echo "trl $v: $line"
  case "$line" in *failed*|*error*|"") status=1 ;; esac
done
exit $status

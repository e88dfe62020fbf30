#!/usr/bin/env bash
# An extra's version range, tested: the tests that exercise PACKAGE (trl or transformers), run against
# each release given, each installed alone into a scratch folder that shadows the venv's copy (no other
# package changes). CPU; about 15 s per trl release, 90 s per transformers release (two workers).
#   trl:          tests/test_trl*.py (GRPO with enable(), R3GRPOTrainer over checkpointing, bf16,
#                 num_iterations, gradient accumulation, beta, the vLLM colocate path, the demo)
#   transformers: the hf and TRL tests (capture, replay, checkpointing in every mode, compile, the static
#                 cache, FSDP2 on gloo, the README's examples)
# Usage (repo root, after `make venv`):  bash scripts/check_range.sh PACKAGE [VERSION ...]
#   (default versions: the ends of the extra's range and a few between)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
PKG="${1:-}"
shift || true
TRL_TESTS=(tests/test_trl.py tests/test_trl_r3.py tests/test_trl_vllm.py)
case "$PKG" in
  trl) DEFAULT=(1.7.1 1.9.0 1.12.0 1.14.0 1.15.0 1.16.0); TESTS=("${TRL_TESTS[@]}") ;;
  transformers)
    DEFAULT=(5.16.1 5.17.0 5.22.2 5.23.0 5.24.0)
    TESTS=(tests/test_hf.py tests/test_hf_aux_loss.py tests/test_hf_compile.py tests/test_hf_replay_training.py
           tests/test_hf_static_cache.py tests/test_hf_step_rows.py tests/test_hf_fsdp.py tests/test_hf_recompute.py
           tests/test_bench_hf.py tests/test_readme.py "${TRL_TESTS[@]}") ;;
  *) echo "usage: bash scripts/check_range.sh trl|transformers [VERSION ...]"; exit 2 ;;
esac
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=("${DEFAULT[@]}")
SCRATCH="${SCRATCH:-$(mktemp -d)}"
# trl before 1.16 imports requests in its vLLM client without declaring it where the venv may lack it
"$PY" -m pip install -q --target "$SCRATCH/requests" requests || { echo "could not install requests"; exit 2; }
status=0
for v in "${VERSIONS[@]}"; do
  dir="$SCRATCH/$PKG-$v"
  if ! "$PY" -m pip install -q --no-deps --target "$dir" "$PKG==$v"; then
    echo "$PKG $v: could not install"; status=2; continue
  fi
  line=$(PYTHONPATH="$dir:$SCRATCH/requests:src" "$PY" -m pytest -q -n 2 -p no:cacheprovider "${TESTS[@]}" 2>&1 \
    | tail -n 1)
  echo "$PKG $v: $line"
  case "$line" in *failed*|*error*|"") status=1 ;; esac
done
exit $status

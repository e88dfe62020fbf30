# Set-up-included entry points for a fresh machine.
#   make test      -> venv + installs + mypy + the CPU test suite (what CI runs, through .ci/run)
#   make demo      -> venv + installs + `replaymoe demo` (Triton kernels on a GPU, torch reference on CPU)
#   make test-gpu  -> the gpu/multigpu tests (on a GPU machine)
# scripts/install.sh does the installing: on a machine whose python3 already has a CUDA torch (GPU
# machines, often offline) it reuses that torch and installs only what is missing; elsewhere it
# installs a CPU torch==2.13.0 plus the triton/numpy the Triton-interpreter tests need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.replaymoe-installed
# extra pip arguments for torch on a CPU machine, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# reuse the torch python3 already has: auto (a CUDA/ROCm build), 1 (any), 0 (never)
REUSE_TORCH ?= auto
# what `make test` / `make test-gpu` run (e.g. TESTS=tests/test_routing_gpu.py)
TESTS ?= tests

.PHONY: venv typecheck test test-gpu demo lint format clean

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON="$(PYTHON)" VENV="$(VENV)" TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" REUSE_TORCH="$(REUSE_TORCH)" \
		bash scripts/install.sh
	touch $(STAMP)

venv: $(STAMP)

# mypy on record/, routing/ and moe/ (pyproject.toml [tool.mypy]: the packages, the modules left out);
# about 15 s from cold, a second or two with its cache (.mypy_cache)
typecheck: $(STAMP)
	$(PY) -m mypy

test: $(STAMP) typecheck
	$(PY) -m pytest -q -n 2 $(TESTS)

# one-GPU tests in 6 workers sharing the GPU (305 tests in 241 s on an H100), then the memory-heavy ones
# alone (marker gpu_alone: DeepSeek-V3's experts; 4 tests, 94 s), then the multi-GPU tests alone (each
# spawns a process per GPU)
GPU_WORKERS ?= 6
test-gpu: $(STAMP)
	$(PY) -m pytest -q -n $(GPU_WORKERS) -m "gpu and not multigpu and not gpu_alone" $(TESTS)
	$(PY) -m pytest -q -m "gpu_alone and not multigpu" $(TESTS)
	$(PY) -m pytest -q -m multigpu $(TESTS)

demo: $(STAMP)
	$(PY) -m replaymoe demo

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format: $(STAMP)
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache

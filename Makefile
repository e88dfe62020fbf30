# Set-up-included entry points for a fresh machine.
#   make test   -> venv + installs + the CPU test suite (what CI runs)
#   make demo   -> venv + installs + `replaymoe demo` (GPU when present, else CPU)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.replaymoe-installed

.PHONY: venv test test-gpu demo lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare `torch` would pull several GB of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.6.0 "numpy<2.3"
	$(PY) -m pip install -q -e ".[dev,plot,hf]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m "gpu or multigpu" tests

demo: $(STAMP)
	$(VENV)/bin/replaymoe demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

format: $(STAMP)
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

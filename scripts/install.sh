#!/usr/bin/env bash
# Create $VENV and install replaymoe in it (what `make test`, `make demo` and CI run first).
#
# Two kinds of machine, told apart by whether $PYTHON already imports a CUDA build of torch
# (REUSE_TORCH below overrides the choice):
#
# * GPU machine (a CUDA torch is there; often offline): REUSE it. The venv is created with
#   --system-site-packages (and, when $PYTHON itself runs in a venv, that venv's site-packages are
#   added through a .pth file: --system-site-packages only reaches the base interpreter's). The
#   project is installed editable with --no-deps --no-build-isolation (nothing downloaded; torch
#   and triton untouched); a missing test/demo dependency is installed with torch and triton held
#   at the versions present. triton and numpy are never pinned here.
# * CPU machine: a CPU torch==$TORCH_VERSION (on a machine whose index serves the CUDA build, pass
#   the CPU index, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"), then,
#   only if that torch is a CPU build, triton==3.6.0 and numpy<2.3, the versions under which the
#   Triton-interpreter tests are known to be correct; then the project with its extras.
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:-}
EXTRAS=${EXTRAS:-dev,plot,hf,trl}
# the transformers release the CPU suite runs against (the hf extra allows a range; CI tests this one,
# TRANSFORMERS_VERSION=5.24.0 make test the range's other end)
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.17.0}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

say() { echo "install: $*"; }

# REUSE_TORCH: auto (default) = reuse a CUDA (or ROCm) build of torch that $PYTHON imports; 1 = reuse
# any torch it imports (e.g. a CPU build already installed); 0 = never reuse.
REUSE_TORCH=${REUSE_TORCH:-auto}
case "$REUSE_TORCH" in
    auto) reuse_check="import sys, torch; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)" ;;
    1) reuse_check="import torch" ;;
    0) reuse_check="import sys; sys.exit(1)" ;;
    *) echo "install: error: REUSE_TORCH must be auto, 1 or 0, got '$REUSE_TORCH'" >&2; exit 2 ;;
esac

if "$PYTHON" -c "$reuse_check" 2>/dev/null; then
    # ------------------------------------------------------------------ reuse the CUDA torch
    say "reusing the torch of $PYTHON ($("$PYTHON" -c \
        'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>/dev/null \
        || echo 'no triton'))"
    if ! test -x "$PY"; then
        # an interpreter without ensurepip (e.g. Debian's without python3-venv): no pip in the venv;
        # the parent's pip serves it through the site-packages made visible below
        "$PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null \
            || { rm -rf "$VENV" && "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"; }
    fi
    purelib=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    if "$PYTHON" -c "import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)"; then
        # $PYTHON is itself a venv: make its site-packages visible too
        "$PYTHON" -c "import site; print('\n'.join(site.getsitepackages()))" >"$purelib/_replaymoe_parent_env.pth"
    fi
    "$PY" -c "import torch" || {
        say "error: the venv $VENV does not see $PYTHON's torch (remove $VENV and retry)"
        exit 1
    }
    if ! "${PIP[@]}" --no-deps --no-build-isolation -e . 2>"$VENV/editable-install.log"; then
        # e.g. a setuptools older than 77 (no PEP 639 license strings) and no network to fetch a newer
        # one: the same result by hand, src/ on the path and the console script
        say "editable install failed (see $VENV/editable-install.log); adding $(pwd)/src through a .pth file"
        echo "$(pwd)/src" >"$purelib/_replaymoe_src.pth"
        printf '#!%s\nimport sys\n\nfrom replaymoe.apps.cli import main\n\nsys.exit(main())\n' \
            "$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" >"$VENV/bin/replaymoe"
        chmod +x "$VENV/bin/replaymoe"
    fi
    # what the tests and the demo need, by import name -> requirement
    missing=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "pytest": "pytest>=8", "xdist": "pytest-xdist", "matplotlib": "matplotlib",
        "transformers": "transformers>=5.16.1,<5.25", "tqdm": "tqdm"}
print(" ".join(req for mod, req in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
    if [ -n "$missing" ]; then
        say "installing what is missing: $missing (torch and triton held where they are)"
        "$PY" -c "import torch, triton; print(f'torch=={torch.__version__}\ntriton=={triton.__version__}')" \
            >"$VENV/held.txt"
        # shellcheck disable=SC2086
        "${PIP[@]}" -c "$VENV/held.txt" $missing || {
            say "error: could not install $missing (offline? carry them as wheels and pip install --no-index)"
            exit 1
        }
    fi
    # mypy (make test's type check; make test-gpu and make demo do not need it) at the dev extra's pin:
    # best effort, so that an offline machine without it still installs
    mypy_req=$(sed -n 's/.*"\(mypy==[^"]*\)".*/\1/p' pyproject.toml | head -n 1)
    mypy_have=$("$PY" -c "import importlib.metadata as m; print(m.version('mypy'))" 2>/dev/null || true)
    if [ -n "$mypy_req" ] && [ "mypy==$mypy_have" != "$mypy_req" ]; then
        "${PIP[@]}" "$mypy_req" || say "note: could not install $mypy_req (make test's type check needs it)"
    fi
else
    # ------------------------------------------------------------------ CPU machine
    test -x "$PY" || "$PYTHON" -m venv "$VENV"
    # shellcheck disable=SC2086
    "${PIP[@]}" "torch==$TORCH_VERSION" $TORCH_PIP_ARGS
    if "$PY" -W ignore -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
        "${PIP[@]}" triton==3.6.0 "numpy<2.3"
    else
        say "note: the index served a CUDA build of torch; triton is left at torch's own pin" \
            "(for a CPU build: TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu')"
    fi
    "${PIP[@]}" -e ".[$EXTRAS]" "transformers==$TRANSFORMERS_VERSION"
fi
"$PY" -c "import torch, triton, replaymoe
print(f'install: ok: replaymoe {replaymoe.__version__}, torch {torch.__version__} '
      f'({\"CUDA \" + torch.version.cuda if torch.version.cuda else \"CPU\"} build, '
      f'GPU: {torch.cuda.is_available()}), triton {triton.__version__}')"

"""Test configuration.

* CPU machines (CI): torch references everywhere, Triton kernels under the interpreter.
  ``TRITON_INTERPRET=1`` must be set before Triton decorates any kernel, so it is set
  here, before any replaymoe kernel module is imported, when there is no GPU.
* ``-m gpu`` / ``-m multigpu`` tests are skipped without enough CUDA devices.
* ``--device cpu`` runs the CPU suite on a GPU machine too (GPU tests skipped); ``--device cuda``
  makes a missing GPU an error instead of a skip (on the GPU machines, so that a broken CUDA setup
  cannot pass as "all skipped"); ``--device auto`` (default) uses what there is. The ``device``
  fixture gives the chosen device.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Importing dynamo (after TRITON_INTERPRET: it imports Triton) builds its table of torch functions
# once per process. Some tests poison ``torch.empty`` by patching the torch module; were dynamo first
# imported inside such a test, the table would hold the patched function and every later
# ``torch.compile`` in that process would reject the real ``torch.empty``. So import it first.
import torch._dynamo  # noqa: E402, F401

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: skip GPU tests even with a GPU; cuda: fail without one; auto: use what there is",
    )


def pytest_configure(config):
    if config.getoption("--device") == "cuda" and not HAS_CUDA:
        raise pytest.UsageError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if HAS_CUDA and config.getoption("--device") != "cpu" else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs >= 2 CUDA GPUs")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (CPU interpreter run)")
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


@pytest.fixture
def generator():
    """A freshly seeded CPU generator per test (seed from the test's name, reproducible)."""
    import zlib

    g = torch.Generator()
    g.manual_seed(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "x").encode()))
    return g


@pytest.fixture
def device(request) -> torch.device:
    """The device tests run on: ``--device``, or CUDA when there is one (``auto``)."""
    choice = request.config.getoption("--device")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and HAS_CUDA) else "cpu")


@pytest.fixture
def one_thread():
    """Tiny models are latency-bound; one intra-op thread avoids OpenMP barrier stalls under -n 2."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

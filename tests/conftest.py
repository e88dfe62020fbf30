"""Test configuration.

* CPU machines (CI): torch references everywhere, Triton kernels under the interpreter.
  ``TRITON_INTERPRET=1`` must be set before Triton decorates any kernel, so it is set
  here, before any replaymoe kernel module is imported, when there is no GPU.
* ``-m gpu`` / ``-m multigpu`` tests are skipped without enough CUDA devices.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if HAS_CUDA else 0
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

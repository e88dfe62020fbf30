"""Run one of the project's ``scripts/`` in a fresh Python process, outside Triton's interpreter.

The sm_90 compile checks (``scripts/*_ptx_check.py``) compile kernels for Hopper without a GPU. The
test process itself runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``), so they need
a process of their own with that variable removed and ``src`` on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python scripts/<name> *args`` without ``TRITON_INTERPRET``; stdout and stderr captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip

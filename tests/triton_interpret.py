"""Run a kvlab parity harness under Triton's CPU interpreter, in a subprocess:
``TRITON_INTERPRET=1`` must be set before Triton is first imported, which this process may
already have done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(module: str) -> dict:
    """``python -m module`` with ``TRITON_INTERPRET=1``; the JSON on its last stdout line."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", module], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

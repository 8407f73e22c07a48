"""Run a kernel module's ``--layout-facts`` entry point in a fresh process (the CuTe DSL picks its
target arch when ``cutlass`` is first imported, so the arch is set before Python starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def layout_facts(module: str) -> dict:
    """The JSON facts that ``python -m <module> --layout-facts`` prints last (sm_90a, no GPU needed)."""
    proc = subprocess.run([sys.executable, "-m", module, "--layout-facts"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])

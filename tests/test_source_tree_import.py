"""A checkout that is not installed still finds cula.kernels & co. (the GPU machine's setup can skip the
install: then dispatch must not silently lose the kernels)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import sys
# drop the editable install's finder: what a plain, uninstalled checkout sees
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import cula.kernels.common.ptx_check, cula.suites, cula.reports, cula.cli
import cula.kernels
print(cula.kernels.__file__)
"""


def test_uninstalled_checkout_imports_the_top_level_packages():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert os.path.samefile(out.stdout.strip(), os.path.join(ROOT, "kernels", "__init__.py"))

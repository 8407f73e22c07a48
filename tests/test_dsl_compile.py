"""kernels/common/dsl_compile.py: compiles without the DSL's source-text lookups give the same PTX, and the swap of
the DSL's ``inspect`` is scoped (nested, concurrent-safe by count, undone on errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

_SAME_PTX = r"""
import glob, hashlib, json, os, sys
from cutlass.base_dsl.compiler import Compiler
Compiler._check_cuda_dependencies_once = lambda *a, **k: None
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from cula.kernels.common import dsl_compile
from cula.kernels.sm90 import kda_fwd_raw_tiles as raw

out, d = {}, os.environ["CUTE_DSL_DUMP_DIR"]
for name, compile_fn in (("plain", cute.compile), ("lines_only", dsl_compile.compile)):
    try:
        compile_fn(raw.RawTilesProbe("log"), *raw.fake_args(), make_fake_stream())
    except Exception:  # loading into a missing driver fails after the PTX is written
        pass
    out[name] = []
    for p in sorted(glob.glob(os.path.join(d, "*.ptx"))):
        out[name].append(hashlib.sha256(open(p, "rb").read()).hexdigest())
    for p in glob.glob(os.path.join(d, "*")):
        os.remove(p)
print(json.dumps(out))
"""


def test_lines_only_compiles_the_same_ptx():
    """The raw-tile probe (a small kernel with nested jit calls) compiled by
    ``cute.compile`` and by ``dsl_compile.compile``: byte-identical PTX (session 40 found the same for stage 1's
    two three-CTA builds, whose compiles took 31.6 s and 17.3 s)."""
    pytest.importorskip("cutlass")
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": dump,
               "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
        proc = subprocess.run([sys.executable, "-c", _SAME_PTX], capture_output=True, text=True, timeout=300,
                              env=env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert len(out["plain"]) == 1 and out["plain"] == out["lines_only"]


def test_lines_only_is_scoped_and_counted():
    pytest.importorskip("cutlass")
    from cutlass.base_dsl._mlir_helpers import op as dsl_op

    from cula.kernels.common import dsl_compile

    original = dsl_op.inspect
    with dsl_compile.lines_only():
        assert dsl_op.inspect is dsl_compile._LineOnly
        with dsl_compile.lines_only():  # a nested (or concurrent) compile
            pass
        assert dsl_op.inspect is dsl_compile._LineOnly  # still swapped: the outer one is running
    assert dsl_op.inspect is original
    with pytest.raises(RuntimeError):
        with dsl_compile.lines_only():
            raise RuntimeError("a failing compile")
    assert dsl_op.inspect is original


def test_line_only_frame_info_keeps_file_line_and_function():
    from cula.kernels.common import dsl_compile

    def where():
        return dsl_compile._LineOnly.getframeinfo(sys._getframe())

    info = where()
    assert info.filename == __file__ and info.function == "where" and info.code_context is None
    assert info.lineno == info.positions.lineno == where.__code__.co_firstlineno + 1

"""``cute.compile`` without the DSL's source-text lookups: the same PTX in about half the time.

Every DSL op records where it was called through ``inspect.getframeinfo``, which reads the calling source line and,
for a line inside a comprehension, scans the file upwards to the enclosing ``def`` with a regular expression per
line. In our kernels (long ``@cute.jit`` methods, many comprehensions) that was ~45% of a compile: stage 1's two
three-CTA builds took 31.6 s on this project's CPU machine, 17.3 s without it, and their PTX was byte-identical
(session 40; ``tests/test_dsl_compile.py`` checks the identity on a small kernel). The op's location keeps its file,
line and function; only the source text in its name is dropped.

Used by the KDA launcher (``fast_launch.compile_launcher``), Lightning's ``_compile``, the AOT build and the PTX
checks. The swap is scoped (:func:`lines_only`) and counted, so concurrent compiles restore it once, after the last.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_depth = 0
_saved: Any = None


class _LineOnly:
    """``inspect`` as the DSL's op wrapper uses it (``currentframe``, ``getframeinfo``), without source lookups."""

    currentframe = staticmethod(inspect.currentframe)

    @staticmethod
    def getframeinfo(frame, context: int = 1) -> inspect.Traceback:
        line = frame.f_lineno
        return inspect.Traceback(frame.f_code.co_filename, line, frame.f_code.co_name, None, None,
                                 positions=dis.Positions(line, line, 0, 0))


@contextlib.contextmanager
def lines_only() -> Iterator[None]:
    """Within: DSL ops are located by file, line and function only (see the module docstring)."""
    global _depth, _saved
    from cutlass.base_dsl._mlir_helpers import op as dsl_op

    with _lock:
        if _depth == 0:
            _saved = dsl_op.inspect
            dsl_op.inspect = _LineOnly
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                dsl_op.inspect = _saved


def compile(fn, *args, **kwargs):  # noqa: A001 - the DSL's name, on purpose
    """``cute.compile(fn, *args, **kwargs)`` under :func:`lines_only`."""
    import cutlass.cute as cute

    with lines_only():
        return cute.compile(fn, *args, **kwargs)

"""cula: CuTe DSL linear-attention kernels for NVIDIA Hopper, drop-in compatible with FLA 0.6.0.

Variants live in submodules, imported on first use so that ``import cula`` stays cheap::

    from cula.kda import chunk_kda
    from cula.lightning import lightning_attn_fwd

``cula.backends()`` says which backend (``cula-sm90`` kernel, ``fla-triton``, ``torch-ref``) each op can
use on this machine, and ``cula.backends(op, **inputs)`` which one given inputs would take, and why.
"""

from __future__ import annotations

import importlib
from typing import Any

from cula._warn import CulaFallbackWarning

__version__ = "0.1.0"

_VARIANTS = ("kda", "gdn", "gla", "lightning", "ref")
_TOP_LEVEL = ("kernels", "suites", "reports", "cli")  # installed as cula.<name> (pyproject package-dir)


def _source_tree_fallback() -> None:
    """Make ``cula.kernels`` & co. importable from a checkout that is not installed.

    The install maps the top-level folders to ``cula.*``; without it (a plain ``python3`` in the repo
    root, e.g. on a GPU machine whose setup skipped the install because ``import cula`` found this
    folder) they would be missing and dispatch would silently lose the kernels. Then the repo root is
    searched for those sub-packages too.
    """
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if importlib.util.find_spec(f"{__name__}.kernels") is None and os.path.isfile(
        os.path.join(root, "kernels", "__init__.py")
    ):
        __path__.append(root)  # noqa: F821 - the package's own __path__


_source_tree_fallback()

__all__ = ["CulaFallbackWarning", "backends", *_VARIANTS]


def backends(op: str | None = None, /, *args: Any, **inputs: Any) -> Any:
    """Which backends the public ops can use, or which one given inputs would take.

    - ``backends()``: ``{op: [BackendStatus(backend, available, reason), ...]}`` for every op, in
      dispatch order, for this machine (inputs aside): e.g. ``cula-sm90`` is unavailable without a
      Hopper GPU or without its kernel module, ``fla-triton`` without CUDA.
    - ``backends(op)``: that op's list.
    - ``backends(op, *args, **inputs)``: the ``Decision`` the op would make for these arguments (given
      as to the op itself, e.g. ``backends("chunk_kda", q=q, k=k, v=v, g=g, beta=beta)``):
      ``decision.backend`` is the first usable candidate, ``decision.skipped`` the ``(backend, reason,
      environmental)`` of those passed over; ``str(decision)`` reads as one line. Invalid arguments
      raise ``ValueError`` exactly as the op would.

    ``op`` is the function name (``"chunk_kda"``, ``"lightning_attn_decode"``, ...); a dotted path such as
    ``"cula.kda.chunk_kda"`` or ``"kda.chunk_kda"`` also works.
    """
    from cula import _dispatch

    if op is None:
        if args or inputs:
            raise ValueError("op: expected an op name when inputs are given, got None")
        return _dispatch.availability()
    name = op.rsplit(".", 1)[-1]
    if not args and not inputs:
        _dispatch.candidates(name)
        return _dispatch.availability()[name]
    return _dispatch.explain(name, *args, **inputs)


def __getattr__(name: str) -> Any:
    if name in _VARIANTS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

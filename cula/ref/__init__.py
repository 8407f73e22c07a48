"""Exact torch references for every variant: ``recurrent`` (token by token) and ``chunked`` forms.

Modules: :mod:`cula.ref.lightning`, :mod:`cula.ref.kda`, :mod:`cula.ref.gdn`, :mod:`cula.ref.gla`
(each with ``recurrent(...)`` and ``chunked(..., chunk_size=64)`` taking the FLA 0.6.0 keyword names
plus keyword-only ``dtype``), and :mod:`cula.ref.pool` (decode state-pool gather / scatter).
They compute in ``dtype`` (fp32 by default, fp64 for oracles), are differentiable with autograd and
run on any device. Submodules are imported on first attribute access.
"""

import importlib

__all__ = ["gdn", "gla", "kda", "lightning", "pool"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

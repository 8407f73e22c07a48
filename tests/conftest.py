"""Shared pytest configuration for cula's tests.

Tests marked ``@pytest.mark.gpu`` need a CUDA device; on a machine without one they are skipped
automatically here, so each GPU test file does not have to repeat the check (they may still add their
own ``skipif`` for clarity).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when ``torch.cuda.is_available()`` is False; run the compile
    checks last (see PTX reports below)."""
    _compile_checks_last(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ------------------------------------------------------------------------------------ PTX reports
# Compile checks (``cula.kernels.common.ptx_check.ptx_report``) spawn a child that runs the CuTe DSL
# compiler, seconds to tens of seconds per target. For the session, ``ptx_report`` answers from one
# shared cache: each (module, target) compiles once however many tests ask for it, several targets of a
# module share a child, and the targets that the collected tests will ask for start compiling right
# after collection, at low priority on the core(s) the mostly single-threaded tests leave idle. The
# tests that ask run last, when their reports are ready. Only the scheduling changes: every report
# still comes from a fresh compile in this session, and a target that fails to compile fails each test
# that asks for it.


def _literal(node, params: dict, module_globals: dict):
    """The string value of a call argument: a literal, a parametrized argument, or a module constant."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        value = params[node.id] if node.id in params else module_globals.get(node.id)
        return value if isinstance(value, str) else None
    return None


_PTX_CALLS: dict = {}


def _ptx_requests(item: pytest.Item) -> list[tuple[str, str]]:
    """The (module, target) pairs that test ``item`` passes to ``ptx_report``, read from its source: a
    call ``ptx_report(module, target)`` with literals, the test's parameters or module constants is
    found, so new compile checks are prefetched without registering them anywhere (a call that is not
    understood simply compiles when the test runs)."""
    import ast
    import inspect
    import textwrap

    fn = getattr(item, "function", None)
    if fn is None:
        return []
    if fn not in _PTX_CALLS:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        _PTX_CALLS[fn] = [] if tree is None else [
            node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ptx_report"]
    params = getattr(getattr(item, "callspec", None), "params", {})
    pairs = []
    for call in _PTX_CALLS[fn]:
        args = dict(enumerate(call.args))
        args.update({{"module": 0, "target": 1}.get(k.arg, k.arg): k.value for k in call.keywords})
        module = _literal(args[0], params, fn.__globals__) if 0 in args else None
        target = _literal(args[1], params, fn.__globals__) if 1 in args else "default"
        if module and target:
            pairs.append((module, target))
    return pairs


def _compile_checks_last(items: list[pytest.Item]) -> None:
    """Compile checks last (stable order otherwise): their reports compile in the background meanwhile."""
    asks = [bool(_ptx_requests(item)) for item in items]
    items[:] = [it for it, a in zip(items, asks) if not a] + [it for it, a in zip(items, asks) if a]


_PTX_CACHE = pytest.StashKey()


def pytest_collection_finish(session: pytest.Session) -> None:
    import importlib.util
    import os

    from cula.kernels.common import ptx_check

    cache = ptx_check.ReportCache(workers=max(1, (os.cpu_count() or 1) - 1))
    ptx_check.share_reports(cache)
    session.config.stash[_PTX_CACHE] = cache
    if session.config.option.collectonly or importlib.util.find_spec("cutlass") is None:
        return
    cache.prefetch(pair for item in session.items for pair in _ptx_requests(item))


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = session.config.stash.get(_PTX_CACHE, None)
    if cache is not None:
        from cula.kernels.common import ptx_check

        cache.close()
        ptx_check.share_reports(None)

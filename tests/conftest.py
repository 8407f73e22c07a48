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
# Compile checks (``cula.kernels.common.ptx_check.ptx_report`` and ``ptx_reports``) spawn a child that
# runs the CuTe DSL compiler, seconds to tens of seconds per target. For the session, both answer from one
# shared cache: each (module, target) compiles once however many tests ask for it, several targets of a
# module share a child, and the targets that the collected tests will ask for start compiling right
# after collection, at low priority on the core(s) the mostly single-threaded tests leave idle. The
# tests that ask run last, when their reports are ready. Only the scheduling changes: every report
# still comes from a fresh compile in this session, and a target that fails to compile fails each test
# that asks for it.


def _literal(node, params: dict, module_globals: dict, local: dict | None = None):
    """The string value of a call argument: a literal, a parametrized argument, a name the test binds to a
    literal, or a module constant."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        if local and node.id in local and node.id not in params:
            return _literal(local[node.id], params, module_globals)
        value = params[node.id] if node.id in params else module_globals.get(node.id)
        return value if isinstance(value, str) else None
    return None


def _literals(node, params: dict, module_globals: dict, local: dict) -> list[str]:
    """The strings of a list or tuple argument (``ptx_reports(module, [a, b])``), literal or bound in the
    test to a literal list; elements that are not understood are left out (they compile when asked)."""
    import ast

    if isinstance(node, ast.Name) and node.id in local:
        node = local[node.id]
    if not isinstance(node, (ast.List, ast.Tuple)):
        return []
    found = (_literal(e, params, module_globals, local) for e in node.elts)
    return [t for t in found if t]


def _bindings(tree) -> dict:
    """Names the test assigns once from a literal: ``names = [...]``, ``a, b = "x", "y"``."""
    import ast

    out: dict = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Name):
            out[target.id] = value
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            out.update((t.id, v) for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name))
    return out


_PTX_CALLS: dict = {}


def _ptx_requests(item: pytest.Item) -> list[tuple[str, str]]:
    """The (module, target) pairs of cula's kernel modules that test ``item`` passes to ``ptx_report`` or
    ``ptx_reports``, read from its source: a call ``ptx_report(module, target)`` or ``ptx_reports(module,
    [targets])`` with literals, the test's parameters, names it binds to literals or module constants is
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
        _PTX_CALLS[fn] = ([], {}) if tree is None else ([
            node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("ptx_report", "ptx_reports")],
            _bindings(tree))
    calls, local = _PTX_CALLS[fn]
    params = getattr(getattr(item, "callspec", None), "params", {})
    pairs = []
    for call in calls:
        many = getattr(call.func, "id", getattr(call.func, "attr", None)) == "ptx_reports"
        args = dict(enumerate(call.args))
        args.update({{"module": 0, "target": 1, "targets": 1}.get(k.arg, k.arg): k.value for k in call.keywords})
        module = _literal(args[0], params, fn.__globals__, local) if 0 in args else None
        if many:
            targets = _literals(args[1], params, fn.__globals__, local) if 1 in args else []
        else:
            targets = [_literal(args[1], params, fn.__globals__, local) if 1 in args else "default"]
        if module and module.startswith("cula."):
            pairs += [(module, t) for t in targets if t]
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

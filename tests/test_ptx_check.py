"""cula.kernels.common.ptx_check: the child that compiles several targets, and the shared report cache.

The compile checks of the kernels (test_kernel_*.py) read their reports through the session cache set
up in conftest.py; these tests check that the sharing cannot change a report or hide a failure.
"""

from __future__ import annotations

import threading

import pytest

from cula.kernels.common import ptx_check

MODULE = "cula.kernels.sm90.lightning_decode"


def test_one_child_for_several_targets_gives_each_its_own_result():
    """A batched child compiles each target on its own: a failing target gets its own error, the next
    one the same PTX as its single-target compile (here, the session's shared report)."""
    pytest.importorskip("cutlass")
    results = ptx_check.compile_reports(MODULE, ["no_such_target", "default"])
    assert isinstance(results["no_such_target"], RuntimeError)
    assert "KeyError" in str(results["no_such_target"])
    alone = ptx_check.ptx_report(MODULE, "default")
    assert results["default"].ptx == alone.ptx and alone.kernels


class _FakeCompiler:
    """Stands in for ``compile_reports`` in a cache of its own (the session's cache keeps the real one):
    records the batches, fails the targets named ``bad*``."""

    def __init__(self):
        self.batches: list[tuple[str, list[str]]] = []
        self.lock = threading.Lock()

    def __call__(self, module, targets, timeout=600.0, started=None, nice=0):
        with self.lock:
            self.batches.append((module, list(targets)))
        return {t: RuntimeError(f"{t} failed") if t.startswith("bad") else
                ptx_check.PtxReport(ptx=f"{module}:{t}", ptxas_log="", kernels=[]) for t in targets}


def test_cache_compiles_each_target_once_and_keeps_failures():
    fake = _FakeCompiler()
    cache = ptx_check.ReportCache(workers=1, batch=2, compiler=fake)
    cache.prefetch([("m", "a"), ("m", "b"), ("m", "bad"), ("n", "a"), ("m", "a")])
    for _ in range(2):
        assert cache.get("m", "a").ptx == "m:a" and cache.get("n", "a").ptx == "n:a"
        assert cache.get("m", "b").ptx == "m:b"
        with pytest.raises(RuntimeError, match="bad failed"):
            cache.get("m", "bad")
        assert cache.get("m", "new").ptx == "m:new"  # never prefetched: compiled by the caller
    cache.close()
    compiled = sorted((m, t) for m, ts in fake.batches for t in ts)
    assert compiled == [("m", "a"), ("m", "b"), ("m", "bad"), ("m", "new"), ("n", "a")]
    assert all(len(ts) <= 2 for _, ts in fake.batches)  # batches of one module, at most `batch` targets


def test_shared_cache_serves_ptx_report():
    fake = _FakeCompiler()
    cache = ptx_check.ReportCache(workers=1, compiler=fake)
    previous = ptx_check._shared_cache
    ptx_check.share_reports(cache)
    module, target = "m", "x"  # not literals in the call: conftest does not prefetch this fake pair
    try:
        assert ptx_check.ptx_report(module, target).ptx == "m:x"
        assert ptx_check.ptx_report(module, target).ptx == "m:x"
    finally:
        ptx_check.share_reports(previous)
    assert fake.batches == [("m", ["x"])]


def test_several_targets_share_the_cache_and_compile_the_missing_ones_together():
    """``ptx_reports`` in a session that shares reports: targets compiled already (or by another caller) are not
    compiled again, the missing ones compile in one batch taken out of the queue, and failures come back as
    values, as a fresh compile returns them."""
    fake = _FakeCompiler()
    cache = ptx_check.ReportCache(workers=0, compiler=fake)  # no worker: what is queued stays queued
    previous = ptx_check._shared_cache
    ptx_check.share_reports(cache)
    module, first, later = "m", ["a", "b"], ["b", "c", "bad", "d"]  # names, not literals: no conftest prefetch
    try:
        assert ptx_check.ptx_reports(module, first)["a"].ptx == "m:a"
        cache.prefetch([(module, "d"), (module, "e")])
        got = ptx_check.ptx_reports(module, later)
        assert [got[t].ptx for t in ("b", "c", "d")] == ["m:b", "m:c", "m:d"]
        assert isinstance(got["bad"], RuntimeError) and cache._queue == [(module, ["e"])]
        with pytest.raises(RuntimeError, match="bad failed"):
            ptx_check.ptx_report(module, "bad")
    finally:
        ptx_check.share_reports(previous)
        cache.close()
    assert fake.batches == [(module, ["a", "b"]), (module, ["c", "bad", "d"])]


def test_a_caller_waiting_on_another_compile_works_the_queue_meanwhile():
    """While the target it needs compiles elsewhere, ``get`` compiles the queued batches itself (no idle core
    while work is queued), then returns the other thread's report."""
    fake = _FakeCompiler()
    cache = ptx_check.ReportCache(workers=0, batch=1, compiler=fake)
    cache.prefetch([("m", "x"), ("m", "y")])
    with cache._lock:
        cache._running.add(("m", "z"))  # as if a background child were compiling it

    def finish_z():
        while len(fake.batches) < 2:  # after the caller has taken both queued batches
            threading.Event().wait(0.01)
        cache._finish("m", ["z"], {"z": ptx_check.PtxReport(ptx="elsewhere", ptxas_log="", kernels=[])})

    other = threading.Thread(target=finish_z)
    other.start()
    try:
        assert cache.get("m", "z").ptx == "elsewhere"
    finally:
        other.join(5)
        cache.close()
    assert fake.batches == [("m", ["x"]), ("m", ["y"])] and cache.get("m", "x").ptx == "m:x"

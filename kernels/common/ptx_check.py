"""Compile a CuTe DSL kernel to sm_90a PTX on a machine without a GPU, then assemble it with ptxas.

The DSL refuses to compile when it cannot find the CUDA driver; for a compile-only check we skip that
test, let ``cute.compile`` lower to PTX (kept on disk by ``CUTE_DSL_KEEP_PTX``) and swallow the error it
raises when it tries to load the module into a driver that is not there. The work happens in a child
process so the patched compiler and the environment never leak into the caller (tests, CLI).

Each kernel module exposes ``compile_targets() -> dict[str, Callable[[], tuple[fn, args]]]``: named
builders returning a ``@cute.jit`` entry and fake tensors/scalars to compile it with.

Usage from Python::

    report = ptx_report("cula.kernels.sm90.lightning_fwd", "default")
    assert report.has("wgmma.mma_async") and report.spill_bytes == 0

``ptx_reports(module, [targets])`` compiles several targets of one module in one child (same PTX as one
child each; the interpreter and the DSL load once). The test session shares one :class:`ReportCache`
(``share_reports``, set up in tests/conftest.py) behind both: each target compiles once per session, ahead
of the tests that read it, in the background. ``compile_reports`` compiles without any cache.

or from a shell: ``python -m cula.kernels.common.ptx_check cula.kernels.sm90.lightning_fwd default``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

ARCH = "sm_90a"


@dataclasses.dataclass
class KernelResources:
    """What ptxas says about one ``.entry`` in the PTX."""

    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    smem_bytes: int


@dataclasses.dataclass
class PtxReport:
    """The PTX text of one compile target and ptxas' resource report for each of its kernels."""

    ptx: str
    ptxas_log: str
    kernels: list[KernelResources]

    def has(self, instruction: str) -> bool:
        return instruction in self.ptx

    def count(self, instruction: str) -> int:
        return self.ptx.count(instruction)

    @property
    def spill_bytes(self) -> int:
        return sum(k.spill_store_bytes + k.spill_load_bytes for k in self.kernels)

    @property
    def max_registers(self) -> int:
        return max((k.registers for k in self.kernels), default=0)


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)'")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REG_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def fake_ptr(index: int, dtype, align: int = 16):
    """A distinct, aligned placeholder global-memory pointer for compiling against (never dereferenced)."""
    from cutlass.cute import AddressSpace
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, (1 << 40) + (index << 32), AddressSpace.gmem, assumed_align=align)


def trace_without_gpu(trace, facts: dict) -> dict:
    """Run ``trace`` (a ``@cute.jit(preprocess=False)`` function without kernels that fills ``facts``
    with static layout facts) on a machine with or without a GPU, and return ``facts``.

    The driver check is skipped; ``cute.compile`` then fails only when it loads the empty module, which
    is expected without a driver. An error before ``facts`` has anything in it is a tracing error: raised.
    Set ``CUTE_DSL_ARCH=sm_90a`` before ``cutlass`` is first imported (the tests start a fresh process).
    """
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    from cutlass.base_dsl.compiler import Compiler

    from cula.kernels.common import dsl_compile

    Compiler._check_cuda_dependencies_once = lambda *a, **k: None
    try:
        dsl_compile.compile(trace)  # (without source-text lookups: kda_fwd_recur's trace 43 s -> 11 s)
    except Exception:
        if not facts:
            raise
    return facts


def parse_ptxas_log(log: str) -> list[KernelResources]:
    """Split ``ptxas -v`` output into one record per entry function."""
    kernels: list[KernelResources] = []
    current: dict | None = None
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            if current:
                kernels.append(KernelResources(**current))
            current = dict(name=m.group(1), registers=0, spill_store_bytes=0, spill_load_bytes=0,
                           stack_bytes=0, smem_bytes=0)
            continue
        if current is None:
            continue
        m = _SPILL_RE.search(line)
        if m:
            current["stack_bytes"] = int(m.group(1))
            current["spill_store_bytes"] = int(m.group(2))
            current["spill_load_bytes"] = int(m.group(3))
        m = _REG_RE.search(line)
        if m:
            current["registers"] = int(m.group(1))
            sm = _SMEM_RE.search(line)
            if sm:
                current["smem_bytes"] = int(sm.group(1))
    if current:
        kernels.append(KernelResources(**current))
    return kernels


def _child(module: str, dump_dir: str, targets: list[str]) -> None:
    """Runs in the child process: compile each target, leaving its PTX in ``dump_dir/<index>/``.

    Several targets of one module share a child (the interpreter, torch and the DSL load once); each
    compile is separate (its own ``cute.compile``), and its files are moved to the target's folder
    before the next one starts. A target that fails leaves its error in ``error.txt`` instead.
    """
    nice = int(os.environ.pop("CULA_PTX_NICE", "0"))
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    os.environ["CUTE_DSL_ARCH"] = ARCH
    os.environ["CUTE_DSL_KEEP_PTX"] = "1"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump_dir
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    from cutlass.base_dsl.compiler import Compiler

    Compiler._check_cuda_dependencies_once = lambda *a, **k: None
    import importlib
    import traceback

    from cula.kernels.common import dsl_compile

    mod = importlib.import_module(module)
    for i, target in enumerate(targets):
        out = os.path.join(dump_dir, str(i))
        os.makedirs(out)
        try:
            fn, args = mod.compile_targets()[target]()
            try:
                dsl_compile.compile(fn, *args)
            except Exception as exc:  # loading into a missing driver fails after PTX is written
                if not glob.glob(os.path.join(dump_dir, "*.ptx")):
                    raise
                print(f"{target}: (expected after PTX was written: {type(exc).__name__})", file=sys.stderr)
        except Exception:  # noqa: BLE001 - reported for this target; the others still compile
            with open(os.path.join(out, "error.txt"), "w") as f:
                f.write(traceback.format_exc())
        for path in glob.glob(os.path.join(dump_dir, "*")):
            if os.path.isfile(path):
                shutil.move(path, out)


def _report(module: str, target: str, out: str, child_output: str, ptxas: str | None, timeout: float) -> PtxReport:
    """The report of one target from its folder of the child's dump (``RuntimeError`` if it failed)."""
    files = sorted(glob.glob(os.path.join(out, "*.ptx")))
    if not files:
        err = ""
        if os.path.exists(os.path.join(out, "error.txt")):
            with open(os.path.join(out, "error.txt")) as f:
                err = f.read()
        raise RuntimeError(f"no PTX produced for {module}:{target}\n{err[-6000:]}\n{child_output[-6000:]}")
    with open(files[-1], "rb") as f:
        ptx = f.read().replace(b"\x00", b"").decode()
    log = ""
    if ptxas:
        clean = os.path.join(out, "clean.ptx")
        with open(clean, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch={ARCH}", "-v", clean, "-o", os.devnull],
                             capture_output=True, text=True, timeout=timeout)
        log = res.stdout + res.stderr
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed for {module}:{target}\n{log[-6000:]}")
    return PtxReport(ptx=ptx, ptxas_log=log, kernels=parse_ptxas_log(log))


def ptx_reports(module: str, targets: list[str], timeout: float = 600.0) -> dict[str, PtxReport | Exception]:
    """Each target's report, or the exception that ``ptx_report`` would raise for it (one target's failure
    does not hide the others' results). Inside a test session that shares reports (:class:`ReportCache`) a
    target compiled once, ahead of time or by another test, is not compiled again; the rest compile together
    in one child (:func:`compile_reports`)."""
    if _shared_cache is not None:
        return _shared_cache.get_many(module, targets)
    return compile_reports(module, targets, timeout)


def compile_reports(module: str, targets: list[str], timeout: float = 600.0,
                    started: Callable[[subprocess.Popen], None] | None = None,
                    nice: int = 0) -> dict[str, PtxReport | Exception]:
    """Compile several targets of ``module`` in one child process and run ``ptxas -v`` on each (no cache).

    Returns each target's report, or the exception that ``ptx_report`` would raise for it. ``started`` is
    told the child process; ``nice`` lowers its scheduling priority (a compile ahead of need yields to the
    work in front).
    """
    ptxas = shutil.which("ptxas")
    results: dict[str, PtxReport | Exception] = {}
    with tempfile.TemporaryDirectory(prefix="cula-ptx-") as dump_dir:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cula.kernels.common.ptx_check", "--child", module, dump_dir, *targets],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "CULA_PTX_NICE": str(nice)},
        )
        if started is not None:
            started(proc)
        try:
            output, _ = proc.communicate(timeout=timeout * len(targets))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += f"\n(the compile child timed out after {timeout * len(targets):.0f} s)"
        lost = []
        for i, target in enumerate(targets):
            out = os.path.join(dump_dir, str(i))
            if len(targets) > 1 and not glob.glob(os.path.join(out, "*.ptx")) \
                    and not os.path.exists(os.path.join(out, "error.txt")):
                lost.append(target)  # the shared child died (or timed out) before or during this one
                continue
            try:
                results[target] = _report(module, target, out, output, ptxas, timeout)
            except Exception as exc:  # noqa: BLE001 - handed to whoever asks for this target
                results[target] = exc
    for target in lost:  # alone, as a single-target call would: the failure lands on its own target
        results.update(compile_reports(module, [target], timeout, started, nice))
    return {t: results[t] for t in targets}


def ptx_report(module: str, target: str = "default", timeout: float = 600.0) -> PtxReport:
    """Compile ``module``'s ``target`` to sm_90a PTX in a child process and run ``ptxas -v`` on it.

    Inside a test session that shares reports (see :class:`ReportCache`), a target compiled once (or
    ahead of time) is not compiled again.
    """
    if _shared_cache is not None:
        return _shared_cache.get(module, target)
    result = compile_reports(module, [target], timeout)[target]
    if isinstance(result, Exception):
        raise result
    return result


class ReportCache:
    """Compile each (module, target) once per session, in the background ahead of use where told to.

    ``prefetch(pairs)`` queues the targets, grouped by module into children of a few targets each,
    for ``workers`` background threads (each waits on one child process at a time, run at ``nice``
    so that it takes only the CPU the foreground leaves idle). ``get`` returns
    a finished report, compiles a queued or unknown target in the calling thread itself (a caller that
    needs a report never waits behind the queue), and while its target compiles elsewhere compiles
    queued batches itself instead of waiting idle. Reports and
    failures are both kept: a target that failed fails every test that asks for it, as it would when
    compiled there.
    """

    def __init__(self, workers: int = 1, batch: int = 2, timeout: float = 600.0, nice: int = 10,
                 compiler: Callable[..., dict[str, PtxReport | Exception]] | None = None):
        self.workers, self.batch, self.timeout, self.nice = workers, batch, timeout, nice
        self._compiler = compiler or compile_reports  # bound now: a later monkeypatch cannot reach it
        self._lock = threading.Condition()
        self._done: dict[tuple[str, str], PtxReport | Exception] = {}
        self._running: set[tuple[str, str]] = set()
        self._queue: list[tuple[str, list[str]]] = []
        self._procs: set[subprocess.Popen] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def prefetch(self, pairs) -> None:
        by_module: dict[str, list[str]] = {}
        with self._lock:
            for module, target in pairs:
                key = (module, target)
                known = key in self._done or key in self._running or any(
                    m == module and target in ts for m, ts in self._queue)
                if not known and target not in by_module.setdefault(module, []):
                    by_module[module].append(target)
            for module, targets in by_module.items():
                for i in range(0, len(targets), self.batch):
                    self._queue.append((module, targets[i:i + self.batch]))
            while len(self._threads) < self.workers and self._queue:
                th = threading.Thread(target=self._work, daemon=True, name="ptx-prefetch")
                self._threads.append(th)
                th.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    self._threads.remove(threading.current_thread())
                    return
                module, targets = self._queue.pop(0)
                self._running.update((module, t) for t in targets)
            self._compile(module, targets, self.nice)

    def _compile(self, module: str, targets: list[str], nice: int = 0) -> None:
        def started(proc: subprocess.Popen) -> None:
            with self._lock:
                self._procs.add(proc)

        results: dict = {}
        try:
            results = self._compiler(module, targets, self.timeout, started, nice)
        except BaseException as exc:  # noqa: BLE001 - e.g. the child could not start
            results = {t: exc if isinstance(exc, Exception) else RuntimeError(f"interrupted: {exc!r}")
                       for t in targets}
            if not isinstance(exc, Exception):
                raise
        finally:
            self._finish(module, targets, results)

    def _finish(self, module: str, targets: list[str], results: dict) -> None:
        with self._lock:
            self._procs.difference_update(p for p in list(self._procs) if p.poll() is not None)
            for t in targets:
                self._done[(module, t)] = results.get(t, RuntimeError(f"{module}:{t} was not compiled"))
                self._running.discard((module, t))
            self._lock.notify_all()

    def get(self, module: str, target: str) -> PtxReport:
        result = self.get_many(module, [target])[target]
        if isinstance(result, Exception):
            raise result
        return result

    def get_many(self, module: str, targets: list[str]) -> dict[str, PtxReport | Exception]:
        """Each target's report or failure (as :func:`compile_reports` returns them): the ones not yet
        compiled or compiling are taken out of the queue and compiled here, together in one child. While the
        others compile elsewhere, this thread compiles queued batches in the meantime rather than wait idle
        (the caller needs the reports, so the queue's work may as well run on its core)."""
        targets = list(dict.fromkeys(targets))
        keys = [(module, t) for t in targets]
        while True:
            with self._lock:
                if all(k in self._done for k in keys):
                    return {t: self._done[(module, t)] for t in targets}
                mine = [t for t in targets if (module, t) not in self._done and (module, t) not in self._running]
                if mine:
                    self._take(module, mine)
                    job = (module, mine)
                elif self._queue:  # ours compile elsewhere: a queued batch here meanwhile
                    job = self._queue.pop(0)
                    self._running.update((job[0], t) for t in job[1])
                else:
                    self._lock.wait()
                    continue
            self._compile(*job)

    def _take(self, module: str, mine: list[str]) -> None:
        """(Lock held.) Claim ``mine`` for the calling thread: out of the queue, marked running."""
        for entry in list(self._queue):
            if entry[0] == module:
                entry[1][:] = [t for t in entry[1] if t not in mine]
                if not entry[1]:
                    self._queue.remove(entry)
        self._running.update((module, t) for t in mine)

    def close(self) -> None:
        """Drop what is queued and stop the children still compiling (end of the session)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


_shared_cache: ReportCache | None = None


def share_reports(cache: ReportCache | None) -> None:
    """Make ``ptx_report`` answer from ``cache`` (``None``: compile on every call again)."""
    global _shared_cache
    _shared_cache = cache


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":
        _child(argv[1], argv[2], argv[3:])
        return 0
    module, target = argv[0], argv[1] if len(argv) > 1 else "default"
    rep = ptx_report(module, target)
    print(json.dumps({
        "wgmma": rep.count("wgmma.mma_async"),
        "tma": rep.count("cp.async.bulk.tensor"),
        "kernels": [dataclasses.asdict(k) for k in rep.kernels],
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Timing of one callable: eager launches and CUDA-graph replay, medians with a p20-p80 spread.

On CUDA every timed call is bracketed by CUDA events and preceded by a write of a large buffer
(``flush_bytes``, default 256 MiB, several times the size of an H100/H200 L2) so no call starts with its inputs
already in L2 - the same discipline as ``triton.testing.do_bench``. That write leaves L2 full of dirty
lines, and the timed call pays for writing them back as it evicts them (tens of MB on an H200: several
microseconds, the same for every impl, which compresses ratios of short calls). A read-only flush
(one reduction over the buffer, tried in session 7) does not evict on the H200: a 32 MiB input summed
after it took 17.4 us against 17.0 us with no flush at all, so writing is the only mode. The number of timed calls is
capped both by count (``max_reps``) and by wall time (``max_time_s`` per impl and mode), so a suite
has a predictable duration; at least ``min_reps`` calls are timed even when one call is slow.

CUDA graph: after warm-up on a side stream, one call is captured and its replays are timed the same
way. Launch overhead dominates small shapes (decode, short prefill); the graph time shows the kernels
alone. When capture fails (a host sync inside the op, a non-capturable library call) the result is
NaN with the reason, and the run goes on.

On CPU (the smoke grid) calls are timed with ``time.perf_counter``; there is no flush and no graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAN = float("nan")


@dataclass(frozen=True)
class Timing:
    """Median and p20/p80 of ``reps`` timed calls in milliseconds; ``note`` says why NaN if so."""

    median_ms: float = NAN
    p20_ms: float = NAN
    p80_ms: float = NAN
    reps: int = 0
    note: str = ""


@dataclass(frozen=True)
class TimingSettings:
    """Knobs of the timer (recorded on every row as ``settings_json``)."""

    max_reps: int = 50
    min_reps: int = 3
    max_time_s: float = 1.0
    warmup_ms: float = 25.0
    flush_bytes: int = 256 * 1024 * 1024
    graphs: bool = True
    flush: str = "write"  # do_bench's zeroing; see the module docstring for why there is no read mode


#: The ways the timer empties L2 before a timed call (a read-only pass does not evict: module docstring).
FLUSH_MODES = ("write",)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values`` (numpy's default method)."""
    if not values:
        return NAN
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def event_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` on the current CUDA stream, between two CUDA events (waits for the second):
    what the kernels' own A/B tools time, each after its own flush or warm-up."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def summarize(times_ms: list[float], note: str = "") -> Timing:
    return Timing(percentile(times_ms, 50), percentile(times_ms, 20), percentile(times_ms, 80),
                  len(times_ms), note)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def _root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain: a failed capture_end() hides the call that broke capture."""
    seen = 0
    while seen < 8 and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return exc


class Timer:
    """Times callables on ``device`` ("cuda" or "cpu") with the given settings."""

    def __init__(self, device: str, settings: TimingSettings | None = None) -> None:
        self.device = device
        self.s = settings or TimingSettings()
        if self.s.flush not in FLUSH_MODES:
            raise ValueError(f"flush: expected one of {FLUSH_MODES}, got {self.s.flush!r}")
        self._flush_buf: Any = None

    # -- helpers ------------------------------------------------------------------------------
    def _flush(self) -> None:
        import torch

        if self._flush_buf is None:
            self._flush_buf = torch.zeros(self.s.flush_bytes // 4, dtype=torch.int32, device="cuda")
        self._flush_buf.zero_()

    def _reps_for(self, est_ms: float) -> tuple[int, int]:
        """(warm-up calls, timed calls) for a call that takes about ``est_ms``."""
        est = max(est_ms, 1e-3)
        reps = int(self.s.max_time_s * 1000.0 / est)
        reps = max(self.s.min_reps, min(self.s.max_reps, reps))
        warm = max(1, min(10, int(self.s.warmup_ms / est)))
        return warm, reps

    def _cuda_loop(self, call: Callable[[], Any], reps: int) -> list[float]:
        import torch

        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self._flush()
            starts[i].record()
            call()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    # -- public -------------------------------------------------------------------------------
    def eager(self, fn: Callable[[], Any]) -> Timing:
        """Time ``fn`` launched eagerly (``fn`` was already called once: compiled and checked)."""
        if self.device != "cuda":
            return self._cpu(fn)
        import torch

        est = self._cuda_loop(fn, 1)[0]
        warm, reps = self._reps_for(est)
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        return summarize(self._cuda_loop(fn, reps))

    def graph(self, fn: Callable[[], Any]) -> Timing:
        """Capture one call of ``fn`` in a CUDA graph and time its replays; NaN + reason on failure."""
        if self.device != "cuda":
            return Timing(note="CPU run: no CUDA graph")
        if not self.s.graphs:
            return Timing(note="CUDA graphs disabled (--no-graph)")
        import torch

        caller_stream = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller_stream)
        graph = None
        failure = None
        # Our own pool id: a failed capture's CUDAGraph refuses pool() ("without a preceding
        # successful capture"), and this id is what release_failed_capture must hand back.
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up on the capture stream, as graph capture requires
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn()
        except Exception as exc:  # capture is best effort: record why and go on
            root = _root_cause(exc)
            failure = f"capture failed: {_short(root)}"
            if root is not exc:
                failure += f" (then {_short(exc)})"
            # The exception's traceback holds the op's frames, hence the tensors it allocated in the
            # graph's pool; keeping `root` here would make a cycle through this frame.
            del root
        if failure is not None:
            # torch.cuda.graph's __exit__ raised in capture_end, before it left its capture stream: without
            # this every later launch of the run went to that stream (seen on the H200, torch 2.11)
            torch.cuda.set_stream(caller_stream)
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # the context is unusable: stop the run, rows are kept
                raise RuntimeError(f"CUDA context broken after a failed graph capture: {_short(sync_exc)}") from None
            if graph is not None:
                release_failed_capture(pool)
            return Timing(note=failure)
        try:
            graph.replay()
            torch.cuda.synchronize()
            est = self._cuda_loop(graph.replay, 1)[0]
            warm, reps = self._reps_for(est)
            for _ in range(warm):
                graph.replay()
            torch.cuda.synchronize()
            return summarize(self._cuda_loop(graph.replay, reps))
        except Exception as exc:
            torch.cuda.synchronize()
            return Timing(note=f"replay failed: {_short(exc)}")
        finally:
            del graph

    def _cpu(self, fn: Callable[[], Any]) -> Timing:
        t0 = time.perf_counter()
        fn()
        est = (time.perf_counter() - t0) * 1000.0
        warm, reps = self._reps_for(est)
        for _ in range(min(warm, 2)):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
        return summarize(times)

    def release(self) -> None:
        """Free the flush buffer."""
        self._flush_buf = None


def measure_ceilings(device: str, seconds: float = 2.0) -> tuple[float, float, str]:
    """(copy TB/s, matmul TFLOP/s, description) measured now on ``device``.

    Copy: ``dst.copy_(src)`` of 1 GiB on CUDA (bytes read + written / time). Matmul: bf16
    ``8192 x 8192 x 8192`` on CUDA (2 n³ / time). On CPU: 64 MiB copy and fp32 1024³ matmul.
    The medians of a few reps are taken; these are achievable ceilings, not datasheet peaks.
    """
    import torch

    if device == "cuda":
        n_bytes, n, dtype = 1 << 30, 8192, torch.bfloat16
    else:
        n_bytes, n, dtype = 64 << 20, 1024, torch.float32
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    timer = Timer(device, TimingSettings(max_reps=20, min_reps=3, max_time_s=seconds / 2,
                                         flush_bytes=256 << 20))
    dst.copy_(src)
    torch.matmul(a, b)
    t_copy = timer.eager(lambda: dst.copy_(src)).median_ms
    t_mm = timer.eager(lambda: torch.matmul(a, b)).median_ms
    timer.release()
    tbps = 2 * n_bytes / (t_copy * 1e-3) / 1e12
    tflops = 2 * n ** 3 / (t_mm * 1e-3) / 1e12
    what = (f"{'1 GiB' if device == 'cuda' else '64 MiB'} device copy; "
            f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} {n}^3 matmul")
    del src, dst, a, b
    return tbps, tflops, what


def release_failed_capture(pool: Any) -> None:
    """Give back the memory a failed capture allocated.

    Everything an op allocates while being captured comes from the graph's private memory pool, and a
    graph whose capture never ended does not release that pool when it dies. Runs whose varlen rows
    failed capture (ops that sync the host) grew by ~13 GB of "non-PyTorch" device memory per config
    (the ``gpu_mem_used_gib`` column of run 20261203-070755-h200-4aa088a-2790, while live tensors
    stayed at 1-2 GB) until the oracle ran out of memory. Releasing the pool lets ``empty_cache`` return
    it once its blocks are free. Best effort: an older torch without these internals keeps the leak.
    """
    import gc

    import torch

    gc.collect()  # tensors the op allocated may still sit in collectable exception/frame cycles
    dev = torch.cuda.current_device()
    # capture_end raised before it ended the pool's allocation routing (endAllocateToPool), so the pool
    # still counts as being captured into; end that first, then drop the graph's reference to it
    for step in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
        try:
            step(dev, pool)
        except Exception:  # noqa: BLE001 - internals differ across torch versions; never fail a run here
            pass
    _end_generator_capture()
    torch.cuda.empty_cache()


def _end_generator_capture() -> None:
    """Take the CUDA RNG out of capture mode after a capture that never ended.

    ``capture_end`` raises on an invalidated capture before it tells the registered generator that
    capture is over, so every later RNG call (``torch.randn`` of the next config's inputs) fails with
    "Offset increment outside graph capture encountered unexpectedly" (seen on the H200, torch 2.11).
    A capture that does end resets that state: capture one tiny op and drop the graph.
    """
    import torch

    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    del g

"""Low-overhead calls of a compiled CuTe DSL host function whose arguments are pointers and scalars.

A decode kernel runs for a few microseconds, so what the host spends per call matters as much as the
kernel. The DSL's own call path (``compiled(*args)``) adapts every argument on every call: it rectifies
the argument list against the signature, wraps each pointer / scalar / stream in a DSL object and asks it
for a ctypes pointer. :class:`Launcher` does that once: it keeps one ctypes cell per argument and a packed
argument array pointing at those cells, and per call only writes the new values into the cells and calls
the compiled C entry point.

The fast path leans on DSL internals (``JitExecutor``'s ``capi_func``, ``cuda_result`` and
``kernel_functions_ptrs``), so it checks itself: on the first call it launches through the DSL's public
path, then compares, byte by byte, the argument cells the DSL built with its own. Any difference, missing
attribute or error switches the launcher to the public path for good, with one warning. The public path
is always correct, only slower.

Argument kinds (``ArgSpec.kind``): ``"ptr"`` (device address as int; ``dtype`` and ``align`` say how the
kernel was compiled), ``"i32"``, ``"f32"`` and ``"stream"`` (a raw ``cudaStream_t`` as int).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import warnings
from collections.abc import Sequence
from typing import Any

#: ctypes cell type per argument kind (what the compiled entry point reads through each slot).
_CELL = {"ptr": ctypes.c_void_p, "stream": ctypes.c_void_p, "i32": ctypes.c_int32, "f32": ctypes.c_float}


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One runtime argument of a compiled host function."""

    kind: str  # "ptr", "i32", "f32" or "stream"
    dtype: Any = None  # cutlass numeric type of a pointer
    align: int = 16  # assumed alignment (bytes) a pointer was compiled with

    def __post_init__(self) -> None:
        if self.kind not in _CELL:
            raise ValueError(f"kind: expected one of {sorted(_CELL)}, got {self.kind!r}")


def compile_args(specs: Sequence[ArgSpec]) -> list[Any]:
    """Example arguments to ``cute.compile`` a host function with: null pointers, zeros, a fake stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    out: list[Any] = []
    for spec in specs:
        if spec.kind == "ptr":
            out.append(make_ptr(spec.dtype, 0, cute.AddressSpace.gmem, assumed_align=spec.align))
        elif spec.kind == "i32":
            out.append(cutlass.Int32(0))
        elif spec.kind == "f32":
            out.append(cutlass.Float32(0.0))
        else:
            out.append(make_fake_stream())
    return out


def compile_launcher(fn: Any, specs: Sequence[ArgSpec], fast: bool = True,
                     aot_key: tuple | None = None) -> "Launcher":
    """``cute.compile`` ``fn`` for ``specs`` and wrap the result in a :class:`Launcher`. With ``aot_key``
    (``(kind, key)`` of the launch) a module compiled ahead of time is used instead where ``CULA_AOT_DIR`` has
    one for the current sources (``cula.kernels.common.aot``)."""
    from cula.kernels.common import dsl_compile

    compiled = None
    if aot_key is not None:
        from cula.kernels.common import aot

        compiled = aot.find(*aot_key, specs)
    if compiled is None:
        compiled = dsl_compile.compile(fn, *compile_args(specs))  # (the same PTX, about half the time)
    return Launcher(compiled, specs, fast=fast)


def dsl_args(specs: Sequence[ArgSpec], values: Sequence[Any]) -> list[Any]:
    """The DSL objects (``Pointer``, ``Int32``, ``Float32``, ``CUstream``) the public call path takes."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    out: list[Any] = []
    for spec, value in zip(specs, values):
        if spec.kind == "ptr":
            out.append(make_ptr(spec.dtype, int(value), cute.AddressSpace.gmem, assumed_align=spec.align))
        elif spec.kind == "i32":
            out.append(cutlass.Int32(int(value)))
        elif spec.kind == "f32":
            out.append(cutlass.Float32(float(value)))
        else:
            out.append(cuda_driver.CUstream(int(value)))
    return out


class Launcher:
    """Calls ``compiled`` (a ``cute.compile`` result) with plain ints / floats, fast after the first call.

    Args:
        compiled: the compiled host function.
        specs: one :class:`ArgSpec` per runtime argument, in order.
        fast: try the cached-cell path (``False``: always the DSL's public path).
    """

    def __init__(self, compiled: Any, specs: Sequence[ArgSpec], fast: bool = True):
        self.compiled = compiled
        self.specs = tuple(specs)
        self._cells = [_CELL[s.kind]() for s in self.specs]
        self._packed = None  # ctypes array of slot addresses, once the fast path is verified
        self._capi = None
        self._result = None
        self._want_fast = fast
        self._checked = False
        self._lock = threading.Lock()
        self.fast_reason: str | None = None  # why the fast path is off (None while on / untried)
        self._tail: tuple[int, ...] = ()  # packed slots after the arguments (result cell, kernel pointers)
        # the last call's (BoundLaunch or None, values): what _last_values rebuilds on demand
        self._last: tuple = (None, ())

    @property
    def is_fast(self) -> bool:
        return self._packed is not None

    @property
    def _last_values(self) -> tuple:
        """The full argument values of the last call (for overhead measurements and tests)."""
        bound, values = self._last
        return values if bound is None else bound.full_values(values)

    @_last_values.setter
    def _last_values(self, values: tuple) -> None:
        self._last = (None, tuple(values))

    def bind(self, static: dict[int, Any]) -> BoundLaunch | None:
        """The fast path with the arguments at the indices of ``static`` fixed to its values; see
        :class:`BoundLaunch`. None while the fast path is not on (before the first, checked call, or
        once it was turned off): call the launcher itself then."""
        if self._packed is None:
            return None
        return BoundLaunch(self, static)

    def __call__(self, *values: Any) -> None:
        self._last = (None, values)
        if self._packed is not None:
            with self._lock:
                for cell, value in zip(self._cells, values):
                    cell.value = value
                self._capi(self._packed)
                if self._result is not None and self._result.value != 0:
                    raise RuntimeError(f"CuTe DSL kernel launch failed with CUDA error {self._result.value}")
            return
        if self._want_fast and not self._checked:
            self._checked = True
            self._first_call(values)
            return
        self.compiled(*dsl_args(self.specs, values))

    def call_public(self, *values: Any) -> None:
        """Launch through the DSL's public path (what the fast path must be equal to)."""
        self.compiled(*dsl_args(self.specs, values))

    # -- the one-time check ----------------------------------------------------------------------

    def _first_call(self, values: Sequence[Any]) -> None:
        objs = dsl_args(self.specs, values)
        exe_args, _ = self.compiled.generate_execution_args(*objs)
        self.compiled.run_compiled_program(list(exe_args))  # the real launch of this call
        try:
            self._enable_fast(values, exe_args)
        except Exception as exc:  # internals moved: stay on the public path
            self._disable(f"{type(exc).__name__}: {exc}")

    def _disable(self, reason: str) -> None:
        self._packed = None
        self.fast_reason = reason
        warnings.warn(f"cula fast kernel launch disabled, using the CuTe DSL call path ({reason})",
                      RuntimeWarning, stacklevel=4)

    def _enable_fast(self, values: Sequence[Any], exe_args: Sequence[Any]) -> None:
        if len(exe_args) != len(self.specs):
            return self._disable(f"DSL packs {len(exe_args)} arguments, expected {len(self.specs)}")
        for cell, value in zip(self._cells, values):
            cell.value = value
        for i, (arg, cell) in enumerate(zip(exe_args, self._cells)):
            addr = arg.value if isinstance(arg, ctypes.c_void_p) else int(arg)
            size = ctypes.sizeof(cell)
            if ctypes.string_at(addr, size) != ctypes.string_at(ctypes.addressof(cell), size):
                return self._disable(f"argument {i} ({self.specs[i].kind}) is packed differently")
        executor = self.compiled._default_executor
        capi = executor.jit_module.capi_func
        result = executor.cuda_result
        tail = []
        if result is not None:
            tail.append(ctypes.addressof(result))
        if executor.exec_context is not None:
            tail += list(executor.exec_context.kernel_functions_ptrs)
        slots = [ctypes.addressof(c) for c in self._cells] + tail
        slots = [addr.value if isinstance(addr, ctypes.c_void_p) else addr for addr in slots]
        packed = (ctypes.c_void_p * len(slots))(*slots)
        self._tail = tuple(slots[len(self._cells):])
        self._capi, self._result, self._packed = capi, result, packed


class BoundLaunch:
    """A verified :class:`Launcher`'s fast path with some arguments fixed (a decode call's sizes and
    scalars, the same for every call of one signature) in cells of its own, so that a call writes
    only the others, which must all be pointers or streams: they live in one ``void*`` array that a
    single slice assignment fills. Call it with those values, in argument order, as one sequence.

    It shares the launcher's entry point, result cell and lock (the result cell is the compiled
    function's, one per launcher)."""

    __slots__ = ("launcher", "_dynamic", "_dynamic_index", "_static", "_packed", "_capi", "_result", "_lock")

    def __init__(self, launcher: Launcher, static: dict[int, Any]):
        specs = launcher.specs
        self.launcher = launcher
        self._dynamic_index = tuple(i for i in range(len(specs)) if i not in static)
        for i in self._dynamic_index:
            if specs[i].kind not in ("ptr", "stream"):
                raise ValueError(f"static: argument {i} ({specs[i].kind}) must be fixed, only pointers and "
                                 "streams can change per call")
        self._dynamic = (ctypes.c_void_p * len(self._dynamic_index))()
        self._static = {i: _CELL[specs[i].kind](value) for i, value in static.items()}
        where = {i: ctypes.addressof(cell) for i, cell in self._static.items()}
        step = ctypes.sizeof(ctypes.c_void_p)
        for j, i in enumerate(self._dynamic_index):
            where[i] = ctypes.addressof(self._dynamic) + j * step
        slots = [where[i] for i in range(len(specs))] + list(launcher._tail)
        self._packed = (ctypes.c_void_p * len(slots))(*slots)
        self._capi, self._result, self._lock = launcher._capi, launcher._result, launcher._lock

    def __call__(self, values: Sequence[int]) -> None:
        lock = self._lock
        lock.acquire()  # (a with block costs twice as much here)
        try:
            self._dynamic[:] = values
            self._capi(self._packed)  # ctypes drops the GIL for the call: the lock keeps the cells ours
            if self._result is not None and self._result.value != 0:
                raise RuntimeError(f"CuTe DSL kernel launch failed with CUDA error {self._result.value}")
        finally:
            lock.release()
        self.launcher._last = (self, values)

    def full_values(self, values: Sequence[int]) -> tuple:
        """All argument values of a call that passed ``values`` (what the launcher itself would take)."""
        full = {i: cell.value for i, cell in self._static.items()}
        full.update(zip(self._dynamic_index, values))
        return tuple(full[i] for i in range(len(full)))


def null_launcher(specs: Sequence[ArgSpec]) -> Launcher:
    """A :class:`Launcher` already on its fast path whose entry point is a C function that returns 0
    without reading its arguments: what a launch costs the host minus the launch itself (the cells are
    written and one ctypes call is made, as for a compiled kernel). For host-overhead measurements
    and tests on machines without a GPU."""
    launcher = Launcher(None, specs)
    launcher._checked = True
    launcher._result = ctypes.c_int32(0)
    slots = [ctypes.addressof(c) for c in launcher._cells] + [ctypes.addressof(launcher._result)]
    launcher._packed = (ctypes.c_void_p * len(slots))(*slots)
    launcher._tail = (slots[-1],)
    launcher._capi = _null_entry()
    return launcher


_NULL_ENTRY: list = []


def _null_entry() -> Any:
    # labs(long) returns its argument: a C call that ignores the packed array, typed as the DSL
    # types its entry points (int32 result, one void** argument)
    if not _NULL_ENTRY:
        address = ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value
        _NULL_ENTRY.append(ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)(address))
    return _NULL_ENTRY[0]


def stream_query() -> Any:
    """The cheapest ``device index -> raw cudaStream_t of torch's current stream`` callable: torch's C
    getter itself where it has one (no Python frame per call), else :func:`current_stream_handle`."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else current_stream_handle


def current_stream_handle(device_index: int) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on ``device_index`` (cheapest query first)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def stream_capturing() -> bool:
    """Whether torch's current CUDA stream is being captured into a graph: tensors made now get their
    values only when the graph runs, so host-side caches must not keep them."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_SM_COUNT: dict[int, int] = {}


def sm_count(device: Any) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (a ``torch.device``; cached per device index): what
    grid sizes are chosen against."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n

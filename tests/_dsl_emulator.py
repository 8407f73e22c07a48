"""Run a SIMT CuTe DSL kernel's Python source on the CPU, one Python thread per CUDA thread.

Compile checks prove a kernel lowers to good PTX, not that it computes the right thing; on a machine
without a GPU this emulator runs the kernel's own source (the functions under ``@cute.jit`` /
``@cute.kernel``, taken from ``__wrapped__``) with stand-ins for the few DSL calls the decode kernels
use: register tensors and shared memory are buffers (Python lists) addressed through the CuTe layouts
the kernel builds, ``shuffle_sync_bfly`` exchanges values between the 32 threads of a warp, ``sync_threads`` is a
barrier over the CTA, and scalars are fp32 (bf16 / fp16 stores round as the hardware does).

It checks what a GPU run would only show as wrong numbers or a crash: every global access is in bounds
of its tensor, every ``cute.assume(x, divby=n)`` holds, shared and register memory is written before
it is read (buffers start as NaN), and every thread reaches each barrier and shuffle (a deadlock times
out). Only what the decode kernels use is emulated; anything else raises ``AttributeError``.
"""

from __future__ import annotations

import math
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# --------------------------------------------------------------------------------------- numbers
#
# Speed: a kernel of 256 threads makes millions of element accesses, so the hot paths below avoid
# numpy calls that cost ~1 us on a scalar (``np.isnan``, ``np.float32(x)`` of a value that already is
# one, one-element arrays) and allocate results without re-converting them. Every value is still an
# ``np.float32`` and every operation still rounds as fp32 arithmetic does; the checks are unchanged.

_f32 = np.float32
_new = object.__new__


def _round_bf16(x: float) -> np.float32:
    b = int(_f32(x).view(np.uint32))
    b = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
    return np.uint32(b).view(np.float32)


class _Dtype:
    """A dtype tag that also converts, like ``cutlass.Float32(x)``."""

    def __init__(self, name: str, kind: str, width: int):
        self.name, self.kind, self.width = name, kind, width

    def __call__(self, x: Any) -> Any:
        return self.convert(x)

    def convert(self, x: Any) -> Any:
        return _F(self.raw(x)) if self.kind == "float" else int(x.v if type(x) is F else x)

    def raw(self, x: Any) -> Any:
        """The stored form of ``x`` in this dtype: an ``np.float32`` (floats, rounded) or an int."""
        v = x.v if type(x) is F else x
        if self.kind == "int":
            return int(v)
        if self.name == "bf16":
            return _round_bf16(float(v))
        if self.name == "f16":
            return _f32(np.float16(v))
        return v if type(v) is _f32 else _f32(v)

    def __repr__(self) -> str:
        return self.name


Float32 = _Dtype("f32", "float", 32)
BFloat16 = _Dtype("bf16", "float", 16)
Float16 = _Dtype("f16", "float", 16)
Int32 = _Dtype("i32", "int", 32)
Int64 = _Dtype("i64", "int", 64)


def _v(x: Any) -> np.float32:
    if type(x) is F:
        return x.v
    return x if type(x) is _f32 else _f32(x)


def _F(v: np.float32) -> "F":
    """An ``F`` around a value that already is an ``np.float32`` (no conversion)."""
    r = _new(F)
    r.v = v
    return r


class F:
    """An fp32 value in the kernel (result of arithmetic on fp32 values)."""

    __slots__ = ("v",)

    def __init__(self, v: Any):
        self.v = v if type(v) is _f32 else _f32(v)

    def to(self, dtype: _Dtype) -> Any:
        return dtype.convert(self)

    # np.float32 (op) np.float32 is an np.float32: the result needs no conversion
    def __add__(self, o): r = _new(F); r.v = self.v + (o.v if type(o) is F else _v(o)); return r
    def __radd__(self, o): r = _new(F); r.v = _v(o) + self.v; return r
    def __sub__(self, o): r = _new(F); r.v = self.v - (o.v if type(o) is F else _v(o)); return r
    def __rsub__(self, o): r = _new(F); r.v = _v(o) - self.v; return r
    def __mul__(self, o): r = _new(F); r.v = self.v * (o.v if type(o) is F else _v(o)); return r
    def __rmul__(self, o): r = _new(F); r.v = _v(o) * self.v; return r
    def __truediv__(self, o): r = _new(F); r.v = self.v / (o.v if type(o) is F else _v(o)); return r
    def __rtruediv__(self, o): r = _new(F); r.v = _v(o) / self.v; return r
    def __neg__(self): r = _new(F); r.v = -self.v; return r
    def __le__(self, o): return bool(self.v <= _v(o))
    def __lt__(self, o): return bool(self.v < _v(o))
    def __ge__(self, o): return bool(self.v >= _v(o))
    def __gt__(self, o): return bool(self.v > _v(o))
    def __float__(self): return float(self.v)


# --------------------------------------------------------------------------------- memory model


class Pointer:
    def __init__(self, buf: np.ndarray | None, offset: int, dtype: _Dtype, name: str):
        self.buf, self.offset, self.dtype, self.name = buf, offset, dtype, name

    def __add__(self, n: int) -> "Pointer":
        return Pointer(self.buf, self.offset + int(n), self.dtype, self.name)


def _compact_stride(shape: tuple) -> tuple:
    stride, acc = [], 1
    for s in shape:
        stride.append(acc)
        acc *= s
    return tuple(stride)


class Layout:
    def __init__(self, shape, stride=None):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.stride = _compact_stride(self.shape) if stride is None else (
            (stride,) if isinstance(stride, int) else tuple(stride))
        assert len(self.shape) == len(self.stride)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def cosize(self) -> int:
        return 1 + sum((s - 1) * d for s, d in zip(self.shape, self.stride))


class Tensor:
    """A CuTe tensor over a buffer: ``offset + sum(coord * stride)`` addresses an element.

    Buffers are Python lists (indexing one is ~4x cheaper than indexing a numpy array): float buffers
    hold ``np.float32`` values (or the exact Python floats of a registered tensor), NaN where never
    written; int buffers hold ints.
    """

    __slots__ = ("ptr", "layout", "_buf", "_n", "_base", "_shape", "_stride", "_size", "_rank", "_name", "_dtype",
                 "_is_int")

    def __init__(self, ptr: Pointer, layout: Layout):
        self.ptr, self.layout = ptr, layout
        # the hot paths read these instead of walking ptr / layout on every access
        self._buf, self._base, self._name, self._dtype = ptr.buf, ptr.offset, ptr.name, ptr.dtype
        self._n = 0 if ptr.buf is None else len(ptr.buf)  # buffers never change length
        self._shape, self._stride = layout.shape, layout.stride
        self._size, self._rank = layout.size, len(layout.shape)
        self._is_int = ptr.dtype.kind == "int"

    @property
    def iterator(self) -> Pointer:
        return self.ptr

    @property
    def shape(self) -> tuple:
        return self._shape

    def _offset(self, idx) -> int:
        shape, stride = self._shape, self._stride
        if type(idx) is tuple or isinstance(idx, tuple):
            if len(idx) != self._rank:
                raise AssertionError(f"{self._name}: index {idx} for shape {shape}")
            coords = idx
        else:  # a flat index runs over the modes first-mode-fastest, as in CuTe
            rest = idx if type(idx) is int else int(idx)
            if not 0 <= rest < self._size:
                raise AssertionError(f"{self._name}: flat index {idx} of {shape}")
            if self._rank == 1:
                coords = (rest,)
            else:
                coords = []
                for s in shape:
                    coords.append(rest % s)
                    rest //= s
        # every coordinate within its mode, then the element within the buffer (ranks 1-3 unrolled)
        rank = self._rank
        if rank == 2:
            c0, c1 = coords
            if type(c0) is not int:
                c0 = int(c0)
            if type(c1) is not int:
                c1 = int(c1)
            if not (0 <= c0 < shape[0] and 0 <= c1 < shape[1]):
                raise AssertionError(f"{self._name}: coordinate {coords} out of shape {shape}")
            off = self._base + c0 * stride[0] + c1 * stride[1]
        elif rank == 3:
            c0, c1, c2 = coords
            if type(c0) is not int:
                c0 = int(c0)
            if type(c1) is not int:
                c1 = int(c1)
            if type(c2) is not int:
                c2 = int(c2)
            if not (0 <= c0 < shape[0] and 0 <= c1 < shape[1] and 0 <= c2 < shape[2]):
                raise AssertionError(f"{self._name}: coordinate {coords} out of shape {shape}")
            off = self._base + c0 * stride[0] + c1 * stride[1] + c2 * stride[2]
        else:
            off = self._base
            for c, s, d in zip(coords, shape, stride):
                c = int(c)
                if not 0 <= c < s:
                    raise AssertionError(f"{self._name}: coordinate {coords} out of shape {shape}")
                off += c * d
        if not 0 <= off < self._n:
            if self._buf is None:
                raise AssertionError(f"{self._name}: access through a null pointer")
            raise AssertionError(f"{self._name}: element {off} out of bounds ({self._n})")
        return off

    def __getitem__(self, idx):
        if type(idx) is tuple and None in idx:
            keep = [m for m, i in enumerate(idx) if i is None]
            base = self._base + sum(int(i) * self._stride[m] for m, i in enumerate(idx) if i is not None)
            sub = Layout(tuple(self._shape[m] for m in keep), tuple(self._stride[m] for m in keep))
            return Tensor(Pointer(self._buf, base, self._dtype, self._name), sub)
        val = self._buf[self._offset(idx)]
        if self._is_int:
            return int(val)
        if val != val:
            raise AssertionError(f"{self._name}: read of an element never written")
        r = _new(F)
        r.v = val if type(val) is _f32 else _f32(val)
        return r

    @property
    def element_type(self) -> "_Dtype":
        return self._dtype

    def fill(self, value) -> None:
        for i in range(self._size):
            self[i] = value

    def __setitem__(self, idx, value):
        self._buf[self._offset(idx)] = int(value) if self._is_int else self._dtype.raw(value)


# ---------------------------------------------------------------------------------- thread model


class _Barrier:
    """``threading.Barrier``'s contract (all ``n`` threads must arrive; a wait that times out, or an
    ``abort()``, breaks it for every waiter with ``BrokenBarrierError``) at a fraction of its cost.

    Each waiting thread blocks on its own lock, which the last thread to arrive releases: waking a
    thread costs one lock release instead of a condition variable that all waiters then contend for.
    """

    def __init__(self, n: int, timeout: float):
        self.n, self.timeout = n, timeout
        self.mutex = threading.Lock()
        self.waiting: list[tuple[threading.Lock, list]] = []  # (lock held for the waiter, [outcome])
        self.broken = False

    def wait(self) -> None:
        wake = _tls.wake
        outcome = [None]
        with self.mutex:
            if self.broken:
                raise threading.BrokenBarrierError
            if len(self.waiting) == self.n - 1:  # the last one: release everybody
                for lock, out in self.waiting:
                    out[0] = True
                    lock.release()
                self.waiting = []
                return
            wake.acquire()  # free (each thread's lock is released when it is not waiting)
            self.waiting.append((wake, outcome))
        if not wake.acquire(timeout=self.timeout):
            with self.mutex:
                if outcome[0] is None:  # nobody came: break the barrier for everyone
                    self.waiting.remove((wake, outcome))
                    wake.release()
                    self._abort_locked()
                    raise threading.BrokenBarrierError
            wake.acquire()  # released just after the timeout: it completed (or was aborted)
        wake.release()
        if not outcome[0]:
            raise threading.BrokenBarrierError

    def _abort_locked(self) -> None:
        self.broken = True
        for lock, out in self.waiting:
            out[0] = False
            lock.release()
        self.waiting = []

    def abort(self) -> None:
        with self.mutex:
            self._abort_locked()


class _CTA:
    def __init__(self, block: tuple[int, int, int], threads: int, timeout: float,
                 grid: tuple[int, int, int] = (1, 1, 1)):
        self.block = block
        self.grid = grid
        self.barrier = _Barrier(threads, timeout)
        # per warp: its barrier and two slot arrays, used by alternate shuffles (see _shuffle_sync_bfly)
        self.warps = [(_Barrier(32, timeout), ([None] * 32, [None] * 32)) for _ in range(threads // 32)]
        self.smem: list[Tensor] = []
        self.lock = threading.Lock()


_tls = threading.local()


def _thread_idx():
    return (_tls.tid, 0, 0)


def _block_idx():
    return _tls.cta.block


def _grid_dim():
    return _tls.cta.grid


def _sync_threads():
    _tls.cta.barrier.wait()


def _named_barrier(barrier_id: int = 0, number_of_threads: int | None = None):
    """``bar.sync id, n``: the emulator runs whole CTAs, so only a barrier over every thread is modelled."""
    cta = _tls.cta
    assert number_of_threads in (None, cta.barrier.n), (
        f"named barrier {barrier_id} over {number_of_threads} of {cta.barrier.n} threads: not emulated")
    cta.barrier.wait()


def _fmax(a, b):
    return F(max(_v(a), _v(b)))


def _exchange(x, source):
    """A warp shuffle: every lane posts ``x`` and reads the value of lane ``source(lane)``.

    One barrier per shuffle: a lane writes slot array k % 2 for its k-th shuffle, so a fast lane cannot
    overwrite values not yet read (writing array k % 2 again, for shuffle k + 2, needs every lane past
    shuffle k + 1's barrier, hence done reading shuffle k)."""
    barrier, buffers = _tls.cta.warps[_tls.tid // 32]
    slots = buffers[_tls.shuffles & 1]
    _tls.shuffles += 1
    lane = _tls.tid % 32
    slots[lane] = x
    barrier.wait()
    return slots[source(lane)]


def _shuffle_sync_bfly(x, offset: int, mask: int = -1, mask_and_clamp: int = 31):
    return _exchange(x, lambda lane: lane ^ int(offset))


def _shuffle_sync(x, offset, mask: int = -1, mask_and_clamp: int = 31):
    # idx mode, PTX's rule: c = segment mask (bits 12:8) | clamp (bits 4:0); a source past the clamp reads
    # the lane's own value
    seg, clamp = (int(mask_and_clamp) >> 8) & 31, int(mask_and_clamp) & 31

    def source(lane):
        lo = lane & seg
        src = lo | (int(offset) & ~seg & 31)
        return src if src <= (lo | (clamp & ~seg)) else lane

    return _exchange(x, source)


_INT_UNWRITTEN = -(1 << 63)  # what an int64 buffer filled with NaN holds


def _unwritten(n: int, dtype: _Dtype) -> list:
    """A fresh shared / register buffer: NaN (floats) so that a read before a write is caught."""
    return [_INT_UNWRITTEN] * n if dtype.kind == "int" else [math.nan] * n


class _SmemAllocator:
    """Every thread of a CTA runs the allocations in the same order and gets the same buffers."""

    def __init__(self):
        self.n = 0

    def allocate_tensor(self, dtype: _Dtype, layout: Layout, byte_alignment: int = 16) -> Tensor:
        cta = _tls.cta
        with cta.lock:
            if self.n == len(cta.smem):
                buf = _unwritten(layout.cosize, dtype)
                cta.smem.append(Tensor(Pointer(buf, 0, dtype, f"smem{self.n}"), layout))
            t = cta.smem[self.n]
        self.n += 1
        return t


def _assume(x, divby=None):
    if divby is not None:
        assert int(x) % divby == 0, f"cute.assume({x}, divby={divby}) is false"
    return x


def _make_tensor(ptr: Pointer, layout: Layout) -> Tensor:
    return Tensor(ptr, layout)


def _make_rmem_tensor(layout: Layout, dtype: _Dtype) -> Tensor:
    return Tensor(Pointer(_unwritten(layout.cosize, dtype), 0, dtype, "rmem"), layout)


def _autovec_copy(src: Tensor, dst: Tensor) -> None:
    n = src.layout.size
    assert n == dst.layout.size, "autovec_copy: sizes differ"
    for i in range(n):
        dst[i] = src[i]


def _exp2(x: float) -> float:
    return 2.0 ** x if x < 1024.0 else math.inf


def _math(fn):
    def op(x, fastmath=False):
        return F(fn(np.float64(_v(x))))
    return op


cute = types.SimpleNamespace(
    arch=types.SimpleNamespace(thread_idx=_thread_idx, block_idx=_block_idx, grid_dim=_grid_dim,
                               sync_threads=_sync_threads, shuffle_sync_bfly=_shuffle_sync_bfly,
                               shuffle_sync=_shuffle_sync,
                               barrier=_named_barrier, fmax=_fmax, rcp_approx=_math(lambda x: 1.0 / x)),
    math=types.SimpleNamespace(exp=_math(math.exp), log=_math(math.log), log2=_math(math.log2),
                               rsqrt=_math(lambda x: 1.0 / math.sqrt(x)), exp2=_math(_exp2)),
    make_layout=lambda shape, stride=None: Layout(shape, stride),
    crd2idx=lambda coord, layout: sum(int(c) * d for c, d in zip(coord, layout.stride)),
    make_tensor=_make_tensor,
    make_rmem_tensor=_make_rmem_tensor,
    autovec_copy=_autovec_copy,
    assume=_assume,
)
cutlass = types.SimpleNamespace(
    Float32=Float32, BFloat16=BFloat16, Float16=Float16, Int32=Int32, Int64=Int64,
    range=lambda *a, unroll=None, **k: range(*[int(x) for x in a]),
    range_constexpr=lambda *a: range(*a),
    const_expr=lambda x: x,
    min=lambda a, b: a if a <= b else b,
    max=lambda a, b: a if a >= b else b,
    utils=types.SimpleNamespace(SmemAllocator=_SmemAllocator),
)


# --------------------------------------------------------------------------------- source rebinding


def _real_dtypes() -> dict:
    """The DSL's own dtype classes mapped to the emulator's (a module's ``F32 = cutlass.Float32`` aliases)."""
    try:
        import cutlass as real
    except ImportError:
        return {}
    return {id(getattr(real, name)): dt for name, dt in
            (("Float32", Float32), ("BFloat16", BFloat16), ("Float16", Float16), ("Int32", Int32), ("Int64", Int64))}


def rebind(fn: Callable, namespace: dict[str, Any]) -> Callable:
    """The undecorated source of ``fn`` with its module globals overridden by ``namespace`` (and module-level
    aliases of the DSL's dtypes by the emulator's)."""
    raw = getattr(fn, "__wrapped__", fn)
    glb = dict(raw.__globals__)
    dtypes = _real_dtypes()
    glb.update({name: dtypes[id(value)] for name, value in glb.items() if id(value) in dtypes})
    glb.update(namespace)
    return types.FunctionType(raw.__code__, glb, raw.__name__, raw.__defaults__, raw.__closure__)


class _Launch:
    def __init__(self, body: Callable, args: tuple):
        self.body, self.args = body, args

    def launch(self, grid, block, stream=None, **_: Any) -> None:
        launch(self.body, [int(g) for g in grid], int(block[0]) * int(block[1]) * int(block[2]), self.args)


def emulated_instance(obj: Any, helpers: dict[str, Callable], kernel_name: str | None = "kernel") -> Any:
    """A copy of kernel configuration ``obj`` whose DSL methods run on the emulator (``kernel_name`` None: a
    helper object without a kernel, e.g. a device routine another kernel's object holds).

    Calling the copy runs the host ``__call__`` source; its ``self.<kernel_name>(...).launch(grid, block)``
    runs the kernel source on every CTA of the grid it computes.
    """
    namespace = {"cute": cute, "cutlass": cutlass}
    namespace.update({name: rebind(fn, namespace) for name, fn in helpers.items()})
    cls = type(obj)
    members = {}
    for name, member in vars(cls).items():
        if callable(member) and (not name.startswith("__") or name == "__call__"):
            members[name] = rebind(member, namespace) if hasattr(member, "__wrapped__") else member
    body = members.pop(kernel_name) if kernel_name is not None else None
    emu_cls = type(f"Emulated{cls.__name__}", (), members)
    inst = emu_cls()
    inst.__dict__.update(obj.__dict__)
    if body is not None:
        setattr(inst, kernel_name, lambda *args: _Launch(lambda *a: body(inst, *a), args))
    return inst


def launch(kernel: Callable, grid: Sequence[int], threads: int, args: Sequence[Any], timeout: float = 20.0) -> None:
    """Run ``kernel(*args)`` for every CTA of ``grid`` (x fastest), ``threads`` Python threads each."""
    # The threads only need to interleave at barriers and shuffles, where they block anyway; the
    # interpreter's forced switches every 5 ms among hundreds of runnable threads only add OS context
    # switches (a third of the run time). Results and checks do not depend on the interleaving.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(max(interval, 0.5))
    try:
        _launch(kernel, grid, threads, args, timeout)
    finally:
        sys.setswitchinterval(interval)


def _launch(kernel: Callable, grid: Sequence[int], threads: int, args: Sequence[Any], timeout: float) -> None:
    errors: list[BaseException] = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                cta = _CTA((bx, by, bz), threads, timeout, tuple(grid))

                def body(tid: int, cta=cta) -> None:
                    _tls.tid, _tls.cta, _tls.shuffles, _tls.wake = tid, cta, 0, threading.Lock()
                    try:
                        kernel(*args)
                    except threading.BrokenBarrierError:
                        errors.append(RuntimeError(f"thread {tid} of CTA {cta.block}: a barrier was broken"))
                    except BaseException as exc:  # noqa: BLE001 - report every thread's failure
                        errors.append(exc)
                        cta.barrier.abort()
                        for barrier, _ in cta.warps:
                            barrier.abort()

                pool = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
                for th in pool:
                    th.start()
                for th in pool:
                    th.join()
                if errors:
                    first = next((e for e in errors if not isinstance(e, RuntimeError)), errors[0])
                    raise AssertionError(f"CTA {cta.block}: {type(first).__name__}: {first}") from first


def _buffer(flat: torch.Tensor, dtype: _Dtype) -> list:
    """The list buffer of a registered tensor: exact values, as ``np.float32`` where that is exact."""
    if dtype.kind != "float":
        return flat.to(torch.int64).tolist()
    arr = flat.to(torch.float64).numpy()
    as32 = arr.astype(np.float32)
    if np.array_equal(as32.astype(np.float64), arr, equal_nan=True):
        return list(as32)  # reads then need no conversion
    return arr.tolist()


class Memory:
    """Device memory for an emulated launch: torch tensors mirrored into buffers by ``data_ptr``."""

    def __init__(self):
        self.tensors: dict[int, torch.Tensor] = {}

    def register(self, *tensors: torch.Tensor | None) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.tensors[t.data_ptr()] = t

    def pointers(self, specs, values) -> tuple[list[Any], list[tuple[torch.Tensor, list]]]:
        """Kernel arguments for launcher ``values`` (pointers resolved to buffers), plus write-backs."""
        dtypes = {"Float32": Float32, "BFloat16": BFloat16, "Float16": Float16, "Int32": Int32, "Int64": Int64}
        args, backs, bufs = [], [], {}
        for spec, value in zip(specs, values):
            if spec.kind == "ptr":
                dtype = dtypes[spec.dtype.__name__]
                if value == 0:
                    args.append(Pointer(None, 0, dtype, "null"))
                    continue
                t = self.tensors[value]
                if value not in bufs:  # one buffer per tensor: in-place updates alias
                    flat = t.detach().reshape(-1)
                    bufs[value] = _buffer(flat, dtype)
                    backs.append((t, bufs[value]))
                args.append(Pointer(bufs[value], 0, dtype, f"tensor{list(t.shape)}"))
            elif spec.kind == "i32":
                args.append(int(value))
            elif spec.kind == "f32":
                args.append(F(value))
            else:
                args.append(None)
        return args, backs

    @staticmethod
    def write_back(backs: list[tuple[torch.Tensor, list]]) -> None:
        for t, buf in backs:
            arr = np.array(buf, dtype=np.float64 if t.dtype.is_floating_point else np.int64)
            t.view(-1).copy_(torch.from_numpy(arr).to(t.dtype))

"""Run a SIMT CuTe DSL kernel's Python source on the CPU, one Python thread per CUDA thread.

Compile checks prove a kernel lowers to good PTX, not that it computes the right thing; on a machine
without a GPU this emulator runs the kernel's own source (the functions under ``@cute.jit`` /
``@cute.kernel``, taken from ``__wrapped__``) with stand-ins for the few DSL calls the decode kernels
use: register tensors and shared memory are numpy buffers addressed through the CuTe layouts the kernel
builds, ``shuffle_sync_bfly`` exchanges values between the 32 threads of a warp, ``sync_threads`` is a
barrier over the CTA, and scalars are fp32 (bf16 / fp16 stores round as the hardware does).

It checks what a GPU run would only show as wrong numbers or a crash: every global access is in bounds
of its tensor, every ``cute.assume(x, divby=n)`` holds, shared and register memory is written before
it is read (buffers start as NaN), and every thread reaches each barrier and shuffle (a deadlock times
out). Only what the decode kernels use is emulated; anything else raises ``AttributeError``.
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# --------------------------------------------------------------------------------------- numbers


def _round_bf16(x: float) -> np.float32:
    b = np.array([x], dtype=np.float32).view(np.uint32)
    b = ((b.astype(np.uint64) + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return b.view(np.float32)[0]


class _Dtype:
    """A dtype tag that also converts, like ``cutlass.Float32(x)``."""

    def __init__(self, name: str, kind: str, width: int):
        self.name, self.kind, self.width = name, kind, width

    def __call__(self, x: Any) -> Any:
        return self.convert(x)

    def convert(self, x: Any) -> Any:
        v = x.v if isinstance(x, F) else x
        if self.kind == "int":
            return int(v)
        if self.name == "bf16":
            return F(_round_bf16(float(v)))
        if self.name == "f16":
            return F(np.float32(np.float16(v)))
        return F(v)

    def __repr__(self) -> str:
        return self.name


Float32 = _Dtype("f32", "float", 32)
BFloat16 = _Dtype("bf16", "float", 16)
Float16 = _Dtype("f16", "float", 16)
Int32 = _Dtype("i32", "int", 32)
Int64 = _Dtype("i64", "int", 64)


def _v(x: Any) -> np.float32:
    return x.v if isinstance(x, F) else np.float32(x)


class F:
    """An fp32 value in the kernel (result of arithmetic on fp32 values)."""

    __slots__ = ("v",)

    def __init__(self, v: Any):
        self.v = np.float32(v)

    def to(self, dtype: _Dtype) -> Any:
        return dtype.convert(self)

    def __add__(self, o): return F(self.v + _v(o))
    def __radd__(self, o): return F(_v(o) + self.v)
    def __sub__(self, o): return F(self.v - _v(o))
    def __rsub__(self, o): return F(_v(o) - self.v)
    def __mul__(self, o): return F(self.v * _v(o))
    def __rmul__(self, o): return F(_v(o) * self.v)
    def __truediv__(self, o): return F(self.v / _v(o))
    def __rtruediv__(self, o): return F(_v(o) / self.v)
    def __neg__(self): return F(-self.v)
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
    """A CuTe tensor over a numpy buffer: ``offset + sum(coord * stride)`` addresses an element."""

    def __init__(self, ptr: Pointer, layout: Layout):
        self.ptr, self.layout = ptr, layout

    @property
    def iterator(self) -> Pointer:
        return self.ptr

    def _offset(self, idx) -> int:
        shape, stride = self.layout.shape, self.layout.stride
        if isinstance(idx, tuple):
            assert len(idx) == len(shape), f"{self.ptr.name}: index {idx} for shape {shape}"
            coords = idx
        else:  # a flat index runs over the modes first-mode-fastest, as in CuTe
            coords, rest = [], int(idx)
            assert 0 <= rest < self.layout.size, f"{self.ptr.name}: flat index {idx} of {shape}"
            for s in shape:
                coords.append(rest % s)
                rest //= s
        off = self.ptr.offset
        for c, s, d in zip(coords, shape, stride):
            c = int(c)
            assert 0 <= c < s, f"{self.ptr.name}: coordinate {coords} out of shape {shape}"
            off += c * d
        buf = self.ptr.buf
        assert buf is not None, f"{self.ptr.name}: access through a null pointer"
        assert 0 <= off < buf.shape[0], f"{self.ptr.name}: element {off} out of bounds ({buf.shape[0]})"
        return off

    def __getitem__(self, idx):
        if isinstance(idx, tuple) and any(i is None for i in idx):
            keep = [m for m, i in enumerate(idx) if i is None]
            base = self.ptr.offset + sum(int(i) * self.layout.stride[m] for m, i in enumerate(idx) if i is not None)
            sub = Layout(tuple(self.layout.shape[m] for m in keep), tuple(self.layout.stride[m] for m in keep))
            return Tensor(Pointer(self.ptr.buf, base, self.ptr.dtype, self.ptr.name), sub)
        val = self.ptr.buf[self._offset(idx)]
        if self.ptr.dtype.kind == "int":
            return int(val)
        assert not np.isnan(val), f"{self.ptr.name}: read of an element never written"
        return F(val)

    @property
    def element_type(self) -> "_Dtype":
        return self.ptr.dtype

    def fill(self, value) -> None:
        for i in range(self.layout.size):
            self[i] = value

    def __setitem__(self, idx, value):
        self.ptr.buf[self._offset(idx)] = self.ptr.dtype.convert(value).v if self.ptr.dtype.kind == "float" \
            else int(value)


# ---------------------------------------------------------------------------------- thread model


class _CTA:
    def __init__(self, block: tuple[int, int, int], threads: int, timeout: float):
        self.block = block
        self.barrier = threading.Barrier(threads, timeout=timeout)
        self.warps = [(threading.Barrier(32, timeout=timeout), [None] * 32) for _ in range(threads // 32)]
        self.smem: list[Tensor] = []
        self.lock = threading.Lock()


_tls = threading.local()


def _thread_idx():
    return (_tls.tid, 0, 0)


def _block_idx():
    return _tls.cta.block


def _sync_threads():
    _tls.cta.barrier.wait()


def _shuffle_sync_bfly(x, offset: int, mask: int = -1, mask_and_clamp: int = 31):
    barrier, slots = _tls.cta.warps[_tls.tid // 32]
    lane = _tls.tid % 32
    slots[lane] = x
    barrier.wait()
    y = slots[lane ^ int(offset)]
    barrier.wait()
    return y


class _SmemAllocator:
    """Every thread of a CTA runs the allocations in the same order and gets the same buffers."""

    def __init__(self):
        self.n = 0

    def allocate_tensor(self, dtype: _Dtype, layout: Layout, byte_alignment: int = 16) -> Tensor:
        cta = _tls.cta
        with cta.lock:
            if self.n == len(cta.smem):
                buf = np.full(layout.cosize, np.nan, dtype=np.float64 if dtype.kind == "float" else np.int64)
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
    buf = np.full(layout.cosize, np.nan, dtype=np.float64 if dtype.kind == "float" else np.int64)
    return Tensor(Pointer(buf, 0, dtype, "rmem"), layout)


def _autovec_copy(src: Tensor, dst: Tensor) -> None:
    n = src.layout.size
    assert n == dst.layout.size, "autovec_copy: sizes differ"
    for i in range(n):
        dst[i] = src[i]


def _math(fn):
    def op(x, fastmath=False):
        return F(fn(np.float64(_v(x))))
    return op


cute = types.SimpleNamespace(
    arch=types.SimpleNamespace(thread_idx=_thread_idx, block_idx=_block_idx, sync_threads=_sync_threads,
                               shuffle_sync_bfly=_shuffle_sync_bfly),
    math=types.SimpleNamespace(exp=_math(math.exp), log=_math(math.log),
                               rsqrt=_math(lambda x: 1.0 / math.sqrt(x)), exp2=_math(lambda x: 2.0 ** x)),
    make_layout=lambda shape, stride=None: Layout(shape, stride),
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


def rebind(fn: Callable, namespace: dict[str, Any]) -> Callable:
    """The undecorated source of ``fn`` with its module globals overridden by ``namespace``."""
    raw = getattr(fn, "__wrapped__", fn)
    glb = dict(raw.__globals__)
    glb.update(namespace)
    return types.FunctionType(raw.__code__, glb, raw.__name__, raw.__defaults__, raw.__closure__)


class _Launch:
    def __init__(self, body: Callable, args: tuple):
        self.body, self.args = body, args

    def launch(self, grid, block, stream=None, **_: Any) -> None:
        launch(self.body, [int(g) for g in grid], int(block[0]) * int(block[1]) * int(block[2]), self.args)


def emulated_instance(obj: Any, helpers: dict[str, Callable], kernel_name: str = "kernel") -> Any:
    """A copy of kernel configuration ``obj`` whose DSL methods run on the emulator.

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
    body = members.pop(kernel_name)
    emu_cls = type(f"Emulated{cls.__name__}", (), members)
    inst = emu_cls()
    inst.__dict__.update(obj.__dict__)
    setattr(inst, kernel_name, lambda *args: _Launch(lambda *a: body(inst, *a), args))
    return inst


def launch(kernel: Callable, grid: Sequence[int], threads: int, args: Sequence[Any], timeout: float = 20.0) -> None:
    """Run ``kernel(*args)`` for every CTA of ``grid`` (x fastest), ``threads`` Python threads each."""
    errors: list[BaseException] = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                cta = _CTA((bx, by, bz), threads, timeout)

                def body(tid: int, cta=cta) -> None:
                    _tls.tid, _tls.cta = tid, cta
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


class Memory:
    """Device memory for an emulated launch: torch tensors mirrored into numpy buffers by ``data_ptr``."""

    def __init__(self):
        self.tensors: dict[int, torch.Tensor] = {}

    def register(self, *tensors: torch.Tensor | None) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.tensors[t.data_ptr()] = t

    def pointers(self, specs, values) -> tuple[list[Any], list[tuple[torch.Tensor, np.ndarray]]]:
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
                    bufs[value] = flat.to(torch.float64 if dtype.kind == "float" else torch.int64).numpy().copy()
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
    def write_back(backs: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        for t, buf in backs:
            t.view(-1).copy_(torch.from_numpy(buf).to(t.dtype))

"""Host-side pieces shared by the decode kernels: input checks, the state pool, output buffers.

The decode host functions sit on the serving hot path (one call per layer per generated token), so
everything here reads tensor metadata only: no device work, no host sync, no allocation beyond the
outputs the caller did not provide. ``state_indices`` values are not checked (as FLA's
``ssm_state_indices`` are not): the public op checks them where that is cheap.
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import torch

from cula._op import getter

#: Activation dtypes the decode kernels are compiled for.
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Every pointer the kernels take is assumed 16-byte aligned (torch's allocations are 256-byte aligned).
ALIGN = 16


def cutlass_dtype(dtype: torch.dtype):
    """The cutlass numeric type of a torch dtype the kernels take."""
    import cutlass

    return {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }[dtype]


def shape_of(x: Any) -> str:
    return f"{list(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else type(x).__name__


def expect_shape(name: str, x: Any, shape: tuple[int, ...], meaning: str) -> None:
    """ValueError unless ``x`` is a tensor of exactly ``shape``."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {meaning} = {list(shape)}, got {shape_of(x)}")


def expect_numel(name: str, x: Any, numel: int, meaning: str) -> None:
    if not isinstance(x, torch.Tensor) or x.numel() != numel:
        got = x.numel() if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected {numel} elements ({meaning}), got {got}")


def aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % ALIGN == 0 for t in tensors)


def is_dense(x: torch.Tensor) -> bool:
    """Whether :func:`dense` leaves ``x`` as it is."""
    return x.is_contiguous() and not x.data_ptr() % ALIGN


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous and 16-byte aligned (a copy only when it is not already)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % ALIGN:
        x = x.clone()
    return x


def check_pool(
    initial_state: torch.Tensor | None,
    state_indices: torch.Tensor | None,
    inplace: bool,
    B: int,
    state_shape: tuple[int, int, int],
    state_desc: str,
) -> None:
    """Checks of the state / pool arguments shared by the decode host functions.

    Args:
        initial_state: ``[B, *state_shape]``, or a pool ``[P, *state_shape]`` with ``state_indices``.
        state_indices: ``[B]`` int32/int64 slots (negative = skip the row), or None.
        inplace: write the new states back into ``initial_state``.
        state_shape: ``(HV, K, V)`` (or ``(HV, V, K)`` for V-first states).
    """
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("initial_state: expected the state pool [P, ...] with state_indices, got None")
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1 or state_indices.numel() != B:
            raise ValueError(f"state_indices: expected a 1-D int32/int64 tensor [B] = [{B}], got {shape_of(state_indices)}")
        if state_indices.dtype not in INDEX_DTYPES:
            raise ValueError(f"state_indices: expected dtype int32 or int64, got {state_indices.dtype}")
        if state_indices.device != initial_state.device:
            raise ValueError(f"state_indices: expected a tensor on {initial_state.device}, got {state_indices.device}")
    if inplace and initial_state is None:
        raise ValueError("initial_state: expected a state (pool) to update with inplace=True, got None")
    if initial_state is None:
        return
    if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != state_shape:
        raise ValueError(f"initial_state: expected shape [N, {state_desc}] = [N, {', '.join(map(str, state_shape))}], "
                         f"got {shape_of(initial_state)}")
    if state_indices is None and initial_state.shape[0] != B:
        raise ValueError(f"initial_state: expected {B} states (one per batch row) without state_indices, "
                         f"got {initial_state.shape[0]}")


def check_out(out: torch.Tensor | None, v: torch.Tensor) -> None:
    """``out`` (a caller-provided o) must be None or a contiguous 16-byte aligned tensor like ``v``."""
    if out is not None and (tuple(out.shape) != tuple(v.shape) or out.dtype != v.dtype or not out.is_contiguous()
                            or not aligned(out)):
        raise ValueError(f"out: expected a contiguous 16-byte aligned {v.dtype} tensor of shape "
                         f"{list(v.shape)}, got {shape_of(out)}")


def cuda_tensors(*tensors: Any) -> bool:
    """Whether every one of ``tensors`` that is not None is a CUDA tensor (all the kernels take)."""
    return all(x is None or (isinstance(x, torch.Tensor) and x.is_cuda) for x in tensors)


def state_reason(initial_state: torch.Tensor | None) -> str | None:
    """Why the kernels cannot read/write ``initial_state`` in place as given, or None."""
    if initial_state is None:
        return None
    if initial_state.dtype != torch.float32:
        return f"the kernel keeps fp32 states, got a {initial_state.dtype} state"
    if not initial_state.is_contiguous():
        return "the kernel needs a contiguous state (pool)"
    if initial_state.data_ptr() % ALIGN:
        return "the kernel needs a 16-byte aligned state (pool)"
    return None


def new_state(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A new fp32 final state the kernel writes (out of place)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


class DecodeRunner:
    """One checked static signature of a decode host function, ready to launch.

    Everything the host function decides from the metadata of its arguments (the compiled kernel,
    the sizes and scalars it takes, which inputs need a dense copy, what the outputs are) is decided
    once; a call with tensors of the same metadata then only allocates the outputs, takes the data
    pointers and the stream, and launches (through a :class:`~cula.kernels.common.fast_launch.BoundLaunch`
    once the launcher's fast path is verified). Holding it for later calls is only valid for tensors
    whose shapes, contiguity, dtypes, device and 16-byte alignment equal those it was made from (the
    public ops' call plans key on those, among others).

    Args:
        launcher: the compiled kernel's Launcher; None when there is nothing to launch (B = 0).
        names: the tensor arguments a call passes, positionally, in this order: only those the kernel
            reads (a None argument, or one its flags leave unused, is not passed).
        pointers: per pointer argument of the kernel, in order: a name of ``names``, ``"o"``,
            ``"final_state"`` or None (a null pointer).
        like: the name of the tensor ``o`` is allocated like (``torch.empty_like``).
        final: None (no final state), :data:`INPLACE` (the final state is the ``initial_state``
            argument) or the shape of a new fp32 final state.
        statics: the kernel's scalar arguments, between its pointers and its stream.
        device: the inputs' device (new final state, stream).
        dense: names whose tensors go through :func:`dense` (not contiguous or not 16-byte aligned).
        stream_query: ``device index -> cudaStream_t``
            (:func:`~cula.kernels.common.fast_launch.stream_query`).
        arg_order: all tensor arguments of the host function, in order: ``take`` picks ``names``
            out of a tuple of them (None where the host function got None).
    """

    __slots__ = ("names", "take", "launcher", "statics", "_like", "_final", "_h0", "_dense", "_device", "_index",
                 "_order", "_n_ptr", "_stream", "_bound", "_lock")

    def __init__(self, launcher: Any, names: tuple[str, ...], pointers: tuple[str | None, ...], like: str,
                 final: Any, statics: tuple, device: torch.device, dense: tuple[str, ...] = (),
                 stream_query: Any = None, arg_order: tuple[str, ...] | None = None):
        self.names = names
        self.take = getter([(arg_order or names).index(name) for name in names])
        self.launcher = launcher
        self.statics = statics
        n = len(names)
        self._like = names.index(like)
        self._final = final
        self._h0 = names.index("initial_state") if final is INPLACE else -1
        self._dense = frozenset(names.index(name) for name in dense)
        self._device = device
        self._index = device.index
        # a call's pointer values: [its tensors..., o, new final state (or 0), 0, stream]
        where = {name: i for i, name in enumerate(names)}
        where.update(o=n, final_state=self._h0 if final is INPLACE else n + 1)
        where[None] = n + 2
        self._order = operator.itemgetter(*(where[p] for p in pointers), n + 3)
        self._n_ptr = len(pointers)
        self._stream = stream_query
        self._bound = None
        self._lock = threading.Lock()

    def __call__(self, *xs: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        return self.run(xs, out)

    def run(self, xs: tuple[torch.Tensor, ...], out: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """``self(*xs, out=out)`` (the public ops' call plans hold the tuple already)."""
        if self._dense:
            xs = tuple(dense(x) if i in self._dense else x for i, x in enumerate(xs))
        o = _empty_like(xs[self._like]) if out is None else out
        final = self._final
        if final is None:
            ht, new = None, 0
        elif final is INPLACE:
            ht, new = xs[self._h0], 0
        else:
            ht = new_state(final, self._device)
            new = ht.data_ptr()
        if self.launcher is None:
            return o, ht
        values = self._order((*map(_data_ptr, xs), o.data_ptr(), new, 0, self._stream(self._index)))
        bound = self._bound
        if bound is None:
            bound = self._bind()
        if bound is not None:
            bound(values)
        else:
            self.launcher(*values[:-1], *self.statics, values[-1])
        return o, ht

    def _bind(self) -> Any:
        bind = getattr(self.launcher, "bind", None)  # any callable taking the launch values will do
        if bind is None:
            return None
        with self._lock:
            if self._bound is None:
                self._bound = bind({self._n_ptr + i: v for i, v in enumerate(self.statics)})
            return self._bound


INPLACE = "inplace"
_empty_like = torch.empty_like
_data_ptr = torch.Tensor.data_ptr  # map() calls the method descriptor without a bound method per tensor
#: Runners a kernel module keeps (one per static call signature); more than this start afresh.
RUNNERS_MAX = 256


def cached_runner(cache: dict, tensor_args: tuple[str, ...], used: tuple, config: tuple, dtypes: tuple,
                  statics: tuple, final: Any, make_launcher: Any, stream_query: Any) -> DecodeRunner:
    """The :class:`DecodeRunner` of a checked decode call, from a kernel module's ``cache``.

    ``tensor_args`` names the kernel's tensor arguments in order (``initial_state`` then
    ``state_indices`` last), ``used`` the tensors of this call (None where absent or unused), ``config`` /
    ``dtypes`` its compiled-kernel key, ``statics`` its sizes and scalars (``B`` first), ``final`` the
    final-state mode (INPLACE, a shape, or None), ``make_launcher()`` the compiled kernel's launcher and
    ``stream_query()`` the runner's stream getter (both only called for a new signature). The kernel's pointer arguments are the present tensors up to
    the initial state, the final state, o and the state indices."""
    device = used[0].device
    # the initial state is never copied: kernel_reason refused one that is not contiguous and aligned
    copy = tuple(n for n, x in zip(tensor_args, used) if x is not None and n != "initial_state" and not is_dense(x))
    key = (config, dtypes, statics, device, copy)
    hit = cache.get(key)
    if hit is None:
        names = tuple(n for n, x in zip(tensor_args, used) if x is not None)
        pointers = (*(n if x is not None else None for n, x in zip(tensor_args[:-1], used[:-1])),
                    "final_state" if final is not None else None, "o",
                    tensor_args[-1] if used[-1] is not None else None)
        hit = DecodeRunner(make_launcher() if statics[0] else None, names, pointers, "v", final, statics, device,
                           copy, stream_query(), tensor_args)
        if len(cache) >= RUNNERS_MAX:
            cache.clear()
        cache[key] = hit
    return hit


# The work split both decode kernels use: each warp owns V_PER_WARP values of V and all of K.
V_PER_WARP = 8
WARP_CHOICES = (4, 2, 1)  # warps per CTA: the most that still gives MIN_CTAS CTAs (small B: more SMs)
MIN_CTAS = 128  # ~ one CTA per SM of the 132
V_ALIGN = V_PER_WARP * max(WARP_CHOICES)  # V must be a multiple of the widest CTA
MAX_T = 8  # tokens per call (decode, MTP / speculative verification)


def pick_warps(B: int, HV: int, V: int) -> int:
    """Warps per CTA: 4 when that still makes ~one CTA per SM, fewer at small B so the state of a few
    heads is spread over more SMs (each SM's share of the bytes, hence its time, shrinks)."""
    units = B * HV * (V // V_PER_WARP)  # warps of work
    for warps in WARP_CHOICES:
        if units // warps >= MIN_CTAS:
            return warps
    return WARP_CHOICES[-1]


def decode_dims(q, k, v) -> tuple[int, int, int, int, int, int]:
    """``(B, T, H, K, HV, V)`` of decode inputs q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected a 4-D tensor [B, T, H, K], got {shape_of(q)}")
    B, T, H, K = q.shape
    expect_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected shape [B, T, HV, V] with B, T = {B}, {T}, got {shape_of(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v: expected HV (dim 2) a multiple of H = {H}, got HV = {HV}")
    return B, T, H, K, HV, V

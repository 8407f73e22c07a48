"""Argument checks shared by every public op, run before anything is launched.

Every failure raises ``ValueError`` naming the argument, what was expected and what was given, e.g.
``"beta: expected shape [B, T, HV] = [2, 64, 4], got [2, 64, 2]"``.

Cost policy (the checks sit on the hot path of every call):

- Shape, dtype, rank and device checks read tensor metadata only: no device work, no host sync.
- Checks on *values* need the values on the host. ``cu_seqlens`` values (start at 0, non-decreasing,
  last == total tokens) are read from ``cu_seqlens_cpu`` when the caller gives it (no sync); otherwise
  ``cu_seqlens`` is copied to the host once, the same sync FLA's own varlen path makes. Lightning's
  ``decay`` sign is checked the same way. Both are remembered per tensor (identity + in-place version
  counter), so a model that passes the same ``cu_seqlens`` / ``decay`` to every layer pays one copy, not
  one per layer. Nothing is synced while a CUDA graph is being captured (the values are then not checked).
- ``state_indices`` values (slot range, distinct slots) are checked when the tensor is on the CPU, and by
  the torch/FLA fallback paths; on the CUDA kernel path they are not (like FLA's ``ssm_state_indices``),
  unless ``CULA_DEBUG_CHECKS=1`` is set, which turns on every value check regardless of cost.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

#: Activation dtypes the public ops take (float64 only runs on the torch reference).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Dtypes of index tensors (``cu_seqlens``, ``state_indices``).
INDEX_DTYPES = (torch.int32, torch.int64)
#: State dtypes: the chunked ops take fp32 states as FLA asserts; recurrent/decode ops also take fp16/bf16
#: pools (they are computed in fp32 and written back in the pool's dtype).
STATE_DTYPES_STRICT = (torch.float32, torch.float64)
STATE_DTYPES_POOL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def debug_checks() -> bool:
    """True when ``CULA_DEBUG_CHECKS=1``: value checks that cost a host sync run on every path."""
    return os.environ.get("CULA_DEBUG_CHECKS", "") == "1"


class Dims(NamedTuple):
    """Problem sizes read from ``q, k, v`` (and ``cu_seqlens``): ``N`` is the number of sequences."""

    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int


def describe(x: Any) -> str:
    """A short description of ``x`` for error messages."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, bool, str)) else type(x).__name__


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    x: Any,
    *,
    shape: tuple[int, ...] | None = None,
    layout: str = "",
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``x`` is a tensor of the given shape (or rank), dtype and device; return it.

    ``layout`` names the dimensions in messages, e.g. ``"[B, T, HV]"``.
    """
    what = f"shape {layout} = {list(shape)}" if shape is not None and layout else (
        f"shape {list(shape)}" if shape is not None else f"a {ndim}-D tensor {layout}".rstrip()
    )
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of {what}, got {describe(x)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected {what}, got {list(x.shape)}")
    if shape is None and ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {what}, got {x.dim()}-D shape {list(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_names(dtypes)}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {x.device}")
    return x


def check_qkv(q: Any, k: Any, v: Any, *, gva: bool = True) -> Dims:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, HV, V]`` (``HV`` a multiple of ``H``; ``HV == H``
    when ``gva`` is False); one float dtype, one device. Returns the sizes with ``N = B``."""
    check_tensor("q", q, ndim=4, layout="[B, T, H, K]", dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, layout="[B, T, H, K]", dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("v", v, ndim=4, layout="[B, T, HV, V]", dtypes=FLOAT_DTYPES, device=q.device)
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q [B, T, H, K] = {list(q.shape)}, got {list(k.shape)}")
    B, T, H, K = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected leading dims [B, T] = {[B, T]} (as q), got {list(v.shape[:2])}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or K == 0 or V == 0:
        raise ValueError(f"q/v: expected non-empty head and feature dims, got q {list(q.shape)}, v {list(v.shape)}")
    if gva and HV % H != 0:
        raise ValueError(f"v: expected a number of value heads HV that is a multiple of H={H}, got HV={HV}")
    if not gva and HV != H:
        raise ValueError(f"v: expected H={H} heads as q (this op has no grouped value heads), got {HV}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: expected the dtype of q ({q.dtype}), got {x.dtype}")
    return Dims(B, T, H, K, HV, V, B)


def check_scale(scale: Any) -> None:
    """``scale`` is ``None`` (``K ** -0.5``) or a real number."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale: expected a float or None, got {describe(scale)}")


# --------------------------------------------------------------------------------------------------
# Value checks that need host values: run once per tensor version.

_checked: dict[tuple, tuple[weakref.ref, int]] = {}
_CHECKED_MAX = 1024


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_values_once(t: torch.Tensor, key: tuple, check: Callable[[torch.Tensor], None]) -> None:
    """Run ``check(t)`` (which may sync) unless it already passed for this very tensor at this version.

    ``key`` holds what else the check depends on (e.g. the expected total); ``check`` must depend on
    nothing but ``t`` and what ``key`` or the tensor metadata fix, so that a public op's fast path can
    replay it on the next call's tensor (:func:`recording_value_checks`). Skipped while a CUDA graph
    is being captured, since a sync would break the capture.
    """
    rec = getattr(_recorder, "checks", None)
    if rec is not None:
        rec.append((t, key, check))
    try:  # (_version inlined: this runs on every call of a planned op)
        version = t._version
    except RuntimeError:  # inference tensors have no version counter: never cache them
        version = None
    full_key = (id(t), *key)
    hit = _checked.get(full_key)
    if hit is not None and version is not None and hit[0]() is t and hit[1] == version:
        return  # passed before (no sync either way, capturing or not)
    if _capturing(t):
        return
    check(t)
    if version is None:
        return
    if len(_checked) >= _CHECKED_MAX:
        _checked.pop(next(iter(_checked)))
    _checked[full_key] = (weakref.ref(t), version)


_recorder = threading.local()


def start_recording_value_checks() -> list | None:
    """Record every :func:`check_values_once` call of this thread from now on (as ``(tensor, key, check)``)
    until :func:`stop_recording_value_checks`; returns the previous recording to hand back there."""
    previous = getattr(_recorder, "checks", None)
    _recorder.checks = []
    return previous


def stop_recording_value_checks(previous: list | None) -> list[tuple[torch.Tensor, tuple, Callable]]:
    """The value checks recorded since :func:`start_recording_value_checks`, in call order."""
    recorded = _recorder.checks
    _recorder.checks = previous
    return recorded


def _check_cu_values(name: str, values: list[int], T: int) -> None:
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]} (values {values})")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name}: expected non-decreasing values, got {values[i]} after {values[i - 1]} "
                f"at position {i} (values {values})"
            )
    if values[-1] != T:
        raise ValueError(f"{name}: expected the last value to equal the total tokens T={T}, got {values[-1]}")


def _check_cu_tensor(name: str, T: int, t: torch.Tensor) -> None:
    _check_cu_values(name, t.tolist(), T)


def check_cu_seqlens(
    cu_seqlens: Any, dims: Dims, device: torch.device, cu_seqlens_cpu: Any = None
) -> Dims:
    """Check ``cu_seqlens: [N+1]`` int32/int64 on ``device`` (and ``cu_seqlens_cpu``) against ``q``'s
    ``[B, T]``; returns ``dims`` with ``N`` set. See the module docstring for when values are read."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu: expected None when cu_seqlens is None, got a tensor")
        return dims
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor [N+1], got {describe(cu_seqlens)}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N+1], got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise ValueError(f"cu_seqlens: expected an integer dtype int32/int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected a tensor on {device} (the device of q), got one on {cu_seqlens.device}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 values [0, ..., T], got {cu_seqlens.numel()}")
    if dims.B != 1:
        raise ValueError(
            f"q: expected batch size B=1 with cu_seqlens (packed variable-length inputs), got B={dims.B}"
        )
    N = cu_seqlens.numel() - 1
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.dim() != 1:
            raise ValueError(f"cu_seqlens_cpu: expected a 1-D int32/int64 tensor [N+1], got {describe(cu_seqlens_cpu)}")
        if cu_seqlens_cpu.dtype not in INDEX_DTYPES:
            raise ValueError(f"cu_seqlens_cpu: expected an integer dtype int32/int64, got {cu_seqlens_cpu.dtype}")
        if cu_seqlens_cpu.numel() != cu_seqlens.numel():
            raise ValueError(
                f"cu_seqlens_cpu: expected {cu_seqlens.numel()} values like cu_seqlens, got {cu_seqlens_cpu.numel()}"
            )
        source, source_name = cu_seqlens_cpu, "cu_seqlens_cpu"
    else:
        source, source_name = cu_seqlens, "cu_seqlens"
    check_values_once(source, ("cu_seqlens", dims.T), functools.partial(_check_cu_tensor, source_name, dims.T))
    return dims._replace(N=N)


def check_state(
    name: str,
    state: Any,
    dims: Dims,
    device: torch.device,
    *,
    state_v_first: bool = False,
    rows: int | None = None,
    dtypes: tuple[torch.dtype, ...] = STATE_DTYPES_STRICT,
) -> None:
    """Check a state ``[rows, HV, K, V]`` (``[rows, HV, V, K]`` with ``state_v_first``); ``rows``
    defaults to the number of sequences ``N`` (``None`` accepts any, for a decode state pool)."""
    if state is None:
        return
    K, V = dims.K, dims.V
    inner = (dims.HV, V, K) if state_v_first else (dims.HV, K, V)
    layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {layout}, got {describe(state)}")
    expected_rows = dims.N if rows is None else rows
    if state.dim() != 4 or tuple(state.shape[1:]) != inner or (expected_rows >= 0 and state.shape[0] != expected_rows):
        lead = "P" if expected_rows < 0 else str(expected_rows)
        expected = [lead, *inner]
        hint = ""
        if state.dim() == 4 and tuple(state.shape[1:]) == (dims.HV, *inner[1:][::-1]) and K != V:
            hint = " (the other layout: check state_v_first)"
        raise ValueError(f"{name}: expected shape {layout} = {expected}, got {list(state.shape)}{hint}")
    if state.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_names(dtypes)}, got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {state.device}")


def check_gate(name: str, x: Any, shape: tuple[int, ...], layout: str, device: torch.device) -> None:
    """A per-token gate / beta tensor of exactly ``shape`` (float dtype, on ``device``)."""
    check_tensor(name, x, shape=shape, layout=layout, dtypes=FLOAT_DTYPES, device=device)


def check_param(name: str, x: Any, numel: int, meaning: str, device: torch.device) -> None:
    """A per-head parameter (``A_log``, ``dt_bias``) with ``numel`` elements, float, on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a float tensor of {numel} elements ({meaning}), got {describe(x)}")
    if x.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements ({meaning}), got shape {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a float dtype, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {x.device}")


def _check_decay_sign(decay: torch.Tensor) -> None:
    bad = (decay.detach() < 0) | decay.detach().isnan()
    if bool(bad.any()):
        raise ValueError(
            f"decay: expected rates >= 0 (the per-step factor is exp(-decay)), got {decay.detach().reshape(-1).tolist()}"
        )


def check_decay(decay: Any, HV: int, device: torch.device) -> torch.Tensor:
    """Lightning's ``decay``: ``HV`` float rates >= 0 (any shape with ``HV`` elements, e.g. ``[HV]`` or
    ``[HV, 1, 1]``). Returns it viewed as ``[HV]``. The sign is checked once per tensor version."""
    if not isinstance(decay, torch.Tensor):
        raise ValueError(f"decay: expected a float tensor of shape [HV] = [{HV}], got {describe(decay)}")
    if decay.numel() != HV:
        raise ValueError(f"decay: expected shape [HV] = [{HV}] (one rate per value head), got {list(decay.shape)}")
    if decay.dtype not in FLOAT_DTYPES:
        raise ValueError(f"decay: expected a float dtype, got {decay.dtype}")
    if decay.device != device:
        raise ValueError(f"decay: expected a tensor on {device} (the device of q), got one on {decay.device}")

    check_values_once(decay, ("decay",), _check_decay_sign)
    # an [HV] decay is passed on as itself (no new view object), so the op's fast path can reuse the call plan
    return decay if decay.dim() == 1 else decay.reshape(HV)


def check_state_indices(state_indices: Any, rows: int, pool_size: int, device: torch.device) -> None:
    """``state_indices: [rows]`` int32/int64 on ``device``; values ``< pool_size``, distinct where
    non-negative (negative = skip the row). Values are checked only for CPU tensors or when
    ``CULA_DEBUG_CHECKS=1`` (a sync otherwise; the fallback paths check them when they gather)."""
    if not isinstance(state_indices, torch.Tensor):
        raise ValueError(f"state_indices: expected a 1-D int32/int64 tensor [{rows}], got {describe(state_indices)}")
    if state_indices.dim() != 1 or state_indices.numel() != rows:
        raise ValueError(
            f"state_indices: expected shape [N] = [{rows}] (one slot per sequence), got {list(state_indices.shape)}"
        )
    if state_indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"state_indices: expected an integer dtype int32/int64, got {state_indices.dtype}")
    if state_indices.device != device:
        raise ValueError(
            f"state_indices: expected a tensor on {device} (the device of the state pool), got one on {state_indices.device}"
        )
    if state_indices.is_cuda and not debug_checks():
        return

    check_values_once(state_indices, ("state_indices", pool_size), functools.partial(_check_slots, pool_size))


def _check_slots(pool_size: int, state_indices: torch.Tensor) -> None:
    slots = [i for i in state_indices.tolist() if i >= 0]
    if slots and max(slots) >= pool_size:
        raise ValueError(f"state_indices: expected slots < pool size {pool_size}, got {max(slots)}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"state_indices: expected distinct non-negative slots, got {state_indices.tolist()}")


def check_flag_pair_neg_eigval(allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool) -> None:
    """FLA's rule: ``allow_neg_eigval`` scales the in-kernel sigmoid, so it needs that flag."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(
            "allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True alongside it "
            "(beta becomes 2 * sigmoid(beta)), got use_beta_sigmoid_in_kernel=False"
        )


def check_chunk_size(chunk_size: Any, allowed: tuple[int, ...]) -> None:
    """``chunk_size`` (an FLA keyword) must be one FLA accepts for this op."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in allowed:
        raise ValueError(f"chunk_size: expected one of {list(allowed)}, got {describe(chunk_size)}")


def check_pool_arguments(a: dict[str, Any], dims: Dims, device: torch.device, state_v_first: bool = False) -> None:
    """The state-pool arguments of a decode op: ``initial_state`` (``[N, ...]`` states, or a pool
    ``[P, ...]`` with ``state_indices: [N]``) and ``inplace`` (needs a state, one that needs no grad)."""
    state, indices, inplace = a["initial_state"], a.get("state_indices"), bool(a.get("inplace"))
    if indices is not None and state is None:
        raise ValueError("initial_state: expected a state pool [P, HV, K, V] when state_indices is given, got None")
    if inplace and state is None:
        raise ValueError("initial_state: expected the state (pool) to update when inplace=True, got None")
    rows = -1 if indices is not None else None  # a pool has any number of slots P
    check_state("initial_state", state, dims, device, state_v_first=state_v_first, rows=rows,
                dtypes=STATE_DTYPES_POOL)
    if indices is not None:
        check_state_indices(indices, dims.N, state.shape[0], state.device)
    if inplace and torch.is_grad_enabled() and state.requires_grad:
        raise ValueError("inplace: expected a pool that does not require grad (it is updated in place), got one that does")

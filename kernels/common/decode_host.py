"""Host-side pieces shared by the decode kernels: input checks, the state pool, output buffers.

The decode host functions sit on the serving hot path (one call per layer per generated token), so
everything here reads tensor metadata only: no device work, no host sync, no allocation beyond the
outputs the caller did not provide. ``state_indices`` values are not checked (as FLA's
``ssm_state_indices`` are not): the public op checks them where that is cheap.
"""

from __future__ import annotations

from typing import Any

import torch

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


def new_final_state(
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    inplace: bool,
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor | None:
    """The tensor the kernel writes the final states into (the pool itself when ``inplace``)."""
    if inplace:
        return initial_state
    if output_final_state:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return None


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

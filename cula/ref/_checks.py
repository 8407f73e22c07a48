"""Argument checks shared by the references.

Kept local to ``cula.ref`` (torch only) so the references stay importable on their own. Every failure
is a ``ValueError`` that names the argument, what was expected and what was given.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64)


def check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")


def check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, HV, V]`` with ``HV % H == 0``.

    Returns ``(B, T, H, K, HV, V)``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a 4-D tensor [B, T, heads, dim], got {got}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v: expected leading dims [B, T] = {[B, T]}, got {list(v.shape[:2])}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v: expected a number of value heads divisible by H={H}, got HV={HV}")
    return B, T, H, K, HV, V


def check_shape(name: str, x: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    if x is None:
        raise ValueError(f"{name}: expected a tensor of shape {list(expected)}, got None")
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {list(expected)}, got {list(x.shape)}")


def check_numel(name: str, x: torch.Tensor | None, expected: int, meaning: str) -> None:
    if x is None:
        raise ValueError(f"{name}: expected a tensor of {expected} elements ({meaning}), got None")
    if x.numel() != expected:
        raise ValueError(f"{name}: expected {expected} elements ({meaning}), got shape {list(x.shape)}")


def check_state(
    initial_state: torch.Tensor | None, N: int, HV: int, K: int, V: int, state_v_first: bool = False
) -> None:
    if initial_state is None:
        return
    expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
    if tuple(initial_state.shape) != expected:
        raise ValueError(
            f"initial_state: expected shape {layout} = {list(expected)}, got {list(initial_state.shape)}"
        )


def seqlens_from_cu(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[int] | None:
    """Validate ``cu_seqlens`` and return the segment lengths (None for fixed-length batches)."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor [N+1], got {got}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., total], got {cu_seqlens.tolist()}")
    if B != 1:
        raise ValueError(f"q: expected batch size 1 with cu_seqlens (packed inputs), got B={B}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {cu[0]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens: expected non-decreasing values, got {cu}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens: expected last entry == total tokens T={T}, got {cu[-1]}")
    return lengths

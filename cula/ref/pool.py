"""Decode state pool: gather the states of a batch from a pool of slots, scatter them back.

A pool is ``[P, ...]`` (e.g. ``[P, HV, K, V]``); ``state_indices: [B]`` int32/int64 maps batch row ``b``
to slot ``state_indices[b]``. A negative index skips the row: :func:`gather_states` gives it a zero
state, :func:`scatter_states` leaves every slot it could have touched alone, and the decode op's output
for that row is zero (:func:`zero_skipped_rows`).
"""

from __future__ import annotations

import torch


def _check_indices(state_indices: torch.Tensor, P: int, B: int | None = None) -> torch.Tensor:
    """Validate and return the boolean mask of rows that are not skipped."""
    if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1:
        got = tuple(state_indices.shape) if isinstance(state_indices, torch.Tensor) else type(state_indices).__name__
        raise ValueError(f"state_indices: expected a 1-D int32/int64 tensor [B], got {got}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices: expected dtype int32 or int64, got {state_indices.dtype}")
    if B is not None and state_indices.numel() != B:
        raise ValueError(f"state_indices: expected {B} entries (one per row of states), got {state_indices.numel()}")
    valid = state_indices >= 0
    used = state_indices[valid]
    if used.numel() and int(used.max()) >= P:
        raise ValueError(f"state_indices: expected slots < pool size {P}, got max {int(used.max())}")
    if used.numel() != used.unique().numel():
        raise ValueError(f"state_indices: expected distinct non-negative slots, got {state_indices.tolist()}")
    return valid


def gather_states(pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """Rows ``pool[state_indices[b]]``, zeros where the index is negative.

    Args:
        pool: ``[P, ...]`` state pool.
        state_indices: ``[B]`` int32/int64 slot per row; negative = skipped.
    Returns:
        ``[B, ...]`` in ``pool.dtype`` (a new tensor; differentiable w.r.t. ``pool``).
    """
    valid = _check_indices(state_indices, pool.shape[0])
    rows = pool[state_indices.clamp(min=0).long()]
    mask = valid.reshape(-1, *([1] * (pool.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=pool.dtype, device=pool.device))


def scatter_states(pool: torch.Tensor, states: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """Write ``states[b]`` into slot ``state_indices[b]`` of ``pool`` in place, skipping negative indices.

    Args:
        pool: ``[P, ...]`` state pool, modified in place.
        states: ``[B, ...]`` with ``pool``'s trailing shape (cast to ``pool.dtype``).
        state_indices: ``[B]`` int32/int64, distinct where non-negative.
    Returns:
        ``pool``.
    """
    if states.shape[1:] != pool.shape[1:]:
        raise ValueError(f"states: expected trailing shape {list(pool.shape[1:])}, got {list(states.shape)}")
    valid = _check_indices(state_indices, pool.shape[0], states.shape[0])
    slots = state_indices[valid].long()
    pool.index_copy_(0, slots.to(pool.device), states[valid].to(pool.dtype))
    return pool


def zero_skipped_rows(x: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """``x: [B, ...]`` with the rows of negative ``state_indices`` set to zero (out of place)."""
    valid = state_indices >= 0
    mask = valid.reshape(-1, *([1] * (x.dim() - 1))).to(x.device)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))

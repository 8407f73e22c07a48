"""Helpers shared by the FLA and torch runners of the public ops (``cula/<variant>/_paths.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """Precision of the torch reference path: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """``[B, T, H, D] -> [B, T, HV, D]``: q/k head ``h`` serves value heads ``h*G .. h*G+G-1``."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


def no_grad_for_frozen_decay(inputs: Mapping[str, Any], who: str) -> str | None:
    """FLA's simple_gla ops return no gradient for ``g_gamma``: refuse when ``decay`` needs one."""
    decay = inputs["decay"]
    if torch.is_grad_enabled() and decay.requires_grad:
        return f"{who} returns no gradient for g_gamma, and decay requires grad"
    return None


def zero_skipped(o: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``o: [B, T, ...]`` with the tokens of skipped sequences (negative ``state_indices``) zeroed."""
    valid = (state_indices >= 0).to(o.device)
    if cu_seqlens is None:
        mask = valid.reshape(-1, *([1] * (o.dim() - 1)))
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(o.device)
        per_token = valid.repeat_interleave(lengths, output_size=o.shape[1])
        mask = per_token.reshape(1, -1, *([1] * (o.dim() - 2)))
    return torch.where(mask, o, torch.zeros((), dtype=o.dtype, device=o.device))


def run_with_pool(
    inputs: Mapping[str, Any],
    step: Callable[[torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode state-pool semantics around ``step(initial_state, output_final_state) -> (o, ht)``.

    With ``state_indices``, row ``n`` starts from ``initial_state[state_indices[n]]`` (zeros when the
    index is negative; that row's output and final state are zeros and its slot is left alone). With
    ``inplace``, the new states are written back into the pool (``initial_state``) and the pool is
    returned as the final state. The gather checks the index values (a host sync).
    """
    from cula.ref.pool import gather_states, scatter_states

    pool = inputs["initial_state"]
    indices = inputs.get("state_indices")
    inplace = bool(inputs.get("inplace"))
    want_state = bool(inputs["output_final_state"]) or inplace
    h0 = gather_states(pool, indices) if indices is not None else pool
    o, ht = step(h0, want_state)
    if indices is not None:
        o = zero_skipped(o, indices, inputs.get("cu_seqlens"))
        if ht is not None:
            ht = zero_skipped(ht, indices, None)
    if not inplace:
        return o, (ht if inputs["output_final_state"] else None)
    if indices is not None:
        scatter_states(pool, ht, indices)
    else:
        pool.copy_(ht)
    return o, pool


def has_pool(inputs: Mapping[str, Any]) -> bool:
    """Whether the call uses decode state-pool semantics (``state_indices`` or ``inplace``)."""
    return inputs.get("state_indices") is not None or bool(inputs.get("inplace"))

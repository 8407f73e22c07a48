"""Exact torch reference for Lightning Attention (linear attention with a per-head constant decay).

    S_t = exp(-decay[h]) S_{t-1} + k_t^T v_t,    o_t = scale q_t S_t

equal to FLA's ``chunk_simple_gla(q, k, v, g_gamma=-decay, ...)``. GVA: ``q, k: [B, T, H, K]``,
``v: [B, T, HV, V]`` with ``HV`` a multiple of ``H``, ``decay: [HV]``.
"""

from __future__ import annotations

import torch

from cula.ref import _core
from cula.ref._checks import check_chunk_size, check_compute_dtype, check_numel, check_qkv


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Validate and return the log-decay ``g = -decay`` broadcast to ``[B, T, HV, 1]``."""
    B, T, H, K, HV, V = check_qkv(q, k, v)
    if not isinstance(decay, torch.Tensor):
        raise ValueError(f"decay: expected a tensor of shape [HV] = [{HV}], got {type(decay).__name__}")
    check_numel("decay", decay, HV, "one decay rate per value head")
    return (-decay.reshape(1, 1, HV, 1)).expand(B, T, HV, 1)


def _forward(form, q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens, chunk_size, dtype):
    check_compute_dtype(dtype)
    g = _prepare(q, k, v, decay)
    return _core.run(
        form, q, k, v, g, None,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        state_v_first=False,
        chunk_size=chunk_size,
        dtype=dtype,
    )


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token Lightning Attention (the ground truth).

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H``.
        decay: ``[HV]`` decay rates >= 0 (the per-step factor is ``exp(-decay)``).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``.
        output_final_state: return the final state.
        cu_seqlens: ``[N+1]`` int32/int64 for packed inputs (``B == 1``).
        dtype: compute and output precision (``torch.float32`` or ``torch.float64``).
    Returns:
        ``o: [B, T, HV, V]`` and the final state ``[N, HV, K, V]`` (or ``None``), both in ``dtype``.
    """
    return _forward("recurrent", q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens, 1, dtype)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Lightning Attention: same arguments and results as :func:`recurrent`, plus ``chunk_size``."""
    check_chunk_size(chunk_size)
    return _forward(
        "chunked", q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens, chunk_size, dtype
    )

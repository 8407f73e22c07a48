"""Exact torch reference for GLA (gated linear attention), mirroring ``fla.ops.gla.chunk_gla`` 0.6.0.

Per head, with a per-key-dim log-decay ``g_t: [K]`` (natural log; FLA's recurrent op calls it ``gk``)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = scale q_t^T S_t

Shapes as FLA: ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]`` (FLA's GLA has no GVA), states
``[N, H, K, V]`` or ``[N, H, V, K]`` with ``state_v_first``.
"""

from __future__ import annotations

import torch

from cula.ref import _core
from cula.ref._checks import check_chunk_size, check_compute_dtype, check_qkv, check_shape


def _forward(form, chunk_size, q, k, v, g, scale, initial_state, output_final_state, state_v_first,
             cu_seqlens, dtype):
    check_compute_dtype(dtype)
    B, T, H, K, HV, V = check_qkv(q, k, v)
    if HV != H:
        raise ValueError(f"v: expected H={H} heads like q (chunk_gla has no GVA), got {HV}")
    check_shape("g", g, (B, T, H, K))
    return _core.run(
        form, q, k, v, g, None,
        scale=K ** -0.5 if scale is None else scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
        dtype=dtype,
    )


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GLA (the ground truth).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``).
        cu_seqlens: ``[N+1]`` int32/int64 for packed inputs (``B == 1``).
        dtype: compute and output precision (``torch.float32`` or ``torch.float64``).
    Returns:
        ``o: [B, T, H, V]`` and the final state (layout as ``initial_state``) or ``None``, in ``dtype``.
    """
    return _forward("recurrent", 1, q, k, v, g, scale, initial_state, output_final_state, state_v_first,
                    cu_seqlens, dtype)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GLA: same arguments and results as :func:`recurrent`, plus ``chunk_size``."""
    check_chunk_size(chunk_size)
    return _forward("chunked", chunk_size, q, k, v, g, scale, initial_state, output_final_state,
                    state_v_first, cu_seqlens, dtype)

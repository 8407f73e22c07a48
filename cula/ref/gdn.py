"""Exact torch reference for the gated delta rule (GDN), mirroring ``chunk_gated_delta_rule`` 0.6.0.

Per value head, with one scalar log-decay ``g_t`` per head and token (natural log)::

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + beta_t k_t (v_t - k_t^T S'_t)^T
    o_t  = scale q_t^T S_t

Flags as in FLA 0.6.0: ``use_qk_l2norm_in_kernel`` (``x / sqrt(sum(x^2) + 1e-6)``),
``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval`` (``sigmoid(beta)`` / ``2 sigmoid(beta)``),
``state_v_first`` (``[N, HV, V, K]`` states) and, passed by keyword as FLA takes them through
``**kwargs``, ``use_gate_in_kernel`` with ``A_log: [HV]`` and ``dt_bias: [HV]``:
``g <- -exp(A_log) * softplus(g + dt_bias)``. GVA: ``v, g, beta`` have ``HV`` heads.
``g=None`` means no decay and ``beta=None`` means ``beta = 1`` (as in FLA's fused recurrent op).
"""

from __future__ import annotations

import torch

from cula.ref import _core
from cula.ref._checks import check_chunk_size, check_compute_dtype, check_numel, check_qkv, check_shape
from cula.ref._gates import beta_sigmoid, decay_gate, l2norm


def _forward(form, chunk_size, q, k, v, g, beta, scale, initial_state, output_final_state,
             use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
             cu_seqlens, use_gate_in_kernel, A_log, dt_bias, dtype):
    check_compute_dtype(dtype)
    B, T, H, K, HV, V = check_qkv(q, k, v)
    if g is not None:
        check_shape("g", g, (B, T, HV))
    if beta is not None:
        check_shape("beta", beta, (B, T, HV))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(
            "allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True alongside it, "
            "got use_beta_sigmoid_in_kernel=False"
        )
    if use_gate_in_kernel:
        if g is None:
            raise ValueError("g: expected the raw gate input [B, T, HV] with use_gate_in_kernel=True, got None")
        check_numel("A_log", A_log, HV, "one per value head")
        if dt_bias is not None:
            check_numel("dt_bias", dt_bias, HV, "one per value head")

    q, k, v = (x.to(dtype) for x in (q, k, v))
    g = q.new_zeros(B, T, HV) if g is None else g.to(dtype)
    beta = q.new_ones(B, T, HV) if beta is None else beta.to(dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    g = g[..., None]  # [B, T, HV, 1]: a scalar gate per head
    if use_gate_in_kernel:
        g = decay_gate(g, A_log.to(dtype), dt_bias.to(dtype) if dt_bias is not None else None, None)
    return _core.run(
        form, q, k, v, g, beta,
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
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (the ground truth).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[B, T, HV]`` log-decay (raw input with ``use_gate_in_kernel``), or ``None``.
        beta: ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``), or ``None`` (ones).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        cu_seqlens: ``[N+1]`` int32/int64 for packed inputs (``B == 1``).
        dtype: compute and output precision (``torch.float32`` or ``torch.float64``).
    Returns:
        ``o: [B, T, HV, V]`` and the final state (layout as ``initial_state``) or ``None``, in ``dtype``.
    """
    return _forward(
        "recurrent", 1, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
        cu_seqlens, use_gate_in_kernel, A_log, dt_bias, dtype,
    )


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (WY / UT transform per chunk): same arguments and results as :func:`recurrent`."""
    check_chunk_size(chunk_size)
    return _forward(
        "chunked", chunk_size, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
        cu_seqlens, use_gate_in_kernel, A_log, dt_bias, dtype,
    )

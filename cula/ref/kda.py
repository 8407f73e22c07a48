"""Exact torch reference for KDA (Kimi Delta Attention), mirroring ``fla.ops.kda.chunk_kda`` 0.6.0.

Per value head, with a per-key-dim log-decay ``g_t: [K]`` (natural log, as the public op takes it)::

    S'_t = diag(exp(g_t)) S_{t-1}
    S_t  = S'_t + beta_t k_t (v_t - k_t^T S'_t)^T
    o_t  = scale q_t^T S_t

What each flag does before the recurrence (read from FLA 0.6.0's ``chunk.py`` / ``chunk_fwd.py`` /
``gate.py`` / ``fused_recurrent.py``):

- ``use_qk_l2norm_in_kernel``: ``q, k <- x / sqrt(sum(x^2) + 1e-6)``.
- ``use_beta_sigmoid_in_kernel``: ``beta <- sigmoid(beta)``; with ``allow_neg_eigval`` ``2 sigmoid(beta)``
  (``allow_neg_eigval`` without the sigmoid flag is an error, as in FLA).
- ``use_gate_in_kernel``: ``g`` is raw; ``g <- -exp(A_log) * softplus(g + dt_bias)``, or, when
  ``lower_bound`` is set, ``g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then
  be ``None``). ``A_log: [HV]``, ``dt_bias: [HV * K]``.
- ``safe_gate``: only selects FLA's bounded-gate tensor-core path; the math is unchanged. With
  ``use_gate_in_kernel`` it requires ``lower_bound`` in ``[-5, 0)`` (checked as FLA does).
- ``state_v_first``: states are ``[N, HV, V, K]`` instead of ``[N, HV, K, V]``.

GVA (``HV > H``) is supported as in FLA: ``g: [B, T, HV, K]``, ``beta: [B, T, HV]``.
"""

from __future__ import annotations

import torch

from cula.ref import _core
from cula.ref._checks import check_chunk_size, check_compute_dtype, check_numel, check_qkv, check_shape
from cula.ref._gates import beta_sigmoid, decay_gate, l2norm


def _prepare(
    q, k, v, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, dtype,
):
    """Validate, cast to ``dtype`` and apply the in-kernel transforms; returns ``q, k, v, g, beta``."""
    check_compute_dtype(dtype)
    B, T, H, K, HV, V = check_qkv(q, k, v)
    check_shape("g", g, (B, T, HV, K))
    check_shape("beta", beta, (B, T, HV))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(
            "allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True alongside it "
            "(beta is scaled to 2*sigmoid(beta)), got use_beta_sigmoid_in_kernel=False"
        )
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("A_log: expected a [HV] tensor when use_gate_in_kernel=True and lower_bound is None, got None")
        if A_log is not None:
            check_numel("A_log", A_log, HV, "one per value head")
        if dt_bias is not None:
            check_numel("dt_bias", dt_bias, HV * K, "HV * K")
        if safe_gate:
            if lower_bound is None:
                raise ValueError("lower_bound: expected a float in [-5, 0) with safe_gate and use_gate_in_kernel, got None")
            if not -5 <= lower_bound < 0:
                raise ValueError(f"lower_bound: expected a value in [-5, 0) with safe_gate, got {lower_bound}")

    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    if use_gate_in_kernel:
        g = decay_gate(
            g,
            A_log.to(dtype) if A_log is not None else None,
            dt_bias.to(dtype) if dt_bias is not None else None,
            lower_bound,
        )
    return q, k, v, g, beta


def _forward(form, chunk_size, q, k, v, g, beta, scale, initial_state, output_final_state,
             use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, dtype):
    q, k, v, g, beta = _prepare(
        q, k, v, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, dtype,
    )
    return _core.run(
        form, q, k, v, g, beta,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
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
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (the ground truth); arguments as ``fla.ops.kda.chunk_kda`` 0.6.0.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[B, T, HV, K]`` log-decay (natural log), or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` (raw logits with ``use_beta_sigmoid_in_kernel``).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (used with ``use_gate_in_kernel``).
        cu_seqlens: ``[N+1]`` int32/int64 for packed inputs (``B == 1``).
        dtype: compute and output precision (``torch.float32`` or ``torch.float64``).
        Flags: see the module docstring.
    Returns:
        ``o: [B, T, HV, V]`` and the final state (layout as ``initial_state``) or ``None``, in ``dtype``.
    """
    return _forward(
        "recurrent", 1, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, dtype,
    )


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (WY / UT transform per chunk): same arguments and results as :func:`recurrent`."""
    check_chunk_size(chunk_size)
    return _forward(
        "chunked", chunk_size, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, dtype,
    )

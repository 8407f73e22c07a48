"""Public GDN ops with FLA 0.6.0's signatures."""

from __future__ import annotations

from typing import Any

import torch

from cula import _validate as V
from cula._op import pop_known, public_op, reject_head_first, state_v_first_alias

GDN_CHUNK_SIZES = (16, 32, 64)


def _check_gate_in_kernel(a: dict[str, Any], dims: V.Dims, device: torch.device) -> None:
    if not a["use_gate_in_kernel"]:
        return
    if a["g"] is None:
        raise ValueError("g: expected the raw gate input [B, T, HV] with use_gate_in_kernel=True, got None")
    if a["A_log"] is None:
        raise ValueError(f"A_log: expected a [HV] = [{dims.HV}] tensor with use_gate_in_kernel=True, got None")
    V.check_param("A_log", a["A_log"], dims.HV, f"[HV] = [{dims.HV}], one per value head", device)
    if a["dt_bias"] is not None:
        V.check_param("dt_bias", a["dt_bias"], dims.HV, f"[HV] = [{dims.HV}], one per value head", device)


def _prepare_chunk(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    reject_head_first(extra)
    a["state_v_first"] = state_v_first_alias(extra, a["state_v_first"])
    a.update(pop_known(extra, "chunk_gated_delta_rule", {
        "use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64,
    }))
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"])
    device = q.device
    V.check_scale(a["scale"])
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device, a["cu_seqlens_cpu"])
    B, T, HV = dims.B, dims.T, dims.HV
    V.check_gate("g", a["g"], (B, T, HV), "[B, T, HV]", device)
    V.check_gate("beta", a["beta"], (B, T, HV), "[B, T, HV]", device)
    V.check_state("initial_state", a["initial_state"], dims, device, state_v_first=a["state_v_first"])
    V.check_flag_pair_neg_eigval(a["allow_neg_eigval"], a["use_beta_sigmoid_in_kernel"])
    _check_gate_in_kernel(a, dims, device)
    V.check_chunk_size(a["chunk_size"], GDN_CHUNK_SIZES)
    if a["cp_context"] is not None and (a["initial_state"] is not None or a["output_final_state"]):
        raise ValueError("cp_context: expected initial_state=None and output_final_state=False with it (as FLA), got a state")
    return a


def _prepare_recurrent(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    a["state_v_first"] = state_v_first_alias(extra, a["state_v_first"])
    pop_known(extra, "fused_recurrent_gated_delta_rule", {})
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"])
    device = q.device
    V.check_scale(a["scale"])
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device)
    B, T, HV, K, Vd = dims.B, dims.T, dims.HV, dims.K, dims.V
    if a["g"] is not None:
        V.check_gate("g", a["g"], (B, T, HV), "[B, T, HV]", device)
    if a["gk"] is not None:
        V.check_gate("gk", a["gk"], (B, T, HV, K), "[B, T, HV, K]", device)
    if a["gv"] is not None:
        V.check_gate("gv", a["gv"], (B, T, HV, Vd), "[B, T, HV, V]", device)
    beta = a["beta"]
    if isinstance(beta, torch.Tensor) and beta.dim() == 4:  # one beta per value channel
        V.check_gate("beta", beta, (B, T, HV, Vd), "[B, T, HV, V]", device)
    elif beta is not None:
        V.check_gate("beta", beta, (B, T, HV), "[B, T, HV]", device)
    V.check_state("initial_state", a["initial_state"], dims, device, state_v_first=a["state_v_first"],
                  dtypes=V.STATE_DTYPES_POOL)
    V.check_flag_pair_neg_eigval(a["allow_neg_eigval"], a["use_beta_sigmoid_in_kernel"])
    _check_gate_in_kernel(a, dims, device)
    return a


@public_op("chunk_gated_delta_rule", _prepare_chunk,
           plan_kwargs=frozenset({"use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"}))
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
):
    r"""Chunked gated delta rule, a drop-in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (0.6.0).

    Per value head: ``S'_t = exp(g_t) S_{t-1}``, ``S_t = S'_t + beta_t k_t (v_t - k_t^T S'_t)^T``,
    ``o_t = scale q_t^T S_t``.

    Args:
        q: queries ``[B, T, H, K]``, fp16/bf16/fp32 (fp64: torch reference only).
        k: keys ``[B, T, H, K]``; v: values ``[B, T, HV, V]``, ``HV`` a multiple of ``H``; dtype of ``q``.
        g: log-space decay ``[B, T, HV]``, or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` (post-sigmoid; logits with ``use_beta_sigmoid_in_kernel``).
        scale: factor on ``q``; defaults to ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), one per sequence.
        output_final_state: also return the fp32 final state, shaped like ``initial_state``.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) first.
        use_beta_sigmoid_in_kernel: apply ``sigmoid`` to ``beta`` in the op.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, use ``2 * sigmoid(beta)``.
        state_v_first: states in the V-first layout ``[N, HV, V, K]``.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (checks and planning without a sync).
        chunk_indices: FLA's precomputed varlen chunk indices (FLA path only; ignored elsewhere).
        cp_context: FLA's context-parallel context (FLA path only; no states with it).
        **kwargs: ``use_gate_in_kernel`` (``g <- -exp(A_log) * softplus(g + dt_bias)``) with ``A_log``
            ``[HV]`` and the optional ``dt_bias`` ``[HV]``; ``chunk_size`` (16, 32 or 64); the deprecated
            ``transpose_state_layout``. Unknown names are ignored with a warning.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``; ``final_state`` or ``None``.

    Backends, in order: FLA's Triton op on CUDA, then the chunked torch reference (CPU, fp64). cula has
    no GDN kernel yet; gradients flow through both backends.
    """


@public_op("fused_recurrent_gated_delta_rule", _prepare_recurrent)
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Token-by-token gated delta rule, a drop-in for FLA 0.6.0's ``fused_recurrent_gated_delta_rule``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``), one float dtype.
        g: scalar log-decay per head ``[B, T, HV]`` (raw input with ``use_gate_in_kernel``), or None.
        gk: key-channel log-decay ``[B, T, HV, K]``, or None.
        gv: value-channel log-decay ``[B, T, HV, V]``, or None.
        beta: ``[B, T, HV]`` or per value channel ``[B, T, HV, V]``; None means ones.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: return the fp32 final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        use_gate_in_kernel: ``g <- -exp(A_log) * softplus(g + dt_bias)`` (needs ``g`` and ``A_log``).
        A_log: ``[HV]``; dt_bias: ``[HV]`` (``use_gate_in_kernel`` only).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: ``sigmoid(beta)`` / ``2 * sigmoid(beta)``.
        state_v_first: states in the V-first layout.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        **kwargs: the deprecated ``transpose_state_layout``; unknown names are ignored with a warning.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``; ``final_state`` or ``None``.

    Backends: FLA's Triton op on CUDA (it has no backward: calls that need gradients run the torch
    path), then the torch reference (``gk`` / ``gv`` / per-channel beta via a token-by-token recurrence).
    """

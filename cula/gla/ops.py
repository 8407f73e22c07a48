"""Public GLA ops with FLA 0.6.0's signatures."""

from __future__ import annotations

from typing import Any

import torch

from cula import _validate as V
from cula._op import pop_known, public_op, state_v_first_alias


def _prepare_chunk(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"], gva=False)
    device = q.device
    V.check_scale(a["scale"])
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device, a["cu_seqlens_cpu"])
    V.check_gate("g", a["g"], (dims.B, dims.T, dims.H, dims.K), "[B, T, H, K]", device)
    V.check_state("initial_state", a["initial_state"], dims, device, state_v_first=a["state_v_first"])
    return a


def _prepare_recurrent(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    a["state_v_first"] = state_v_first_alias(extra, a["state_v_first"])
    pop_known(extra, "fused_recurrent_gla", {})
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"], gva=False)
    device = q.device
    V.check_scale(a["scale"])
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device)
    if a["gk"] is not None:
        V.check_gate("gk", a["gk"], (dims.B, dims.T, dims.H, dims.K), "[B, T, H, K]", device)
    if a["gv"] is not None:
        V.check_gate("gv", a["gv"], (dims.B, dims.T, dims.H, dims.V), "[B, T, H, V]", device)
    V.check_state("initial_state", a["initial_state"], dims, device, state_v_first=a["state_v_first"],
                  dtypes=V.STATE_DTYPES_POOL)
    return a


@public_op("chunk_gla", _prepare_chunk)
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: int | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Chunked GLA, a drop-in for ``fla.ops.gla.chunk_gla`` (0.6.0).

    Per head: ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t^T S_t``.

    Args:
        q: queries ``[B, T, H, K]``, fp16/bf16/fp32 (fp64: torch reference only).
        k: keys ``[B, T, H, K]``; v: values ``[B, T, H, V]`` (no grouped value heads); dtype of ``q``.
        g: log-space forget gate ``[B, T, H, K]``.
        scale: factor on ``q``; defaults to ``K ** -0.5``.
        initial_state: fp32 ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), one per sequence.
        output_final_state: also return the fp32 final state, shaped like ``initial_state``.
        state_v_first: states in the V-first layout.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (checks and planning without a sync).

    Returns:
        ``(o, final_state)``: ``o: [B, T, H, V]`` in the dtype of ``q``; ``final_state`` or ``None``.

    Backends: FLA's Triton op on CUDA, then the chunked torch reference (CPU, fp64). cula has no GLA
    kernel yet; gradients flow through both.
    """


@public_op("fused_recurrent_gla", _prepare_recurrent)
def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: int | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Token-by-token GLA, a drop-in for ``fla.ops.gla.fused_recurrent_gla`` (0.6.0).

    Per head: ``S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t^T v_t``, ``o_t = scale q_t^T S_t``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; one float dtype.
        gk: key-channel log-decay ``[B, T, H, K]``, or None (no decay).
        gv: value-channel log-decay ``[B, T, H, V]``, or None.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``).
        output_final_state: return the fp32 final state.
        reverse: run each sequence from its last token to its first.
        state_v_first: states in the V-first layout.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        **kwargs: the deprecated ``transpose_state_layout``; unknown names are ignored with a warning.

    Returns:
        ``(o, final_state)``: ``o: [B, T, H, V]`` in the dtype of ``q``; ``final_state`` or ``None``.

    Backends: FLA's Triton op on CUDA (differentiable), then the torch reference (``gv`` / ``reverse``
    via a token-by-token recurrence).
    """

"""Public Lightning Attention ops (the signatures of docs/INTERFACES.md)."""

from __future__ import annotations

from typing import Any

import torch

from cula import _validate as V
from cula._op import public_op


def _prepare_common(a: dict[str, Any]) -> tuple[V.Dims, torch.device]:
    dims = V.check_qkv(a["q"], a["k"], a["v"])
    device = a["q"].device
    V.check_scale(a["scale"])
    a["decay"] = V.check_decay(a["decay"], dims.HV, device)
    return dims, device


def _prepare_fwd(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    dims, device = _prepare_common(a)
    if a["cp_context"] is not None:
        # token inputs are this rank's piece while initial_state / cu_seqlens are global: cula.cp checks
        # them against the context
        return a
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device)
    V.check_state("initial_state", a["initial_state"], dims, device)
    return a


def _prepare_decode(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    dims, device = _prepare_common(a)
    V.check_pool_arguments(a, dims, device)
    return a


@public_op("lightning_attn_fwd", _prepare_fwd)
def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cp_context: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Lightning Attention forward: ``S_t = exp(-decay_h) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

    The same math as FLA's ``chunk_simple_gla(q, k, v, g_gamma=-decay, ...)``, with grouped value heads.

    Args:
        q: queries ``[B, T, H, K]``, fp16/bf16/fp32 (fp64 runs on the torch reference only).
        k: keys ``[B, T, H, K]``, dtype of ``q``.
        v: values ``[B, T, HV, V]``, dtype of ``q``; ``HV`` a multiple of ``H`` (GVA: q/k head ``h`` serves
            value heads ``h*HV/H .. (h+1)*HV/H - 1``).
        decay: per-value-head decay rates ``[HV]`` (any shape with ``HV`` elements), float, ``>= 0``; the
            state is multiplied by ``exp(-decay)`` each step. Its sign is checked once per tensor version.
        scale: factor on ``q``; defaults to ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]``, one state per sequence (``N = B``, or the number of
            sequences with ``cu_seqlens``). Default: zeros.
        output_final_state: also return the fp32 final state ``[N, HV, K, V]``.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative sequence lengths of packed inputs (``B == 1``),
            starting at 0 and ending at ``T``, as in FlashAttention.
        cp_context: context parallelism: a context from ``cula.cp.build_cp_context`` (or FLA's
            ``FLACPContext``); the token inputs are then this rank's piece and the call is a collective
            over the context's group (:mod:`cula.cp`). ``None``: one rank.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``; ``final_state: [N, HV, K, V]``
        fp32 if ``output_final_state`` else ``None``.

    Backends, in order: cula's SM90 kernel (Hopper, supported inputs, no gradients requested), FLA's
    Triton ``chunk_simple_gla`` on CUDA (q/k expanded per value head), the torch reference. Gradients:
    until cula has a backward kernel, a call that needs them runs FLA on CUDA (or the reference when
    ``decay`` itself requires grad, since FLA gives none for it) and the differentiable reference on CPU.
    """


@public_op("lightning_attn_decode", _prepare_decode)
def lightning_attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Lightning Attention decode: a few new tokens (``T <= 8`` is what the kernel targets) per sequence.

    Same recurrence as :func:`lightning_attn_fwd`, for fixed-length batches, with a state pool.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``), one float dtype.
        decay: ``[HV]`` rates ``>= 0`` (factor ``exp(-decay)`` per step).
        scale: defaults to ``K ** -0.5``.
        initial_state: without ``state_indices``, the states ``[B, HV, K, V]``; with ``state_indices``, a
            state pool ``[P, HV, K, V]`` (fp32, or fp16/bf16: computed in fp32, stored back in its dtype).
        output_final_state: return the new states ``[B, HV, K, V]`` (fp32).
        state_indices: int32/int64 ``[B]``: row ``b`` reads slot ``state_indices[b]`` of the pool. A
            negative index skips the row: its output is zeros (and its returned state), its slot untouched.
        inplace: write the new states back into ``initial_state`` (the pool slots, or the ``[B, ...]``
            states) and return ``initial_state`` itself as ``final_state``.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``; ``final_state`` is the pool with
        ``inplace``, else the new states if ``output_final_state``, else ``None``.

    Backends: cula's SM90 decode kernel, then FLA's ``fused_recurrent_simple_gla`` with the pool
    gather/scatter in torch, then the torch reference (the last two check the index values: a sync).
    """

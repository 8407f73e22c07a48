"""Context-parallel Lightning Attention forward: ``S_t = exp(-decay) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

Per rank, three steps:

1. local pass: one call of the local forward over this rank's segments, the first one (if it continues a
   sequence from an earlier rank) started from zero, the others from their true initial states;
2. scan: the summary of the last segment, ``(M, b) = (exp(-decay * L_last), its end state)``, goes through
   :func:`cula.cp.scan.exclusive_scan`, which returns the carried-in state ``S0`` of the first;
3. correction, closed form because ``M`` is a scalar per head: token ``t`` (0-based) of the first segment
   gets ``scale * exp(-decay * (t + 1)) * q_t S0`` added, and its end state ``exp(-decay * L_first) S0``.

Extra cost over the plain local forward: the scan and one ``[L_first, K] x [K, V]`` product per head, run on
the tensor cores into ``o`` in place for half-precision outputs. (Running the forward once more from the
true state, or once after a closed-form ``b``, puts a pass over the piece on the critical path before the
forward; measured on the H200 the ``b`` product alone, ``[K, L] x [L, V]`` per head, costs half a forward,
its output being only ``HV`` tiles; the correction's output is ``L x V`` per head.)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cula.cp import _local
from cula.cp.context import CPContext, check_global_cu_seqlens, emulated_contexts
from cula.cp.gather import assemble_final_state, concat_tokens, split_tokens
from cula.cp.scan import emulated_initial_states, exclusive_scan, inputs_require_grad, scan_dtype


def _local_pass(q, k, v, decay, scale, initial_state, output_final_state, ctx: CPContext, local_fn):
    """Step 1: local outputs (first segment from zero if it carries in) and the rank's summary ``(M, b)``."""
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    # Every rank asks for states when CP is on, so that all ranks scan in the local forward's state dtype.
    need_final = output_final_state or ctx.world_size > 1
    o, final = local_fn(
        q, k, v, decay,
        scale=scale,
        initial_state=_local.local_initial_states(initial_state, ctx),
        output_final_state=need_final,
        cu_seqlens=ctx.cu_seqlens,
    )
    sdt = scan_dtype(final.dtype if final is not None else torch.float32)  # same on every rank
    if ctx.carries_out:
        last_len = int(ctx.cu_seqlens_cpu[-1] - ctx.cu_seqlens_cpu[-2])
        m = torch.exp(-decay.to(sdt) * last_len)
        b = final[-1].to(sdt)
    else:
        m = torch.zeros(HV, device=v.device, dtype=sdt)
        b = torch.zeros(HV, K, V, device=v.device, dtype=sdt)
    return o, final, m, b


def _finish(o, final, q, decay, scale, h0, anchor, ctx: CPContext, output_final_state):
    """Step 3: add the carried-in state's contribution to the first segment."""
    if h0 is not None:
        first_len = int(ctx.cu_seqlens_cpu[1])
        HV = h0.shape[0]
        group = HV // q.shape[2]
        steps = torch.arange(1, first_len + 1, device=h0.device, dtype=h0.dtype)
        weight = scale * torch.exp(-decay.to(h0.dtype)[None, :] * steps[:, None])  # [L_first, HV]
        q_first = q[0, :first_len] if group == 1 else q[0, :first_len].repeat_interleave(group, dim=1)
        o = _local.add_state_product(o, q_first, h0, weight)
        if output_final_state:
            end = final[0].to(h0.dtype) + torch.exp(-decay.to(h0.dtype) * first_len)[:, None, None] * h0
            final = torch.cat([end[None].to(final.dtype), final[1:]])
    if anchor is not None:
        o = o + anchor.to(o.dtype)
    return o, (final if output_final_state else None)


def _scale(scale: float | None, q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cp_context: Any,
    local_fn: _local.LocalFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention forward over a sequence split across the ranks of ``cp_context.group``.

    Call it on every rank of the group (it is a collective). Arguments as
    :func:`cula.lightning.lightning_attn_fwd`, except that token-wise inputs are this rank's piece.

    Args:
        q, k: ``[1, T_local, H, K]``; v: ``[1, T_local, HV, V]`` (``cula.cp.split_tokens`` of the packed stream).
        decay: ``[HV]`` fp32 >= 0, the same on every rank.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``None`` or the global ``[N, HV, K, V]`` fp32 states (the same on every rank).
        output_final_state: also return the local final states.
        cu_seqlens: ``None`` or the context's (local or global) boundaries; the context's local ones are used.
        cp_context: from :func:`cula.cp.build_cp_context` (an FLA ``FLACPContext`` is accepted too).
        local_fn: the single-device forward to run locally (default: the public op).
    Returns:
        ``o: [1, T_local, HV, V]`` and, with ``output_final_state``, ``[N_local, HV, K, V]``: the true state at
        the end of each local segment (``cula.cp.gather_final_state`` assembles the global ``[N, ...]``).
    """
    ctx = _local.as_context(cp_context)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _local.check_local_tokens(name, x, ctx)
    _local.check_cu_seqlens_arg(cu_seqlens, ctx)
    _local.check_global_initial_state(initial_state, ctx)
    if not isinstance(decay, torch.Tensor) or decay.numel() != v.shape[2]:
        raise ValueError(f"decay: expected a tensor [HV={v.shape[2]}], got "
                         f"{list(decay.shape) if isinstance(decay, torch.Tensor) else type(decay).__name__}")
    local_fn = local_fn or _local.default_local_fn("lightning")
    scale = _scale(scale, q)
    decay = decay.reshape(-1)

    o, final, m, b = _local_pass(q, k, v, decay, scale, initial_state, output_final_state, ctx, local_fn)
    h0, anchor = exclusive_scan(m, b, ctx, requires_grad=inputs_require_grad(q, k, v, decay, initial_state))
    return _finish(o, final, q, decay, scale, h0, anchor, ctx, output_final_state)


def emulate_lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    world_size: int,
    offsets: Sequence[int] | None = None,
    local_fn: _local.LocalFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Single-process emulation of :func:`lightning_attn_fwd` on ``world_size`` ranks (no torch.distributed).

    Takes and returns the global tensors of :func:`cula.lightning.lightning_attn_fwd` (``[B, T, ...]`` or
    packed with ``cu_seqlens``); the stream is split as :func:`cula.cp.build_cp_context` splits it, every
    rank's local pass runs in turn, the scan runs in-process, and the pieces are put back together.
    """
    local_fn = local_fn or _local.default_local_fn("lightning")
    batch, length = q.shape[0], q.shape[1]
    packed = cu_seqlens is None
    if packed:
        q, k, v = (_local.pack_batch(x) for x in (q, k, v))
        cu_seqlens = _local.uniform_cu_seqlens(batch, length, q.device)
    contexts = emulated_contexts(cu_seqlens, world_size, offsets)
    check_global_cu_seqlens(cu_seqlens)
    scale = _scale(scale, q)
    decay = decay.reshape(-1)

    pieces = [(split_tokens(q, c), split_tokens(k, c), split_tokens(v, c)) for c in contexts]
    passes = [
        _local_pass(ql, kl, vl, decay, scale, initial_state, output_final_state, c, local_fn)
        for (ql, kl, vl), c in zip(pieces, contexts)
    ]
    h0s = emulated_initial_states([(m, b) for _, _, m, b in passes], contexts)
    results = [
        _finish(o, final, ql, decay, scale, h0, None, c, output_final_state)
        for (o, final, _, _), (ql, _, _), h0, c in zip(passes, pieces, h0s, contexts)
    ]
    o = concat_tokens([r[0] for r in results])
    if packed:
        o = o.reshape(batch, length, *o.shape[2:])
    final = assemble_final_state([r[1] for r in results], contexts, initial_state) if output_final_state else None
    return o, final

"""Context-parallel Lightning Attention forward: ``S_t = exp(-decay) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.

Per rank, three steps:

1. summary: the last local segment's ``(M, b)``, ``M = exp(-decay * L_last)`` and ``b`` its end state from
   zero (plus ``M`` times its own initial state when it starts on this rank), in closed form because the
   decay is a scalar per head: ``b = sum_t exp(-decay * (L - 1 - t)) k_t^T v_t``, one ``[K, L] x [L, V]``
   product per head;
2. scan: :func:`cula.cp.scan.exclusive_scan` turns the summaries into this rank's carried-in state ``S0``;
3. one call of the local forward over this rank's segments with their true initial states (``S0`` for the
   first): its outputs and final states are the single-device ones, with no correction pass.

Extra cost over the plain local forward: the product of step 1 and the scan.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cula.cp import _local
from cula.cp.context import CPContext, check_global_cu_seqlens, emulated_contexts
from cula.cp.gather import assemble_final_state, concat_tokens, split_tokens
from cula.cp.scan import emulated_initial_states, exclusive_scan, inputs_require_grad, scan_dtype


def _summary(k, v, decay, initial_state, ctx: CPContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: ``(M [HV], b [HV, K, V])`` of the last local segment (zeros when it does not carry out)."""
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    sdt = scan_dtype(torch.promote_types(v.dtype, initial_state.dtype if initial_state is not None else v.dtype))
    if not ctx.carries_out:
        return torch.zeros(HV, device=v.device, dtype=sdt), torch.zeros(HV, K, V, device=v.device, dtype=sdt)
    cu = ctx.cu_seqlens_cpu
    start, end = int(cu[-2]), int(cu[-1])
    length = end - start
    dec = decay.to(sdt)
    group = HV // k.shape[2]
    # weight of token t in the end state: exp(-decay * (L - 1 - t)), [L, HV]
    age = torch.arange(length - 1, -1, -1, device=v.device, dtype=sdt)
    weight = torch.exp(-dec[None, :] * age[:, None])
    k_seg = k[0, start:end] if group == 1 else k[0, start:end].repeat_interleave(group, dim=1)
    # Half inputs: the weights are rounded to k's dtype and applied in one pass (as the kernel rounds its
    # decayed k); fp32/fp64 inputs stay exact.
    k_w = k_seg * weight.to(k.dtype)[..., None]
    b = _bmm_wide(k_w.permute(1, 2, 0), v[0, start:end].transpose(0, 1), sdt)  # [HV, K, V]
    m = torch.exp(-dec * length)
    starts_here = not (ctx.carries_in and ctx.num_seqs == 1)
    if starts_here and initial_state is not None:
        b = b + m[:, None, None] * initial_state[ctx.seq_ids[-1]].to(sdt)
    return m, b


def _bmm_wide(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` batched, accumulated and returned in ``out_dtype`` (half inputs stay half on the tensor cores
    when autograd is off; the kernels round the same way)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and not inputs_require_grad(a, b):
        try:
            return torch.bmm(a, b, out_dtype=out_dtype)
        except (TypeError, RuntimeError):  # a torch without bmm(out_dtype=)
            pass
    return torch.bmm(a.to(out_dtype), b.to(out_dtype))


def _local_run(q, k, v, decay, scale, initial_state, h0, ctx: CPContext, output_final_state, local_fn):
    """Step 3: one local call with every segment's true initial state (``h0`` for a carried-in first one)."""
    rows = _local.local_initial_states(initial_state, ctx)
    if h0 is not None:
        dt = h0.dtype if rows is None else torch.promote_types(rows.dtype, h0.dtype)
        if rows is None:
            rows = torch.zeros(ctx.num_seqs, *h0.shape, device=h0.device, dtype=dt)
        rows = torch.cat([h0[None].to(dt), rows[1:].to(dt)])
    return local_fn(q, k, v, decay, scale=scale, initial_state=rows, output_final_state=output_final_state,
                    cu_seqlens=ctx.cu_seqlens)


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

    m, b = _summary(k, v, decay, initial_state, ctx)
    h0, anchor = exclusive_scan(m, b, ctx, requires_grad=inputs_require_grad(q, k, v, decay, initial_state))
    o, final = _local_run(q, k, v, decay, scale, initial_state, h0, ctx, output_final_state, local_fn)
    if anchor is not None:
        o = o + anchor.to(o.dtype)
    return o, (final if output_final_state else None)


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
    summaries = [_summary(kl, vl, decay, initial_state, c) for (_, kl, vl), c in zip(pieces, contexts)]
    h0s = emulated_initial_states(summaries, contexts)
    results = [
        _local_run(ql, kl, vl, decay, scale, initial_state, h0, c, output_final_state, local_fn)
        for (ql, kl, vl), h0, c in zip(pieces, h0s, contexts)
    ]
    o = concat_tokens([r[0] for r in results])
    if packed:
        o = o.reshape(batch, length, *o.shape[2:])
    final = assemble_final_state([r[1] for r in results], contexts, initial_state) if output_final_state else None
    return o, final

"""A token-by-token torch recurrence for the FLA options the references in :mod:`cula.ref` do not take.

FLA's fused recurrent ops accept a few inputs beyond the math of their chunked siblings: a value-dim
decay ``gv`` (GLA, GDN), a key-dim decay ``gk`` on top of GDN's scalar ``g``, a per-channel beta
``[B, T, HV, V]`` (KDA, GDN) and ``reverse=True`` (GLA). On CUDA FLA runs them; this is the torch path
for them (the CPU path, and the fallback when gradients are needed), so that every valid input has a
correct backend. Per value head, with all gates already activated (natural-log decays)::

    S'_t = exp(g_t) * diag(exp(gk_t)) S_{t-1} diag(exp(gv_t))
    U_t  = beta_t * (v_t - k_t^T S'_t)        (delta rule)    or    U_t = v_t    (plain)
    S_t  = S'_t + k_t U_t^T,    o_t = scale q_t^T S_t

``reverse`` runs every sequence from its last token to its first (the state still flows from
``initial_state`` to the final state). Slow by design (one step per token); differentiable.
"""

from __future__ import annotations

import torch


def recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    delta: bool,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the recurrence above.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``).
        g: ``[B, T, HV]`` scalar log-decay per head, or None.
        gk: ``[B, T, HV, K]`` key-dim log-decay, or None.
        gv: ``[B, T, HV, V]`` value-dim log-decay, or None.
        beta: ``[B, T, HV]`` or ``[B, T, HV, V]`` (delta rule only; None = ones).
        delta: delta rule (KDA/GDN) or plain linear attention (GLA).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), or None.
        cu_seqlens: ``[N+1]`` for packed inputs (``B == 1``).
        dtype: compute precision.
    Returns:
        ``o: [B, T, HV, V]`` and the final state (layout of ``initial_state``) or None, in ``dtype``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q, k = (x.to(dtype).repeat_interleave(rep, dim=2) if rep > 1 else x.to(dtype) for x in (q, k))
    v = v.to(dtype)
    g, gk, gv, beta = (x.to(dtype) if x is not None else None for x in (g, gk, gv, beta))
    if beta is not None and beta.dim() == 3:
        beta = beta[..., None]  # [B, T, HV, 1]: one beta per head

    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        segments = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]

    outs, finals = [], []
    for n, (b, start, end) in enumerate(segments):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
            S = S.transpose(-1, -2) if state_v_first else S
        else:
            S = q.new_zeros(HV, K, V)
        steps = range(end - 1, start - 1, -1) if reverse else range(start, end)
        seg_out = {}
        for t in steps:
            if g is not None:
                S = S * g[b, t].exp()[:, None, None]
            if gk is not None:
                S = S * gk[b, t].exp()[:, :, None]
            if gv is not None:
                S = S * gv[b, t].exp()[:, None, :]
            if delta:
                U = v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S)
                U = U * beta[b, t] if beta is not None else U
            else:
                U = v[b, t]
            S = S + k[b, t][:, :, None] * U[:, None, :]
            seg_out[t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        ordered = [seg_out[t] for t in range(start, end)]
        outs.append(torch.stack(ordered) if ordered else v.new_zeros(0, HV, V))
        finals.append(S.transpose(-1, -2) if state_v_first else S)

    if cu_seqlens is None:
        o = torch.stack(outs)
    else:
        o = torch.cat(outs).unsqueeze(0)
    final = torch.stack(finals) if output_final_state else None
    return o, final

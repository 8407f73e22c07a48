"""The one recurrence behind every reference, in two exact forms.

All four variants are instances of a gated (delta-rule) linear recurrence on a state ``S: [K, V]`` per
value head. With a log-decay ``g_t`` (per key dim ``[K]`` or one scalar per head, broadcast over K)::

    S'_t = diag(exp(g_t)) S_{t-1}
    U_t  = beta_t (v_t - k_t^T S'_t)      (delta rule: KDA, GDN)
    U_t  = v_t                            (plain:      GLA, Lightning)
    S_t  = S'_t + k_t U_t^T
    o_t  = scale q_t^T S_t

``recurrent_core`` runs it token by token (the ground truth). ``chunked_core`` is the form the kernels
use: per chunk of C tokens, with ``G_t`` the within-chunk cumulative log-decay and ``Gamma = exp(G)``,

    A_qk[t, s] = q_t^T diag(Gamma_t / Gamma_s) k_s            (s <= t)
    A_kk[t, s] = beta_t k_t^T diag(Gamma_t / Gamma_s) k_s     (s <  t)
    T = (I + A_kk)^-1                                         (UT transform, unit lower triangular)
    u = T diag(beta) V,  w = T diag(beta) (K * Gamma)         (WY representation)
    U = u - w S_0                                             (plain: U = V)
    O = scale (Q * Gamma) S_0 + scale A_qk U
    S_C = diag(Gamma_C) S_0 + (K * Gamma_C / Gamma)^T U

Numerics: ``Gamma_t / Gamma_s`` is formed as ``exp(G_t - G_s)`` on the causal entries only (the others
are masked to ``-inf`` *before* ``exp``), so nothing overflows however strong the decay and no
``exp(+large) * exp(-large)`` product is ever formed. For per-key-dim gates this materialises a
``[C, C, K]`` tensor per chunk; chunks are processed in groups under a memory budget.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cula.ref._checks import check_state, seqlens_from_cu
from cula.ref._varlen import length_groups, pad_segments, unpad_segments

# Elements of one [chunks, C, C, K] pairwise-decay temporary (x B x HV) per group: 2**26 fp32 = 256 MiB.
PAIRWISE_BUDGET = 1 << 26


def recurrent_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence.

    Args:
        q, k: ``[B, T, HV, K]`` (already expanded to value heads).
        v: ``[B, T, HV, V]``.
        g: log-decay ``[B, T, HV, K]`` or ``[B, T, HV, 1]`` (scalar per head).
        beta: ``[B, T, HV]`` for the delta rule, ``None`` for plain linear attention.
        h0: ``[B, HV, K, V]`` or ``None`` (zeros).
    Returns:
        ``o: [B, T, HV, V]`` and the final state ``[B, HV, K, V]``.
    """
    B, T, HV, K = q.shape
    V = v.shape[-1]
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, V)
    decay = g.exp()
    outs = []
    for t in range(T):
        S = S * decay[:, t, :, :, None]
        if beta is None:
            U = v[:, t]
        else:
            U = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * U[:, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o, S


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, T, HV, ...]`` (T a multiple of C) -> ``[B, HV, NT, C, ...]``."""
    B, T, HV = x.shape[:3]
    x = x.reshape(B, T // C, C, HV, *x.shape[3:])
    return x.movedim(3, 1)


def _pairwise_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, want_kk: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Intra-chunk ``A_qk`` (s <= t) and, if asked, ``A_kk`` (s < t, unscaled by beta).

    ``q, k: [B, HV, NT, C, K]``, ``G: [B, HV, NT, C, Dg]`` (Dg = 1 or K). Returns ``[B, HV, NT, C, C]``.
    """
    B, HV, NT, C, K = k.shape
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = incl.tril(-1)
    neg_inf = torch.tensor(float("-inf"), dtype=G.dtype, device=G.device)
    if G.shape[-1] == 1:
        g = G[..., 0]
        decay = torch.where(incl, g[..., :, None] - g[..., None, :], neg_inf).exp()
        A_qk = (q @ k.transpose(-1, -2)) * decay
        A_kk = (k @ k.transpose(-1, -2)) * decay * strict if want_kk else None
        return A_qk, A_kk
    # Per-key-dim decay: exp(G_t - G_s) differs per d, so it cannot be factored out of the dot product
    # exactly; form it pairwise, a group of chunks at a time.
    per_chunk = max(1, B * HV * C * C * K)
    group = max(1, PAIRWISE_BUDGET // per_chunk)
    qk_parts, kk_parts = [], []
    for lo in range(0, NT, group):
        hi = min(NT, lo + group)
        Gg = G[:, :, lo:hi]
        diff = Gg[..., :, None, :] - Gg[..., None, :, :]  # [B, HV, n, C(t), C(s), K]
        decay = torch.where(incl[:, :, None], diff, neg_inf).exp()
        k_dec = decay * k[:, :, lo:hi, None, :, :]  # k_s * exp(G_t - G_s)
        qk_parts.append(torch.einsum("...td,...tsd->...ts", q[:, :, lo:hi], k_dec))
        if want_kk:
            kk_parts.append(torch.einsum("...td,...tsd->...ts", k[:, :, lo:hi], k_dec) * strict)
    A_qk = torch.cat(qk_parts, dim=2)
    A_kk = torch.cat(kk_parts, dim=2) if want_kk else None
    return A_qk, A_kk


def chunked_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float,
    h0: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of :func:`recurrent_core` (same arguments and results), any ``chunk_size``."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, V)
    if T == 0:
        return v.new_zeros(B, 0, HV, V), S
    C = chunk_size
    NT = math.ceil(T / C)
    pad = NT * C - T
    if pad:
        # Zero padding is exact: k = 0 adds nothing to the state, g = 0 leaves it undecayed.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad)) if beta is not None else None
    qc, kc, vc, gc = (_to_chunks(x, C) for x in (q, k, v, g))  # [B, HV, NT, C, *]
    G = gc.cumsum(dim=-2)
    G_last = G[..., -1:, :]  # [B, HV, NT, 1, Dg]

    A_qk, A_kk = _pairwise_scores(qc, kc, G, want_kk=beta is not None)
    A_qk = A_qk * scale
    if beta is not None:
        bc = _to_chunks(beta, C)  # [B, HV, NT, C]
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        # T = (I + diag(beta) strict_lower(K diag K^T))^-1, unit lower triangular.
        T_inv = torch.linalg.solve_triangular(
            eye + bc[..., :, None] * A_kk, eye.expand(B, HV, NT, C, C), upper=False, unitriangular=True
        )
        u = T_inv @ (bc[..., None] * vc)
        w = T_inv @ (bc[..., None] * kc * G.exp())
    q_dec = qc * G.exp() * scale  # q_t Gamma_t
    k_dec = kc * (G_last - G).exp()  # k_s Gamma_C / Gamma_s
    state_decay = G_last.exp().transpose(-1, -2)  # [B, HV, NT, Dg, 1]

    outs = []
    for n in range(NT):
        U = u[:, :, n] - w[:, :, n] @ S if beta is not None else vc[:, :, n]
        outs.append(q_dec[:, :, n] @ S + A_qk[:, :, n] @ U)
        S = state_decay[:, :, n] * S + k_dec[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [B, HV, NT, C, V]
    o = o.movedim(1, 3).reshape(B, NT * C, HV, V)[:, :T]
    return o, S


def run(
    form: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    state_v_first: bool,
    chunk_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared driver: precision, GVA head expansion, state layout and varlen around a core.

    ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``, ``g: [B, T, HV, Dg]`` log-decay (already activated),
    ``beta: [B, T, HV]`` or ``None``. ``form`` is ``"recurrent"`` or ``"chunked"``.
    Returns ``o: [B, T, HV, V]`` and the final state ``[N, HV, K, V]`` (``[N, HV, V, K]`` if
    ``state_v_first``) or ``None``, all in ``dtype``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    lengths = seqlens_from_cu(cu_seqlens, B, T)
    N = B if lengths is None else len(lengths)
    check_state(initial_state, N, HV, K, V, state_v_first)

    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    beta = beta.to(dtype) if beta is not None else None
    if HV != H:
        # GVA: q/k head h serves value heads h*G .. h*G+G-1.
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(dtype)
        if state_v_first:
            h0 = h0.transpose(-1, -2)

    def core(q, k, v, g, beta, h0):
        if form == "recurrent":
            return recurrent_core(q, k, v, g, beta, scale, h0)
        return chunked_core(q, k, v, g, beta, scale, h0, chunk_size)

    if lengths is None:
        o, S = core(q, k, v, g, beta, h0)
    else:
        pieces: list[torch.Tensor | None] = [None] * N
        states: list[torch.Tensor | None] = [None] * N
        for members in length_groups(lengths):
            lens = [lengths[i] for i in members]
            width = max(lens)
            padded = [pad_segments(x, lengths, width, members) for x in (q, k, v, g)]
            beta_p = pad_segments(beta, lengths, width, members) if beta is not None else None
            o_p, S_g = core(*padded, beta_p, h0[members] if h0 is not None else None)
            for i, piece, state in zip(members, unpad_segments(o_p, lens).split(lens, dim=1), S_g):
                pieces[i], states[i] = piece, state
        o = torch.cat(pieces, dim=1)
        S = torch.stack(states)
    if not output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S)

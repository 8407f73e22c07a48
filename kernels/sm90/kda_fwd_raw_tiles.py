"""The "raw tiles" transform designed for stage 2, as a torch model. No kernel: its premise, measured on an H100 in
session 36, said it could buy ~1% of both stages (kda_fwd.md, "Where the time goes"); kept as the reference should
the balance change.

Today stage 1 writes qg, kgᵀ and −X (768 of its 1,676 B a token-head) and stage 2 reads them back. In this
design stage 2 reads q, k and g instead (the same bytes) and a second warpgroup forms the three operand tiles in
shared memory, without exp2 of the cumulative gate: down a key column, 2^Γ_i is the running product of the tokens'
factors 2^g'_s (s ≤ i) and 2^(Γ_C − Γ_i) the product of those after i. Stage 1 hands over only what needs a whole
row: the inverse row norms of q and k.

A thread owns two key columns and one half of the chunk's rows (``HALF`` = 32): 64 column pairs × 2 halves are the
warpgroup's 128 threads. Each half forms its local products; the halves then exchange totals (the upper half's
prefix total scales the lower half's prefixes, the lower half's total scales the upper half's suffixes). The
products and roundings are the scheme's, in its order; the per-token gate is stage 1's model's
(``kda_fwd_intra_tc.gate_log2``). tests/test_kda_raw_tiles.py checks it against that model
(``kda_fwd_intra_tc.emulate``).
"""

from __future__ import annotations

import torch

from cula.kernels.sm90.kda_fwd_intra_tc import CHUNK, L2NORM_EPS, gate_log2

HALF = 32  # rows a transform thread walks: the chunk's two halves run on two threads


def half_products(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e: [..., 64, K]`` the factors 2^g' (fp32). Returns (prefix, suffix): prefix_i = Π_{s ≤ i} e_s = 2^Γ_i and
    suffix_i = Π_{s > i} e_s = 2^(Γ_C − Γ_i), each formed as the two-half scheme forms it: a running product down
    each half in fp32, then one multiply by the other half's total."""
    pre = torch.empty_like(e)
    suf = torch.empty_like(e)
    for h in range(CHUNK // HALF):
        r0 = h * HALF
        run = torch.ones_like(e[..., 0, :])
        for r in range(r0, r0 + HALF):  # down the half: the prefix includes the row itself
            run = run * e[..., r, :]
            pre[..., r, :] = run
        run = torch.ones_like(e[..., 0, :])
        for r in range(r0 + HALF - 1, r0 - 1, -1):  # up the half: the suffix excludes the row itself
            suf[..., r, :] = run
            run = run * e[..., r, :]
    top_total = pre[..., HALF - 1, :].clone()  # Π over rows 0..31
    bottom_total = suf[..., HALF, :] * e[..., HALF, :]  # Π over rows 32..63
    pre[..., HALF:, :] = top_total[..., None, :] * pre[..., HALF:, :]
    suf[..., :HALF, :] = bottom_total[..., None, :] * suf[..., :HALF, :]
    return pre, suf


def raw_tiles(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, keep: torch.Tensor, scale: float,
              lower_bound: float, a: torch.Tensor, dt_bias: torch.Tensor, use_qk_l2norm: bool = True,
              softplus_gate: bool = False, log_gate: bool = False) -> dict[str, torch.Tensor]:
    """The tiles stage 2 would form for a batch of chunks. ``q, k, g: [..., 64, K]`` one chunk's rows per leading
    index (rows past a sequence's end hold anything finite), ``keep: [..., 64]`` bool, the rows inside it; ``a: [...]``
    exp(A_log) per head, ``dt_bias: [..., K]``. Returns ``qg`` (scale q̂ ⊙ 2^Γ), ``x`` (k̂ ⊙ 2^Γ: stage 1 stores its
    negation), ``kg`` (k̂ ⊙ 2^(Γ_C − Γ), stage 1 stores its transpose) in bf16 and ``gam`` (2^Γ_C, fp32, [..., K])."""
    kf = keep[..., None].float()
    qf, kf_ = q.float() * kf, k.float() * kf
    nq = torch.full_like(qf[..., :1], scale)
    nk = torch.ones_like(kf_[..., :1])
    if use_qk_l2norm:  # stage 1 hands these over (8 B a token-head)
        nq = scale * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        nk = torch.rsqrt((kf_ * kf_).sum(-1, keepdim=True) + L2NORM_EPS)
    e = torch.exp2(gate_log2(g.float(), lower_bound, a[..., None, None], dt_bias[..., None, :], softplus_gate,
                             log_gate) * kf)
    pre, suf = half_products(e)
    qs, ks = qf * nq, kf_ * nk
    gam = pre[..., CHUNK - 1, :]
    return dict(qg=(qs * pre).to(torch.bfloat16), x=(ks * pre).to(torch.bfloat16), kg=(ks * suf).to(torch.bfloat16),
                gam=gam)

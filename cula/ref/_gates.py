"""Input transforms that FLA 0.6.0 fuses into its kernels, written out in torch.

- q/k L2 norm (``fla.modules.l2norm``): ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim; the epsilon
  sits inside the square root.
- beta sigmoid (``fla.ops.common.gate.fused_beta_sigmoid``): ``sigmoid(beta)``, times 2 with
  ``allow_neg_eigval`` (eigenvalues of ``I - beta k k^T`` then reach ``(-1, 1]``).
- KDA / GDN in-kernel gate (``fla.ops.kda.gate``, ``fla.ops.gated_delta_rule.gate``), natural-log space:
  ``-exp(A_log) * softplus(g + dt_bias)``, or with a ``lower_bound``:
  ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` optional there: factor 1).
  ``softplus`` is torch's (threshold 20), the same cut-over FLA's PTX softplus uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + 1e-6)``, FLA's ``l2norm_fwd``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def beta_sigmoid(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(beta)``, doubled (range ``(0, 2)``) when ``allow_neg_eigval``."""
    return torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)


def decay_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """The in-kernel log-decay gate.

    Args:
        g: raw gate input ``[..., HV, D]`` (D = K for KDA, 1 for GDN's per-head gate).
        A_log: ``[HV]`` (may be ``None`` only with ``lower_bound``).
        dt_bias: ``[HV * D]`` or ``None``.
        lower_bound: ``None`` for the softplus gate, else the log-space floor of the sigmoid gate.
    Returns:
        log-decay of the shape of ``g`` (values in ``(-inf, 0]``, or ``[lower_bound, 0)``).
    """
    HV, D = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).reshape(HV, D)
    if lower_bound is None:
        return -A_log.to(g.dtype).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(g.dtype).reshape(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)

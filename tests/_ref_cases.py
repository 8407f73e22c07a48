"""Seeded random inputs and error measures shared by the tests/test_ref_*.py files."""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (a scale-free error over the whole tensor)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().max().item()
    return (got.to(F64) - want.to(F64)).abs().max().item() / max(scale, 1e-30)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen_, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen_, dtype=dtype)


def rand(gen_, *shape, low=0.0, high=1.0, dtype=F64):
    return low + (high - low) * torch.rand(*shape, generator=gen_, dtype=dtype)


def delta_inputs(seed, B, T, H, K, V, HV=None, gate="vector", with_state=False, dtype=F64):
    """Inputs for a delta-rule variant: unit-norm keys (the regime the models use, so ``I - beta k k^T``
    stays a contraction), ``beta`` in (0, 1), log-decays in [-5, 0] (KDA, per key dim) or [-2, 0] (GDN).
    ``gate``: "vector" -> g [B, T, HV, K]; "scalar" -> g [B, T, HV]."""
    HV = HV or H
    r = gen(seed)
    q = randn(r, B, T, H, K, dtype=dtype)
    k = F.normalize(randn(r, B, T, H, K, dtype=dtype), dim=-1)
    v = randn(r, B, T, HV, V, dtype=dtype)
    if gate == "vector":
        g = rand(r, B, T, HV, K, low=-5.0, high=0.0, dtype=dtype)
    else:
        g = rand(r, B, T, HV, low=-2.0, high=0.0, dtype=dtype)
    beta = rand(r, B, T, HV, low=0.05, high=1.0, dtype=dtype)
    h0 = randn(r, B, HV, K, V, dtype=dtype) if with_state else None
    return q, k, v, g, beta, h0


def varlen_cu(lengths: list[int], dtype=torch.int64) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype)


def split_by_cu(x: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    """Packed ``[1, T, ...]`` -> list of ``[1, len_i, ...]``."""
    c = cu.tolist()
    return [x[:, a:b] for a, b in zip(c[:-1], c[1:])]


SEGMENTS = {
    "1seg": [37],
    "3seg_with_empty": [20, 0, 70],
    "17seg_with_empty": [5, 1, 0, 64, 3, 65, 12, 7, 0, 30, 2, 9, 128, 4, 1, 11, 40],
}

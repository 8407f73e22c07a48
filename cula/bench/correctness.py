"""Correctness of an implementation's outputs against the reference (the "oracle").

The oracle is cula's torch reference on the same inputs:

- CPU runs (the smoke grid): ``cula.ref.<variant>.recurrent`` in float64 - the token-by-token ground
  truth, cheap at smoke sizes;
- GPU decode: ``recurrent`` in fp32 (one token: the recurrence *is* the algorithm);
- GPU prefill / train: ``chunked`` in fp32 on the GPU (the recurrence is far too slow at T = 16384).

Errors are the relative L2 norm ``||x - ref|| / ||ref||`` and the max absolute difference, for the
output, the final state and (train) the worst input gradient. A row fails when a relative error is
above the config's tolerance or is NaN (a NaN never passes). Max-abs errors are recorded for the
reader but not gated: they scale with the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cula.bench.impls import Outputs, Unavailable, _load, _two, fit_kwargs, kind_of, op_kwargs
from cula.bench.inputs import Inputs

NAN = float("nan")

Oracle = Callable[[Inputs], tuple[Outputs, str]]


@dataclass(frozen=True)
class Errors:
    o_rel_l2: float = NAN
    o_max_abs: float = NAN
    state_rel_l2: float = NAN
    state_max_abs: float = NAN
    grad_rel_l2: float = NAN


# Elements per slice when comparing: float64 copies of a whole [8, 32768, 64, 128] output would
# take 17 GB each, so the sums are accumulated slice by slice.
_SLICE = 1 << 24


def _slices(x: torch.Tensor, ref: torch.Tensor):
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: got {tuple(x.shape)}, reference {tuple(ref.shape)}")
    xf, rf = x.detach().reshape(-1), ref.detach().reshape(-1).to(x.device)
    for start in range(0, xf.numel(), _SLICE):
        yield xf[start:start + _SLICE].to(torch.float64), rf[start:start + _SLICE].to(torch.float64)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64 (``||x - ref||`` when ref is all zeros)."""
    num = den = 0.0
    for a, b in _slices(x, ref):
        num += torch.sum((a - b) ** 2).item()
        den += torch.sum(b * b).item()
    num, den = math.sqrt(num), math.sqrt(den)
    return num / den if den > 0 else num


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref|`` (NaN if either holds a NaN)."""
    worst = 0.0
    for a, b in _slices(x, ref):
        if a.numel():
            m = (a - b).abs().max().item()  # torch's max propagates NaN, Python's max() would not
            if math.isnan(m):
                return math.nan
            worst = max(worst, m)
    return worst


def compare(out: Outputs, ref: Outputs) -> Errors:
    """Errors of ``out = (o, final_state, grads)`` against the oracle's."""
    o, ht, grads = out
    ro, rht, rgrads = ref
    e_o, m_o = rel_l2(o, ro), max_abs(o, ro)
    e_s = m_s = NAN
    if rht is not None:
        if ht is None:
            e_s = m_s = math.inf  # a missing final state is as wrong as it gets
        else:
            e_s, m_s = rel_l2(ht, rht), max_abs(ht, rht)
    e_g = NAN
    if rgrads is not None:
        if grads is None:
            e_g = math.inf
        else:
            worst = 0.0
            for g, rg in zip(grads, rgrads):
                if rg is None:
                    continue
                worst = max(worst, math.inf if g is None else rel_l2(g, rg))
                if math.isnan(worst):
                    break
            e_g = worst
    return Errors(e_o, m_o, e_s, m_s, e_g)


def verdict(err: Errors, tol: dict[str, float]) -> tuple[bool, str]:
    """(passed, reason) of ``err`` against tolerances ``{"o":, "state":, "grad":}``."""
    bad = []
    for key, val in (("o", err.o_rel_l2), ("state", err.state_rel_l2), ("grad", err.grad_rel_l2)):
        if key == "o" or not math.isnan(val):
            limit = tol.get(key)
            if limit is None:
                continue
            if not (val <= limit):  # NaN fails here
                bad.append(f"{key} rel-L2 {val:.3g} > {limit:.3g}")
    return (not bad), "; ".join(bad)


def default_oracle(inputs: Inputs) -> tuple[Outputs, str]:
    """Reference outputs for ``inputs`` (see module docstring for which form and precision)."""
    cfg = inputs.cfg
    on_cpu = inputs.device != "cuda"
    form = "recurrent" if (on_cpu or cfg.phase == "decode") else "chunked"
    dtype = torch.float64 if on_cpu else torch.float32
    fn = _load(f"cula.ref.{cfg.variant}", form)
    kwargs = op_kwargs(inputs, "ref")
    kwargs["dtype"] = dtype
    if inputs.h0 is not None:
        kwargs["initial_state"] = inputs.h0.to(dtype)
    kwargs = fit_kwargs(fn, kwargs)
    name = f"cula.ref.{cfg.variant}.{form} {'fp64' if dtype == torch.float64 else 'fp32'}"
    if cfg.phase != "train":
        with torch.no_grad():
            o, ht = _two(fn(**kwargs))
        return (o, ht, None), name
    # Differentiate through fresh high-precision leaves so the reference gradients are not rounded
    # to the input dtype.
    leaves = []
    for n in inputs.leaves:
        leaf = inputs.tensors[n].detach().to(dtype).requires_grad_(True)
        kwargs[n] = leaf
        leaves.append(leaf)
    o, ht = _two(fn(**kwargs))
    grads = torch.autograd.grad([o], leaves, [inputs.do.to(dtype)], allow_unused=True)
    return (o.detach(), ht.detach() if ht is not None else None, grads), name


__all__ = ["Errors", "compare", "verdict", "rel_l2", "max_abs", "default_oracle", "Oracle",
           "Unavailable", "kind_of"]

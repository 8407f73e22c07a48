"""Build the input tensors of one benchmark config, deterministically from its seed.

Inputs are made once per config on the target device with a seeded ``torch.Generator`` and shared
by every implementation (so all impls see the same numbers). Distributions follow FLA's tests:

- ``q, k, v``: standard normal in the config dtype (KDA/GDN normalise q/k in kernel).
- KDA: raw gate ``g ~ N(0, 1)`` ``[B, T, HV, K]`` with ``A_log = log U(1, 16)`` and
  ``dt_bias ~ N(0, 1)`` when the gate is computed in kernel, else ``g = logsigmoid(N(0,1))`` (clamped
  to ``lower_bound`` under ``safe_gate``); ``beta`` raw logits when sigmoid is in kernel, else
  ``sigmoid(N(0,1))``.
- GDN: ``g = logsigmoid(N(0,1))`` fp32 ``[B, T, HV]``, ``beta = sigmoid(N(0,1))``.
- GLA: ``g = logsigmoid(N(0,1)) / 16`` ``[B, T, H, K]`` (slow decay, as in FLA's tests).
- Lightning: ``decay[h] = 2^(-8 (h+1) / HV)`` (ALiBi-style slopes, the MiniMax lightning decay).
- ``h0 ~ N(0, 1)`` fp32 ``[N, HV, K, V]`` when the config carries a state; ``dO ~ N(0, 1)`` for train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cula.suites import Config, cu_seqlens_from_lengths

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass
class Inputs:
    """Tensors of one config. ``tensors`` holds q, k, v and the variant's gates/parameters; ``h0``
    the fp32 initial state or None; ``cu_seqlens`` int64 ``[N+1]`` (varlen) with its host copy."""

    cfg: Config
    device: str
    tensors: dict[str, torch.Tensor]
    h0: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    do: torch.Tensor | None = None          # train: gradient of o
    leaves: tuple[str, ...] = ()            # train: names of tensors we differentiate
    flags: dict[str, Any] = field(default_factory=dict)

    def release(self) -> None:
        self.tensors.clear()
        self.h0 = self.cu_seqlens = self.cu_seqlens_cpu = self.do = None


def build_inputs(cfg: Config, device: str) -> Inputs:
    """Create the inputs of ``cfg`` on ``device`` from ``cfg.seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    dt = torch_dtype(cfg.dtype)
    B, T, H, HV, K, V = cfg.B, cfg.T, cfg.H, cfg.HV, cfg.K, cfg.V
    flags = cfg.flag_dict

    def randn(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=device, dtype=torch.float32)

    t: dict[str, torch.Tensor] = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, HV, V)}
    if cfg.variant == "kda":
        if flags.get("use_gate_in_kernel"):
            t["g"] = randn(B, T, HV, K)
            t["A_log"] = torch.log(1.0 + 15.0 * rand(HV))
            t["dt_bias"] = randn(HV * K, dtype=torch.float32)
        else:
            g = torch.nn.functional.logsigmoid(randn(B, T, HV, K, dtype=torch.float32))
            if flags.get("safe_gate") and flags.get("lower_bound") is not None:
                g = g.clamp_min(float(flags["lower_bound"]))
            t["g"] = g.to(dt)
        beta = randn(B, T, HV, dtype=torch.float32)
        t["beta"] = (beta if flags.get("use_beta_sigmoid_in_kernel") else beta.sigmoid()).to(dt)
    elif cfg.variant == "gdn":
        t["g"] = torch.nn.functional.logsigmoid(randn(B, T, HV, dtype=torch.float32))
        t["beta"] = randn(B, T, HV, dtype=torch.float32).sigmoid().to(dt)
    elif cfg.variant == "gla":
        t["g"] = (torch.nn.functional.logsigmoid(randn(B, T, HV, K, dtype=torch.float32)) / 16).to(dt)
    elif cfg.variant == "lightning":
        heads = torch.arange(1, HV + 1, device=device, dtype=torch.float32)
        t["decay"] = torch.exp2(-8.0 * heads / HV)
    else:  # the suite loader already rejects this
        raise ValueError(f"variant: expected kda, lightning, gdn or gla, got {cfg.variant!r}")

    n = cfg.num_seqs
    h0 = randn(n, HV, K, V, dtype=torch.float32) if (cfg.state or cfg.phase == "decode") else None
    cu = cu_cpu = None
    if cfg.mode == "varlen":
        offsets = cu_seqlens_from_lengths(list(cfg.lengths))
        cu_cpu = torch.tensor(offsets, dtype=torch.int64)
        cu = cu_cpu.to(device)
    do = None
    leaves: tuple[str, ...] = ()
    if cfg.phase == "train":
        do = randn(B, T, HV, V)
        leaves = tuple(name for name in ("q", "k", "v", "g", "beta") if name in t)
        for name in leaves:
            t[name].requires_grad_(True)
    return Inputs(cfg=cfg, device=device, tensors=t, h0=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                  do=do, leaves=leaves, flags=flags)

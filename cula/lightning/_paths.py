"""How the FLA and torch backends run the Lightning ops (entries of the table in cula/_dispatch.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cula._dispatch import resolved_scale
from cula._runners import compute_dtype, expand_heads, no_grad_for_frozen_decay, run_with_pool


def cp_fwd(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context parallel: each rank's local pass is this op without cp_context (dispatched as usual)."""
    from cula.cp.lightning import lightning_attn_fwd as cp_lightning

    return cp_lightning(
        inputs["q"], inputs["k"], inputs["v"], inputs["decay"], inputs["scale"], inputs["initial_state"],
        inputs["output_final_state"], inputs["cu_seqlens"], cp_context=inputs["cp_context"],
    )


def fla_fwd_limits(inputs: Mapping[str, Any]) -> str | None:
    return no_grad_for_frozen_decay(inputs, "FLA's simple_gla")


def _fla_args(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k expanded per value head (FLA's simple_gla has no GVA) and ``g_gamma = -decay`` in fp32."""
    HV = inputs["v"].shape[2]
    q, k = (expand_heads(inputs[n], HV) for n in ("q", "k"))
    return q, k, inputs["v"], -inputs["decay"].float()


def fla_fwd(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.simple_gla import chunk_simple_gla

    q, k, v, g_gamma = _fla_args(inputs)
    return chunk_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=resolved_scale(inputs), initial_state=inputs["initial_state"],
        output_final_state=inputs["output_final_state"], cu_seqlens=inputs["cu_seqlens"],
    )


def ref_fwd(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula.ref import lightning as ref

    q = inputs["q"]
    o, ht = ref.chunked(
        q, inputs["k"], inputs["v"], inputs["decay"], scale=inputs["scale"], initial_state=inputs["initial_state"],
        output_final_state=inputs["output_final_state"], cu_seqlens=inputs["cu_seqlens"], dtype=compute_dtype(q),
    )
    return o.to(q.dtype), ht


def fla_decode(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    q, k, v, g_gamma = _fla_args(inputs)

    def step(h0, want_state):
        return fused_recurrent_simple_gla(
            q, k, v, g_gamma=g_gamma, scale=resolved_scale(inputs), initial_state=h0, output_final_state=want_state,
        )

    return run_with_pool(inputs, step)


def ref_decode(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula.ref import lightning as ref

    q = inputs["q"]

    def step(h0, want_state):
        o, ht = ref.recurrent(
            q, inputs["k"], inputs["v"], inputs["decay"], scale=inputs["scale"], initial_state=h0,
            output_final_state=want_state, dtype=compute_dtype(q),
        )
        return o.to(q.dtype), ht

    return run_with_pool(inputs, step)

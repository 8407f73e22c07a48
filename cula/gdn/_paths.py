"""How the FLA and torch backends run the GDN ops (entries of the table in cula/_dispatch.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cula._dispatch import needs_grad, resolved_scale
from cula._runners import compute_dtype

FLA_CHUNK_ARGS = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "chunk_indices", "cp_context", "use_gate_in_kernel", "A_log", "dt_bias", "chunk_size",
)
FLA_RECURRENT_ARGS = (
    "q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state", "output_final_state",
    "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval", "state_v_first", "cu_seqlens",
)
REF_ARGS = (
    "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval", "state_v_first", "cu_seqlens", "use_gate_in_kernel", "A_log", "dt_bias",
)


def fla_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(**{name: inputs[name] for name in FLA_CHUNK_ARGS})


def ref_chunk_limits(inputs: Mapping[str, Any]) -> str | None:
    if inputs.get("cp_context") is not None:
        return "cp_context (context parallelism) runs through FLA"
    return None


def ref_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula.ref import gdn as ref

    q = inputs["q"]
    o, ht = ref.chunked(
        q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"], chunk_size=inputs["chunk_size"],
        dtype=compute_dtype(q), **{name: inputs[name] for name in REF_ARGS},
    )
    return o.to(q.dtype), ht


def fla_recurrent_limits(inputs: Mapping[str, Any]) -> str | None:
    if needs_grad(inputs):
        return "FLA's fused_recurrent_gated_delta_rule has no backward and gradients are requested"
    return None


def fla_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(**{name: inputs[name] for name in FLA_RECURRENT_ARGS})


def ref_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = inputs["q"]
    beta = inputs["beta"]
    if inputs["gk"] is None and inputs["gv"] is None and (beta is None or beta.dim() == 3):
        from cula.ref import gdn as ref

        o, ht = ref.recurrent(
            q, inputs["k"], inputs["v"], inputs["g"], beta, dtype=compute_dtype(q),
            **{name: inputs[name] for name in REF_ARGS},
        )
        return o.to(q.dtype), ht
    return _general(inputs)


def _general(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gk`` / ``gv`` / per-channel beta: the token-by-token recurrence with FLA's input transforms."""
    from cula._recurrence import recurrence
    from cula.ref._gates import beta_sigmoid, decay_gate, l2norm

    dtype = compute_dtype(inputs["q"])
    q, k = (inputs[n].to(dtype) for n in ("q", "k"))
    g, beta = (inputs[n].to(dtype) if inputs[n] is not None else None for n in ("g", "beta"))
    if inputs["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    if beta is not None and inputs["use_beta_sigmoid_in_kernel"]:
        beta = beta_sigmoid(beta, inputs["allow_neg_eigval"])
    if beta is None and inputs["use_beta_sigmoid_in_kernel"]:  # FLA: beta defaults to ones, then the sigmoid
        beta = beta_sigmoid(torch.ones_like(inputs["v"][..., 0], dtype=dtype), inputs["allow_neg_eigval"])
    if inputs["use_gate_in_kernel"]:
        g = decay_gate(g[..., None], inputs["A_log"], inputs["dt_bias"], None)[..., 0]
    o, ht = recurrence(
        q, k, inputs["v"], g=g, gk=inputs["gk"], gv=inputs["gv"], beta=beta, delta=True,
        scale=resolved_scale(inputs), initial_state=inputs["initial_state"],
        output_final_state=inputs["output_final_state"], state_v_first=inputs["state_v_first"],
        cu_seqlens=inputs["cu_seqlens"], dtype=dtype,
    )
    return o.to(inputs["q"].dtype), ht

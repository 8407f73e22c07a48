"""How the kernel, FLA and torch backends run the KDA ops (entries of the table in cula/_dispatch.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cula._dispatch import needs_grad, resolved_scale
from cula._runners import compute_dtype, has_pool, run_with_pool

# chunk_kda arguments FLA takes (its signature plus the keywords it reads from **kwargs).
FLA_CHUNK_ARGS = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "cp_context", "use_graph", "max_num_seqs", "A_log", "dt_bias", "chunk_size",
)
FLA_RECURRENT_ARGS = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
    "cu_seqlens",
)
# The arguments of cula.ref.kda that change the math.
REF_ARGS = (
    "scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval", "lower_bound", "state_v_first", "cu_seqlens",
)
FLA_MAX_K = 256


def _fla_only(inputs: Mapping[str, Any]) -> str | None:
    if inputs.get("return_intermediate_states"):
        return "return_intermediate_states=True is FLA's inference-mode output"
    if inputs.get("cp_context") is not None:
        return "cp_context runs through cula.cp (or FLA's own CP); this path is the single-rank pass"
    return None


def cp_chunk_limits(inputs: Mapping[str, Any]) -> str | None:
    from cula.cp._local import is_fla_context

    has_state = inputs["initial_state"] is not None or inputs["output_final_state"]
    if is_fla_context(inputs["cp_context"]) and inputs["q"].is_cuda and not has_state and not inputs.get("use_graph"):
        return "an FLA FLACPContext on CUDA runs FLA's own CP kernels (they have a backward)"
    return None


def cp_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context parallel: each rank's local pass is chunk_kda without cp_context (dispatched as usual)."""
    from cula.cp.kda import chunk_kda as cp_kda

    names = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first",
             "cu_seqlens")
    extra = ("A_log", "dt_bias", "chunk_size", "disable_recompute", "cu_seqlens_cpu", "use_graph",
             "return_intermediate_states")
    return cp_kda(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], *(inputs[n] for n in names),
        cp_context=inputs["cp_context"], **{n: inputs[n] for n in extra},
    )


# --- chunk_kda

def kernel_chunk_limits(inputs: Mapping[str, Any]) -> str | None:
    reason = _fla_only(inputs)
    if reason is None and inputs.get("use_graph"):
        reason = "use_graph=True (graph-capture varlen planning) is FLA's"
    return reason


def fla_chunk_limits(inputs: Mapping[str, Any]) -> str | None:
    if inputs.get("cp_context") is not None and (inputs["initial_state"] is not None or inputs["output_final_state"]):
        return "FLA's CP takes no initial/final state"
    K = inputs["q"].shape[-1]
    if K > FLA_MAX_K:
        return f"FLA's chunk_kda takes head dim K <= {FLA_MAX_K}, got K={K}"
    return None


def ref_chunk_limits(inputs: Mapping[str, Any]) -> str | None:
    return _fla_only(inputs)


def fla_chunk(inputs: Mapping[str, Any]) -> Any:
    from fla.ops.kda import chunk_kda

    return chunk_kda(**{name: inputs[name] for name in FLA_CHUNK_ARGS})


def ref_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula.ref import kda as ref

    q = inputs["q"]
    o, ht = ref.chunked(
        q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        initial_state=inputs["initial_state"], output_final_state=inputs["output_final_state"],
        safe_gate=inputs["safe_gate"], chunk_size=inputs["chunk_size"], dtype=compute_dtype(q),
        **{name: inputs[name] for name in REF_ARGS},
    )
    return o.to(q.dtype), ht


# --- fused_recurrent_kda

def kernel_decode_limits(inputs: Mapping[str, Any]) -> str | None:
    if inputs["cu_seqlens"] is not None:
        return "varlen (cu_seqlens) is not taken by the kda_decode kernel"
    if inputs["beta"].dim() == 4:
        return "per-channel beta [B, T, HV, V] is not taken by the kda_decode kernel"
    return None


def fla_recurrent_limits(inputs: Mapping[str, Any]) -> str | None:
    if needs_grad(inputs):
        return "FLA's fused_recurrent_kda has no backward and gradients are requested"
    K = inputs["q"].shape[-1]
    if K > FLA_MAX_K:
        return f"FLA's fused_recurrent_kda takes head dim K <= {FLA_MAX_K}, got K={K}"
    return None


def fla_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.kda import fused_recurrent_kda

    args = {name: inputs[name] for name in FLA_RECURRENT_ARGS}

    def step(h0, want_state):
        return fused_recurrent_kda(**{**args, "initial_state": h0, "output_final_state": want_state})

    if not has_pool(inputs):
        return step(inputs["initial_state"], inputs["output_final_state"])
    return run_with_pool(inputs, step)


def _ref_recurrent_step(inputs: Mapping[str, Any], h0: torch.Tensor | None, want_state: bool):
    q = inputs["q"]
    dtype = compute_dtype(q)
    if inputs["beta"].dim() == 4:
        return _per_channel_beta(inputs, h0, want_state, dtype)
    from cula.ref import kda as ref

    o, ht = ref.recurrent(
        q, inputs["k"], inputs["v"], inputs["g"], inputs["beta"], initial_state=h0, output_final_state=want_state,
        dtype=dtype, **{name: inputs[name] for name in REF_ARGS},
    )
    return o.to(q.dtype), ht


def _per_channel_beta(inputs: Mapping[str, Any], h0, want_state: bool, dtype: torch.dtype):
    """KDA with beta ``[B, T, HV, V]`` (FLA's fused recurrent kernel takes it; the reference does not)."""
    from cula._recurrence import recurrence
    from cula.ref._gates import beta_sigmoid, decay_gate, l2norm

    q, k, g, beta = (inputs[n].to(dtype) for n in ("q", "k", "g", "beta"))
    if inputs["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    if inputs["use_beta_sigmoid_in_kernel"]:
        beta = beta_sigmoid(beta, inputs["allow_neg_eigval"])
    if inputs["use_gate_in_kernel"]:
        g = decay_gate(g, inputs["A_log"], inputs["dt_bias"], inputs["lower_bound"])
    o, ht = recurrence(
        q, k, inputs["v"], gk=g, beta=beta, delta=True, scale=resolved_scale(inputs), initial_state=h0,
        output_final_state=want_state, state_v_first=inputs["state_v_first"], cu_seqlens=inputs["cu_seqlens"],
        dtype=dtype,
    )
    return o.to(inputs["q"].dtype), ht


def ref_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    def step(h0, want_state):
        return _ref_recurrent_step(inputs, h0, want_state)

    if not has_pool(inputs):
        return step(inputs["initial_state"], inputs["output_final_state"])
    return run_with_pool(inputs, step)

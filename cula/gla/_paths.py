"""How the FLA and torch backends run the GLA ops (entries of the table in cula/_dispatch.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cula._dispatch import resolved_scale
from cula._runners import compute_dtype

FLA_CHUNK_ARGS = (
    "q", "k", "v", "g", "scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens",
    "cu_seqlens_cpu",
)
FLA_RECURRENT_ARGS = (
    "q", "k", "v", "gk", "gv", "scale", "initial_state", "output_final_state", "reverse", "state_v_first",
    "cu_seqlens",
)
REF_ARGS = ("scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens")


def fla_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.gla import chunk_gla

    return chunk_gla(**{name: inputs[name] for name in FLA_CHUNK_ARGS})


def ref_chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula.ref import gla as ref

    q = inputs["q"]
    o, ht = ref.chunked(q, inputs["k"], inputs["v"], inputs["g"], dtype=compute_dtype(q),
                        **{name: inputs[name] for name in REF_ARGS})
    return o.to(q.dtype), ht


def fla_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.gla import fused_recurrent_gla

    return fused_recurrent_gla(**{name: inputs[name] for name in FLA_RECURRENT_ARGS})


def ref_recurrent(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = inputs["q"]
    dtype = compute_dtype(q)
    if inputs["gv"] is None and not inputs["reverse"]:
        from cula.ref import gla as ref

        gk = inputs["gk"] if inputs["gk"] is not None else torch.zeros_like(q)
        o, ht = ref.recurrent(q, inputs["k"], inputs["v"], gk, dtype=dtype, **{n: inputs[n] for n in REF_ARGS})
        return o.to(q.dtype), ht
    from cula._recurrence import recurrence

    o, ht = recurrence(
        q, inputs["k"], inputs["v"], gk=inputs["gk"], gv=inputs["gv"], delta=False, scale=resolved_scale(inputs),
        initial_state=inputs["initial_state"], output_final_state=inputs["output_final_state"],
        state_v_first=inputs["state_v_first"], cu_seqlens=inputs["cu_seqlens"], reverse=inputs["reverse"],
        dtype=dtype,
    )
    return o.to(q.dtype), ht

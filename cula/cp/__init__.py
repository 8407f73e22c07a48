"""Context parallelism for Lightning Attention and KDA prefill: one sequence split across ranks.

Each rank runs the single-device forward on its contiguous piece of the packed token stream, the ranks
exchange affine state summaries (an exclusive scan over the group), and each rank adds the contribution of
the state it inherits. Usage on every rank of ``group``::

    from cula.cp import build_cp_context, split_tokens, chunk_kda
    ctx = build_cp_context(cu_seqlens, group)                 # global boundaries, same on every rank
    q_l, k_l, v_l, g_l, b_l = (split_tokens(x, ctx) for x in (q, k, v, g, beta))
    o_l, _ = chunk_kda(q_l, k_l, v_l, g_l, b_l, cp_context=ctx)

``emulate_lightning_attn_fwd`` / ``emulate_chunk_kda`` run the same split in one process.
"""

from cula.cp.context import CPContext, build_cp_context, emulated_contexts
from cula.cp.gather import assemble_final_state, concat_tokens, gather_final_state, gather_tokens, split_tokens
from cula.cp.kda import chunk_kda, emulate_chunk_kda
from cula.cp.lightning import emulate_lightning_attn_fwd, lightning_attn_fwd

__all__ = [
    "CPContext",
    "assemble_final_state",
    "build_cp_context",
    "chunk_kda",
    "concat_tokens",
    "emulate_chunk_kda",
    "emulate_lightning_attn_fwd",
    "emulated_contexts",
    "gather_final_state",
    "gather_tokens",
    "lightning_attn_fwd",
    "split_tokens",
]

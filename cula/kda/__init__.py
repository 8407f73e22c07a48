"""KDA (Kimi Delta Attention): the delta rule with a per-key-channel decay, FLA 0.6.0-compatible.

- :func:`chunk_kda`: prefill / training (``fla.ops.kda.chunk_kda``).
- :func:`fused_recurrent_kda`: token-by-token / decode (``fla.ops.kda.fused_recurrent_kda``), with an
  optional state pool (``state_indices``, ``inplace``; FLA's names ``ssm_state_indices``,
  ``inplace_final_state`` are accepted too).
"""

from cula.kda.ops import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]

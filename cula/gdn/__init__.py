"""GDN (the gated delta rule): the delta rule with one scalar decay per head and token, FLA 0.6.0-compatible.

- :func:`chunk_gated_delta_rule`: prefill / training (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``).
- :func:`fused_recurrent_gated_delta_rule`: token by token (``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``).
"""

from cula.gdn.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"]

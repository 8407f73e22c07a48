"""GLA (gated linear attention): linear attention with a per-key-channel decay, FLA 0.6.0-compatible.

- :func:`chunk_gla`: prefill / training (``fla.ops.gla.chunk_gla``).
- :func:`fused_recurrent_gla`: token by token (``fla.ops.gla.fused_recurrent_gla``).
"""

from cula.gla.ops import chunk_gla, fused_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla"]

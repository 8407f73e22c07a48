"""Lightning Attention: linear attention with a per-head constant decay (``S_t = exp(-decay) S_{t-1} + k_t^T v_t``).

- :func:`lightning_attn_fwd`: prefill / training forward, varlen via ``cu_seqlens``.
- :func:`lightning_attn_decode`: decode steps (a few tokens) against a state pool (``state_indices``,
  ``inplace``).
"""

from cula.lightning.ops import lightning_attn_decode, lightning_attn_fwd

__all__ = ["lightning_attn_decode", "lightning_attn_fwd"]

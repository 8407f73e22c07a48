"""Packed (``cu_seqlens``) <-> padded batch conversion for the references.

The references run every segment of a packed batch at once by right-padding the segments to a common
length. Padding tokens carry ``q = k = v = 0``, log-decay ``g = 0`` and ``beta = 0``: they multiply the
state by ``exp(0) = 1`` and add ``k^T (...) = 0``, so the state after the padding is exactly the state
after the last real token, and the padded outputs are simply dropped. Both directions are gathers, so
autograd flows through them.
"""

from __future__ import annotations

import torch


def _padded_index(lengths: list[int], width: int, pad_index: int, device: torch.device) -> torch.Tensor:
    """``[N, width]`` token indices into the packed sequence; ``pad_index`` marks padding."""
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    pos = torch.arange(width, dtype=torch.int64)
    lens = torch.tensor(lengths, dtype=torch.int64)
    idx = starts[:, None] + pos[None, :]
    idx = torch.where(pos[None, :] < lens[:, None], idx, torch.full_like(idx, pad_index))
    return idx.to(device)


def pad_segments(x: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """``x: [1, T, ...]`` packed -> ``[N, width, ...]``, each segment left-aligned, zeros after it."""
    total = x.shape[1]
    flat = torch.cat([x[0], x.new_zeros((1, *x.shape[2:]))], dim=0)  # row `total` is the zero row
    idx = _padded_index(lengths, width, total, x.device)
    return flat[idx]


def unpad_segments(y: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``y: [N, width, ...]`` -> packed ``[1, sum(lengths), ...]`` (the inverse of :func:`pad_segments`)."""
    N, width = y.shape[:2]
    lens = torch.tensor(lengths, dtype=torch.int64)
    valid = torch.arange(width, dtype=torch.int64)[None, :] < lens[:, None]  # [N, width]
    index = valid.reshape(-1).nonzero().squeeze(1).to(y.device)
    return y.reshape(N * width, *y.shape[2:])[index].unsqueeze(0)

"""Packed (``cu_seqlens``) <-> padded batch conversion for the references.

The references run the segments of a packed batch as padded batches: segments of similar length are
right-padded to their group's longest (:func:`length_groups`), so a skewed batch does not pad every segment
to the longest one. Padding tokens carry ``q = k = v = 0``, log-decay ``g = 0`` and ``beta = 0``: they multiply the
state by ``exp(0) = 1`` and add ``k^T (...) = 0``, so the state after the padding is exactly the state
after the last real token, and the padded outputs are simply dropped. Both directions are gathers, so
autograd flows through them.
"""

from __future__ import annotations

import torch


# A group's padded tokens (members x its longest length) may be at most this many times its real tokens.
GROUP_SLACK = 1.5


def length_groups(lengths: list[int], slack: float = GROUP_SLACK) -> list[list[int]]:
    """Segment indices in groups of similar length, longest first, for padding each group separately.

    Padding every segment to the batch's longest costs ``N x max(lengths)`` tokens of memory and work: ten
    segments of which one holds most of the tokens pad to ~10x the real ones (the training oracle ran out of
    memory on such a batch). Greedy over the lengths in descending order: a segment joins the current group
    while the group's padded size stays within ``slack`` times its real size. Empty segments come last: they
    join the shortest group where it has room, and otherwise make a group of width 0 of their own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= slack * max(real + lengths[i], 1):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _padded_index(lengths: list[int], members: list[int], width: int, pad_index: int,
                  device: torch.device) -> torch.Tensor:
    """``[len(members), width]`` indices of those segments' tokens in the packed sequence; ``pad_index`` pads."""
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)[members]
    pos = torch.arange(width, dtype=torch.int64)
    lens = torch.tensor([lengths[i] for i in members], dtype=torch.int64)
    idx = starts[:, None] + pos[None, :]
    idx = torch.where(pos[None, :] < lens[:, None], idx, torch.full_like(idx, pad_index))
    return idx.to(device)


def pad_segments(
    x: torch.Tensor, lengths: list[int], width: int, members: list[int] | None = None
) -> torch.Tensor:
    """``x: [1, T, ...]`` packed -> ``[M, width, ...]``: segments ``members`` (default all, in order) of the
    packing ``lengths``, each left-aligned, zeros after it."""
    members = list(range(len(lengths))) if members is None else members
    total = x.shape[1]
    flat = torch.cat([x[0], x.new_zeros((1, *x.shape[2:]))], dim=0)  # row `total` is the zero row
    idx = _padded_index(lengths, members, width, total, x.device)
    return flat[idx]


def unpad_segments(y: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``y: [N, width, ...]`` -> packed ``[1, sum(lengths), ...]`` (the inverse of :func:`pad_segments`)."""
    N, width = y.shape[:2]
    lens = torch.tensor(lengths, dtype=torch.int64)
    valid = torch.arange(width, dtype=torch.int64)[None, :] < lens[:, None]  # [N, width]
    index = valid.reshape(-1).nonzero().squeeze(1).to(y.device)
    return y.reshape(N * width, *y.shape[2:])[index].unsqueeze(0)

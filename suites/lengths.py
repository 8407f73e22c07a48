"""Sequence-length generators for the variable-length benchmark configs.

Each generator splits ``total`` tokens into ``n`` sequences whose lengths sum to exactly ``total``;
they are pure Python (no torch, no numpy) so a suite expands identically on every machine.

- ``uniform``: ``n`` equal lengths; the ``total % n`` leftover tokens go one each to the first sequences.
- ``random``: weights drawn from U(0.02, 1.02) with ``random.Random(seed)``, lengths proportional.
- ``skewed``: ``n - 1`` sequences of weight 1 and one (the last) of weight ``n``, so the long sequence
  holds ``n / (2n - 1)`` of the tokens (about half) - the case where a per-sequence schedule starves.

Proportional splits round down, then hand the leftover tokens to the largest fractional remainders
(ties to the lower index), and finally make sure every sequence has at least one token.
"""

from __future__ import annotations

import random

DISTRIBUTIONS: tuple[str, ...] = ("uniform", "random", "skewed")

# U(RANDOM_LOW, RANDOM_LOW + 1): the low end keeps the shortest sequence from collapsing to ~0 tokens.
RANDOM_LOW = 0.02


def _split_by_weights(weights: list[float], total: int) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` that sum to exactly ``total``."""
    wsum = sum(weights)
    exact = [w / wsum * total for w in weights]
    lengths = [int(x) for x in exact]
    leftover = total - sum(lengths)
    # Largest remainder first; the index breaks ties so the result is deterministic.
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - lengths[i]), i))
    for i in order[:leftover]:
        lengths[i] += 1
    # A zero-length sequence is legal for the ops but useless in a benchmark: borrow from the longest.
    for i, n in enumerate(lengths):
        if n == 0:
            j = max(range(len(lengths)), key=lambda x: lengths[x])
            lengths[j] -= 1
            lengths[i] = 1
    return lengths


def varlen_lengths(dist: str, n: int, total: int, seed: int = 0) -> list[int]:
    """Return ``n`` positive sequence lengths summing to ``total`` following distribution ``dist``.

    Args:
        dist: one of ``uniform``, ``random``, ``skewed``.
        n: number of sequences (>= 1).
        total: number of tokens over all sequences (>= n).
        seed: seed of the ``random`` distribution (ignored by the others).
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist: expected one of {', '.join(DISTRIBUTIONS)}, got {dist!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    if not isinstance(total, int) or total < n:
        raise ValueError(f"total: expected an integer >= n ({n}), got {total!r}")
    if dist == "uniform":
        base, extra = divmod(total, n)
        return [base + (1 if i < extra else 0) for i in range(n)]
    if dist == "random":
        rng = random.Random(seed)
        weights = [rng.uniform(RANDOM_LOW, RANDOM_LOW + 1.0) for _ in range(n)]
        return _split_by_weights(weights, total)
    # skewed
    weights = [1.0] * (n - 1) + [float(n)]
    return _split_by_weights(weights, total)


def cu_seqlens_from_lengths(lengths: list[int]) -> list[int]:
    """Cumulative offsets ``[0, l0, l0+l1, ...]`` (length ``n + 1``) of the given lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out

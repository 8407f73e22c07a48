"""Speedup chart (PNG) beside the markdown: per suite, one bar per config and impl, speedup over FLA.

Drawn with matplotlib's Agg backend (no display needed), log-scaled y axis with a line at 1x.
"""

from __future__ import annotations

import math
from pathlib import Path

_COLORS = {"cula": "#2a7ab9", "flashkda": "#e08a1e", "ref": "#8c8c8c"}


def draw(series: list[tuple[str, list[tuple[str, dict[str, float]]]]], path: Path, title: str) -> Path:
    """Draw ``series`` = [(suite, [(config label, {impl: speedup})])] into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(series)
    widest = max(len(configs) for _, configs in series)
    fig, axes = plt.subplots(n, 1, figsize=(max(7.0, 0.32 * widest + 2), 3.2 * n), squeeze=False)
    for ax, (suite, configs) in zip(axes[:, 0], series):
        impls = sorted({i for _, sp in configs for i in sp}, key=lambda i: (i != "cula", i))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for x, (_, sp) in enumerate(configs):
                if impl in sp and sp[impl] > 0 and not math.isnan(sp[impl]):
                    xs.append(x + (j - (len(impls) - 1) / 2) * width)
                    ys.append(sp[impl])
            bars = ax.bar(xs, ys, width=width, label=impl, color=_COLORS.get(impl, None))
            if len(impls) == 1 and len(configs) <= 48:
                ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([label for label, _ in configs], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("x faster than FLA")
        ax.set_title(f"suite {suite}", fontsize=10)
        ax.legend(fontsize=8, loc="best")
        ax.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    # No metadata: the bytes then depend only on the data (and the matplotlib version).
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path

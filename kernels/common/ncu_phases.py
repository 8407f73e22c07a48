"""Read an ncu per-instruction source page (SASS, CSV) by kernel phase.

``ncu -i R.ncu-rep --page source --csv --print-source sass > sass.csv`` gives one row per SASS
instruction with its executed count and its warp-stall samples by reason. A kernel's phases are
separated by CTA barriers and wgmma waits, so cutting the listing at ``BAR.SYNC`` and
``WARPGROUP.DEPBAR`` splits it into segments that map onto the source's phases. Prints the stall
reasons over the whole kernel, then per segment its share of executed instructions and of stall
samples and its most executed opcodes (``Instructions Executed`` counts warp instructions; with
``--warps``, the CTAs x warps per CTA of the profiled launch, they become per-warp counts)::

    python3 -m cula.kernels.common.ncu_phases sass.csv [--warps 16384] [--min-share 1.0]
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import Counter
from dataclasses import dataclass, field

#: Instructions that end a segment: the CTA barrier and the wait for a wgmma group.
SEGMENT_ENDS = ("BAR.SYNC", "WARPGROUP.DEPBAR")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Segment:
    first: int
    last: int = 0
    executed: float = 0.0
    samples: float = 0.0
    opcodes: Counter = field(default_factory=Counter)
    ends_with: str = ""


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode family of a SASS line: ``@!P0 FFMA.FTZ R1, ...`` -> ``FFMA``."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def read_rows(text: str) -> list[dict[str, str]]:
    """The instruction rows of the CSV (the first line names the kernel, the second the columns)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def stall_shares(rows: list[dict[str, str]]) -> dict[str, float]:
    """Percent of all stall samples per reason (``stall_*`` columns, the not-issued split left out)."""
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []
    totals = {r: sum(_number(row[r]) for row in rows) for r in reasons}
    whole = sum(totals.values()) or 1.0
    return {r[len("stall_"):]: 100.0 * v / whole for r, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def segments(rows: list[dict[str, str]]) -> list[Segment]:
    """Consecutive instructions up to and including each barrier / wgmma wait."""
    out = [Segment(first=0)]
    for i, row in enumerate(rows):
        seg = out[-1]
        src = row.get("Source", "")
        seg.last = i
        seg.executed += _number(row.get(EXECUTED, ""))
        seg.samples += _number(row.get(SAMPLES, ""))
        seg.opcodes[opcode(src)] += _number(row.get(EXECUTED, ""))
        if any(end in src for end in SEGMENT_ENDS):
            seg.ends_with = opcode(src)
            out.append(Segment(first=i + 1))
    return [s for s in out if s.last >= s.first and (s.executed or s.samples)]


def report(text: str, warps: int | None = None, min_share: float = 1.0) -> str:
    rows = read_rows(text)
    segs = segments(rows)
    executed = sum(s.executed for s in segs) or 1.0
    samples = sum(s.samples for s in segs) or 1.0
    lines = ["stall samples by reason (%): " + ", ".join(f"{k} {v:.1f}" for k, v in stall_shares(rows).items()
                                                         if v >= 0.5)]
    per = f", per warp of {warps}" if warps else ""
    lines.append(f"segments (instructions / samples, % of the kernel; top opcodes{per}):")
    for s in segs:
        si, ss = 100.0 * s.executed / executed, 100.0 * s.samples / samples
        if si < min_share and ss < min_share:
            continue
        top = ", ".join(f"{op} {n / warps:.0f}" if warps else f"{op} {n:.0f}"
                        for op, n in s.opcodes.most_common(5))
        lines.append(f"  rows {s.first:5d}-{s.last:5d}  {si:5.1f} / {ss:5.1f}  {top}  | {s.ends_with or 'end'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--min-share", type=float, default=1.0)
    a = ap.parse_args(argv)
    with open(a.csv, encoding="utf-8") as fh:
        print(report(fh.read(), a.warps, a.min_share))


if __name__ == "__main__":
    main()

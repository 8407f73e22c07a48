"""Where the tensor-core stage 1 spends a chunk's time, phase by phase, by the SM's cycle counter.

    python3 -m cula.kernels.sm90.kda_fwd_clock [--B 2 --T 16384 --H 64] [--dist uniform --n 20] [--one-cta]
        [--diag no_qg_kgt]

Runs stage 1 alone with the `kda` suite's flags under the ``clock`` diagnostic (``CULA_KDA_TC_DIAG=clock``;
``--one-cta`` adds ``one_cta``: one CTA per SM instead of two; ``--diag`` adds other timing diagnostics, e.g.
``no_qg_kgt``, to see which phases shrink without that work). Thread 0 of every CTA reads ``%clock`` right
after each phase's CTA barrier (``STAMP_NAMES``) and stores the stamps and its SM id. Printed:
- per phase, the cycles since the stamp before it over the chunks (p10, median, p90) and the median's share of
  a chunk's median life: a phase that ends in a barrier includes the wait for its slowest warp;
- per SM, how the CTAs shared it: the time-weighted number resident, the share of a CTA's life spent beside
  another CTA, and the cycles between one CTA's end and the next one's start there;
- whether the CTAs of an SM run in step: through what share of a CTA's wait for its loads another CTA there works
  or waits too, and how far apart (as a share of the median life) CTAs start from the one already resident.

Two cautions. The stamps cost ~60 instructions and change ptxas's schedule a little (session 24: 208 registers
instead of 225 at two CTAs an SM), so the device step also times the clock build against the default
(``device_round.sh clock``). And the counter is per SM: stamps of CTAs on different SMs are not comparable, only
their differences. The kernel keeps the counter's low 32 bits (since session 38: with 64-bit stamps the three-CTA
build spilled); :func:`unwrap` restores them per SM. The build is the default one (three CTAs an SM, packed where
the default packs) plus the stamps.
"""

from __future__ import annotations

import argparse

import numpy as np

#: the stamps' slots (kda_fwd_intra_tc stamps them in this order; slot CLOCK_SLOTS - 1 holds the SM id)
STAMP_NAMES = ("entry", "tma_wait", "phase1", "column_pass", "phase2", "b_prime", "wgmma_wait", "wgmma_bar",
               "combine", "inv_diag", "inv_step2", "inverse", "t_prime", "phase5", "phase6", "end")
#: what each span (the cycles up to its stamp from the one before) covers
SPAN_WHAT = {
    "tma_wait": "TMA issued, L2 prefetch, beta; the wait for q, k, g (none without TMA)",
    "phase1": "rows read back, l2 sums, gate, in-thread cumsum, group totals",
    "column_pass": "group prefixes, pair factors",
    "phase2": "factors, operand tiles, qg / kgT / gamma stores",
    "b_prime": "B' scaling pass (16-row factor blocks)",
    "wgmma_wait": "Akk / Aqk products issued and waited for",
    "wgmma_bar": "barrier after the products",
    "combine": "Akk beta to smem, Aqk staged and stored",
    "inv_diag": "inverse: 16x16 diagonal blocks",
    "inv_step2": "inverse: T_10, T_32",
    "inverse": "inverse: lower-left 32x32 (wgmma)",
    "t_prime": "T' formed, its store issued",
    "phase5": "w = T'X product",
    "phase6": "w staged",
    "end": "w store issued, smem read out",
}


def unwrap(raw: np.ndarray) -> np.ndarray:
    """int64 stamps from the kernel's int32 slots [chunks, CLOCK_SLOTS] (the low 32 bits of each SM's counter;
    the last slot is the SM id, kept). Per SM, each stamp is taken as the one nearest the SM's first stamp
    modulo 2^32: exact while an SM's stamps span less than 2^31 cycles (~1 s), which one launch does."""
    raw = np.asarray(raw)
    out = raw.astype(np.int64)
    if raw.size == 0:
        return out
    low = raw[:, :-1].astype(np.int64) & 0xFFFFFFFF
    sm = raw[:, -1]
    for s in np.unique(sm):
        rows = sm == s
        ref = low[rows][0, 0]
        d = (low[rows] - ref) & 0xFFFFFFFF
        out[rows, :-1] = ref + np.where(d >= 1 << 31, d - (1 << 32), d)
    return out


def phase_rows(stamps: np.ndarray) -> list[tuple[str, float, float, float, float]]:
    """(span, p10, median, p90 cycles, median's share of the median life) per span, and a last row "life"
    (entry to end). ``stamps``: int64 [chunks, >= len(STAMP_NAMES)], one row per real chunk."""
    s = np.asarray(stamps, dtype=np.int64)[:, :len(STAMP_NAMES)]
    life = s[:, -1] - s[:, 0]
    med_life = float(np.median(life))
    rows = []
    for k in range(1, len(STAMP_NAMES)):
        d = s[:, k] - s[:, k - 1]
        p10, p50, p90 = np.percentile(d, [10, 50, 90])
        rows.append((STAMP_NAMES[k], float(p10), float(p50), float(p90), float(p50) / med_life if med_life else 0.0))
    p10, p50, p90 = np.percentile(life, [10, 50, 90])
    rows.append(("life", float(p10), float(p50), float(p90), 1.0))
    return rows


def sm_sharing(entry: np.ndarray, end: np.ndarray, sm: np.ndarray) -> dict[str, float]:
    """How the CTAs shared their SMs, from each CTA's [entry, end) cycles and SM id:
    ``resident``: CTAs resident on an SM, time-weighted over its busy span (first entry to last end);
    ``shared``: the share of a CTA's life (summed over CTAs) with at least one other CTA on its SM;
    ``gap_median``: median cycles from a CTA's end to the next start on its SM (the next CTA's launch; only
    ends followed by a start); ``idle``: share of the SMs' busy spans with no CTA resident."""
    entry, end, sm = (np.asarray(x, dtype=np.int64) for x in (entry, end, sm))
    weighted = span_total = shared = life_total = idle = 0
    gaps: list[int] = []
    for s in np.unique(sm):
        a, b = entry[sm == s], end[sm == s]
        # sweep: +1 at each entry, -1 at each end (ends first at equal times)
        ev = np.concatenate([np.stack([a, np.ones_like(a)], 1), np.stack([b, -np.ones_like(b)], 1)])
        ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]
        t, n = ev[:, 0], np.cumsum(ev[:, 1])
        dt = np.diff(t)
        weighted += int(np.sum(n[:-1] * dt))
        idle += int(np.sum(dt[n[:-1] == 0]))
        span_total += int(t[-1] - t[0])
        shared += int(np.sum(dt[n[:-1] >= 2] * n[:-1][n[:-1] >= 2]))  # CTA-cycles with company
        life_total += int(np.sum(b - a))
        starts = np.sort(a)
        for e in b:
            later = starts[starts >= e]
            if later.size:
                gaps.append(int(later[0] - e))
    return {"resident": weighted / span_total if span_total else 0.0,
            "shared": shared / life_total if life_total else 0.0,
            "gap_median": float(np.median(gaps)) if gaps else float("nan"),
            "idle": idle / span_total if span_total else 0.0}


def wait_company(entry: np.ndarray, wait_end: np.ndarray, end: np.ndarray, sm: np.ndarray) -> dict[str, object]:
    """Whether an SM's CTAs run in step, from each CTA's entry, the end of its wait for its loads (the
    ``tma_wait`` stamp) and its end, and its SM id. ``work`` / ``wait``: the share of the CTAs' summed wait cycles
    during which other CTAs on the SM work / wait as well (summed over those others: 1.0 for one companion
    throughout); ``offset``: p10, p25, p50, p75, p90 of (a CTA's entry − the entry of each CTA resident when it
    starts) over the median life (0.5 for two CTAs half a life apart; near 0 or 1 in step)."""
    entry, wait_end, end, sm = (np.asarray(x, dtype=np.int64) for x in (entry, wait_end, end, sm))
    life = float(np.median(end - entry))
    total = work = wait = 0
    offsets: list[float] = []
    for s in np.unique(sm):
        idx = np.flatnonzero(sm == s)
        for i in idx:
            a, b = entry[i], wait_end[i]
            others = idx[(idx != i) & (entry[idx] < max(b, a + 1)) & (end[idx] > a)]
            total += max(b - a, 0)
            for j in others:
                wait += max(0, min(b, wait_end[j]) - max(a, entry[j]))
                work += max(0, min(b, end[j]) - max(a, wait_end[j]))
                if entry[j] <= a and life:
                    offsets.append((a - entry[j]) / life)
    pct = np.percentile(offsets, [10, 25, 50, 75, 90]) if offsets else np.full(5, np.nan)
    return {"work": work / total if total else 0.0, "wait": wait / total if total else 0.0,
            "offset": tuple(float(x) for x in pct)}


def report(stamps: np.ndarray, sm: np.ndarray, label: str) -> str:
    """The printed tables (lines start with ``[clock]``)."""
    out = [f"[clock] {label}: {len(stamps)} chunks on {len(np.unique(sm))} SMs (cycles)",
           f"[clock] {'span':<12} {'p10':>8} {'median':>8} {'p90':>8} {'share':>6}  what"]
    for name, p10, p50, p90, share in phase_rows(stamps):
        out.append(f"[clock] {name:<12} {p10:8.0f} {p50:8.0f} {p90:8.0f} {share:6.1%}  {SPAN_WHAT.get(name, '')}")
    sh = sm_sharing(stamps[:, 0], stamps[:, len(STAMP_NAMES) - 1], sm)
    out.append(f"[clock] per SM: {sh['resident']:.2f} CTAs resident, {sh['shared']:.1%} of CTA life beside another, "
               f"{sh['idle']:.1%} idle, {sh['gap_median']:.0f} cycles from an end to the next start")
    wc = wait_company(stamps[:, 0], stamps[:, STAMP_NAMES.index("tma_wait")], stamps[:, len(STAMP_NAMES) - 1], sm)
    out.append(f"[clock] in step?: while a CTA waits for its loads the others on its SM work {wc['work']:.1%} and "
               f"wait {wc['wait']:.1%} of it; start offsets (share of a life, p10/25/50/75/90) "
               + " / ".join(f"{x:.2f}" for x in wc["offset"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--dist", default=None, help="varlen: uniform, random or skewed lengths (B = 1)")
    ap.add_argument("--n", type=int, default=20, help="varlen: number of sequences")
    ap.add_argument("--one-cta", action="store_true", help="one CTA per SM (the one_cta diagnostic) as well")
    ap.add_argument("--diag", default="", help="more kda_fwd_intra_tc diagnostics, comma-separated (timing only)")
    a = ap.parse_args(argv)

    import torch

    from cula.kernels.sm90 import kda_fwd
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90.kda_fwd_profile import suite_call

    intra_tc.DIAG = ("clock", *(("one_cta",) if a.one_cta else ()), *(d for d in a.diag.split(",") if d))
    args, kw = suite_call(a.B, a.T, a.H, a.dist, a.n)
    for _ in range(3):  # the first compiles (or loads the AOT module); the last one's stamps are read
        kda_fwd.kda_fwd(*args, **kw, stages=("intra",))
    torch.cuda.synchronize()
    clocks, chunks = kda_fwd.LAST_CLOCKS
    real = (chunks[:, 1] > 0).cpu().numpy()
    stamps = unwrap(clocks.cpu().numpy()[:, real, :].reshape(-1, clocks.shape[-1]))
    label = (f"B{args[0].shape[0]} T{a.T} H{a.H}" + (f" {a.dist} n{a.n}" if a.dist else "")
             + (", one CTA per SM" if a.one_cta else "") + (f", {a.diag}" if a.diag else ""))
    print(report(stamps, stamps[:, -1], label), flush=True)


if __name__ == "__main__":
    main()

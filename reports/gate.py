"""The regression gate: compare a candidate run with a baseline run, config by config.

For every (config, impl) of the baseline (impls selected by ``--impl``, default ``cula``):

- **missing**: the candidate has no row for it -> regression;
- **changed**: the config's definition (shape, flags, lengths) differs -> regression (re-baseline);
- **failed** / **error**: the candidate's row failed its correctness check or raised -> regression;
- otherwise the times are compared: ``change = candidate / baseline - 1`` of the median, and the
  allowed slowdown is ``max(threshold, noise_k * sqrt(s_b^2 + s_c^2))`` where ``s`` is each run's
  relative half p20-p80 spread - so a noisy config needs a larger move to count. Defaults:
  ``threshold = 5 %``, ``noise_k = 2``, metric = the eager median. ``change > allowed`` is a
  **regression**, ``change < -allowed`` an **improvement**, anything else **ok**.

Exit codes: 0 pass, 1 regression, 2 unusable data (unknown or unreadable run, runs on different GPU
types, nothing in common to compare).
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cula.bench.schema import ERROR, FAIL, OK, UNAVAILABLE, Row, spread_rel
from cula.bench.store import CorruptPartError, RunData, Store, StoreError
from cula.reports.data import RESULTS_DIR, ReportError

PASS, REGRESSION, UNUSABLE = 0, 1, 2
DEFAULT_THRESHOLD = 0.05
DEFAULT_NOISE_K = 2.0


@dataclass(frozen=True)
class GateOptions:
    threshold: float = DEFAULT_THRESHOLD
    noise_k: float = DEFAULT_NOISE_K
    metric: str = "eager"            # eager | graph | both
    impls: tuple[str, ...] = ("cula",)


@dataclass
class Change:
    config_id: str
    impl: str
    metric: str
    verdict: str                     # regression | improved | ok | missing | changed | failed | error | new
    base_ms: float = math.nan
    cand_ms: float = math.nan
    change: float = math.nan
    allowed: float = math.nan
    note: str = ""

    @property
    def is_regression(self) -> bool:
        return self.verdict in ("regression", "missing", "changed", "failed", "error")


@dataclass
class GateResult:
    code: int
    message: str
    changes: list[Change] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.changes:
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return out


def _metrics(metric: str) -> list[str]:
    if metric not in ("eager", "graph", "both"):
        raise ReportError(f"--metric: expected eager, graph or both, got {metric!r}")
    return ["eager", "graph"] if metric == "both" else [metric]


def _times(r: Row, metric: str) -> tuple[float, float]:
    if metric == "eager":
        return r.eager_ms, spread_rel(r.eager_ms, r.eager_p20_ms, r.eager_p80_ms)
    return r.graph_ms, spread_rel(r.graph_ms, r.graph_p20_ms, r.graph_p80_ms)


def compare_runs(base: RunData, cand: RunData, opts: GateOptions = GateOptions()) -> GateResult:
    """Compare two runs; see the module docstring for the rules."""
    metrics = _metrics(opts.metric)
    if not base.rows:
        return GateResult(UNUSABLE, f"baseline {base.run_id} has no rows")
    if not cand.rows:
        return GateResult(UNUSABLE, f"candidate {cand.run_id} has no rows")
    gb = sorted({r.gpu_name for r in base.rows})
    gc = sorted({r.gpu_name for r in cand.rows})
    if gb != gc or len(gb) != 1:
        return GateResult(UNUSABLE, f"runs are on different GPU types: baseline {', '.join(gb)}, "
                                    f"candidate {', '.join(gc)}")
    brows = {(r.config_id, r.impl): r for r in base.rows if r.impl in opts.impls}
    crows = {(r.config_id, r.impl): r for r in cand.rows if r.impl in opts.impls}
    if not brows:
        return GateResult(UNUSABLE, f"baseline {base.run_id} has no rows for impl(s) {', '.join(opts.impls)}")
    if not set(brows) & set(crows):
        return GateResult(UNUSABLE, f"no (config, impl) in common between {base.run_id} and {cand.run_id} "
                                    f"for impl(s) {', '.join(opts.impls)}")
    changes: list[Change] = []
    order = sorted(brows, key=lambda k: (brows[k].suite, brows[k].config_index, k[1]))
    for key in order:
        b = brows[key]
        c = crows.get(key)
        cid, impl = key
        if c is None:
            changes.append(Change(cid, impl, "-", "missing", note="no row in the candidate"))
            continue
        if c.config_hash != b.config_hash:
            changes.append(Change(cid, impl, "-", "changed", note="config definition differs; re-baseline"))
            continue
        if b.status in (ERROR, UNAVAILABLE) and c.status in (ERROR, UNAVAILABLE):
            continue  # never ran in either: nothing to compare
        if c.status in (ERROR, UNAVAILABLE):
            changes.append(Change(cid, impl, "-", "error", note=f"{c.status}: {c.note}"[:200]))
            continue
        if c.status == FAIL:
            changes.append(Change(cid, impl, "-", "failed", note=c.note[:200]))
            continue
        for m in metrics:
            bt, bs = _times(b, m)
            ct, cs = _times(c, m)
            if math.isnan(bt) or b.status != OK:
                if not math.isnan(ct):
                    changes.append(Change(cid, impl, m, "new", math.nan, ct, note="no baseline time"))
                continue
            if math.isnan(ct):
                changes.append(Change(cid, impl, m, "regression", bt, ct,
                                      note=f"no candidate time ({c.graph_note if m == 'graph' else 'not measured'})"))
                continue
            noise = math.sqrt((0 if math.isnan(bs) else bs) ** 2 + (0 if math.isnan(cs) else cs) ** 2)
            allowed = max(opts.threshold, opts.noise_k * noise)
            change = ct / bt - 1.0
            verdict = "regression" if change > allowed else "improved" if change < -allowed else "ok"
            changes.append(Change(cid, impl, m, verdict, bt, ct, change, allowed))
    for key in sorted(set(crows) - set(brows)):
        changes.append(Change(key[0], key[1], "-", "new", note="not in the baseline"))
    bad = [c for c in changes if c.is_regression]
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    if bad:
        return GateResult(REGRESSION, f"REGRESSION: {len(bad)} of {len(order)} baseline rows ({summary})", changes)
    return GateResult(PASS, f"pass: {len(order)} baseline rows compared ({summary})", changes)


def committed_runs(results_dir: Path) -> list[str]:
    """Run ids whose files are tracked by git under ``results_dir`` (oldest first)."""
    try:
        out = subprocess.run(["git", "-C", str(results_dir), "ls-files", "."], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    ids = set()
    for line in out.stdout.splitlines():
        first = line.split("/")[0]
        if first.endswith(".parquet"):
            ids.add(first[: -len(".parquet")])
        elif "/" in line:
            ids.add(first)
    return sorted(ids)


def load_run(store: Store, run_id: str, skip_corrupt: bool = False) -> RunData:
    try:
        return store.read_run(run_id, skip_corrupt=skip_corrupt)
    except CorruptPartError as exc:
        raise ReportError(f"{exc} (pass --skip-corrupt to gate without it)") from None
    except StoreError as exc:
        raise ReportError(str(exc)) from None


def resolve_runs(baseline: str | None, candidate: str | None, results_dir: Path | None = None,
                 skip_corrupt: bool = False) -> tuple[RunData, RunData]:
    """Load the two runs. Defaults: candidate = the newest stored run; baseline = the newest
    git-committed run on the same GPU other than the candidate."""
    store = Store(results_dir or RESULTS_DIR)
    if candidate is None:
        runs = store.list_runs()
        if not runs:
            raise ReportError(f"no runs stored in {store.root}")
        candidate = runs[-1]
    cand_id = candidate
    cand = load_run(store, cand_id, skip_corrupt)
    if baseline is None:
        gpu = {r.gpu_name for r in cand.rows}
        picked = None
        for rid in reversed(committed_runs(store.root)):
            if rid == cand_id or not store.exists(rid):
                continue
            data = load_run(store, rid, skip_corrupt)
            if {r.gpu_name for r in data.rows} == gpu:
                picked = data
                break
        if picked is None:
            raise ReportError(f"no committed baseline run on {', '.join(sorted(gpu)) or '?'} in {store.root}; "
                              "pass --baseline RUN_ID")
        return picked, cand
    return load_run(store, baseline, skip_corrupt), cand

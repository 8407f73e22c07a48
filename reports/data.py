"""Load stored runs for the report and the gate, and pick the rows one published file shows.

Reads only the store and its schema (:mod:`cula.bench.store`, :mod:`cula.bench.schema`).
A published file covers one GPU kind (``H200``, ``GB200``, ``H100``): it takes CUDA rows whose GPU name
contains that kind - CPU runs (the smoke grid) never qualify - and, per suite, the rows of the
most recent run holding that suite, so one table never mixes runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cula.bench.schema import Row
from cula.bench.store import CorruptPartError, RunData, Store, StoreError

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "reports" / "results"

# Published files: GPU kind -> path from the repository root. The H100 file lives under reports/ (the top
# level keeps the two files the project publishes); the device lends H100s far more often than H200s, and an
# H100 run's rows would otherwise stay unread parquet.
TARGETS: dict[str, str] = {
    "H200": "BENCHMARK_H200.md",
    "GB200": "BENCHMARK_GB200.md",
    "H100": "reports/BENCHMARK_H100.md",
}


class ReportError(Exception):
    """The stored data cannot be reported (corrupt part, mixed GPUs, unknown run): exit code 2."""


@dataclass
class SuiteRows:
    """Rows of one suite from one run."""

    suite: str
    run_id: str
    rows: list[Row]


@dataclass
class Selection:
    """What one published file shows: per-suite rows and the runs they come from."""

    gpu_kind: str
    suites: list[SuiteRows] = field(default_factory=list)
    runs: dict[str, RunData] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.suites


def load_runs(results_dir: Path | None = None, run_ids: list[str] | None = None,
              skip_corrupt: bool = False) -> tuple[list[RunData], list[str]]:
    """(runs, skipped files) from the store; CorruptPartError becomes ReportError unless skipped."""
    store = Store(results_dir or RESULTS_DIR)
    ids = run_ids if run_ids else store.list_runs()
    runs: list[RunData] = []
    skipped: list[str] = []
    for rid in ids:
        try:
            data = store.read_run(rid, skip_corrupt=skip_corrupt)
        except CorruptPartError as exc:
            raise ReportError(f"{exc} (pass --skip-corrupt to report without it)") from None
        except StoreError as exc:
            raise ReportError(str(exc)) from None
        skipped.extend(data.skipped)
        if data.rows:
            runs.append(data)
    return runs, skipped


def matches(row: Row, gpu_kind: str) -> bool:
    return row.device_kind == "cuda" and gpu_kind.upper() in row.gpu_name.upper()


def run_gpu(run: RunData) -> str:
    names = sorted({r.gpu_name for r in run.rows})
    return names[0] if len(names) == 1 else " + ".join(names)


def select(runs: list[RunData], gpu_kind: str, explicit: bool = False) -> Selection:
    """Rows for the ``gpu_kind`` file. ``explicit``: the runs were named by the user, so a run on
    another GPU is an error rather than silently left out."""
    sel = Selection(gpu_kind=gpu_kind)
    candidates: list[RunData] = []
    for run in runs:
        rows = [r for r in run.rows if matches(r, gpu_kind)]
        if explicit and len(rows) != len(run.rows):
            other = sorted({r.gpu_name for r in run.rows if not matches(r, gpu_kind)})
            raise ReportError(f"run {run.run_id} has rows from {', '.join(other)}, not a {gpu_kind}")
        if rows:
            candidates.append(RunData(run.run_id, rows, run.meta, run.skipped))
    # Latest run per suite (run ids start with the UTC start time; run_started breaks nothing).
    latest: dict[str, RunData] = {}
    for run in sorted(candidates, key=lambda r: (max(x.run_started for x in r.rows), r.run_id)):
        for suite in {r.suite for r in run.rows}:
            latest[suite] = run
    for suite in sorted(latest, key=_suite_order):
        run = latest[suite]
        rows = sorted((r for r in run.rows if r.suite == suite), key=lambda r: (r.config_index, r.impl))
        sel.suites.append(SuiteRows(suite, run.run_id, rows))
        sel.runs[run.run_id] = run
    gpus = sorted({r.gpu_name for s in sel.suites for r in s.rows})
    if len(gpus) > 1:
        where = {g: sorted({s.run_id for s in sel.suites for r in s.rows if r.gpu_name == g}) for g in gpus}
        desc = "; ".join(f"{g!r} in {', '.join(ids)}" for g, ids in where.items())
        raise ReportError(f"mixed GPU types in one {gpu_kind} report: {desc}; choose runs with --run")
    return sel


_ORDER = ("kda", "kda_layer", "kda_exact", "kda_train", "lightning", "decode", "gdn", "gla", "train", "smoke")


def _suite_order(name: str) -> tuple[int, str]:
    return (_ORDER.index(name) if name in _ORDER else len(_ORDER), name)

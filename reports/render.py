"""Render BENCHMARK_<GPU>.md (and its speedup chart) from stored runs with the jinja2 templates.

The markdown depends only on the stored rows - no clock, no host - so ``cula report --check`` can
re-render it and compare byte for byte with the committed file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from cula.bench.fingerprint import without_labels
from cula.bench.schema import ERROR, FAIL, OK, UNAVAILABLE, Row
from cula.reports.data import REPO_ROOT, TARGETS, ReportError, Selection

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
IMPL_ORDER = ("fla", "cula", "flashkda", "ref")
BASELINE = "fla"
PRIMARY = "cula"
_KEY_FIELDS = ("variant", "phase", "state", "B", "T", "H", "HV", "K", "V", "dtype")
_KEY_LABEL = {"state": "state", "variant": "variant", "phase": "phase", "dtype": "dtype"}


def fmt_ms(ms: float) -> str:
    if ms is None or math.isnan(ms):
        return "-"
    if ms < 0.1:
        return f"{ms:.4f}"
    if ms < 10:
        return f"{ms:.3f}"
    if ms < 1000:
        return f"{ms:.2f}"
    return f"{ms:.1f}"


def fmt_x(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


def fmt_err(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1e}"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    align: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        align = self.align or ["r"] * len(self.headers)
        sep = ["---:" if a == "r" else ":---" for a in align]
        lines = ["| " + " | ".join(self.headers) + " |", "| " + " | ".join(sep) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def _cell(row: Row | None, attr: str = "eager_ms") -> str:
    if row is None:
        return ""
    if row.status == UNAVAILABLE:
        return "n/a"
    if row.status == ERROR:
        return "error"
    text = fmt_ms(getattr(row, attr))
    if row.status == FAIL:
        text += " ⚠"
    if row.impl == PRIMARY and row.backend and row.backend != "cula-sm90" and text != "-":
        text += " †"
    return text


def _speedup(base: Row | None, cand: Row | None, attr: str) -> float:
    if base is None or cand is None:
        return math.nan
    b, c = getattr(base, attr), getattr(cand, attr)
    if not (b > 0 and c > 0):
        return math.nan
    return b / c


def _usable(r: Row | None) -> bool:
    return r is not None and r.status == OK


def _key_columns(rows: list[Row], mode: str) -> list[str]:
    """Config fields that vary within the table (plus B and T for fixed prefill tables)."""
    cols = []
    for f in _KEY_FIELDS:
        if len({getattr(r, f) for r in rows}) > 1:
            cols.append(f)
    if "HV" in cols and all(r.HV == r.H for r in rows):
        cols.remove("HV")  # HV only moves with H: one column says it
    if mode == "fixed":
        always = ("B",) if all(r.phase == "decode" for r in rows) else ("B", "T")
        cols += [f for f in always if f not in cols]
        cols = [c for c in _KEY_FIELDS if c in cols]
    else:
        cols = [c for c in cols if c not in ("B", "T")]
    return cols


def _key_value(r: Row, f: str) -> str:
    v = getattr(r, f)
    if f == "state":
        return "yes" if v else "no"
    return str(v)


@dataclass
class SuiteView:
    name: str
    description: str
    run_id: str
    impls: list[str]
    fixed: Table | None
    varlen: Table | None
    summary: Table | None
    roofline: Table | None
    failures: list[str]
    backends: list[str]
    chart_data: list[tuple[str, dict[str, float]]]


def _group(rows: list[Row]) -> list[tuple[int, dict[str, Row]]]:
    by_cfg: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_cfg.setdefault(r.config_index, {})[r.impl] = r
    return sorted(by_cfg.items())


def _suite_view(name: str, run_id: str, rows: list[Row]) -> SuiteView:
    from cula.suites import SuiteError, load_suite

    try:
        description = load_suite(name).description
    except SuiteError:
        description = ""
    present = {r.impl for r in rows}
    impls = [i for i in IMPL_ORDER if i in present] + sorted(present - set(IMPL_ORDER))
    others = [i for i in impls if i != BASELINE]
    has_pair = BASELINE in present and PRIMARY in present
    groups = _group(rows)
    tables: dict[str, Table | None] = {}
    chart: list[tuple[str, dict[str, float]]] = []
    speedups: dict[tuple[str, str, str], list[float]] = {}
    for mode in ("fixed", "varlen"):
        mode_groups = [(i, g) for i, g in groups if next(iter(g.values())).mode == mode]
        if not mode_groups:
            tables[mode] = None
            continue
        mode_rows = [r for _, g in mode_groups for r in g.values()]
        keys = _key_columns(mode_rows, mode)
        headers = [_KEY_LABEL.get(k, k) for k in keys]
        if mode == "varlen":
            headers += ["dist", "seqs", "T", "len min", "len max", "len avg"]
        # Baseline and cula first with their speedup, then the other impls; same for graph times.
        lead = [i for i in (BASELINE, PRIMARY) if i in present]
        rest = [i for i in impls if i not in lead]
        graph_rest = [i for i in rest if i != "ref"]
        headers += [f"{i} ms" for i in lead] + (["speedup"] if has_pair else []) + [f"{i} ms" for i in rest]
        headers += [f"{i} graph ms" for i in lead] + (["graph speedup"] if has_pair else [])
        headers += [f"{i} graph ms" for i in graph_rest]
        body = []
        for _, g in mode_groups:
            first = next(iter(g.values()))
            cells = [_key_value(first, k) for k in keys]
            if mode == "varlen":
                cells += [first.dist, str(first.n_seqs), str(first.T), str(first.len_min),
                          str(first.len_max), f"{first.len_avg:.0f}"]
            cells += [_cell(g.get(i)) for i in lead]
            if has_pair:
                cells.append(fmt_x(_speedup(g.get(BASELINE), g.get(PRIMARY), "eager_ms")))
            cells += [_cell(g.get(i)) for i in rest]
            cells += [_cell(g.get(i), "graph_ms") for i in lead]
            if has_pair:
                cells.append(fmt_x(_speedup(g.get(BASELINE), g.get(PRIMARY), "graph_ms")))
            cells += [_cell(g.get(i), "graph_ms") for i in graph_rest]
            body.append(cells)
            label = _chart_label(first, mode)
            sp = {}
            for o in others:
                base, cand = g.get(BASELINE), g.get(o)
                for attr, timing in (("eager_ms", "eager"), ("graph_ms", "graph")):
                    x = _speedup(base, cand, attr)
                    if _usable(base) and _usable(cand) and not math.isnan(x):
                        speedups.setdefault((o, mode, timing), []).append(x)
                        if timing == "eager":
                            sp[o] = x
            chart.append((label, sp))
        n_left = len(keys) + (1 if mode == "varlen" else 0)
        align = ["l"] * n_left + ["r"] * (len(headers) - n_left)
        tables[mode] = Table(headers, body, align)
    if any(k != "ref" for _, sp in chart for k in sp):
        for _, sp in chart:  # the torch reference only squashes the scale when a kernel is charted
            sp.pop("ref", None)
    summary_rows = []
    for (impl, mode, timing), xs in sorted(speedups.items(), key=lambda kv: (impls.index(kv[0][0]), kv[0][1], kv[0][2])):
        summary_rows.append([f"{impl} vs {BASELINE}", mode, timing, str(len(xs)), fmt_x(sum(xs) / len(xs)),
                             fmt_x(geomean(xs)), fmt_x(min(xs)), fmt_x(max(xs))])
    summary = Table(["comparison", "mode", "timing", "configs", "avg", "geomean", "min", "max"],
                    summary_rows, ["l", "l", "l", "r", "r", "r", "r", "r"]) if summary_rows else None
    roofline = _roofline(groups, impls)
    failures = []
    for _, g in groups:
        for i in impls:
            r = g.get(i)
            if r is not None and r.status in (FAIL, ERROR):
                failures.append(f"`{r.config_id}` {i}: **{r.status}** - {r.note or 'no detail'}")
    backends = []
    for i in impls:
        counts: dict[str, int] = {}
        for _, g in groups:
            r = g.get(i)
            if r is not None and r.status in (OK, FAIL):
                counts[r.backend or "?"] = counts.get(r.backend or "?", 0) + 1
        if counts:
            backends.append(f"{i}: " + ", ".join(f"{b} ({n})" for b, n in sorted(counts.items())))
    unavailable: dict[str, set[str]] = {}
    for _, g in groups:
        for i, r in g.items():
            if r.status == UNAVAILABLE:
                unavailable.setdefault(i, set()).add(r.note)
    for i, notes in sorted(unavailable.items()):
        backends.append(f"{i}: not run on some configs - " + "; ".join(sorted(notes))[:400])
    return SuiteView(name, description, run_id, impls, tables["fixed"], tables["varlen"], summary,
                     roofline, failures, backends, chart)


def _chart_label(r: Row, mode: str) -> str:
    if mode == "varlen":
        return f"{r.dist[:4]} n{r.n_seqs} T{r.T}"
    parts = []
    if r.phase == "decode":
        parts += [r.variant, f"B{r.B}", f"H{r.H}"]
    else:
        if r.suite in ("train",):
            parts.append(r.variant)
        parts += [f"B{r.B}", f"T{r.T}"]
        if r.variant == "lightning" and r.suite == "lightning":
            parts.append("s" if r.state else "-")
    return " ".join(parts)


def _roofline(groups: list[tuple[int, dict[str, Row]]], impls: list[str]) -> Table | None:
    shown = [i for i in impls if i != "ref"]
    if not shown:
        return None
    headers = ["config"] + [f"{i} TB/s (% copy)" for i in shown] + [f"{i} TFLOP/s (% mm)" for i in shown]
    body = []
    for _, g in groups:
        first = next(iter(g.values()))
        cells = [f"`{_chart_label(first, first.mode)}`"]
        for attr, pct in (("tbps", "pct_bw"), ("tflops", "pct_flops")):
            for i in shown:
                r = g.get(i)
                if r is None or r.status not in (OK, FAIL) or math.isnan(getattr(r, attr)):
                    cells.append("-")
                else:
                    p = getattr(r, pct)
                    cells.append(f"{getattr(r, attr):.3g} ({p:.0f}%)" if not math.isnan(p) else f"{getattr(r, attr):.3g}")
        body.append(cells)
    return Table(headers, body, ["l"] + ["r"] * (len(headers) - 1))


def _run_header(run_rows: list[Row], status: str) -> dict[str, Any]:
    r = max(run_rows, key=lambda x: x.date)
    settings = json.loads(r.settings_json or "{}")
    return {
        "run_id": r.run_id, "started": r.run_started, "gpu": r.gpu_name, "sm": r.sm_count,
        "driver": r.driver, "cuda": r.cuda, "torch": r.torch, "triton": r.triton, "dsl": r.dsl,
        "fla": r.fla, "python": r.python, "sha": r.cula_sha, "dirty": r.cula_dirty,
        "host": r.host_hash, "command": without_labels(r.command), "ceil_tbps": f"{r.ceil_tbps:.2f}",
        "ceil_tflops": f"{r.ceil_tflops:.0f}", "settings": settings,
        "suites": sorted({x.suite for x in run_rows}), "rows": len(run_rows), "status": status,
    }


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=False,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                              undefined=jinja2.StrictUndefined)


def chart_name(gpu_kind: str) -> str:
    return f"BENCHMARK_{gpu_kind}_speedup.png"


def render(sel: Selection, chart_file: str | None = None) -> str:
    """Markdown of one published file (``chart_file``: the PNG name to link, if one is drawn)."""
    if sel.empty:
        return _env().get_template("no_run.md.j2").render(gpu=sel.gpu_kind, file=TARGETS.get(sel.gpu_kind, ""))
    from cula.reports.cp_view import CP_SUITES, cp_view

    views = [_suite_view(s.suite, s.run_id, s.rows) for s in sel.suites if s.suite not in CP_SUITES]
    cp_rows = {name: [r for s in sel.suites if s.suite == name for r in s.rows] for name in CP_SUITES}
    cp = cp_view(cp_rows["cp_scaling"], cp_rows["cp_check"]) if any(cp_rows.values()) else None
    runs = []
    for run_id in sorted(sel.runs):
        rows = [r for s in sel.suites if s.run_id == run_id for r in s.rows]
        runs.append(_run_header(rows, str(sel.runs[run_id].meta.get("status", "unknown"))))
    flagged = sum(len(v.failures) for v in views) + (len(cp.failures) if cp else 0)
    return _env().get_template("benchmark.md.j2").render(
        gpu=sel.gpu_kind, gpu_name=runs[0]["gpu"], runs=runs, suites=views, chart=chart_file,
        flagged=flagged, baseline=BASELINE, primary=PRIMARY, cp=cp)


def chart_series(sel: Selection) -> list[tuple[str, list[tuple[str, dict[str, float]]]]]:
    """Per suite: (config label, {impl: eager speedup over FLA}) for the chart."""
    from cula.reports.cp_view import CP_SUITES

    out = []
    for s in sel.suites:
        if s.suite in CP_SUITES:  # no FLA baseline in these rows: their speedup is over one GPU
            continue
        v = _suite_view(s.suite, s.run_id, s.rows)
        if any(sp for _, sp in v.chart_data):
            out.append((s.suite, v.chart_data))
    return out


def target_path(gpu_kind: str, root: Path = REPO_ROOT) -> Path:
    if gpu_kind not in TARGETS:
        raise ReportError(f"--gpu: expected one of {', '.join(TARGETS)}, got {gpu_kind!r}")
    return root / TARGETS[gpu_kind]


def write_report(sel: Selection, md_path: Path, draw_chart: bool = True) -> tuple[str, Path | None]:
    """Write the markdown (and its chart beside it when there is a speedup to draw)."""
    from cula.reports.chart import draw

    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    chart_path = md_path.with_name(md_path.stem + "_speedup.png")
    series = chart_series(sel) if not sel.empty else []
    drawn = None
    if draw_chart and series:
        draw(series, chart_path, title=f"Speedup over FLA (eager), {sel.gpu_kind}")
        drawn = chart_path
    text = render(sel, chart_path.name if series else None)
    md_path.write_text(text)
    return text, drawn

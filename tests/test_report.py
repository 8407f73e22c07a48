"""Rendering BENCHMARK_<GPU>.md from stored fixture runs; selection rules; --check."""

from __future__ import annotations

import re

import pytest

from bench_fixtures import H200, make_rows, store_run
from cula.reports.data import ReportError, load_runs, select
from cula.reports.render import fmt_ms, geomean, render, write_report

R1 = "20260101-000000-h200-abc1234-0001"
R2 = "20260201-000000-h200-abc1234-0002"


def _table(text: str, heading: str) -> list[list[str]]:
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start:end]]


def test_tables_speedups_and_summary(tmp_path):
    rows = make_rows(R1, impls=("fla", "cula", "ref"), scale={"cula": 0.8})
    store_run(tmp_path, R1, rows)
    runs, _ = load_runs(tmp_path)
    text = render(select(runs, "H200"))
    fixed = _table(text, "### Fixed length")
    assert fixed[0][:5] == ["B", "T", "fla ms", "cula ms", "speedup"]
    assert len(fixed) == 2 + 10
    by = {(r.config_index, r.impl): r for r in rows}
    for i, line in enumerate(fixed[2:]):
        expect = by[(i, "fla")].eager_ms / by[(i, "cula")].eager_ms
        assert line[4] == f"{expect:.2f}x"
        assert line[2] == fmt_ms(by[(i, "fla")].eager_ms)
    varlen = _table(text, "### Variable length")
    assert varlen[0][:6] == ["dist", "seqs", "T", "len min", "len max", "len avg"]
    assert len(varlen) == 2 + 18
    summary = _table(text, "### Summary")
    cula_fixed = [ln for ln in summary if ln[:3] == ["cula vs fla", "fixed", "eager"]][0]
    xs = [by[(i, "fla")].eager_ms / by[(i, "cula")].eager_ms for i in range(10)]
    assert cula_fixed[3] == "10"
    assert cula_fixed[4:] == [f"{sum(xs) / 10:.2f}x", f"{geomean(xs):.2f}x", f"{min(xs):.2f}x", f"{max(xs):.2f}x"]
    assert "NVIDIA H200" in text and "abc1234def" in text and "4.20 TB/s" in text
    assert "cula bench --suite kda --mode both --impl fla,cula,ref" in text
    assert "### Roofline" in text and "Flagged rows" not in text


def test_failed_rows_are_flagged_and_left_out_of_summaries(tmp_path):
    rows = make_rows(R1, fail={(0, "cula"), (1, "cula")}, unavailable={"ref"}, impls=("fla", "cula", "ref"))
    store_run(tmp_path, R1, rows)
    runs, _ = load_runs(tmp_path)
    text = render(select(runs, "H200"))
    fixed = _table(text, "### Fixed length")
    assert fixed[2][3].endswith("⚠") and fixed[3][3].endswith("⚠") and not fixed[4][3].endswith("⚠")
    assert "n/a" in fixed[2]
    assert "**2 row(s) failed" in text and text.count("**fail**") == 2
    summary = _table(text, "### Summary")
    assert [ln for ln in summary if ln[:3] == ["cula vs fla", "fixed", "eager"]][0][3] == "8"


def test_fallback_backend_is_marked(tmp_path):
    rows = make_rows(R1, limit=2)
    for r in rows:
        if r.impl == "cula":
            r.backend = "fla-triton"
    store_run(tmp_path, R1, rows)
    text = render(select(load_runs(tmp_path)[0], "H200"))
    assert "†" in _table(text, "### Fixed length")[2][3]
    assert "cula: fla-triton (2)" in text


def test_latest_run_per_suite_and_cpu_rows_excluded(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, scale={"cula": 2.0}, started="2026-01-01T00:00:00Z"))
    store_run(tmp_path, R2, make_rows(R2, started="2026-02-01T00:00:00Z"))
    cpu_id = "20260301-000000-cpu-abc1234-0003"
    cpu = dict(H200, device_kind="cpu", gpu_name="cpu (x86_64)")
    store_run(tmp_path, cpu_id, make_rows(cpu_id, suite="smoke", fingerprint=cpu, started="2026-03-01T00:00:00Z"))
    sel = select(load_runs(tmp_path)[0], "H200")
    assert [(s.suite, s.run_id) for s in sel.suites] == [("kda", R2)]
    text = render(sel)
    assert R1 not in text and cpu_id not in text and "smoke" not in text


def test_mixed_gpus_is_an_error(tmp_path):
    store_run(tmp_path, R1, make_rows(R1))
    nvl = dict(H200, gpu_name="NVIDIA H200 NVL")
    store_run(tmp_path, R2, make_rows(R2, suite="lightning", fingerprint=nvl, limit=3))
    with pytest.raises(ReportError, match="mixed GPU types.*NVIDIA H200 NVL"):
        select(load_runs(tmp_path)[0], "H200")


def test_explicit_run_of_other_gpu_is_an_error(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, fingerprint=dict(H200, gpu_name="NVIDIA GB200")))
    runs, _ = load_runs(tmp_path, [R1])
    with pytest.raises(ReportError, match="not a H200"):
        select(runs, "H200", explicit=True)
    assert select(runs, "GB200").suites[0].run_id == R1


def test_no_run_yet(tmp_path):
    text = render(select([], "GB200"))
    assert "No GB200 run is recorded yet" in text and "cula bench --suite kda" in text
    assert not re.search(r"\d+\.\d+ ?(ms|x|TB/s)", text)  # no numbers from anywhere


def test_corrupt_part_is_reported_or_skipped(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=2))
    (tmp_path / R1 / "part-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(ReportError, match="part-00001.parquet.*--skip-corrupt"):
        load_runs(tmp_path)
    runs, skipped = load_runs(tmp_path, skip_corrupt=True)
    assert len(skipped) == 1 and len(runs[0].rows) == 2


def test_render_is_deterministic_and_writes_chart(tmp_path):
    store_run(tmp_path / "s", R1, make_rows(R1))
    sel = select(load_runs(tmp_path / "s")[0], "H200")
    md = tmp_path / "BENCHMARK_H200.md"
    text, chart = write_report(sel, md)
    assert chart == tmp_path / "BENCHMARK_H200_speedup.png" and chart.stat().st_size > 1000
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![Speedup over FLA](BENCHMARK_H200_speedup.png)" in text
    assert md.read_text() == text == render(select(load_runs(tmp_path / "s")[0], "H200"), chart.name)


def test_incomplete_run_is_labelled(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=3), meta={"run_id": R1, "status": "interrupted"})
    text = render(select(load_runs(tmp_path)[0], "H200"))
    assert "run interrupted: not every config was measured" in text
    store_run(tmp_path / "b", R1, make_rows(R1, limit=3))
    assert "not every config" not in render(select(load_runs(tmp_path / "b")[0], "H200"))


def _cp_rows() -> list[dict]:
    """Rows as ``cula.cp.multigpu`` produces them: W = 1, 2 scaling for one variant and two checks."""
    rows = []
    for T, w1, w2, local in ((131072, 5.0, 4.0, 3.0), (262144, 10.0, 6.25, 5.5)):
        for w, ms in ((1, w1), (2, w2)):
            rows.append(dict(kind="scaling", variant="kda", world_size=w, T=T, times_ms=[ms] * 5, ms=ms,
                             us_per_token=ms * 1e3 / T, local_ms=local if w == 2 else float("nan"), note="",
                             local_backend="cula-sm90"))
    for layout, ok in (("fixed", True), ("varlen", False)):
        rows.append(dict(kind="check", variant="kda", layout=layout, lens=[96] if layout == "fixed" else [50, 0, 46],
                         world_size=2, T=96, ok=ok, tol_o=0.01, tol_s=0.01, o_cp=0.004 if ok else 0.5, o_one=0.004,
                         s_cp=0.003, s_one=0.003, o_cp_vs_one=1e-4, s_cp_vs_one=1e-4, o_max_abs=0.01, s_max_abs=0.01))
    return rows


def test_context_parallel_section(tmp_path, monkeypatch):
    """The multi-GPU rows get their own tables: speedup over W = 1, efficiency, the local forward alone, and
    the checks, a failed one flagged; they stay out of the suite views and the chart."""
    import cula.bench.fingerprint as fingerprint
    from cula.cp import multigpu

    monkeypatch.setattr(fingerprint, "collect", lambda device: dict(H200))
    rows = _cp_rows()
    multigpu._speedups(rows)
    args = multigpu.parse_args(["--device", "cpu", "--store", str(tmp_path)])
    multigpu.store_rows(rows, args, "2026-01-03T00:00:00Z")
    store_run(tmp_path, R1, make_rows(R1, limit=2))
    text = render(select(load_runs(tmp_path)[0], "H200"))
    scaling = _table(text, "### Strong scaling: kda (cula; local op: cula-sm90)")
    assert scaling[0] == ["T", "W=1 ms", "W=2 ms", "W=2 speedup", "W=2 efficiency", "W=2 local forward alone ms",
                          "ns/token at W=2"]
    assert scaling[2] == ["131072", "5.00", "4.00", "1.25x", "62%", "3.00", f"{4.0 * 1e6 / 131072:.1f}"]
    assert scaling[3][3:5] == ["1.60x", "80%"]
    checks = _table(text, "### Correctness across GPUs")
    assert [c[-1] for c in checks[2:]] == ["pass", "**fail**"]
    assert "**1 row(s) failed" in text
    assert "## Suite `cp_scaling`" not in text and "## Suite `kda`" in text
    assert "multi-GPU): timing: median of 5" in text

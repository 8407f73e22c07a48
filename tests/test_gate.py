"""The regression gate on fixture runs: pass, regression, unusable, noise-aware threshold."""

from __future__ import annotations

import pytest

from bench_fixtures import H200, make_rows, store_run
from cula.bench.store import RunData
from cula.reports.data import ReportError
from cula.reports.gate import PASS, REGRESSION, UNUSABLE, GateOptions, compare_runs, resolve_runs

B, C = "20260101-000000-h200-abc1234-0001", "20260102-000000-h200-abc1234-0002"


def run(run_id, **kw):
    return RunData(run_id, make_rows(run_id, **kw), {}, [])


def test_same_speed_passes():
    res = compare_runs(run(B, seed=0), run(C, seed=1))
    assert res.code == PASS, res.message
    assert res.counts() == {"ok": 28}


def test_slower_candidate_regresses():
    res = compare_runs(run(B), run(C, scale={"cula": 1.3}))
    assert res.code == REGRESSION
    assert all(c.verdict == "regression" and c.change == pytest.approx(0.3, abs=0.02) for c in res.changes)


def test_faster_candidate_is_an_improvement():
    res = compare_runs(run(B), run(C, scale={"cula": 0.7}))
    assert res.code == PASS and res.counts() == {"improved": 28}


def test_fla_slowdown_is_not_gated_by_default():
    assert compare_runs(run(B), run(C, scale={"fla": 1.5})).code == PASS
    assert compare_runs(run(B), run(C, scale={"fla": 1.5}), GateOptions(impls=("fla",))).code == REGRESSION


def test_noise_widens_the_threshold():
    # 8 % slower: a regression with no spread (5 % floor), within noise with +-10 % p20-p80
    # half-spreads in both runs (allowed 2 x sqrt(2) x 10 % = 28 %)
    quiet = compare_runs(run(B, spread=0.0), run(C, scale={"cula": 1.08}, spread=0.0))
    noisy = compare_runs(run(B, spread=0.1), run(C, scale={"cula": 1.08}, spread=0.1))
    assert quiet.code == REGRESSION and noisy.code == PASS
    assert noisy.changes[0].allowed == pytest.approx(2 * (2 * 0.1 ** 2) ** 0.5, rel=1e-6)


def test_missing_config_and_correctness_failure_regress():
    res = compare_runs(run(B), run(C, limit=20))
    assert res.code == REGRESSION and res.counts()["missing"] == 8
    res = compare_runs(run(B), run(C, fail={(4, "cula")}))
    assert res.code == REGRESSION and [c.verdict for c in res.changes if c.is_regression] == ["failed"]


def test_changed_config_definition_regresses():
    cand = run(C)
    cand.rows[1].config_hash = "different"
    res = compare_runs(run(B), cand)
    assert res.code == REGRESSION and res.counts()["changed"] == 1


def test_graph_metric():
    cand = run(C)
    for r in cand.rows:
        if r.impl == "cula":
            r.graph_ms *= 1.5
            r.graph_p20_ms *= 1.5
            r.graph_p80_ms *= 1.5
    assert compare_runs(run(B), cand).code == PASS
    assert compare_runs(run(B), cand, GateOptions(metric="graph")).code == REGRESSION
    assert compare_runs(run(B), cand, GateOptions(metric="both")).code == REGRESSION
    with pytest.raises(ReportError, match="--metric"):
        compare_runs(run(B), cand, GateOptions(metric="p99"))


@pytest.mark.parametrize("cand,why", [
    (lambda: run(C, fingerprint=dict(H200, gpu_name="NVIDIA GB200")), "different GPU types"),
    (lambda: run(C, suite="lightning"), "no \\(config, impl\\) in common"),
    (lambda: RunData(C, [], {}, []), "no rows"),
])
def test_unusable(cand, why):
    res = compare_runs(run(B), cand())
    assert res.code == UNUSABLE
    assert __import__("re").search(why, res.message)


def test_resolve_runs_defaults_and_errors(tmp_path):
    store_run(tmp_path, B, make_rows(B))
    store_run(tmp_path, C, make_rows(C))
    base, cand = resolve_runs(B, None, tmp_path)
    assert (base.run_id, cand.run_id) == (B, C)  # candidate defaults to the newest run
    with pytest.raises(ReportError, match="no committed baseline"):
        resolve_runs(None, C, tmp_path)  # tmp_path is not a git checkout: nothing committed
    with pytest.raises(ReportError, match="unknown run id 'nope'"):
        resolve_runs("nope", C, tmp_path)
    (tmp_path / C / "part-00003.parquet").write_bytes(b"x")
    with pytest.raises(ReportError, match="part-00003.parquet"):
        resolve_runs(B, C, tmp_path)
    assert resolve_runs(B, C, tmp_path, skip_corrupt=True)[1].skipped

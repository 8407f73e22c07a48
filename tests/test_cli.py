"""The typer app: exit codes, one-line errors without tracebacks, report --check, gate codes."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bench_fixtures import H200, make_rows, store_run
from cula.cli.app import app

R1, R2 = "20260101-000000-h200-abc1234-0001", "20260102-000000-h200-abc1234-0002"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_error(res, pattern):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    err_lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: "), res.stderr
    assert __import__("re").search(pattern, err_lines[0]), err_lines[0]


def test_suites_lists_counts():
    res = invoke("suites")
    assert res.exit_code == 0
    kda = [ln for ln in res.stdout.splitlines() if ln.startswith("kda ")][0].split()
    assert kda[:5] == ["kda", "gpu", "10", "18", "28"]
    assert any(ln.startswith("smoke ") and " any " in ln for ln in res.stdout.splitlines())


@pytest.mark.parametrize("args,pattern", [
    (["bench", "--suite", "nope"], "unknown suite 'nope'"),
    (["bench", "--impl", "fla,triton"], "unknown impl 'triton'"),
    (["bench", "--suite", "kda", "--device", "cpu"], "needs a GPU"),
    (["bench", "--mode", "diagonal", "--suite", "smoke"], "--mode"),
    (["bench", "--resume", "nope", "--results-dir", "{tmp}"], "unknown run id 'nope'"),
    (["bench", "--max-time", "0", "--suite", "smoke"], "--max-time"),
    (["bench", "--flush", "sideways", "--suite", "smoke"], "--flush"),
    (["report", "--run", "nope", "--results-dir", "{tmp}"], "unknown run id 'nope'"),
    (["report", "--gpu", "A100", "--results-dir", "{tmp}"], "--gpu"),
    (["gate", "--baseline", "nope", "--candidate", "nope2", "--results-dir", "{tmp}"], "unknown run id"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, pattern):
    res = invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert_clean_error(res, pattern)


def test_no_gpu_for_cuda_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert_clean_error(invoke("bench", "--suite", "kda", "--device", "cuda"), "no CUDA GPU")


def test_corrupt_part_fails_report_and_gate_unless_skipped(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=3))
    store_run(tmp_path, R2, make_rows(R2, limit=3))
    bad = tmp_path / R2 / "part-00002.parquet"
    bad.write_bytes(b"not parquet")
    assert_clean_error(invoke("report", "--results-dir", tmp_path, "--out", tmp_path / "x.md"), "part-00002.parquet")
    assert_clean_error(invoke("gate", "-b", R1, "-c", R2, "--results-dir", tmp_path), "part-00002.parquet")
    res = invoke("report", "--results-dir", tmp_path, "--gpu", "H200", "--out", tmp_path / "x.md", "--no-chart")
    assert res.exit_code == 2  # still refused without --skip-corrupt ...
    res = invoke("report", "--results-dir", tmp_path, "--gpu", "H200", "--out", tmp_path / "x.md",
                 "--no-chart", "--skip-corrupt")
    assert res.exit_code == 0 and "skipped corrupted result file" in res.stderr
    assert bad.read_bytes() == b"not parquet"  # nothing stored is touched


def test_mixed_gpus_exit_2(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=2))
    store_run(tmp_path, R2, make_rows(R2, suite="lightning", limit=2, fingerprint=dict(H200, gpu_name="NVIDIA H200 NVL")))
    assert_clean_error(invoke("report", "--results-dir", tmp_path, "--gpu", "H200", "--out", "-"), "mixed GPU types")


def test_report_writes_and_check_detects_drift(tmp_path):
    data, root = tmp_path / "results", tmp_path / "repo"
    root.mkdir()
    store_run(data, R1, make_rows(R1))
    check = ("report", "--check", "--results-dir", data, "--root", root)
    res = invoke(*check)
    assert res.exit_code == 1 and "BENCHMARK_H200.md: missing" in res.stderr
    res = invoke("report", "--results-dir", data, "--root", root)
    assert res.exit_code == 0, res.output
    assert (root / "BENCHMARK_H200.md").is_file() and (root / "BENCHMARK_H200_speedup.png").is_file()
    gb = (root / "BENCHMARK_GB200.md").read_text()
    assert "No GB200 run is recorded yet" in gb and not (root / "BENCHMARK_GB200_speedup.png").exists()
    assert invoke(*check).exit_code == 0
    # hand edit -> drift
    md = root / "BENCHMARK_H200.md"
    md.write_text(md.read_text().replace("2.00x", "3.00x", 1))
    res = invoke(*check)
    assert res.exit_code == 1 and "BENCHMARK_H200.md: differs" in res.stderr
    # new stored data -> drift as well
    invoke("report", "--results-dir", data, "--root", root)
    store_run(data, R2, make_rows(R2, started="2026-01-02T00:00:00Z", scale={"cula": 0.9}))
    assert invoke(*check).exit_code == 1


def test_h100_runs_publish_under_reports(tmp_path):
    data, root = tmp_path / "results", tmp_path / "repo"
    root.mkdir()
    store_run(data, R1, make_rows(R1, fingerprint=dict(H200, gpu_name="NVIDIA H100 80GB HBM3")))
    res = invoke("report", "--results-dir", data, "--root", root)
    assert res.exit_code == 0, res.output
    md = root / "reports" / "BENCHMARK_H100.md"
    assert md.is_file() and (root / "reports" / "BENCHMARK_H100_speedup.png").is_file()
    assert "NVIDIA H100 80GB HBM3" in md.read_text() and "| 1 | 512 |" in md.read_text()
    assert "No H200 run is recorded yet" in (root / "BENCHMARK_H200.md").read_text()
    assert invoke("report", "--check", "--results-dir", data, "--root", root).exit_code == 0
    res = invoke("report", "--results-dir", data, "--root", root, "--run", R1)
    assert res.exit_code == 0, res.output


def test_report_stdout(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=2))
    res = invoke("report", "--results-dir", tmp_path, "--gpu", "H200", "--out", "-")
    assert res.exit_code == 0 and res.stdout.startswith("<!-- Generated by `cula report`")
    assert "| 1 | 512 |" in res.stdout


def test_gate_exit_codes(tmp_path):
    store_run(tmp_path, R1, make_rows(R1))
    store_run(tmp_path, R2, make_rows(R2, scale={"cula": 1.25}))
    res = invoke("gate", "-b", R1, "-c", R1, "--results-dir", tmp_path)
    assert res.exit_code == 0 and "pass: 28 baseline rows" in res.stdout
    res = invoke("gate", "-b", R1, "-c", R2, "--results-dir", tmp_path)
    assert res.exit_code == 1 and "REGRESSION" in res.stdout and "+25" in res.stdout
    other = "20260103-000000-gb200-abc1234-0003"
    store_run(tmp_path, other, make_rows(other, fingerprint=dict(H200, gpu_name="NVIDIA GB200")))
    res = invoke("gate", "-b", R1, "-c", other, "--results-dir", tmp_path)
    assert res.exit_code == 2 and "different GPU types" in res.stdout


def test_runs_and_env(tmp_path):
    store_run(tmp_path, R1, make_rows(R1, limit=1))
    res = invoke("runs", "--results-dir", tmp_path)
    assert res.exit_code == 0 and R1 in res.stdout and "NVIDIA H200" in res.stdout
    res = invoke("env", "--device", "cpu")
    assert res.exit_code == 0
    assert "torch" in res.stdout and "cula_sha" in res.stdout and "backends" in res.stdout


def test_bench_cpu_fallback_end_to_end(tmp_path, monkeypatch):
    """The README command on a machine without a GPU: the smoke grid on the torch references."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the fallback does not apply")
    monkeypatch.setenv("CULA_CPU_RESULTS_DIR", str(tmp_path))
    res = invoke("bench", "--suite", "kda", "--mode", "fixed", "--quick", "--max-reps", "2", "--plain")
    assert res.exit_code == 0, res.output
    assert "No CUDA GPU found" in res.stdout and "smoke" in res.stdout
    assert "CPU run: kept out of the published" in res.stdout
    from cula.bench.store import Store

    store = Store(tmp_path)
    (run_id,) = store.list_runs()
    rows = store.read_run(run_id).rows
    assert {r.impl for r in rows} == {"cula", "ref"} and {r.device_kind for r in rows} == {"cpu"}
    from cula.suites import load_suite

    assert len(rows) == 2 * len(load_suite("smoke").select("fixed"))  # every fixed smoke config x 2 impls
    assert any(r.status == "ok" for r in rows)


def test_kill_9_loses_at_most_the_config_in_flight(tmp_path):
    """A real `cula bench` process killed with SIGKILL mid-run: the stored parts stay readable and
    `--resume` finishes the run without redoing them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    from cula.bench.store import Store

    if torch.cuda.is_available():
        pytest.skip("uses the CPU smoke grid")
    env = dict(os.environ, CULA_CPU_RESULTS_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "cula.cli.app", "bench", "--suite", "smoke", "--mode", "fixed",
           "--impl", "ref", "--max-time", "0.3", "--plain"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not list(tmp_path.glob("*/part-00001.parquet")):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    store = Store(tmp_path)
    (run_id,) = store.list_runs()
    assert not store.bundle_path(run_id).exists(), "the run finished before it could be killed"
    before = store.read_run(run_id).rows  # no corrupt part: raises otherwise
    from cula.suites import load_suite

    n = len(load_suite("smoke").select("fixed"))
    assert 2 <= len(before) < n
    res = invoke("bench", "--resume", run_id, "--results-dir", tmp_path, "--quick", "--plain")
    assert res.exit_code == 0, res.output
    assert f"{len(before)} configs already stored" in res.stdout
    after = store.read_run(run_id).rows
    assert len(after) == n and {(r.config_id, r.date) for r in before} <= {(r.config_id, r.date) for r in after}

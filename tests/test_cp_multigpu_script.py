"""The multi-GPU script's code path, run on the CPU with gloo (tiny sizes): checks pass, rows are stored."""

from __future__ import annotations

import warnings


def test_multigpu_script_cpu_dry_run(tmp_path):
    from cula.bench.store import Store
    from cula.cp import multigpu

    md = tmp_path / "cp.md"
    argv = ["--device", "cpu", "--world-sizes", "1,2", "--check-T", "48", "--scaling-T", "64", "--H", "2",
            "--K", "8", "--V", "8", "--dtype", "float32", "--reps", "1", "--warmup", "0",
            "--store", str(tmp_path / "store"), "--md", str(md)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert multigpu.main(argv) == 0  # 0: every correctness check passed
    text = md.read_text()
    assert text.count("| pass |") == 4  # 2 variants x (fixed, varlen) at W = 2
    assert "### kda" in text and "### lightning" in text
    store = Store(tmp_path / "store")
    rows = store.read_run(store.list_runs()[0]).rows
    suites = sorted(r.suite for r in rows)
    assert suites == ["cp_check"] * 4 + ["cp_scaling"] * 4  # scaling: 2 variants x W in (1, 2)
    assert all(r.status == "ok" for r in rows)

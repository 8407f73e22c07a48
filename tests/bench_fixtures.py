"""Synthetic stored runs for the report, gate and store tests (no GPU, no ops needed).

Rows are built the way the runner builds them (``base_row`` from real suite configs) and given
made-up timings: FLA's time grows with the token count, other impls are a fixed factor of it, and
each run can scale or perturb them, so tests can create passing, regressing and failing runs.
"""

from __future__ import annotations

import random
from pathlib import Path

from cula.bench.runner import base_row
from cula.bench.schema import FAIL, OK, UNAVAILABLE, Row
from cula.bench.store import Store
from cula.bench.timing import TimingSettings
from cula.suites import load_suite

H200 = {"device_kind": "cuda", "gpu_name": "NVIDIA H200", "sm_count": 132, "driver": "570.00",
        "cuda": "12.8", "torch": "2.9.0", "triton": "3.5.0", "dsl": "4.3.5", "fla": "0.6.0",
        "python": "3.12.3", "cula_sha": "abc1234def", "cula_dirty": False, "host_hash": "0123456789ab"}

FACTORS = {"fla": 1.0, "cula": 0.5, "flashkda": 0.6, "ref": 20.0}


def make_rows(run_id: str, suite: str = "kda", impls: tuple[str, ...] = ("fla", "cula"),
              fingerprint: dict | None = None, scale: dict[str, float] | None = None,
              spread: float = 0.01, seed: int = 0, started: str = "2026-01-01T00:00:00Z",
              fail: set[tuple[int, str]] = frozenset(), unavailable: set[str] = frozenset(),
              limit: int | None = None) -> list[Row]:
    """Rows of ``suite`` x ``impls``; ``scale[impl]`` multiplies that impl's times,
    ``fail`` = {(config_index, impl)} marks correctness failures."""
    fp = dict(H200 if fingerprint is None else fingerprint)
    rng = random.Random(seed)
    rows = []
    configs = load_suite(suite).configs[:limit]
    for cfg in configs:
        base_ms = 0.02 + cfg.B * cfg.T * cfg.HV / 2.0e6
        for impl in impls:
            r = base_row(cfg, impl, run_id, fp, started, f"cula bench --suite {suite} --mode both "
                         f"--impl {','.join(impls)}", TimingSettings(), (4.2, 750.0))
            r.date = started
            r.backend = {"cula": "cula-sm90", "fla": "fla-triton", "ref": "torch-ref"}.get(impl, impl)
            if impl in unavailable:
                r.status, r.note = UNAVAILABLE, f"{impl} not importable"
                rows.append(r)
                continue
            ms = base_ms * FACTORS.get(impl, 1.0) * (scale or {}).get(impl, 1.0)
            ms *= 1.0 + rng.uniform(-spread, spread) / 4
            r.eager_ms, r.eager_p20_ms, r.eager_p80_ms, r.eager_reps = ms, ms * (1 - spread), ms * (1 + spread), 50
            g = ms * 0.9
            r.graph_ms, r.graph_p20_ms, r.graph_p80_ms, r.graph_reps = g, g * (1 - spread), g * (1 + spread), 50
            r.o_rel_l2, r.state_rel_l2 = 1e-3, 2e-3
            r.o_max_abs, r.state_max_abs = 1e-2, 3e-2
            r.oracle = "cula.ref.kda.chunked fp32"
            r.status = OK
            if (cfg.index, impl) in fail:
                r.o_rel_l2, r.status, r.note = 0.5, FAIL, "o rel-L2 0.5 > 0.02"
            sec = ms * 1e-3
            r.tbps, r.tflops = r.bytes / sec / 1e12, r.flops / sec / 1e12
            r.pct_bw, r.pct_flops = 100 * r.tbps / r.ceil_tbps, 100 * r.tflops / r.ceil_tflops
            rows.append(r)
    return rows


def store_run(root: Path, run_id: str, rows: list[Row], per_config: bool = True,
              meta: dict | None = None) -> Store:
    """Write ``rows`` into a store at ``root`` as parts (one per config) like the runner does."""
    store = Store(root)
    store.start_run(run_id, meta or {"run_id": run_id, "status": "complete"})
    if per_config:
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(r.config_id, []).append(r)
        for g in groups.values():
            store.append(run_id, g)
    else:
        store.append(run_id, rows)
    return store

"""Parquet store: append, atomic parts, resume bookkeeping, corruption, bundles."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from bench_fixtures import make_rows, store_run
from cula.bench.schema import ARROW_SCHEMA, FIELDS, Row, row_from_dict, rows_to_table, spread_rel
from cula.bench.store import CorruptPartError, Store, StoreError, new_run_id

RUN = "20260101-000000-h200-abc1234-0001"


def test_row_roundtrip_through_arrow():
    rows = make_rows(RUN, limit=2)
    table = rows_to_table(rows)
    assert table.schema == ARROW_SCHEMA and table.num_rows == 4
    back = [row_from_dict(d) for d in table.to_pylist()]
    assert [r.config_id for r in back] == [r.config_id for r in rows]
    assert back[0].eager_ms == pytest.approx(rows[0].eager_ms)
    assert math.isnan(back[0].grad_rel_l2)
    assert set(FIELDS) >= {"gpu_name", "sm_count", "driver", "cuda", "torch", "triton", "dsl", "fla",
                           "cula_sha", "cula_dirty", "host_hash", "date"}


def test_append_one_part_per_config_and_read(tmp_path):
    rows = make_rows(RUN, limit=3)
    store = store_run(tmp_path, RUN, rows)
    parts = sorted((tmp_path / RUN).glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    data = store.read_run(RUN)
    assert len(data.rows) == 6 and data.meta["status"] == "complete"
    assert store.list_runs() == [RUN]
    assert store.done_pairs(RUN) == {(r.config_id, r.impl) for r in rows}


def test_tmp_leftovers_are_ignored(tmp_path):
    store = store_run(tmp_path, RUN, make_rows(RUN, limit=1))
    (tmp_path / RUN / "part-00001.parquet.123.tmp").write_bytes(b"half a file")
    assert len(store.read_run(RUN).rows) == 2


def test_corrupted_part_is_named_and_can_be_skipped(tmp_path):
    store = store_run(tmp_path, RUN, make_rows(RUN, limit=2))
    bad = tmp_path / RUN / "part-00001.parquet"
    bad.write_bytes(bad.read_bytes()[:50])  # truncated, as a full disk would leave it
    with pytest.raises(CorruptPartError, match="part-00001.parquet"):
        store.read_run(RUN)
    data = store.read_run(RUN, skip_corrupt=True)
    assert len(data.rows) == 2 and data.skipped == [str(bad)]
    # the good part is untouched
    assert pq.read_table(tmp_path / RUN / "part-00000.parquet").num_rows == 2


def test_part_missing_required_columns_is_corrupt(tmp_path):
    store = store_run(tmp_path, RUN, make_rows(RUN, limit=1))
    table = rows_to_table(make_rows(RUN, limit=1)).drop_columns(["eager_ms"])
    pq.write_table(table, tmp_path / RUN / "part-00001.parquet")
    with pytest.raises(CorruptPartError, match="missing columns"):
        store.read_run(RUN)


def test_unknown_run(tmp_path):
    store = store_run(tmp_path, RUN, make_rows(RUN, limit=1))
    with pytest.raises(StoreError, match="unknown run id 'nope'.*" + RUN):
        store.read_run("nope")


def test_latest_row_wins_for_a_repeated_pair(tmp_path):
    rows = make_rows(RUN, limit=1, impls=("cula",))
    store = store_run(tmp_path, RUN, rows)
    again = make_rows(RUN, limit=1, impls=("cula",), scale={"cula": 3.0}, started="2026-01-02T00:00:00Z")
    store.append(RUN, again)
    data = store.read_run(RUN)
    assert len(data.rows) == 1 and data.rows[0].eager_ms == pytest.approx(again[0].eager_ms)


def test_bundle_compact_resume_and_import(tmp_path):
    rows = make_rows(RUN, limit=3)
    store = store_run(tmp_path / "a", RUN, rows, meta={"run_id": RUN, "impls": ["fla", "cula"]})
    bundle = store.bundle(RUN, compact=True)
    assert bundle == tmp_path / "a" / f"{RUN}.parquet" and not (tmp_path / "a" / RUN).exists()
    assert store.list_runs() == [RUN] and len(store.read_run(RUN).rows) == 6
    assert store.read_meta(RUN)["impls"] == ["fla", "cula"]  # metadata travels inside the bundle
    # resuming a bundled run: new parts beside the bundle, union on read, compacted again
    extra = make_rows(RUN, suite="kda", impls=("ref",), limit=2)
    store.append(RUN, extra)
    assert len(store.read_run(RUN).rows) == 8
    store.bundle(RUN, compact=True)
    assert len(store.read_run(RUN).rows) == 8 and not (tmp_path / "a" / RUN).exists()
    # a bundle copied elsewhere is a run there too
    out = store.bundle(RUN, tmp_path / "transfer")
    other = Store(tmp_path / "b")
    assert other.import_bundle(out) == RUN and len(other.read_run(RUN).rows) == 8


def test_new_run_id_shape():
    rid = new_run_id("h200", "abcdef123456", when=0)
    assert rid.startswith("19700101-000000-h200-abcdef1-") and len(rid.split("-")[-1]) == 4
    assert new_run_id("h200", "x") != new_run_id("h200", "x")


def test_start_run_rejects_bad_id(tmp_path):
    with pytest.raises(StoreError, match="run id"):
        Store(tmp_path).start_run("../escape", {})


def test_spread_rel():
    assert spread_rel(1.0, 0.9, 1.1) == pytest.approx(0.1)
    assert math.isnan(spread_rel(float("nan"), 0.9, 1.1))
    assert math.isnan(Row().eager_ms)


def test_parts_written_before_the_memory_columns_read_as_nan(tmp_path):
    import math

    import pyarrow.parquet as pq

    table = rows_to_table([Row(run_id="r", suite="s", config_id="c", impl="fla", eager_ms=1.0)])
    old = table.drop(["gpu_mem_used_gib", "torch_alloc_gib"])  # what a 2026-12-02 run wrote
    pq.write_table(old, tmp_path / "old.parquet")
    (record,) = pq.read_table(tmp_path / "old.parquet").to_pylist()
    row = row_from_dict(record)
    assert math.isnan(row.gpu_mem_used_gib) and math.isnan(row.torch_alloc_gib) and row.eager_ms == 1.0


def test_memory_in_use_reads_the_device_and_torch(monkeypatch):
    import torch

    from cula.bench import runner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**30)
    assert runner._memory_in_use() == (100.0, 3.0)

"""Parquet store of benchmark runs, safe against Ctrl-C and kill -9.

Layout under the store root (``reports/results/`` for GPU runs)::

    <run_id>/run.json             run metadata (command, suites, impls, settings), written first
    <run_id>/part-00000.parquet   the rows of one finished config, one file per config
    <run_id>.parquet              a *bundle*: all rows of a run in one file (run.json in its metadata)

Parts are written to a ``.tmp`` file and renamed, so a killed process leaves either a whole part or
none; ``.tmp`` leftovers are ignored. A finished run is compacted into its bundle (and its parts
removed); a resumed run adds parts beside the bundle and is compacted again at the end. Readers take
the union of a run's bundle and parts. A part that cannot be read is reported by path
(:class:`CorruptPartError`) unless the caller asks to skip it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cula.bench.schema import ARROW_SCHEMA, FIELDS, REQUIRED, Row, row_from_dict, rows_to_table

META_KEY = b"cula_run_meta"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{2,120}$")


class StoreError(Exception):
    """The store cannot answer (unknown run id, unreadable data)."""


class CorruptPartError(StoreError):
    """A stored parquet file cannot be read or lacks required columns."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"corrupted result file {path}: {reason}")
        self.path = path


@dataclass
class RunData:
    """Rows of one run, its metadata and the files that could not be read (when skipped)."""

    run_id: str
    rows: list[Row]
    meta: dict[str, Any]
    skipped: list[str]


def new_run_id(gpu_slug: str, sha: str, when: float | None = None) -> str:
    """``<YYYYmmdd-HHMMSS>-<gpu>-<sha7>-<rand4>`` (UTC)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(when if when is not None else time.time()))
    sha7 = (sha or "unknown")[:7]
    return f"{stamp}-{gpu_slug}-{sha7}-{secrets.token_hex(2)}"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_write_table(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_table(path: Path) -> pa.Table:
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for truncated / garbage files
        raise CorruptPartError(path, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise CorruptPartError(path, f"missing columns {missing}")
    return table


def _table_rows(table: pa.Table) -> list[Row]:
    cols = [c for c in table.column_names if c in FIELDS]
    data = table.select(cols).to_pylist()
    return [row_from_dict(d) for d in data]


class Store:
    """Runs stored under ``root``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    # -- paths --------------------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.root / run_id

    def bundle_path(self, run_id: str) -> Path:
        return self.root / f"{run_id}.parquet"

    def exists(self, run_id: str) -> bool:
        return self.run_dir(run_id).is_dir() or self.bundle_path(run_id).is_file()

    def list_runs(self) -> list[str]:
        """Run ids in the store, oldest first (ids start with their UTC start time)."""
        if not self.root.is_dir():
            return []
        ids = set()
        for p in self.root.iterdir():
            if p.is_dir() and ((p / "run.json").is_file() or any(p.glob("part-*.parquet"))):
                ids.add(p.name)
            elif p.is_file() and p.suffix == ".parquet" and not p.name.endswith(".tmp"):
                ids.add(p.stem)
        return sorted(ids)

    # -- writing ------------------------------------------------------------------------------
    def start_run(self, run_id: str, meta: dict[str, Any]) -> None:
        if not RUN_ID_RE.match(run_id):
            raise StoreError(f"run id {run_id!r}: expected letters, digits, '.', '_' or '-'")
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=True)
        self.write_meta(run_id, meta)

    def write_meta(self, run_id: str, meta: dict[str, Any]) -> None:
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(d / "run.json", json.dumps(meta, indent=2, sort_keys=True).encode())

    def append(self, run_id: str, rows: list[Row]) -> Path:
        """Write ``rows`` (one finished config) as the run's next part; returns its path."""
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=True)
        existing = [int(p.stem.split("-")[1]) for p in d.glob("part-*.parquet")
                    if p.stem.split("-")[1].isdigit()]
        idx = max(existing, default=-1) + 1
        path = d / f"part-{idx:05d}.parquet"
        _atomic_write_table(path, rows_to_table(rows))
        return path

    # -- reading ------------------------------------------------------------------------------
    def read_meta(self, run_id: str) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        bundle = self.bundle_path(run_id)
        if bundle.is_file():
            try:
                md = pq.read_schema(bundle).metadata or {}
                if META_KEY in md:
                    meta.update(json.loads(md[META_KEY]))
            except Exception:
                pass  # a corrupt bundle is reported by read_run
        mpath = self.run_dir(run_id) / "run.json"
        if mpath.is_file():
            try:
                meta.update(json.loads(mpath.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise CorruptPartError(mpath, f"{type(exc).__name__}: {exc}") from None
        return meta

    def files(self, run_id: str) -> list[Path]:
        out = []
        if self.bundle_path(run_id).is_file():
            out.append(self.bundle_path(run_id))
        d = self.run_dir(run_id)
        if d.is_dir():
            out.extend(sorted(d.glob("part-*.parquet")))
        return out

    def read_run(self, run_id: str, skip_corrupt: bool = False) -> RunData:
        """All rows of ``run_id`` (bundle + parts; for a repeated (config, impl) the latest wins)."""
        if not self.exists(run_id):
            known = self.list_runs()
            hint = f"; stored runs: {', '.join(known[-5:])}" if known else f"; no runs stored in {self.root}"
            raise StoreError(f"unknown run id {run_id!r}{hint}")
        rows: list[Row] = []
        skipped: list[str] = []
        for path in self.files(run_id):
            try:
                rows.extend(_table_rows(_read_table(path)))
            except CorruptPartError as exc:
                if not skip_corrupt:
                    raise
                skipped.append(str(exc.path))
        latest: dict[tuple[str, str], Row] = {}
        for r in rows:
            key = (r.config_id, r.impl)
            if key not in latest or r.date >= latest[key].date:
                latest[key] = r
        ordered = sorted(latest.values(), key=lambda r: (r.suite, r.config_index, r.impl))
        return RunData(run_id=run_id, rows=ordered, meta=self.read_meta(run_id), skipped=skipped)

    def done_pairs(self, run_id: str) -> set[tuple[str, str]]:
        """(config_id, impl) pairs already stored for ``run_id`` (readable parts only)."""
        return {(r.config_id, r.impl) for r in self.read_run(run_id, skip_corrupt=True).rows}

    # -- bundling -----------------------------------------------------------------------------
    def bundle(self, run_id: str, dest_dir: Path | None = None, compact: bool = False) -> Path:
        """Write all rows of ``run_id`` as one parquet file (metadata inside) into ``dest_dir``
        (default: the store root). ``compact``: then delete the run's parts directory."""
        data = self.read_run(run_id)
        table = rows_to_table(data.rows)
        meta = json.dumps(data.meta, sort_keys=True).encode()
        table = table.replace_schema_metadata({META_KEY: meta})
        dest = (Path(dest_dir) if dest_dir is not None else self.root) / f"{run_id}.parquet"
        dest.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_table(dest, table)
        if compact and dest == self.bundle_path(run_id) and self.run_dir(run_id).is_dir():
            shutil.rmtree(self.run_dir(run_id))
        return dest

    def import_bundle(self, path: Path) -> str:
        """Copy a bundle file into this store (validated first); returns its run id."""
        path = Path(path)
        _read_table(path)  # raises CorruptPartError when unreadable
        run_id = path.stem
        if not RUN_ID_RE.match(run_id):
            raise StoreError(f"{path}: file name is not a run id")
        self.root.mkdir(parents=True, exist_ok=True)
        dest = self.bundle_path(run_id)
        if dest.resolve() != path.resolve():
            shutil.copyfile(path, dest)
        return run_id


def check_schema_compatible(table: pa.Table) -> bool:
    """True when every column present has the type :data:`ARROW_SCHEMA` gives it."""
    for f in table.schema:
        if f.name in ARROW_SCHEMA.names and ARROW_SCHEMA.field(f.name).type != f.type:
            return False
    return True

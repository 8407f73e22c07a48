"""The one definition of a stored benchmark row.

A row is one (config, implementation) measurement of one run. The store writes rows with
:data:`ARROW_SCHEMA`; the report and the gate read columns by these names, never by position.
Times are milliseconds; NaN means "not measured" and the matching ``*_note`` column says why.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 1

# Row status values.
OK = "ok"                 # measured, within tolerance
FAIL = "fail"             # measured, but o / state / grad error above the tolerance: flagged in reports
ERROR = "error"           # the implementation raised
UNAVAILABLE = "unavailable"  # not importable / not supported for this config (reason in ``note``)
STATUSES = (OK, FAIL, ERROR, UNAVAILABLE)

NAN = float("nan")


@dataclass
class Row:
    """One measurement. Groups: identity, config, result, correctness, timing, roofline, environment."""

    # identity
    schema_version: int = SCHEMA_VERSION
    run_id: str = ""
    suite: str = ""
    config_index: int = 0          # position in the suite's expansion (report order)
    config_id: str = ""            # readable key the gate joins on
    config_hash: str = ""          # digest of the measured config; differs => not comparable
    impl: str = ""                 # cula | fla | flashkda | ref
    # config
    variant: str = ""
    phase: str = ""
    mode: str = ""
    B: int = 0
    T: int = 0
    H: int = 0
    HV: int = 0
    K: int = 0
    V: int = 0
    dtype: str = ""
    state: bool = False
    flags_json: str = "{}"
    dist: str = ""
    n_seqs: int = 0
    seed: int = 0
    lengths_json: str = "[]"
    len_min: int = 0
    len_max: int = 0
    len_avg: float = 0.0
    # result
    status: str = OK
    backend: str = ""              # what actually ran (e.g. cula-sm90, fla-triton, torch-ref)
    note: str = ""                 # error text, fallback warnings, unavailability reason
    # correctness against the oracle
    oracle: str = ""               # e.g. "cula.ref.kda.chunked fp32"
    o_rel_l2: float = NAN
    o_max_abs: float = NAN
    state_rel_l2: float = NAN
    state_max_abs: float = NAN
    grad_rel_l2: float = NAN       # worst over the input gradients (train phase)
    tol_o: float = NAN
    tol_state: float = NAN
    tol_grad: float = NAN
    # timing (ms): median and p20/p80 spread of ``*_reps`` timed calls
    eager_ms: float = NAN
    eager_p20_ms: float = NAN
    eager_p80_ms: float = NAN
    eager_reps: int = 0
    graph_ms: float = NAN
    graph_p20_ms: float = NAN
    graph_p80_ms: float = NAN
    graph_reps: int = 0
    graph_note: str = ""           # why there is no graph time (capture failed, CPU run, disabled)
    # counted work and roofline (from the eager median)
    bytes: float = NAN
    flops: float = NAN
    tbps: float = NAN
    tflops: float = NAN
    ceil_tbps: float = NAN         # device-to-device copy bandwidth measured in this run
    ceil_tflops: float = NAN       # bf16 matmul throughput measured in this run
    pct_bw: float = NAN
    pct_flops: float = NAN
    # device memory still held after this row's impl finished and the allocator cache was emptied
    # (GiB): growth from row to row is memory a run leaks (NaN on CPU and in runs before 2026-12-02)
    gpu_mem_used_gib: float = NAN  # whole device in use (cudaMemGetInfo: total - free)
    torch_alloc_gib: float = NAN   # of it, live torch tensors (torch.cuda.memory_allocated)
    # environment fingerprint
    device_kind: str = ""          # cuda | cpu
    gpu_name: str = ""
    sm_count: int = 0
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    triton: str = ""
    dsl: str = ""
    fla: str = ""
    python: str = ""
    cula_sha: str = ""
    cula_dirty: bool = False
    host_hash: str = ""
    run_started: str = ""          # ISO-8601 UTC start of the run
    date: str = ""                 # ISO-8601 UTC time this row finished
    command: str = ""              # the canonical command that reproduces the run
    settings_json: str = "{}"      # timing settings (max reps, max time, flush size, ...)

    def to_dict(self) -> dict[str, typing.Any]:
        return dataclasses.asdict(self)


_ARROW_TYPES = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_()}
_HINTS = typing.get_type_hints(Row)
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Row))
ARROW_SCHEMA = pa.schema([pa.field(name, _ARROW_TYPES[_HINTS[name]]) for name in FIELDS])
# Columns a part must have to be usable (older parts may lack newer optional columns).
REQUIRED = ("run_id", "suite", "config_id", "config_hash", "impl", "status", "eager_ms", "gpu_name",
            "device_kind", "date")


def row_from_dict(d: dict[str, typing.Any]) -> Row:
    """Build a Row from a stored record; unknown keys are ignored, missing ones take defaults."""
    kwargs = {}
    for name in FIELDS:
        if name in d and d[name] is not None:
            val = d[name]
            typ = _HINTS[name]
            if typ is float and val is not None:
                val = float(val)
            elif typ is int and not (isinstance(val, float) and math.isnan(val)):
                val = int(val)
            kwargs[name] = val
    return Row(**kwargs)


def rows_to_table(rows: list[Row]) -> pa.Table:
    """Rows as an arrow table with :data:`ARROW_SCHEMA`."""
    cols = {name: [getattr(r, name) for r in rows] for name in FIELDS}
    return pa.Table.from_pydict(cols, schema=ARROW_SCHEMA)


def spread_rel(median: float, p20: float, p80: float) -> float:
    """Half-width of the p20-p80 interval relative to the median (0.05 = +-5%); NaN if unknown."""
    if not (median > 0) or math.isnan(p20) or math.isnan(p80):
        return NAN
    return (p80 - p20) / (2.0 * median)


__all__ = ["Row", "ARROW_SCHEMA", "FIELDS", "REQUIRED", "SCHEMA_VERSION", "STATUSES", "OK", "FAIL",
           "ERROR", "UNAVAILABLE", "row_from_dict", "rows_to_table", "spread_rel"]

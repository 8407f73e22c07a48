"""Load benchmark suites from the TOML grid files beside this module and expand them into configs.

A suite file (``suites/<name>.toml``) holds::

    name = "kda"                 # must equal the file stem
    description = "..."
    device = "cuda"              # "cuda": GPU-only suite; "any": runs on CPU too
    [defaults]                   # fields shared by every grid entry (any Config field)
    variant = "kda"
    ...
    [defaults.flags]             # op flags (use_gate_in_kernel, lower_bound, ...)
    [tolerance.bfloat16]         # relative-L2 tolerance per input dtype: o, state, grad
    [[grid]]                     # one block of configs; list values are axes of a cartesian product,
    mode = "fixed"               # expanded in the order the keys are written (first = outermost)
    B = [1, 2]
    T = [512, 1024]

Nothing here imports torch: a suite is data, the runner turns it into tensors.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .lengths import DISTRIBUTIONS, varlen_lengths

SUITE_DIR = Path(__file__).resolve().parent

VARIANTS = ("kda", "lightning", "gdn", "gla")
PHASES = ("prefill", "decode", "train")
MODES = ("fixed", "varlen")
DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# Relative-L2 tolerances of o / final state / gradients against the fp32 reference, per input dtype.
# A suite may override them in its [tolerance.<dtype>] tables; these are the fallbacks.
DEFAULT_TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"o": 2e-2, "state": 2e-2, "grad": 5e-2},
    "float16": {"o": 5e-3, "state": 5e-3, "grad": 2e-2},
    "float32": {"o": 1e-4, "state": 1e-4, "grad": 1e-3},
}

_SCALAR_FIELDS = ("variant", "phase", "mode", "B", "T", "H", "HV", "K", "V", "dtype", "state",
                  "dist", "n_seqs", "seed")
_ENTRY_KEYS = set(_SCALAR_FIELDS) | {"flags"}
_TOP_KEYS = {"name", "description", "device", "defaults", "tolerance", "grid"}


class SuiteError(ValueError):
    """A suite name is unknown or a suite file is malformed."""


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: a shape, a dtype, the op flags and (varlen) the length split.

    For ``mode == "varlen"`` the inputs are packed: ``B == 1``, ``T`` is the total token count and
    ``lengths`` (``n_seqs`` entries, summing to ``T``) come from ``dist`` with ``seed``. For fixed
    configs ``lengths`` is empty and ``n_seqs == B``. ``seed`` also seeds the input tensors.
    ``state``: an fp32 initial state goes in and the final state comes out.
    """

    suite: str
    index: int
    variant: str
    phase: str
    mode: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    state: bool
    flags: tuple[tuple[str, Any], ...] = ()
    dist: str = ""
    n_seqs: int = 0
    seed: int = 0
    lengths: tuple[int, ...] = ()
    tolerance: tuple[tuple[str, float], ...] = ()
    device: str = "cuda"

    @property
    def flag_dict(self) -> dict[str, Any]:
        return dict(self.flags)

    @property
    def tol(self) -> dict[str, float]:
        return dict(self.tolerance)

    @property
    def config_id(self) -> str:
        """Readable key, stable across runs: what the gate and the report join on."""
        shape = f"H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-{_DTYPE_SHORT[self.dtype]}"
        state = "state" if self.state else "nostate"
        if self.mode == "varlen":
            head = f"{self.dist}-n{self.n_seqs}-T{self.T}-s{self.seed}"
        else:
            head = f"B{self.B}-T{self.T}"
        return f"{self.variant}/{self.phase}/{self.mode}/{head}-{shape}-{state}"

    @property
    def config_hash(self) -> str:
        """Digest of everything that changes the measurement (not the tolerance)."""
        payload = {
            "variant": self.variant, "phase": self.phase, "mode": self.mode, "B": self.B,
            "T": self.T, "H": self.H, "HV": self.HV, "K": self.K, "V": self.V, "dtype": self.dtype,
            "state": self.state, "flags": sorted(self.flags), "dist": self.dist,
            "n_seqs": self.n_seqs, "seed": self.seed, "lengths": list(self.lengths),
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def num_seqs(self) -> int:
        return self.n_seqs if self.mode == "varlen" else self.B

    @property
    def total_tokens(self) -> int:
        return self.B * self.T


@dataclass(frozen=True)
class Suite:
    """A named grid: its configs in file order, and whether it needs a GPU."""

    name: str
    description: str
    device: str
    configs: tuple[Config, ...] = field(default_factory=tuple)
    path: Path | None = None

    @property
    def gpu_only(self) -> bool:
        return self.device == "cuda"

    def select(self, mode: str = "both") -> list[Config]:
        """Configs of ``mode`` (``fixed``, ``varlen`` or ``both``), in suite order."""
        if mode not in ("fixed", "varlen", "both"):
            raise SuiteError(f"mode: expected fixed, varlen or both, got {mode!r}")
        return [c for c in self.configs if mode == "both" or c.mode == mode]

    def counts(self) -> dict[str, int]:
        return {m: sum(1 for c in self.configs if c.mode == m) for m in MODES}


def list_suites() -> list[str]:
    """Names of the suite files shipped in ``suites/``, sorted."""
    return sorted(p.stem for p in SUITE_DIR.glob("*.toml"))


def load_suite(name: str, path: Path | None = None) -> Suite:
    """Load and expand suite ``name`` (or the file at ``path``); raises SuiteError naming the problem."""
    if path is None:
        shipped = SUITE_DIR / f"{name}.toml"
        if shipped.is_file():
            return _load_shipped(name, shipped.stat().st_mtime_ns)
        path = SUITE_DIR / f"{name}.toml"
        if not path.is_file():
            raise SuiteError(f"unknown suite {name!r}; known suites: {', '.join(list_suites())}")
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SuiteError(f"suite file {path}: cannot read: {exc}") from None
    return _expand(data, Path(path))


@functools.lru_cache(maxsize=32)
def _load_shipped(name: str, mtime_ns: int) -> Suite:
    """Shipped suites are parsed once per file version (the mtime is part of the cache key)."""
    return load_suite(name, SUITE_DIR / f"{name}.toml")


def load_configs(names: list[str], mode: str = "both") -> list[Config]:
    """Configs of several suites, in the order given, filtered by ``mode``; duplicates dropped."""
    out: list[Config] = []
    seen: set[str] = set()
    for name in names:
        for cfg in load_suite(name).select(mode):
            if cfg.config_id not in seen:
                seen.add(cfg.config_id)
                out.append(cfg)
    return out


def _fail(path: Path, msg: str) -> SuiteError:
    return SuiteError(f"suite file {path.name}: {msg}")


def _expand(data: dict[str, Any], path: Path) -> Suite:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise _fail(path, f"unknown top-level keys {sorted(unknown)}; expected {sorted(_TOP_KEYS)}")
    name = data.get("name")
    if name != path.stem:
        raise _fail(path, f"name: expected {path.stem!r} (the file stem), got {name!r}")
    device = data.get("device", "cuda")
    if device not in ("cuda", "any"):
        raise _fail(path, f"device: expected 'cuda' or 'any', got {device!r}")
    defaults = dict(data.get("defaults", {}))
    tolerance = {k: dict(v) for k, v in DEFAULT_TOLERANCE.items()}
    for dt, table in data.get("tolerance", {}).items():
        if dt not in DTYPES:
            raise _fail(path, f"tolerance: expected dtype keys in {DTYPES}, got {dt!r}")
        tolerance[dt].update({k: float(v) for k, v in table.items()})
    grid = data.get("grid")
    if not isinstance(grid, list) or not grid:
        raise _fail(path, "grid: expected at least one [[grid]] entry")

    configs: list[Config] = []
    for gi, entry in enumerate(grid):
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise _fail(path, f"grid[{gi}]: unknown keys {sorted(unknown)}; expected {sorted(_ENTRY_KEYS)}")
        merged: dict[str, Any] = {**{k: v for k, v in defaults.items() if k != "flags"}}
        flags = {**defaults.get("flags", {}), **entry.get("flags", {})}
        # Axes in the order written: defaults first (rarely lists), then the entry's own keys.
        for k, v in entry.items():
            if k != "flags":
                merged[k] = v
        axes = [k for k, v in merged.items() if isinstance(v, list)]
        for combo in itertools.product(*(merged[k] for k in axes)):
            point = dict(merged)
            point.update(zip(axes, combo))
            configs.append(_make_config(path, name, len(configs), point, flags, tolerance, device, gi))
    ids = [c.config_id for c in configs]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise _fail(path, f"duplicate configs {dups[:3]}")
    return Suite(name=name, description=str(data.get("description", "")), device=device,
                 configs=tuple(configs), path=path)


def _make_config(path: Path, suite: str, index: int, p: dict[str, Any], flags: dict[str, Any],
                 tolerance: dict[str, dict[str, float]], device: str, gi: int) -> Config:
    where = f"grid[{gi}]"

    def need_int(key: str, low: int = 1) -> int:
        val = p.get(key)
        if not isinstance(val, int) or isinstance(val, bool) or val < low:
            raise _fail(path, f"{where}: {key}: expected an integer >= {low}, got {val!r}")
        return val

    variant, phase, mode = p.get("variant"), p.get("phase", "prefill"), p.get("mode", "fixed")
    if variant not in VARIANTS:
        raise _fail(path, f"{where}: variant: expected one of {VARIANTS}, got {variant!r}")
    if phase not in PHASES:
        raise _fail(path, f"{where}: phase: expected one of {PHASES}, got {phase!r}")
    if mode not in MODES:
        raise _fail(path, f"{where}: mode: expected one of {MODES}, got {mode!r}")
    dtype = p.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise _fail(path, f"{where}: dtype: expected one of {DTYPES}, got {dtype!r}")
    H, K, V, T = need_int("H"), need_int("K"), need_int("V"), need_int("T")
    HV = p.get("HV", H)
    if not isinstance(HV, int) or HV < H or HV % H:
        raise _fail(path, f"{where}: HV: expected a multiple of H={H}, got {HV!r}")
    seed = need_int("seed", 0) if "seed" in p else 0
    state = p.get("state", False)
    if not isinstance(state, bool):
        raise _fail(path, f"{where}: state: expected true or false, got {state!r}")
    dist, n_seqs, lengths = "", 0, ()
    if mode == "varlen":
        B = p.get("B", 1)
        if B != 1:
            raise _fail(path, f"{where}: B: varlen inputs are packed, expected 1, got {B!r}")
        dist = p.get("dist")
        if dist not in DISTRIBUTIONS:
            raise _fail(path, f"{where}: dist: expected one of {DISTRIBUTIONS}, got {dist!r}")
        n_seqs = need_int("n_seqs")
        if n_seqs > T:
            raise _fail(path, f"{where}: n_seqs: expected <= T={T}, got {n_seqs}")
        lengths = tuple(varlen_lengths(dist, n_seqs, T, seed))
    else:
        B = need_int("B")
        n_seqs = B
        if "dist" in p or "n_seqs" in p:
            raise _fail(path, f"{where}: dist/n_seqs only apply to mode = 'varlen'")
    return Config(
        suite=suite, index=index, variant=variant, phase=phase, mode=mode, B=B, T=T, H=H, HV=HV,
        K=K, V=V, dtype=dtype, state=state, flags=tuple(sorted(flags.items())), dist=dist,
        n_seqs=n_seqs, seed=seed, lengths=lengths, tolerance=tuple(sorted(tolerance[dtype].items())),
        device=device,
    )

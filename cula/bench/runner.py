"""The benchmark runner: plan a run, then for each config build inputs once, check and time every impl.

Per config (impls interleaved in one process, in the order given):

1. inputs from the config's seed (:mod:`cula.bench.inputs`), the oracle's outputs
   (:mod:`cula.bench.correctness`);
2. per impl: prepare (import lazily - a missing op is an ``unavailable`` row), one call with its
   warnings recorded (compiles, autotunes), errors against the oracle, eager timing, CUDA-graph
   timing (:mod:`cula.bench.timing`), counted bytes/FLOPs and % of the ceilings measured at the start
   of the run (:mod:`cula.bench.counting`);
3. the config's rows are appended to the store as one parquet part, before the next config starts.

Ctrl-C / kill -9 therefore lose at most the config in flight; ``resume`` skips stored
(config, impl) pairs.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cula.bench import counting
from cula.bench.schema import ERROR, FAIL, OK, UNAVAILABLE, Row
from cula.bench.store import Store, new_run_id
from cula.bench.timing import Timer, TimingSettings
from cula.suites import Config, SuiteError, list_suites, load_suite

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_RESULTS_DIR = REPO_ROOT / "reports" / "results"
CPU_IMPLS = ("cula", "ref")
DEFAULT_GPU_IMPLS = ("cula", "fla")
QUICK = TimingSettings(max_reps=10, min_reps=3, max_time_s=0.25, warmup_ms=5.0)


class BenchError(Exception):
    """A user-facing problem with a bench request (bad name, no GPU, ...): one line, exit code 2."""


def cpu_results_dir() -> Path:
    """Where CPU runs go: never the published store. ``CULA_CPU_RESULTS_DIR`` overrides."""
    env = os.environ.get("CULA_CPU_RESULTS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cula" / "results"


@dataclass
class Plan:
    """What a bench invocation will run, after defaults, validation and the no-GPU fallback."""

    suites: list[str]
    mode: str
    impls: list[str]
    device: str
    configs: list[Config]
    results_dir: Path
    notices: list[str] = field(default_factory=list)
    fallback: bool = False


def parse_impls(text: str | list[str] | None) -> list[str] | None:
    """``"fla,ref"`` or ``["fla", "ref"]`` -> ``["fla", "ref"]``, validated; None stays None."""
    from cula.bench.impls import IMPL_NAMES

    if text is None:
        return None
    parts = text if isinstance(text, list) else [text]
    names: list[str] = []
    for p in parts:
        for n in p.split(","):
            n = n.strip()
            if n and n not in names:
                names.append(n)
    bad = [n for n in names if n not in IMPL_NAMES]
    if bad:
        raise BenchError(f"unknown impl {bad[0]!r}; known impls: {', '.join(IMPL_NAMES)}")
    if not names:
        raise BenchError("--impl: expected at least one of " + ", ".join(IMPL_NAMES))
    return names


def resolve_plan(suites: list[str] | None, mode: str = "both", impls: list[str] | None = None,
                 device: str = "auto", results_dir: Path | None = None,
                 cuda_available: bool | None = None) -> Plan:
    """Validate a request and apply defaults. Without a GPU (``device="auto"``), GPU-only suites are
    replaced by the CPU ``smoke`` grid on the ``cula`` and ``ref`` impls, with a notice saying so."""
    from cula.bench.impls import flashkda_importable

    if mode not in ("fixed", "varlen", "both"):
        raise BenchError(f"--mode: expected fixed, varlen or both, got {mode!r}")
    if device not in ("auto", "cuda", "cpu"):
        raise BenchError(f"--device: expected auto, cuda or cpu, got {device!r}")
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    known = list_suites()
    for s in suites or []:
        if s not in known:
            raise BenchError(f"unknown suite {s!r}; known suites: {', '.join(known)}")
    notices: list[str] = []
    dev = ("cuda" if cuda_available else "cpu") if device == "auto" else device
    if dev == "cuda" and not cuda_available:
        raise BenchError("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    names = list(suites) if suites else (["kda"] if dev == "cuda" else ["smoke"])
    try:
        loaded = [load_suite(n) for n in names]
    except SuiteError as exc:
        raise BenchError(str(exc)) from None
    fallback = False
    gpu_only = [s.name for s in loaded if s.gpu_only]
    if dev == "cpu" and gpu_only:
        if device == "cpu":
            raise BenchError(f"suite {gpu_only[0]!r} needs a GPU; on CPU run --suite smoke")
        notices.append(
            f"No CUDA GPU found (torch.cuda.is_available() is False): suite(s) {', '.join(gpu_only)} "
            f"need a GPU, so this runs the CPU smoke grid instead (torch references via the cula and "
            f"ref impls). CPU results are kept out of the published tables.")
        loaded = [s for s in loaded if not s.gpu_only]
        if not any(s.name == "smoke" for s in loaded):
            loaded.append(load_suite("smoke"))
        fallback = True
    if impls is None:
        if dev == "cuda":
            impls = list(DEFAULT_GPU_IMPLS) + (["flashkda"] if flashkda_importable() else [])
        else:
            impls = list(CPU_IMPLS)
    elif dev == "cpu":
        dropped = [n for n in impls if n not in CPU_IMPLS]
        impls = [n for n in impls if n in CPU_IMPLS]
        if dropped:
            notices.append(f"impl(s) {', '.join(dropped)} need a GPU: skipped on CPU")
        if not impls:
            raise BenchError(f"--impl: none of the requested impls runs on CPU (CPU impls: {', '.join(CPU_IMPLS)})")
    configs: list[Config] = []
    seen: set[str] = set()
    for s in loaded:
        for c in s.select(mode):
            if c.config_id not in seen:
                seen.add(c.config_id)
                configs.append(c)
    if not configs:
        raise BenchError(f"no configs: suite(s) {', '.join(s.name for s in loaded)} have none in mode {mode!r}")
    rdir = Path(results_dir) if results_dir is not None else (GPU_RESULTS_DIR if dev == "cuda" else cpu_results_dir())
    return Plan(suites=[s.name for s in loaded], mode=mode, impls=list(impls), device=dev,
                configs=configs, results_dir=rdir, notices=notices, fallback=fallback)


def canonical_command(plan: Plan, settings: TimingSettings, quick: bool) -> str:
    """The command that reproduces the run (paths and resume flags left out), prefixed by the knob
    environment variables it ran with (``fingerprint.knob_env``)."""
    from cula.bench.fingerprint import knob_env

    parts = [*knob_env(), "cula bench"]
    for s in plan.suites:
        parts.append(f"--suite {s}")
    parts.append(f"--mode {plan.mode}")
    parts.append(f"--impl {','.join(plan.impls)}")
    if plan.device == "cpu":
        parts.append("--device cpu")
    if quick:
        parts.append("--quick")
    elif settings.max_time_s != TimingSettings().max_time_s:
        parts.append(f"--max-time {settings.max_time_s:g}")
    if settings.max_reps != (QUICK.max_reps if quick else TimingSettings().max_reps):
        parts.append(f"--max-reps {settings.max_reps}")
    if not settings.graphs:
        parts.append("--no-graph")
    if settings.flush != TimingSettings().flush:
        parts.append(f"--flush {settings.flush}")
    return " ".join(parts)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def base_row(cfg: Config, impl: str, run_id: str, fp: dict[str, Any], run_started: str,
             command: str, settings: TimingSettings, ceilings: tuple[float, float]) -> Row:
    """A row with the config, environment and run fields filled in; results still NaN."""
    lengths = list(cfg.lengths) if cfg.lengths else [cfg.T] * cfg.B
    row = Row(
        run_id=run_id, suite=cfg.suite, config_index=cfg.index, config_id=cfg.config_id,
        config_hash=cfg.config_hash, impl=impl, variant=cfg.variant, phase=cfg.phase, mode=cfg.mode,
        B=cfg.B, T=cfg.T, H=cfg.H, HV=cfg.HV, K=cfg.K, V=cfg.V, dtype=cfg.dtype, state=cfg.state,
        flags_json=json.dumps(dict(cfg.flags), sort_keys=True), dist=cfg.dist, n_seqs=cfg.num_seqs,
        seed=cfg.seed, lengths_json=json.dumps(list(cfg.lengths)), len_min=min(lengths),
        len_max=max(lengths), len_avg=sum(lengths) / len(lengths),
        tol_o=cfg.tol.get("o", math.nan), tol_state=cfg.tol.get("state", math.nan) if cfg.state or cfg.phase == "decode" else math.nan,
        tol_grad=cfg.tol.get("grad", math.nan) if cfg.phase == "train" else math.nan,
        ceil_tbps=ceilings[0], ceil_tflops=ceilings[1], run_started=run_started, command=command,
        settings_json=json.dumps(asdict(settings), sort_keys=True),
    )
    for key, val in fp.items():
        if hasattr(row, key):
            setattr(row, key, val)
    work = counting.count(cfg.variant, cfg.phase, B=cfg.B, T=cfg.T, H=cfg.H, HV=cfg.HV, K=cfg.K,
                          V=cfg.V, dtype=cfg.dtype, num_seqs=cfg.num_seqs, state=cfg.state)
    row.bytes, row.flops = work.bytes, work.flops
    return row


def _cuda_healthy(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    try:
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return _short(exc)


class FatalDeviceError(Exception):
    """The CUDA context is unusable (e.g. an illegal memory access): the run must stop."""


def measure_config(cfg: Config, impls: dict[str, Any], order: list[str], timer: Timer,
                   oracle: Callable[[Any], Any], device: str, row_for: Callable[[Config, str], Row],
                   skip: set[str] = frozenset(), reporter: Any = None) -> list[Row]:
    """Rows of ``cfg`` for the impls in ``order`` (minus ``skip``). Never raises for an impl's
    failure: it becomes the row's status; raises FatalDeviceError if the GPU is left unusable."""
    from cula.bench.correctness import compare, verdict
    from cula.bench.fingerprint import utc_now
    from cula.bench.impls import Unavailable, capture_warnings
    from cula.bench.inputs import build_inputs

    inputs = build_inputs(cfg, device)
    ref_out, oracle_name, oracle_err = None, "", ""
    try:
        ref_out, oracle_name = _oracle_with_retry(oracle, inputs, device)
    except Exception as exc:
        oracle_err = f"oracle failed: {_short(exc)}"
    rows: list[Row] = []
    fatal = None
    for name in order:
        if name in skip:
            continue
        row = row_for(cfg, name)
        row.oracle = oracle_name
        try:
            if fatal:
                raise Unavailable(f"not run: {fatal}")
            prepared = impls[name].prepare(inputs)
            row.backend = prepared.backend
            out, msgs = capture_warnings(prepared.call)
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
            notes = [prepared.note] + [m for m in msgs if "TracerWarning" not in m][:3]
            if ref_out is None:
                row.status, notes = FAIL, [oracle_err] + notes
            else:
                err = compare(prepared.post(out), ref_out)
                row.o_rel_l2, row.o_max_abs = err.o_rel_l2, err.o_max_abs
                row.state_rel_l2, row.state_max_abs = err.state_rel_l2, err.state_max_abs
                row.grad_rel_l2 = err.grad_rel_l2
                ok, why = verdict(err, {"o": row.tol_o, "state": row.tol_state, "grad": row.tol_grad})
                row.status = OK if ok else FAIL
                if not ok:
                    notes = [why] + notes
            del out
            row.note = " | ".join(n for n in notes if n)
            t = timer.eager(prepared.call)
            row.eager_ms, row.eager_p20_ms, row.eager_p80_ms, row.eager_reps = t.median_ms, t.p20_ms, t.p80_ms, t.reps
            g = timer.graph(prepared.call)
            row.graph_ms, row.graph_p20_ms, row.graph_p80_ms, row.graph_reps = g.median_ms, g.p20_ms, g.p80_ms, g.reps
            row.graph_note = g.note
            if row.eager_ms > 0:
                sec = row.eager_ms * 1e-3
                row.tbps = row.bytes / sec / 1e12
                row.tflops = row.flops / sec / 1e12
                row.pct_bw = 100.0 * row.tbps / row.ceil_tbps if row.ceil_tbps > 0 else math.nan
                row.pct_flops = 100.0 * row.tflops / row.ceil_tflops if row.ceil_tflops > 0 else math.nan
            del prepared
        except Unavailable as exc:
            row.status, row.note = UNAVAILABLE, str(exc)
        except Exception as exc:
            row.status, row.note = ERROR, _short(exc)
            broken = _cuda_healthy(device)
            if broken:
                fatal = f"CUDA context broken after {name}: {broken}"
                row.note += f" | {fatal}"
        if device == "cuda":
            _release_cached_memory()
            row.gpu_mem_used_gib, row.torch_alloc_gib = _memory_in_use()
        row.date = utc_now()
        rows.append(row)
    inputs.release()
    del ref_out
    if device == "cuda":
        gc.collect()  # drop reference cycles holding device memory before the next config's inputs
        _release_cached_memory()
    if fatal:
        raise FatalDeviceError(fatal, rows)
    return rows


def _release_cached_memory() -> None:
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:
        pass


def _memory_in_use() -> tuple[float, float]:
    """(GiB in use on the device, GiB in live torch tensors); NaN when CUDA cannot say."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30, torch.cuda.memory_allocated() / 2**30
    except Exception:
        return math.nan, math.nan


def _oracle_with_retry(oracle: Callable[[Any], Any], inputs: Any, device: str) -> Any:
    """The oracle's outputs; on a CUDA out-of-memory error, once more after freeing what can be freed
    (the fp32 reference of a long sequence is the largest allocation of a config). A second failure
    names the memory in use, so a leak across configs shows in the flagged row."""
    try:
        return oracle(inputs)
    except Exception as exc:
        if device != "cuda" or "out of memory" not in str(exc).lower():
            raise
    gc.collect()
    _release_cached_memory()
    try:
        return oracle(inputs)
    except Exception as exc:
        import torch

        free, total = torch.cuda.mem_get_info()
        held = torch.cuda.memory_allocated() / 2**30
        raise RuntimeError(f"{_short(exc)} (retried after freeing; {(total - free) / 2**30:.1f} GiB in use, "
                           f"{held:.1f} GiB held by torch tensors)") from exc


@dataclass
class RunResult:
    run_id: str
    rows: int
    configs_done: int
    configs_skipped: int
    results_dir: Path
    bundle: Path | None = None
    interrupted: bool = False


def execute(plan: Plan, settings: TimingSettings, *, quick: bool = False, resume: str | None = None,
            reporter: Any = None, impls: dict[str, Any] | None = None,
            oracle: Callable[[Any], Any] | None = None, out_dir: Path | None = None,
            fingerprint: dict[str, Any] | None = None,
            ceilings: tuple[float, float, str] | None = None) -> RunResult:
    """Run ``plan`` into its store; ``impls``/``oracle``/``fingerprint``/``ceilings`` are injectable
    for tests. Returns a summary; KeyboardInterrupt is re-raised after the finished rows are safe."""
    from cula.bench import fingerprint as fpmod
    from cula.bench.progress import PlainReporter

    reporter = reporter or PlainReporter()
    store = Store(plan.results_dir)
    if impls is None:
        from cula.bench.impls import registry

        impls = registry()
    if oracle is None:
        from cula.bench.correctness import default_oracle

        oracle = default_oracle
    fp = fingerprint if fingerprint is not None else fpmod.collect(plan.device)
    done: set[tuple[str, str]] = set()
    if resume:
        if not store.exists(resume):
            known = store.list_runs()
            raise BenchError(f"unknown run id {resume!r} in {plan.results_dir}"
                             + (f"; stored runs: {', '.join(known[-5:])}" if known else ""))
        meta = store.read_meta(resume)
        if meta.get("gpu_name") and meta["gpu_name"] != fp.get("gpu_name"):
            raise BenchError(f"--resume {resume}: run was on {meta['gpu_name']}, this machine is {fp.get('gpu_name')}")
        run_id = resume
        done = store.done_pairs(run_id)
        run_started = meta.get("run_started", fpmod.utc_now())
        command = meta.get("command") or canonical_command(plan, settings, quick)
    else:
        run_id = new_run_id(fpmod.gpu_slug(str(fp.get("gpu_name", ""))), str(fp.get("cula_sha", "")))
        run_started = fpmod.utc_now()
        command = canonical_command(plan, settings, quick)
    if ceilings is None:
        reporter.message("measuring ceilings (device copy bandwidth, matmul throughput) ...")
        from cula.bench.timing import measure_ceilings

        ceilings = measure_ceilings(plan.device)
    reporter.message(f"ceilings: copy {ceilings[0]:.3g} TB/s, matmul {ceilings[1]:.3g} TFLOP/s ({ceilings[2]})")
    meta = {"run_id": run_id, "run_started": run_started, "command": command, "suites": plan.suites,
            "mode": plan.mode, "impls": plan.impls, "device": plan.device,
            "settings": asdict(settings), "ceilings": list(ceilings), "status": "running", **fp}
    store.start_run(run_id, meta)
    timer = Timer(plan.device, settings)

    def row_for(cfg: Config, name: str) -> Row:
        return base_row(cfg, name, run_id, fp, run_started, command, settings, (ceilings[0], ceilings[1]))

    todo = [c for c in plan.configs if any((c.config_id, n) not in done for n in plan.impls)]
    skipped = len(plan.configs) - len(todo)
    if skipped:
        reporter.message(f"resume {run_id}: {skipped} configs already stored, {len(todo)} to go")
    n_rows = 0
    interrupted = False
    reporter.start(len(todo), plan.impls)
    try:
        for cfg in todo:
            reporter.config_started(cfg.config_id)
            skip = {n for n in plan.impls if (cfg.config_id, n) in done}
            try:
                rows = measure_config(cfg, impls, plan.impls, timer, oracle, plan.device, row_for, skip)
            except FatalDeviceError as exc:
                store.append(run_id, exc.args[1])
                reporter.config_done(cfg.config_id, exc.args[1])
                raise BenchError(f"{exc.args[0]}; finished rows are stored, continue with "
                                 f"`cula bench --resume {run_id}` in a fresh process") from None
            store.append(run_id, rows)
            n_rows += len(rows)
            reporter.config_done(cfg.config_id, rows)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        reporter.finish()
        timer.release()
    meta["status"] = "interrupted" if interrupted else "complete"
    store.write_meta(run_id, meta)
    bundle = None
    if not interrupted:
        bundle = store.bundle(run_id, compact=True)
        if out_dir is not None:
            bundle = store.bundle(run_id, Path(out_dir))
    result = RunResult(run_id=run_id, rows=n_rows, configs_done=len(todo) if not interrupted else -1,
                       configs_skipped=skipped, results_dir=plan.results_dir, bundle=bundle,
                       interrupted=interrupted)
    if interrupted:
        raise KeyboardInterrupt(run_id)
    return result

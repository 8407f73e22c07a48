"""``cula``: the command line of the benchmark service (bench, report, gate, suites, runs, env).

Thin by design: every command validates its arguments, calls the library and prints. User errors
(unknown suite / impl / run id, no GPU for a GPU-only suite, unreadable data, mixed GPU types) are
one line on stderr with exit code 2 and no traceback; set ``CULA_DEBUG=1`` to see tracebacks.
"""

from __future__ import annotations

import os

# The fla impl must be FLA's Triton path: set before anything can import fla.
os.environ["FLA_FLASH_KDA"] = "0"

import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import typer  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="cula benchmark service: run suites, render BENCHMARK_*.md, gate regressions.")

EXIT_USAGE = 2


class CliError(Exception):
    """A one-line user error (exit code 2)."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from cula.bench.runner import BenchError
    from cula.bench.store import StoreError
    from cula.suites import SuiteError
    from cula.reports.data import ReportError

    return (CliError, BenchError, StoreError, SuiteError, ReportError)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(EXIT_USAGE)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one-line messages with exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except _user_errors() as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # unexpected: still no traceback unless asked
            if os.environ.get("CULA_DEBUG"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (set CULA_DEBUG=1 for the traceback)")
    return wrapper


# ---------------------------------------------------------------------------------------- bench
@app.command()
@friendly
def bench(
    suite: Optional[list[str]] = typer.Option(None, "--suite", "-s", help="Suite name (repeatable). Default: kda on a GPU, smoke on CPU."),
    mode: str = typer.Option("both", "--mode", "-m", help="fixed | varlen | both"),
    impl: Optional[str] = typer.Option(None, "--impl", "-i", help="Comma-separated impls: cula, fla, flashkda, ref. Default: cula,fla (+flashkda if importable); CPU: cula,ref."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu. auto without a GPU runs the CPU smoke grid."),
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue run RUN_ID, skipping stored (config, impl) rows."),
    quick: bool = typer.Option(False, "--quick", help="Short timing: <= 10 reps, <= 0.25 s per impl and mode."),
    max_time: Optional[float] = typer.Option(None, "--max-time", help="Seconds of timed calls per impl, config and mode (default 1.0)."),
    max_reps: Optional[int] = typer.Option(None, "--max-reps", help="Most timed calls per impl, config and mode (default 50)."),
    no_graph: bool = typer.Option(False, "--no-graph", help="Skip the CUDA-graph timing."),
    flush: str = typer.Option("write", "--flush", help="How L2 is emptied before each timed call: write (zero 256 MiB, as triton's do_bench; a read-only pass was tried and does not evict on the H200)."),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Store root. Default: reports/results (GPU), ~/.cache/cula/results (CPU)."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Also write the finished run as one parquet file <run_id>.parquet here."),
    plain: bool = typer.Option(False, "--plain", help="Plain progress lines even on a terminal."),
) -> None:
    """Run benchmark suites and store one row per (config, impl)."""
    from dataclasses import replace

    from cula.bench.progress import make_reporter
    from cula.bench.runner import QUICK, execute, parse_impls, resolve_plan
    from cula.bench.store import Store
    from cula.bench.timing import FLUSH_MODES, TimingSettings

    impls = parse_impls(impl)
    if resume and (suite is None or impls is None):
        # Take what the run was started with, unless given again.
        from cula.bench.runner import GPU_RESULTS_DIR, cpu_results_dir

        roots = [results_dir] if results_dir else [GPU_RESULTS_DIR, cpu_results_dir()]
        meta = None
        for root in roots:
            st = Store(root)
            if st.exists(resume):
                meta, results_dir = st.read_meta(resume), root
                break
        if meta is None:
            raise CliError(f"unknown run id {resume!r} (looked in {', '.join(str(r) for r in roots)})")
        suite = suite or meta.get("suites")
        impls = impls or meta.get("impls")
        if mode == "both" and meta.get("mode"):
            mode = meta["mode"]
        if device == "auto" and meta.get("device"):
            device = meta["device"]
    if max_time is not None and not max_time > 0:
        raise CliError(f"--max-time: expected seconds > 0, got {max_time}")
    if flush not in FLUSH_MODES:
        raise CliError(f"--flush: expected one of {', '.join(FLUSH_MODES)}, got {flush!r}")
    if max_reps is not None and max_reps < 1:
        raise CliError(f"--max-reps: expected an integer >= 1, got {max_reps}")
    plan = resolve_plan(suite, mode, impls, device, results_dir)
    settings = QUICK if quick else TimingSettings()
    if max_time is not None:
        settings = replace(settings, max_time_s=max_time)
    if max_reps is not None:
        settings = replace(settings, max_reps=max_reps, min_reps=min(settings.min_reps, max_reps))
    if no_graph:
        settings = replace(settings, graphs=False)
    if flush != settings.flush:
        settings = replace(settings, flush=flush)
    reporter = make_reporter(force_plain=plain)
    for notice in plan.notices:
        reporter.message(f"NOTE: {notice}")
    reporter.message(f"suites {', '.join(plan.suites)} (mode {plan.mode}): {len(plan.configs)} configs; "
                     f"impls {', '.join(plan.impls)}; device {plan.device}; store {plan.results_dir}")
    try:
        res = execute(plan, settings, quick=quick, resume=resume, reporter=reporter, out_dir=out_dir)
    except KeyboardInterrupt as exc:
        run_id = exc.args[0] if exc.args else "?"
        typer.echo(f"\ninterrupted: finished configs are stored; continue with "
                   f"`cula bench --resume {run_id}`", err=True)
        raise typer.Exit(130)
    typer.echo(f"run {res.run_id}: {res.rows} rows stored in {res.bundle or res.results_dir}")
    if out_dir is not None and res.bundle is not None:
        typer.echo(f"bundle for transfer: {res.bundle} (copy it into reports/results/)")
    if plan.device == "cpu":
        typer.echo("CPU run: kept out of the published BENCHMARK_*.md (the report only takes GPU rows).")
    else:
        typer.echo("render the tables with: cula report")


# --------------------------------------------------------------------------------------- report
@app.command()
@friendly
def report(
    run: Optional[list[str]] = typer.Option(None, "--run", "-r", help="Render these run ids only (repeatable). Default: the latest run per suite."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="H200 or GB200: render only this file."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Write the markdown here instead of the repository file ('-' = stdout)."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if a committed BENCHMARK file differs from what the stored data renders."),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Store root (default reports/results)."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help="Skip unreadable result files (named on stderr) instead of failing."),
    no_chart: bool = typer.Option(False, "--no-chart", help="Do not draw the speedup PNG."),
    root: Optional[Path] = typer.Option(None, "--root", help="Folder of the BENCHMARK_*.md files (default: the repository root)."),
) -> None:
    """Render BENCHMARK_H200.md / BENCHMARK_GB200.md (+ speedup PNG) from the stored runs."""
    from cula.reports.data import REPO_ROOT, TARGETS, load_runs, select
    from cula.reports.render import chart_series, render, target_path, write_report

    if gpu is not None and gpu not in TARGETS:
        raise CliError(f"--gpu: expected one of {', '.join(TARGETS)}, got {gpu!r}")
    runs, skipped = load_runs(results_dir, run, skip_corrupt)
    for s in skipped:
        typer.echo(f"warning: skipped corrupted result file {s}", err=True)
    if run:
        kinds = []
        for r in runs:
            names = {x.gpu_name for x in r.rows}
            cuda_names = {x.gpu_name.upper() for x in r.rows if x.device_kind == "cuda"}
            kind = [k for k in TARGETS if any(k in n for n in cuda_names)]
            if not kind:
                raise CliError(f"run {r.run_id} is on {', '.join(sorted(names))}: no published file takes it")
            kinds.extend(k for k in kind if k not in kinds)
        if not runs:
            raise CliError("the given runs hold no rows")
        targets = [gpu] if gpu else kinds
    else:
        targets = [gpu] if gpu else list(TARGETS)
    if check:
        stale = []
        for kind in targets:
            sel = select(runs, kind, explicit=bool(run))
            path = target_path(kind, root or REPO_ROOT)
            chart = path.stem + "_speedup.png" if (chart_series(sel) if not sel.empty else []) else None
            text = render(sel, chart)
            current = path.read_text() if path.is_file() else None
            if current != text:
                stale.append(path.name)
                why = "missing" if current is None else "differs from the stored data"
                typer.echo(f"{path.name}: {why}; run `cula report` and commit it", err=True)
            else:
                typer.echo(f"{path.name}: up to date")
        raise typer.Exit(1 if stale else 0)
    if out is not None:
        if len(targets) != 1:
            raise CliError(f"--out writes one file: choose it with --gpu ({', '.join(targets)})")
        sel = select(runs, targets[0], explicit=bool(run))
        if out == "-":
            typer.echo(render(sel, None), nl=False)
            return
        text, chart = write_report(sel, Path(out), draw_chart=not no_chart)
        typer.echo(f"wrote {out}" + (f" and {chart}" if chart else ""))
        return
    for kind in targets:
        sel = select(runs, kind, explicit=bool(run))
        path = target_path(kind, root or REPO_ROOT)
        _, chart = write_report(sel, path, draw_chart=not no_chart)
        what = "no run recorded yet" if sel.empty else f"{len(sel.suites)} suite(s) from {len(sel.runs)} run(s)"
        typer.echo(f"wrote {path.name}: {what}" + (f"; chart {chart.name}" if chart else ""))


# ----------------------------------------------------------------------------------------- gate
@app.command()
@friendly
def gate(
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="Baseline run id (default: the newest committed run on the same GPU)."),
    candidate: Optional[str] = typer.Option(None, "--candidate", "-c", help="Candidate run id (default: the newest stored run)."),
    threshold: float = typer.Option(0.05, "--threshold", help="Smallest slowdown that counts (0.05 = 5%)."),
    noise_k: float = typer.Option(2.0, "--noise-k", help="Allowed slowdown is at least noise_k x the combined p20-p80 half-spread."),
    metric: str = typer.Option("eager", "--metric", help="eager | graph | both"),
    impl: str = typer.Option("cula", "--impl", help="Comma-separated impls to gate."),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Store root (default reports/results)."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help="Skip unreadable result files instead of failing."),
    show_all: bool = typer.Option(False, "--all", help="List every compared row, not only what moved."),
) -> None:
    """Compare a candidate run with a baseline: exit 0 pass, 1 regression, 2 unusable data."""
    from cula.bench.runner import parse_impls
    from cula.reports.gate import GateOptions, compare_runs, resolve_runs

    if not threshold >= 0:
        raise CliError(f"--threshold: expected a fraction >= 0, got {threshold}")
    impls = tuple(parse_impls(impl) or ())
    base, cand = resolve_runs(baseline, candidate, results_dir, skip_corrupt)
    result = compare_runs(base, cand, GateOptions(threshold=threshold, noise_k=noise_k, metric=metric, impls=impls))
    typer.echo(f"baseline {base.run_id}  ->  candidate {cand.run_id}")
    shown = [c for c in result.changes if show_all or c.verdict != "ok"]
    if shown:
        _print_gate_table(shown)
    typer.echo(result.message)
    raise typer.Exit(result.code)


def _print_gate_table(changes: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_edge=False, header_style="bold")
    for col in ("config", "impl", "metric", "base ms", "cand ms", "change", "allowed", "verdict", "note"):
        table.add_column(col, justify="right" if col in ("base ms", "cand ms", "change", "allowed") else "left")

    def f(x: float, pct: bool = False) -> str:
        if x is None or math.isnan(x):
            return "-"
        return f"{x * 100:+.1f}%" if pct else f"{x:.4f}"
    for c in changes:
        style = "red" if c.is_regression else "green" if c.verdict == "improved" else ""
        table.add_row(c.config_id, c.impl, c.metric, f(c.base_ms), f(c.cand_ms), f(c.change, True),
                      "-" if math.isnan(c.allowed) else f"{c.allowed * 100:.1f}%",
                      f"[{style}]{c.verdict}[/{style}]" if style else c.verdict, c.note, )
    Console(width=max(160, Console().width)).print(table)


# --------------------------------------------------------------------------------- suites / runs
@app.command()
@friendly
def suites() -> None:
    """List the suites with their config counts."""
    from cula.suites import list_suites, load_suite

    typer.echo(f"{'suite':<10} {'device':<6} {'fixed':>5} {'varlen':>6} {'total':>5}  description")
    for name in list_suites():
        s = load_suite(name)
        c = s.counts()
        typer.echo(f"{name:<10} {'gpu' if s.gpu_only else 'any':<6} {c['fixed']:>5} {c['varlen']:>6} "
                   f"{len(s.configs):>5}  {s.description}")


@app.command()
@friendly
def runs(
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Store root (default reports/results)."),
    cpu: bool = typer.Option(False, "--cpu", help="List the CPU store (~/.cache/cula/results) instead."),
) -> None:
    """List the stored runs (id, GPU, suites, rows, status)."""
    from cula.bench.runner import GPU_RESULTS_DIR, cpu_results_dir
    from cula.bench.store import Store, StoreError

    store = Store(results_dir or (cpu_results_dir() if cpu else GPU_RESULTS_DIR))
    ids = store.list_runs()
    if not ids:
        typer.echo(f"no runs in {store.root}")
        return
    for rid in ids:
        try:
            data = store.read_run(rid, skip_corrupt=True)
        except StoreError as exc:
            typer.echo(f"{rid}  unreadable: {exc}")
            continue
        gpus = ", ".join(sorted({r.gpu_name for r in data.rows})) or data.meta.get("gpu_name", "?")
        suites_ = ", ".join(sorted({r.suite for r in data.rows})) or "-"
        status = data.meta.get("status", "?")
        extra = f"  ({len(data.skipped)} unreadable file(s))" if data.skipped else ""
        typer.echo(f"{rid}  {gpus}  suites {suites_}  {len(data.rows)} rows  {status}{extra}")


@app.command()
@friendly
def env(device: str = typer.Option("auto", "--device", help="auto | cuda | cpu")) -> None:
    """Print the environment fingerprint stamped on every row, and cula's backends."""
    import torch

    from cula.bench.fingerprint import collect

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dev not in ("cuda", "cpu"):
        raise CliError(f"--device: expected auto, cuda or cpu, got {device!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA GPU is visible")
    for key, val in collect(dev).items():
        typer.echo(f"{key:<12} {val}")
    typer.echo("")
    typer.echo(_describe_backends())


def _describe_backends() -> str:
    try:
        import cula
    except Exception as exc:  # pragma: no cover - cula itself always imports
        return f"backends: cannot import cula ({exc})"
    fn = getattr(cula, "backends", None)
    if fn is None:
        return "backends: cula.backends() is not available in this checkout yet"
    try:
        info = fn()
    except TypeError:
        from cula.bench.impls import OPS

        lines = []
        for (_, _), entry in sorted(OPS.items()):
            op = entry["cula"][1]
            try:
                lines.append(f"  {op}: {fn(op)}")
            except Exception as exc:
                lines.append(f"  {op}: ({type(exc).__name__}: {exc})")
        return "backends:\n" + "\n".join(lines)
    except Exception as exc:
        return f"backends: cula.backends() failed: {type(exc).__name__}: {exc}"
    if isinstance(info, dict):
        lines = []
        for op, statuses in info.items():
            parts = []
            for st in statuses if isinstance(statuses, (list, tuple)) else [statuses]:
                name = getattr(st, "backend", st)
                if getattr(st, "available", True):
                    parts.append(f"{name} (usable)")
                else:
                    parts.append(f"{name} (no: {getattr(st, 'reason', '?')})")
            lines.append(f"  {op}: " + ", ".join(str(p) for p in parts))
        return "backends (dispatch order, on this machine):\n" + "\n".join(lines)
    return f"backends: {info}"


def main() -> None:
    """Console-script entry point (``cula = cula.cli.app:main``)."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

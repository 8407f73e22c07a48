"""Progress display of a benchmark run: a rich live view on a terminal, plain log lines otherwise.

The live view shows a progress bar with ETA and a table of the latest finished configs (one column
per impl, eager ms, marks for failed correctness). Headless (no TTY: CI, the device machine) it
prints one flushed line per finished config, with the elapsed time and an ETA.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from cula.bench.schema import ERROR, FAIL, OK, UNAVAILABLE, Row


def fmt_ms(row: Row) -> str:
    """Short cell for a row: eager ms (+ graph ms), or its status."""
    if row.status == UNAVAILABLE:
        return "n/a"
    if row.status == ERROR:
        return "error"
    cell = f"{row.eager_ms:.3f}" if not math.isnan(row.eager_ms) else "-"
    if not math.isnan(row.graph_ms):
        cell += f" (g {row.graph_ms:.3f})"
    if row.status == FAIL:
        cell += " FAIL"
    return cell


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class PlainReporter:
    """One line per event, flushed: safe for logs and pipes."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = 0
        self.done = 0
        self.t0 = time.perf_counter()

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, total: int, impls: list[str]) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.message(f"running {total} configs x impls {','.join(impls)}")

    def _eta(self) -> str:
        elapsed = time.perf_counter() - self.t0
        if self.done == 0:
            return "?"
        return fmt_duration(elapsed / self.done * (self.total - self.done))

    def config_done(self, config_id: str, rows: list[Row]) -> None:
        self.done += 1
        cells = "  ".join(f"{r.impl}={fmt_ms(r)}" for r in rows)
        elapsed = fmt_duration(time.perf_counter() - self.t0)
        width = len(str(self.total))
        self.message(f"[{self.done:>{width}}/{self.total}] {config_id}  {cells}  "
                     f"(elapsed {elapsed}, eta {self._eta()})")
        for r in rows:
            if r.status in (FAIL, ERROR) and r.note:
                self.message(f"    {r.impl}: {r.status}: {r.note}")

    def config_started(self, config_id: str) -> None:
        pass

    def finish(self) -> None:
        pass

    def __enter__(self) -> "PlainReporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


class RichReporter(PlainReporter):
    """rich Live view: progress bar with ETA over a table of the last finished configs."""

    MAX_ROWS = 12

    def __init__(self) -> None:
        super().__init__()
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.console = Console()
        self.progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 console=self.console)
        self.current = ""
        self.task = None
        self.recent: list[tuple[str, list[Row]]] = []
        self.impls: list[str] = []
        self.live = None

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        table = Table(show_edge=False, header_style="bold",
                      caption=f"running {self.current}" if self.current else None)
        table.add_column("config")
        for name in self.impls:
            table.add_column(f"{name} ms", justify="right")
        for cid, rows in self.recent[-self.MAX_ROWS:]:
            by_impl = {r.impl: r for r in rows}
            cells = []
            for name in self.impls:
                r = by_impl.get(name)
                text = fmt_ms(r) if r else ""
                if r and r.status in (FAIL, ERROR):
                    text = f"[red]{text}[/red]"
                elif r and r.status == OK:
                    text = f"[green]{text}[/green]"
                cells.append(text)
            table.add_row(cid, *cells)
        return Group(self.progress, table)

    def message(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, markup=False, highlight=False)
        else:
            self.console.print(text, markup=False, highlight=False)

    def start(self, total: int, impls: list[str]) -> None:
        from rich.live import Live

        self.total, self.impls = total, list(impls)
        self.task = self.progress.add_task("", total=total)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def config_started(self, config_id: str) -> None:
        self.current = config_id
        if self.live is not None:
            self.live.update(self._render())

    def config_done(self, config_id: str, rows: list[Row]) -> None:
        self.done += 1
        self.current = ""
        self.recent.append((config_id, rows))
        if self.task is not None:
            self.progress.advance(self.task)
        if self.live is not None:
            self.live.update(self._render())
        for r in rows:
            if r.status in (FAIL, ERROR) and r.note:
                self.message(f"  {config_id} {r.impl}: {r.status}: {r.note}")

    def finish(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def make_reporter(force_plain: bool = False) -> PlainReporter:
    """Rich live view when stdout is a terminal, plain lines otherwise."""
    if not force_plain and sys.stdout.isatty():
        try:
            return RichReporter()
        except Exception:
            pass
    return PlainReporter()

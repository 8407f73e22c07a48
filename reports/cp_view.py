"""The context-parallel section of the report: strong scaling and the multi-GPU correctness checks.

Rows come from ``python -m cula.cp.multigpu`` (suites ``cp_scaling`` and ``cp_check``): one row per
(variant, T, world size W); W = 1 is the plain single-GPU op, the baseline of the speedup. Their timing is
different from the single-GPU suites (barrier-to-barrier wall time of one forward on all ranks), so they
get their own tables rather than a suite view.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cula.bench.schema import FAIL, OK, Row

if TYPE_CHECKING:
    from cula.reports.render import Table

CP_SUITES = ("cp_scaling", "cp_check")


def _flags(r: Row) -> dict:
    return json.loads(r.flags_json or "{}")


def _ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


@dataclass
class CPView:
    run_ids: list[str]
    setup: str
    scaling: list[tuple[str, Table]]  # (variant and impl, table)
    checks: Table | None
    failures: list[str]


def cp_view(scaling: list[Row], checks: list[Row]) -> CPView:
    """Tables from the rows of one ``cp_scaling`` run and one ``cp_check`` run (not both empty)."""
    from cula.reports.render import Table

    rows = scaling + checks
    first = rows[0]
    flags = _flags(first)
    setup = (f"{first.dtype}, H={first.H}, K={first.K}, V={first.V}, scan={flags.get('scan', '?')}, "
             f"KDA identity response: {flags.get('identity_columns', '?')}; one sequence of T tokens split "
             f"evenly over W GPUs (NCCL); median of {json.loads(first.settings_json or '{}').get('reps', '?')} "
             f"barrier-to-barrier timings of one forward on all ranks")
    tables = []
    for variant, impl in sorted({(r.variant, r.impl) for r in scaling}):
        mine = [r for r in scaling if r.variant == variant and r.impl == impl]
        ws = sorted({_flags(r)["world_size"] for r in mine})
        base = {r.T: r.eager_ms for r in mine if _flags(r)["world_size"] == 1}
        headers = ["T"] + [f"W={w} ms" for w in ws]
        top = [w for w in ws if w > 1]
        for w in top:
            headers += [f"W={w} speedup", f"W={w} efficiency", f"W={w} local forward alone ms"]
        headers.append(f"ns/token at W={ws[-1]}")
        body = []
        for T in sorted({r.T for r in mine}):
            by_w = {_flags(r)["world_size"]: r for r in mine if r.T == T}
            cells = [str(T)] + [(_ms(by_w[w].eager_ms) if by_w[w].status == OK else by_w[w].status)
                                if w in by_w else "-" for w in ws]
            for w in top:
                r = by_w.get(w)
                sp = base.get(T, math.nan) / r.eager_ms if r is not None and r.eager_ms > 0 else math.nan
                cells += ["-" if math.isnan(sp) else f"{sp:.2f}x", "-" if math.isnan(sp) else f"{sp / w:.0%}",
                          _ms(_flags(r).get("local_forward_ms")) if r is not None else "-"]
            last = by_w.get(ws[-1])
            cells.append(f"{last.eager_ms * 1e6 / T:.1f}" if last is not None and last.eager_ms > 0 else "-")
            body.append(cells)
        # "cula.cp over cula (cula-sm90)": the part in brackets is the backend dispatch picked locally
        local = sorted({r.backend.split("(", 1)[1].rstrip(")") for r in mine if "(" in (r.backend or "")})
        title = f"{variant} ({impl}" + (f"; local op: {', '.join(local)}" if local else "") + ")"
        tables.append((title, Table(headers, body, ["r"] * len(headers))))
    check_table = None
    failures = []
    if checks:
        body = []
        for r in sorted(checks, key=lambda r: (r.variant, r.config_index)):
            f = _flags(r)
            body.append([r.variant, r.impl, r.dist, r.lengths_json, str(f.get("world_size")),
                         f"{r.o_rel_l2:.2e}", f"{f.get('o_one_vs_ref', math.nan):.2e}", f"{r.state_rel_l2:.2e}",
                         f"{f.get('state_one_vs_ref', math.nan):.2e}", f"{f.get('o_cp_vs_one', math.nan):.2e}",
                         "pass" if r.status == OK else f"**{r.status}**"])
            if r.status == FAIL:
                failures.append(f"`{r.config_id}` {r.impl}: **{r.status}** - {r.note or 'tolerance missed'}")
        check_table = Table(
            ["variant", "impl", "input", "lengths", "W", "o: CP", "o: one GPU", "state: CP", "state: one GPU",
             "o: CP vs one GPU", "result"],
            body, ["l", "l", "l", "l", "r", "r", "r", "r", "r", "r", "l"])
    run_ids = sorted({r.run_id for r in rows})
    return CPView(run_ids, setup, tables, check_table, failures)

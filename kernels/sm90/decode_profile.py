"""A few decode calls of one shape, for a profiler to attach to, or timed under a CUDA graph.

    ncu --clock-control none -k regex:Decode --launch-count 1 \\
        python3 -m cula.kernels.sm90.decode_profile --variant kda --B 64 --H 32 [--flags serving|bare]
    python3 -m cula.kernels.sm90.decode_profile --time --variant kda --B 64 --H 32 --flags bare

``--flags bare`` runs KDA without the in-kernel gate, l2 norms and beta sigmoid (log-space g and a
plain beta given), so the time against ``serving`` says what the per-token prologue costs.
``--time`` prints the CUDA-graph time per call (``decode_bench.graph_time`` over input sets rotated as
``decode_bench.bench_case`` rotates them, so the states do not sit in L2) and the same-size copy's.
"""

from __future__ import annotations

import argparse

import torch

from cula.kernels.sm90 import decode_bench as db


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="kda", choices=("kda", "lightning"))
    ap.add_argument("--B", type=int, nargs="+", default=[64], help="batch sizes (several: timed one by one)")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--flags", default="serving", choices=("serving", "bare"))
    ap.add_argument("--time", action="store_true")
    a = ap.parse_args(argv)
    flags = {}
    if a.variant == "kda" and a.flags == "serving":
        flags = db.KDA_SERVING_FLAGS
    if not a.time:
        case = db.DecodeCase(a.variant, a.B[0], 1, a.H, a.H, flags=flags)
        call = db.cula_call(case, db.make_inputs(case))
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        return 0
    for B in a.B:
        case = db.DecodeCase(a.variant, B, 1, a.H, a.H, flags=flags)
        n = max(2, min(32, (256 << 20) // db.state_bytes(case)))
        sets = [db.make_inputs(db.DecodeCase(**{**case.__dict__, "seed": i})) for i in range(n)]
        calls = [db.cula_call(case, s) for s in sets]
        copies = [db.copy_call(case, s) for s in sets]
        us = db.graph_time(calls) * 1e6
        copy_us = db.graph_time(copies) * 1e6
        print(f"decode_profile {case.label} flags={a.flags}: graph {us:.2f} us, same-size copy {copy_us:.2f} us, "
              f"{100 * copy_us / us:.1f}% of it")
        del sets, calls, copies
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

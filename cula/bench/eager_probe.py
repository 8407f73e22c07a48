"""Where an eager row's time goes: host time inside the timer's loop, and the GPU timeline around the op.

The ``decode`` suite run ``20261203-104726`` timed Lightning decode at B1 H8 at 28.5 µs eager against 6.0
µs under a CUDA graph, while KDA decode at the same shape took 6.2 µs eager: with the 256 MiB flush
before every call the host has ~80 µs of slack, so an eager time above the graph time means the GPU
waited on something. This probe replays the timer's eager loop for one suite config and prints

1. the host microseconds of the op call alone (no flush; the GPU is not waited on),
2. per loop iteration: host µs of the flush launch, the start event, the call and the end event, and
   the event-timed call (what the suite records),
3. a ``torch.profiler`` trace of a few iterations: every GPU kernel with its start relative to the
   iteration's flush kernel and its duration, so extra kernels or an idle gap before the op show.

``python -m cula.bench.eager_probe --variant lightning --B 1 --H 8`` (needs a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _config(variant: str, B: int, H: int):
    from cula.suites.grid import load_configs

    for cfg in load_configs(["decode"]):
        if cfg.variant == variant and cfg.B == B and cfg.H == H:
            return cfg
    raise SystemExit(f"no decode config {variant} B{B} H{H}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="lightning")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)

    from cula.bench.impls import TableImpl
    from cula.bench.inputs import build_inputs
    from cula.bench.timing import Timer

    cfg = _config(args.variant, args.B, args.H)
    fn = TableImpl("cula").prepare(build_inputs(cfg, "cuda")).call
    fn()
    torch.cuda.synchronize()
    timer = Timer("cuda")

    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn()
    host_alone = (time.perf_counter() - t0) / args.iters * 1e6
    torch.cuda.synchronize()

    parts: list[tuple[float, float, float, float]] = []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    for i in range(args.iters):
        a = time.perf_counter()
        timer._flush()
        b = time.perf_counter()
        starts[i].record()
        c = time.perf_counter()
        fn()
        d = time.perf_counter()
        ends[i].record()
        e = time.perf_counter()
        parts.append(((b - a) * 1e6, (c - b) * 1e6, (d - c) * 1e6, (e - d) * 1e6))
    torch.cuda.synchronize()
    timed = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    med = [statistics.median(p[j] for p in parts) for j in range(4)]
    print(f"{cfg.config_id if hasattr(cfg, 'config_id') else cfg}: host µs per call alone {host_alone:.1f}; "
          f"in the loop (median) flush {med[0]:.1f}, start event {med[1]:.1f}, call {med[2]:.1f}, "
          f"end event {med[3]:.1f}; event-timed call median {statistics.median(timed):.1f} µs "
          f"(p20 {sorted(timed)[len(timed) // 5]:.1f}, p80 {sorted(timed)[4 * len(timed) // 5]:.1f})", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            timer._flush()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t_ref = None
    for e in kernels:
        if "zero" in e.name.lower() or "fill" in e.name.lower():
            t_ref = e.time_range.start
        rel = e.time_range.start - t_ref if t_ref is not None else float("nan")
        print(f"  +{rel:9.1f} µs  {e.time_range.elapsed_us():8.1f} µs  {e.name[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Inputs, exact references and timing for the decode kernels (``kda_decode``, ``lightning_decode``).

Shared by the GPU tests (``tests/test_kernel_*_decode.py``), the kernels' ``--check`` mains and the
device benchmark (``python -m cula.kernels.sm90.decode_bench``), which times our kernels against FLA
0.6.0's ``fused_recurrent_kda`` / ``fused_recurrent_simple_gla`` in one process:

- ``graph``: per call, from replaying a CUDA graph of ``CALLS`` calls that each touch their own state
  and inputs (a rotation deeper than the 60 MB L2), i.e. the steady state of a model's decode step;
- ``eager``: per call, wall clock of back-to-back eager calls (includes the host's launch work);
- ``host``: per call, host time of the Python call alone (the GPU is not waited on);
- bandwidth: the state bytes read + written per call over the graph time, against the measured
  device-to-device copy rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cula.bench.timing import event_ms

# ------------------------------------------------------------------------------------------- inputs


@dataclass
class DecodeCase:
    """One decode problem: sizes, layout, pool mode and (KDA) flags."""

    variant: str  # "kda" or "lightning"
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    dtype: torch.dtype = torch.bfloat16
    state_v_first: bool = False
    pool: str = "plain"  # "plain" (h0 [B]), "none" (no h0), "pool" (indices, out of place), "inplace"
    flags: dict[str, Any] = field(default_factory=dict)
    g_dtype: torch.dtype = torch.float32
    seed: int = 0

    @property
    def label(self) -> str:
        lay = "vfirst" if self.state_v_first else "kfirst"
        return f"{self.variant}-B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-{lay}-{self.pool}"


KDA_SERVING_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


def make_inputs(case: DecodeCase, device: str = "cuda") -> dict[str, Any]:
    """Random inputs of ``case`` as the host function's keyword arguments (pool of 2B+3 slots)."""
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    def uni(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    q = rnd(B, T, H, K, dtype=case.dtype)
    k = rnd(B, T, H, K)
    v = rnd(B, T, HV, V, dtype=case.dtype)
    inputs: dict[str, Any] = {"q": q, "v": v}
    flags = dict(case.flags)
    if case.variant == "kda":
        if not flags.get("use_qk_l2norm_in_kernel"):
            k = F.normalize(k, dim=-1)  # an unnormalised delta rule blows up; FLA's tests do the same
        raw_gate = flags.get("use_gate_in_kernel", False)
        g = rnd(B, T, HV, K) if raw_gate else F.logsigmoid(rnd(B, T, HV, K) + 2.0)
        inputs["g"] = g.to(case.g_dtype)
        if flags.get("use_beta_sigmoid_in_kernel"):
            inputs["beta"] = rnd(B, T, HV, dtype=case.dtype)
        else:
            inputs["beta"] = uni(B, T, HV).to(case.dtype)
        if raw_gate:
            inputs["A_log"] = torch.log(uni(HV) * 15 + 1)
            inputs["dt_bias"] = rnd(HV * K, scale=0.5)
        inputs.update(flags)
        inputs["state_v_first"] = case.state_v_first
    else:
        inputs["decay"] = uni(HV) * 0.5
    inputs["k"] = k.to(case.dtype)
    shape = (HV, V, K) if case.state_v_first else (HV, K, V)
    if case.pool == "none":
        inputs["initial_state"] = None
    elif case.pool == "plain":
        inputs["initial_state"] = rnd(B, *shape, scale=0.5)
    else:
        P = 2 * B + 3
        inputs["initial_state"] = rnd(P, *shape, scale=0.5)
        slots = torch.randperm(P, generator=gen, device=device)[:B]
        if B >= 3:
            slots[1] = -1  # skip a row (and leave a gap in the pool)
        inputs["state_indices"] = slots.to(torch.int32)
        inputs["inplace"] = case.pool == "inplace"
    inputs["output_final_state"] = True
    return inputs


def reference(case: DecodeCase, inputs: dict[str, Any], dtype: torch.dtype = torch.float64):
    """``(o, final_state)`` by cula's torch references with the pool semantics of the host functions.

    ``final_state`` is the whole updated pool for ``inplace`` (skipped and unused slots unchanged).
    """
    from cula.ref import kda as ref_kda
    from cula.ref import lightning as ref_lightning
    from cula.ref.pool import gather_states, scatter_states, zero_skipped_rows

    pool = inputs.get("initial_state")
    idx = inputs.get("state_indices")
    h0 = gather_states(pool, idx) if idx is not None else pool
    if case.variant == "kda":
        keys = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                "allow_neg_eigval", "lower_bound", "state_v_first")
        kw = {key: inputs[key] for key in keys if key in inputs}
        o, ht = ref_kda.recurrent(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                  scale=inputs.get("scale"), initial_state=h0, output_final_state=True,
                                  A_log=inputs.get("A_log"), dt_bias=inputs.get("dt_bias"), dtype=dtype, **kw)
    else:
        o, ht = ref_lightning.recurrent(inputs["q"], inputs["k"], inputs["v"], inputs["decay"],
                                        scale=inputs.get("scale"), initial_state=h0,
                                        output_final_state=True, dtype=dtype)
    if idx is not None:
        o = zero_skipped_rows(o, idx)
        ht = zero_skipped_rows(ht, idx)
    if inputs.get("inplace"):
        new_pool = pool.to(dtype).clone()
        if idx is not None:
            scatter_states(new_pool, ht, idx)
        else:
            new_pool.copy_(ht)
        return o, new_pool
    return o, ht


def host_fn(variant: str) -> Callable[..., Any]:
    if variant == "kda":
        from cula.kernels.sm90.kda_decode import kda_decode
        return kda_decode
    from cula.kernels.sm90.lightning_decode import lightning_decode
    return lightning_decode


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in fp64 (NaN anywhere gives NaN)."""
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def fla_call(case: DecodeCase, inputs: dict[str, Any]) -> Callable[[], Any]:
    """FLA 0.6.0's op on the same (non-pool) inputs."""
    if case.variant == "kda":
        from fla.ops.kda import fused_recurrent_kda
        keys = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                "allow_neg_eigval", "lower_bound", "state_v_first")
        kw = {key: inputs[key] for key in keys if key in inputs}
        args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
        return lambda: fused_recurrent_kda(*args, A_log=inputs.get("A_log"), dt_bias=inputs.get("dt_bias"),
                                           initial_state=inputs["initial_state"], output_final_state=True, **kw)
    from fla.ops.simple_gla import fused_recurrent_simple_gla
    g_gamma = -inputs["decay"]
    return lambda: fused_recurrent_simple_gla(inputs["q"], inputs["k"], inputs["v"], g_gamma=g_gamma,
                                              initial_state=inputs["initial_state"], output_final_state=True)


def cula_call(case: DecodeCase, inputs: dict[str, Any]) -> Callable[[], Any]:
    fn = host_fn(case.variant)
    kw = {key: val for key, val in inputs.items()}
    return lambda: fn(**kw)


def copy_call(case: DecodeCase, inputs: dict[str, Any]) -> Callable[[], Any]:
    """A plain device copy of as many bytes as the kernel moves (read ``B*HV*K*V`` fp32, write as many),
    on buffers of the input set's device: the same-size ceiling a decode step of ``case`` can approach,
    with the fixed per-launch cost a 1 GiB copy rate leaves out."""
    n = case.B * case.HV * case.K * case.V
    dev = inputs["q"].device
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# ------------------------------------------------------------------------------------------- timing


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate (bytes read + written per second) of a large buffer."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = sorted(event_ms(lambda: dst.copy_(src)) * 1e-3 for _ in range(reps))
    return 2 * nbytes / times[len(times) // 2]


def graph_time(calls: list[Callable[[], Any]], reps: int = 20) -> float:
    """Seconds per call from replaying one CUDA graph of all ``calls`` (median over ``reps`` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = sorted(event_ms(graph.replay) * 1e-3 / len(calls) for _ in range(reps))
    return times[len(times) // 2]


def eager_time(calls: list[Callable[[], Any]], rounds: int = 5) -> float:
    """Seconds per call, wall clock, of back-to-back eager calls (median round)."""
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / len(calls))
    times.sort()
    return times[len(times) // 2]


def host_time(fn: Callable[[], Any], n: int = 200) -> float:
    """Host seconds per call of ``fn`` (the launches queue up; the GPU is not waited on inside)."""
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best


def state_bytes(case: DecodeCase) -> int:
    """State bytes read + written per call (fp32, once each)."""
    return 2 * case.B * case.HV * case.K * case.V * 4


def bench_case(case: DecodeCase, copy_rate: float, budget_bytes: int = 3 << 30) -> dict[str, Any]:
    """Graph / eager / host times of cula and FLA for ``case`` (inputs rotated across the L2)."""
    per_set = state_bytes(case)
    n_sets = int(max(2, min(32, (256 << 20) // max(per_set, 1))))
    n_sets = min(n_sets, max(2, budget_bytes // max(per_set, 1)))
    sets = [make_inputs(DecodeCase(**{**case.__dict__, "seed": case.seed + i})) for i in range(n_sets)]
    row: dict[str, Any] = {"case": case.label, "B": case.B, "H": case.H, "HV": case.HV, "T": case.T,
                           "state_MB": per_set / 2 / 1e6, "sets": n_sets}
    for impl, make in (("cula", cula_call), ("fla", fla_call), ("copy", copy_call)):
        try:
            calls = [make(case, s) for s in sets]
            g = graph_time(calls)
            row[f"{impl}_graph_us"] = g * 1e6
            row[f"{impl}_eager_us"] = eager_time(calls) * 1e6
            row[f"{impl}_host_us"] = host_time(calls[0]) * 1e6
            row[f"{impl}_TBps"] = per_set / g / 1e12
            row[f"{impl}_pct_copy"] = 100 * per_set / g / copy_rate
        except Exception as exc:  # keep the other impl's numbers
            row[f"{impl}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:  # the two implementations agree on this case (first input set)
        o_c, s_c = cula_call(case, sets[0])()
        o_f, s_f = fla_call(case, sets[0])()
        row["rel_err_o_vs_fla"] = rel_err(o_c, o_f)
        row["rel_err_state_vs_fla"] = rel_err(s_c, s_f)
    except Exception as exc:
        row["compare_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "cula_graph_us" in row and "copy_graph_us" in row:  # % of a same-size copy's time
        row["cula_pct_same_copy"] = 100 * row["copy_graph_us"] / row["cula_graph_us"]
    if "cula_graph_us" in row and "fla_graph_us" in row:
        row["speedup_graph"] = row["fla_graph_us"] / row["cula_graph_us"]
        row["speedup_eager"] = row["fla_eager_us"] / row["cula_eager_us"]
    del sets
    torch.cuda.empty_cache()
    return row


def launcher_overhead(case: DecodeCase) -> dict[str, float]:
    """Host µs per launch: the fast cell path vs the DSL's public call path (same compiled kernel)."""
    inputs = make_inputs(case)
    fn = host_fn(case.variant)
    fn(**inputs)
    mod = sys.modules[fn.__module__]
    for lau in mod._cache.values():
        lau._last_values = ()
    fn(**inputs)
    torch.cuda.synchronize()
    launcher = next(lau for lau in mod._cache.values() if lau._last_values)
    values = launcher._last_values
    out: dict[str, Any] = {"fast_path": launcher.is_fast, "fast_reason": launcher.fast_reason}
    out["host_fn_us"] = host_time(lambda: fn(**inputs)) * 1e6
    out["launch_fast_us"] = host_time(lambda: launcher(*values)) * 1e6
    out["launch_public_us"] = host_time(lambda: launcher.call_public(*values)) * 1e6
    # the public op on the same inputs: its repeated calls take the planned path (issue 6: <= 20 us)
    import cula

    try:  # (kept apart: a failure here must not lose the launcher numbers above)
        public = public_op(case.variant)
        out["public_backend"] = cula.backends(public.op_name, **inputs).backend
        out["public_op_us"] = host_time(lambda: public(**inputs)) * 1e6
    except Exception as exc:
        out["public_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def public_op(variant: str) -> Callable[..., Any]:
    """cula's public decode op of ``variant`` ("kda" or "lightning")."""
    import cula

    if variant == "kda":
        return cula.kda.fused_recurrent_kda
    return cula.lightning.lightning_attn_decode


def profile_public_op(case: DecodeCase, calls: int = 3000, top: int = 25) -> None:
    """Where the public op's host time goes: cProfile of ``calls`` repeated calls (the planned path),
    the ``top`` functions by own time. Profiling inflates every Python call, so read it for shares."""
    import cProfile
    import io
    import pstats

    inputs = make_inputs(case)
    public = public_op(case.variant)
    for _ in range(10):
        public(**inputs)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        public(**inputs)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"== profile {case.label} ({calls} calls)\n{buf.getvalue()}", flush=True)


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="kda,lightning")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--heads", default="32")
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true",
                    help="only profile the public ops' host path (cProfile, B1 H32) and exit")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.profile:
        for variant in args.variants.split(","):
            profile_public_op(DecodeCase(variant, 1, 1, 32, 32,
                                         flags=KDA_SERVING_FLAGS if variant == "kda" else {}))
        return 0
    copy_rate = copy_bandwidth()
    print(f"copy bandwidth: {copy_rate / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for variant in args.variants.split(","):
        flags = KDA_SERVING_FLAGS if variant == "kda" else {}
        for H in map(int, args.heads.split(",")):
            for B in map(int, args.batches.split(",")):
                case = DecodeCase(variant, B, args.T, H, H, flags=flags)
                row = bench_case(case, copy_rate)
                rows.append(row)
                print(json.dumps(row), flush=True)
        case = DecodeCase(variant, 1, 1, 32, 32, flags=flags)
        try:
            ov = launcher_overhead(case)
            ov["case"] = case.label + "-overhead"
            rows.append(ov)
            print(json.dumps(ov), flush=True)
        except Exception as exc:
            print(f"overhead {variant}: {type(exc).__name__}: {exc}", flush=True)
    with open(os.path.join(args.out, "decode_bench.json"), "w") as f:
        json.dump({"copy_TBps": copy_rate / 1e12, "rows": rows}, f, indent=1)
    print(f"\n{'case':40s} {'cula graph':>11s} {'fla graph':>10s} {'x':>5s} {'%copy':>6s} "
          f"{'cula eager':>10s} {'fla eager':>10s} {'cula host':>9s} {'fla host':>9s} {'copy graph':>10s} "
          f"{'%same':>6s}")
    for r in rows:
        if "cula_graph_us" not in r:
            print(r)
            continue
        print(f"{r['case']:40s} {r['cula_graph_us']:11.2f} {r.get('fla_graph_us', float('nan')):10.2f} "
              f"{r.get('speedup_graph', float('nan')):5.2f} {r['cula_pct_copy']:6.1f} "
              f"{r['cula_eager_us']:10.2f} {r.get('fla_eager_us', float('nan')):10.2f} "
              f"{r['cula_host_us']:9.2f} {r.get('fla_host_us', float('nan')):9.2f} "
              f"{r.get('copy_graph_us', float('nan')):10.2f} {r.get('cula_pct_same_copy', float('nan')):6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-GPU context-parallel check and strong-scaling benchmark (NCCL, one process per GPU).

    python -m cula.cp.multigpu                       # every GPU count 1..N, Lightning and KDA
    python -m cula.cp.multigpu --world-sizes 2,8 --variants kda --scaling-T 131072,1048576
    python -m cula.cp.multigpu --device cpu --backend gloo --world-sizes 1,2 --check-T 96 \
        --scaling-T 192 --H 2 --K 16 --V 16 --dtype float32 --reps 2   # CPU dry run of the same code

For each world size W (a spawn of W processes, rank r on GPU r):

1. correctness: a global input of ``--check-T`` tokens, fixed (one sequence) and varlen (a sequence that
   crosses more than two ranks, one that starts on a rank boundary, a zero-length one), split over the
   ranks; the gathered CP output and final states are compared with the same local op run on the whole
   input on one GPU, and both with the fp32 torch reference. Pass: relative L2 error of CP vs the
   reference <= 2 x (single GPU vs the reference) + 1e-3, for o and for the final states.
2. strong scaling: one sequence of T tokens (each of ``--scaling-T``) split over W ranks; the time of one
   CP forward (all ranks, scan included; barrier to barrier) and the time per token. W = 1 runs the plain
   local op, the baseline of the speedup.

Rows go to the benchmark store (``cula.bench.store``, suite ``cp_check`` / ``cp_scaling``) and a markdown
table is printed (and written to ``--md``). ``--impl fla`` runs FLA's Triton ops as the local forward under
cula's CP; ``--impl fla-native`` (KDA only) times FLA's own CP (``fla.ops.cp``) for comparison.

NVLink multicast (NVLS) stays off: the variables below are set before torch.distributed starts.
"""

from __future__ import annotations

import os

# Multicast objects are not available on the lent machines; NCCL / symmetric memory must not try them.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------- local ops
def local_op(variant: str, impl: str) -> Callable:
    """The single-device forward CP runs per rank (and the W=1 baseline)."""
    if impl == "cula":
        from cula.cp._local import default_local_fn

        return default_local_fn(variant)
    if impl in ("fla", "fla-native"):
        if variant == "kda":
            from fla.ops.kda import chunk_kda

            return chunk_kda
        from fla.ops.simple_gla import chunk_simple_gla

        def fla_lightning(q, k, v, decay, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
            return chunk_simple_gla(q, k, v, g_gamma=-decay, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)

        return fla_lightning
    if impl == "ref":
        from cula.cp._local import import_attr

        return import_attr(f"cula.ref.{variant}", "chunked")
    raise ValueError(f"impl: expected cula, fla, fla-native or ref, got {impl!r}")


def reference(variant: str) -> Callable:
    """fp32 torch reference (the oracle both the single-GPU and the CP result are measured against)."""
    if variant == "kda":
        from cula.ref.kda import chunked
    else:
        from cula.ref.lightning import chunked
    return lambda **kw: chunked(**kw, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- inputs
def make_inputs(variant: str, T: int, H: int, K: int, V: int, dtype: torch.dtype, device, seed: int) -> dict:
    """Token-wise inputs ``[1, T, ...]`` plus the per-head parameters, drawn on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    out = dict(q=randn(1, T, H, K), v=randn(1, T, H, V))
    if variant == "lightning":
        out["k"] = randn(1, T, H, K) * K ** -0.5
        # Decays as Lightning's layers use (slow heads carry state far across rank boundaries).
        out["decay"] = torch.logspace(-4, -1, H, device=device, dtype=torch.float32)
    else:
        # A KDA layer's call (Kimi Linear): raw gate with A_log / dt_bias and q/k l2norm in the kernel, the
        # inputs cula's tensor-core stage 1 takes (a log-space g goes to FLA, see kda_fwd.simt_reason).
        out["k"] = randn(1, T, H, K)
        out["g"] = randn(1, T, H, K)
        out["beta"] = torch.rand(1, T, H, generator=gen, device=device).to(dtype)
        out["A_log"] = -2.0 + 0.5 * torch.randn(H, generator=gen, device=device)
        out["dt_bias"] = 0.1 * torch.randn(H * K, generator=gen, device=device)
        out.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    return out


def check_layouts(T: int, world_size: int) -> dict[str, list[int]]:
    """Sequence lengths of the correctness inputs (sum T)."""
    part = T // world_size
    # One sequence over >2 ranks, one starting exactly on a rank boundary, a zero-length one, a short tail.
    first = min(T - 1, 2 * part + part // 2 + 3) if world_size > 2 else T // 2 + 5
    lens = [first, 0]
    boundary = (first // part + 1) * part
    if boundary < T:
        lens.append(boundary - first)
    rest = T - sum(lens)
    if rest > 0:
        lens += [rest - rest // 3, rest // 3] if rest > 2 else [rest]
    return {"fixed": [T], "varlen": [n for n in lens if n >= 0]}


# ------------------------------------------------------------------------------------------ helpers
def local_backend(variant: str, impl: str, inputs: dict, cu_seqlens: torch.Tensor) -> str:
    """The backend cula's dispatch picks for the local forward on these inputs (so a row never times FLA
    under the cula label: inputs the kernels do not take go to FLA)."""
    if impl != "cula":
        return impl
    from cula import _dispatch

    op = "chunk_kda" if variant == "kda" else "lightning_attn_fwd"
    try:
        return _dispatch.explain(op, **inputs, cu_seqlens=cu_seqlens).backend or "none"
    except Exception as exc:  # noqa: BLE001 - a label, never a reason to stop the run
        return f"unknown ({type(exc).__name__})"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device) -> None:
    import torch.distributed as dist

    _sync(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.zeros(1, device=device)
        dist.all_reduce(flag)
    _sync(device)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def _token_names(variant: str) -> tuple[str, ...]:
    return ("q", "k", "v") if variant == "lightning" else ("q", "k", "v", "g", "beta")


def _run_cp(variant: str, impl: str, local: dict, ctx, output_final_state: bool, fla_ctx=None,
            identity_columns: str = "auto"):
    """One CP forward on this rank's piece."""
    from cula.cp import chunk_kda, lightning_attn_fwd

    if impl == "fla-native":
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        return fla_chunk_kda(**local, cp_context=fla_ctx)
    # impl cula: the default local op, so that KDA can take the kernel's identity response
    local_fn = None if impl == "cula" else local_op(variant, impl)
    if variant == "lightning":
        return lightning_attn_fwd(**local, output_final_state=output_final_state, cp_context=ctx, local_fn=local_fn)
    return chunk_kda(**local, output_final_state=output_final_state, cp_context=ctx, local_fn=local_fn,
                     identity_columns=identity_columns)


# ------------------------------------------------------------------------------------ rank programs
def _check(args, variant: str, rank: int, world_size: int, device) -> list[dict]:
    """Correctness of the CP split against one device, for each input layout (rank 0 returns rows)."""
    import torch.distributed as dist

    from cula.cp import build_cp_context, gather_final_state, gather_tokens, split_tokens

    rows = []
    dtype = DTYPES[args.dtype]
    for layout, lens in check_layouts(args.check_T, world_size).items():
        inputs = make_inputs(variant, args.check_T, args.H, args.K, args.V, dtype, device, seed=1234)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
        ctx = build_cp_context(cu, dist.group.WORLD, scan=args.scan)
        local = {n: (split_tokens(x, ctx) if n in _token_names(variant) else x) for n, x in inputs.items()}
        o_local, s_local = _run_cp(variant, args.impl, local, ctx, True, identity_columns=args.identity_columns)
        o, s = gather_tokens(o_local, ctx), gather_final_state(s_local, ctx)
        if rank != 0:
            continue
        op = local_op(variant, args.impl)
        o_one, s_one = op(**inputs, output_final_state=True, cu_seqlens=cu)
        o_ref, s_ref = reference(variant)(**inputs, output_final_state=True, cu_seqlens=cu)
        e = dict(o_cp=_rel_l2(o, o_ref), o_one=_rel_l2(o_one, o_ref),
                 s_cp=_rel_l2(s, s_ref), s_one=_rel_l2(s_one, s_ref),
                 o_cp_vs_one=_rel_l2(o, o_one), s_cp_vs_one=_rel_l2(s, s_one), o_max_abs=_max_abs(o, o_one),
                 s_max_abs=_max_abs(s, s_one))
        tol_o, tol_s = 2 * e["o_one"] + 1e-3, 2 * e["s_one"] + 1e-3
        ok = e["o_cp"] <= tol_o and e["s_cp"] <= tol_s
        rows.append(dict(kind="check", variant=variant, layout=layout, lens=lens, world_size=world_size,
                         T=args.check_T, ok=ok, tol_o=tol_o, tol_s=tol_s, **e))
        print(f"[check] {variant:9s} {layout:6s} W={world_size}: o rel-L2 cp {e['o_cp']:.2e} one {e['o_one']:.2e}"
              f" | state cp {e['s_cp']:.2e} one {e['s_one']:.2e} -> {'PASS' if ok else 'FAIL'}", flush=True)
    return rows


def _time(fn: Callable[[], Any], device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _barrier(device)
        t0 = time.perf_counter()
        fn()
        _barrier(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _scaling(args, variant: str, rank: int, world_size: int, device) -> list[dict]:
    """Strong scaling: one sequence of T tokens over the ranks (rank 0 returns rows)."""
    import torch.distributed as dist

    from cula.cp import build_cp_context

    rows = []
    dtype = DTYPES[args.dtype]
    for T in args.scaling_T:
        if T % world_size:
            continue
        cu = torch.tensor([0, T], device=device, dtype=torch.int32)
        local_T = T // world_size
        # Values do not matter for time: each rank draws its own piece directly on its device.
        local = make_inputs(variant, local_T, args.H, args.K, args.V, dtype, device, seed=rank)
        cu_local = torch.tensor([0, local_T], device=device, dtype=torch.int32)  # == cu at W = 1
        backend = local_backend(variant, args.impl, local, cu_local)
        # the plain single-device op: the W = 1 baseline, and every rank's piece alone at W > 1
        plain = local_op(variant, "fla" if args.impl == "fla-native" else args.impl)
        note = ""
        try:
            if world_size == 1:
                fn = lambda: plain(**local, cu_seqlens=cu)  # noqa: E731
            else:
                ctx = build_cp_context(cu, dist.group.WORLD, scan=args.scan)
                fla_ctx = None
                if args.impl == "fla-native":
                    from fla.ops.cp import build_cp_context as fla_build

                    fla_ctx = fla_build(cu, group=dist.group.WORLD)
                fn = lambda: _run_cp(variant, args.impl, local, ctx, False, fla_ctx,  # noqa: E731
                                     identity_columns=args.identity_columns)
            with torch.no_grad():
                times = _time(fn, device, args.warmup, args.reps)
                local_times = []
                if world_size > 1:  # every rank's plain forward on its piece, no CP: the compute floor
                    local_times = sorted(_time(lambda: plain(**local, cu_seqlens=cu_local), device, 1, args.reps))
        except torch.cuda.OutOfMemoryError as exc:  # a size that does not fit is a result, not a crash
            times, local_times, note = [], [], f"out of memory: {str(exc).splitlines()[0]}"
        local = None  # free the piece before the next size
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            times.sort()
            med = times[len(times) // 2] if times else float("nan")
            local_ms = local_times[len(local_times) // 2] if local_times else float("nan")
            rows.append(dict(kind="scaling", variant=variant, world_size=world_size, T=T, times_ms=times,
                             ms=med, us_per_token=med * 1e3 / T, local_ms=local_ms, note=note,
                             local_backend=backend))
            print(f"[scale] {variant:9s} W={world_size} T={T:>8d}: {med:9.3f} ms  "
                  f"{med * 1e6 / T:8.3f} ns/token  (local forward alone {local_ms:.3f} ms; {backend}) {note}",
                  flush=True)
    return rows


def _rank_main(rank: int, world_size: int, args, port: int, result_file: str) -> None:
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rows: list[dict] = []
        for variant in args.variants:
            if args.impl == "fla-native" and variant != "kda":
                continue
            if world_size > 1 and not args.skip_check and args.impl != "fla-native":
                rows += _check(args, variant, rank, world_size, device)
            rows += _scaling(args, variant, rank, world_size, device)
        if rank == 0:
            with open(result_file, "w") as fh:
                json.dump(rows, fh)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, world_size: int) -> list[dict]:
    """Spawn ``world_size`` ranks, return rank 0's rows."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "rows.json")
        mp.spawn(_rank_main, args=(world_size, args, _free_port(), result_file), nprocs=world_size, join=True)
        with open(result_file) as fh:
            return json.load(fh)


# ------------------------------------------------------------------------------------ store, report
def _speedups(rows: list[dict]) -> None:
    base = {(r["variant"], r["T"]): r["ms"] for r in rows if r["kind"] == "scaling" and r["world_size"] == 1}
    for r in rows:
        if r["kind"] == "scaling":
            b = base.get((r["variant"], r["T"]))
            r["speedup"] = b / r["ms"] if b and r["ms"] == r["ms"] else float("nan")
            r["efficiency"] = r["speedup"] / r["world_size"]


def markdown(rows: list[dict], args) -> str:
    """Tables: strong scaling (ms, speedup) per variant, and the correctness checks."""
    lines = [f"## Context parallel: strong scaling ({args.impl}, {args.dtype}, H={args.H}, K={args.K}, V={args.V}, "
             f"scan={args.scan})", ""]
    for variant in args.variants:
        scal = [r for r in rows if r["kind"] == "scaling" and r["variant"] == variant]
        if not scal:
            continue
        ws = sorted({r["world_size"] for r in scal})
        header = " | ".join(f"W={w} ms (speedup)" for w in ws)
        lines += [f"### {variant}", "", f"| T | {header} | ns/token at max W |",
                  "|---:|" + "---:|" * (len(ws) + 1)]
        for T in sorted({r["T"] for r in scal}):
            by_w = {r["world_size"]: r for r in scal if r["T"] == T}
            cells = []
            for w in ws:
                r = by_w.get(w)
                cells.append("-" if r is None else (r["note"] or "n/a") if r["ms"] != r["ms"]
                             else f"{r['ms']:.2f} ({r.get('speedup', float('nan')):.2f}x)")
            top = by_w.get(max(ws))
            cells.append(f"{top['us_per_token'] * 1e3:.3f}" if top and top["ms"] == top["ms"] else "-")
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        lines.append("")
    checks = [r for r in rows if r["kind"] == "check"]
    if checks:
        lines += ["### Correctness (relative L2 vs the fp32 reference)", "",
                  "| variant | input | W | o: CP | o: one GPU | state: CP | state: one GPU | CP vs one GPU (o) "
                  "| result |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in checks:
            lines.append(f"| {r['variant']} | {r['layout']} {r['lens']} | {r['world_size']} | {r['o_cp']:.2e} | "
                         f"{r['o_one']:.2e} | {r['s_cp']:.2e} | {r['s_one']:.2e} | {r['o_cp_vs_one']:.2e} | "
                         f"{'pass' if r['ok'] else 'FAIL'} |")
        lines.append("")
    return "\n".join(lines)


def store_rows(rows: list[dict], args, started: str) -> str | None:
    """Write the rows to the benchmark store; returns the run id (None when the store is unavailable)."""
    try:
        from cula.bench import fingerprint
        from cula.bench.schema import FAIL, OK, UNAVAILABLE, Row
        from cula.bench.store import Store, new_run_id
    except ImportError as exc:
        print(f"[store] not written: {exc}", file=sys.stderr)
        return None
    fp = fingerprint.collect(args.device)
    fp_fields = {k: v for k, v in fp.items() if k in Row.__dataclass_fields__}
    run_id = new_run_id(fingerprint.gpu_slug(fp.get("gpu_name", "")), fp.get("cula_sha", ""))
    store = Store(args.store)
    command = "python -m cula.cp.multigpu " + " ".join(sys.argv[1:])
    store.start_run(run_id, dict(command=command, suites=["cp_check", "cp_scaling"], impls=[args.impl],
                                 started=started, settings=vars(args)))
    out = []
    for i, r in enumerate(rows):
        flags = dict(world_size=r["world_size"], scan=args.scan, identity_columns=args.identity_columns)
        if r["kind"] == "scaling":
            flags.update(speedup=r.get("speedup"), efficiency=r.get("efficiency"), us_per_token=r["us_per_token"],
                         local_forward_ms=r.get("local_ms"))
            config_id = f"cp/{r['variant']}/T{r['T']}/W{r['world_size']}"
            times = r["times_ms"]
            row = Row(suite="cp_scaling", status=OK if times else UNAVAILABLE, note=r["note"],
                      eager_ms=r["ms"], eager_reps=len(times),
                      eager_p20_ms=times[int(0.2 * (len(times) - 1))] if times else float("nan"),
                      eager_p80_ms=times[int(0.8 * (len(times) - 1))] if times else float("nan"),
                      dist="single", n_seqs=1, lengths_json=json.dumps([r["T"]]),
                      len_min=r["T"], len_max=r["T"], len_avg=float(r["T"]))
        else:
            config_id = f"cp/{r['variant']}/check/{r['layout']}/T{r['T']}/W{r['world_size']}"
            flags.update(o_cp_vs_one=r["o_cp_vs_one"], o_one_vs_ref=r["o_one"], state_one_vs_ref=r["s_one"])
            row = Row(suite="cp_check", status=OK if r["ok"] else FAIL, oracle="cula.ref chunked fp32",
                      o_rel_l2=r["o_cp"], o_max_abs=r["o_max_abs"], state_rel_l2=r["s_cp"],
                      state_max_abs=r["s_max_abs"], tol_o=r["tol_o"], tol_state=r["tol_s"], dist="varlen"
                      if r["layout"] == "varlen" else "single", n_seqs=len(r["lens"]),
                      lengths_json=json.dumps(r["lens"]))
        row.run_id, row.config_index, row.config_id, row.impl = run_id, i, config_id, args.impl
        row.config_hash = hashlib.sha256(json.dumps([config_id, args.H, args.K, args.V, args.dtype, args.impl,
                                                     args.scan]).encode()).hexdigest()[:16]
        row.variant, row.phase, row.mode, row.B, row.T = r["variant"], "prefill", f"cp{r['world_size']}", 1, r["T"]
        row.H, row.HV, row.K, row.V, row.dtype = args.H, args.H, args.K, args.V, args.dtype
        local = r.get("local_backend")
        row.flags_json = json.dumps(flags)
        row.backend = f"cula.cp over {args.impl}" + (f" ({local})" if local else "")
        row.run_started, row.date, row.command = started, fingerprint.utc_now(), command
        row.settings_json = json.dumps(dict(warmup=args.warmup, reps=args.reps, timing="barrier-to-barrier wall"))
        for k, v in fp_fields.items():
            setattr(row, k, v)
        out.append(row)
    store.append(run_id, out)
    store.bundle(run_id, compact=True)
    return run_id


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--world-sizes", type=ints, default=None, help="default: 1..number of GPUs")
    p.add_argument("--variants", type=lambda s: s.split(","), default=["lightning", "kda"])
    p.add_argument("--impl", default="cula", choices=["cula", "fla", "fla-native", "ref"])
    p.add_argument("--scan", default="allgather", choices=["allgather", "ring"])
    p.add_argument("--identity-columns", default="auto", choices=["auto", "kernel", "appended", "separate"],
                   help="KDA: the identity response from the kernel's second stage-2 pass, from K extra value "
                        "columns in the same local call, or from a second call (auto: kernel where it runs)")
    p.add_argument("--check-T", type=int, default=16384)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--scaling-T", type=ints, default=[131072, 262144, 524288, 1048576])
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds")
    p.add_argument("--store", default="reports/results", help="benchmark store root")
    p.add_argument("--no-store", action="store_true")
    p.add_argument("--md", default=None, help="also write the markdown tables here")
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.world_sizes is None:
        n = torch.cuda.device_count() if args.device == "cuda" else 2
        args.world_sizes = list(range(1, max(n, 1) + 1))
    if args.device == "cuda" and max(args.world_sizes) > torch.cuda.device_count():
        raise ValueError(f"--world-sizes: at most {torch.cuda.device_count()} GPUs here, got {args.world_sizes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows: list[dict] = []
    for w in args.world_sizes:
        rows += run_world(args, w)
    _speedups(rows)
    md = markdown(rows, args)
    print(md)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md + "\n")
    if not args.no_store:
        run_id = store_rows(rows, args, started)
        if run_id:
            print(f"[store] run {run_id} in {args.store}")
    return 0 if all(r["ok"] for r in rows if r["kind"] == "check") else 1


if __name__ == "__main__":
    raise SystemExit(main())

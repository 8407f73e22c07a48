"""Check and time the SM90 Lightning prefill kernel on a GPU machine (one process, one call).

    python -m cula.kernels.sm90.lightning_fwd --check            # compile, compare, time one shape
    python -m cula.kernels.sm90.lightning_fwd --check --bench    # + the anchor shapes vs FLA
    python -m cula.kernels.sm90.lightning_fwd --bench --json out.json

Timing follows the device METHOD: FLA ``chunk_simple_gla`` and this kernel are interleaved in one
process, every timed call is preceded by a 256 MiB write (L2 flush), CUDA events, median of many reps;
the same once more with each call captured in a CUDA graph (launch overhead removed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from cula.bench.timing import event_ms

HBM_BYTES_PER_S = 4.3e12  # the project's roofline bandwidth (H200)


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
def make_inputs(B: int, T: int, H: int, HV: int | None = None, lengths: list[int] | None = None,
                state: bool = False, seed: int = 0, device: str = "cuda", decay: torch.Tensor | None = None):
    """Random bf16 q, k, v (unit-variance rows scaled like real activations), decays in (0, 1)."""
    HV = HV or H
    g = torch.Generator(device=device).manual_seed(seed)
    if lengths is not None:
        B, T = 1, sum(lengths)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    q = randn(B, T, H, 128)
    k = randn(B, T, H, 128, scale=128 ** -0.5)
    v = randn(B, T, HV, 128)
    if decay is None:
        # Lightning's per-head slopes: 2^(-8 h / HV), a spread from ~1 down to ~0.004
        decay = torch.tensor([2.0 ** (-8.0 * (h + 1) / HV) for h in range(HV)], dtype=torch.float32)
    decay = decay.to(device)
    cu = None
    N = B
    if lengths is not None:
        cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device)
        N = len(lengths)
    s0 = torch.randn(N, HV, 128, 128, generator=g, device=device) * 0.1 if state else None
    return dict(q=q, k=k, v=v, decay=decay, scale=128 ** -0.5, initial_state=s0,
                output_final_state=state, cu_seqlens=cu)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def fla_call(inp: dict):
    from fla.ops.simple_gla import chunk_simple_gla

    cu = inp["cu_seqlens"]
    kwargs = {}
    if cu is not None:
        kwargs = dict(cu_seqlens=cu.long(), cu_seqlens_cpu=cu.long().cpu())
    return chunk_simple_gla(inp["q"], inp["k"], inp["v"], g_gamma=-inp["decay"], scale=inp["scale"],
                            initial_state=inp["initial_state"], output_final_state=inp["output_final_state"],
                            **kwargs)


def cula_call(inp: dict, **kw):
    from cula.kernels.sm90.lightning_fwd import lightning_fwd

    return lightning_fwd(inp["q"], inp["k"], inp["v"], inp["decay"], inp["scale"], inp["initial_state"],
                         inp["output_final_state"], inp["cu_seqlens"], **kw)


def ref_call(inp: dict):
    from cula.ref.lightning import chunked

    return chunked(inp["q"], inp["k"], inp["v"], inp["decay"], inp["scale"], inp["initial_state"],
                   inp["output_final_state"], inp["cu_seqlens"], dtype=torch.float64)


def emulate(inp: dict, garbage: float = 1e3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's chunk algorithm in torch, with its bf16 roundings, on any device (CPU tests).

    Per 64-token chunk with n valid tokens and gamma = exp(-decay):
        P = bf16(scale * (Q K^T) * gamma^(i-j)) on j <= i, else 0
        O = scale * gamma^(i+1) * (Q bf16(S)) + P V
        S = gamma^n S + K^T bf16(w * V),   w_j = gamma^(n-1-j) for j < n, else 0
    Rows past the sequence end are filled with ``garbage`` (the kernel's TMA reads the next sequence's
    tokens there), so the masks are exercised.
    """
    q, k, v, decay = inp["q"], inp["k"], inp["v"], inp["decay"].float()
    scale = inp["scale"]
    B, T, H, _ = q.shape
    HV = v.shape[2]
    G = HV // H
    cu = inp["cu_seqlens"]
    bounds = ([(int(cu[i]), int(cu[i + 1])) for i in range(cu.numel() - 1)] if cu is not None
              else [(b * T, (b + 1) * T) for b in range(B)])
    qf = q.reshape(B * T, H, 128).repeat_interleave(G, dim=1).float()  # [BT, HV, 128]
    kf = k.reshape(B * T, H, 128).repeat_interleave(G, dim=1).float()
    vf = v.reshape(B * T, HV, 128).float()
    o = torch.empty(B * T, HV, 128, dtype=torch.float32, device=q.device)
    finals = []
    log2g = -decay * 1.4426950408889634  # [HV]
    idx = torch.arange(64, device=q.device, dtype=torch.float32)
    causal = idx[:, None] >= idx[None, :]
    bf = torch.bfloat16
    gen = torch.Generator(device=q.device).manual_seed(123)
    for n_seq, (bos, eos) in enumerate(bounds):
        S = (inp["initial_state"][n_seq].float().clone() if inp["initial_state"] is not None
             else torch.zeros(HV, 128, 128, device=q.device))
        for c0 in range(bos, eos, 64):
            n = min(64, eos - c0)

            def tile(x):
                t = torch.randn(64, HV, 128, generator=gen, device=q.device) * garbage
                t = t.to(bf).float()
                t[:n] = x[c0:c0 + n]
                return t.transpose(0, 1)  # [HV, 64, 128]

            Q, K, V = tile(qf), tile(kf), tile(vf)
            dist = idx[:, None] - idx[None, :]
            decay_ij = torch.exp2(log2g[:, None, None] * dist)  # [HV, 64, 64]
            A = Q @ K.transpose(1, 2)
            P = torch.where(causal, scale * A * decay_ij, torch.zeros((), device=q.device)).to(bf).float()
            row = scale * torch.exp2(log2g[:, None] * (idx + 1))  # [HV, 64]
            O = row[..., None] * (Q @ S.to(bf).float()) + P @ V
            o[c0:c0 + n] = O[:, :n].transpose(0, 1)
            # a select, not a product: the factor overflows to inf on the masked rows for large decay
            w = torch.where(idx < n, torch.exp2(log2g[:, None] * (n - 1 - idx)), torch.zeros((), device=q.device))
            Vd = (w[..., None] * V).to(bf).float()
            S = torch.exp2(log2g * n)[:, None, None] * S + K.transpose(1, 2) @ Vd
        finals.append(S)
    o = o.reshape(B, T, HV, 128).to(bf)
    final = torch.stack(finals) if inp["output_final_state"] else None
    return o, final


def layout_facts() -> dict:
    """Trace-time facts about the kernel's layouts that its raw-pointer passes rely on (CPU, no GPU).

    - ``p_reuse_mismatches``: A-operand register slots of the P.V product whose (row, k) differs from the
      (row, col) of the Q.K^T accumulator register they reuse (must be 0);
    - ``kt_is_canonical_a``: the K tile read transposed is the canonical MN-major A layout;
    - ``v_row_is_token``: in a V tile every 2*Vt-byte smem row holds one token (before the in-row swizzle);
    - ``o_outer_row_major`` and ``o_swizzle``: sO is row-major [64, Vt] under the swizzle the copy-out uses.
    Runs ``cute.compile`` on a function without kernels; the driver check is skipped (compile only).
    """
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the first cutlass import
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup

    from cula.kernels.sm90.lightning_fwd import STAGES, LightningFwdSm90, _a_operand_layout

    bf16 = cutlass.BFloat16
    kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    facts: dict = {}

    @cute.jit(preprocess=False)  # plain Python control flow: everything here is static
    def trace():
        mqk = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, cutlass.Float32, (1, 1, 1), (64, 64))
        mpv = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, mnmaj, cutlass.Float32, (1, 1, 1), (64, 64),
                                                warpgroup.OperandSource.RMEM)
        bad = 0
        for t in (0, 5, 37, 127):
            c_c = mqk.get_slice(t).partition_C(cute.make_identity_tensor((64, 64))).layout
            c_a = mpv.get_slice(t).partition_A(cute.make_identity_tensor((64, 64))).layout
            a_regs = _a_operand_layout(cute.make_layout(mqk.get_slice(t).partition_shape_C((64, 64))))
            for p in range(cute.size(a_regs)):
                ca = c_a(cute.idx2crd(p, c_a.shape))
                cc = c_c(cute.idx2crd(a_regs(cute.idx2crd(p, a_regs.shape)), c_c.shape))
                bad += int(tuple(int(x) for x in ca) != tuple(int(x) for x in cc))
        facts["p_reuse_mismatches"] = bad
        k_layout = sm90_utils.make_smem_layout_b(row, (64, 64, 128), bf16, STAGES)
        kt = sm90_utils.make_smem_layout_a(col, (128, 64, 64), bf16, STAGES)
        facts["kt_is_canonical_a"] = (str(cute.select(k_layout.outer, mode=[1, 0, 2])) == str(kt.outer)
                                      and str(k_layout.inner) == str(kt.inner))
        for vt in (32, 64):
            v_layout = sm90_utils.make_smem_layout_b(col, (64, vt, 64), bf16, 1)
            ok = all(int(cute.crd2idx((v, j, 0), v_layout.outer)) // vt == j for v in range(vt) for j in range(64))
            facts[f"v_row_is_token_{vt}"] = ok
            facts[f"v_swizzle_{vt}"] = str(v_layout.inner)
            o_layout = sm90_utils.make_smem_layout_epi(bf16, row, (64, vt), 1)
            facts[f"o_outer_row_major_{vt}"] = all(
                int(cute.crd2idx((r, c, 0), o_layout.outer)) == r * vt + c for r in range(64) for c in range(vt))
            facts[f"o_swizzle_{vt}"] = str(o_layout.inner)
            facts[f"kernel_swizzle_mask_{vt}"] = LightningFwdSm90(vt).swizzle_mask

    from cula.kernels.common.ptx_check import trace_without_gpu

    return trace_without_gpu(trace, facts)


def moved_bytes(inp: dict) -> int:
    """Fewest bytes the op must move: q, k, v read once, o written once, states read/written once."""
    n = inp["q"].numel() + inp["k"].numel() + 2 * inp["v"].numel()  # v read + o written (same shape)
    total = 2 * n
    s = inp["initial_state"]
    if s is not None:
        total += 4 * s.numel()
    if inp["output_final_state"]:
        N = inp["cu_seqlens"].numel() - 1 if inp["cu_seqlens"] is not None else inp["q"].shape[0]
        total += 4 * N * inp["v"].shape[2] * 128 * 128
    return total


# ---------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------
class Flusher:
    def __init__(self, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.zero_()


def time_interleaved(fns: dict, reps: int, flush: Flusher, graph: bool) -> dict:
    """Median ms of each callable, calls interleaved (a, b, a, b, ...), each after an L2 flush."""
    runners = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        if graph:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    fn()
                runners[name] = gr.replay
            except Exception as exc:  # capture can fail (host syncs): report NaN
                print(f"  graph capture failed for {name}: {type(exc).__name__}: {str(exc)[:120]}")
                runners[name] = None
        else:
            runners[name] = fn
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, run in runners.items():
            if run is None:
                continue
            flush()
            times[name].append(event_ms(run))
    return {name: (statistics.median(t) if t else math.nan) for name, t in times.items()}


# ---------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------
def check(verbose: bool = True) -> bool:
    ok = True
    cases = [
        ("B2 T1000 H2 state", dict(B=2, T=1000, H=2, state=True)),
        ("varlen [0,1,63,64,65,300] state", dict(B=1, T=0, H=2, lengths=[0, 1, 63, 64, 65, 300], state=True)),
        ("B1 T130 H2 HV4 (GVA)", dict(B=1, T=130, H=2, HV=4)),
    ]
    for name, cfg in cases:
        inp = make_inputs(**cfg)
        t0 = time.time()
        o, st = cula_call(inp)
        torch.cuda.synchronize()
        dt = time.time() - t0
        o_ref, st_ref = ref_call(inp)
        eo = rel_err(o, o_ref)
        es = rel_err(st, st_ref) if st is not None else 0.0
        good = eo < 1e-2 and es < 1e-2 and bool(torch.isfinite(o).all())
        ok &= good
        if verbose:
            print(f"check {name:36s} o_err {eo:.2e} state_err {es:.2e} first-call {dt:.1f}s "
                  f"{'OK' if good else 'FAIL'}")
    return ok


BENCH = [
    # (name, make_inputs kwargs)
    ("B2 T16384 H64", dict(B=2, T=16384, H=64)),
    ("B1 T16384 H64", dict(B=1, T=16384, H=64)),
    ("B8 T4096 H64", dict(B=8, T=4096, H=64)),
    ("B2 T16384 H64 state", dict(B=2, T=16384, H=64, state=True)),
    ("varlen uniform20 T16384 state", dict(B=1, T=0, H=64, lengths=[16384 // 20 + (1 if i < 16384 % 20 else 0)
                                                                  for i in range(20)], state=True)),
    ("varlen skewed10 T8192 state", dict(B=1, T=0, H=64, lengths=[431] * 9 + [8192 - 9 * 431], state=True)),
    ("B4 T2048 H64", dict(B=4, T=2048, H=64)),
    ("B1 T512 H64", dict(B=1, T=512, H=64)),
]


def bench(names: list[str] | None = None, reps: int = 30, v_tiles: tuple = (None,)) -> list[dict]:
    flush = Flusher()
    rows = []
    print(f"{'config':34s} {'mode':5s} {'fla ms':>8s} {'cula ms':>8s} {'speedup':>7s} {'%floor':>6s}")
    for name, cfg in BENCH:
        if names and name not in names:
            continue
        inp = make_inputs(**cfg)
        floor_ms = moved_bytes(inp) / HBM_BYTES_PER_S * 1e3
        for vt in v_tiles:
            fns = {"fla": lambda: fla_call(inp), "cula": lambda vt=vt: cula_call(inp, v_tile=vt)}
            for graph in (False, True):
                res = time_interleaved(fns, reps, flush, graph)
                mode = "graph" if graph else "eager"
                sp = res["fla"] / res["cula"]
                label = name if vt is None else f"{name} vt{vt}"
                print(f"{label:34s} {mode:5s} {res['fla']:8.3f} {res['cula']:8.3f} {sp:7.2f} "
                      f"{100 * floor_ms / res['cula']:6.1f}")
                rows.append(dict(config=label, mode=mode, fla_ms=res["fla"], cula_ms=res["cula"],
                                 speedup=sp, floor_ms=floor_ms))
        del inp
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m cula.kernels.sm90.lightning_fwd")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--only", action="append", help="bench only this config (repeatable)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--v-tiles", default="", help="comma list of V tiles to compare, e.g. 64,32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layout-facts", action="store_true", help="print the layout facts as JSON (CPU)")
    ap.add_argument("--sanitize-case", action="store_true",
                    help="run one small varlen case once (for compute-sanitizer memcheck / racecheck)")
    ap.add_argument("--fast-launch", action="store_true",
                    help="launch through the prebuilt-argument launcher (lightning_fwd.FAST_LAUNCH, the default)")
    ap.add_argument("--dsl-launch", action="store_true",
                    help="launch through the DSL's own call path (FAST_LAUNCH off), for comparison")
    args = ap.parse_args(argv)
    if args.fast_launch:
        from cula.kernels.sm90 import lightning_fwd

        lightning_fwd.FAST_LAUNCH = True
    if args.dsl_launch:
        from cula.kernels.sm90 import lightning_fwd

        lightning_fwd.FAST_LAUNCH = False
    if args.layout_facts:
        print(json.dumps(layout_facts()))
        return 0
    if args.sanitize_case:
        inp = make_inputs(B=1, T=0, H=2, lengths=[5, 70, 0, 130], state=True)
        o, st = cula_call(inp)
        torch.cuda.synchronize()
        o_ref, st_ref = ref_call(inp)
        print(f"sanitize case: o_err {rel_err(o, o_ref):.2e} state_err {rel_err(st, st_ref):.2e}")
        return 0
    if not (args.check or args.bench):
        args.check = True
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU check is the PTX compile test)")
        return 1
    ok = True
    if args.check:
        ok = check()
        inp = make_inputs(B=2, T=16384, H=64)
        res = time_interleaved({"fla": lambda: fla_call(inp), "cula": lambda: cula_call(inp)}, 10, Flusher(),
                               graph=False)
        print(f"time B2 T16384 H64: fla {res['fla']:.3f} ms, cula {res['cula']:.3f} ms")
        del inp
    rows = []
    if args.bench:
        vts = tuple(int(x) for x in args.v_tiles.split(",") if x) or (None,)
        rows = bench(args.only, args.reps, vts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(check_ok=ok, bench=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

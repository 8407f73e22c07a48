"""Device check of the KDA forward pipeline: correctness per stage and end to end, then timings.

``python -m cula.kernels.sm90.kda_fwd --check [--quick] [--no-bench]``. Prints one line per case:
relative errors of each stage-1 scratch tensor vs the torch emulation, of o / final state vs the fp64
reference (``cula.ref.kda``) and vs FLA's ``chunk_kda``; then the timings table.
"""

from __future__ import annotations

import time
import traceback

import torch

TOL_O = 2e-2  # bf16 operands: ||Δ|| / ||ref|| of o and the final state vs the fp64 reference
SCRATCH = ("w", "x", "u", "tp", "qg", "aqk", "kgt", "gam")  # stage 1's outputs (tp for u with U_IN_RECUR, x for w
# with W_IN_RECUR)

_TC = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True)

# (name, B, T, H, HV, cu_seqlens or None, flags)
CASES = [
    ("T1", 1, 1, 2, 2, None, dict()),
    ("T15-l2-gate", 2, 15, 2, 2, None, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)),
    ("T63-lb-5", 1, 63, 2, 2, None, dict(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
                                         use_beta_sigmoid_in_kernel=True)),
    ("T65-gva-vfirst", 2, 65, 1, 2, None, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                               state_v_first=True)),
    ("T1000-all", 1, 1000, 2, 2, None, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("varlen-zero", 1, 200, 2, 2, [0, 0, 15, 15, 79, 200], dict(use_qk_l2norm_in_kernel=True,
                                                                use_gate_in_kernel=True, lower_bound=-0.1)),
    ("varlen-33", 1, 33 * 40, 1, 1, "33", dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)),
    ("loggate-fp32", 1, 130, 2, 2, None, dict(use_qk_l2norm_in_kernel=True, g_log=True)),
    # the tensor-core stage 1 (kda_fwd.intra_kind == "tc": l2norm + in-kernel gate, with a lower bound)
    ("tc-T1", 1, 1, 2, 2, None, dict(_TC, lower_bound=-5.0)),
    ("tc-T65-gva-vfirst", 2, 65, 1, 2, None, dict(_TC, lower_bound=-5.0, state_v_first=True)),
    ("tc-T1000-negeig", 1, 1000, 2, 2, None, dict(_TC, lower_bound=-5.0, allow_neg_eigval=True)),
    ("tc-varlen-zero", 1, 200, 2, 2, [0, 0, 15, 15, 79, 200], dict(_TC, lower_bound=-0.1)),
    ("tc-varlen-33", 1, 33 * 40, 1, 1, "33", dict(_TC, lower_bound=-3.0)),
    # safe_gate caps the bound at -5 (FLA's contract); without it any bound goes, and stage 1 stays on
    # tensor cores down to MIN_LOWER_BOUND = -11 (gates saturated at the bound here)
    ("tc-lb11-strong", 1, 300, 2, 2, None, dict(_TC, safe_gate=False, lower_bound=-11.0, a_log_scale=3.0)),
    # gates saturated at bounds the 32-row factor blocks take (FACTOR_BLOCKS): -5 (factors up to 2^112) and
    # their limit (2^120)
    ("tc-lb5-strong", 1, 300, 2, 2, None, dict(_TC, lower_bound=-5.0, a_log_scale=3.0)),
    ("tc-lb536-strong", 1, 300, 2, 2, None, dict(_TC, safe_gate=False, lower_bound=-5.36, a_log_scale=3.0)),
    ("tc-fp32-gate-plainbeta", 1, 190, 2, 4, None, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                                         lower_bound=-5.0, g_fp32=True)),
    # FLA's layer call: the softplus gate without a bound, which the tensor-core stage 1 clamps at
    # SOFTPLUS_FLOOR (T15-l2-gate, T65-gva-vfirst, T1000-all and varlen-33 above take it too); here with
    # gates far below the floor in many channels (exp(A_log) up to ~e^6)
    ("tc-softplus-strong", 1, 300, 2, 2, None, dict(_TC, safe_gate=False, a_log_scale=3.0)),
    ("tc-softplus-varlen-zero", 1, 200, 2, 4, [0, 0, 15, 15, 79, 200], dict(_TC, safe_gate=False)),
    # precomputed (log-space, fp32) gates declared bounded by safe_gate: clamped to [lower_bound, 0] (the
    # floor without a bound); g_log_scale 30 puts some gates below -11, where the clamp acts (as for the
    # in-kernel softplus gate)
    ("tc-loggate-safe-varlen", 1, 200, 2, 4, [0, 0, 15, 15, 79, 200],
     dict(use_qk_l2norm_in_kernel=True, g_log=True, safe_gate=True, lower_bound=-5.0,
          use_beta_sigmoid_in_kernel=True)),
    ("tc-loggate-safe-floor", 2, 65, 1, 2, None,
     dict(use_qk_l2norm_in_kernel=True, g_log=True, g_log_scale=30.0, safe_gate=True)),
]


def _inputs(name, B, T, H, HV, cu, flags, dev, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen)

    flags = dict(flags)
    g_log = flags.pop("g_log", False)
    g_fp32 = flags.pop("g_fp32", False)  # raw gate given in fp32
    a_log_scale = flags.pop("a_log_scale", 0.5)  # larger: gates saturate at the lower bound
    g_log_scale = flags.pop("g_log_scale", 0.5)  # log-space gates uniform in [-g_log_scale, 0]
    q = r(B, T, H, 128).to(dev, torch.bfloat16)
    k = r(B, T, H, 128).to(dev, torch.bfloat16)
    v = r(B, T, HV, 128).to(dev, torch.bfloat16)
    if g_log:  # already log-space decay, fp32 input
        g = (-torch.rand(B, T, HV, 128, generator=gen) * g_log_scale).to(dev, torch.float32)
    else:
        g = r(B, T, HV, 128).to(dev, torch.float32 if g_fp32 else torch.bfloat16)
    beta = (r(B, T, HV) if flags.get("use_beta_sigmoid_in_kernel") else torch.rand(B, T, HV, generator=gen)).to(dev, torch.bfloat16)
    if cu == "33":
        # 32 lengths in [0, 40] sum to at most 1280 < T = 1320, so the last one is >= 40; one empty and
        # one single-token segment are always among them
        lens = torch.randint(0, 41, (33,), generator=gen)
        lens[3], lens[7] = 0, 1
        lens[-1] = T - lens[:-1].sum()
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).tolist()
        assert cu[-1] == T and lens[-1] >= 0
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    N = B if cu is None else len(cu) - 1
    kw = dict(flags)
    if flags.get("use_gate_in_kernel"):
        kw["A_log"] = (r(HV) * a_log_scale).to(dev)
        kw["dt_bias"] = (r(HV * 128) * 0.1).to(dev)
    kw["initial_state"] = (r(N, HV, 128, 128) * 0.1).to(dev)
    kw["output_final_state"] = True
    kw["cu_seqlens"] = cu_t
    return (q, k, v, g, beta), kw


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_case(case, dev, fla_chunk_kda=None):
    from cula.kernels.sm90.kda_fwd import emulate_stages, kda_fwd
    from cula.ref import kda as ref

    name, *spec = case
    args, kw = _inputs(name, *spec, dev=dev)
    o, ht, scratch = kda_fwd(*args, **kw, return_scratch=True)
    torch.cuda.synchronize()
    # U_IN_RECUR's scratch: -w, and T' ("tp") for u
    o_e, ht_e, scr_e = emulate_stages(*args, **kw, dtype=torch.float64, u_in_recur="tp" in scratch,
                                      w_in_recur="x" in scratch)
    o_r, ht_r = ref.recurrent(*args, **kw, dtype=torch.float64)
    names = [n for n in SCRATCH if n in scratch]
    errs = {n: _rel(scratch[n], scr_e[n]) for n in names}
    errs["o_vs_emul"] = _rel(o, o_e)
    errs["o"] = _rel(o, o_r)
    errs["ht"] = _rel(ht, ht_r)
    if fla_chunk_kda is not None:
        fkw = {k2: v2 for k2, v2 in kw.items()}
        o_f, ht_f = fla_chunk_kda(*args, **fkw)
        errs["fla_o"] = _rel(o_f, o_r)
        errs["fla_ht"] = _rel(ht_f, ht_r)
    o2, ht2, _ = kda_fwd(*args, **kw, return_scratch=True)
    errs["determ"] = float(not (torch.equal(o, o2) and torch.equal(ht, ht2)))
    ok = errs["o"] < TOL_O and errs["ht"] < TOL_O and errs["determ"] == 0.0
    # stage 1's scratch is bf16: each tensor within 2e-2 of the exact emulation (observed ~2-3e-3)
    ok = ok and len(names) == 6 and all(errs[n] < TOL_O for n in names)
    return ok, errs


def bench(dev, shapes=((1, 8192, 64), (2, 16384, 64))):
    import triton.testing

    from cula.kernels.sm90.kda_fwd import kda_fwd

    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001
        chunk_kda = None
    rows = []
    for B, T, H in shapes:
        q = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        g = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=torch.randn(H, device=dev), dt_bias=torch.randn(H * 128, device=dev) * 0.1,
                  lower_bound=-5.0, safe_gate=True)
        with torch.inference_mode():
            t_cula = triton.testing.do_bench(lambda: kda_fwd(q, k, v, g, beta, **kw), warmup=50, rep=300,
                                             return_mode="median")
            t_fla = (triton.testing.do_bench(lambda: chunk_kda(q, k, v, g, beta, **kw), warmup=50, rep=300,
                                             return_mode="median") if chunk_kda else float("nan"))
        rows.append((B, T, H, t_cula, t_fla))
        print(f"bench B{B} T{T} H{H}: cula {t_cula:.3f} ms  fla {t_fla:.3f} ms  speedup {t_fla / t_cula:.2f}x",
              flush=True)
    return rows


#: ``--split`` shapes: (B, T, H) fixed, or ("dist", n_seqs, T, H) varlen as the ``kda`` suite builds it
#: (its slowest rows against FLA are varlen n20 T8192, ``--split varlen``)
SPLIT_FIXED = ((1, 4096, 64), (2, 4096, 64), (1, 16384, 64))
SPLIT_VARLEN = (("uniform", 20, 8192, 64), ("random", 20, 8192, 64), ("skewed", 20, 8192, 64))
#: the three rows with the lowest ratio to FLA in suite run 20261203-152706, and the issue's B2 T16384 anchor
SPLIT_WORST = (("uniform", 20, 4096, 64), ("random", 20, 4096, 64), ("skewed", 20, 4096, 64), (2, 16384, 64))
#: fixed rows whose stage 2 reads the packed tile (more than PACK_ABOVE_CHUNKS chunks a sequence), longest first
#: (device_round s42_mask: the packed mask's A/B)
SPLIT_PACKED = ((2, 16384, 64), (1, 16384, 64), (1, 4096, 64))
#: stage 2 as pairs (kda_fwd_recur.PAIR_ENV; device_round s43_pair): B2 T16384 and long varlen batches (V halves
#: outnumber the SMs: "auto" takes pairs; skewed: one long sequence sets the time), B2 T4096, and B1 T16384, where
#: pairs leave half the SMs idle
SPLIT_PAIR = ((2, 16384, 64), ("uniform", 10, 16384, 64), ("skewed", 10, 16384, 64), (2, 4096, 64), (1, 16384, 64))
#: ...its B2 T16384 and skewed rows alone (a short device call)
SPLIT_PAIR_LEAN = (SPLIT_PAIR[0], SPLIT_PAIR[2])
#: the suite's shortest fixed rows, where the launch gap and stage 2's start are a visible share
SPLIT_SMALL = ((1, 512, 64), (2, 512, 64), (1, 1024, 64), (2, 1024, 64))
#: where stage 2's programmatic launch could help (short rows) or cost (long rows): both ends
SPLIT_PDL = SPLIT_SMALL + ((1, 4096, 64), (1, 16384, 64), (2, 16384, 64), ("uniform", 20, 4096, 64))


#: the rows stage 1's launch order was measured on (session 31, kda_fwd_intra_tc.ORDER), chosen where L2 could carry
#: stage 1's hand-off to stage 2 (it carried none measurably): hand-offs of ~33-66 MB (B1 T512 to B2 T512), the n20
#: T4096 rows (a tenth of theirs fits), and B2 T16384 (a few chunk columns)
SPLIT_L2 = ((1, 512, 64), (2, 512, 64), (1, 1024, 64), ("uniform", 20, 4096, 64), ("random", 20, 4096, 64),
            (2, 16384, 64))


#: varlen rows by average chunks per sequence (7, 13, 13, 26): where stage 2's state buffer stops paying
SPLIT_ITEMS = (("uniform", 20, 8192, 64), ("uniform", 20, 16384, 64), ("uniform", 10, 8192, 64),
               ("uniform", 10, 16384, 64))


def split(dev, shapes=SPLIT_FIXED, initial: bool = True, final: bool = True) -> list[dict]:
    """Time each stage alone and both together (median ms, L2 flushed by do_bench), with the suite's flags
    (``initial`` / ``final`` False: no initial / no final state, to see what stage 2's state traffic costs)."""
    import triton.testing

    from cula.kernels.sm90.kda_fwd import kda_fwd
    from cula.suites.lengths import cu_seqlens_from_lengths, varlen_lengths

    rows = []
    for shape in shapes:
        if isinstance(shape[0], str):  # varlen: one packed batch of n sequences, T tokens in all
            dist, n, T, H = shape
            B, name = 1, f"{dist}-n{n} T{T} H{H}"
            cu = torch.tensor(cu_seqlens_from_lengths(varlen_lengths(dist, n, T)), dtype=torch.int32, device=dev)
            N = n
        else:
            B, T, H = shape
            name, cu, N = f"B{B} T{T} H{H}", None, B
        q, k, v, g = (torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
        beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
        h0 = torch.zeros(N, H, 128, 128, device=dev) if initial else None
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=torch.randn(H, device=dev), dt_bias=torch.randn(H * 128, device=dev) * 0.1,
                  lower_bound=-5.0, safe_gate=True, initial_state=h0, output_final_state=final,
                  cu_seqlens=cu)
        row = dict(shape=name + ("" if initial else " no-h0") + ("" if final else " no-ht"))
        for stage, st in (("both", ("intra", "recur")), ("intra", ("intra",)), ("recur", ("recur",)),
                          ("host", ())):
            row[stage] = triton.testing.do_bench(lambda: kda_fwd(q, k, v, g, beta, **kw, stages=st),
                                                 warmup=20, rep=200, return_mode="median")
        print(f"split {row['shape']}: " + " ".join(f"{n}={row[n]:.3f}ms" for n in ("both", "intra", "recur", "host")),
              flush=True)
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    dev = torch.device("cuda")
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001
        chunk_kda = None
    from cula.kernels.sm90.kda_fwd import intra_kind

    n_ok = 0
    t0 = time.time()
    deadline = float(argv[argv.index("--deadline") + 1]) if "--deadline" in argv else 1e9
    if "--inverse" in argv:  # try stage 1's other inverse (kda_fwd_intra.INVERSES)
        from cula.kernels.sm90 import kda_fwd as kf

        kf.INTRA_INVERSE = argv[argv.index("--inverse") + 1]
        print(f"stage 1 inverse: {kf.INTRA_INVERSE}", flush=True)
    if "--variant" in argv:  # try stage 1's other kernel body (kda_fwd_intra.VARIANTS)
        from cula.kernels.sm90 import kda_fwd as kf

        kf.INTRA_VARIANT = argv[argv.index("--variant") + 1]
        print(f"stage 1 variant: {kf.INTRA_VARIANT}", flush=True)
    if "--recur-variant" in argv:  # stage 2's other kernel body (kda_fwd_recur.VARIANTS)
        from cula.kernels.sm90 import kda_fwd_recur as kr

        kr.RECUR_VARIANT = argv[argv.index("--recur-variant") + 1]
        print(f"stage 2 variant: {kr.RECUR_VARIANT}", flush=True)
    if "--u-in-recur" in argv:  # u formed in stage 2 from T' and v (kda_fwd.U_IN_RECUR)
        from cula.kernels.sm90 import kda_fwd as kf

        kf.U_IN_RECUR = True
        print("u in stage 2: on", flush=True)
    if "--no-tc" in argv:  # stage 1 on the SIMT kernel for every input (kda_fwd.INTRA_TC off)
        from cula.kernels.sm90 import kda_fwd as kf

        kf.INTRA_TC = False
        print("stage 1: SIMT only", flush=True)
    # --split [varlen | all | worst | small | pdl | l2 | items | packed | pair | pair_lean] [--no-h0] [--no-ht]
    if "--split" in argv:
        nxt = argv[argv.index("--split") + 1] if argv.index("--split") + 1 < len(argv) else ""
        sets = {"varlen": SPLIT_VARLEN, "all": SPLIT_FIXED + SPLIT_VARLEN, "worst": SPLIT_WORST,
                "small": SPLIT_SMALL, "pdl": SPLIT_PDL, "l2": SPLIT_L2,
                "items": SPLIT_ITEMS, "packed": SPLIT_PACKED,
                "pair": SPLIT_PAIR, "pair_lean": SPLIT_PAIR_LEAN}
        split(dev, sets.get(nxt, SPLIT_FIXED), initial="--no-h0" not in argv, final="--no-ht" not in argv)
        return 0
    cases = CASES[:3] if "--quick" in argv else CASES
    if "--cases" in argv:  # comma list of case names
        wanted = argv[argv.index("--cases") + 1].split(",")
        cases = [c for c in CASES if c[0] in wanted]
    for case in cases:
        if time.time() - t0 > deadline:
            print(f"case {case[0]}: skipped (deadline)", flush=True)
            continue
        try:
            # --no-fla: our kernels only (e.g. under compute-sanitizer, where FLA's launches would dominate)
            ok, errs = check_case(case, dev, None if "--no-fla" in argv else chunk_kda)
        except Exception:  # noqa: BLE001
            print(f"case {case[0]}: EXCEPTION\n{traceback.format_exc()[-3000:]}", flush=True)
            continue
        n_ok += ok
        fl = case[-1]
        kind = intra_kind(fl.get("use_qk_l2norm_in_kernel", False), fl.get("use_gate_in_kernel", False),
                          fl.get("lower_bound"), fl.get("safe_gate", False))
        print(f"case {case[0]} [{kind}]: {'PASS' if ok else 'FAIL'} "
              + " ".join(f"{k}={v:.2e}" for k, v in errs.items()), flush=True)
    print(f"correctness: {n_ok}/{len(cases)} passed in {time.time() - t0:.1f} s", flush=True)
    if "--no-bench" not in argv and n_ok > 0 and time.time() - t0 < deadline:
        try:
            bench(dev)
        except Exception:  # noqa: BLE001
            print(f"bench: EXCEPTION\n{traceback.format_exc()[-3000:]}", flush=True)
    return 0 if n_ok == len(cases) else 1

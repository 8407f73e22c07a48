"""Which ahead-of-time modules to build (``cula.kernels.common.aot``), and the build itself.

The device steps' launches are recorded as ``kda_fwd`` calls on the CPU (:data:`SCENARIOS`, :func:`record_launches`),
and each distinct launch is compiled and saved with :func:`cula.kernels.common.aot.compile_for_export` and
:func:`~cula.kernels.common.aot.save`. This file decides which modules exist, not what is in them, so it is left
out of the kernel-source fingerprint (``aot.NOT_KERNEL_SOURCES``): adding a scenario renames no module.

Build (on any machine, CPU only): ``python -m cula.kernels.common.aot build DIR [--all | --scenarios a,b] [--jobs N]``
(or ``-m cula.kernels.common.aot_build``) records the launches for the device steps' inputs and compiles each
distinct one, in N processes (default: one per core, at most four): the queued steps' scenarios
(:data:`CORE_SCENARIOS`), every scenario with ``--all``, or the ones named; without ``--scenarios`` it then deletes
the modules of older kernel sources from DIR.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cula.kernels.common.aot import HOST_ARCH_ENV, SUFFIX, compile_for_export, entry_name, save

#: one list with stage 1's (importing the kernel module costs nothing extra: kda_fwd imports it anyway)
from cula.kernels.sm90.kda_fwd_intra_tc import GATE_FACTOR_MODES as _GATE_FACTOR_MODES
from cula.kernels.sm90.kda_fwd_intra_tc import SAME_VALUE_DIAGS as _SAME_VALUE_DIAGS
from cula.kernels.sm90.kda_fwd_intra_tc import SUBST_MODES as _SUBST_MODES

#: the diagnostics that drop every scratch store of stage 1 (qg / kgᵀ, w, Aqk | T'): what a fused kernel, whose
#: stage 1 hands them to the recurrence in shared memory, would not write (device_round fused_premise)
NO_STORES = ("no_qg_kgt", "no_wu_store", "no_aqk_store")

#: What the device steps launch (docs/DEVICE.md), as kda_fwd calls to record: name -> (case names of
#: kda_fwd_check.CASES or "split" for its timing rows, module settings of kda_fwd to apply).
SCENARIOS = {
    "default": ("tc", {}),
    "u_in_recur": ("tc", {"U_IN_RECUR": True}),
    # u formed in stage 1 (CULA_KDA_U_IN_RECUR=0; the default forms it in stage 2 since session 17): tests/test_aot.py's
    # GPU test loads these and u_in_recur's
    "u_in_stage1": ("tc", {"U_IN_RECUR": False}),
    # kda_fwd_check --split worst (suite flags, H64), each stage set, with and without u in stage 2
    "split": ("split", {}),
    "split_u": ("split", {"U_IN_RECUR": True}),
    # the kda and kda_layer benchmark suites as cula.bench builds their inputs (default modes)
    "suites": ("suites", {}),
    # every check case (the SIMT stage 1's too: device_round next / tc_gpu run them through pytest)
    "checks": ("all", {}),
    # the training path: kda_fwd(fla_factors=True) for the kda_train suite and the check cases it serves
    "train": ("train", {}),
    # device_round diag_split: the split rows with each of stage 1's timing diagnostics (kda_fwd_intra_tc.DIAG)
    **{f"diag_{d}": ("split", {"intra_tc.DIAG": (d,)}) for d in _SAME_VALUE_DIAGS},
    # device_round clock: kda_fwd_clock --one-cta (the phase stamps at one CTA per SM) and --diag no_qg_kgt
    "diag_clock_one_cta": ("split", {"intra_tc.DIAG": ("clock", "one_cta")}),
    "diag_clock_no_qg_kgt": ("split", {"intra_tc.DIAG": ("clock", "no_qg_kgt")}),
    # device_round fused_premise: the split rows without any scratch store, at two CTAs per SM and at one
    "diag_no_stores": ("split", {"intra_tc.DIAG": NO_STORES}),
    "diag_one_cta_no_stores": ("split", {"intra_tc.DIAG": ("one_cta", *NO_STORES)}),
    # device_round raw_premise: the split rows without the qg / kgT and -X stores (Aqk | T' kept)
    "diag_no_qkx": ("split", {"intra_tc.DIAG": ("no_qg_kgt", "no_wu_store")}),
    # device_round raw_tiles / raw_suite: the raw tiles end to end (CULA_KDA_RAW_TILES=1) in the split rows and suites
    "raw_split": ("split", {"RAW_TILES": True}),
    "raw_suites": ("suites", {"RAW_TILES": True}),
    # device_round gate_factors / subst: the default stage 1 with the pre-session-21 factors (2^Γ by exp2) or
    # substitution (left-looking), in checks and splits (the first mode of each list is the default)
    **{f"gate_{m}_{w}": (what, {"intra_tc.GATE_FACTORS": m}) for m in _GATE_FACTOR_MODES[1:]
       for w, what in (("checks", "tc"), ("split", "split"))},
    **{f"subst_{m}_{w}": (what, {"intra_tc.SUBST": m}) for m in _SUBST_MODES[1:]
       for w, what in (("checks", "tc"), ("split", "split"))},
    # device_round block32: 32-row reference-factor blocks (the default where the bound takes them) with 2^Γ by exp2
    "block32_direct_split": ("split", {"intra_tc.FACTOR_BLOCK": 32, "intra_tc.GATE_FACTORS": _GATE_FACTOR_MODES[1]}),
    # device_round block32 / loggate32: the 16-row blocks (the default before session 24) in the split rows
    "block16_split": ("split", {"intra_tc.FACTOR_BLOCK": 16}),
    # device_round phase1: session 25's phase 1 (butterfly l2 sums, PHASE1) in the split rows
    "pre26_split": ("split", {"intra_tc.PHASE1": "pre26"}),
    # device_round tma_qk: session 26's phase 1 (PHASE1 "lean": q, k by per-thread loads) in the GPU test's calls
    # (the check cases') and the splits, against the default (q, k by TMA)
    "lean_checks": ("tc", {"intra_tc.PHASE1": "lean"}),
    "lean_split": ("split", {"intra_tc.PHASE1": "lean"}),
    # device_round tma_qkg: session 27's phase 1 (PHASE1 "tma_qk": g by per-thread loads) in the GPU test's calls
    # (the check cases') and the splits, against the default (g by TMA as well)
    "tma_qk_checks": ("tc", {"intra_tc.PHASE1": "tma_qk"}),
    "tma_qk_split": ("split", {"intra_tc.PHASE1": "tma_qk"}),
    # device_round g_first: session 28's first default (PHASE1 "tma_qkg": g on q's and k's barrier, the L2 prefetch
    # on) in the GPU test's calls (its prefetch off there, as the rule sets it) and the splits, against the default
    "tma_qkg_checks": ("tc", {"intra_tc.PHASE1": "tma_qkg"}),
    "tma_qkg_pf66_split": ("split", {"intra_tc.PHASE1": "tma_qkg", "intra_tc.PREFETCH_AHEAD": 66}),
    # device_round pf_tma: stage 1's L2 prefetch distance (CTAs ahead; 66 the default) now that q, k, g arrive by TMA
    # device_round pack: the packed [Aqk | T'] tile (kda_fwd.PACK) in the check cases, the GPU test's and the splits
    "pack_checks": ("tc", {"PACK": "1"}),
    "pack_split": ("split", {"PACK": "1"}),
    # device_round s42_mask (run in session 44): the packed tile's word mask (CULA_KDA_PACK_MASK=words, the default
    # before session 44; rows since) in the split rows, against the default
    "words_split": ("split", {"recur.PACK_MASK": "words"}),
    "unpacked_split": ("split", {"PACK": "0"}),
    # device_round s43_pair: stage 2 as pairs (recur.PAIR_ENV "1") and the split launch it must equal bitwise, the
    # state buffer off in both (the GPU test's calls), unpacked and packed; the split rows with pairs and the suites
    # with "auto"
    **{f"{n}_{m}_checks": ("tc", {"recur.PAIR_ENV": pe, "recur.STATE_SMEM_ENV": "0", "PACK": pk})
       for n, pe in (("nossm", "0"), ("pair", "1")) for m, pk in (("unpacked", "0"), ("packed", "1"))},
    "pair_split": ("split", {"recur.PAIR_ENV": "1"}),
    "pair_auto_suites": ("suites", {"recur.PAIR_ENV": "auto"}),
    # device_round pack_premise: stage 1 without T''s store, stage 2 reading ~8 KB of [Aqk | T'] a chunk instead of
    # 16 (timing only: what packing the two into one 64 x 64 tile would save at most)
    "pack_premise_split": ("split", {"intra_tc.DIAG": ("no_tp_store",), "recur.RECUR_DIAG": ("half_at",)}),
    **{f"pf{n}_split": ("split", {"intra_tc.PREFETCH_AHEAD": n}) for n in (0, 33, 132)},
    # device_round s31: stage 1 launched in the order before session 31 (ORDER "chunk") in the check cases (the
    # order GPU test's calls) and the splits, against the default ("head_rev")
    "order_chunk_checks": ("tc", {"intra_tc.ORDER": "chunk"}),
    "order_chunk_split": ("split", {"intra_tc.ORDER": "chunk"}),
    # device_round s32: w in stage 2 (kda_fwd.W_IN_RECUR) in the check cases, unpacked and packed (the GPU tests'
    # calls), and the splits
    "w_in_checks": ("tc", {"W_IN_RECUR": True}),
    "w_in_pack_checks": ("tc", {"W_IN_RECUR": True, "PACK": "1"}),
    "w_in_split": ("split", {"W_IN_RECUR": True}),
    # device_round no_w_in_suite, s32: the kda suite, the GPU tests' calls and the splits with w in stage 2 off (the
    # default before session 32)
    "suites_no_w_in": ("suites", {"W_IN_RECUR": False}),
    "no_w_in_checks": ("tc", {"W_IN_RECUR": False}),
    "no_w_in_pack_checks": ("tc", {"W_IN_RECUR": False, "PACK": "1"}),
    "no_w_in_split": ("split", {"W_IN_RECUR": False}),
    # device_round s33, ctas2_suite: stage 1 at two CTAs per SM (intra_tc.CTAS; three is the default for the packed
    # tile since session 33) in the packed check cases (the GPU tests' reference calls), the splits and the kda suite
    "ctas2_pack_checks": ("tc", {"intra_tc.CTAS": 2, "PACK": "1"}),
    "ctas2_split": ("split", {"intra_tc.CTAS": 2}),
    "suites_ctas2": ("suites", {"intra_tc.CTAS": 2}),
    # device_round s34u: three CTAs for the unpacked tile too (session 34): the check cases forced unpacked, at three
    # CTAs (the default) and at two (the GPU tests' reference calls)
    "unpacked_checks": ("tc", {"PACK": "0"}),
    "ctas2_unpacked_checks": ("tc", {"intra_tc.CTAS": 2, "PACK": "0"}),
    # device_round s37: stage 1 widening bf16 by cvt.f32.bf16 (intra_tc.WIDEN), forming kgT as K^ 2^(G_last - E)
    # (intra_tc.KGT "kh"): in the check cases (the GPU tests' reference calls); both (session 36's stage 1) in the
    # splits
    "widen_cvt_checks": ("tc", {"intra_tc.WIDEN": "cvt"}),
    "kgt_kh_checks": ("tc", {"intra_tc.KGT": "kh"}),
    "s36_split": ("split", {"intra_tc.WIDEN": "cvt", "intra_tc.KGT": "kh"}),
    "pre21_split": ("split", {"intra_tc.GATE_FACTORS": _GATE_FACTOR_MODES[1], "intra_tc.SUBST": _SUBST_MODES[1]}),
}


#: tests/test_kda_train.py's GPU cases by test id: (B, T, H, HV, cu_seqlens, lower_bound, beta sigmoid, h0,
#: V-first, gate). HV = 2 throughout: FLA's backward kernels autotune per HV (and state layout) on first use,
#: minutes on a fresh device, so the cases share one key where they can
TRAIN_TEST_CASES = {
    "B2-T200-lb5-h0": (2, 200, 2, 2, None, -5.0, True, True, False, "kernel"),
    "varlen-zero-gva-vfirst": (1, 300, 1, 2, [0, 0, 1, 64, 65, 300], -5.0, True, True, True, "kernel"),
    "varlen-softplus-plainbeta": (1, 1000, 2, 2, [0, 333, 1000], None, False, False, False, "kernel"),
    "T63-lb1-gva": (1, 63, 1, 2, None, -1.0, True, False, False, "kernel"),
    "varlen-loggate-safe": (1, 200, 2, 2, [0, 70, 200], -5.0, True, True, False, "log"),
}


def _train_test_calls():
    """``kda_fwd`` as the training GPU tests call it: with ``fla_factors`` (``cula.kda._train``), and without
    (the inference path they compare o and the final state with: on the device the first run of a case spent
    minutes compiling it)."""
    import torch

    dev = torch.device("meta")
    for B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate in TRAIN_TEST_CASES.values():
        N = B if cu is None else len(cu) - 1
        qk = torch.empty(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        v = torch.empty(B, T, HV, 128, device=dev, dtype=torch.bfloat16)
        g = torch.empty(B, T, HV, 128, device=dev, dtype=torch.float32 if gate == "log" else torch.bfloat16)
        kernel_gate = gate == "kernel"
        kw = dict(scale=128 ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=kernel_gate, use_beta_sigmoid_in_kernel=sigmoid,
                  A_log=torch.empty(HV, device=dev) if kernel_gate else None,
                  dt_bias=torch.empty(HV * 128, device=dev) if kernel_gate else None,
                  safe_gate=lb is not None or gate == "log", lower_bound=lb, state_v_first=v_first,
                  initial_state=torch.empty(N, HV, 128, 128, device=dev) if h0 else None,
                  cu_seqlens=None if cu is None else torch.tensor(cu))
        args = (qk, qk, v, g, torch.empty(B, T, HV, device=dev, dtype=torch.bfloat16))
        yield args, dict(kw, fla_factors=True)
        yield args, kw


def _suite_calls(names=("kda", "kda_layer"), **extra):
    """``kda_fwd`` calls of the suites' configs (their inputs' shapes and dtypes as ``cula.bench.inputs``
    makes them), on the meta device; ``extra`` goes to every call."""
    import torch

    from cula.suites import cu_seqlens_from_lengths, load_suite

    dev, bf16 = torch.device("meta"), torch.bfloat16
    for name in names:
        for cfg in load_suite(name).configs:
            B, T, H, HV = cfg.B, cfg.T, cfg.H, cfg.HV
            flags = dict(cfg.flag_dict)
            kw = dict(flags, initial_state=torch.empty(cfg.num_seqs, HV, 128, 128, device=dev) if cfg.state else None,
                      output_final_state=bool(cfg.state))
            if flags.get("use_gate_in_kernel"):
                kw.update(A_log=torch.empty(HV, device=dev), dt_bias=torch.empty(HV * 128, device=dev))
            if cfg.mode == "varlen":
                kw["cu_seqlens"] = torch.tensor(cu_seqlens_from_lengths(list(cfg.lengths)), dtype=torch.int64)
            qk = torch.empty(B, T, H, 128, device=dev, dtype=bf16)
            v = torch.empty(B, T, HV, 128, device=dev, dtype=bf16)
            yield (qk, qk, v, v, torch.empty(B, T, HV, device=dev, dtype=bf16)), dict(kw, **extra)


def _split_calls():
    """``kda_fwd`` calls of ``kda_fwd_check.split`` on its ``worst`` and ``l2`` rows, on the meta device: the launch
    keys depend on shapes and flags only, so no memory is needed for the large rows."""
    import torch

    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.suites.lengths import cu_seqlens_from_lengths, varlen_lengths

    dev = torch.device("meta")
    for shape in dict.fromkeys(chk.SPLIT_WORST + chk.SPLIT_L2):
        if isinstance(shape[0], str):
            dist, n, T, H = shape
            B, N = 1, n
            cu = torch.tensor(cu_seqlens_from_lengths(varlen_lengths(dist, n, T)), dtype=torch.int32)
        else:
            (B, T, H), cu = shape, None
            N = B
        x = torch.empty(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        beta = torch.empty(B, T, H, device=dev, dtype=torch.bfloat16)
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=torch.empty(H, device=dev), dt_bias=torch.empty(H * 128, device=dev), lower_bound=-5.0,
                  safe_gate=True, initial_state=torch.empty(N, H, 128, 128, device=dev), output_final_state=True,
                  cu_seqlens=cu)
        for stages in (("intra", "recur"), ("intra",), ("recur",)):
            yield (x, x, x, x, beta), dict(kw, stages=stages)


def record_launches(scenario: str) -> list[tuple]:
    """``(kind, key, make_kernel, specs)`` of every distinct launch ``kda_fwd`` makes for a scenario, on the
    CPU: the launcher, streams and device queries are replaced by recorders."""
    import torch

    import cula.kernels.common.fast_launch as fl
    from cula.kernels.sm90 import kda_fwd
    from cula.kernels.sm90 import kda_fwd_check as chk

    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90 import kda_fwd_recur as recur

    which, settings = SCENARIOS[scenario]
    seen: dict[tuple, tuple] = {}
    modules = {"intra_tc": intra_tc, "recur": recur}

    def owner(name: str) -> tuple[Any, str]:  # "X" is kda_fwd's, "intra_tc.X" / "recur.X" the stage modules'
        mod, _, attr = name.rpartition(".")
        return modules.get(mod, kda_fwd), attr

    saved = {n: getattr(*owner(n)) for n in ("_launcher", "sm_count", *settings)}
    saved_fl, saved_dev = fl.current_stream_handle, torch.cuda.current_device

    def launcher(kind, key, make_kernel, specs):
        seen.setdefault((kind, key), (kind, key, make_kernel, specs))
        return lambda *values: None

    try:
        kda_fwd._launcher = launcher
        kda_fwd.sm_count = lambda device: 132
        fl.current_stream_handle = lambda index: 0
        torch.cuda.current_device = lambda: 0
        for name, value in settings.items():
            setattr(*owner(name), value)
        if which in ("split", "suites", "train"):
            calls = {"split": _split_calls, "suites": _suite_calls,
                     "train": lambda: _suite_calls(("kda_train",), fla_factors=True)}[which]()
            for args, kw in calls:
                kda_fwd.kda_fwd(*args, **kw)
            if which == "train":
                for args, kw in _train_test_calls():
                    kda_fwd.kda_fwd(*args, **kw)
            return list(seen.values())
        cases = [c for c in chk.CASES if c[0].startswith("tc-") or which == "all"]
        for case in cases:
            args, kw = chk._inputs(*case, dev=torch.device("cpu"))
            kda_fwd.kda_fwd(*args, **kw)
            kda_fwd.kda_fwd(*args, **{**kw, "initial_state": None, "output_final_state": False})
    finally:
        for name, value in saved.items():
            setattr(*owner(name), value)
        fl.current_stream_handle, torch.cuda.current_device = saved_fl, saved_dev
    return list(seen.values())


def shard_of(name: str, shards: int) -> int:
    """Which of ``shards`` build processes compiles module ``name`` (stable across processes)."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % shards


def build(out_dir: str, scenarios: Sequence[str], shard: tuple[int, int] = (0, 1)) -> list[tuple[str, int]]:
    """Compile every distinct launch of ``scenarios`` into ``out_dir`` (only the modules of ``shard`` = (index,
    count): :func:`build_parallel` runs one process per shard); returns (file, bytes) per module."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, int]] = []
    names: set[str] = set()
    for scenario in scenarios:
        for kind, key, make_kernel, specs in record_launches(scenario):
            name = entry_name(kind, key, specs)
            if name in names or (Path(out_dir) / name).exists() or shard_of(name, shard[1]) != shard[0]:
                names.add(name)
                continue
            names.add(name)
            size = save(Path(out_dir) / name, compile_for_export(make_kernel(), specs))
            done.append((name, size))
            print(f"aot: {scenario} {name} {size / 2**20:.2f} MiB", flush=True)
    return done


def expected_names(scenarios: Sequence[str]) -> set[str]:
    """The module file names that ``scenarios`` need from the current kernel sources (~5 s for all)."""
    return {entry_name(kind, key, specs) for sc in scenarios for kind, key, _, specs in record_launches(sc)}


def prune(out_dir: str, keep: set[str]) -> list[str]:
    """Delete the modules in ``out_dir`` not named in ``keep`` (those of older kernel sources: every edit to a
    kernel source renames all modules, and ``.device`` travels to the device within a 64 MiB carry); other
    files stay. Returns the deleted names."""
    gone = sorted(p.name for p in Path(out_dir).glob(f"*{SUFFIX}") if p.name not in keep)
    for name in gone:
        (Path(out_dir) / name).unlink()
    return gone


def build_parallel(out_dir: str, scenarios: Sequence[str], jobs: int) -> int:
    """:func:`build` in ``jobs`` processes, each compiling its shard of the modules (one compile keeps one core
    busy for ~6 s); returns the first nonzero exit status, or 0."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cula.kernels.common.aot_build", "build", str(out_dir),
           "--scenarios", ",".join(scenarios)]
    procs = [subprocess.Popen([*cmd, "--shard", f"{i}/{jobs}"]) for i in range(jobs)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def default_jobs() -> int:
    """One build process per core, at most four (each holds the DSL and its MLIR context: ~0.7 GB)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


#: What a plain build compiles: the scenarios of the steps in docs/DEVICE.md's queue (the checks, suites and training
#: path at the defaults, the split rows, two CTAs, both packings). The others serve steps of past experiments: build
#: them with ``--all``, or one step's with ``--scenarios``, before such a step (on the device a missing module
#: compiles instead, ~40 s a flag set). 95 modules (session 38): ~7.5 min on 2 cores instead of 14-18 for all.
CORE_SCENARIOS = ("default", "u_in_recur", "split", "split_u", "suites", "checks", "train", "pack_checks", "pack_split",
                  "unpacked_split", "w_in_checks", "w_in_pack_checks", "w_in_split", "ctas2_pack_checks",
                  "ctas2_split", "suites_ctas2", "unpacked_checks", "ctas2_unpacked_checks", "diag_no_qkx",
                  "widen_cvt_checks", "kgt_kh_checks", "s36_split",
                  "gate_square_checks", "gate_square_split", "diag_clock",
                  "diag_no_stores", "raw_split", "raw_suites", "words_split",
                  *(f"{n}_{m}_checks" for n in ("nossm", "pair") for m in ("unpacked", "packed")),
                  "pair_split", "pair_auto_suites")


def main(argv: list[str]) -> int:
    """``build DIR [--all | --scenarios a,b] [--jobs N]``: without ``--scenarios`` the build then deletes the modules
    of older kernel sources (those no scenario names: a plain build keeps what ``--all`` built)."""
    if len(argv) < 2 or argv[0] != "build":
        print(__doc__)
        return 2
    full = "--scenarios" not in argv
    scenarios = list(SCENARIOS) if "--all" in argv else list(CORE_SCENARIOS)
    if not full:
        scenarios = argv[argv.index("--scenarios") + 1].split(",")
    if "--shard" in argv:  # one process of build_parallel
        index, count = (int(x) for x in argv[argv.index("--shard") + 1].split("/"))
        build(argv[1], scenarios, (index, count))
        return 0
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else default_jobs()
    if jobs > 1:
        code = build_parallel(argv[1], scenarios, jobs)
    else:
        build(argv[1], scenarios)
        code = 0
    if full and code == 0:  # every module a device step can ask for is known: the rest is stale
        gone = prune(argv[1], expected_names(list(SCENARIOS)))
        print(f"aot: removed {len(gone)} modules of older kernel sources", flush=True)
    return code


if __name__ == "__main__":
    import sys

    os.environ["CUTE_DSL_ARCH"] = HOST_ARCH_ENV  # before cutlass is imported: no host JIT
    sys.exit(main(sys.argv[1:]))

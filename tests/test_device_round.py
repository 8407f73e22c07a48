"""kernels/sm90/device_round.sh as a dry run: stand-ins for nvidia-smi, python3 and timeout record which
steps a call would run, so a plan is checked before device time is spent on it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "kernels" / "sm90" / "device_round.sh"


def dry_run(tmp_path: Path, gpu: str, *steps: str) -> list[str]:
    """The commands the script hands to ``timeout`` on a machine whose GPU is ``gpu``."""
    tmp_path.mkdir(exist_ok=True)
    shims = tmp_path / "bin"
    shims.mkdir()
    log = tmp_path / "commands.log"
    scripts = {
        "nvidia-smi": f'echo "{gpu}"',
        "python3": "exit 0",
        # timeout SECONDS CMD...: record the command, run nothing
        "timeout": f'shift; echo "$*" >> "{log}"',
    }
    for name, body in scripts.items():
        path = shims / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), CULA_AOT_DIR="x")
    res = subprocess.run(["bash", str(SCRIPT), *steps], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return log.read_text().splitlines() if log.exists() else []


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_next_publishes(tmp_path, gpu):
    cmds = dry_run(tmp_path, gpu, "next")
    suites = [c.split("--suite ")[1].split()[0] for c in cmds if "cula.cli bench" in c]
    assert suites == ["kda", "kda_train", "kda_layer"]
    steps = ["kda_suite", "train_suite", "kda_layer_suite"]
    assert cmds == [c.replace(str(tmp_path / str(i)), str(tmp_path)) for i, step in enumerate(steps)
                    for c in dry_run(tmp_path / str(i), gpu, step)]


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_next2_is_the_second_call(tmp_path, gpu):
    cmds = dry_run(tmp_path, gpu, "next2")
    expected = [c for i, step in enumerate(("fused_premise", "block32")) for c in dry_run(tmp_path / str(i), gpu, step)]
    assert cmds == expected and cmds


def test_clock_times_two_ctas_one_cta_and_what_the_stamps_cost(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "clock")
    runs = [c for c in cmds if "kda_fwd_clock" in c]
    assert len(runs) == 4 and sum("--one-cta" in c for c in runs) == 1 and "--dist uniform" in runs[2]
    assert "--diag no_qg_kgt" in runs[3]
    splits = [c for c in cmds if "--split worst" in c]
    assert [("CULA_KDA_TC_DIAG=clock" in c) for c in splits] == [False, True]


def test_s38_clock_stamps_both_packings_then_times_the_stamps(tmp_path):
    from cula.kernels.common import aot_build

    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s38_clock")
    runs = [c for c in cmds if "kda_fwd_clock" in c]
    assert len(runs) == 2 and "--B 2 --T 16384" in runs[0] and "--dist uniform --n 20" in runs[1]
    assert not any("--one-cta" in c or "--diag" in c for c in runs)
    splits = [c for c in cmds if "--split worst" in c]
    assert [("CULA_KDA_TC_DIAG=clock" in c) for c in splits] == [False, True, False, True]
    assert "diag_clock" in aot_build.CORE_SCENARIOS


def test_s38_raw_times_the_stores_at_three_ctas(tmp_path):
    from cula.kernels.common import aot_build

    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s38_raw")
    assert len(cmds) == 6 and all("--split worst" in c for c in cmds)
    diags = [c.split("CULA_KDA_TC_DIAG=")[1].split()[0] if "CULA_KDA_TC_DIAG=" in c else "" for c in cmds]
    assert diags == ["", "no_qg_kgt,no_wu_store", "no_qg_kgt,no_wu_store,no_aqk_store"] * 2
    assert {"diag_no_qkx", "diag_no_stores"} <= set(aot_build.CORE_SCENARIOS)


def test_s38_is_the_gpu_tests_then_s38_raw_then_s38_clock(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s38")
    assert "tests/test_kda_fwd_clock.py" in cmds[0] and "-m gpu" in cmds[0]
    assert cmds[1:] == dry_run(tmp_path / "a", "NVIDIA H100 80GB HBM3", "s38_raw", "s38_clock")


def test_s39_raw_runs_the_raw_tile_gpu_tests_then_the_stage_2_bench(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H200", "s39_raw")
    assert len(cmds) == 2
    assert "-m gpu" in cmds[0] and "tests/test_kda_raw_tiles.py" in cmds[0]
    assert "kda_fwd_recur --raw-bench" in cmds[1]


def test_raw_tiles_runs_the_gpu_tests_then_splits_against_the_default_twice(tmp_path):
    from cula.kernels.common import aot_build

    cmds = dry_run(tmp_path, "NVIDIA H200", "raw_tiles")
    assert "-m gpu" in cmds[0] and "tests/test_kda_raw_tiles.py" in cmds[0]
    assert len(cmds) == 5 and all("--split worst" in c for c in cmds[1:])
    assert ["CULA_KDA_RAW_TILES=1" in c for c in cmds[1:]] == [False, True, False, True]
    assert {"raw_split", "raw_suites"} <= set(aot_build.CORE_SCENARIOS)
    (suite,) = dry_run(tmp_path / "s", "NVIDIA H200", "raw_suite")
    assert "CULA_KDA_RAW_TILES=1" in suite and "--suite kda " in suite and "/raw" in suite.split("--out-dir ")[1]


def test_block32_checks_name_real_cases_then_splits(tmp_path):
    from cula.kernels.sm90.kda_fwd_check import CASES

    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "block32")
    check = cmds[0]
    assert "CULA_KDA_TC_FACTOR_BLOCK" not in check and "--no-bench" in check  # 32-row blocks: the default
    names = check.split("--cases ")[1].split()[0].split(",")
    assert len(names) == 9 and set(names) <= {c[0] for c in CASES}
    assert {"tc-lb5-strong", "tc-lb536-strong"} <= set(names)
    splits = cmds[1:]
    assert [("CULA_KDA_TC_FACTOR_BLOCK=16" in c) for c in splits] == [True, False, False] * 2
    assert [("CULA_KDA_TC_GATE_FACTORS=direct" in c) for c in splits] == [False, False, True] * 2


def test_fused_premise_splits_stores_off_at_one_and_two_ctas(tmp_path):
    from cula.kernels.common.aot_build import NO_STORES

    cmds = dry_run(tmp_path, "NVIDIA H200", "fused_premise")
    assert len(cmds) == 8 and all("--split worst" in c for c in cmds)
    diags = [c.split("CULA_KDA_TC_DIAG=")[1].split()[0].split(",") if "CULA_KDA_TC_DIAG=" in c else [] for c in cmds]
    assert diags == [[], ["one_cta"], list(NO_STORES), ["one_cta", *NO_STORES]] * 2


def test_phase1_checks_every_gate_form_then_splits_against_pre26(tmp_path):
    from cula.kernels.sm90.kda_fwd_check import CASES

    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "phase1")
    check = cmds[0]
    assert "CULA_KDA_TC_PHASE1" not in check and "--no-bench" in check  # the lean phase 1 is the default
    names = check.split("--cases ")[1].split()[0].split(",")
    assert set(names) <= {c[0] for c in CASES} and len(names) == 9
    assert {"tc-softplus-varlen-zero", "tc-fp32-gate-plainbeta", "tc-loggate-safe-varlen"} <= set(names)
    splits = cmds[1:]
    assert len(splits) == 4 and all("--split worst" in c for c in splits)
    assert [("CULA_KDA_TC_PHASE1=pre26" in c) for c in splits] == [False, True] * 2


def test_tma_qk_checks_gpu_test_then_splits_against_lean(tmp_path):
    from cula.kernels.sm90.kda_fwd_check import CASES

    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "tma_qk")
    check, test = cmds[:2]
    assert "CULA_KDA_TC_PHASE1" not in check and "--no-bench" in check  # tma_qk is the default
    names = check.split("--cases ")[1].split()[0].split(",")
    assert set(names) <= {c[0] for c in CASES} and len(names) == 9
    assert "pytest" in test and "tma_qk" in test and "CULA_KDA_TC_PHASE1" not in test
    splits = cmds[2:]
    assert len(splits) == 4 and all("--split worst" in c for c in splits)
    assert [("CULA_KDA_TC_PHASE1=lean" in c) for c in splits] == [False, True] * 2


def new_kernel_head(cmds: list[str], env: str, default: bool, k: str) -> list[str]:
    """The first three commands of a new stage 1's step: one case under a short limit (a hang costs 45 s), the
    nine tc checks, the GPU tests ``-k k``; ``env`` set in the first two unless the mode is already the default.
    Returns the commands after them."""
    sanity, check, test = cmds[:3]
    assert (env not in sanity) == default and "--cases tc-T1" in sanity
    assert (env not in check) == default and len(check.split("--cases ")[1].split()[0].split(",")) == 9
    assert "pytest" in test and k in test.split(" -k ")[1]
    return cmds[3:]


def test_tma_qkg_sanity_first_then_checks_gpu_tests_and_a_split_against_tma_qk(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "tma_qkg")
    splits = new_kernel_head(cmds, "CULA_KDA_TC_PHASE1", True, "tma_qk")  # tma_qkg was the default
    assert len(splits) == 2 and [("CULA_KDA_TC_PHASE1=tma_qk" in c) for c in splits] == [False, True]


def test_clock_tma_runs_the_three_clocks(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "clock_tma")
    assert len(cmds) == 3 and all("kda_fwd_clock" in c for c in cmds)
    assert "--one-cta" in cmds[1] and "--n 20" in cmds[2]


def test_pf_tma_splits_each_prefetch_distance_between_two_defaults(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "pf_tma")
    assert len(cmds) == 5 and all("--split worst" in c for c in cmds)
    pf = [c.split("CULA_KDA_TC_PREFETCH=")[1].split()[0] if "CULA_KDA_TC_PREFETCH=" in c else None for c in cmds]
    assert pf == [None, "0", "33", "132", None]


def test_pack_sanity_first_then_checks_gpu_test_and_splits(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "pack")
    splits = new_kernel_head(cmds, "CULA_KDA_PACK=1", False, "pack_equals")
    assert len(splits) == 4 and [("CULA_KDA_PACK=1" in c) for c in splits] == [False, True] * 2
    assert [("CULA_KDA_PACK=0" in c) for c in splits] == [True, False] * 2  # forced off: the default decides by length


def test_s30_sanity_checks_then_the_u_in_recur_and_pack_gpu_tests(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s30")
    rest = new_kernel_head(cmds, "CULA_KDA", True, "u_in_recur")  # the defaults, nothing forced
    assert "pack_equals" in cmds[2] and rest == []


def test_sanitize_pack_runs_memcheck_packed_then_racecheck_unpacked_and_packed(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "sanitize_pack")
    tools = [(c.split("--tool ")[1].split()[0], c.split("CULA_KDA_PACK=")[1].split()[0]) for c in cmds]
    assert tools == [("memcheck", "1"), ("racecheck", "0"), ("racecheck", "1")]
    assert all("tc-T65-gva-vfirst" in c and "--no-fla" in c for c in cmds)  # two chunks: a chunk after the first


def test_s31_sanity_checks_the_three_gpu_tests_then_chunk_against_the_default(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s31")
    rest = new_kernel_head(cmds, "CULA_KDA", True, "order_equals")  # the defaults, nothing forced
    assert "u_in_recur" in cmds[2] and "pack_equals" in cmds[2]
    assert len(rest) == 2 and all("--split l2" in c for c in rest)
    assert ["CULA_KDA_TC_ORDER=chunk" in c for c in rest] == [True, False]


def test_s32_checks_unpacked_and_packed_the_gpu_tests_then_the_default_against_it_off(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s32")
    assert len(cmds) == 8 and all("CULA_KDA_W_IN_RECUR=1" in c for c in cmds[:3])
    assert "--cases tc-T1" in cmds[0] and "tc-loggate-safe-varlen" in cmds[1] and "tc-loggate-safe-varlen" in cmds[2]
    assert ["CULA_KDA_PACK=1" in c for c in cmds[:3]] == [False, False, True]
    assert "pytest" in cmds[3] and "w_in_recur" in cmds[3]
    splits = cmds[4:]
    assert all("--split worst" in c for c in splits) and ["W_IN_RECUR=0" in c for c in splits] == [True, False] * 2


def test_no_w_in_suite_runs_the_kda_suite_with_w_in_stage_2_off_into_its_own_folder(tmp_path):
    (cmd,) = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "no_w_in_suite")
    assert "CULA_KDA_W_IN_RECUR=0" in cmd and "--suite kda " in cmd and cmd.rstrip().endswith("--max-time 0.2")
    assert "/no_w_in" in cmd.split("--out-dir ")[1].split()[0]


def test_s33_checks_the_packed_default_the_gpu_tests_then_splits_two_ctas_against_it(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s33")
    assert len(cmds) == 7 and all("CULA_KDA_PACK=1" in c and "CTAS" not in c for c in cmds[:2])
    assert "--cases tc-T65-gva-vfirst" in cmds[0] and "tc-loggate-safe-varlen" in cmds[1]
    assert "pytest" in cmds[2] and "ctas3" in cmds[2]
    splits = cmds[3:]
    assert all("--split worst" in c for c in splits) and ["TC_CTAS=2" in c for c in splits] == [True, False] * 2


def test_s34_runs_the_occupancy_and_the_bitwise_equality_gpu_tests_at_the_defaults(tmp_path):
    (cmd,) = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s34")
    assert "pytest" in cmd and "-m gpu" in cmd and "test_kda_tc_numerics.py" in cmd and "CULA_KDA" not in cmd
    assert '-k ctas or pack_equals_unpacked' in cmd or '"ctas or pack_equals_unpacked"' in cmd


def test_s34u_checks_the_unpacked_default_the_gpu_tests_then_splits_two_ctas_against_it(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s34u")
    assert len(cmds) == 7 and all("CULA_KDA_PACK=0" in c and "CTAS" not in c for c in cmds[:2])
    assert "--cases tc-T65-gva-vfirst" in cmds[0] and "tc-loggate-safe-varlen" in cmds[1]
    assert "pytest" in cmds[2] and "ctas" in cmds[2] and "CULA_KDA_PACK" not in cmds[2]
    splits = cmds[3:]
    assert all("--split worst" in c for c in splits) and ["TC_CTAS=2" in c for c in splits] == [True, False] * 2


def test_sanitize_ctas3_runs_memcheck_then_racecheck_at_three_ctas_packed(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "sanitize_ctas3")
    assert [c.split("--tool ")[1].split()[0] for c in cmds] == ["memcheck", "racecheck"]
    assert all("CULA_KDA_TC_CTAS=3" in c and "CULA_KDA_PACK=1" in c and "tc-T65-gva-vfirst" in c for c in cmds)


def test_ctas2_suite_runs_the_kda_suite_at_two_ctas_into_its_own_folder(tmp_path):
    (cmd,) = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "ctas2_suite")
    assert "CULA_KDA_TC_CTAS=2" in cmd and "--suite kda " in cmd and cmd.rstrip().endswith("--max-time 0.2")
    assert "/ctas2" in cmd.split("--out-dir ")[1].split()[0]


def test_pack_premise_splits_the_byte_diagnostics_against_the_default_twice(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "pack_premise")
    assert len(cmds) == 4 and all("--split worst" in c for c in cmds)
    both = [("CULA_KDA_TC_DIAG=no_tp_store" in c) + ("CULA_KDA_RECUR_DIAG=half_at" in c) for c in cmds]
    assert both == [0, 2] * 2


def test_g_first_sanity_first_then_checks_gpu_tests_splits_and_clock(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "g_first")
    rest = new_kernel_head(cmds, "CULA_KDA_TC_PHASE1", True, "g_first")  # tma_g_first is the default
    splits, clock = rest[:4], rest[4:]
    assert all("--split worst" in c for c in splits)
    old = [("CULA_KDA_TC_PHASE1=tma_qkg" in c and "CULA_KDA_TC_PREFETCH=66" in c) for c in splits]
    assert old == [False, True] * 2
    assert len(clock) == 1 and "kda_fwd_clock" in clock[0]



def test_s35_runs_the_occupancy_and_aot_gpu_tests_then_small_splits_two_ctas_against_the_default(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s35")
    assert len(cmds) == 6
    assert "tests/test_kda_tc_numerics.py" in cmds[0] and "ctas" in cmds[0] and "tests/test_aot.py" in cmds[1]
    splits = cmds[2:]
    assert all("--split small" in c for c in splits) and ["TC_CTAS=2" in c for c in splits] == [True, False] * 2


def test_raw_premise_splits_stage1_without_the_qg_kgt_and_x_stores_against_the_default_twice(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "raw_premise")
    assert len(cmds) == 4 and all("--split worst" in c for c in cmds)
    diag = ["CULA_KDA_TC_DIAG=no_qg_kgt,no_wu_store " in c for c in cmds]
    assert diag == [False, True] * 2 and not any("no_aqk_store" in c for c in cmds)


@pytest.mark.parametrize("gpu, suites", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False)])
def test_first_publishes_the_suites_on_an_h200_then_runs_the_aot_gpu_test(tmp_path, gpu, suites):
    cmds = dry_run(tmp_path, gpu, "first")
    assert "tests/test_aot.py" in cmds[-1] and "-m gpu" in cmds[-1]
    ran = " ".join(cmds[:-1])
    assert ("--suite kda " in ran and "--suite kda_train " in ran and "--suite kda_layer " in ran
            and "memcheck" in ran) == suites
    assert bool(ran) == suites


def test_s37_runs_the_gpu_tests_then_splits_against_session_36_twice(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s37")
    assert "pytest" in cmds[0] and "-m gpu" in cmds[0] and "-k widen or kgt" in cmds[0]
    assert len(cmds) == 5 and all("--split worst" in c for c in cmds[1:])
    assert ["CULA_KDA_TC_WIDEN=cvt CULA_KDA_TC_KGT=kh " in c for c in cmds[1:]] == [False, True] * 2


def test_s37b_checks_the_square_gate_factors_then_splits_against_them_twice(tmp_path):
    cmds = dry_run(tmp_path, "NVIDIA H100 80GB HBM3", "s37b")
    assert "CULA_KDA_TC_GATE_FACTORS=square" in cmds[0] and "--check" in cmds[0] and "tc-lb5-strong" in cmds[0]
    assert len(cmds) == 5 and all("--split worst" in c for c in cmds[1:])
    assert ["CULA_KDA_TC_GATE_FACTORS=square " in c for c in cmds[1:]] == [False, True] * 2

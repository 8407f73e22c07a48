"""The ``clock`` diagnostic of the tensor-core stage 1 (phase stamps by the SM's cycle counter): the analysis on
hand-made stamps, the host path's buffer, and the stamps in the PTX (the default PTX has none)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from _kda_host import record_kda_launches
from cula.kernels.sm90 import kda_fwd
from cula.kernels.sm90.kda_fwd_clock import STAMP_NAMES, phase_rows, report, sm_sharing, wait_company


def test_phase_rows_are_the_spans_between_stamps():
    steps = np.arange(1, len(STAMP_NAMES))  # span k lasts k cycles in chunk 0, 2k in chunk 1, 3k in chunk 2
    stamps = np.stack([np.concatenate([[100 * c], 100 * c + np.cumsum(steps * (c + 1))]) for c in range(3)])
    rows = phase_rows(stamps)
    assert [r[0] for r in rows] == [*STAMP_NAMES[1:], "life"]
    life = steps.sum() * 2  # the median chunk's
    for k, (name, p10, p50, p90, share) in enumerate(rows[:-1], start=1):
        assert p50 == 2 * k and p10 < p50 < p90 and share == pytest.approx(2 * k / life)
    assert rows[-1][2] == life and rows[-1][4] == 1.0


def test_sm_sharing_counts_company_idle_time_and_launch_gaps():
    # SM 0: A [0, 100), B [50, 150), C [160, 200); SM 1: D [1000, 1100) alone
    entry = np.array([0, 50, 160, 1000])
    end = np.array([100, 150, 200, 1100])
    sm = np.array([0, 0, 0, 1])
    sh = sm_sharing(entry, end, sm)
    # resident CTA-cycles 240 + 100 over busy spans 200 + 100; company 50..100 for A and B: 100 of 340
    assert sh["resident"] == pytest.approx(340 / 300)
    assert sh["shared"] == pytest.approx(100 / 340)
    assert sh["idle"] == pytest.approx(10 / 300)
    assert sh["gap_median"] == pytest.approx(35)  # A's end -> C 60, B's end -> C 10
    stamps = np.zeros((4, 16), dtype=np.int64)
    stamps[:, 0], stamps[:, len(STAMP_NAMES) - 1] = entry, end
    assert "[clock] per SM: 1.13 CTAs resident" in report(stamps, sm, "t")


def test_wait_company_tells_in_step_from_staggered_ctas():
    # SM 0, in step: A and B both [0, 100), waiting [0, 20); SM 1, staggered: C [0, 100) waits [0, 20), D [50, 150)
    # waits [50, 70): C is at work through all of D's wait, and nobody through C's (D not yet there)
    entry = np.array([0, 0, 0, 50])
    wait_end = np.array([20, 20, 20, 70])
    end = np.array([100, 100, 100, 150])
    same = wait_company(entry[:2], wait_end[:2], end[:2], np.array([0, 0]))
    assert same["wait"] == 1.0 and same["work"] == 0.0 and same["offset"][2] == 0.0
    apart = wait_company(entry[2:], wait_end[2:], end[2:], np.array([1, 1]))
    assert apart["work"] == pytest.approx(20 / 40) and apart["wait"] == 0.0
    assert apart["offset"][2] == pytest.approx(0.5)  # D starts half a life after C
    stamps = np.zeros((2, 16), dtype=np.int64)
    stamps[:, 0], stamps[:, STAMP_NAMES.index("tma_wait")], stamps[:, len(STAMP_NAMES) - 1] = entry[2:], \
        wait_end[2:], end[2:]
    assert "others on its SM work 50.0% and wait 0.0%" in report(stamps, np.array([1, 1]), "t")


def test_host_path_puts_the_stamps_after_gamma(monkeypatch):
    """With the diagnostic, γ's buffer grows by CLOCK_SLOTS int64 per (head, chunk), zeroed, and LAST_CLOCKS views
    them; the launch key carries it; the outputs are right, so no warning. Without it, γ is as before."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    calls = record_kda_launches(monkeypatch)
    HV, T = 2, 130
    q, k, v, g = (torch.randn(1, T, HV, 128).bfloat16() for _ in range(4))
    beta = torch.randn(1, T, HV).bfloat16()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, safe_gate=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV * 128))
    monkeypatch.setattr(intra_tc, "DIAG", ("clock",))
    monkeypatch.setattr(kda_fwd, "LAST_CLOCKS", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kda_fwd.kda_fwd(q, k, v, g, beta, **kw)
    (kind, key, _, values), _ = calls
    assert kind == "intra_tc" and dict(key[0])["diag"] == ("clock",)
    clocks, chunks = kda_fwd.LAST_CLOCKS
    nc = chunks.shape[0]
    assert clocks.shape == (HV, nc, intra_tc.CLOCK_SLOTS) and clocks.dtype == torch.int64
    assert not clocks.any()
    gam_ptr = values[13]
    assert clocks.data_ptr() == gam_ptr + HV * nc * 128 * 4  # where the kernel writes them
    calls.clear()
    monkeypatch.setattr(intra_tc, "DIAG", ())
    monkeypatch.setattr(kda_fwd, "LAST_CLOCKS", None)
    kda_fwd.kda_fwd(q, k, v, g, beta, **kw)
    assert "diag" not in dict(calls[0][1][0]) and kda_fwd.LAST_CLOCKS is None


def test_clock_ptx_reads_the_counter_at_every_stamp():
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report
    from cula.kernels.sm90.kda_fwd_intra_tc import CLOCK_SLOTS

    rep = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_clock")
    assert rep.ptx.count("%clock64") == len(STAMP_NAMES) and rep.ptx.count("%smid") == 1
    assert rep.ptx.count("st.global.v2.u64") == CLOCK_SLOTS // 2  # thread 0's stamps, 16 bytes at a time
    assert rep.spill_bytes == 0
    base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out")
    assert "%clock64" not in base.ptx and "%smid" not in base.ptx


def test_suite_call_is_the_split_rows_launch(monkeypatch):
    """kda_fwd_clock and kda_fwd_profile build their call with ``suite_call``: the suite's flags, so its stage-1
    launch under the clock diagnostic is one the AOT scenario ``diag_clock`` prebuilds; varlen means B = 1."""
    pytest.importorskip("cutlass")
    from cula.kernels.common import aot_build
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90.kda_fwd_profile import suite_call

    have = {key for kind, key, _, _ in aot_build.record_launches("diag_clock") if kind == "intra_tc"}
    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(intra_tc, "DIAG", ("clock",))
    args, kw = suite_call(2, 256, 4, "uniform", 3, dev="cpu")
    assert args[0].shape == (1, 256, 4, 128) and kw["cu_seqlens"].tolist()[-1] == 256
    assert kw["initial_state"].shape == (3, 4, 128, 128)
    kda_fwd.kda_fwd(*args, **kw, stages=("intra",))
    assert [c[1] in have for c in calls if c[0] == "intra_tc"] == [True]

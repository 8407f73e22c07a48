"""Tests of the KDA forward prefill kernels (kernels/sm90/kda_fwd*.py).

CPU: the torch emulation of the two stages (same scratch layout as the kernels) against the exact
reference; both kernels compile to sm_90a PTX with wgmma / bulk tensor copies and no spills;
``supports()`` reasons. GPU (marked): each case of ``kda_fwd_check.CASES`` against the fp64
reference, the emulation per stage, FLA, and a rerun (determinism).
"""

from __future__ import annotations

import re

import pytest
import torch

from _kda_host import record_allocations, record_kda_launches
from cula.kernels.sm90 import kda_fwd
from cula.ref import kda as ref


def _case(B, T, H, HV, cu, seed, **flags):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 128, generator=gen)
    k = torch.randn(B, T, H, 128, generator=gen)
    v = torch.randn(B, T, HV, 128, generator=gen)
    g = torch.randn(B, T, HV, 128, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen)
    N = B if cu is None else len(cu) - 1
    kw = dict(flags, initial_state=torch.randn(N, HV, 128, 128, generator=gen) * 0.1,
              output_final_state=True, cu_seqlens=None if cu is None else torch.tensor(cu))
    if flags.get("use_gate_in_kernel"):
        kw["A_log"] = torch.randn(HV, generator=gen) * 0.5
        kw["dt_bias"] = torch.randn(HV * 128, generator=gen) * 0.1
    if not flags.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta)
    if not flags.get("use_gate_in_kernel"):
        g = -torch.nn.functional.softplus(g)
    return (q, k, v, g, beta), kw


EMULATION_CASES = [
    pytest.param(2, 65, 2, 2, None, dict(use_gate_in_kernel=True, lower_bound=-5.0), id="T65-lb"),
    pytest.param(1, 150, 1, 2, [0, 0, 15, 79, 150], dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True),
                 id="varlen-zero-gva"),
    pytest.param(1, 130, 1, 1, [0, 1, 130], dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                                 state_v_first=True), id="vfirst-negeig"),
    pytest.param(1, 1, 2, 2, None, dict(), id="T1"),
]


@pytest.mark.parametrize("B,T,H,HV,cu,flags", EMULATION_CASES)
def test_emulated_stages_match_reference(B, T, H, HV, cu, flags):
    """The two-stage algorithm and its scratch layout (what the kernels implement) are exact."""
    args, kw = _case(B, T, H, HV, cu, seed=T, **flags)
    o, ht, scratch = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    o_r, ht_r = ref.recurrent(*args, **kw, dtype=torch.float64)
    assert (o - o_r).norm() / o_r.norm() < 1e-10
    assert (ht - ht_r).norm() / ht_r.norm() < 1e-10
    nc = kda_fwd.chunk_tables(kw["cu_seqlens"] if cu is not None else torch.arange(B + 1) * T)[2]
    assert scratch["w"].shape == (HV, nc * 64, 128) and scratch["kgt"].shape == (HV, 128, nc * 64)


@pytest.mark.parametrize("B,T,H,HV,cu,flags", EMULATION_CASES[:3])
def test_emulated_u_in_recur_matches_reference(B, T, H, HV, cu, flags):
    """U_IN_RECUR's scratch (T' beside Aqk, -w, no u) and its stage 2 (v_new = T' v + (-w) S from the
    chunk-padded input rows) are the same algorithm: exact in fp64, and T' v is the default's u."""
    args, kw = _case(B, T, H, HV, cu, seed=T, **flags)
    o, ht, scratch = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64, u_in_recur=True)
    _, _, base = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    o_r, ht_r = ref.recurrent(*args, **kw, dtype=torch.float64)
    assert (o - o_r).norm() / o_r.norm() < 1e-10 and (ht - ht_r).norm() / ht_r.norm() < 1e-10
    assert "u" not in scratch and scratch["tp"].shape == scratch["aqk"].shape
    assert torch.equal(scratch["w"], -base["w"])
    hv, r, _ = scratch["tp"].shape
    tp = scratch["tp"].reshape(hv, r // 64, 64, 64)
    assert torch.allclose(tp @ scratch["v"].reshape(hv, r // 64, 64, -1), base["u"].reshape(hv, r // 64, 64, -1),
                          atol=1e-12)
    assert torch.equal(tp, tp.tril())  # unit-lower T times diag(β): nothing above the diagonal


@pytest.mark.parametrize("B,T,H,HV,cu,flags", EMULATION_CASES[:3])
def test_emulated_w_in_recur_matches_reference(B, T, H, HV, cu, flags):
    """W_IN_RECUR's scratch (-X for -w, T', no u) and its stage 2 (v_new = T'(v - X S)) are the same algorithm:
    exact in fp64, and T' times -X is U_IN_RECUR's -w."""
    args, kw = _case(B, T, H, HV, cu, seed=T + 1, **flags)
    o, ht, scratch = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64, u_in_recur=True, w_in_recur=True)
    _, _, base = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64, u_in_recur=True)
    o_r, ht_r = ref.recurrent(*args, **kw, dtype=torch.float64)
    assert (o - o_r).norm() / o_r.norm() < 1e-10 and (ht - ht_r).norm() / ht_r.norm() < 1e-10
    assert "w" not in scratch and "u" not in scratch and scratch["x"].shape == base["w"].shape
    hv, r, _ = scratch["tp"].shape
    tp = scratch["tp"].reshape(hv, r // 64, 64, 64)
    assert torch.allclose(tp @ scratch["x"].reshape(hv, r // 64, 64, -1), base["w"].reshape(hv, r // 64, 64, -1),
                          atol=1e-12)
    with pytest.raises(AssertionError, match="needs u in stage 2"):
        kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64, w_in_recur=True)


def test_emulation_detects_a_wrong_scratch():
    """A perturbed stage-1 output changes o: the per-stage GPU comparison can fail."""
    args, kw = _case(1, 70, 1, 1, None, seed=3, use_gate_in_kernel=True)
    o, _, scratch = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    chunks, seqs, _ = kda_fwd.chunk_tables(torch.tensor([0, 70]))
    a = scratch["aqk"]
    a_t = a.reshape(a.shape[0], -1, 64, 64).transpose(-1, -2).reshape(a.shape)  # Aqkᵀ per chunk
    scratch = dict(scratch, aqk=a_t)
    o_bad, _ = kda_fwd.emulate_recurrence(scratch, chunks, seqs, 70, kw["initial_state"], True, False,
                                          torch.float64)
    assert (o_bad.reshape_as(o) - o).norm() / o.norm() > 1e-2


def test_chunk_tables_zero_length_segments():
    chunks, seqs, nc = kda_fwd.chunk_tables(torch.tensor([0, 0, 64, 65, 65, 200]))
    assert nc == 1 + 1 + 3
    assert seqs.tolist() == [[0, 0], [0, 1], [1, 1], [2, 0], [2, 3]]
    assert chunks.tolist() == [[0, 64], [64, 1], [65, 64], [129, 64], [193, 7]]


def test_supports_reports_not_validated_on_cpu():
    args, kw = _case(1, 8, 1, 1, None, seed=0)
    reason = kda_fwd.supports(*args, **kw)
    assert isinstance(reason, str) and reason


@pytest.mark.parametrize("target,needs_wgmma", [("intra", False), ("intra_prefetch", False),
                                               ("intra_blocked_inverse", False), ("intra_v2", False),
                                               ("intra_v2_blocked_inverse", False), ("recur", True),
                                               ("recur_v_first", True), ("recur_v2", True),
                                               ("recur_v2_v_first", True), ("recur_v2_no_state", True),
                                               ("recur_v2_state_smem", True), ("recur_v2_state_smem_v_first", True),
                                               ("recur_v2_state_smem_h0_only", True),
                                               ("recur_v2_state_smem_ht_only", True),
                                               ("recur_v2_t_in", True), ("recur_v2_t_in_no_state", True),
                                               ("recur_v2_t_in_state_smem", True),
                                               ("intra_tc", True),
                                               ("intra_tc_fp32_gate", True), ("intra_tc_plain_gva", True),
                                               ("intra_tc_simt_inverse", True),
                                               ("intra_tc_prefetch", True), ("intra_tc_pdl_end", True),
                                               ("intra_tc_softplus_gate", True),
                                               ("intra_tc_softplus_fp32_gate_gva", True),
                                               ("intra_tc_diag_all", True), ("intra_tc_emit_akk", True),
                                               ("intra_tc_log_gate", True), ("intra_tc_diag_no_v_u", True),
                                               ("intra_tc_t_out", True), ("intra_tc_t_out_softplus_gva", True),
                                               ("intra_tc_t_out_diag_all", True), ("intra_tc_t_out_gate_direct", True),
                                               ("intra_tc_t_out_subst_left", True),
                                               ("intra_tc_t_out_direct_left", True),
                                               ("intra_tc_t_out_block32", True),
                                               ("intra_tc_t_out_block32_pre26", True),
                                               ("intra_tc_t_out_block32_lean", True),
                                               ("intra_tc_t_out_block32_tma_qk", True),
                                               ("intra_tc_t_out_block32_tma_qkg", True),
                                               ("intra_tc_t_out_block32_pack_chunk", True)])
def test_ptx_compiles_clean(target, needs_wgmma):
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report

    rep = ptx_report("cula.kernels.sm90.kda_fwd", target)
    assert rep.kernels, "ptxas reported no kernel"
    assert rep.spill_bytes == 0
    assert rep.max_registers <= 255
    if target in ("intra", "intra_prefetch"):  # a later CTA's q, k, v rows (2 lines each), g rows (2 bf16, 4 fp32)
        from cula.kernels.sm90.kda_fwd_intra import PREFETCH_AHEAD as SIMT_PREFETCH_AHEAD

        want = {"intra_prefetch": 10, "intra": 8 if SIMT_PREFETCH_AHEAD else 0}[target]
        assert rep.count("prefetch.global.L2") == want
    if target.startswith("intra_v2"):  # 2 CTAs x 256 threads per SM (its launch bound)
        assert rep.max_registers <= 128
    if needs_wgmma and target.startswith("recur"):
        assert rep.count("wgmma.mma_async") >= 20  # 8 + 8 + 4 (n64) and 4 (n128) per chunk
        assert rep.has("cp.async.bulk.tensor")
    if target.startswith("recur_v2"):
        t_in = "t_in" in target  # u in stage 2: + vᵀ T'ᵀ (4 SS m64n64k16, A MN-major: trans-a 1)
        n_vt = 4 if t_in else 0
        # one chunk's code: 8 + 8 + 4 m64n64k16 and 4 m64n128k16, A from registers (no A descriptors)
        assert rep.count("wgmma.mma_async") == 24 + n_vt and rep.count("m64n128k16") == 4
        assert rep.count("p, 1,  1, 1, 0;") == n_vt  # the SS products' transpose bits
        # w, qg (two 128-byte boxes each), u, γ, kgᵀ, Aqk; t_in: v for u, and Aqk | T' in two boxes
        assert rep.count("cp.async.bulk.tensor") == (9 if t_in else 8)
        # t_in: a partial chunk's v rows are zeroed by the math warps, then named barrier 2
        assert rep.count("bar.sync 2, 128;") == n_vt // 4
        from cula.kernels.sm90.kda_fwd_recur import V2_H0_PREFETCH

        smem_state = "state_smem" in target
        # the next item's state tile, 2 lines per thread (none without an initial state, nor where the
        # state moves through shared memory: there it is a cp.async of 16 pieces, at two call sites)
        pf = 2 if "no_state" not in target and V2_H0_PREFETCH and not smem_state else 0
        assert rep.count("prefetch.global.L2") == pf
        h0_async = smem_state and "ht_only" not in target
        assert rep.count("cp.async.cg.shared.global") == (32 if h0_async else 0)
        # scalar state loads / stores only where the state stays in registers end to end
        scalar = not smem_state and "no_state" not in target
        assert (rep.count("ld.global.f32") >= 64) == scalar and (rep.count("st.global.f32") >= 64) == scalar
        from cula.kernels.sm90.kda_fwd_recur import PDL

        # programmatic dependent launch: the TMA warp alone waits for stage 1's grid, once per CTA
        assert rep.count("griddepcontrol.wait") == (1 if PDL else 0)
        # ptxas did not have to serialise any wgmma (registers of one in flight read too early)
        assert "C7517" not in rep.ptxas_log and "serialized" not in rep.ptxas_log
        # the mbarrier-init barrier only: no CTA barrier per chunk (the state buffer's are per item, among
        # the math warps: named barrier 1)
        assert rep.count("bar.sync \t0;") == 1
        assert (rep.count("bar.sync 1, 128;") > 0) == smem_state
        assert rep.count("st.global.v4") >= 4 and rep.count("ld.shared.v4") >= 4  # o as 16-byte rows
        assert rep.count("ld.shared.v2.f32") >= 16  # γ from the stage (pairs of k)
    if target.startswith("intra_tc"):
        # 2 x 8 diagonal (m64n64) + 2 x 3 x 8 off-diagonal (m64n16 / n32 / n48) + 2 x 4 (m64n128); the
        # wgmma inverse step (the default) adds 2 products x 3 hi/lo passes x 2 k-blocks (m64n64k16, A
        # from registers)
        inv = 0 if target.endswith("simt_inverse") else 12
        # the timing diagnostic and u in stage 2 (t_out): no v loads, no u product / store
        no_v_u = target.endswith("no_v_u") or "t_out" in target
        # every CTA lets stage 2 launch as soon as it is resident (one instruction, before anything else;
        # pdl_end: after its work, one instruction too)
        assert rep.count("griddepcontrol.launch_dependents") == 1
        # 32-row factor blocks: one m64n32 off-diagonal product per matrix instead of three
        off = 2 * 1 * 8 if "block32" in target else 2 * 3 * 8
        assert rep.count("wgmma.mma_async") == 16 + off + 8 + inv - (4 if no_v_u else 0)
        # q, k by TMA (since session 27): two 64-column boxes each; a bf16 g too (PHASE1 "tma_qkg", the default
        # since session 28)
        tma_qk = not any(m in target for m in ("_lean", "pre26"))
        fp32_g = target in ("intra_tc_fp32_gate", "intra_tc_softplus_fp32_gate_gva", "intra_tc_log_gate")
        tma_g = tma_qk and not target.endswith("_tma_qk") and not fp32_g
        # TMA stores: aqk, w and u (two 64-column boxes); t_out: T' beside Aqk instead of u (packed: in Aqk's tile)
        assert rep.count("cp.async.bulk.tensor") == ((4 if "t_out" in target else 3 if no_v_u else 5)
                                                     - ("_pack" in target) + (4 if tma_qk else 0) + (2 if tma_g else 0))
        # 16-byte accesses: 8 rows x q, k, v, g per thread, less those that TMA brings
        loads = (24 if no_v_u else 32) - (16 if tma_qk else 0) - (8 if tma_g else 0)
        assert rep.count("ld.global.v4") >= loads and rep.count("st.shared.v4") >= 24
        if no_v_u and "gva" not in target:  # the 8 v loads per thread are gone
            base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc")  # q, k, g by TMA
            want = base.count("ld.global.v4") - 8 + (0 if tma_qk else 16) + (0 if tma_g else 8)
            assert rep.count("ld.global.v4") == want
        # the off-diagonal factor on the B side: 12 vectors of 8 per thread (4 packed bf16 products each)
        # form B'_1..3, and each row block's off-diagonal part is one SS product per A tile of N = 16, 32,
        # 48 (8 k-steps)
        if "block32" in target:  # the one B factor folds into phase 2 (fp32); one m64n32 product per A tile
            assert rep.count("mul.bf16x2") + rep.count("mul.rn.bf16x2") == 0
            assert [rep.count(f"m64n{n}k16") for n in (16, 32, 48)] == [0, 16, 0]
        else:
            assert rep.count("mul.bf16x2") + rep.count("mul.rn.bf16x2") == 48
            assert [rep.count(f"m64n{n}k16") for n in (16, 32, 48)] == [16, 16, 16]
        # the later CTA's q, k (threads 0-63) or v, g (64-127) rows: 2 lines each (4 for an fp32 g); where
        # both branches have the same shape, ptxas merges them into one on selected addresses (4)
        # (none by default where TMA brings q, k and g: KdaFwdIntraTC.prefetch_for)
        from cula.kernels.sm90.kda_fwd_intra_tc import PREFETCH_AHEAD, PREFETCH_LOADS

        fp32_g = "fp32_gate" in target or target.endswith("log_gate")  # log_gate: fp32 log-space gates
        lines = 2 + 2 + (0 if no_v_u else 2) + (4 if fp32_g else 2)
        n_pf = rep.count("prefetch.global.L2")
        pf = PREFETCH_AHEAD if PREFETCH_AHEAD is not None else 0 if tma_g else PREFETCH_LOADS
        if target.endswith("prefetch") or pf:
            assert n_pf in (lines, lines // 2), n_pf
        else:
            assert n_pf == 0
        if target.endswith("emit_akk"):
            # bf16(T) for FLA's backward: 4 more 16-byte global stores per thread (2 threads per row, 32
            # columns each), the rest as the default
            base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc")
            assert rep.count("st.global.v4") == base.count("st.global.v4") + 4
        if target == "intra_tc_t_out":  # -w from -X, more negations than the diagnostic without T' (ptxas
            # folds them): with the halved factors X's sign rides on -2^(C/2), one per column (8); 2^Γ by exp2
            # negates each k̂ (64)
            from cula.kernels.sm90.kda_fwd_intra_tc import GATE_FACTOR_MODES

            halves = GATE_FACTOR_MODES[0] == "halves"  # the class's default
            base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_diag_no_v_u")
            assert rep.count("neg.f32") == base.count("neg.f32") + (8 if halves else 64)


def test_tc_layout_facts():
    """The hand-made addressing of kda_fwd_intra_tc matches the DSL's layouts: the m64n(16 I) fragments
    of the off-diagonal products are prefixes of the m64n64 one, the B'_I rows are 16-byte vectors, the
    RS A registers (a_operand_layout, the inverse's wgmma step) hold the operand's elements, and the
    operand tiles' swizzle is S<3,4,3>."""
    pytest.importorskip("cutlass")
    from _layout_facts import layout_facts

    facts = layout_facts("cula.kernels.sm90.kda_fwd_intra_tc")
    assert facts["a_register_mismatches"] == 0
    # the m64n(16 I) fragments are prefixes of the m64n64 one; B'_I rows as 16-byte vectors
    assert facts["offdiag_prefix_mismatches"] == 0 and facts["offdiag_b_vector_mismatches"] == 0
    assert facts["x_is_a_transposed"] and facts["w_staging_is_a"] and facts["tb_is_aqk_staging"]
    assert facts["aqk_staging_offsets"]  # pack: the T' scatter's hand-made swizzled offsets
    assert {v for k, v in facts.items() if k.startswith("swizzle_")} == {"S<3,4,3>"}


def test_recur_v2_layout_facts():
    """What v2 relies on, from the DSL's own layouts: the bf16 Sᵀ / v_newᵀ registers are the RS products'
    A operands element for element, each warp's accumulator rows are its 16 v (its o staging tile,
    covered exactly once), and the u / o shared-memory accesses are free of bank conflicts."""
    pytest.importorskip("cutlass")
    from _layout_facts import layout_facts

    facts = layout_facts("cula.kernels.sm90.kda_fwd_recur")
    assert facts["a_register_mismatches"] == 0
    assert facts["warp_row_mismatches"] == 0 and facts["o_staging_exact_cover"]
    assert facts["u_read_conflicts"] == facts["o_write_conflicts"] == facts["o_read_conflicts"] == 0
    assert facts["swizzle_t64"] == "S<3,4,3>" and facts["u_tile_is_aqk_tile"]
    # the state buffer's fragment accesses: none K-first, 2-way V-first (64 extra wavefronts over the 64 values)
    assert facts["state_kf_padded_conflicts"] == 0
    assert facts["state_vf_padded_conflicts"] <= 64
    # u in stage 2 (t_in): the compact o tile is conflict-free and covered once, zero_v_rows' whole 128-byte
    # token rows, and [Aqk | T'] as two t64 tiles (the k blocks 4-7 of the B fragment are T')
    assert facts["o_compact_write_conflicts"] == facts["o_compact_read_conflicts"] == 0
    assert facts["o_compact_swap_mismatches"] == 0  # store_o_v2 takes one half-swap per thread
    assert facts["o_compact_exact_cover"] and facts["va_token_rows"] and facts["aqk_t_halves_are_t64"]
    assert facts["swizzle_va"] == "S<3,4,3>"
    # pack: T''s MN-major copy has the packed tile's bytes where a K-major t64 tile has them, and mask_packed's
    # piece offsets are the 128-byte-swizzled ones
    assert facts["pack_tp_is_t64_transposed"] and facts["pack_mask_offset_mismatches"] == 0
    # raw_in: the transform swizzles a half's local offsets and adds the half's start (RawTiles.pair)
    assert facts["raw_half_split_mismatches"] == 0 and facts["raw_swizzles"] == "S<3,4,3> S<3,4,3>"


def test_bank_conflict_counter():
    """The counter behind the facts: 2-byte writes to distinct words of distinct banks are free, two words
    of one bank cost a pass, and 16-byte accesses go a quarter warp at a time."""
    from cula.kernels.sm90.kda_fwd_recur import _bank_conflicts

    assert _bank_conflicts([2 * i for i in range(32)], 2) == 0  # 16 words, pairs of lanes share one
    assert _bank_conflicts([14, 16], 2) == 0  # byte 14-15 is word 3, not 4
    assert _bank_conflicts([0, 128], 2) == 1  # words 0 and 32: bank 0 twice
    assert _bank_conflicts([16 * i for i in range(32)], 16) == 0
    assert _bank_conflicts([0, 128] + [16 * i for i in range(2, 8)], 16) == 1


def test_recur_state_smem_choice(monkeypatch):
    """Stage 2 moves the state through shared memory for short sequences with a state, not long ones."""
    from cula.kernels.sm90 import kda_fwd_recur as kr

    monkeypatch.setattr(kr, "STATE_SMEM_ENV", None)
    assert kr.use_state_smem(20, 20 * 4, True)  # varlen n20 T4096: 4 chunks a sequence
    assert kr.use_state_smem(10, 10 * 7, True) and not kr.use_state_smem(10, 10 * 7 + 1, True)
    assert not kr.use_state_smem(2, 512, True)  # B2 T16384
    assert not kr.use_state_smem(20, 80, False)  # nothing to move
    monkeypatch.setattr(kr, "STATE_SMEM_ENV", "1")
    assert kr.use_state_smem(2, 512, True) and not kr.use_state_smem(2, 512, False)
    monkeypatch.setattr(kr, "STATE_SMEM_ENV", "0")
    assert not kr.use_state_smem(20, 80, True)
    flags = dict(has_initial_state=False, output_final_state=False, state_v_first=False)
    assert not kr.KdaFwdRecur(**flags, variant="v2", state_smem=True).state_smem  # no state: the plain body
    assert kr.KdaFwdRecur(**{**flags, "output_final_state": True}, variant="v2", state_smem=True).stages == 2


def test_recur_pair_choice_and_validation(monkeypatch):
    """Stage 2 as pairs (both V halves of an item in one CTA): "auto" only where the V halves outnumber the SMs,
    "1" always, "0" never, anything else a ValueError naming the variable; the kernel refuses the combinations it
    has no code for, and takes two stages and three warpgroups."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as kr

    monkeypatch.setattr(kr, "PAIR_ENV", "auto")
    assert kr.use_pair(2, 64, 132)  # B2 H64: 256 V halves
    assert not kr.use_pair(1, 64, 132) and not kr.use_pair(1, 66, 132)  # 128 and 132 V halves: one each per SM
    assert kr.use_pair(1, 67, 132)
    monkeypatch.setattr(kr, "PAIR_ENV", "1")
    assert kr.use_pair(1, 1, 132)
    monkeypatch.setattr(kr, "PAIR_ENV", "0")
    assert not kr.use_pair(20, 64, 132)
    monkeypatch.setattr(kr, "PAIR_ENV", "yes")
    with pytest.raises(ValueError, match="CULA_KDA_RECUR_PAIR"):
        kr.use_pair(2, 64, 132)
    full = dict(has_initial_state=True, output_final_state=True, state_v_first=False, variant="v2")
    k = kr.KdaFwdRecur(**full, t_in=True, x_in=True, pack=True, pair=True)
    assert (k.stages, k.threads_v2, k.tma_warp, k.math_threads) == (2, 384, 8, 256)
    assert kr.KdaFwdRecur(**full, t_in=True, x_in=True).math_threads == 128
    with pytest.raises(ValueError, match="x_in"):
        kr.KdaFwdRecur(**full, t_in=True, pair=True)
    with pytest.raises(ValueError, match="state_smem"):
        kr.KdaFwdRecur(**full, t_in=True, x_in=True, pair=True, state_smem=True)
    with pytest.raises(ValueError, match="raw_in"):
        kr.KdaFwdRecur(**full, t_in=True, x_in=True, raw_in=True, pair=True)
    with pytest.raises(ValueError, match="pack_mask='rows'"):
        kr.KdaFwdRecur(**full, t_in=True, x_in=True, pack=True, pack_mask="rows", pair=True)
    assert kr.KdaFwdRecur(**full, t_in=True, x_in=True, pack_mask="rows", pair=True).pair  # (unpacked: no mask)
    # the setmaxnreg split fills the launch's pool exactly: 3 warpgroups at 168 registers a thread
    assert 2 * kr.PAIR_MATH_REGS + kr.PAIR_TMA_REGS == 3 * 168 and kr.PAIR_TMA_REGS >= 24


def test_recur_pair_launch_keys(monkeypatch):
    """kda_fwd asks for the pair kernel (``pair`` in stage 2's key, nothing else changed) only where use_pair says
    so and the state does not go through the buffer; the default keys carry no ``pair``."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as kr

    def recur_keys(B, T, state):
        calls = record_kda_launches(monkeypatch)
        meta = torch.device("meta")
        x = torch.empty(B, T, 4, 128, device=meta, dtype=torch.bfloat16)
        kda_fwd.kda_fwd(x, x, x, x, torch.empty(B, T, 4, device=meta, dtype=torch.bfloat16),
                        initial_state=torch.empty(B, 4, 128, 128, device=meta) if state else None,
                        output_final_state=state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, A_log=torch.empty(4, device=meta),
                        dt_bias=torch.empty(512, device=meta), lower_bound=-5.0, safe_gate=True)
        return [dict(key[0]) for kind, key, *_ in calls if kind == "recur"]

    monkeypatch.setattr(kr, "PAIR_ENV", "0")
    assert all("pair" not in k for k in recur_keys(2, 1000, True))
    monkeypatch.setattr(kr, "PAIR_ENV", "1")
    assert [k.get("pair") for k in recur_keys(2, 1000, True)] == [True]
    assert [k.get("pair") for k in recur_keys(2, 1000, False)] == [True]
    # packed (B2 T5000: 79 chunks a sequence): pair takes the word mask whatever PACK_MASK says, the split launch
    # PACK_MASK's (rows by default)
    for mask in kr.PACK_MASKS:
        monkeypatch.setattr(kr, "PACK_MASK", mask)
        assert [(k.get("pair"), k.get("pack_mask")) for k in recur_keys(2, 5000, True)] == [(True, "words")]
    assert [k.get("pair") for k in recur_keys(2, 300, False)] == [True]  # (unpacked: no mask; no state: no buffer)
    monkeypatch.setattr(kr, "PAIR_ENV", "0")
    monkeypatch.setattr(kr, "PACK_MASK", "rows")
    assert [k.get("pack_mask") for k in recur_keys(2, 5000, True)] == ["rows"]
    monkeypatch.setattr(kr, "PAIR_ENV", "1")
    monkeypatch.setattr(kr, "STATE_SMEM_ENV", "1")  # the state buffer wins: no pair
    assert [k.get("pair") for k in recur_keys(2, 1000, True)] == [None]


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
def test_recur_state_buffer_addressing(v_first):
    """The state buffer's element and 16-byte piece addressing agree: every element of a state tile has
    its own slot, and each thread's cp.async / copy-out piece carries 4 consecutive state elements to
    (from) the 4 slots state_offset gives them, 16-byte aligned; the pieces cover the tile once."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as kr

    kern = kr.KdaFwdRecur(True, True, v_first, variant="v2", state_smem=True)
    DK, DV, BV = kr.DK, kr.DV, kr.BV
    slots = {}
    for vv in range(BV):
        for kk in range(DK):
            slots[(vv, kk)] = int(kern.state_offset(vv, kk))
    assert len(set(slots.values())) == BV * DK and max(slots.values()) < kr.STATE_BUF
    item, n_vt, n_hv = 5, DV // BV, 3  # head 2, V tile 1
    head, v0 = (item // (n_vt * n_hv)) * n_hv + (item // n_vt) % n_hv, (item % n_vt) * BV
    seen = set()
    for tidx in range(kr.V2_MATH_THREADS):
        for m in range(kr.STATE_PIECES):
            so, go = (int(x) for x in kern.state_piece(item, (n_vt, n_hv, 1), tidx, m))
            assert so % 4 == 0 and go % 4 == 0
            for e in range(4):
                rem = go + e - head * DK * DV
                vv, kk = ((rem // DK) - v0, rem % DK) if v_first else (rem % DV - v0, rem // DV)
                assert 0 <= vv < BV and slots[(vv, kk)] == so + e
                seen.add((vv, kk))
    assert len(seen) == BV * DK


def test_recur_variant_selector(monkeypatch):
    """kda_fwd builds KdaFwdRecur without naming a body: the module constant picks it at construction."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as kr

    flags = dict(has_initial_state=True, output_final_state=True, state_v_first=False)
    assert kr.RECUR_VARIANT in kr.VARIANTS
    monkeypatch.setattr(kr, "RECUR_VARIANT", "v2")
    assert kr.KdaFwdRecur(**flags).variant == "v2"
    assert kr.KdaFwdRecur(**flags, variant="v1").variant == "v1"
    monkeypatch.setattr(kr, "RECUR_VARIANT", "v9")
    with pytest.raises(ValueError):
        kr.KdaFwdRecur(**flags)


TC_CASES = [
    pytest.param(2, 65, 2, 2, None, -5.0, 0.5, False, id="T65-lb5"),
    pytest.param(1, 200, 1, 2, [0, 0, 15, 79, 200], -5.0, 0.5, False, id="varlen-zero-gva"),
    pytest.param(1, 130, 2, 2, None, -11.0, 3.0, True, id="lb11-saturated-negeig"),
    pytest.param(1, 64, 1, 1, None, -0.1, 0.5, False, id="lb0.1"),
    # lb None: the softplus gate, clamped at SOFTPLUS_FLOOR; a_scale 3: many channels far below it
    pytest.param(1, 130, 2, 2, None, None, 0.5, False, id="softplus"),
    pytest.param(1, 200, 1, 2, [0, 0, 15, 79, 200], None, 3.0, True, id="softplus-strong-varlen-negeig"),
]


@pytest.mark.parametrize("B,T,H,HV,cu,lb,a_scale,neg", TC_CASES)
def test_tc_algorithm_matches_exact_stages(B, T, H, HV, cu, lb, a_scale, neg):
    """kda_fwd_intra_tc's algorithm (reference factors, block inverse, bf16 rounding points; torch model)
    gives the exact stage-1 scratch within bf16 error, also with gates saturated at lower_bound = -11,
    and for the unbounded softplus gate, which it clamps at SOFTPLUS_FLOOR (the exact one is unclamped)."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    args, kw = _case(B, T, H, HV, cu, seed=T, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, lower_bound=lb,
                     safe_gate=lb is not None)
    kw["A_log"] = kw["A_log"] / 0.5 * a_scale
    _, _, exact = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    qf, kf, vf, gf, bf = kda_fwd._flatten(*args)
    B_, T_ = args[0].shape[:2]
    cu_t = kw["cu_seqlens"] if kw["cu_seqlens"] is not None else kda_fwd._fixed_cu_seqlens(B_, T_, args[0].device)
    chunks, _, _ = kda_fwd.chunk_tables(cu_t)
    model = tc.emulate(*(x.bfloat16() for x in (qf, kf, vf, gf, bf)), chunks, 128 ** -0.5,
                       tc.SOFTPLUS_FLOOR if lb is None else lb, kw["A_log"], kw["dt_bias"], use_qk_l2norm=True,
                       use_beta_sigmoid=True, allow_neg_eigval=neg, softplus_gate=lb is None)
    if lb is None and a_scale > 1:  # the case must reach the clamp, or it tests nothing new
        a = kw["A_log"].double().exp()[:, None]
        sp = torch.nn.functional.softplus(gf.double() + kw["dt_bias"].double().reshape(-1, 128))
        assert ((-a * sp) < tc.SOFTPLUS_FLOOR).double().mean() > 0.05
    for name in ("w", "u", "qg", "aqk", "kgt", "gam"):
        a, b = model[name].double(), exact[name].double()
        assert torch.isfinite(a).all(), name
        # bf16 operands: observed 1.5-3.2e-3 (w, the deepest product, the largest)
        assert (a - b).norm() / b.norm() < 1e-2, name


@pytest.mark.parametrize("lb, a_scale, neg", [(-5.0, 0.5, False), (-5.0, 3.0, True), (-5.36, 3.0, False),
                                              (-0.1, 0.5, False)])
def test_tc_factor_block_32_matches_exact_stages_as_block_16_does(lb, a_scale, neg):
    """32-row reference-factor blocks (FACTOR_BLOCKS; bounds >= BLOCK32_MIN_LOWER_BOUND), the torch model: the
    exact stage-1 scratch within the same bf16 error as the 16-row blocks (a_scale 3 saturates the gates at the
    bound, where the factors are largest: 2^(15.5 |lb| / ln 2) = 2^120 at lb = -5.36)."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    assert lb >= tc.BLOCK32_MIN_LOWER_BOUND
    args, kw = _case(1, 200, 1, 2, [0, 0, 15, 79, 200], seed=3, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg,
                     lower_bound=lb, safe_gate=True)
    kw["A_log"] = kw["A_log"] / 0.5 * a_scale
    _, _, exact = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    qf, kf, vf, gf, bf = kda_fwd._flatten(*args)
    chunks, _, _ = kda_fwd.chunk_tables(kw["cu_seqlens"])
    errs = {}
    for block in tc.FACTOR_BLOCKS:
        model = tc.emulate(*(x.bfloat16() for x in (qf, kf, vf, gf, bf)), chunks, 128 ** -0.5, lb, kw["A_log"],
                           kw["dt_bias"], use_qk_l2norm=True, use_beta_sigmoid=True, allow_neg_eigval=neg,
                           factor_block=block)
        for name in ("w", "u", "qg", "aqk", "kgt", "gam"):
            a, b = model[name].double(), exact[name].double()
            assert torch.isfinite(a).all(), (block, name)
            errs[block, name] = ((a - b).norm() / b.norm()).item()
    for name in ("w", "u", "qg", "aqk", "kgt", "gam"):
        assert errs[32, name] < 1e-2, (name, errs[32, name])
        # the same roundings of the same values, except where the off-diagonal B factor is formed
        assert errs[32, name] <= 1.25 * errs[16, name] + 1e-4, (name, errs[32, name], errs[16, name])


def test_factor_block_is_chosen_by_the_bound(monkeypatch):
    """The host asks for 32-row factor blocks (the default since session 24) where the kernel's bound allows them,
    and never when CULA_KDA_TC_FACTOR_BLOCK says 16."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    assert tc.FACTOR_BLOCK == 32  # the default
    monkeypatch.setattr(tc, "FACTOR_BLOCK", 16)
    assert kda_fwd.factor_block(-5.0, False) == 16 and kda_fwd.factor_block(-0.1, False) == 16
    monkeypatch.setattr(tc, "FACTOR_BLOCK", 32)
    assert kda_fwd.factor_block(-5.0, False) == 32 and kda_fwd.factor_block(-0.1, False) == 32
    assert kda_fwd.factor_block(tc.BLOCK32_MIN_LOWER_BOUND, False) == 32
    assert kda_fwd.factor_block(-5.4, False) == 16 and kda_fwd.factor_block(-11.0, False) == 16
    assert kda_fwd.factor_block(tc.SOFTPLUS_FLOOR, True) == 16
    # precomputed log-space gates take them (their checks passed in session 25) unless LOG_GATE_BLOCK32 is off
    assert tc.LOG_GATE_BLOCK32 and kda_fwd.factor_block(-5.0, False, log_gate=True) == 32
    assert kda_fwd.factor_block(-11.0, False, log_gate=True) == 16
    monkeypatch.setattr(tc, "LOG_GATE_BLOCK32", False)
    assert kda_fwd.factor_block(-5.0, False, log_gate=True) == 16


@pytest.mark.parametrize("value", ["24", "abc"])
def test_factor_block_environment_is_checked_by_name(value):
    pytest.importorskip("cutlass")
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", "import cula.kernels.sm90.kda_fwd_intra_tc"], capture_output=True,
                         text=True, env={**__import__("os").environ, "CULA_KDA_TC_FACTOR_BLOCK": value}, timeout=300)
    assert res.returncode != 0 and f"CULA_KDA_TC_FACTOR_BLOCK: expected one of (16, 32), got {value!r}" in res.stderr


def test_factor_block_32_keeps_the_default_smem_and_fewer_registers():
    """The 32-row mode's PTX: wgmma (one m64n32 off-diagonal product a matrix), no spills, registers within two
    CTAs per SM (at most the 16-row build's until session 27; with q, k by TMA the 16-row build takes 188 against
    196); the kernel's shared memory is the same struct (two CTAs per SM)."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out")
    b32 = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_block32")
    assert b32.spill_bytes == 0 and "wgmma.mma_async" in b32.ptx
    assert b32.kernels[0].registers <= 65536 // (2 * 128) - 1
    assert b32.ptx.count("wgmma.mma_async") < base.ptx.count("wgmma.mma_async")
    with pytest.raises(ValueError, match="CULA_KDA_TC_FACTOR_BLOCK"):
        tc.KdaFwdIntraTC(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                         allow_neg_eigval=False, group=1, factor_block=24)


def test_row_norms_halving_equals_the_butterfly_bitwise():
    """row_norms' exchange, modelled lane by lane in fp32 as the kernel writes it: after the recursive halving at
    lane offsets 1, 2, 4, 8, lane bitrev4(m) of a half-warp holds sum m, bit for bit the butterfly's (session 25's
    phase 1: every lane holds every sum), because both add over the same pairwise tree of lanes."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90.kda_fwd_intra_tc import _bitrev4

    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-20, 21, (16, 16), generator=gen).float())
    vals = torch.rand(16, 16, generator=gen) * scale  # [lane, sum index]: partial sums over 8 columns each
    lanes = torch.arange(16)
    bfly = vals.clone()
    for s in range(4):
        bfly = bfly + bfly[lanes ^ (1 << s)]
    cur = [vals[:, m] for m in range(16)]
    for s in range(4):
        half = len(cur) // 2
        upper = ((lanes >> s) & 1) == 1
        cur = [torch.where(upper, cur[j + half], cur[j]) + torch.where(upper, cur[j], cur[j + half])[lanes ^ (1 << s)]
               for j in range(half)]
    assert sorted(_bitrev4(m) for m in range(16)) == list(range(16))
    for m in range(16):
        assert torch.equal(bfly[:, m], bfly[0, m].expand(16))
        assert torch.equal(cur[0][_bitrev4(m)], bfly[0, m])
    assert not torch.equal(cur[0], bfly[0])  # the lanes hold different sums: the mapping matters


def test_phase1_lean_cuts_shuffles_and_registers():
    """The lean phase 1 (session 26's; the default until session 27's TMA loads) against session 25's (PHASE1
    "pre26"): 15 butterfly and 16 broadcast shuffles instead of 64, one rsqrt per lane instead of 16, no more
    registers, no spills; the switch is checked by name."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_block32_pre26")
    lean = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_block32_lean")
    assert base.ptx.count("shfl.sync.bfly") == 64 and lean.ptx.count("shfl.sync.bfly") == 15
    assert lean.ptx.count("shfl.sync.idx") == base.ptx.count("shfl.sync.idx") + 16
    assert lean.ptx.count("rsqrt.approx") == base.ptx.count("rsqrt.approx") - 15
    assert lean.spill_bytes == 0 and lean.kernels[0].registers <= base.kernels[0].registers
    with pytest.raises(ValueError, match="CULA_KDA_TC_PHASE1"):
        tc.KdaFwdIntraTC(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                         allow_neg_eigval=False, group=1, phase1="fast")


def _assert_rows_moved_to_tma(before: str, after: str, boxes: int, rows: int):
    """``after``'s PTX issues ``boxes`` more TMA box loads than ``before``'s and ``rows`` fewer per-thread 16-byte
    global loads, reading those rows back from shared memory instead; no spills, registers within 255."""
    from cula.kernels.common.ptx_check import ptx_report

    base = ptx_report("cula.kernels.sm90.kda_fwd", before)
    tma = ptx_report("cula.kernels.sm90.kda_fwd", after)
    assert tma.ptx.count("cp.async.bulk.tensor") == base.ptx.count("cp.async.bulk.tensor") + boxes
    assert tma.ptx.count("ld.global.v4") == base.ptx.count("ld.global.v4") - rows
    assert tma.ptx.count("ld.shared.v4") == base.ptx.count("ld.shared.v4") + rows
    assert tma.spill_bytes == 0 and tma.kernels[0].registers <= 255
    return tma


def test_phase1_tma_qk_loads_q_k_by_tma():
    """PHASE1 "tma_qk" (session 27's): q and k arrive by four TMA box loads (two a tile) instead of 16 per-thread
    16-byte global loads; the threads read the 16 rows back from shared memory; same shared memory (the
    mbarrier sits in the struct's alignment padding), no spills."""
    pytest.importorskip("cutlass")
    tma = _assert_rows_moved_to_tma("intra_tc_t_out_block32_lean", "intra_tc_t_out_block32_tma_qk", boxes=4,
                                    rows=16)
    assert tma.ptx.count("mbarrier.try_wait") >= 1
    # lane 0's init, then a warp sync (racecheck: ptxas puts the init on the warp's uniform datapath), lane 0's
    # arrive, and the copies, which elect their lane over the full warp, after the warp rejoins (from lane 0
    # alone they hung on the H100)
    ptx = tma.ptx
    init = ptx.index("mbarrier.init")
    arrive = ptx.index("mbarrier.arrive.expect_tx")
    assert init < ptx.index("bar.warp.sync", init) < arrive < ptx.index("bar.warp.sync", arrive) \
        < ptx.index("elect.sync")


def test_phase1_tma_qkg_loads_g_by_tma_too():
    """PHASE1 "tma_qkg" (session 28's first default): a bf16 gate arrives by two more TMA boxes (into the X tile)
    instead of 8 per-thread 16-byte global loads; the threads read the 8 rows back from shared memory; no spills.
    An fp32 gate keeps its per-thread loads."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    _assert_rows_moved_to_tma("intra_tc_t_out_block32_tma_qk", "intra_tc_t_out_block32_tma_qkg", boxes=2, rows=8)
    bulk = [ptx_report("cula.kernels.sm90.kda_fwd", t).ptx.count("cp.async.bulk.tensor")
            for t in ("intra_tc", "intra_tc_fp32_gate")]
    assert bulk[1] == bulk[0] - 2
    assert tc.PHASE1_MODES[0] == "tma_g_first"  # tma_qkg with g on a barrier of its own


def test_phase1_tma_g_first_waits_for_q_k_after_the_gate_work():
    """PHASE1 "tma_g_first" (the default since session 28): the same six boxes and per-thread loads as "tma_qkg",
    on two mbarriers (g's and q / k's, both set up by lane 0 before the warp's copies); the threads wait for g, run
    phase 1 and the column pass (two CTA barriers), and only then wait for q and k, before the l2 norms' shuffles;
    no spills."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report

    base = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_block32_tma_qkg")
    rep = ptx_report("cula.kernels.sm90.kda_fwd", "intra_tc_t_out_block32")
    ptx = rep.ptx
    for op in ("cp.async.bulk.tensor", "ld.global.v4"):
        assert ptx.count(op) == base.ptx.count(op), op
    assert ptx.count("ld.shared.v4") >= 24  # the q, k, g rows read back (8 each)
    assert ptx.count("mbarrier.init") == 2 and ptx.count("mbarrier.arrive.expect_tx") == 2
    waits = [i for i in range(len(ptx)) if ptx.startswith("mbarrier.try_wait", i)]
    assert len(waits) == 2
    barriers = [i for i in range(waits[0], waits[1]) if ptx.startswith("bar.sync", i)]
    assert len(barriers) >= 2  # phase 1's and the column pass's
    assert ptx.index("mbarrier.arrive.expect_tx") < ptx.index("cp.async.bulk.tensor") < waits[0]
    assert waits[1] < ptx.index("shfl.sync", waits[1])  # the row norms follow the second wait
    assert rep.spill_bytes == 0 and rep.kernels[0].registers <= 255


def test_tc_factor_block_32_overflows_below_its_bound():
    """Past BLOCK32_MIN_LOWER_BOUND the 32-row factors leave fp32's range on saturated gates (why the host
    keeps the 16-row blocks there)."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    lb = -11.0
    assert lb < tc.BLOCK32_MIN_LOWER_BOUND
    gam = torch.arange(32, dtype=torch.float32) * (lb * tc.RCP_LN2)  # every gate at the bound
    shift = tc.factor_shift(32) * lb
    assert not torch.isfinite(torch.exp2(-(gam - (gam[0] - shift)))).all()
    assert torch.isfinite(torch.exp2(-(gam[:16] - (gam[0] - tc.factor_shift(16) * lb)))).all()


@pytest.mark.parametrize("lb, depth", [(-5.0, 4.0), (None, 30.0)])
def test_tc_log_gate_matches_exact_stages(lb, depth):
    """The log-space gate on the tensor-core stage 1 (safe_gate): the torch model against the exact stages,
    on gates in [-depth, 0]. With a bound inside it, nothing is clamped; without one, gates below
    SOFTPLUS_FLOOR are clamped there, so the exact side is given the clamped gate (the kernel's input
    contract) and must then agree to bf16 error as well."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    B, T, H, HV, cu = 1, 150, 1, 2, [0, 0, 15, 79, 150]
    args, kw = _case(B, T, H, HV, cu, seed=7, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=lb)
    q, k, v, _, beta = args
    gen = torch.Generator().manual_seed(8)
    g = -torch.rand(B, T, HV, 128, generator=gen) * depth
    floor = tc.SOFTPLUS_FLOOR if lb is None else lb
    if lb is None:
        assert (g < floor).double().mean() > 0.3  # the clamp acts on many gates
    exact_g = g.clamp(min=floor)
    _, _, exact = kda_fwd.emulate_stages(q, k, v, exact_g, beta, **kw, dtype=torch.float64)
    qf, kf, vf, gf, bf = kda_fwd._flatten(q, k, v, g, beta)
    chunks, _, _ = kda_fwd.chunk_tables(kw["cu_seqlens"])
    model = tc.emulate(*(x.bfloat16() for x in (qf, kf, vf)), gf.float(), bf.bfloat16(), chunks, 128 ** -0.5,
                       floor, use_qk_l2norm=True, use_beta_sigmoid=True, log_gate=True)
    for name in ("w", "u", "qg", "aqk", "kgt", "gam"):
        a, b = model[name].double(), exact[name].double()
        assert torch.isfinite(a).all(), name
        assert (a - b).norm() / b.norm() < 1e-2, name


def test_tc_routing():
    """Only the inputs the tensor-core stage 1 is built for take it; everything else the exact SIMT one."""
    assert kda_fwd.intra_kind(True, True, -5.0) == "tc"
    assert kda_fwd.intra_kind(True, True, -11.0) == "tc"
    assert kda_fwd.intra_kind(True, True, -11.5) == "simt"  # the diagonal factors could overflow
    assert kda_fwd.intra_kind(True, True, None) == "tc"  # softplus gate: clamped at SOFTPLUS_FLOOR
    assert kda_fwd.intra_kind(False, True, -5.0) == "simt"  # no l2norm: bf16 T' may be ill-conditioned
    assert kda_fwd.intra_kind(True, False, -5.0) == "simt"  # precomputed gates: no bound known
    # ... unless the caller declares them bounded (safe_gate, FLA's contract): clamped to [lb, 0]
    assert kda_fwd.intra_kind(True, False, -5.0, safe_gate=True) == "tc"
    assert kda_fwd.intra_kind(True, False, None, safe_gate=True) == "tc"  # clamped at SOFTPLUS_FLOOR
    assert kda_fwd.intra_kind(True, False, -12.0, safe_gate=True) == "simt"
    assert kda_fwd.intra_kind(False, False, -5.0, safe_gate=True) == "simt"


# ----------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", __import__("cula.kernels.sm90.kda_fwd_check", fromlist=["CASES"]).CASES,
                         ids=lambda c: c[0])
def test_gpu_kernel_matches_reference(case):
    from cula.kernels.sm90 import kda_fwd_check as chk

    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001
        chunk_kda = None
    ok, errs = chk.check_case(case, torch.device("cuda"), chunk_kda)
    assert ok, errs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["tc-T1", "tc-T65-gva-vfirst", "tc-varlen-zero", "tc-lb11-strong",
                                  "tc-T1000-negeig", "tc-fp32-gate-plainbeta"])
def test_gpu_simt_inverse_step_matches_reference(name, monkeypatch):
    """``INV_WGMMA = False`` (the fp32 SIMT lower-left block, kept for A/B runs): the same per-output
    checks as the default stage 1 (w and u carry any error of T)."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    monkeypatch.setattr(tc, "INV_WGMMA", False)
    case = next(c for c in chk.CASES if c[0] == name)
    ok, errs = chk.check_case(case, torch.device("cuda"), None)
    assert ok, errs


U_IN_RECUR_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33",
                    "tc-softplus-varlen-zero", "tc-loggate-safe-varlen"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", U_IN_RECUR_CASES)
@pytest.mark.parametrize("state", ["h0-ht", "none"])
def test_gpu_u_in_recur_matches_reference(name, state, monkeypatch):
    """``U_IN_RECUR`` (u = T' v formed in stage 2): stage 1's scratch (-w, T', qg, Aqk, kgᵀ, γ) against the
    exact emulation and o / final state against the fp64 recurrence, the per-case checks of the default
    (tolerance TOL_O, bf16 operands); and o within 1e-2 of the default stages' o, which differ only where u
    is rounded to bf16 before v_new (here v_new is T' v + S(-w) in one fp32 accumulator). ``state``: with an
    initial and final state (short varlen sequences take the state buffer), or neither."""
    from cula.kernels.sm90 import kda_fwd_check as chk

    case = next(c for c in chk.CASES if c[0] == name)
    dev = torch.device("cuda")
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    if state == "h0-ht":
        ok, errs = chk.check_case(case, dev, None)
        assert ok and "tp" in errs and "u" not in errs, errs
        return
    args, kw = chk._inputs(*case, dev=dev)
    kw = dict(kw, initial_state=None, output_final_state=False)
    o, ht, scratch = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    assert "tp" in scratch and ht is None
    o_r, _ = ref.recurrent(*args, **kw, dtype=torch.float64)
    assert chk._rel(o, o_r) < chk.TOL_O
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", False)
    o_d, _ = kda_fwd.kda_fwd(*args, **kw)
    assert chk._rel(o, o_d) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_u_in_recur_partial_chunk_ignores_the_next_sequence(monkeypatch):
    """Stage 2 loads a partial last chunk's v rows by TMA: past the sequence's end they are the next
    sequence's tokens. T' has zero columns there, but an Inf would still make NaN: the kernel zeroes them,
    so a sequence's o and final state do not depend on what follows it (bitwise, the same call with the
    next sequence's v replaced by Inf). W_IN_RECUR off: its stage 2 reads v differently (its own test below)."""
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", False)
    _check_partial_chunk_ignores_the_next_sequence()


def _check_partial_chunk_ignores_the_next_sequence():
    """Two sequences (100 and 130 tokens): the first's o and final state are bitwise the same when the second's v
    is Inf. Returns the inputs and the first call's o."""
    from cula.kernels.sm90 import kda_fwd_check as chk

    cu = [0, 100, 230]
    args, kw = chk._inputs("partial", 1, 230, 2, 2, cu, dict(chk._TC, lower_bound=-5.0), dev=torch.device("cuda"))
    o, ht = kda_fwd.kda_fwd(*args, **kw)
    q, k, v, g, beta = args
    v_bad = v.clone()
    v_bad[:, 100:] = float("inf")
    o2, ht2 = kda_fwd.kda_fwd(q, k, v_bad, g, beta, **kw)
    assert torch.isfinite(o[:, :100]).all() and torch.equal(o[:, :100], o2[:, :100])
    assert torch.equal(ht[0], ht2[0])
    return args, kw, o


#: (phase 1 before, the TMA phase 1 after it, which of a later sequence's inputs are poisoned: Inf in q, k; NaN in g)
TMA_PHASE1_STEPS = [("lean", "tma_qk", "qk"), ("tma_qk", "tma_qkg", "g"), ("tma_qkg", "tma_g_first", "qkg")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("before,after,poisoned", TMA_PHASE1_STEPS, ids=[s[1] for s in TMA_PHASE1_STEPS])
@pytest.mark.parametrize("case", ["tc-varlen-zero", "tc-softplus-varlen-zero"])
def test_gpu_tma_phase1_equals_the_one_before_and_ignores_later_sequences(monkeypatch, case, before, after,
                                                                           poisoned):
    """Each TMA phase 1 against the one it grew from: "tma_qk" loads q, k by TMA (against lean), "tma_qkg" a bf16
    g too, "tma_g_first" waits for q and k after the gate work. A partial chunk's rows past its sequence are the
    next tokens there. The outputs are bitwise the phase 1 before's (the same values reach the same arithmetic),
    for 32-row (lb −0.1) and 16-row (softplus) factor blocks, and Inf in every later sequence's q and k, NaN in its
    g (which a zero factor would not remove), leave the first sequences' o and final states bitwise unchanged
    (cu_seqlens 0, 0, 15, 15, 79, 200: the first chunk is partial)."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    (spec,) = [c for c in chk.CASES if c[0] == case]
    args, kw = chk._inputs(*spec, dev=torch.device("cuda"))
    monkeypatch.setattr(intra_tc, "PHASE1", before)
    o1, ht1 = kda_fwd.kda_fwd(*args, **kw)
    monkeypatch.setattr(intra_tc, "PHASE1", after)
    o, ht = kda_fwd.kda_fwd(*args, **kw)
    assert torch.equal(o, o1) and torch.equal(ht, ht1)
    q, k, v, g, beta = args
    q_bad, k_bad, g_bad = q.clone(), k.clone(), g.clone()
    if "qk" in poisoned:
        q_bad[:, 15:] = float("inf")
        k_bad[:, 15:] = float("inf")
    if "g" in poisoned:
        assert g.dtype == torch.bfloat16
        g_bad[:, 15:] = float("nan")
    o2, ht2 = kda_fwd.kda_fwd(q_bad, k_bad, v, g_bad, beta, **kw)
    assert torch.isfinite(o[:, :15]).all() and torch.equal(o[:, :15], o2[:, :15])
    assert torch.equal(ht[:2], ht2[:2])


#: The GPU test's cases for PACK: fixed, GVA V-first, varlen with zero-length and partial chunks, a long random
#: varlen batch with many items per stage-2 CTA, the softplus gate, a log-space gate, and short items with
#: zero-length ones between them (~15 items a stage-2 CTA, some without chunks)
PACK_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-softplus-varlen-zero",
              "tc-loggate-safe-varlen", "big-varlen", "short-zero-varlen"]
#: 60 sequences of 0-200 tokens, a third of them empty: ~15 items per stage-2 CTA at 16 heads
SHORT_ZERO_LENGTHS = [0, 1, 64, 0, 0, 65, 200, 0, 3, 128, 0, 63] * 5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", PACK_CASES)
def test_gpu_pack_equals_unpacked(name, monkeypatch):
    """PACK stores one [64, 64] tile a chunk (Aqk, T' transposed above it) and T''s diagonal after γ; stage 2
    masks two copies of it into the very tiles the unpacked path loads. Stage 1's scratch, taken apart on the
    host, and o and the final state are bitwise the unpacked path's, with and without a state, twice, and o
    inside a CUDA graph."""
    args, kw = _equality_case(name)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    _check_bitwise_equal(args, kw, lambda: monkeypatch.setattr(kda_fwd, "PACK", "0"),
                         lambda: monkeypatch.setattr(kda_fwd, "PACK", "1"))


def _equality_case(name: str) -> tuple:
    """Inputs (on the GPU) of a check case (kda_fwd_check.CASES) by name, or of the equality tests' two longer varlen
    batches: "big-varlen" (20 random sequences, 8192 tokens) and "short-zero-varlen" (SHORT_ZERO_LENGTHS)."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.suites.lengths import cu_seqlens_from_lengths, varlen_lengths

    lengths = {"big-varlen": lambda: varlen_lengths("random", 20, 8192),
               "short-zero-varlen": lambda: SHORT_ZERO_LENGTHS}
    if name in lengths:
        lens = lengths[name]()
        case = (name, 1, sum(lens), 16, 16, cu_seqlens_from_lengths(lens), dict(chk._TC, lower_bound=-5.0))
    else:
        case = next(c for c in chk.CASES if c[0] == name)
    return chk._inputs(*case, dev=torch.device("cuda"))


def _recorded_launch_keys(monkeypatch) -> list:
    """The launcher keys of kda_fwd's launches from now on, appended as they happen (clear it to start over)."""
    keys = []
    launcher = kda_fwd._launcher
    monkeypatch.setattr(kda_fwd, "_launcher", lambda kind, key, *a: keys.append(key) or launcher(kind, key, *a))
    return keys


def _check_bitwise_equal(args, kw, reference, candidate, after=lambda: None):
    """With and without a state: the scratch, o and the final state of two calls made after ``candidate()`` are
    bitwise those of one made after ``reference()`` (each sets the module state it stands for), then ``after()``
    runs; and o of a CUDA graph of the stateless call under ``candidate`` is that call's o."""
    for state in (kw, {**kw, "initial_state": None, "output_final_state": False}):
        reference()
        o_ref, ht_ref, scr_ref = kda_fwd.kda_fwd(*args, **state, return_scratch=True)
        candidate()
        for _ in range(2):
            o, ht, scr = kda_fwd.kda_fwd(*args, **state, return_scratch=True)
            torch.cuda.synchronize()
            assert scr.keys() == scr_ref.keys()  # -w or -X (W_IN_RECUR), qg, Aqk, T', kgᵀ, γ
            for n in scr_ref:
                assert torch.equal(scr[n], scr_ref[n]), n
            assert torch.equal(o, o_ref)
            assert (ht is None and ht_ref is None) or torch.equal(ht, ht_ref)
        after()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = kda_fwd.kda_fwd(*args, **state)  # (the last state: none, whose o_ref is the one above)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_ref)


#: The GPU test's cases for stage 2 as pairs: fixed, GVA V-first, partial chunks, zero-length segments, 33 segments,
#: the softplus gate, a log-space gate, a long random varlen batch and short items with empty ones between them
PAIR_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33",
              "tc-softplus-varlen-zero", "tc-loggate-safe-varlen", "big-varlen", "short-zero-varlen"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["unpacked", "packed"])
@pytest.mark.parametrize("name", PAIR_CASES)
def test_gpu_pair_equals_split(name, mode, monkeypatch):
    """Stage 2 as pairs (CULA_KDA_RECUR_PAIR=1: one CTA per item, one math warpgroup per V half, the stage's tiles
    shared and the packed tile masked by both) runs each V half's instructions on the same operands as the split
    launch: the scratch, o and the final state are bitwise the split launch's, with and without a state, twice, and
    in a CUDA graph. The state buffer is off in both (pair never takes it); the pair kernel must have run. Packed,
    pair masks with the word mask and the split launch with PACK_MASK's (rows): both masks are exact."""
    from cula.kernels.sm90 import kda_fwd_recur as kr

    args, kw = _equality_case(name)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", "0" if mode == "unpacked" else "1")
    monkeypatch.setattr(kr, "STATE_SMEM_ENV", "0")
    keys = _recorded_launch_keys(monkeypatch)
    _check_bitwise_equal(args, kw, lambda: monkeypatch.setattr(kr, "PAIR_ENV", "0"),
                         lambda: monkeypatch.setattr(kr, "PAIR_ENV", "1"))
    assert any(("pair", True) in k[0] for k in keys if isinstance(k, tuple) and k and isinstance(k[0], tuple))


#: The GPU test's cases for W_IN_RECUR: every gate form, GVA V-first, partial chunks, zero-length segments, 33 segments
W_IN_RECUR_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33",
                    "tc-softplus-varlen-zero", "tc-loggate-safe-varlen", "tc-fp32-gate-plainbeta"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pack", ["0", "1"], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", W_IN_RECUR_CASES)
def test_gpu_w_in_recur_matches_reference(name, pack, monkeypatch):
    """``W_IN_RECUR`` (stage 1 stores -X, stage 2 forms v_new = T'(v - X S)): the per-case checks of the default
    (-X and the rest of the scratch against the exact emulation, o / final state against the fp64 recurrence within
    TOL_O, a rerun bitwise); the rest of stage 1's scratch (qg, Aqk, T', kgᵀ, γ) bitwise the default's; o and the
    final state within 1e-2 of the default's (they differ where v_new is rounded: bf16(v - X S) against bf16(T' X)
    and bf16 S). Packed and unpacked [Aqk | T']."""
    from cula.kernels.sm90 import kda_fwd_check as chk

    case = next(c for c in chk.CASES if c[0] == name)
    dev = torch.device("cuda")
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", pack)
    args, kw = chk._inputs(*case, dev=dev)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", False)
    o_d, ht_d, scr_d = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    ok, errs = chk.check_case(case, dev, None)
    assert ok and "x" in errs and "w" not in errs, errs
    o, ht, scr = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    torch.cuda.synchronize()
    for n in ("qg", "aqk", "tp", "kgt", "gam"):
        assert torch.equal(scr[n], scr_d[n]), n
    assert chk._rel(o, o_d) < 1e-2 and chk._rel(ht, ht_d) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pack", ["0", "1"], ids=["unpacked", "packed"])
def test_gpu_w_in_recur_partial_chunk_ignores_the_next_sequence(pack, monkeypatch):
    """With W_IN_RECUR stage 2 reads a partial last chunk's v rows into its accumulator: past the sequence's end
    they are the next sequence's tokens, zeroed first, so an Inf there changes nothing (bitwise) in the sequence's o
    and final state; and o inside a CUDA graph is the eager o."""
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", pack)
    args, kw, o = _check_partial_chunk_ignores_the_next_sequence()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = kda_fwd.kda_fwd(*args, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o)


@pytest.mark.gpu
@gpu
def test_gpu_order_equals_chunk_order(monkeypatch):
    """Stage 1's launch order (ORDER: the default "head_rev" maps the grid [HV, NC] to (chunk NC - 1 - y, head x);
    "chunk", the order before session 31, [NC, HV] to (x, y)) changes which CTA does which item and when, not what
    it computes: the scratch, o and the final state are bitwise the same, on short, long (packed) and varlen inputs
    with zero-length and dummy chunks."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    dev = torch.device("cuda")
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    for name in ("tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33"):
        args, kw = chk._inputs(*next(c for c in chk.CASES if c[0] == name), dev=dev)
        monkeypatch.setattr(intra_tc, "ORDER", "chunk")
        o_ref, ht_ref, scr_ref = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
        monkeypatch.setattr(intra_tc, "ORDER", "head_rev")
        o, ht, scr = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
        torch.cuda.synchronize()
        for n in scr_ref:
            assert torch.equal(scr[n], scr_ref[n]), (name, n)
        assert torch.equal(o, o_ref), name
        assert (ht is None and ht_ref is None) or torch.equal(ht, ht_ref), name


def test_order_head_rev_launches_heads_fastest_and_chunks_last_to_first(monkeypatch):
    """The launch-order contract the GPU test relies on, on the CPU: "head_rev" (the default) is a [HV, NC] grid;
    orders are validated; the host keeps it only while NC fits the grid's y limit (65535), and asks for "chunk"
    beyond."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                 allow_neg_eigval=False, group=1, t_out=True)
    assert intra_tc.ORDER_MODES[0] == "head_rev" and intra_tc.MAX_GRID_Y == 65535
    assert intra_tc.KdaFwdIntraTC(**flags).grid(10, 4) == [4, 10, 1]
    assert intra_tc.KdaFwdIntraTC(**flags, order="chunk").grid(10, 4) == [10, 4, 1]
    with pytest.raises(ValueError, match="order"):
        intra_tc.KdaFwdIntraTC(**flags, order="heads")
    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(intra_tc, "ORDER", "head_rev")
    meta = torch.device("meta")
    for T, expect in ((4096, None), ((intra_tc.MAX_GRID_Y + 1) * 64, "chunk")):
        x = torch.empty(1, T, 1, 128, device=meta, dtype=torch.bfloat16)
        beta = torch.empty(1, T, 1, device=meta, dtype=torch.bfloat16)
        calls.clear()
        kda_fwd.kda_fwd(x, x, x, x, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, A_log=torch.empty(1, device=meta),
                        dt_bias=torch.empty(128, device=meta), lower_bound=-5.0, safe_gate=True)
        (flags_key, _), = [key for kind, key, _, _ in calls if kind == "intra_tc"]
        assert dict(flags_key).get("order") == expect, T


RECUR_CASES = ["T1", "T15-l2-gate", "T65-gva-vfirst", "T1000-all", "varlen-zero", "varlen-33"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", RECUR_CASES)
@pytest.mark.parametrize("state", ["h0-ht", "h0", "ht", "none"])
@pytest.mark.parametrize("state_smem", [False, True], ids=["state-regs", "state-smem"])
def test_gpu_recur_v2_matches_v1(name, state, state_smem):
    """Stage 2 alone, v2 against v1 on the same scratch (the exact emulation of stage 1 in the kernels'
    dtypes, so no stage-1 compile): the same products in the same order on the same bf16 values, so
    equal to fp32 rounding (expected bitwise); both within bf16 error of the fp64 recurrence on that
    scratch; v2 deterministic, and bitwise the same on a 3-CTA persistent grid. ``state``: which of the
    initial / final state the call has; ``state_smem``: v2 moves the state through shared memory."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90 import kda_fwd_recur as kr

    if state == "none" and state_smem:
        pytest.skip("no state to move: the same kernel as state-regs")
    dev = torch.device("cuda")
    case = next(c for c in chk.CASES if c[0] == name)
    args, kw = chk._inputs(*case, dev=dev)
    B, T = args[0].shape[:2]
    _, _, exact = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)
    scratch = {n: exact[n].to(torch.float32 if n == "gam" else torch.bfloat16) for n in exact}
    cu = kw["cu_seqlens"] if kw["cu_seqlens"] is not None else torch.arange(B + 1, device=dev) * T
    chunks, seqs, _ = kda_fwd.chunk_tables(cu)
    h0 = kw["initial_state"] if state.startswith("h0") else None
    final = state.endswith("ht")
    v_first = kw.get("state_v_first", False)
    ssm = dict(state_smem=state_smem)
    outs = {"v1": kr.run(scratch, chunks, seqs, B * T, h0, final, v_first, variant="v1"),
            "v2": kr.run(scratch, chunks, seqs, B * T, h0, final, v_first, variant="v2", **ssm)}
    again = kr.run(scratch, chunks, seqs, B * T, h0, final, v_first, variant="v2", **ssm)
    # 3 persistent CTAs: each walks many (V tile, head, sequence) items, the TMA ring running on across
    # item boundaries (zero-chunk items included); the same products, so bitwise the full grid's
    few = kr.run(scratch, chunks, seqs, B * T, h0, final, v_first, variant="v2", max_ctas=3, **ssm)
    torch.cuda.synchronize()
    o_ref, ht_ref = kda_fwd.emulate_recurrence(scratch, chunks, seqs, B * T, h0, final, v_first, torch.float64)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    (o1, ht1), (o2, ht2) = outs["v1"], outs["v2"]
    errs = dict(o_v2_v1=rel(o2, o1), o_v1_ref=rel(o1, o_ref), o_v2_ref=rel(o2, o_ref),
                bitwise=torch.equal(o1, o2) and (not final or torch.equal(ht1, ht2)))
    if final:
        errs.update(ht_v2_v1=rel(ht2, ht1), ht_v2_ref=rel(ht2, ht_ref))
    print(name, state, state_smem, errs)
    assert errs["o_v2_v1"] < 1e-5 and errs["o_v2_ref"] < chk.TOL_O, errs
    assert torch.equal(again[0], o2), "v2 is not deterministic"
    assert torch.equal(few[0], o2), "v2 on 3 persistent CTAs differs from one CTA per item"
    if final:
        assert torch.equal(few[1], ht2)
        assert errs["ht_v2_v1"] < 1e-5 and errs["ht_v2_ref"] < chk.TOL_O, errs
        assert torch.equal(again[1], ht2)


@pytest.mark.parametrize("B, T", [(1, 1), (2, 63), (3, 64), (2, 65), (1, 1000)])
def test_fixed_length_tables_equal_the_general_ones_and_are_cached(B, T):
    from cula.kernels.sm90.kda_fwd import chunk_tables, fixed_length_tables

    chunks, seqs, nc = fixed_length_tables(B, T, "cpu")
    ref_chunks, ref_seqs, ref_nc = chunk_tables(torch.arange(B + 1) * T)
    assert nc == ref_nc == B * -(-T // 64)
    assert torch.equal(chunks, ref_chunks) and torch.equal(seqs, ref_seqs)
    assert fixed_length_tables(B, T, "cpu")[0] is chunks  # no per-call rebuild (and no host sync)


@pytest.mark.parametrize("seed", range(6))
def test_varlen_tables_without_sync_cover_the_exact_ones(seed):
    """varlen_tables (bounded chunk count, built without a host sync) holds chunk_tables' rows first and
    only dummies (token 0, no rows: stage 1 skips them) after them; the per-sequence table is identical."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    lens = torch.randint(0, 200, (n,), generator=gen)
    lens[torch.randint(0, n, (max(n // 4, 1),), generator=gen)] = 0  # empty segments
    lens[0] = 64 if seed % 2 else 1  # exactly one chunk / one token
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    if cu[-1] == 0:
        cu[-1] = lens[-1] = 5
    cu32 = cu.to(torch.int32)
    chunks, seqs, nc = kda_fwd.chunk_tables(cu)
    b_chunks, b_seqs, nc_max = kda_fwd.varlen_tables(cu32, int(cu[-1]))
    assert nc_max == int(cu[-1]) // 64 + n and nc_max >= nc
    assert torch.equal(b_seqs, seqs)
    assert torch.equal(b_chunks[:nc], chunks)
    assert (b_chunks[nc:, 0] == 0).all() and (b_chunks[nc:, 1] == 0).all()
    assert kda_fwd.varlen_tables(cu32, int(cu[-1]))[0] is b_chunks  # cached per tensor ...
    cu32[1:] = cu32[1:]  # ... until it is written in place
    assert kda_fwd.varlen_tables(cu32, int(cu[-1]))[0] is not b_chunks


def test_launch_specs_match_the_compiled_signatures():
    """The fast launcher packs plain values by these specs; they must be the types and alignments the
    kernels are compiled with (the fake arguments), in the same order."""
    pytest.importorskip("cutlass")
    import cutlass

    from cula.kernels.sm90 import kda_fwd_intra, kda_fwd_recur

    def kinds(args):
        out = []
        for a in args:
            if hasattr(a, "memspace"):  # a runtime pointer
                out.append(("ptr", a.dtype, a._assumed_align))
            else:
                out.append(({cutlass.Int32: "i32", cutlass.Float32: "f32"}[type(a)],))
        return out

    def spec_kinds(specs):
        return [(s.kind, s.dtype, s.align) if s.kind == "ptr" else (s.kind,) for s in specs if s.kind != "stream"]

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    for dts in ((bf16, bf16, bf16), (bf16, f32, f32)):
        assert spec_kinds(kda_fwd._intra_specs(*dts)) == kinds(kda_fwd_intra.fake_args(*dts))
    assert spec_kinds(kda_fwd._recur_specs(bf16)) == kinds(kda_fwd_recur.fake_args(bf16))
    assert kda_fwd._intra_specs(bf16, bf16, bf16)[-1].kind == kda_fwd._recur_specs(bf16)[-1].kind == "stream"


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 64, 65, 200]])
@pytest.mark.parametrize("tc", [True, False])
def test_host_path_passes_one_value_per_spec(monkeypatch, cu, tc):
    """kda_fwd's host path (no GPU: launches recorded) hands each compiled kernel one plain value per
    argument spec, of the spec's kind, with the sizes the scratch was allocated for."""
    pytest.importorskip("cutlass")
    calls = record_kda_launches(monkeypatch)  # (kind, key, specs, values) per launch
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=tc, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0, safe_gate=True)
    B, T = (1, 200) if cu is not None else (2, 70)
    args, kw = _case(B, T, 2, 2, cu, seed=1, **flags)
    args = tuple(x.bfloat16() for x in args)
    kda_fwd.kda_fwd(*args, **kw)
    assert [c[0] for c in calls] == ["intra_tc" if tc else "intra", "recur"]
    nc = calls[0][3][17]
    assert calls[1][3][13] == nc  # both kernels see the chunk count the scratch was sized for
    assert calls[1][3][15] == 132  # the persistent recurrence's CTA cap: one per SM
    if cu is not None:
        assert nc == 200 // 64 + 5  # the sync-free bound
    for kind, _, specs, values in calls:
        assert len(values) == len(specs)
        for spec, value in zip(specs, values):
            assert isinstance(value, float if spec.kind == "f32" else int), (kind, spec)


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 64, 65, 200]])
def test_host_path_u_in_recur(monkeypatch, cu):
    """With U_IN_RECUR the tensor-core stage 1 is compiled with t_out and the recurrence with t_in: stage 1's
    Aqk pointer is a [HV, R, 128] buffer (Aqk | T') that it also gets for pU (unused there), and stage 2 reads
    the same buffer and the input v itself in pU's place; calls it cannot serve keep the default stages."""
    pytest.importorskip("cutlass")
    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    allocs = record_allocations(monkeypatch)
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0, safe_gate=True)
    B, T = (1, 200) if cu is not None else (2, 70)
    args, kw = _case(B, T, 2, 2, cu, seed=1, **flags)
    args = tuple(x.bfloat16() for x in args)
    kda_fwd.kda_fwd(*args, **kw)
    (k1, key1, _, v1), (k2, key2, _, v2) = calls
    assert (k1, k2) == ("intra_tc", "recur")
    assert dict(key1[0])["t_out"] is True and dict(key2[0])["t_in"] is True
    nc = v1[17]
    by_ptr = {t.data_ptr(): t for t in allocs}
    aqk_tp = by_ptr[v1[11]]
    assert aqk_tp.shape == (2, nc * 64, 128) and v1[9] == v1[11]  # pU = pAqk in stage 1
    assert v2[2] == v1[11]  # stage 2's pAqk: Aqk | T'
    assert v2[4] == args[2].data_ptr()  # stage 2's pU: the input v (contiguous already)
    assert all(t.shape[-1] != 128 or t.shape[:2] != (2, nc * 64) or t.data_ptr() in (v1[8], v1[10], v1[11])
               for t in allocs if t.dim() == 3)  # no u buffer: only w, qg (| Akk) and Aqk | T' are that shape
    # the SIMT stage 1 (no l2norm) keeps the default stages: it writes u
    calls.clear()
    kda_fwd.kda_fwd(*args, **{**kw, "use_qk_l2norm_in_kernel": False})
    assert [c[0] for c in calls] == ["intra", "recur"] and "t_in" not in dict(calls[1][1][0])


@pytest.mark.parametrize("w_in", [True, False])
def test_host_path_w_in_recur(monkeypatch, w_in):
    """W_IN_RECUR (with U_IN_RECUR) compiles stage 1 with x_out and stage 2 with x_in, packed or not, into the same
    buffers as without it; off, neither key has the flag (so the keys of session 31's kernels stay as they were);
    the training path (FLA's factors) and the SIMT stage 1 never take it; the kernels refuse it without u in
    stage 2."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90 import kda_fwd_recur as recur

    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", w_in)
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0, safe_gate=True)
    args, kw = _case(1, 600, 2, 2, None, seed=2, **flags)  # 10 chunks: packed by default
    args = tuple(x.bfloat16() for x in args)
    for pack in ("0", "1"):
        monkeypatch.setattr(kda_fwd, "PACK", pack)
        calls.clear()
        kda_fwd.kda_fwd(*args, **kw)
        (k1, key1, _, _), (k2, key2, _, _) = calls
        f1, f2 = dict(key1[0]), dict(key2[0])
        assert f1.get("pack", False) == (pack == "1") and f2.get("pack", False) == (pack == "1")
        if w_in:
            assert f1["x_out"] is True and f2["x_in"] is True
        else:
            assert "x_out" not in f1 and "x_in" not in f2
    calls.clear()
    kda_fwd.kda_fwd(*args, **{**kw, "use_qk_l2norm_in_kernel": False})  # the SIMT stage 1
    assert all("x_out" not in dict(c[1][0]) and "x_in" not in dict(c[1][0]) for c in calls)
    with pytest.raises(ValueError, match="x_out"):
        intra_tc.KdaFwdIntraTC(True, True, True, True, False, 1, x_out=True)
    with pytest.raises(ValueError, match="x_in"):
        recur.KdaFwdRecur(True, True, False, variant="v2", x_in=True)


def test_ptx_w_in_recur():
    """x_out drops stage 1's w product (44 wgmma instead of 48, the same 9 bulk tensor copies: -X leaves in w's
    place) at the same registers; x_in keeps stage 2's 28 wgmma a chunk but none of them SS any more (vᵀ T'ᵀ's
    transposed A goes, Yᵀ T'ᵀ reads A from registers). No spills, no local memory."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    names = ["intra_tc_t_out_block32_pack", "intra_tc_t_out_block32_pack_x", "recur_v2_t_in_pack",
             "recur_v2_t_in_pack_x", "recur_v2_t_in_x", "recur_v2_t_in_x_state_smem"]
    r = ptx_reports("cula.kernels.sm90.kda_fwd", names)
    s1, s1x, s2, s2x = (r[n] for n in names[:4])
    for rep in r.values():
        assert rep.spill_bytes == 0 and ".local" not in rep.ptx and rep.max_registers <= 255
    assert s1.count("wgmma.mma_async") == 48 and s1x.count("wgmma.mma_async") == 44
    assert s1x.count("cp.async.bulk.tensor") == s1.count("cp.async.bulk.tensor")
    assert s1x.max_registers <= s1.max_registers
    def shared_a(rep):  # wgmma with A from shared memory: one register list (D) where RS products have two (D, A)
        return sum(1 for t in re.findall(r"wgmma\.mma_async[^;]*;", rep.ptx) if t.count("{") == 1)

    assert shared_a(s2) == 4  # vᵀ T'ᵀ
    for n in names[3:]:
        assert r[n].count("wgmma.mma_async") == 28 and shared_a(r[n]) == 0, n


#: The GPU test's cases for CTAS 3: fixed, GVA V-first (two chunks), varlen with zero-length segments and partial
#: chunks, 33 segments, a log-space gate, an fp32 gate (by per-thread loads: nothing lands in K̃'s tile), a long random batch
CTAS3_CASES = ["tc-T1000-negeig", "tc-T65-gva-vfirst", "tc-varlen-zero", "tc-varlen-33", "tc-loggate-safe-varlen",
               "tc-fp32-gate-plainbeta", "big-varlen"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pack", ["1", "0"])
@pytest.mark.parametrize("name", CTAS3_CASES)
def test_gpu_ctas3_equals_the_default(name, pack, monkeypatch):
    """Stage 1 at three CTAs an SM (CTAS 3: -X stored from registers, g landing in K̃'s tile, the launch bound) moves
    no value: the scratch, o and the final state are bitwise the two-CTA stage 1's (packed and unpacked, w in stage
    2), with and without a state, twice, and o inside a CUDA graph; the calls did build the three-CTA stage 1."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    args, kw = _equality_case(name)
    keys = _recorded_launch_keys(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", pack)

    def three_ctas():
        monkeypatch.setattr(intra_tc, "CTAS", 3)
        keys.clear()

    _check_bitwise_equal(args, kw, lambda: monkeypatch.setattr(intra_tc, "CTAS", 2), three_ctas,
                         after=lambda: _assert_built_three_ctas(keys))


def _assert_built_three_ctas(keys: list) -> None:
    """The calls recorded in ``keys`` (launcher keys) built the three-CTA stage 1."""
    assert any(dict(k[0]).get("ctas") == 3 for k in keys)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pack", ["1", "0"])
def test_gpu_ctas3_ignores_later_sequences(pack, monkeypatch):
    """At three CTAs an SM g lands in K̃'s tile: a partial chunk's rows past its sequence (the next tokens there) are
    zeroed before phase 2 writes K̃ over them, so Inf in every later sequence's q and k and NaN in its g leave the
    first sequences' o and final states bitwise unchanged (cu_seqlens 0, 0, 15, 15, 79, 200: the first chunk is
    partial); packed and unpacked, w in stage 2."""
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    (spec,) = [c for c in chk.CASES if c[0] == "tc-varlen-zero"]
    args, kw = chk._inputs(*spec, dev=torch.device("cuda"))
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", pack)
    monkeypatch.setattr(intra_tc, "CTAS", 3)
    o, ht = kda_fwd.kda_fwd(*args, **kw)
    q, k, v, g, beta = args
    q_bad, k_bad, g_bad = q.clone(), k.clone(), g.clone()
    q_bad[:, 15:] = float("inf")
    k_bad[:, 15:] = float("inf")
    assert g.dtype == torch.bfloat16
    g_bad[:, 15:] = float("nan")
    o2, ht2 = kda_fwd.kda_fwd(q_bad, k_bad, v, g_bad, beta, **kw)
    assert torch.isfinite(o[:, :15]).all() and torch.equal(o[:, :15], o2[:, :15])
    assert torch.equal(ht[:2], ht2[:2])


def test_ctas3_needs_the_w_in_recur_stage_1_and_fits_three_ctas_an_sm(monkeypatch):
    """CTAS 3 (three stage-1 CTAs an SM) is only built for the w-in-stage-2 stage 1 with 32-row blocks, packed or not,
    the one that leaves the X, v and 48-row B' tiles dead: its storage then fits three CTAs an SM with the driver's
    1 KB each; anything else is refused by name. The host asks for it only there (the key of every other call stays
    as it was)."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    full = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True, allow_neg_eigval=False,
                group=1, t_out=True, factor_block=32)
    for pack in (True, False):
        lean = intra_tc.KdaFwdIntraTC(**full, pack=pack, x_out=True, ctas=3).storage_class().size_in_bytes()
        wide = intra_tc.KdaFwdIntraTC(**full, pack=pack, x_out=True).storage_class().size_in_bytes()
        assert 3 * (lean + 1024) <= intra_tc.SMEM_PER_SM < 3 * (wide + 1024)
    for bad in (dict(full, pack=True), dict(full), dict(full, pack=True, x_out=True, factor_block=16),
                dict(full, x_out=True, factor_block=16), dict(full, pack=True, x_out=True, diag=("no_inverse",))):
        with pytest.raises(ValueError, match="ctas"):
            intra_tc.KdaFwdIntraTC(**bad, ctas=3)
    with pytest.raises(ValueError, match="ctas"):
        intra_tc.KdaFwdIntraTC(**full, pack=True, x_out=True, ctas=4)

    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(intra_tc, "CTAS", 3)
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0, safe_gate=True)
    args, kw = _case(1, 600, 2, 2, None, seed=2, **flags)  # 10 chunks
    args = tuple(x.bfloat16() for x in args)
    for pack, w_in, lb, want in (("1", True, -5.0, 3), ("0", True, -5.0, 3), ("1", False, -5.0, None),
                                 ("0", False, -5.0, None), ("1", True, -11.0, None),
                                 ("0", True, -11.0, None)):  # -11: 16-row blocks
        monkeypatch.setattr(kda_fwd, "PACK", pack)
        monkeypatch.setattr(kda_fwd, "W_IN_RECUR", w_in)
        calls.clear()
        kda_fwd.kda_fwd(*args, **{**kw, "lower_bound": lb})
        assert dict(calls[0][1][0]).get("ctas") == want, (pack, w_in, lb)


def test_ptx_ctas3():
    """The w-in-stage-2 stage 1 at three CTAs an SM, packed and unpacked: within the 168 registers that leaves, no
    spills or local memory, the same 44 wgmma; -X's TMA store (two boxes) goes, eight 16-byte stores a thread take
    its place."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    names = ["intra_tc_t_out_block32_pack_x", "intra_tc_t_out_block32_pack_x_ctas3", "intra_tc_t_out_block32_x",
             "intra_tc_t_out_block32_x_ctas3"]
    r = ptx_reports("cula.kernels.sm90.kda_fwd", names)
    for two, three in ((r[names[0]], r[names[1]]), (r[names[2]], r[names[3]])):
        assert three.spill_bytes == 0 and ".local" not in three.ptx and three.max_registers <= 168
        assert ".maxnreg" in three.ptx or ".minnctapersm 3" in three.ptx
        assert three.count("wgmma.mma_async") == two.count("wgmma.mma_async") == 44
        assert three.count("cp.async.bulk.tensor") == two.count("cp.async.bulk.tensor") - 2
        assert three.count("st.global.v4") == two.count("st.global.v4") + 8


def _pack_like_stage1(aqk: torch.Tensor, tp: torch.Tensor, gam: torch.Tensor) -> tuple:
    """What stage 1 writes with PACK, in torch: per chunk Aqk on and below the diagonal and T' transposed above
    it, and γ's row followed by T''s diagonal (64 bf16 in 32 floats)."""
    HV, R, C = aqk.shape
    a, t = aqk.view(HV, R // C, C, C), tp.view(HV, R // C, C, C)
    packed = a.tril() + t.tril(-1).transpose(-1, -2)
    tail = torch.diagonal(t, dim1=-2, dim2=-1).contiguous().view(torch.float32)  # [HV, NC, 32]
    return packed.reshape(HV, R, C), torch.cat([gam, tail], dim=-1)


def test_unpack_aqk_tp_inverts_the_packing():
    """``unpack_aqk_tp`` gives back Aqk (lower, with its diagonal), T' (lower, with bf16(β) on the diagonal)
    and γ from the packed tile and γ's longer rows, bitwise; the upper halves of both come back zero."""
    from cula.kernels.sm90.kda_fwd_recur import GAM_PITCH_PACK

    g = torch.Generator().manual_seed(3)
    HV, NC, C, K = 2, 3, 64, 128
    aqk = torch.randn(HV, NC, C, C, generator=g).tril().bfloat16().view(HV, NC * C, C)
    tp = torch.randn(HV, NC, C, C, generator=g).tril().bfloat16().view(HV, NC * C, C)
    gam = torch.rand(HV, NC, K, generator=g)
    packed, rows = _pack_like_stage1(aqk, tp, gam)
    assert rows.shape == (HV, NC, GAM_PITCH_PACK)
    out = kda_fwd.unpack_aqk_tp(packed, rows, K)
    assert torch.equal(out["aqk"], aqk) and torch.equal(out["tp"], tp) and torch.equal(out["gam"], gam)


def test_host_path_pack(monkeypatch):
    """With PACK (and u in stage 2) both stages are built with ``pack``, the Aqk buffer is [HV, R, 64] (the packed
    tile) and γ's rows GAM_PITCH_PACK floats; without it the keys and buffers are as before; the clock diagnostic
    keeps the packing (its slots follow γ's packed rows). Each kernel refuses pack without u in stage 2."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90 import kda_fwd_recur as recur

    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    allocs = record_allocations(monkeypatch)
    args, kw = _case(1, 130, 2, 2, None, seed=4, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    args = tuple(x.bfloat16() for x in args)
    monkeypatch.setattr(kda_fwd, "PACK", None)  # by length: one sequence of 3 chunks is not packed
    kda_fwd.kda_fwd(*args, **kw)
    monkeypatch.setattr(kda_fwd, "PACK", "1")
    kda_fwd.kda_fwd(*args, **kw)
    (_, k1, _, v1), (_, k2, _, v2), (_, k3, _, v3), (_, k4, _, v4) = calls
    assert "pack" not in dict(k1[0]) and "pack" not in dict(k2[0])
    assert dict(k3[0])["pack"] is True and dict(k4[0])["pack"] is True
    # both run three CTAs an SM (CTAS, the default where the host can take it: packed since session 33, unpacked 34)
    assert dict(k3[0]).get("ctas") == intra_tc.CTAS and dict(k1[0]).get("ctas") == intra_tc.CTAS
    assert {k: v for k, v in dict(k3[0]).items() if k != "pack"} == dict(k1[0])
    by_ptr = {t.data_ptr(): t for t in allocs}
    nc = v3[17]
    assert by_ptr[v1[11]].shape == (2, nc * 64, 128) and by_ptr[v3[11]].shape == (2, nc * 64, 64)
    assert by_ptr[v1[13]].shape == (2, nc, 128) and by_ptr[v3[13]].shape == (2, nc, recur.GAM_PITCH_PACK)
    assert v4[2] == v3[11] and v4[5] == v3[13]  # stage 2 reads the packed tile and γ's longer rows
    calls.clear()
    monkeypatch.setattr(intra_tc, "DIAG", ("clock",))
    kda_fwd.kda_fwd(*args, **kw)
    assert all(dict(key[0])["pack"] is True for _, key, _, _ in calls)
    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True, allow_neg_eigval=False,
                 group=1)
    with pytest.raises(ValueError, match="CULA_KDA_PACK"):
        intra_tc.KdaFwdIntraTC(**flags, pack=True)
    with pytest.raises(ValueError, match="CULA_KDA_PACK"):
        recur.KdaFwdRecur(True, True, False, variant="v2", pack=True)


def test_use_pack_by_length_unless_forced(monkeypatch):
    """By default PACK serves sequences of more than PACK_ABOVE_CHUNKS (7) chunks on average, exactly the lengths
    whose stage 2 runs without the state buffer, three stages (the varlen tables' rows bound the chunks: n20 T4096
    has at most 84 for 20 sequences, not packed; n20 T16384 276, B2 T16384 512 for 2, packed); CULA_KDA_PACK=1 / 0
    forces it on / off."""
    from cula.kernels.sm90 import kda_fwd_recur as recur

    monkeypatch.setattr(kda_fwd, "PACK", None)
    assert kda_fwd.PACK_ABOVE_CHUNKS == recur.STATE_SMEM_MAX_CHUNKS == 7
    assert kda_fwd.use_pack(1, 8) and not kda_fwd.use_pack(1, 7)
    for n, nc in ((20, 84), (20, 276), (2, 512), (10, 266), (3, 22)):
        assert kda_fwd.use_pack(n, nc) == (not recur.use_state_smem(n, nc, True))
    assert not kda_fwd.use_pack(20, 4096 // 64 + 20) and kda_fwd.use_pack(20, 16384 // 64 + 20)
    monkeypatch.setattr(kda_fwd, "PACK", "0")
    assert not kda_fwd.use_pack(2, 512)
    monkeypatch.setattr(kda_fwd, "PACK", "1")
    assert kda_fwd.use_pack(20, 84)
    monkeypatch.setattr(kda_fwd, "PACK", "yes")
    with pytest.raises(ValueError, match="CULA_KDA_PACK: expected '0' or '1'"):
        kda_fwd.use_pack(2, 512)


def test_ptx_pair():
    """Stage 2 as pairs (both V halves of an item in one CTA): no spills and no local memory under the setmaxnreg
    split (the math warpgroups up to PAIR_MATH_REGS, the TMA warpgroup's four warps down to PAIR_TMA_REGS), the
    split kernel's wgmma (each warpgroup runs its V half's chunk), one bulk tensor copy more (v's second half), the
    packed tile's mask ending on one barrier of both warpgroups (256 threads) and each warpgroup's v zeroing on its
    own (a run-time barrier id)."""
    from cula.kernels.common.ptx_check import ptx_reports
    from cula.kernels.sm90 import kda_fwd_recur as kr

    names = ["recur_v2_t_in_pack_x_words", "recur_v2_t_in_pack_x_pair", "recur_v2_t_in_x_pair",
             "recur_v2_t_in_pack_x_pair_no_state", "recur_v2_t_in_pack_x_pair_h0_only",
             "recur_v2_t_in_pack_x_pair_ht_only", "recur_v2_t_in_x_pair_v_first"]
    r = ptx_reports("cula.kernels.sm90.kda_fwd", names)
    base = r[names[0]]
    assert "setmaxnreg" not in base.ptx
    for n in names[1:]:
        rep = r[n]
        assert rep.spill_bytes == 0 and ".local" not in rep.ptx, n
        assert rep.count("wgmma.mma_async") == base.count("wgmma.mma_async"), n
        assert rep.count("cp.async.bulk.tensor") == base.count("cp.async.bulk.tensor") + 1, n
        assert rep.count(f"setmaxnreg.inc.sync.aligned.u32 {kr.PAIR_MATH_REGS}") == 1, n
        assert rep.count(f"setmaxnreg.dec.sync.aligned.u32 {kr.PAIR_TMA_REGS}") == 2, n
        assert re.search(r"bar\.sync %r\d+, 128;", rep.ptx), n
        assert (f"bar.sync {kr.PACK_BARRIER}, 256;" in rep.ptx) == ("pack" in n), n
    assert f"bar.sync {kr.PACK_BARRIER}, 128;" in base.ptx


def test_ptx_pack():
    """The packed [Aqk | T'] builds: stage 1 issues one TMA store fewer (Aqk leaves with T'), scatters T' below the
    diagonal into the staging (32 predicated 2-byte shared stores a thread) and stores the diagonal once a row;
    stage 2 issues the same TMA loads as u in stage 2 (the 16 KB box is two 8 KB boxes) and its math threads mask
    the two copies (16-byte pieces zeroed or masked, a fence, a named barrier; once a chunk, while Sᵀ(-w)ᵀ runs:
    no wait for the next chunk's loads). The products are the unpacked path's (t_in: Sᵀ(-w)ᵀ, then vᵀ T'ᵀ onto it),
    with no wgmma serialisation warning. No spills, no local memory."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    reps = ptx_reports("cula.kernels.sm90.kda_fwd", ["intra_tc_t_out_block32_pack", "intra_tc_t_out_block32",
                                                     "recur_v2_t_in_pack", "recur_v2_t_in",
                                                     "recur_v2_t_in_pack_state_smem"])
    p1, d1, p2, d2, p3 = (reps[n] for n in ("intra_tc_t_out_block32_pack", "intra_tc_t_out_block32",
                                            "recur_v2_t_in_pack", "recur_v2_t_in", "recur_v2_t_in_pack_state_smem"))
    assert p1.spill_bytes == 0 and p2.spill_bytes == 0
    assert ".local" not in p2.ptx and ".local" not in p1.ptx  # (a first mask went there: stage 2 +55%, session 29)
    assert p1.count("cp.async.bulk.tensor") == d1.count("cp.async.bulk.tensor") - 1
    assert p1.count("st.shared.b16") == d1.count("st.shared.b16") + 32
    assert p1.count("st.global.b16") == d1.count("st.global.b16") + 1
    assert p1.count("wgmma.mma_async") == d1.count("wgmma.mma_async")
    assert p2.count("cp.async.bulk.tensor") == d2.count("cp.async.bulk.tensor")
    assert p2.count("mbarrier.init") == d2.count("mbarrier.init")
    assert p2.count("fence.proxy.async") == d2.count("fence.proxy.async") + 1
    assert p2.count("mbarrier.arrive") == d2.count("mbarrier.arrive")
    assert p2.count("mbarrier.try_wait") == d2.count("mbarrier.try_wait")  # (no wait for the next stage's loads)
    assert p2.count("bar.sync 3, 128") == 1
    assert p2.count("st.shared.v4") >= d2.count("st.shared.v4") + 6
    assert p2.count("wgmma.mma_async") == d2.count("wgmma.mma_async")
    for r in (p2, p3, d2):
        assert r.spill_bytes == 0 and ".local" not in r.ptx
        assert "C7517" not in r.ptxas_log and "C7514" not in r.ptxas_log and "serialized" not in r.ptxas_log


def test_ptx_order():
    """ORDER "head_rev" (the default) reads the two grid indices the other way round and nothing else: the same
    instructions by kind as "chunk" and the same registers (a division by HV in its place cost 19). No spills."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    names = ["intra_tc_t_out_block32_pack", "intra_tc_t_out_block32_pack_chunk"]
    r = ptx_reports("cula.kernels.sm90.kda_fwd", names)
    rev, chunk = (r[n] for n in names)
    for r in (rev, chunk):
        assert r.spill_bytes == 0 and ".local" not in r.ptx
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "st.global", "ld.global", "div.", "rem.", "%ctaid.x",
               "%ctaid.y"):
        assert rev.count(op) == chunk.count(op), op
    assert rev.max_registers == chunk.max_registers


def test_host_path_recur_diag_half_at(monkeypatch):
    """CULA_KDA_RECUR_DIAG (timing only) reaches stage 2's launch key as ``diag`` with a warning that o is wrong;
    without it the key is as before. ``half_at`` needs the [Aqk | T'] rows (t_in); unknown names are refused."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as recur

    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    args, kw = _case(1, 130, 2, 2, None, seed=4, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    args = tuple(x.bfloat16() for x in args)
    kda_fwd.kda_fwd(*args, **kw)
    monkeypatch.setattr(recur, "RECUR_DIAG", ("half_at",))
    with pytest.warns(UserWarning, match="CULA_KDA_RECUR_DIAG=half_at"):
        kda_fwd.kda_fwd(*args, **kw)
    keys = [dict(key[0]) for kind, key, _, _ in calls if kind == "recur"]
    assert "diag" not in keys[0] and keys[1]["diag"] == ("half_at",)
    assert {k: v for k, v in keys[1].items() if k != "diag"} == keys[0]
    with pytest.raises(ValueError, match="needs t_in"):
        recur.KdaFwdRecur(True, True, False, variant="v2", diag=("half_at",))
    with pytest.raises(ValueError, match="CULA_KDA_RECUR_DIAG"):
        recur.KdaFwdRecur(True, True, False, variant="v2", t_in=True, diag=("nope",))


def test_item_order_covers_every_item():
    """Stage 2's persistent CTAs walk the (V tile, head, sequence) items V tile fastest, then head, then sequence
    (a head's two V halves side by side, sharing their scratch tiles in L2); every item once, and the state tile
    of an item (``_item_tile``, the kernel's own expression) is the one its coordinates name."""
    from cula.kernels.sm90.kda_fwd_recur import BV, _item_coords, _item_tile

    dims = (2, 3, 5)
    items = range(2 * 3 * 5)
    order = [_item_coords(i, dims) for i in items]
    assert sorted(order) == sorted((t, h, s) for t in range(2) for h in range(3) for s in range(5))
    assert order[:4] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    for i, (t, h, s) in zip(items, order):
        assert _item_tile(i, dims) == (s * 3 + h, t * BV)


def test_host_path_builds_launch_specs_once(monkeypatch):
    """The launchers' argument specs depend only on dtypes: a repeated call builds none (they were ~40 frozen
    dataclasses per call, ~25% of the host path's Python time on the CPU), and gets the same tuples."""
    pytest.importorskip("cutlass")
    from cula.kernels.common import fast_launch

    calls = record_kda_launches(monkeypatch)
    args, kw = _case(1, 70, 2, 2, None, seed=3, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    args = tuple(x.bfloat16() for x in args)
    kda_fwd.kda_fwd(*args, **kw)
    made = []
    real = fast_launch.ArgSpec.__post_init__
    monkeypatch.setattr(fast_launch.ArgSpec, "__post_init__", lambda self: made.append(self) or real(self))
    kda_fwd.kda_fwd(*args, **kw)
    assert [c[0] for c in calls] == ["intra_tc", "recur"] * 2 and made == []
    assert calls[0][2] is calls[2][2] and calls[1][2] is calls[3][2]


def test_tables_built_during_graph_capture_are_not_cached(monkeypatch):
    """Tensors made inside a CUDA-graph capture get their values only when the graph runs: tables
    built then must not be served to later eager calls."""
    from cula.kernels.common import tensor_cache

    monkeypatch.setattr(kda_fwd, "_capturing", lambda: True)  # the fixed-length tables
    monkeypatch.setattr(tensor_cache, "stream_capturing", lambda: True)  # the varlen ones
    cu = torch.tensor([0, 5, 70], dtype=torch.int32)
    first = kda_fwd.varlen_tables(cu, 70)[0]
    assert kda_fwd.varlen_tables(cu, 70)[0] is not first
    a = kda_fwd.fixed_length_tables(3, 77, "cpu")[0]
    assert kda_fwd.fixed_length_tables(3, 77, "cpu")[0] is not a


def test_misaligned_views_are_named_for_the_fallback():
    """A view at an odd element offset cannot feed the 16-byte accesses: supports() names it (dispatch
    then falls back to FLA with one warning) instead of the launch failing."""
    base = torch.zeros(2 * 64 * 128 + 1, dtype=torch.bfloat16)
    odd = base[1:].view(1, 2, 64, 128)
    ok = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert kda_fwd._misaligned(q=ok, k=ok, v=ok, g=ok, beta=None, initial_state=None) is None
    reason = kda_fwd._misaligned(q=ok, k=odd, v=ok, g=ok, beta=None, initial_state=None)
    assert reason.startswith("k data pointer is not 16-byte aligned")


def test_split_builds_the_suites_varlen_shapes(monkeypatch):
    """``kda_fwd --check --split varlen`` times the suite's slowest rows (varlen n20 T8192): each call gets
    cu_seqlens of the suite's length generator, one initial state per sequence, and all four stage sets.
    No GPU: the op and the timer are stand-ins that record the calls."""
    import triton.testing

    from cula.kernels.sm90 import kda_fwd as kf
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.suites.lengths import cu_seqlens_from_lengths, varlen_lengths

    calls = []

    def fake_kda_fwd(q, k, v, g, beta, stages, **kw):
        calls.append((q.shape, kw["cu_seqlens"], kw["initial_state"].shape, stages))

    monkeypatch.setattr(kf, "kda_fwd", fake_kda_fwd)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    rows = chk.split(torch.device("cpu"), chk.SPLIT_VARLEN[:1] + chk.SPLIT_FIXED[:1])
    assert [r["shape"] for r in rows] == ["uniform-n20 T8192 H64", "B1 T4096 H64"]
    shape, cu, h0, _ = calls[0]
    assert shape == (1, 8192, 64, 128) and h0 == (20, 64, 128, 128)
    assert cu.tolist() == cu_seqlens_from_lengths(varlen_lengths("uniform", 20, 8192))
    assert [c[3] for c in calls[:4]] == [("intra", "recur"), ("intra",), ("recur",), ()]
    assert calls[4][1] is None and calls[4][2] == (1, 64, 128, 128)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl,stage1", [(True, "tc"), (False, "tc"), (True, "simt")],
                         ids=["pdl", "serial", "pdl-simt"])
def test_gpu_chained_calls_equal_one_call(monkeypatch, pdl, stage1):
    """Prefill in pieces, each call's initial state the previous call's final state, equals one call
    bitwise (the pieces end on chunk boundaries, so every chunk and every state update is the same).
    With programmatic dependent launch, stage 2 reads its initial state before waiting for stage 1:
    this is what would see a previous call's final state half written. Sixteen heads x 2 x 4096 tokens keep
    stage 1 several waves long; repeated 5 times, on one stream, with no sync in between. ``simt``: a
    log-space gate given (FLA's defaults), so the exact SIMT stage 1 runs, which never signals early."""
    from cula.kernels.sm90 import kda_fwd_recur as kr

    monkeypatch.setattr(kr, "PDL", pdl)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    B, T, H, D = 2, 4096, 16, 128
    q, k, v, g = (torch.randn(B, T, H, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(4))
    beta = torch.randn(B, T, H, device=dev, generator=gen).to(torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=torch.randn(H, device=dev, generator=gen), dt_bias=torch.randn(H * D, device=dev) * 0.1,
              lower_bound=-5.0, safe_gate=True, output_final_state=True)
    if stage1 == "simt":
        g = torch.nn.functional.logsigmoid(g.float()).to(torch.bfloat16)
        kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
    assert kda_fwd.intra_kind(kw["use_qk_l2norm_in_kernel"], kw.get("use_gate_in_kernel", False),
                              kw.get("lower_bound")) == stage1
    h0 = torch.randn(B, H, D, D, device=dev, generator=gen) * 0.1
    o_full, ht_full = kda_fwd.kda_fwd(q, k, v, g, beta, initial_state=h0, **kw)
    cuts = (0, 1024, 1088, 3072, T)  # pieces of 1024, 64, 1984 and 1024 tokens
    for _ in range(5):
        state, outs = h0, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            o, state = kda_fwd.kda_fwd(q[:, a:b].contiguous(), k[:, a:b].contiguous(), v[:, a:b].contiguous(),
                                       g[:, a:b].contiguous(), beta[:, a:b].contiguous(), initial_state=state, **kw)
            outs.append(o)
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(outs, 1), o_full)
        assert torch.equal(state, ht_full)


def test_simt_stage1_inputs_go_to_fla_unless_asked(monkeypatch):
    """Inputs outside the tensor-core stage 1 (its SIMT stage 1 measured 0.38x FLA) are handed to FLA when
    FLA is installed; CULA_KERNELS=kda_fwd_simt keeps them on the kernel, and without FLA it runs them."""
    pytest.importorskip("cutlass")
    from cula import _dispatch

    monkeypatch.delenv("CULA_KERNELS", raising=False)
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: True)
    assert kda_fwd.simt_reason(True, True, -5.0) is None  # the suite's flags: tensor cores
    assert kda_fwd.simt_reason(True, True, None) is None  # FLA's layer call: tensor cores, gate clamped
    for flags in ((False, True, -5.0), (True, False, None), (False, True, None), (True, True, -12.0)):
        reason = kda_fwd.simt_reason(*flags)
        assert reason is not None and "0.38x FLA" in reason and "CULA_KERNELS=kda_fwd_simt" in reason, flags
    monkeypatch.setenv("CULA_KERNELS", "kda_fwd_simt")
    assert kda_fwd.simt_reason(True, False, None) is None
    monkeypatch.delenv("CULA_KERNELS")
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: False)
    assert kda_fwd.simt_reason(True, False, None) is None


def test_log_gate_is_opt_in_until_validated(monkeypatch):
    """Log-space gates with safe_gate take the tensor-core stage 1 in kda_fwd, but dispatch leaves them to FLA
    (with the reason) until LOG_GATE_VALIDATED, unless CULA_KERNELS=kda_fwd_loggate."""
    pytest.importorskip("cutlass")
    from cula import _dispatch

    monkeypatch.delenv("CULA_KERNELS", raising=False)
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: True)
    monkeypatch.setattr(kda_fwd, "LOG_GATE_VALIDATED", False)
    reason = kda_fwd.simt_reason(True, False, -5.0, True)
    assert reason is not None and "not yet validated" in reason and "CULA_KERNELS=kda_fwd_loggate" in reason
    assert kda_fwd.simt_reason(True, True, -5.0, True) is None  # the in-kernel gate is validated
    monkeypatch.setenv("CULA_KERNELS", "kda_fwd_loggate")
    assert kda_fwd.simt_reason(True, False, -5.0, True) is None
    monkeypatch.delenv("CULA_KERNELS")
    monkeypatch.setattr(kda_fwd, "LOG_GATE_VALIDATED", True)
    assert kda_fwd.simt_reason(True, False, None, True) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_gpu_a_warm_call_launches_only_its_two_kernels(varlen):
    """After the first call of a shape (tables cached), a call runs stage 1 and stage 2 and no other GPU
    work: no per-call cu_seqlens, tables or copies (each would be a kernel launch before stage 1, and
    a node in a captured graph)."""
    from _gpu_profile import kernels_of

    args, kw = _case(1 if varlen else 2, 512, 4, 4, [0, 100, 260, 512] if varlen else None, seed=1,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     lower_bound=-5.0, safe_gate=True)
    args = [x.cuda().to(torch.bfloat16) for x in args]
    kw = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    kernels = kernels_of(lambda: kda_fwd.kda_fwd(*args, **kw))
    assert len(kernels) == 2, kernels
    assert "intra" in kernels[0].lower() and "recur" in kernels[1].lower(), kernels


#: The GPU test's cases for WIDEN: every gate form (a bf16 gate is widened, an fp32 one is not), GVA V-first, partial
#: chunks, zero-length segments, 33 segments, short rows (the unpacked tile) and a long batch (the packed one)
WIDEN_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33",
               "tc-softplus-varlen-zero", "tc-loggate-safe-varlen", "tc-fp32-gate-plainbeta", "big-varlen"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", WIDEN_CASES)
def test_gpu_widen_int_equals_cvt(name, monkeypatch):
    """Stage 1 widening its bf16 inputs by word shifts and masks (WIDEN "int", bf16_widen) moves no bit: the scratch,
    o and the final state are bitwise those of the cvt.f32.bf16 widening (at the default CTAs an SM: three for the
    lower-bounded and log-space gates, two for the softplus one), with and without a state, and o inside a CUDA graph;
    the reference calls did build the cvt stage 1."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    args, kw = _equality_case(name)
    keys = _recorded_launch_keys(monkeypatch)

    def cvt():
        monkeypatch.setattr(intra_tc, "WIDEN", "cvt")
        keys.clear()

    def widened():
        assert any(dict(k[0]).get("widen") == "cvt" for k in keys)
        monkeypatch.setattr(intra_tc, "WIDEN", "int")
        keys.clear()

    _check_bitwise_equal(args, kw, cvt, widened, after=lambda: _assert_default_widening(keys))


def _assert_default_widening(keys: list) -> None:
    """The calls recorded in ``keys`` (launcher keys) built stage 1 at its default widening."""
    assert keys and not any("widen" in dict(k[0]) for k in keys)


#: The GPU test's cases for KGT: the 32-row blocks' gate forms (the lower-bounded sigmoid, fixed and varlen,
#: saturated at -5 and strong at -5.36; the log-space gate), GVA V-first, zero-length segments, 33 segments, a long
#: random batch
KGT_CASES = ["tc-T1", "tc-T65-gva-vfirst", "tc-T1000-negeig", "tc-varlen-zero", "tc-varlen-33", "tc-lb5-strong",
             "tc-loggate-safe-varlen", "big-varlen"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", KGT_CASES)
def test_gpu_kgt_ref_is_within_a_bf16_step_of_kh(name, monkeypatch):
    """kgᵀ formed as (K̃ 2^(ref − C)) 2^(Γ_last − ref) (KGT "ref", two FMUL an element) against session 36's
    (K̃ 2^(E − C)) 2^(Γ_last − E) ("kh"): every other scratch tile is bitwise the same, kgᵀ is within one bf16 step
    element by element (the same value rounded through other fp32 factors) except where both are below 2^-126, and o
    and the final state agree to bf16 accuracy; the reference calls did build the "kh" stage 1."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    args, kw = _equality_case(name)
    keys = _recorded_launch_keys(monkeypatch)
    monkeypatch.setattr(intra_tc, "KGT", "kh")
    o_ref, ht_ref, scr_ref = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    assert any(dict(k[0]).get("kgt") == "kh" for k in keys)
    monkeypatch.setattr(intra_tc, "KGT", "ref")
    keys.clear()
    o, ht, scr = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    torch.cuda.synchronize()
    assert keys and not any("kgt" in dict(k[0]) for k in keys)
    for n in scr_ref:
        if "kg" not in n:
            assert torch.equal(scr[n], scr_ref[n]), n
    (kg_name,) = [n for n in scr_ref if "kg" in n]
    a, b = scr[kg_name], scr_ref[kg_name]
    assert a.dtype == torch.bfloat16
    steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    # below 2^-126 one form may keep a subnormal the other flushes (ex2.ftz): a few bf16 subnormal steps, or a sign
    tiny = (a.float().abs() < 2.0 ** -126) & (b.float().abs() < 2.0 ** -126)
    bad = (steps > 1) & ~tiny
    assert not bad.any(), (bad.sum().item(), a[bad][:4].tolist(), b[bad][:4].tolist())
    assert (o.float() - o_ref.float()).norm() <= 1e-2 * o_ref.float().norm()
    assert (ht is None and ht_ref is None) or (ht - ht_ref).norm() <= 1e-2 * ht_ref.norm()


def test_ptx_session_37_stage_1_is_shorter():
    """The integer widening (WIDEN "int") replaces 176 cvt.f32.bf16 a thread of g (phase 1) and of q, k (phase 2) in
    the packed three-CTA default, with no spill or local memory and within 168 registers, as session 36's stage 1;
    KGT "ref" drops an FMUL an element; the SASS (where ptxas and cuobjdump are at hand) is shorter than both."""
    pytest.importorskip("cutlass")
    from cula.kernels.common import sass
    from cula.kernels.common.ptx_check import ptx_reports

    new, cvt, s36 = ("intra_tc_t_out_block32_pack_x_ctas3", "intra_tc_t_out_block32_pack_x_ctas3_cvt",
                     "intra_tc_t_out_block32_pack_x_ctas3_s36")
    r = ptx_reports("cula.kernels.sm90.kda_fwd", [new, cvt, s36])
    assert r[cvt].count("cvt.f32.bf16") - r[new].count("cvt.f32.bf16") >= 160
    # (cvt with KGT "ref" spills 4 bytes: an A/B build for the bitwise GPU test only, not timed)
    for name in (new, s36):
        assert r[name].spill_bytes == 0 and ".local" not in r[name].ptx and r[name].max_registers <= 168
    # KGT "ref": one FMUL an element and a third of the per-column exp2 fewer (8 x 8 and 8 a thread)
    assert r[s36].count("mul.f32") - r[cvt].count("mul.f32") >= 64
    assert r[s36].count("ex2.approx") - r[cvt].count("ex2.approx") == 8
    if sass.find_cuobjdump() and __import__("shutil").which("ptxas"):
        n = {name: len(sass.parse(sass.sass_of(r[name].ptx))) for name in (new, cvt, s36)}
        assert n[new] < min(n[cvt], n[s36]), n


def test_widen_and_kgt_environments_are_checked_by_name():
    """An unknown widening or kgᵀ form names the argument, what it takes and what it got."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    with pytest.raises(ValueError, match=r"widen \(CULA_KDA_TC_WIDEN\): expected one of \('int', 'cvt'\), got 'f16'"):
        intra_tc.KdaFwdIntraTC(True, True, True, True, False, 1, widen="f16")
    with pytest.raises(ValueError, match=r"kgt \(CULA_KDA_TC_KGT\): expected one of \('ref', 'kh'\), got 'e'"):
        intra_tc.KdaFwdIntraTC(True, True, True, True, False, 1, kgt="e")


def test_ptx_square_gate_factors_are_leaner_and_do_not_spill():
    """GATE_FACTORS "square" (2^C once a column, one FMUL an element for X and for qg): within the 168 registers of
    three CTAs an SM, no spills or local memory, the same 44 wgmma, and at least 128 - 16 fewer fp32 multiplies a
    thread than the default (two an element for 64 elements, less the 16 per-column ones it adds)."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    base, square = "intra_tc_t_out_block32_pack_x_ctas3", "intra_tc_t_out_block32_pack_x_ctas3_square"
    r = ptx_reports("cula.kernels.sm90.kda_fwd", [base, square])
    assert r[square].spill_bytes == 0 and ".local" not in r[square].ptx and r[square].max_registers <= 168
    assert r[square].count("wgmma.mma_async") == r[base].count("wgmma.mma_async") == 44
    assert r[base].count("mul.f32") - r[square].count("mul.f32") >= 128 - 16

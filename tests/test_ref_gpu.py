"""GPU: cula.ref against FLA 0.6.0's Triton ops (the behaviour the public ops must match), on CUDA.

This is where the flag semantics read from FLA's source are checked against what its kernels really
compute. FLA gets bf16 inputs (its usual regime); the reference gets the same bf16 values upcast, in
fp64. Tolerance: relative RMS error ||fla - ref|| / ||ref|| < BF16_RMS = 2e-2. FLA keeps bf16
intermediates (q/k after l2norm, the WY factors, chunk states cast to bf16), which costs ~1e-3..1e-2;
a wrong flag formula, mask, layout or head mapping costs O(1).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cula.ref import gdn, gla, kda, lightning

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path, not an optional FlashKDA backend

BF16_RMS = 2e-2
DEV = "cuda"
F64 = torch.float64


def rms_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.to(F64), want.to(F64)
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _bf16(*xs):
    return [x.to(DEV, torch.bfloat16) for x in xs]


def _seed(s):
    return torch.Generator(device=DEV).manual_seed(s)


def _randn(r, *shape):
    return torch.randn(*shape, generator=r, device=DEV, dtype=torch.float32)


KDA_CASES = {
    "plain_gva_state": dict(),
    "l2norm_gate_sigmoid": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                                use_beta_sigmoid_in_kernel=True),
    "safe_gate_neg_eig_vfirst": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True,
                                     dt_bias=True, safe_gate=True, lower_bound=-5.0,
                                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True),
    "lower_bound_no_A_log": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, dt_bias=True,
                                 lower_bound=-3.0, scale=0.1),
    "varlen": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                   cu_seqlens=[0, 100, 100, 357, 420]),
}


@pytest.mark.parametrize("case", KDA_CASES)
def test_kda_matches_fla_chunk_kda(case):
    from fla.ops.kda import chunk_kda

    flags = dict(KDA_CASES[case])
    r = _seed(1)
    cu = flags.pop("cu_seqlens", None)
    B, T = (1, cu[-1]) if cu else (2, 300)
    N = len(cu) - 1 if cu else B
    H, HV, K, V = 2, 4, 64, 64
    q, k, v = _randn(r, B, T, H, K), _randn(r, B, T, H, K), _randn(r, B, T, HV, V)
    if not flags.get("use_qk_l2norm_in_kernel"):
        k = F.normalize(k, dim=-1)
    if flags.get("use_gate_in_kernel"):
        g = _randn(r, B, T, HV, K)
    else:
        g = F.logsigmoid(_randn(r, B, T, HV, K) + 3.0)  # log-decays in (-inf, 0), mostly mild
    beta = _randn(r, B, T, HV) if flags.get("use_beta_sigmoid_in_kernel") else torch.rand(
        B, T, HV, generator=r, device=DEV)
    A_log = torch.rand(HV, generator=r, device=DEV) - 0.5 if flags.pop("A_log", False) else None
    dt_bias = _randn(r, HV * K) if flags.pop("dt_bias", False) else None
    h0 = _randn(r, N, HV, K, V)
    if flags.get("state_v_first"):
        h0 = h0.transpose(-1, -2).contiguous()
    q, k, v, g, beta = _bf16(q, k, v, g, beta)
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu else None

    fla_o, fla_s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                             A_log=A_log, dt_bias=dt_bias, **flags)
    ref_o, ref_s = kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                               A_log=A_log, dt_bias=dt_bias, **flags, dtype=F64)
    assert fla_s.shape == ref_s.shape
    assert rms_rel(fla_o, ref_o) < BF16_RMS, rms_rel(fla_o, ref_o)
    assert rms_rel(fla_s, ref_s) < BF16_RMS, rms_rel(fla_s, ref_s)


GDN_CASES = {
    "plain_gva_state": dict(),
    "flags_gate_vfirst": dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                              use_gate_in_kernel=True, state_v_first=True),
    "varlen": dict(use_qk_l2norm_in_kernel=True, cu_seqlens=[0, 64, 64, 201, 300]),
}


@pytest.mark.parametrize("case", GDN_CASES)
def test_gdn_matches_fla_chunk_gated_delta_rule(case):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    flags = dict(GDN_CASES[case])
    r = _seed(2)
    cu = flags.pop("cu_seqlens", None)
    B, T = (1, cu[-1]) if cu else (2, 300)
    N = len(cu) - 1 if cu else B
    H, HV, K, V = 2, 4, 64, 64
    q, k, v = _randn(r, B, T, H, K), _randn(r, B, T, H, K), _randn(r, B, T, HV, V)
    if not flags.get("use_qk_l2norm_in_kernel"):
        k = F.normalize(k, dim=-1)
    gate = flags.get("use_gate_in_kernel", False)
    g = _randn(r, B, T, HV) if gate else F.logsigmoid(_randn(r, B, T, HV) + 2.0)
    beta = _randn(r, B, T, HV) if flags.get("use_beta_sigmoid_in_kernel") else torch.rand(
        B, T, HV, generator=r, device=DEV)
    extra = dict(A_log=torch.rand(HV, generator=r, device=DEV) - 0.5, dt_bias=_randn(r, HV)) if gate else {}
    h0 = _randn(r, N, HV, K, V)
    if flags.get("state_v_first"):
        h0 = h0.transpose(-1, -2).contiguous()
    q, k, v, g, beta = _bf16(q, k, v, g, beta)
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int64) if cu else None

    fla_o, fla_s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu_t, **flags, **extra)
    ref_o, ref_s = gdn.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                               **flags, **extra, dtype=F64)
    assert rms_rel(fla_o, ref_o) < BF16_RMS, rms_rel(fla_o, ref_o)
    assert rms_rel(fla_s, ref_s) < BF16_RMS, rms_rel(fla_s, ref_s)


@pytest.mark.parametrize("cu", [None, [0, 50, 50, 230, 300]])
def test_gla_matches_fla_chunk_gla(cu):
    from fla.ops.gla import chunk_gla

    r = _seed(3)
    B, T = (1, cu[-1]) if cu else (2, 300)
    N = len(cu) - 1 if cu else B
    H, K, V = 3, 64, 64
    q, k, v = _randn(r, B, T, H, K), _randn(r, B, T, H, K), _randn(r, B, T, H, V)
    g = F.logsigmoid(_randn(r, B, T, H, K) + 3.0)
    h0 = _randn(r, N, H, K, V)
    q, k, v, g = _bf16(q, k, v, g)
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu else None
    fla_o, fla_s = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    ref_o, ref_s = gla.chunked(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu_t, dtype=F64)
    assert rms_rel(fla_o, ref_o) < BF16_RMS, rms_rel(fla_o, ref_o)
    assert rms_rel(fla_s, ref_s) < BF16_RMS, rms_rel(fla_s, ref_s)


@pytest.mark.parametrize("cu", [None, [0, 50, 50, 230, 300]])
def test_lightning_matches_fla_chunk_simple_gla(cu):
    from fla.ops.simple_gla import chunk_simple_gla

    r = _seed(4)
    B, T = (1, cu[-1]) if cu else (2, 300)
    N = len(cu) - 1 if cu else B
    H, K, V = 4, 64, 64
    q, k, v = _randn(r, B, T, H, K), _randn(r, B, T, H, K) * K ** -0.5, _randn(r, B, T, H, V)
    decay = torch.rand(H, generator=r, device=DEV) * 0.5
    h0 = _randn(r, N, H, K, V)
    q, k, v = _bf16(q, k, v)
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu else None
    fla_o, fla_s = chunk_simple_gla(q, k, v, g_gamma=-decay, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu_t)
    ref_o, ref_s = lightning.chunked(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                                     dtype=F64)
    assert rms_rel(fla_o, ref_o) < BF16_RMS, rms_rel(fla_o, ref_o)
    assert rms_rel(fla_s, ref_s) < BF16_RMS, rms_rel(fla_s, ref_s)


def test_large_shape_chunked_matches_recurrent_fp32():
    # The GPU oracle regime: the fp32 chunked form against the fp32 recurrence on a long sequence.
    r = _seed(5)
    B, T, H, K, V = 1, 4096, 8, 128, 128
    q, k, v = _randn(r, B, T, H, K), F.normalize(_randn(r, B, T, H, K), dim=-1), _randn(r, B, T, H, V)
    g = F.logsigmoid(_randn(r, B, T, H, K) + 4.0)
    beta = torch.rand(B, T, H, generator=r, device=DEV)
    with torch.no_grad():
        o_c, s_c = kda.chunked(q, k, v, g, beta, output_final_state=True)
        o_r, s_r = kda.recurrent(q, k, v, g, beta, output_final_state=True)
    assert rms_rel(o_c, o_r) < 1e-4, rms_rel(o_c, o_r)
    assert rms_rel(s_c, s_r) < 1e-4, rms_rel(s_c, s_r)

"""cula.ref.gdn against FLA 0.6.0's torch references and recurrent vs chunked.

Tolerances (relative: max |err| / max |reference|):
- FP64_FORMS = 1e-10: fp64 recurrent vs fp64 chunked, same math reassociated (observed ~1e-15).
- FLA_FP32 = 2e-5: FLA's naive_* cast to fp32 internally (observed <= 1e-6 at these sizes).
- FP32_VS_FP64 = 1e-5: our fp32 mode against our fp64 mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

from _ref_cases import F64, SEGMENTS, delta_inputs, gen, rand, randn, rel_err, split_by_cu, varlen_cu
from cula.ref import gdn

FP64_FORMS = 1e-10
FLA_FP32 = 2e-5
FP32_VS_FP64 = 1e-5

FORMS = {"recurrent": gdn.recurrent, "chunked": gdn.chunked}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B,T,H,with_state", [(1, 1, 1, False), (2, 63, 3, True), (2, 65, 1, True)])
def test_matches_fla_naive_recurrent(form, B, T, H, with_state):
    q, k, v, g, beta, h0 = delta_inputs(1, B, T, H, 16, 8, gate="scalar", with_state=with_state)
    want_o, want_s = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    o, s = FORMS[form](q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


def test_chunked_matches_fla_naive_chunk():
    q, k, v, g, beta, h0 = delta_inputs(2, 2, 100, 2, 16, 8, gate="scalar", with_state=True)
    want_o, want_s = naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, initial_state=h0,
                                                  output_final_state=True)
    o, s = gdn.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=32, dtype=F64)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (63, 64), (65, 64), (65, 16), (1000, 64)])
def test_forms_agree_fp64_gva(T, chunk_size):
    H, HV = (1, 2) if T == 1000 else (1, 3)
    q, k, v, g, beta, h0 = delta_inputs(3, 2, T, H, 8, 4, HV=HV, gate="scalar", with_state=True)
    o_r, s_r = gdn.recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    o_c, s_c = gdn.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           chunk_size=chunk_size, dtype=F64)
    assert rel_err(o_c, o_r) < FP64_FORMS
    assert rel_err(s_c, s_r) < FP64_FORMS


def test_gva_equals_repeated_qk_heads():
    # GVA: q/k head h serves value heads h*G .. h*G+G-1, i.e. the same as repeating q/k G times.
    q, k, v, g, beta, h0 = delta_inputs(4, 1, 30, 2, 8, 4, HV=6, gate="scalar", with_state=True)
    o, s = gdn.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8, dtype=F64)
    qr, kr = q.repeat_interleave(3, dim=2), k.repeat_interleave(3, dim=2)
    want_o, want_s = naive_recurrent_gated_delta_rule(qr, kr, v, beta, g, initial_state=h0, output_final_state=True)
    assert rel_err(o, want_o) < FLA_FP32 and rel_err(s, want_s) < FLA_FP32


def test_flags_match_fla_semantics():
    # l2norm, sigmoid beta with negative eigenvalues, in-kernel gate (FLA's naive_gdn_gate), scale, V-first.
    r = gen(5)
    B, T, H, HV, K, V = 2, 40, 1, 2, 8, 4
    q, k = randn(r, B, T, H, K), randn(r, B, T, H, K)
    v = randn(r, B, T, HV, V)
    g_raw, beta_raw = randn(r, B, T, HV), randn(r, B, T, HV)
    A_log, dt_bias = rand(r, HV, low=-1.0, high=0.5), randn(r, HV)
    h0 = randn(r, B, HV, K, V)
    kwargs = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, scale=0.3, state_v_first=True,
                  initial_state=h0.transpose(-1, -2), output_final_state=True)
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731  FLA's l2norm
    qt, kt = norm(q), norm(k)
    qt, kt = qt.repeat_interleave(2, dim=2), kt.repeat_interleave(2, dim=2)
    want_o, want_s = naive_recurrent_gated_delta_rule(
        qt, kt, v, 2 * torch.sigmoid(beta_raw), naive_gdn_gate(g_raw, A_log, dt_bias, output_dtype=F64),
        scale=0.3, initial_state=h0, output_final_state=True,
    )
    for form in FORMS.values():
        o, s_vk = form(q, k, v, g_raw, beta_raw, **kwargs, dtype=F64)
        assert s_vk.shape == (B, HV, V, K)
        assert rel_err(o, want_o) < FLA_FP32
        assert rel_err(s_vk.transpose(-1, -2), want_s) < FLA_FP32


def test_none_gate_and_beta_mean_no_decay_and_unit_beta():
    q, k, v, _, _, h0 = delta_inputs(6, 1, 20, 1, 8, 4, gate="scalar", with_state=True)
    o, s = gdn.chunked(q, k, v, None, None, initial_state=h0, output_final_state=True, chunk_size=8, dtype=F64)
    want_o, want_s = gdn.recurrent(q, k, v, torch.zeros(1, 20, 1, dtype=F64), torch.ones(1, 20, 1, dtype=F64),
                                   initial_state=h0, output_final_state=True, dtype=F64)
    assert rel_err(o, want_o) < FP64_FORMS and rel_err(s, want_s) < FP64_FORMS


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("segments", SEGMENTS)
def test_varlen_equals_per_segment(form, segments):
    lengths = SEGMENTS[segments]
    N, T = len(lengths), sum(lengths)
    q, k, v, g, beta, _ = delta_inputs(7, 1, T, 1, 8, 4, gate="scalar")
    h0 = randn(gen(8), N, 1, 8, 4)
    cu = varlen_cu(lengths, torch.int32)
    kw = dict(chunk_size=16) if form == "chunked" else {}
    fn = FORMS[form]
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw, dtype=F64)
    parts = [split_by_cu(x, cu) for x in (q, k, v, g, beta)]
    for n in range(N):
        o_n, s_n = fn(*(p[n] for p in parts), initial_state=h0[n:n + 1], output_final_state=True, **kw, dtype=F64)
        a, b = cu[n].item(), cu[n + 1].item()
        assert torch.allclose(o[:, a:b], o_n, rtol=1e-12, atol=1e-12)
        assert torch.allclose(s[n:n + 1], s_n, rtol=1e-12, atol=1e-12)


def test_fp32_mode_close_to_fp64():
    q, k, v, g, beta, h0 = delta_inputs(9, 2, 100, 2, 16, 8, gate="scalar", with_state=True)
    o64, s64 = gdn.recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    o32, s32 = gdn.chunked(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(),
                           output_final_state=True)
    assert o32.dtype == torch.float32
    assert rel_err(o32, o64) < FP32_VS_FP64 and rel_err(s32, s64) < FP32_VS_FP64


def test_gradcheck_chunked():
    r = gen(10)
    B, T, H, HV, K, V = 1, 5, 1, 2, 3, 2
    q = randn(r, B, T, H, K).requires_grad_()
    k = F.normalize(randn(r, B, T, H, K), dim=-1).requires_grad_()
    v = randn(r, B, T, HV, V).requires_grad_()
    g = rand(r, B, T, HV, low=-1.0, high=0.0).requires_grad_()
    beta = rand(r, B, T, HV, low=0.1, high=1.0).requires_grad_()
    h0 = randn(r, B, HV, K, V).requires_grad_()

    def f(q, k, v, g, beta, h0):
        return gdn.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=2, dtype=F64)

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, h0), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(allow_neg_eigval=True), "allow_neg_eigval"),
        (dict(use_gate_in_kernel=True), "A_log"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(3)), "dt_bias"),
        (dict(initial_state=torch.zeros(2, 2, 8, 4), state_v_first=True), "initial_state"),
        (dict(cu_seqlens=torch.tensor([0, 9], dtype=torch.int64)), "q"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(kwargs, arg):
    q, k, v, g, beta, _ = delta_inputs(11, 2, 9, 2, 8, 4, gate="scalar")
    with pytest.raises(ValueError, match=arg):
        gdn.chunked(q, k, v, g, beta, **kwargs)
    with pytest.raises(ValueError, match="g"):
        gdn.recurrent(q, k, v, g[..., None], beta)

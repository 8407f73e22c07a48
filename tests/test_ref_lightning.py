"""cula.ref.lightning against FLA 0.6.0's simple-GLA references (g_gamma = -decay) and recurrent vs chunked.

Tolerances (relative: max |err| / max |reference|):
- FP64_FORMS = 1e-10: fp64 recurrent vs fp64 chunked, same math reassociated (observed ~1e-15).
- FLA_FP32 = 2e-5: FLA's naive simple-GLA functions compute in fp32 (observed <= 1e-6 here).
- FP32_VS_FP64 = 1e-5: our fp32 mode against our fp64 mode.
"""

from __future__ import annotations

import pytest
import torch
from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla

from _ref_cases import F64, SEGMENTS, gen, rand, randn, rel_err, split_by_cu, varlen_cu
from cula.ref import lightning

FP64_FORMS = 1e-10
FLA_FP32 = 2e-5
FP32_VS_FP64 = 1e-5

FORMS = {"recurrent": lightning.recurrent, "chunked": lightning.chunked}


def lightning_inputs(seed, B, T, H, K, V, HV=None, with_state=False):
    HV = HV or H
    r = gen(seed)
    q, k, v = randn(r, B, T, H, K), randn(r, B, T, H, K), randn(r, B, T, HV, V)
    decay = rand(r, HV, low=0.01, high=1.0)
    h0 = randn(r, B, HV, K, V) if with_state else None
    return q, k, v, decay, h0


def _as_simple_gla(q, k, v, decay):
    """FLA's simple GLA takes per-token log gates [B, T, H] and no GVA: expand both."""
    G = v.shape[2] // q.shape[2]
    g = (-decay).expand(*v.shape[:3]).contiguous()
    return q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2), v, g


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B,T,H,HV,with_state", [(1, 1, 1, 1, False), (2, 63, 3, 3, True), (2, 65, 1, 4, True)])
def test_matches_fla_naive_recurrent_simple_gla(form, B, T, H, HV, with_state):
    q, k, v, decay, h0 = lightning_inputs(1, B, T, H, 16, 8, HV, with_state)
    want_o, want_s = naive_recurrent_simple_gla(*_as_simple_gla(q, k, v, decay), initial_state=h0,
                                                output_final_state=True)
    o, s = FORMS[form](q, k, v, decay, initial_state=h0, output_final_state=True, dtype=F64)
    assert o.shape == (B, T, HV, 8) and s.shape == (B, HV, 16, 8)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


def test_chunked_matches_fla_naive_chunk_simple_gla():
    q, k, v, decay, h0 = lightning_inputs(2, 2, 100, 2, 16, 8, with_state=True)
    # naive_chunk_simple_gla works in fp32 and needs an fp32 state.
    want_o, want_s = naive_chunk_simple_gla(*_as_simple_gla(q, k, v, decay), initial_state=h0.float(),
                                            output_final_state=True, chunk_size=32)
    o, s = lightning.chunked(q, k, v, decay, initial_state=h0, output_final_state=True, chunk_size=32, dtype=F64)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (63, 64), (65, 64), (65, 16), (1000, 64)])
def test_forms_agree_fp64(T, chunk_size):
    q, k, v, decay, h0 = lightning_inputs(3, 2, T, 1, 8, 4, HV=3, with_state=True)
    o_r, s_r = lightning.recurrent(q, k, v, decay, initial_state=h0, output_final_state=True, dtype=F64)
    o_c, s_c = lightning.chunked(q, k, v, decay, initial_state=h0, output_final_state=True,
                                 chunk_size=chunk_size, dtype=F64)
    assert rel_err(o_c, o_r) < FP64_FORMS
    assert rel_err(s_c, s_r) < FP64_FORMS


def test_closed_form_single_token_and_scale():
    # One token from state S0: o = scale q (exp(-decay) S0 + k^T v).
    q, k, v, decay, h0 = lightning_inputs(4, 1, 1, 1, 4, 3, with_state=True)
    o, s = lightning.chunked(q, k, v, decay, scale=0.7, initial_state=h0, output_final_state=True, dtype=F64)
    S = torch.exp(-decay)[0] * h0[0, 0] + k[0, 0, 0][:, None] * v[0, 0, 0][None, :]
    torch.testing.assert_close(s[0, 0], S, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(o[0, 0, 0], 0.7 * q[0, 0, 0] @ S, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("segments", SEGMENTS)
def test_varlen_equals_per_segment(form, segments):
    lengths = SEGMENTS[segments]
    N, T = len(lengths), sum(lengths)
    q, k, v, decay, _ = lightning_inputs(5, 1, T, 1, 8, 4, HV=2)
    h0 = randn(gen(6), N, 2, 8, 4)
    cu = varlen_cu(lengths, torch.int32)
    kw = dict(chunk_size=16) if form == "chunked" else {}
    fn = FORMS[form]
    o, s = fn(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw, dtype=F64)
    parts = [split_by_cu(x, cu) for x in (q, k, v)]
    for n in range(N):
        o_n, s_n = fn(*(p[n] for p in parts), decay, initial_state=h0[n:n + 1], output_final_state=True, **kw,
                      dtype=F64)
        a, b = cu[n].item(), cu[n + 1].item()
        assert torch.allclose(o[:, a:b], o_n, rtol=1e-12, atol=1e-12)
        assert torch.allclose(s[n:n + 1], s_n, rtol=1e-12, atol=1e-12)


def test_varlen_without_initial_state_starts_from_zero():
    lengths = [10, 0, 20]
    q, k, v, decay, _ = lightning_inputs(7, 1, 30, 2, 8, 4)
    o, s = lightning.chunked(q, k, v, decay, output_final_state=True, cu_seqlens=varlen_cu(lengths), dtype=F64)
    assert torch.equal(s[1], torch.zeros_like(s[1]))
    o0, s0 = lightning.recurrent(q[:, :10], k[:, :10], v[:, :10], decay, output_final_state=True, dtype=F64)
    assert rel_err(o[:, :10], o0) < FP64_FORMS and rel_err(s[0:1], s0) < FP64_FORMS


def test_fp32_mode_close_to_fp64():
    q, k, v, decay, h0 = lightning_inputs(8, 2, 300, 2, 16, 8, with_state=True)
    o64, s64 = lightning.recurrent(q, k, v, decay, initial_state=h0, output_final_state=True, dtype=F64)
    o32, s32 = lightning.chunked(q.float(), k.float(), v.float(), decay.float(), initial_state=h0.float(),
                                 output_final_state=True)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert rel_err(o32, o64) < FP32_VS_FP64 and rel_err(s32, s64) < FP32_VS_FP64


def test_gradcheck_chunked():
    q, k, v, decay, h0 = (x.requires_grad_() for x in lightning_inputs(9, 1, 5, 1, 3, 2, HV=2, with_state=True))

    def f(q, k, v, decay, h0):
        return lightning.chunked(q, k, v, decay, initial_state=h0, output_final_state=True, chunk_size=2,
                                 dtype=F64)

    assert torch.autograd.gradcheck(f, (q, k, v, decay, h0), eps=1e-6, atol=1e-7)


def test_bad_input_raises_value_error_naming_argument():
    q, k, v, decay, _ = lightning_inputs(10, 1, 9, 2, 8, 4, HV=4)
    with pytest.raises(ValueError, match="decay"):
        lightning.chunked(q, k, v, decay[:2])
    with pytest.raises(ValueError, match="k"):
        lightning.chunked(q, k[..., :4], v, decay)
    with pytest.raises(ValueError, match="cu_seqlens"):
        lightning.chunked(q, k, v, decay, cu_seqlens=torch.tensor([0, 5, 4, 9]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        lightning.chunked(q, k, v, decay, cu_seqlens=torch.tensor([0.0, 9.0]))
    with pytest.raises(ValueError, match="dtype"):
        lightning.recurrent(q, k, v, decay, dtype=torch.bfloat16)

"""cula.ref.gla against FLA 0.6.0's naive_recurrent_gla and recurrent vs chunked.

Tolerances (relative: max |err| / max |reference|):
- FP64_FORMS = 1e-10: fp64 recurrent vs fp64 chunked, same math reassociated (observed ~1e-15).
- FLA_FP32 = 2e-5: naive_recurrent_gla casts to fp32 internally (observed <= 1e-6 here).
- FP32_VS_FP64 = 1e-5: our fp32 mode against our fp64 mode.
"""

from __future__ import annotations

import pytest
import torch
from fla.ops.gla.naive import naive_recurrent_gla

from _ref_cases import F64, SEGMENTS, gen, rand, randn, rel_err, split_by_cu, varlen_cu
from cula.ref import gla

FP64_FORMS = 1e-10
FLA_FP32 = 2e-5
FP32_VS_FP64 = 1e-5

FORMS = {"recurrent": gla.recurrent, "chunked": gla.chunked}


def gla_inputs(seed, B, T, H, K, V, with_state=False, low=-5.0):
    r = gen(seed)
    q, k, v = randn(r, B, T, H, K), randn(r, B, T, H, K), randn(r, B, T, H, V)
    g = rand(r, B, T, H, K, low=low, high=0.0)
    h0 = randn(r, B, H, K, V) if with_state else None
    return q, k, v, g, h0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B,T,H,with_state", [(1, 1, 1, False), (2, 63, 3, True), (2, 65, 1, True)])
def test_matches_fla_naive_recurrent(form, B, T, H, with_state):
    q, k, v, g, h0 = gla_inputs(1, B, T, H, 16, 8, with_state)
    want_o, want_s = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    o, s = FORMS[form](q, k, v, g, initial_state=h0, output_final_state=True, dtype=F64)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (63, 64), (65, 64), (65, 16), (1000, 64)])
def test_forms_agree_fp64(T, chunk_size):
    H = 1 if T == 1000 else 3
    q, k, v, g, h0 = gla_inputs(2, 2, T, H, 8, 4, with_state=True, low=-1.0)
    o_r, s_r = gla.recurrent(q, k, v, g, initial_state=h0, output_final_state=True, dtype=F64)
    o_c, s_c = gla.chunked(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=chunk_size,
                           dtype=F64)
    assert rel_err(o_c, o_r) < FP64_FORMS
    assert rel_err(s_c, s_r) < FP64_FORMS


def test_state_v_first_and_scale():
    q, k, v, g, h0 = gla_inputs(3, 2, 30, 2, 8, 4, with_state=True)
    o_k, s_k = gla.chunked(q, k, v, g, scale=0.25, initial_state=h0, output_final_state=True, chunk_size=8,
                           dtype=F64)
    o_v, s_v = gla.recurrent(q, k, v, g, scale=0.25, initial_state=h0.transpose(-1, -2),
                             output_final_state=True, state_v_first=True, dtype=F64)
    assert s_v.shape == (2, 2, 4, 8)
    assert rel_err(o_v, o_k) < FP64_FORMS and rel_err(s_v.transpose(-1, -2), s_k) < FP64_FORMS
    o_default, _ = gla.chunked(q, k, v, g, initial_state=h0, dtype=F64)
    assert rel_err(o_default, o_k) > 1e-3  # scale is honoured


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("segments", SEGMENTS)
def test_varlen_equals_per_segment(form, segments):
    lengths = SEGMENTS[segments]
    N, T = len(lengths), sum(lengths)
    q, k, v, g, _ = gla_inputs(4, 1, T, 2, 8, 4)
    h0 = randn(gen(5), N, 2, 8, 4)
    cu = varlen_cu(lengths)
    kw = dict(chunk_size=16) if form == "chunked" else {}
    fn = FORMS[form]
    o, s = fn(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw, dtype=F64)
    parts = [split_by_cu(x, cu) for x in (q, k, v, g)]
    for n in range(N):
        o_n, s_n = fn(*(p[n] for p in parts), initial_state=h0[n:n + 1], output_final_state=True, **kw, dtype=F64)
        a, b = cu[n].item(), cu[n + 1].item()
        assert torch.allclose(o[:, a:b], o_n, rtol=1e-12, atol=1e-12)
        assert torch.allclose(s[n:n + 1], s_n, rtol=1e-12, atol=1e-12)


def test_fp32_mode_close_to_fp64():
    q, k, v, g, h0 = gla_inputs(6, 2, 100, 2, 16, 8, with_state=True)
    o64, s64 = gla.recurrent(q, k, v, g, initial_state=h0, output_final_state=True, dtype=F64)
    o32, s32 = gla.chunked(q.float(), k.float(), v.float(), g.float(), initial_state=h0.float(),
                           output_final_state=True)
    assert o32.dtype == torch.float32 and torch.isfinite(o32).all()
    assert rel_err(o32, o64) < FP32_VS_FP64 and rel_err(s32, s64) < FP32_VS_FP64


def test_gradcheck_chunked():
    q, k, v, g, h0 = (x.requires_grad_() for x in gla_inputs(7, 1, 5, 1, 3, 2, with_state=True, low=-1.0))

    def f(q, k, v, g, h0):
        return gla.chunked(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=2, dtype=F64)

    assert torch.autograd.gradcheck(f, (q, k, v, g, h0), eps=1e-6, atol=1e-7)


def test_bad_input_raises_value_error_naming_argument():
    q, k, v, g, _ = gla_inputs(8, 1, 9, 2, 8, 4)
    with pytest.raises(ValueError, match="g"):
        gla.chunked(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match="v"):
        gla.chunked(q, k, torch.cat([v, v], dim=2), g)  # chunk_gla has no GVA
    with pytest.raises(ValueError, match="initial_state"):
        gla.recurrent(q, k, v, g, initial_state=torch.zeros(1, 2, 4, 8))

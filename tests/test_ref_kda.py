"""cula.ref.kda against FLA 0.6.0's torch references, recurrent vs chunked, every chunk_kda flag.

Tolerances (relative: max |err| / max |reference|):
- FP64_FORMS = 1e-10: fp64 recurrent vs fp64 chunked compute the same sums in another order (the
  triangular solve, chunk products); observed <= 4e-15 up to T=1000, so 1e-10 leaves ample room while
  any algebra slip (a wrong mask, decay or sign) shows up at >= 1e-3.
- FLA_FP32 = 2e-5: FLA's naive_* functions cast to fp32 whatever they are given, so they are only
  ~1e-7 per op accurate; observed <= 2.1e-7 up to T=1000.
- FP32_VS_FP64 = 1e-5: our dtype=float32 mode against our float64 mode (observed 0.5e-6..5e-6, the
  largest at T=1000 with chunk 64).
"""

from __future__ import annotations

import math

import pytest
import torch
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from _ref_cases import F64, SEGMENTS, delta_inputs, gen, rand, randn, rel_err, split_by_cu, varlen_cu
from cula.ref import kda

FP64_FORMS = 1e-10
FLA_FP32 = 2e-5
FP32_VS_FP64 = 1e-5

FORMS = {"recurrent": kda.recurrent, "chunked": kda.chunked}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "B,T,H,HV,with_state",
    [(1, 1, 1, 1, False), (2, 63, 3, 3, True), (2, 65, 1, 3, True), (1, 130, 2, 4, False)],
)
def test_matches_fla_naive_recurrent(form, B, T, H, HV, with_state):
    q, k, v, g, beta, h0 = delta_inputs(1, B, T, H, 16, 8, HV, with_state=with_state)
    want_o, want_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = FORMS[form](q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    assert o.dtype == F64 and s.dtype == F64
    assert o.shape == (B, T, HV, 8) and s.shape == (B, HV, 16, 8)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


def test_chunked_matches_fla_naive_chunk_gva():
    # naive_chunk_kda needs T % chunk_size == 0; mild gates keep its unmasked exp() finite.
    q, k, v, _, beta, h0 = delta_inputs(2, 2, 128, 1, 16, 8, HV=2, with_state=True)
    g = rand(gen(3), 2, 128, 2, 16, low=-1.0, high=0.0)
    want_o, want_s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=64)
    o, s = kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    assert rel_err(o, want_o) < FLA_FP32
    assert rel_err(s, want_s) < FLA_FP32


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (63, 64), (65, 64), (65, 16), (50, 7), (1000, 64)])
def test_forms_agree_fp64(T, chunk_size):
    H, K, V = (1, 8, 4) if T == 1000 else (3, 16, 8)
    q, k, v, g, beta, h0 = delta_inputs(4, 2, T, H, K, V, with_state=True)
    o_r, s_r = kda.recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    o_c, s_c = kda.chunked(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size, dtype=F64
    )
    assert rel_err(o_c, o_r) < FP64_FORMS
    assert rel_err(s_c, s_r) < FP64_FORMS


def test_strong_gates_stay_finite_in_fp32():
    # Log-decays near -5 per step: the within-chunk cumulative decay reaches -320, far past fp32's
    # exp range; the chunked form must only exponentiate causal differences.
    q, k, v, _, beta, h0 = delta_inputs(5, 1, 128, 2, 16, 8, with_state=True)
    g = rand(gen(6), 1, 128, 2, 16, low=-5.0, high=-4.0)
    o64, s64 = kda.recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    o32, s32 = kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) < FP32_VS_FP64
    assert rel_err(s32, s64) < FP32_VS_FP64


def test_fp32_mode_close_to_fp64():
    q, k, v, g, beta, h0 = delta_inputs(7, 2, 100, 2, 16, 8, with_state=True)
    o64, s64 = kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    for form in FORMS.values():
        o32, s32 = form(q.float(), k.float(), v.float(), g.float(), beta.float(),
                        initial_state=h0.float(), output_final_state=True)
        assert o32.dtype == torch.float32 and s32.dtype == torch.float32
        assert rel_err(o32, o64) < FP32_VS_FP64
        assert rel_err(s32, s64) < FP32_VS_FP64


def _l2norm_fla(x):
    # FLA's l2norm_fwd: the epsilon sits inside the square root.
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def test_l2norm_epsilon_inside_sqrt():
    # A key of norm 1e-3 is shrunk by sqrt(1e-6 / (1e-6 + 1e-6)) = 1/sqrt(2), not normalised to 1.
    B, T, H, K, V = 1, 1, 1, 4, 2
    q = torch.zeros(B, T, H, K, dtype=F64)
    q[..., 0] = 1.0
    k = q * 1e-3
    v = torch.ones(B, T, H, V, dtype=F64)
    g = torch.zeros(B, T, H, K, dtype=F64)
    beta = torch.ones(B, T, H, dtype=F64)
    o, _ = kda.recurrent(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=True, dtype=F64)
    # S = k_hat v^T (zero start), o = (q_hat . k_hat) v with q_hat = e0 / sqrt(1 + 1e-6) and
    # k_hat = e0 * 1e-3 / sqrt(1e-6 + 1e-6) = e0 / sqrt(2).
    expected = (1 / math.sqrt(1 + 1e-6)) * (1 / math.sqrt(2))
    torch.testing.assert_close(o, torch.full_like(o, expected), rtol=1e-12, atol=0)


FLAG_CASES = {
    "plain": {},
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate_softplus": dict(use_gate_in_kernel=True, with_A_log=True, with_dt_bias=True),
    "gate_softplus_no_bias": dict(use_gate_in_kernel=True, with_A_log=True),
    "gate_lower_bound": dict(use_gate_in_kernel=True, with_A_log=True, with_dt_bias=True, lower_bound=-5.0),
    "gate_lower_bound_no_A": dict(use_gate_in_kernel=True, with_dt_bias=True, lower_bound=-3.0),
    "safe_gate": dict(use_gate_in_kernel=True, with_A_log=True, with_dt_bias=True, safe_gate=True,
                      lower_bound=-5.0),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "scale": dict(scale=0.37),
    "all": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, with_A_log=True, with_dt_bias=True,
                safe_gate=True, lower_bound=-4.0, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                scale=0.5),
}


def _flag_inputs(case, seed=11, B=2, T=40, H=2, HV=4, K=8, V=4):
    """Raw inputs for a flag case, the kwargs for cula.ref.kda and the transformed inputs FLA's naive
    recurrence should see (built from FLA's own torch gate references)."""
    flags = dict(FLAG_CASES[case])
    with_A_log = flags.pop("with_A_log", False)
    with_dt_bias = flags.pop("with_dt_bias", False)
    r = gen(seed)
    q = randn(r, B, T, H, K)
    k = randn(r, B, T, H, K) / math.sqrt(K)
    v = randn(r, B, T, HV, V)
    h0 = randn(r, B, HV, K, V)
    gate_in_kernel = flags.get("use_gate_in_kernel", False)
    g = randn(r, B, T, HV, K) if gate_in_kernel else rand(r, B, T, HV, K, low=-5.0, high=0.0)
    sigmoid_beta = flags.get("use_beta_sigmoid_in_kernel", False)
    beta = randn(r, B, T, HV) if sigmoid_beta else rand(r, B, T, HV, low=0.05, high=1.0)
    A_log = rand(r, HV, low=-1.0, high=0.5) if with_A_log else None
    dt_bias = randn(r, HV * K) if with_dt_bias else None

    qt, kt, gt, bt = q, k, g, beta
    if flags.get("use_qk_l2norm_in_kernel"):
        qt, kt = _l2norm_fla(q), _l2norm_fla(k)
    else:
        kt = torch.nn.functional.normalize(k, dim=-1)  # keep the delta rule contractive
        k = kt
    if gate_in_kernel:
        if flags.get("lower_bound") is not None:
            gt = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=flags["lower_bound"], output_dtype=F64)
        else:
            gt = naive_kda_gate(g, A_log, dt_bias, output_dtype=F64)
    if sigmoid_beta:
        bt = torch.sigmoid(beta) * (2.0 if flags.get("allow_neg_eigval") else 1.0)
    kwargs = dict(flags, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True)
    return (q, k, v, g, beta), kwargs, (qt, kt, v, gt, bt, h0)


@pytest.mark.parametrize("case", FLAG_CASES)
def test_flags_match_fla_semantics(case):
    raw, kwargs, (qt, kt, vt, gt, bt, h0) = _flag_inputs(case)
    want_o, want_s = naive_recurrent_kda(qt, kt, vt, gt, bt, scale=kwargs.get("scale"), initial_state=h0,
                                         output_final_state=True)
    o_r, s_r = kda.recurrent(*raw, **kwargs, dtype=F64)
    o_c, s_c = kda.chunked(*raw, **kwargs, chunk_size=16, dtype=F64)
    assert rel_err(o_r, want_o) < FLA_FP32 and rel_err(s_r, want_s) < FLA_FP32
    assert rel_err(o_c, o_r) < FP64_FORMS and rel_err(s_c, s_r) < FP64_FORMS


@pytest.mark.parametrize("case", [c for c in FLAG_CASES if c not in ("plain", "safe_gate")])
def test_each_flag_changes_the_result(case):
    # Guards against a flag being accepted but ignored: switching the case's flags off (same raw
    # inputs, made valid where the flag-off meaning needs it) must change the output.
    raw, kwargs, _ = _flag_inputs(case)
    q, k, v, g, beta = raw
    off = dict(kwargs)
    if case == "neg_eigval":
        off["allow_neg_eigval"] = False  # keep the sigmoid: only the doubling is under test
    else:
        off.update(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, safe_gate=False, lower_bound=None, scale=None)
        if kwargs.get("use_gate_in_kernel"):
            g = -torch.nn.functional.softplus(g)  # a valid log-decay, but not the in-kernel gate
        if kwargs.get("use_beta_sigmoid_in_kernel"):
            beta = beta.clamp(0.0, 1.0)  # a valid beta, but not sigmoid(beta)
    o_on, _ = kda.chunked(*raw, **kwargs, dtype=F64)
    o_off, _ = kda.chunked(q, k, v, g, beta, **off, dtype=F64)
    assert rel_err(o_on, o_off) > 1e-3


def test_safe_gate_leaves_math_unchanged():
    raw, kwargs, _ = _flag_inputs("safe_gate")
    o_safe, s_safe = kda.chunked(*raw, **kwargs, dtype=F64)
    o_plain, s_plain = kda.chunked(*raw, **dict(kwargs, safe_gate=False), dtype=F64)
    assert torch.equal(o_safe, o_plain) and torch.equal(s_safe, s_plain)


@pytest.mark.parametrize("form", FORMS)
def test_state_v_first_is_the_transpose(form):
    q, k, v, g, beta, h0 = delta_inputs(12, 2, 33, 2, 8, 4, HV=4, with_state=True)
    o_k, s_k = FORMS[form](q, k, v, g, beta, initial_state=h0, output_final_state=True, dtype=F64)
    o_v, s_v = FORMS[form](q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(),
                           output_final_state=True, state_v_first=True, dtype=F64)
    assert s_v.shape == (2, 4, 4, 8)
    assert rel_err(o_v, o_k) < 1e-14
    assert rel_err(s_v.transpose(-1, -2), s_k) < 1e-14


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_varlen_equals_per_segment(form, segments, cu_dtype, state_v_first):
    if form == "recurrent" and (segments == "17seg_with_empty") and cu_dtype == torch.int32:
        pytest.skip("covered by the int64 run; keeps the suite fast")
    lengths = SEGMENTS[segments]
    N, T = len(lengths), sum(lengths)
    q, k, v, g, beta, _ = delta_inputs(13, 1, T, 1, 8, 4, HV=2)
    h0 = randn(gen(14), N, 2, 8, 4)
    if state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    cu = varlen_cu(lengths, cu_dtype)
    flags = dict(use_qk_l2norm_in_kernel=True, state_v_first=state_v_first, output_final_state=True)
    fn = FORMS[form]
    kw = dict(chunk_size=16) if form == "chunked" else {}
    o, s = fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **flags, **kw, dtype=F64)
    assert o.shape == (1, T, 2, 4) and s.shape == h0.shape
    parts = [split_by_cu(x, cu) for x in (q, k, v, g, beta)]
    for n in range(N):
        o_n, s_n = fn(*(p[n] for p in parts), initial_state=h0[n:n + 1], **flags, **kw, dtype=F64)
        a, b = cu[n].item(), cu[n + 1].item()
        assert torch.allclose(o[:, a:b], o_n, rtol=1e-12, atol=1e-12)
        assert torch.allclose(s[n:n + 1], s_n, rtol=1e-12, atol=1e-12)
    if 0 in lengths:  # a zero-length segment returns its initial state untouched
        n = lengths.index(0)
        assert torch.equal(s[n], h0[n])


def test_no_final_state_unless_asked():
    q, k, v, g, beta, h0 = delta_inputs(15, 1, 10, 1, 8, 4, with_state=True)
    for form in FORMS.values():
        o, s = form(q, k, v, g, beta, initial_state=h0)
        assert s is None and o.dtype == torch.float32


def test_gradcheck_chunked():
    # Tiny fp64 problem with every input differentiable, in-kernel gate and sigmoid beta on, a chunk
    # size that does not divide T (padding path) and GVA.
    r = gen(16)
    B, T, H, HV, K, V = 1, 5, 1, 2, 3, 2
    q = randn(r, B, T, H, K).requires_grad_()
    k = (randn(r, B, T, H, K) * 0.5).requires_grad_()
    v = randn(r, B, T, HV, V).requires_grad_()
    g = randn(r, B, T, HV, K).requires_grad_()
    beta = randn(r, B, T, HV).requires_grad_()
    A_log = rand(r, HV, low=-1.0, high=0.0).requires_grad_()
    dt_bias = randn(r, HV * K).requires_grad_()
    h0 = randn(r, B, HV, K, V).requires_grad_()

    def f(q, k, v, g, beta, A_log, dt_bias, h0):
        o, s = kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                           dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, chunk_size=2, dtype=F64)
        return o, s

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, A_log, dt_bias, h0), eps=1e-6, atol=1e-7)


def test_chunked_gradients_match_recurrent():
    # The chunked form is the backward oracle too: its autograd gradients must equal the recurrence's.
    q, k, v, g, beta, h0 = delta_inputs(17, 1, 70, 2, 8, 4, HV=4, with_state=True)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    r = gen(18)
    do, ds = randn(r, 1, 70, 4, 4), randn(r, 1, 4, 8, 4)
    grads = []
    for form in FORMS.values():
        o, s = form(*inputs[:5], initial_state=inputs[5], output_final_state=True, dtype=F64)
        grads.append(torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs))
    for g_r, g_c in zip(*grads):
        assert rel_err(g_c, g_r) < FP64_FORMS


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(allow_neg_eigval=True), "allow_neg_eigval"),
        (dict(use_gate_in_kernel=True), "A_log"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), safe_gate=True), "lower_bound"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), safe_gate=True, lower_bound=-6.0), "lower_bound"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), "A_log"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)), "dt_bias"),
        (dict(initial_state=torch.zeros(2, 4, 4, 8)), "initial_state"),
        (dict(cu_seqlens=torch.tensor([0, 3, 9])), "cu_seqlens"),
        (dict(dtype=torch.float16), "dtype"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(kwargs, arg):
    q, k, v, g, beta, _ = delta_inputs(19, 2, 9, 2, 8, 4, HV=4)
    with pytest.raises(ValueError, match=arg):
        kda.chunked(q, k, v, g, beta, **kwargs)


def test_bad_shapes_raise_value_error():
    q, k, v, g, beta, _ = delta_inputs(20, 1, 9, 2, 8, 4, HV=3)  # HV not a multiple of H
    with pytest.raises(ValueError, match="v"):
        kda.recurrent(q, k, v, g, beta)
    q, k, v, g, beta, _ = delta_inputs(20, 1, 9, 2, 8, 4)
    with pytest.raises(ValueError, match="g"):
        kda.recurrent(q, k, v, g[..., :4], beta)
    with pytest.raises(ValueError, match="beta"):
        kda.recurrent(q, k, v, g, beta[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunked(q, k, v, g, beta, chunk_size=0)


def test_gradcheck_chunked_varlen():
    # Gradients flow through the pack/pad gathers, including past a zero-length segment.
    r = gen(21)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    T, H, K, V = 7, 1, 2, 2
    q, k, v = randn(r, 1, T, H, K), randn(r, 1, T, H, K) * 0.5, randn(r, 1, T, H, V)
    g, beta = rand(r, 1, T, H, K, low=-1.0, high=0.0), rand(r, 1, T, H, low=0.1, high=1.0)
    h0 = randn(r, 3, H, K, V)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, g, beta, h0))

    def f(q, k, v, g, beta, h0):
        return kda.chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                           chunk_size=2, dtype=F64)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)

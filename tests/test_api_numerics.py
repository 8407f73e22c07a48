"""The public ops on CPU (the torch path) equal FLA 0.6.0's ``fla.ops.*.naive`` references.

Small shapes, fp32, GVA, states in both layouts, varlen (with an empty sequence), the in-op transforms,
the FLA-only options the references lack (gk / gv / per-channel beta / reverse, via independent
oracles), the decode state pool, and gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FLA: "Triton is not supported on current platform"
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

from cula.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from cula.gla import chunk_gla, fused_recurrent_gla
from cula.kda import chunk_kda, fused_recurrent_kda
from cula.lightning import lightning_attn_decode, lightning_attn_fwd

B, T, H, HV, K, V = 2, 11, 2, 4, 8, 4
TOL = dict(rtol=1e-4, atol=1e-4)
LENGTHS = (5, 0, 9, 3)  # packed sequences, one empty


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(a, b):
    torch.testing.assert_close(a, b.to(a.dtype), **TOL)


def qkv(b=B, t=T, h=H, hv=HV):
    q = torch.randn(b, t, h, K)
    k = F.normalize(torch.randn(b, t, h, K), dim=-1)
    return q, k, torch.randn(b, t, hv, V)


def pack(*xs):
    return [x.reshape(1, -1, *x.shape[2:]) for x in xs]


def segments(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return cu, [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def per_segment(naive, xs, h0, lengths):
    """Run ``naive(*segment_inputs, h0_n)`` per packed segment; returns packed o and stacked states."""
    cu, spans = segments(lengths)
    outs, states = [], []
    for n, (a, b) in enumerate(spans):
        o, s = naive(*(x[:, a:b] for x in xs), h0[n:n + 1])
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def kda_naive(q, k, v, g, beta, h0, scale=None):
    return naive_recurrent_kda(q, k, v, g, beta, scale, h0, True)


# --- KDA


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_kda_equals_naive_gva_with_states(op):
    q, k, v = qkv()
    g, beta = F.logsigmoid(torch.randn(B, T, HV, K)), torch.rand(B, T, HV)
    h0 = torch.randn(B, HV, K, V)
    o, ht = op(q, k, v, g, beta, scale=0.4, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_naive(q, k, v, g, beta, h0, scale=0.4)
    close(o, o_ref)
    close(ht, ht_ref)
    assert ht.dtype == torch.float32
    assert op(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_kda_varlen_with_empty_sequence(op):
    q, k, v = qkv(b=1, t=sum(LENGTHS))
    g, beta = F.logsigmoid(torch.randn(1, q.shape[1], HV, K)), torch.rand(1, q.shape[1], HV)
    h0 = torch.randn(len(LENGTHS), HV, K, V)
    cu, _ = segments(LENGTHS)
    o, ht = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = per_segment(kda_naive, (q, k, v, g, beta), h0, LENGTHS)
    close(o, o_ref)
    close(ht, ht_ref)
    close(ht[1], h0[1])  # the empty sequence keeps its state


def test_kda_in_op_transforms_and_v_first_state():
    q, k, v = qkv()
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)  # not normalised: the op does it
    raw_g, raw_beta = torch.randn(B, T, HV, K), torch.randn(B, T, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    h0 = torch.randn(B, HV, K, V)
    o, ht = chunk_kda(
        q, k, v, raw_g, raw_beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True, state_v_first=True, A_log=A_log, dt_bias=dt_bias,
    )
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    g = -A_log.exp()[:, None] * F.softplus(raw_g + dt_bias.view(HV, K))
    o_ref, ht_ref = kda_naive(l2(q), l2(k), v, g, 2 * torch.sigmoid(raw_beta), h0)
    close(o, o_ref)
    close(ht.transpose(-1, -2), ht_ref)
    o2, _ = fused_recurrent_kda(
        q, k, v, raw_g, raw_beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
        initial_state=h0.transpose(-1, -2).contiguous(), state_v_first=True,
    )
    close(o2, o_ref)


def test_kda_lower_bound_gate():
    q, k, v = qkv()
    raw_g, beta = torch.randn(B, T, HV, K), torch.rand(B, T, HV)
    o, _ = chunk_kda(q, k, v, raw_g, beta, use_gate_in_kernel=True, safe_gate=True, lower_bound=-3.0)
    o_ref, _ = kda_naive(q, k, v, -3.0 * torch.sigmoid(raw_g), beta, None)
    close(o, o_ref)


def test_kda_per_channel_beta_runs_value_columns_independently():
    """With beta ``[B, T, HV, V]`` each value column is an independent scalar-beta run."""
    q, k, v = qkv()
    g, beta = F.logsigmoid(torch.randn(B, T, HV, K)), torch.rand(B, T, HV, V)
    h0 = torch.randn(B, HV, K, V)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for c in range(V):
        o_c, ht_c = kda_naive(q, k, v[..., c:c + 1], g, beta[..., c], h0[..., c:c + 1])
        close(o[..., c:c + 1], o_c)
        close(ht[..., c:c + 1], ht_c)


def test_kda_bf16_inputs_give_bf16_outputs():
    q, k, v = (x.bfloat16() for x in qkv())
    g, beta = F.logsigmoid(torch.randn(B, T, HV, K)).bfloat16(), torch.rand(B, T, HV).bfloat16()
    o, ht = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, _ = kda_naive(q.float(), k.float(), v.float(), g.float(), beta.float(), None)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)


# --- GDN


def gdn_naive(q, k, v, g, beta, h0):
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, None, h0, True)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_gdn_equals_naive_varlen(op):
    q, k, v = qkv(b=1, t=sum(LENGTHS), hv=H)
    g, beta = F.logsigmoid(torch.randn(1, q.shape[1], H)), torch.rand(1, q.shape[1], H)
    h0 = torch.randn(len(LENGTHS), H, K, V)
    cu, _ = segments(LENGTHS)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    if op == "chunk":
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    else:
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, **kw)
    o_ref, ht_ref = per_segment(gdn_naive, (q, k, v, g, beta), h0, LENGTHS)
    close(o, o_ref)
    close(ht, ht_ref)


def test_gdn_in_op_gate_and_gva():
    q, k, v = qkv()
    raw_g, beta = torch.randn(B, T, HV), torch.rand(B, T, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    g = -A_log.exp() * F.softplus(raw_g + dt_bias)
    o_ref, _ = kda_naive(q, k, v, g[..., None].expand(-1, -1, -1, K), beta, None)  # GDN == KDA with a flat gate
    o, _ = chunk_gated_delta_rule(q, k, v, raw_g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    close(o, o_ref)
    o2, _ = fused_recurrent_gated_delta_rule(q, k, v, raw_g, beta=beta, use_gate_in_kernel=True, A_log=A_log,
                                             dt_bias=dt_bias)
    close(o2, o_ref)


def test_gdn_recurrent_gk_gv_and_default_beta():
    q, k, v = qkv()
    g = F.logsigmoid(torch.randn(B, T, HV))
    gk, gv = F.logsigmoid(torch.randn(B, T, HV, K)), F.logsigmoid(torch.randn(B, T, HV, V))
    h0 = torch.randn(B, HV, K, V)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, initial_state=h0, output_final_state=True)
    ones = torch.ones(B, T, HV)
    for c in range(V):  # column c decays by exp(g + gk + gv[c]): a KDA run per value column
        o_c, ht_c = kda_naive(q, k, v[..., c:c + 1], g[..., None] + gk + gv[..., c:c + 1], ones, h0[..., c:c + 1])
        close(o[..., c:c + 1], o_c)
        close(ht[..., c:c + 1], ht_c)


# --- GLA


def gla_naive(q, k, v, g, h0):
    return naive_recurrent_gla(q, k, v, g, h0, True)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_gla_equals_naive_varlen(op):
    q, k, v = qkv(b=1, t=sum(LENGTHS), hv=H)
    g = F.logsigmoid(torch.randn(1, q.shape[1], H, K))
    h0 = torch.randn(len(LENGTHS), H, K, V)
    cu, _ = segments(LENGTHS)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, ht = chunk_gla(q, k, v, g, **kw) if op == "chunk" else fused_recurrent_gla(q, k, v, g, **kw)
    o_ref, ht_ref = per_segment(gla_naive, (q, k, v, g), h0, LENGTHS)
    close(o, o_ref)
    close(ht, ht_ref)


def test_gla_recurrent_gv_reverse_and_no_gate():
    q, k, v = qkv(hv=H)
    gk, gv = F.logsigmoid(torch.randn(B, T, H, K)), F.logsigmoid(torch.randn(B, T, H, V))
    h0 = torch.randn(B, H, K, V)
    o, ht = fused_recurrent_gla(q, k, v, gk, gv, initial_state=h0, output_final_state=True)
    for c in range(V):  # column c: GLA with key decay gk + gv[c]
        o_c, ht_c = gla_naive(q, k, v[..., c:c + 1], gk + gv[..., c:c + 1], h0[..., c:c + 1])
        close(o[..., c:c + 1], o_c)
        close(ht[..., c:c + 1], ht_c)
    # reverse: the same as running the time-flipped sequence forward
    o_r, ht_r = fused_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True, reverse=True)
    o_f, ht_f = gla_naive(*(x.flip(1) for x in (q, k, v, gk)), h0)
    close(o_r, o_f.flip(1))
    close(ht_r, ht_f)
    # no gate at all: plain linear attention
    o0, _ = fused_recurrent_gla(q, k, v)
    close(o0, gla_naive(q, k, v, torch.zeros_like(q), None)[0])


def test_gla_reverse_varlen():
    q, k, v = qkv(b=1, t=sum(LENGTHS), hv=H)
    gk = F.logsigmoid(torch.randn(1, q.shape[1], H, K))
    cu, spans = segments(LENGTHS)
    o, _ = fused_recurrent_gla(q, k, v, gk, reverse=True, cu_seqlens=cu)
    for a, b in spans:
        o_f, _ = gla_naive(*(x[:, a:b].flip(1) for x in (q, k, v, gk)), None)
        close(o[:, a:b], o_f.flip(1))


# --- Lightning


def lightning_naive(q, k, v, decay, h0, scale=None):
    G = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    g = (-decay).reshape(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
    return naive_recurrent_simple_gla(q, k, v, g, scale, h0, True)


def test_lightning_fwd_equals_naive_varlen_gva():
    q, k, v = qkv(b=1, t=sum(LENGTHS))
    decay = torch.rand(HV)
    h0 = torch.randn(len(LENGTHS), HV, K, V)
    cu, _ = segments(LENGTHS)
    o, ht = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = per_segment(lambda q, k, v, h: lightning_naive(q, k, v, decay, h), (q, k, v), h0, LENGTHS)
    close(o, o_ref)
    close(ht, ht_ref)


def test_lightning_decode_pool_semantics():
    q, k, v = qkv(t=2)
    decay = torch.rand(HV)
    pool = torch.randn(5, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([3, -1])
    # not in place: the pool is untouched, the new states come back
    o, ht = lightning_attn_decode(q, k, v, decay, initial_state=pool, output_final_state=True, state_indices=idx)
    assert torch.equal(pool, before)
    o0, ht0 = lightning_naive(q[:1], k[:1], v[:1], decay, before[3:4])
    close(o[:1], o0)
    close(ht[:1], ht0)
    assert torch.count_nonzero(o[1]) == 0 and torch.count_nonzero(ht[1]) == 0
    # in place: slot 3 gets the new state, the rest stays
    o_i, ret = lightning_attn_decode(q, k, v, decay, initial_state=pool, state_indices=idx, inplace=True)
    assert ret is pool
    close(o_i, o)
    close(pool[3], ht0[0])
    assert torch.equal(pool[[0, 1, 2, 4]], before[[0, 1, 2, 4]])
    # without indices: [B, ...] states, updated in place
    states = before[:2].clone()
    _, ret = lightning_attn_decode(q, k, v, decay, initial_state=states, inplace=True)
    close(ret, lightning_naive(q, k, v, decay, before[:2])[1])


def test_kda_decode_pool_with_varlen_and_bf16_pool():
    lengths = (1, 2, 1)
    q, k, v = qkv(b=1, t=sum(lengths))
    g, beta = F.logsigmoid(torch.randn(1, q.shape[1], HV, K)), torch.rand(1, q.shape[1], HV)
    pool = torch.randn(6, HV, K, V).bfloat16()
    before = pool.clone()
    idx = torch.tensor([5, -1, 0])
    cu, spans = segments(lengths)
    o, ret = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                                 inplace_final_state=True)
    assert ret is pool and pool.dtype == torch.bfloat16
    for n, (a, b) in enumerate(spans):
        if idx[n] < 0:
            assert torch.count_nonzero(o[:, a:b]) == 0
            continue
        o_n, ht_n = kda_naive(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], before[idx[n]][None].float())
        close(o[:, a:b], o_n)
        torch.testing.assert_close(pool[idx[n]].float(), ht_n[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(pool[[1, 2, 3, 4]], before[[1, 2, 3, 4]])


# --- gradients (the CPU path is the differentiable reference)


def test_kda_gradients_equal_naive_autograd():
    q, k, v = qkv(t=6)
    g, beta = F.logsigmoid(torch.randn(B, 6, HV, K)), torch.rand(B, 6, HV)
    h0 = torch.randn(B, HV, K, V)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    (o.square().sum() + ht.sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_r, ht_r = kda_naive(*ref_leaves)
    (o_r.square().sum() + ht_r.sum()).backward()
    for name, mine, theirs in zip("q k v g beta h0".split(), leaves, ref_leaves):
        assert mine.grad is not None and mine.grad.abs().sum() > 0, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-3, atol=1e-3, msg=name)


def test_lightning_gradient_reaches_decay():
    q, k, v = qkv(t=6)
    decay = torch.rand(HV, requires_grad=True)
    o, _ = lightning_attn_fwd(q, k, v, decay)
    o.sum().backward()
    d2 = decay.detach().clone().requires_grad_()
    lightning_naive(q, k, v, d2, None)[0].sum().backward()
    torch.testing.assert_close(decay.grad, d2.grad, rtol=1e-3, atol=1e-3)

"""The public ops on a CUDA GPU: dispatch picks a GPU backend and the results equal the torch reference.

bf16 inputs, K = V = 128 (the shapes the carried Triton autotune cache knows), fp32 states.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import cula
from cula import CulaFallbackWarning
from cula._dispatch import CULA_SM90, FLA_TRITON, TORCH_REF

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
BF = torch.bfloat16
H, HV, K, V = 2, 4, 128, 128
LENGTHS = (100, 0, 37, 119)


@pytest.fixture(autouse=True)
def _quiet():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CulaFallbackWarning)  # kernels say "not validated" until they are
        yield


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def cu(lengths=LENGTHS):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)


def qkv(t, hv=HV, h=H):
    q = torch.randn(1, t, h, K, device=DEV, dtype=BF)
    k = F.normalize(torch.randn(1, t, h, K, device=DEV), dim=-1).to(BF)
    return q, k, torch.randn(1, t, hv, V, device=DEV, dtype=BF)


def check(op, ref, args, kwargs, tol=2e-2):
    name = op.__name__
    decision = cula.backends(name, *args, **kwargs)
    assert decision.backend != TORCH_REF, str(decision)
    o, ht = op(*args, **kwargs)
    o_ref, ht_ref = ref(*args, **kwargs)
    assert o.dtype == BF and o.device.type == "cuda"
    assert rel(o, o_ref) < tol, (name, rel(o, o_ref), str(decision))
    if ht_ref is not None:
        assert ht.dtype == torch.float32 and rel(ht, ht_ref) < tol, (name, rel(ht, ht_ref))
    return decision


def test_backends_here():
    table = cula.backends()
    for op, statuses in table.items():
        by_name = {s.backend: s for s in statuses}
        assert by_name[FLA_TRITON].available, (op, by_name[FLA_TRITON].reason)
        assert by_name[TORCH_REF].available
    print({op: [(s.backend, s.available, s.reason) for s in st] for op, st in table.items()})


def test_lightning_fwd_varlen_gva():
    from cula.lightning import lightning_attn_fwd
    from cula.ref import lightning as ref

    t = sum(LENGTHS)
    q, k, v = qkv(t)
    decay = torch.rand(HV, device=DEV)
    h0 = torch.randn(len(LENGTHS), HV, K, V, device=DEV)
    d = check(lightning_attn_fwd, ref.chunked, (q, k, v, decay),
              dict(initial_state=h0, output_final_state=True, cu_seqlens=cu()))
    print(d)


def test_lightning_decode_pool():
    from cula.lightning import lightning_attn_decode
    from cula.ref import lightning as ref

    B = 3
    q = torch.randn(B, 1, H, K, device=DEV, dtype=BF)
    k = F.normalize(torch.randn(B, 1, H, K, device=DEV), dim=-1).to(BF)
    v = torch.randn(B, 1, HV, V, device=DEV, dtype=BF)
    decay = torch.rand(HV, device=DEV)
    pool = torch.randn(8, HV, K, V, device=DEV)
    before = pool.clone()
    idx = torch.tensor([6, -1, 2], device=DEV, dtype=torch.int32)
    o, ret = lightning_attn_decode(q, k, v, decay, initial_state=pool, state_indices=idx, inplace=True)
    assert ret is pool
    for b, slot in ((0, 6), (2, 2)):
        o_b, h_b = ref.recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], decay, initial_state=before[slot:slot + 1],
                                 output_final_state=True)
        assert rel(o[b:b + 1], o_b) < 2e-2 and rel(pool[slot], h_b[0]) < 2e-2
    assert torch.count_nonzero(o[1]) == 0
    untouched = [i for i in range(8) if i not in (6, 2)]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("gva", [False, True])
def test_chunk_kda_varlen(gva):
    from cula.kda import chunk_kda
    from cula.ref import kda as ref

    hv = HV if gva else H
    t = sum(LENGTHS)
    q, k, v = qkv(t, hv=hv)
    g = F.logsigmoid(torch.randn(1, t, hv, K, device=DEV)).to(BF)
    beta = torch.rand(1, t, hv, device=DEV).to(BF)
    h0 = torch.randn(len(LENGTHS), hv, K, V, device=DEV)
    print(check(chunk_kda, ref.chunked, (q, k, v, g, beta),
                dict(initial_state=h0, output_final_state=True, cu_seqlens=cu())))


def test_chunk_kda_in_op_gate():
    from cula.kda import chunk_kda
    from cula.ref import kda as ref

    t = 256
    q, k, v = qkv(t)
    g, beta = torch.randn(1, t, HV, K, device=DEV, dtype=BF), torch.randn(1, t, HV, device=DEV, dtype=BF)
    A_log, dt_bias = torch.randn(HV, device=DEV), torch.randn(HV * K, device=DEV)
    decision = check(chunk_kda, ref.chunked, (q, k, v, g, beta),
                     dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                          A_log=A_log, dt_bias=dt_bias, output_final_state=True))
    # FLA's layer call (softplus gate, no lower bound): cula's kernel on Hopper, its gate clamped at -11
    if torch.cuda.get_device_capability() == (9, 0):
        assert decision.backend == CULA_SM90, str(decision)


def test_fused_recurrent_kda_pool_and_varlen():
    from cula.kda import fused_recurrent_kda
    from cula.ref import kda as ref

    t = 64
    q, k, v = qkv(t)
    g = F.logsigmoid(torch.randn(1, t, HV, K, device=DEV)).to(BF)
    beta = torch.rand(1, t, HV, device=DEV).to(BF)
    check(fused_recurrent_kda, ref.recurrent, (q, k, v, g, beta),
          dict(output_final_state=True, cu_seqlens=cu((20, 0, 44))))
    # decode against a pool
    B = 3
    qd, kd, vd = (x.reshape(B, 1, *x.shape[2:])[:B] for x in (q[:, :B], k[:, :B], v[:, :B]))
    gd, bd = g[:, :B].reshape(B, 1, HV, K), beta[:, :B].reshape(B, 1, HV)
    pool = torch.randn(5, HV, K, V, device=DEV)
    before = pool.clone()
    idx = torch.tensor([4, 0, -1], device=DEV)
    o, ret = fused_recurrent_kda(qd, kd, vd, gd, bd, initial_state=pool, state_indices=idx, inplace=True)
    assert ret is pool and torch.count_nonzero(o[2]) == 0
    o_ref, h_ref = ref.recurrent(qd[:2], kd[:2], vd[:2], gd[:2], bd[:2], initial_state=before[[4, 0]],
                                 output_final_state=True)
    assert rel(o[:2], o_ref) < 2e-2 and rel(pool[[4, 0]], h_ref) < 2e-2
    assert torch.equal(pool[1:4], before[1:4])


def test_gdn_ops():
    from cula.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from cula.ref import gdn as ref

    t = sum(LENGTHS)
    q, k, v = qkv(t)
    g = F.logsigmoid(torch.randn(1, t, HV, device=DEV)).to(BF)
    beta = torch.rand(1, t, HV, device=DEV).to(BF)
    h0 = torch.randn(len(LENGTHS), HV, K, V, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu())
    check(chunk_gated_delta_rule, ref.chunked, (q, k, v, g, beta), kw)
    check(fused_recurrent_gated_delta_rule, ref.recurrent, (q, k, v, g), kw | {"beta": beta})  # beta is 7th in FLA


def test_gla_ops():
    from cula.gla import chunk_gla, fused_recurrent_gla
    from cula.ref import gla as ref

    t = sum(LENGTHS)
    q, k, v = qkv(t, hv=H)
    g = F.logsigmoid(torch.randn(1, t, H, K, device=DEV)).to(BF)
    h0 = torch.randn(len(LENGTHS), H, K, V, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu())
    check(chunk_gla, ref.chunked, (q, k, v, g), kw)
    check(fused_recurrent_gla, ref.recurrent, (q, k, v, g), kw)


def test_chunk_kda_gradients_through_fla():
    from cula.kda import chunk_kda
    from cula.ref import kda as ref

    t = 128
    q, k, v = qkv(t)
    g = F.logsigmoid(torch.randn(1, t, HV, K, device=DEV)).to(BF)
    beta = torch.rand(1, t, HV, device=DEV).to(BF)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    assert cula.backends("chunk_kda", *leaves).backend == FLA_TRITON
    chunk_kda(*leaves)[0].float().square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref.chunked(*ref_leaves)[0].square().sum().backward()
    for name, a, b in zip("q k v g beta".split(), leaves, ref_leaves):
        assert rel(a.grad, b.grad) < 5e-2, (name, rel(a.grad, b.grad))


def test_fused_recurrent_kda_gradients_run_the_reference_on_cuda():
    from cula.kda import fused_recurrent_kda

    t = 16
    q, k, v = qkv(t)
    g = F.logsigmoid(torch.randn(1, t, HV, K, device=DEV)).to(BF)
    beta = torch.rand(1, t, HV, device=DEV).to(BF).requires_grad_()
    d = cula.backends("fused_recurrent_kda", q, k, v, g, beta)
    assert d.backend == TORCH_REF and "no backward" in str(d)
    o, _ = fused_recurrent_kda(q, k, v, g, beta)
    o.float().sum().backward()
    assert beta.grad is not None and beta.grad.is_cuda and torch.isfinite(beta.grad).all()


def test_repeated_calls_take_the_planned_path_and_follow_new_inputs():
    """The second call with the same signature reuses the cached call plan; it must still read the new
    tensors (a plan that kept the first call's pointers would return the first result again)."""
    from cula.kda import chunk_kda
    from cula.lightning import lightning_attn_fwd
    from cula.ref import kda as kda_ref
    from cula.ref import lightning as lref

    t = sum(LENGTHS)
    for _ in range(3):  # call 1 builds the plan, calls 2 and 3 take it with fresh data
        q, k, v = qkv(t)
        decay = torch.rand(HV, device=DEV)
        h0 = torch.randn(len(LENGTHS), HV, K, V, device=DEV)
        check(lightning_attn_fwd, lref.chunked, (q, k, v, decay),
              dict(initial_state=h0, output_final_state=True, cu_seqlens=cu()))
        g = F.logsigmoid(torch.randn(1, t, HV, K, device=DEV)).to(BF)
        beta = torch.rand(1, t, HV, device=DEV).to(BF)
        check(chunk_kda, kda_ref.chunked, (q, k, v, g, beta),
              dict(initial_state=h0, output_final_state=True, cu_seqlens=cu()))


def test_public_ops_launch_only_their_kernels_when_warm():
    """The public ops' per-call layer (validation, plans, allocations) adds no GPU work: a warm call of
    each op on inputs its cula kernel takes profiles as exactly that kernel's launches (KDA prefill:
    stage 1 and 2; the others one), fixed length and packed."""
    from _gpu_profile import kernels_of

    from cula.kda import chunk_kda, fused_recurrent_kda
    from cula.lightning import lightning_attn_decode, lightning_attn_fwd

    hv = h = 4
    A_log, dt_bias = torch.randn(hv, device=DEV), torch.randn(hv * K, device=DEV) * 0.1
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, safe_gate=True)
    cases = []
    for lengths in (None, (100, 37, 119)):
        t = 256 if lengths is None else sum(lengths)
        b = 2 if lengths is None else 1
        q, k, v = (torch.randn(b, t, h, K, device=DEV, dtype=BF) for _ in range(3))
        g, beta = torch.randn(b, t, hv, K, device=DEV, dtype=BF), torch.randn(b, t, hv, device=DEV, dtype=BF)
        c = None if lengths is None else cu(lengths)
        n = b if lengths is None else len(lengths)
        s0 = torch.zeros(n, hv, K, V, device=DEV)
        cases.append((f"chunk_kda {lengths}", 2, lambda q=q, k=k, v=v, g=g, beta=beta, c=c, s0=s0: chunk_kda(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=c, **flags)))
        decay = torch.rand(hv, device=DEV)
        cases.append((f"lightning_attn_fwd {lengths}", 1, lambda q=q, k=k, v=v, decay=decay, c=c, s0=s0:
                      lightning_attn_fwd(q, k, v, decay, initial_state=s0, output_final_state=True, cu_seqlens=c)))
    q1, k1, v1 = (torch.randn(8, 1, h, K, device=DEV, dtype=BF) for _ in range(3))
    g1, b1 = torch.randn(8, 1, hv, K, device=DEV, dtype=BF), torch.randn(8, 1, hv, device=DEV, dtype=BF)
    pool = torch.zeros(16, hv, K, V, device=DEV)
    idx = torch.arange(8, device=DEV, dtype=torch.int32) * 2
    decode_flags = {n: x for n, x in flags.items() if n != "safe_gate"}  # fused_recurrent_kda has none
    decay1 = torch.rand(hv, device=DEV)
    cases.append(("fused_recurrent_kda", 1, lambda: fused_recurrent_kda(
        q1, k1, v1, g1, b1, initial_state=pool, state_indices=idx, inplace=True, **decode_flags)))
    cases.append(("lightning_attn_decode", 1, lambda: lightning_attn_decode(
        q1, k1, v1, decay1, initial_state=pool, state_indices=idx, inplace=True)))
    for name, per_call, fn in cases:
        kernels = kernels_of(fn, calls=3)
        assert len(kernels) == 3 * per_call, (name, kernels)

"""chunk_kda with gradients: cula's forward kernels under FLA 0.6.0's backward (cula/kda/_train.py).

CPU: the token -> scratch-row map that puts our chunk-padded Aqk / Akk into FLA's layout; kda_fwd's
``fla_factors`` argument checks and host path; the autograd wiring (which gradient lands on which
input, what FLA's backward is handed) with FLA's kernels replaced by recorders. The stage-1 flag that
writes bf16(T) compiles clean (tests/test_kernel_kda_fwd.py, target ``intra_tc_emit_akk``).

GPU (marked): our Aqk / Akk against the ones FLA's own forward saves, and end-to-end gradients against
FLA's chunk_kda and the fp64 reference's autograd.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from _kda_host import fake_sm90, record_kda_launches
from cula.kernels.common.aot_build import TRAIN_TEST_CASES
from cula.kernels.sm90 import kda_fwd

gpu = pytest.mark.gpu


# --------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 64, 65, 200, 200, 329]])
@pytest.mark.parametrize("sync_free", [False, True])
def test_token_rows_map_each_token_to_its_scratch_row(cu, sync_free):
    B, T = (1, 329) if cu is not None else (3, 130)
    TT = B * T
    if cu is None:
        chunks, _, nc = kda_fwd.fixed_length_tables(B, T, "cpu")
        starts = [b * T for b in range(B)]
        ends = [s + T for s in starts]
    else:
        cu_t = torch.tensor(cu)
        chunks, _, nc = kda_fwd.varlen_tables(cu_t, TT) if sync_free else kda_fwd.chunk_tables(cu_t)
        starts, ends = cu[:-1], cu[1:]
    rows = kda_fwd.token_rows(chunks, TT)
    assert rows.shape == (TT,) and rows.dtype == torch.int64
    want, first_chunk = [], 0
    for s, e in zip(starts, ends):
        want += [64 * first_chunk + p for p in range(e - s)]
        first_chunk += -(-(e - s) // 64)
    assert rows.tolist() == want
    assert int(rows.max()) < nc * 64


@pytest.mark.parametrize("flags, words", [
    (dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True, lower_bound=-5.0), "tensor-core"),
    (dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False), "tensor-core"),
    (dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, return_scratch=True),
     "return_scratch"),
])
def test_fla_factors_refuses_what_it_cannot_form(flags, words):
    pytest.importorskip("cutlass")
    x = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"^fla_factors: .*{words}"):
        kda_fwd.kda_fwd(x, x, x, x, x[..., 0], fla_factors=True, **flags)


def test_fla_factors_reason_names_the_pieces_limit():
    reason = kda_fwd.fla_factors_reason(1 << 24, 64, None, 1, True, True, -5.0)
    assert reason is not None and "pieces" in reason
    assert kda_fwd.fla_factors_reason(4096, 64, None, 1, True, True, -5.0) is None


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 64, 65, 200]])
def test_host_path_with_fla_factors(monkeypatch, cu):
    """kda_fwd(fla_factors=True) (launches recorded): stage 1 is compiled with emit_akk, the qg buffer is
    long enough for bf16(T) after qg, and Aqk / Akk come back as [B, T, HV, 64] gathered from the rows
    the kernels write."""
    pytest.importorskip("cutlass")
    calls = record_kda_launches(monkeypatch)  # (kind, key, specs, values) per launch
    B, T, H, HV = (1, 200, 1, 2) if cu is not None else (2, 70, 1, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(B, T, n, 128, generator=gen).bfloat16() for n in (H, H, HV, HV))
    beta = torch.randn(B, T, HV, generator=gen).bfloat16()
    o, ht, aqk, akk = kda_fwd.kda_fwd(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
        A_log=torch.zeros(HV), cu_seqlens=None if cu is None else torch.tensor(cu), fla_factors=True)
    assert [c[0] for c in calls] == ["intra_tc", "recur"]
    assert ("emit_akk", True) in calls[0][1][0]
    assert o.shape == (B, T, HV, 128) and ht is None
    assert aqk.shape == akk.shape == (B, T, HV, 64) and aqk.dtype == akk.dtype == torch.bfloat16
    assert aqk.is_contiguous() and akk.is_contiguous()


class _Recorder:
    """Stand-ins for FLA's kernels (CPU): each gradient a constant that names its slot."""

    def __init__(self, monkeypatch):
        import fla.modules.norm.l2norm as l2
        import fla.ops.common.gate as gate
        import fla.ops.kda.chunk_bwd as bwd
        import fla.ops.utils.cumsum as cumsum

        self.bwd_kwargs = {}
        monkeypatch.setattr(l2, "l2norm_fwd", lambda x: (x * 0.5, torch.full(x.shape[:-1], 2.0)))
        monkeypatch.setattr(l2, "l2norm_bwd", lambda y, rstd, dy: dy * 10)
        monkeypatch.setattr(gate, "fused_beta_sigmoid", lambda x, scale=1.0: torch.sigmoid(x.float()) * scale)
        monkeypatch.setattr(gate, "fused_beta_sigmoid_bwd", lambda x, dy, scale=1.0: dy * 100)
        self.cumsum_kwargs = None

        def chunk_local_cumsum(g, **kw):
            self.cumsum_kwargs = kw
            self.g_cumsum = g.float() * 2
            return self.g_cumsum

        monkeypatch.setattr(cumsum, "chunk_local_cumsum", chunk_local_cumsum)

        def chunk_kda_bwd(**kw):
            self.bwd_kwargs = kw
            q, v, g = kw["q"], kw["v"], kw["g_org"] if kw["g_org"] is not None else kw["g"]
            dh0 = None if kw["initial_state"] is None else torch.full_like(kw["initial_state"], 6.0)
            dA = None if kw["A_log"] is None else torch.full_like(kw["A_log"], 7.0)
            dbias = None if kw["dt_bias"] is None else torch.full_like(kw["dt_bias"], 8.0)
            return (torch.full_like(q, 1.0, dtype=torch.float32), torch.full_like(q, 2.0, dtype=torch.float32),
                    torch.full_like(v, 3.0, dtype=torch.float32), torch.full(v.shape[:-1], 4.0),
                    torch.full_like(g, 5.0, dtype=torch.float32), dh0, dA, dbias)

        monkeypatch.setattr(bwd, "chunk_kda_bwd", chunk_kda_bwd)


def test_autograd_wiring_without_optional_inputs(monkeypatch):
    """No A_log, dt_bias or initial state (the lower-bounded gate needs no A_log): FLA's backward may still
    return tensors in those slots, which autograd would refuse for None inputs."""
    pytest.importorskip("fla")
    import fla.ops.kda.chunk_bwd as bwd

    from cula.kda import _train

    _Recorder(monkeypatch)

    def chunk_kda_bwd(**kw):
        q, v, g = kw["q"], kw["v"], kw["g_org"]
        return (torch.ones_like(q), torch.ones_like(q), torch.ones_like(v), torch.ones(v.shape[:-1]),
                torch.ones_like(g), torch.ones(1), torch.ones(1), torch.ones(1))

    monkeypatch.setattr(bwd, "chunk_kda_bwd", chunk_kda_bwd)
    monkeypatch.setattr(kda_fwd, "kda_fwd", lambda q, k, v, g, beta, **kw: (v.clone(), None, None, None))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    x = dict(q=torch.randn(1, 64, 1, 128), k=torch.randn(1, 64, 1, 128), v=torch.randn(1, 64, 1, 128),
             g=torch.randn(1, 64, 1, 128), beta=torch.randn(1, 64, 1))
    for t in x.values():
        t.requires_grad_()
    o, h = _train.chunk(dict(x, A_log=None, dt_bias=None, initial_state=None, scale=None, output_final_state=False,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                             safe_gate=True, lower_bound=-5.0, state_v_first=False, cu_seqlens=None,
                             cu_seqlens_cpu=None))
    assert h is None
    o.sum().backward()
    assert all(t.grad is not None for t in x.values())


@pytest.mark.parametrize("off, expected", [("", "cula-sm90+fla-bwd"), ("kda_fwd_train", "fla-triton")])
def test_grad_inputs_reach_the_train_path_on_a_hopper(monkeypatch, off, expected):
    """Dispatch with the real kda_fwd.supports on a faked sm_90 (CPU tensors posing as CUDA ones): inputs
    that require grad take our forward under FLA's backward (on by default since the GPU cases passed) unless
    turned off. The first GPU run (an H100) found them all handed to FLA: supports() refuses grad-requiring
    inputs (its own path has no backward), and the train path asked it with grad on; the CPU tests had
    replaced supports() by fakes."""
    pytest.importorskip("fla")
    import cula

    fake_sm90(monkeypatch)
    monkeypatch.delenv("CULA_KERNELS", raising=False)
    monkeypatch.setenv("CULA_KERNELS_OFF", off)
    gen = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(1, 130, 2, 128, generator=gen), k=torch.randn(1, 130, 2, 128, generator=gen),
             v=torch.randn(1, 130, 2, 128, generator=gen), g=torch.randn(1, 130, 2, 128, generator=gen),
             beta=torch.randn(1, 130, 2, generator=gen))
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in x.items()}
    x.update(A_log=torch.zeros(2, requires_grad=True), dt_bias=torch.zeros(256, requires_grad=True))
    decision = cula.backends("chunk_kda", **x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                             output_final_state=True)
    assert decision.backend == expected, str(decision)
    if off:
        assert "turned off with CULA_KERNELS_OFF=kda_fwd_train" in str(decision)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("ht", [False, True])
@pytest.mark.parametrize("log_gate", [False, True])
def test_autograd_wiring(monkeypatch, varlen, sigmoid, ht, log_gate):
    """Each gradient reaches its own input through FLA's backward and the l2norm / sigmoid backwards;
    FLA's backward gets our Aqk / Akk, sigmoid(beta), and the raw gate as g_org (it recomputes the cumsum)
    or, for a log-space gate, FLA's chunk-local cumsum of it as g."""
    pytest.importorskip("fla")
    from cula.kda import _train

    from fla.ops.utils import index as fla_index

    rec = _Recorder(monkeypatch)
    B, T, HV = (1, 100, 2) if varlen else (2, 50, 2)
    aqk_made, akk_made = torch.randn(B, T, HV, 64), torch.randn(B, T, HV, 64)
    order = []
    real_indices = fla_index.prepare_chunk_indices

    def indices(*args, **kwargs):
        order.append("chunk_indices")
        return real_indices(*args, **kwargs)

    monkeypatch.setattr(fla_index, "prepare_chunk_indices", indices)

    def fake_kda_fwd(q, k, v, g, beta, **kw):
        order.append("kda_fwd")
        assert kw["fla_factors"] and kw["use_qk_l2norm_in_kernel"] and kw["use_gate_in_kernel"] == (not log_gate)
        state = torch.zeros(2 if varlen else B, HV, 128, 128) if kw["output_final_state"] else None
        return v.clone(), state, aqk_made, akk_made

    monkeypatch.setattr(kda_fwd, "kda_fwd", fake_kda_fwd)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors here
    gen = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(B, T, 1, 128, generator=gen), k=torch.randn(B, T, 1, 128, generator=gen),
             v=torch.randn(B, T, HV, 128, generator=gen), g=torch.randn(B, T, HV, 128, generator=gen),
             beta=torch.randn(B, T, HV, generator=gen), A_log=torch.randn(HV, generator=gen),
             dt_bias=torch.randn(HV * 128, generator=gen),
             initial_state=torch.randn(2 if varlen else B, HV, 128, 128, generator=gen))
    for t in x.values():
        t.requires_grad_()
    inputs = dict(x, scale=None, output_final_state=ht, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=not log_gate, use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=False,
                  safe_gate=True, lower_bound=-5.0,
                  state_v_first=False, cu_seqlens=torch.tensor([0, 30, 100]) if varlen else None,
                  cu_seqlens_cpu=None)
    o, h = _train.chunk(inputs)
    assert (h is not None) == ht
    # FLA's varlen table (a host sync without cu_seqlens_cpu) comes before our launches, as in FLA's own forward
    assert order == (["chunk_indices", "kda_fwd"] if varlen else ["kda_fwd"])
    (o.sum() + (h.sum() if ht else 0)).backward()
    for name, want in dict(q=10.0, k=20.0, v=3.0, g=5.0, beta=400.0 if sigmoid else 4.0, initial_state=6.0,
                           A_log=7.0, dt_bias=8.0).items():
        assert torch.all(x[name].grad == want), name
    kw = rec.bwd_kwargs
    assert kw["Aqk"] is aqk_made and kw["Akk"] is akk_made
    if log_gate:
        assert kw["g"] is rec.g_cumsum and kw["g_org"] is None and not kw["use_gate_in_kernel"]
        assert rec.cumsum_kwargs["chunk_size"] == 64
        assert rec.cumsum_kwargs["scale"] == pytest.approx(1 / math.log(2))  # log2 units, as FLA saves it
    else:
        assert kw["g"] is None and kw["g_org"] is x["g"] and kw["use_gate_in_kernel"]
        assert rec.cumsum_kwargs is None
    assert not kw["disable_recompute"]
    assert kw["scale"] == 128 ** -0.5 and kw["lower_bound"] == -5.0 and kw["safe_gate"]
    assert torch.equal(kw["q"], x["q"].detach() * 0.5)  # the l2norm_fwd output, as FLA saves it
    want_beta = torch.sigmoid(x["beta"].detach()) if sigmoid else x["beta"].detach()
    assert torch.allclose(kw["beta"], want_beta)
    assert (kw["dht"] is not None) == ht
    if varlen:
        assert kw["chunk_indices"].tolist() == [[0, 0], [1, 0], [1, 1]]
    else:
        assert kw["chunk_indices"] is None


# --------------------------------------------------------------------------------------------- GPU


def _gpu_case(B, T, H, HV, cu, seed, lower_bound, sigmoid, h0, v_first, gate="kernel"):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    N = B if cu is None else len(cu) - 1
    x = dict(q=torch.randn(B, T, H, 128, generator=gen), k=torch.randn(B, T, H, 128, generator=gen),
             v=torch.randn(B, T, HV, 128, generator=gen), g=torch.randn(B, T, HV, 128, generator=gen),
             beta=torch.randn(B, T, HV, generator=gen))
    x = {n: t.to(dev, torch.bfloat16) for n, t in x.items()}
    if not sigmoid:
        x["beta"] = torch.sigmoid(x["beta"].float()).to(torch.bfloat16)
    if gate == "log":  # precomputed log-space decays (fp32, as FLA's gate kernels write them), within the bound
        x["g"] = (-torch.rand(B, T, HV, 128, generator=gen) * 3.0).to(dev)
    else:
        x["A_log"] = (torch.randn(HV, generator=gen) * 0.5).to(dev)
        x["dt_bias"] = (torch.randn(HV * 128, generator=gen) * 0.1).to(dev)
    if h0:
        x["initial_state"] = (torch.randn(N, HV, 128, 128, generator=gen) * 0.1).to(dev)
    kw = dict(scale=128 ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=gate == "kernel", use_beta_sigmoid_in_kernel=sigmoid,
              safe_gate=lower_bound is not None or gate == "log", lower_bound=lower_bound,
              state_v_first=v_first, cu_seqlens=None if cu is None else torch.tensor(cu, device=dev))
    return x, kw


#: one definition with the AOT build's (kernels/common/aot_build.py), so the device finds every case precompiled
GPU_CASES = [pytest.param(*case, id=name) for name, case in TRAIN_TEST_CASES.items()]
#: both paths are on by default now (cula.kda._train.SWITCH, kda_fwd.LOG_GATE_VALIDATED); naming them keeps
#: these tests on them if either is switched off again
OPT_IN = "kda_fwd_train,kda_fwd_loggate"


def _gpu_setup(monkeypatch, B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate):
    """Skip without CUDA or FLA, opt in to the paths under test, and build the case: ``(x, kw, leaves)``,
    the leaves fresh copies of x requiring grad."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    monkeypatch.setenv("CULA_KERNELS", OPT_IN)
    monkeypatch.delenv("CULA_KERNELS_OFF", raising=False)
    x, kw = _gpu_case(B, T, H, HV, cu, 0, lb, sigmoid, h0, v_first, gate)
    return x, kw, {n: t.detach().clone().requires_grad_() for n, t in x.items()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(fn, x, kw, do, dht):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(**leaves, **kw)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    return o.detach(), ht.detach(), {n: t.grad for n, t in leaves.items()}


@gpu
@pytest.mark.parametrize("B,T,H,HV,cu,lb,sigmoid,h0,v_first,gate", GPU_CASES)
def test_gpu_gradients_match_fla(B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate, monkeypatch):
    """Gradients of every input through cula (our forward, FLA's backward) against FLA's chunk_kda and
    the fp64 reference's autograd. Tolerance: our error against fp64 within 1.5x FLA's own (+1e-3): the
    backward is FLA's code, fed our bf16 Aqk / Akk instead of FLA's (two bf16 roundings of the same
    quantities), so the errors are of one size; o and the final state within
    1e-2 of the inference path's (which forms u in stage 2) and as close to fp64 as FLA's."""
    x, kw, leaves = _gpu_setup(monkeypatch, B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate)
    import cula
    from cula._dispatch import CULA_SM90_FLA_BWD
    from cula.kda import chunk_kda
    from cula.ref import kda as ref
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    assert cula.backends("chunk_kda", **leaves, **kw).backend == CULA_SM90_FLA_BWD
    gen = torch.Generator().manual_seed(1)
    o_shape = (B, T, HV, 128)
    do = torch.randn(o_shape, generator=gen).cuda()
    N = B if cu is None else len(cu) - 1
    dht = torch.randn(N, HV, 128, 128, generator=gen).cuda()
    o_c, ht_c, g_c = _run(chunk_kda, x, kw, do, dht)
    o_f, ht_f, g_f = _run(fla_chunk_kda, x, kw, do, dht)
    x64 = {n: t.double() for n, t in x.items()}
    o_r, ht_r, g_r = _run(lambda **a: ref.recurrent(**a, dtype=torch.float64), x64, kw, do.double(), dht.double())
    with torch.no_grad():  # the inference path on the same inputs (u formed in stage 2, not stage 1: not bitwise)
        o_i, ht_i = chunk_kda(**x, **kw)
    # 1e-2 norm-relative is ~5 bf16 unit roundoffs: the two stage pairs round u / T' differently, nothing more
    assert _rel(o_c, o_i) <= 1e-2 and _rel(ht_c, ht_i) <= 1e-2, (_rel(o_c, o_i), _rel(ht_c, ht_i))
    assert _rel(o_c, o_r) <= 1.5 * _rel(o_f, o_r) + 1e-3 and _rel(ht_c, ht_r) <= 1.5 * _rel(ht_f, ht_r) + 1e-3
    report = []
    for name in g_r:
        ours, fla = _rel(g_c[name], g_r[name]), _rel(g_f[name], g_r[name])
        report.append(f"{name}: cula {ours:.2e} fla {fla:.2e}")
        assert torch.isfinite(g_c[name]).all(), name
        assert ours <= 1.5 * fla + 1e-3, "; ".join(report)
    print("; ".join(report))


@gpu
@pytest.mark.parametrize("B,T,H,HV,cu,lb,sigmoid,h0,v_first,gate", GPU_CASES[:2] + GPU_CASES[-1:])
def test_gpu_saved_factors_match_flas(B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate, monkeypatch):
    """The Aqk / Akk our forward saves against the ones FLA's forward saves (its autograd node's saved
    tensors 11 and 12): the same quantities in bf16, so within a few bf16 ulps of each other (norm-relative
    2e-2; Aqk compared on and below the diagonal, FLA leaves the rest of its buffer unwritten)."""
    x, kw, leaves = _gpu_setup(monkeypatch, B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate)
    from cula.kda import chunk_kda
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    o_c, _ = chunk_kda(**leaves, **kw)
    o_f, _ = fla_chunk_kda(**leaves, **kw)
    ours = o_c.grad_fn.saved_tensors
    theirs = o_f.grad_fn.saved_tensors
    aqk_c, akk_c = ours[11], ours[12]
    aqk_f, akk_f = theirs[11], theirs[12]
    assert aqk_c.shape == aqk_f.shape and akk_c.shape == akk_f.shape
    TT = B * T
    pos = (torch.arange(TT, device="cuda") % T) if cu is None else _local_positions(kw["cu_seqlens"], TT)
    lower = (torch.arange(64, device="cuda")[None, :] <= (pos % 64)[:, None])  # [TT, 64]: j <= i in the chunk
    mask = lower.reshape(B, T, 1, 64)
    assert _rel(torch.where(mask, aqk_c.float(), 0.0), torch.where(mask, aqk_f.float(), 0.0)) < 2e-2
    assert _rel(akk_c.float(), akk_f.float()) < 2e-2
    assert torch.all(torch.where(mask, 0.0, akk_c.float()) == 0)  # unit lower triangular, zero above


def _local_positions(cu: torch.Tensor, total: int) -> torch.Tensor:
    cu = cu.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[seq]

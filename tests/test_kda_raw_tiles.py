"""The planned stage-2 transform ("raw tiles", kernels/sm90/kda_fwd_raw_tiles.py): qg, X and kg from q, k, g by
running products down each half of a chunk's key columns, against stage 1's exp2 of the cumulative gate (its torch
model, kda_fwd_intra_tc.emulate) and against the exact stages in fp64."""

import pytest
import torch

from cula.kernels.sm90 import kda_fwd
from cula.kernels.sm90 import kda_fwd_intra_tc as tc
from cula.kernels.sm90 import kda_fwd_raw_tiles as raw

CASES = [  # B, T, H, HV, cu_seqlens, lower_bound (None: FLA's softplus gate, clamped), A_log scale, log-space gate
    pytest.param(1, 300, 1, 2, None, -5.0, 0.5, False, id="lb5-fixed"),
    pytest.param(1, 200, 1, 2, [0, 0, 15, 79, 200], -5.0, 3.0, False, id="lb5-saturated-varlen"),
    pytest.param(1, 130, 2, 2, None, -11.0, 3.0, False, id="lb11-saturated"),
    pytest.param(1, 130, 1, 1, None, -0.1, 0.5, False, id="lb01"),
    pytest.param(1, 200, 1, 2, [0, 0, 15, 79, 200], None, 3.0, False, id="softplus-varlen"),
    # g read as the log-space decay (safe_gate), clamped to [lb, 0]: no exact-stage comparison (those apply the
    # in-kernel gate to the same g)
    pytest.param(1, 200, 1, 2, [0, 0, 15, 79, 200], -5.0, 0.5, True, id="loggate-varlen"),
]


def _inputs(B, T, H, HV, cu, lb, a_scale):
    from tests.test_kernel_kda_fwd import _case

    args, kw = _case(B, T, H, HV, cu, seed=T + 7, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=lb,
                     safe_gate=lb is not None)
    kw["A_log"] = kw["A_log"] / 0.5 * a_scale
    return args, kw


@pytest.mark.parametrize("B,T,H,HV,cu,lb,a_scale,log_gate", CASES)
def test_raw_tiles_match_stage_one_within_one_bf16_step(B, T, H, HV, cu, lb, a_scale, log_gate):
    """The products give stage 1's bf16 tiles bitwise for nearly every element and within one bf16 step for the
    rest (2^Γ by products drifts ~1e-6 relative from exp2 of the fp32 cumsum: only values at a rounding boundary
    move); and they are as close to the exact fp64 stages as stage 1's tiles are."""
    args, kw = _inputs(B, T, H, HV, cu, lb, a_scale)
    qf, kf, vf, gf, bf = kda_fwd._flatten(*args)
    cu_t = kw["cu_seqlens"] if kw["cu_seqlens"] is not None else kda_fwd._fixed_cu_seqlens(B, T, qf.device)
    chunks, _, _ = kda_fwd.chunk_tables(cu_t)
    bound = tc.SOFTPLUS_FLOOR if lb is None else lb
    q16, k16, v16, g16, b16 = (x.bfloat16() for x in (qf, kf, vf, gf, bf))
    model = tc.emulate(q16, k16, v16, g16, b16, chunks, 128 ** -0.5, bound, kw["A_log"], kw["dt_bias"],
                       use_qk_l2norm=True, use_beta_sigmoid=True, softplus_gate=lb is None, log_gate=log_gate)
    _, _, exact = kda_fwd.emulate_stages(*args, **kw, dtype=torch.float64)

    rows = torch.arange(tc.CHUNK)
    keep = rows[None] < chunks[:, 1:].long()  # [NC, 64]
    idx = chunks[:, :1].long() + torch.minimum(rows[None], chunks[:, 1:].long() - 1)

    def gather(x):  # [TT, h, D] -> [NC, HV, 64, D]
        x = x[idx].transpose(1, 2)
        return x.repeat_interleave(HV // x.shape[1], 1)

    a = kw["A_log"].float().exp()[None, :].expand(chunks.shape[0], HV)
    dtb = kw["dt_bias"].float().reshape(HV, -1)[None].expand(chunks.shape[0], HV, -1)
    tiles = raw.raw_tiles(gather(q16), gather(k16), gather(g16), keep[:, None].expand(-1, HV, -1), 128 ** -0.5,
                          bound, a, dtb, softplus_gate=lb is None, log_gate=log_gate)

    def rows_of(x):  # [NC, HV, 64, D] -> [HV, NC*64, D], as stage 1 stores them
        return x.permute(1, 0, 2, 3).reshape(HV, -1, x.shape[-1])

    ours = dict(qg=rows_of(tiles["qg"]), kgt=rows_of(tiles["kg"]).transpose(1, 2), gam=tiles["gam"].permute(1, 0, 2))
    for name in ("qg", "kgt", "gam"):
        o, s, e = ours[name].double(), model[name].double(), exact[name].double()
        assert torch.isfinite(o).all(), name
        step = 2.0 ** -7 if name != "gam" else 1e-5  # bf16's step at the larger of the two (fp32 for γ)
        tol = step * torch.maximum(o.abs(), s.abs()) + 1e-30
        assert ((o - s).abs() <= tol).all(), (name, ((o - s).abs() / tol).max().item())
        if name != "gam":
            assert (o == s).double().mean() > 0.99, (name, (o == s).double().mean().item())
        if log_gate:
            continue
        err_ours = ((o - e).norm() / e.norm()).item()
        err_stage1 = ((s - e).norm() / e.norm()).item()
        assert err_ours <= 1.05 * err_stage1 + 1e-6, (name, err_ours, err_stage1)
    # X (stage 1 stores -X, formed in x_out's phase 2) has no stage-1 output here: against k̂ ⊙ 2^Γ in fp64
    gl = tc.gate_log2(gather(g16).double(), bound, a.double()[..., None, None], dtb.double()[..., None, :],
                      lb is None, log_gate)
    gam = torch.cumsum(gl * keep[:, None, :, None], 2)
    kk = gather(k16).double() * keep[:, None, :, None]
    x_exact = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + tc.L2NORM_EPS) * torch.exp2(gam)
    x = tiles["x"].double()
    assert ((x - x_exact).abs() <= 2.0 ** -8 * x_exact.abs() + 1e-30).all()


def test_half_products_are_the_prefix_and_suffix_products():
    """The two-half scheme against cumulative products in fp64; and a planted error in one half's total (the one
    value the halves exchange) is caught."""
    torch.manual_seed(1)
    e = torch.exp2(-3 * torch.rand(5, 64, 8))
    pre, suf = raw.half_products(e)
    ref_pre = torch.cumprod(e.double(), 1)
    ref_suf = torch.flip(torch.cumprod(torch.flip(e.double(), [1]), 1), [1]) / e.double()
    assert torch.allclose(pre.double(), ref_pre, rtol=1e-6, atol=0)
    assert torch.allclose(suf.double(), ref_suf, rtol=1e-6, atol=0)
    bad = e.clone()
    bad[:, raw.HALF] *= 1.001  # the lower half's first factor: every upper-half suffix depends on it
    _, suf_bad = raw.half_products(bad)
    assert not torch.allclose(suf_bad[:, : raw.HALF].double(), ref_suf[:, : raw.HALF], rtol=1e-6, atol=0)


# ------------------------------------------------------------------------ the DSL form, under the CPU emulator
PROBE_CASES = [  # gate, valid rows, lower bound, A_log scale
    pytest.param("sigmoid", 64, -5.0, 0.5, id="sigmoid-full"),
    pytest.param("sigmoid", 37, -5.0, 3.0, id="sigmoid-partial-saturated"),
    pytest.param("softplus", 64, tc.SOFTPLUS_FLOOR, 3.0, id="softplus-full"),
    pytest.param("log", 1, -5.0, 0.5, id="log-one-row"),
    pytest.param("log", 50, -5.0, 0.5, id="log-partial"),
]


def _probe_inputs(gate, nvalid, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(raw.CHUNK, raw.DK, generator=g).bfloat16()
    k = torch.randn(raw.CHUNK, raw.DK, generator=g).bfloat16()
    if gate == "log":  # a log-space decay, some of it below the bound (clamped)
        gate_in = (-7 * torch.rand(raw.CHUNK, raw.DK, generator=g)).bfloat16()
    else:
        gate_in = torch.randn(raw.CHUNK, raw.DK, generator=g).bfloat16()
    dtb = 0.5 * torch.randn(raw.DK, generator=g)
    a_log = torch.randn(1, generator=g)
    return q, k, gate_in, dtb, a_log


def _model_norms(q, k, keep, scale):
    """The torch model's inverse row norms (rows outside ``keep`` zeroed first), as the probe takes them."""
    kf = keep[:, None].float()
    qf, kf_ = q.float() * kf, k.float() * kf
    nq = (scale * torch.rsqrt((qf * qf).sum(-1) + raw.L2NORM_EPS)).contiguous()
    nk = torch.rsqrt((kf_ * kf_).sum(-1) + raw.L2NORM_EPS).contiguous()
    return nq, nk


def _emulate_probe(gate, q, k, gate_in, nq, nk, dtb, a, nvalid, lb):
    """RawTilesProbe's source run on the CPU emulator: its qg, -X and kg ([64, 128] bf16)."""
    import _dsl_emulator as emu
    from collections import namedtuple

    import cutlass

    out = {n: torch.full((raw.CHUNK, raw.DK), float("nan"), dtype=torch.bfloat16) for n in ("qg", "x", "kg")}
    tensors = [q.contiguous(), k.contiguous(), gate_in.contiguous(), nq, nk, dtb.contiguous(), *out.values()]
    mem = emu.Memory()
    mem.register(*tensors)
    Spec = namedtuple("Spec", "kind dtype")
    dts = [cutlass.BFloat16] * 3 + [cutlass.Float32] * 3 + [cutlass.BFloat16] * 3
    specs = [Spec("ptr", dt) for dt in dts] + [Spec("i32", None), Spec("f32", None), Spec("f32", None)]
    ptrs, backs = mem.pointers(specs, [t.data_ptr() for t in tensors] + [nvalid, float(a), lb])
    probe = raw.RawTilesProbe(gate)
    inst = emu.emulated_instance(probe, {})
    inst.t = emu.emulated_instance(probe.t, {}, kernel_name=None)
    inst(*ptrs, None)
    emu.Memory.write_back(backs)
    return out


@pytest.mark.parametrize("gate,nvalid,lb,a_scale", PROBE_CASES)
def test_dsl_transform_matches_the_model(gate, nvalid, lb, a_scale):
    """RawTiles' own source on one chunk (the probe kernel, emulated: exact exp2 / rcp / log2 where the GPU's are
    approximate) against the torch model: within one bf16 step everywhere and bitwise for nearly every element;
    rows past ``nvalid`` are zero, whatever q, k and g hold there (Inf here). The model's inverse norms are the probe's
    input (stage 1 built with raw_out writes them)."""
    pytest.importorskip("cutlass")
    q, k, gate_in, dtb, a_log = _probe_inputs(gate, nvalid, seed=nvalid)
    a = (a_log * a_scale).exp().float()
    keep = torch.arange(raw.CHUNK) < nvalid
    scale = raw.DK ** -0.5
    want = raw.raw_tiles(q[None], k[None], gate_in[None], keep[None], scale, lb, a, dtb[None],
                         softplus_gate=gate == "softplus", log_gate=gate == "log")
    norms = _model_norms(q, k, keep, scale)
    for x in (q, k, gate_in):  # past the end: the next sequence's tokens, Inf included (a product would be NaN)
        x[nvalid:] = float("inf")
    out = _emulate_probe(gate, q, k, gate_in, *norms, dtb, a, nvalid, lb)

    for name, sign in (("qg", 1), ("x", -1), ("kg", 1)):
        got, ref = out[name].double(), sign * want[name][0].double()
        assert torch.isfinite(got).all(), name
        assert (got[nvalid:] == 0).all(), name
        tol = 2.0 ** -7 * torch.maximum(got.abs(), ref.abs()) + 1e-30
        assert ((got - ref).abs() <= tol).all(), (name, ((got - ref).abs() / tol).max().item())
        assert (got == ref).double().mean() > 0.99, (name, (got == ref).double().mean().item())


def test_dsl_transform_catches_a_wrong_exchange(monkeypatch):
    """The comparison above can fail: with the halves' totals not exchanged (each half alone), the lower half's
    prefixes and the upper half's suffixes are wrong and the probe's tiles leave the model's step."""
    pytest.importorskip("cutlass")
    import _dsl_emulator as emu

    q, k, gate_in, dtb, a_log = _probe_inputs("sigmoid", 64, seed=3)
    a = a_log.exp().float()
    keep = torch.ones(raw.CHUNK, dtype=torch.bool)
    scale = raw.DK ** -0.5
    want = raw.raw_tiles(q[None], k[None], gate_in[None], keep[None], scale, -5.0, a, dtb[None])

    def no_exchange(x, offset, mask=-1, mask_and_clamp=31):  # each half gets its own total back
        return x

    monkeypatch.setattr(emu.cute.arch, "shuffle_sync_bfly", no_exchange)
    out = _emulate_probe("sigmoid", q, k, gate_in, *_model_norms(q, k, keep, scale), dtb, a, 64, -5.0)
    got, ref = out["qg"].double(), want["qg"][0].double()
    tol = 2.0 ** -7 * torch.maximum(got.abs(), ref.abs()) + 1e-30
    assert not ((got - ref).abs() <= tol).all()


@pytest.mark.parametrize("target", ["probe_sigmoid", "probe_softplus", "probe_log"])
def test_probe_compiles_without_spills_at_the_planned_mufu_count(target):
    """The transform (in its probe) compiles to sm_90a without spills or local memory, within the registers a
    256-thread CTA leaves each thread, at the MUFU count of the design: per thread 64 elements, each one exp2 of
    the factor plus the gate's own (sigmoid: exp2 and rcp; softplus: exp2 and log2; log-space: none)."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report

    rep = ptx_report("cula.kernels.sm90.kda_fwd_raw_tiles", target)
    assert rep.spill_bytes == 0 and ".local" not in rep.ptx and rep.max_registers <= 255
    n = raw.HALF * raw.PAIR
    gate = target.removeprefix("probe_")
    assert rep.count("ex2.approx") == {"sigmoid": 2 * n, "softplus": 2 * n, "log": n}[gate]
    assert rep.count("rcp.approx") == (n if gate == "sigmoid" else 0)
    assert rep.count("lg2.approx") == (n if gate == "softplus" else 0)


def test_the_transform_uses_stage_ones_constants():
    """kda_fwd_raw_tiles keeps its own copies of stage 1's constants (an import would be circular): equal."""
    for name in ("CHUNK", "DK", "L2NORM_EPS", "RCP_LN2", "LOG2E", "SOFTPLUS_THRESHOLD"):
        assert getattr(raw, name) == getattr(tc, name), name


# ---------------------------------------------------------------------- stage 2 with the raw tiles (KdaFwdRecurRaw)
def test_pack_aqk_tp_inverts_unpack():
    """pack_aqk_tp is the inverse of kda_fwd.unpack_aqk_tp on stage 1's shapes (Aqk and T' lower triangular,
    diagonals included)."""
    from cula.kernels.sm90 import kda_fwd_recur as recur

    torch.manual_seed(2)
    HV, NC = 2, 3
    aqk = torch.randn(HV, NC, 64, 64).tril().bfloat16().reshape(HV, NC * 64, 64)
    tp = torch.randn(HV, NC, 64, 64).tril().bfloat16().reshape(HV, NC * 64, 64)
    gam = torch.rand(HV, NC, 128)
    packed, rows = recur.pack_aqk_tp(aqk, tp, gam)
    assert packed.shape == (HV, NC * 64, 64) and rows.shape == (HV, NC, 128 + 32)
    back = kda_fwd.unpack_aqk_tp(packed, rows, 128)
    assert torch.equal(back["aqk"], aqk) and torch.equal(back["tp"], tp) and torch.equal(back["gam"], gam)


def test_raw_norms_are_the_rows_inverse_norms():
    """raw_norms' [HV, NC, 2, 64] layout: chunk c's row r is token chunks[c, 0] + r (its q head, repeated over the
    value heads of its group), zero past the chunk's end."""
    from cula.kernels.sm90 import kda_fwd_recur as recur

    torch.manual_seed(0)
    q, k = torch.randn(200, 1, 128), torch.randn(200, 1, 128)
    chunks, _, _ = kda_fwd.chunk_tables(torch.tensor([0, 0, 15, 79, 200]))
    n = recur.raw_norms(q, k, chunks, 2, 0.25)
    assert n.shape == (2, chunks.shape[0], 2, 64)
    c, r = 2, 10  # the third chunk (the 64 tokens from 79), row 10: token 89
    tok = int(chunks[c, 0]) + r
    assert torch.allclose(n[1, c, 0, r], 0.25 / q[tok, 0].norm(), rtol=1e-5)
    assert torch.allclose(n[0, c, 1, r], 1 / k[tok, 0].norm(), rtol=1e-5)
    assert (n[:, 0, :, 15:] == 0).all()  # the second sequence's one chunk holds 15 tokens


@pytest.mark.parametrize("target", ["recur_v2_t_in_pack_x_raw_sigmoid", "recur_v2_t_in_pack_x_raw_softplus",
                                    "recur_v2_t_in_pack_x_raw_log", "recur_v2_t_in_x_raw_sigmoid"])
def test_ptx_raw_stage_2(target):
    """The raw-tile stage 2 against its default (w in stage 2, same packing): the same wgmma (none more for the
    transform) and the same bulk tensor copies (k, q, g where -X, qg, kgᵀ were) but one; three warpgroups whose
    registers setmaxnreg moves to the math one; the transform's MUFU (one exp2 a factor, the gate's own) and its
    halves' shuffle; no spills or local memory."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_report

    base = "recur_v2_t_in_pack_x_words" if "pack" in target else "recur_v2_t_in_x"  # (raw takes the word mask)
    rep, ref = ptx_report("cula.kernels.sm90.kda_fwd", target), ptx_report("cula.kernels.sm90.kda_fwd", base)
    assert rep.spill_bytes == 0 and ".local" not in rep.ptx
    assert rep.count("wgmma.mma_async") == ref.count("wgmma.mma_async")
    # g's box is two copies (a token's 128 keys are 256 bytes: two 128-byte-swizzle boxes), kgᵀ's one (64 tokens)
    assert rep.count("cp.async.bulk.tensor") == ref.count("cp.async.bulk.tensor") + 1
    # the math and transform warpgroups raise theirs above the launch's 168 (a decrease there is an illegal
    # instruction: H100, session 39), the TMA warp and its warpgroup's idle warps lower theirs
    assert rep.count("setmaxnreg.inc") == 2 and rep.count("setmaxnreg.dec") == 2
    assert rep.count("setmaxnreg.inc.sync.aligned.u32 224") == 2
    assert rep.count("setmaxnreg.dec.sync.aligned.u32 56") == 2
    assert ".reqntid 384" in rep.ptx
    n = raw.HALF * raw.PAIR  # a transform thread's elements
    gate = target.rsplit("_", 1)[1]
    # (and exp(A_log) once an item, except for the log-space gate)
    assert rep.count("ex2.approx") - ref.count("ex2.approx") == {"sigmoid": 2 * n + 1, "softplus": 2 * n + 1,
                                                                 "log": n}[gate]
    assert rep.count("shfl.sync.bfly") - ref.count("shfl.sync.bfly") == raw.PAIR


def _raw_case(dev, T, cu, H=1, HV=2, seed=5):
    from tests.test_kernel_kda_fwd import _case

    args, kw = _case(1, T, H, HV, cu, seed, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    args = tuple(x.to(dev).bfloat16() for x in args)
    kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    return args, kw


def _run_raw(args, kw, scr, pack=False):
    from cula.kernels.sm90 import kda_fwd_recur as recur

    q, k, v, g, _ = (x[0] for x in args)
    cu = kw["cu_seqlens"] if kw["cu_seqlens"] is not None else kda_fwd._fixed_cu_seqlens(1, q.shape[0], q.device)
    chunks, seqs, _ = kda_fwd.chunk_tables(cu)
    HV = g.shape[1]
    norms = recur.raw_norms(q, k, chunks, HV, 128 ** -0.5)
    rows, gam = torch.cat([scr["aqk"], scr["tp"]], -1), scr["gam"]
    if pack:
        rows, gam = recur.pack_aqk_tp(scr["aqk"], scr["tp"], scr["gam"])
    o, ht = recur.run_raw(q, k, g, v, norms, kw["A_log"], kw["dt_bias"], rows, gam, chunks, seqs,
                          kw["initial_state"], True, "sigmoid", -5.0, pack=pack, max_ctas=5)
    return o[None], ht


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("T,cu", [(300, None), (300, [0, 0, 15, 79, 200, 300]), (1, None)],
                         ids=["fixed-T300", "varlen-zero", "T1"])
def test_gpu_raw_stage_2_matches_the_default(T, cu, pack, monkeypatch):
    """Stage 2 forming qg, -X and kg from q, k, g on the default stage 1's [Aqk | T'] and γ (unpacked, or packed
    again as stage 1 packs them; GVA group 2, five persistent CTAs walking every item) gives o and the final state
    of the default two stages within 1e-2
    (the tiles differ from stage 1's by one bf16 step at ~0.03% of elements: the products against exp2 of the
    cumulative gate), and is bitwise deterministic."""
    dev = torch.device("cuda")
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", "0")
    args, kw = _raw_case(dev, T, cu)
    o_d, ht_d, scr = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    o, ht = _run_raw(args, kw, scr, pack)
    o2, ht2 = _run_raw(args, kw, scr, pack)
    torch.cuda.synchronize()
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel(o, o_d) < 1e-2 and rel(ht, ht_d) < 1e-2, (rel(o, o_d), rel(ht, ht_d))
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
def test_gpu_raw_stage_2_ignores_the_next_sequence():
    """A partial chunk's rows past its sequence's end hold the next sequence's q, k, g (TMA reads them): an Inf
    planted there changes nothing, bitwise, in the first sequence's o and final state."""
    dev = torch.device("cuda")
    args, kw = _raw_case(dev, 200, [0, 100, 200])
    o_d, ht_d, scr = kda_fwd.kda_fwd(*args, **kw, return_scratch=True)
    o, ht = _run_raw(args, kw, scr)
    bad = tuple(x.clone() for x in args)
    for x in (bad[0], bad[1], bad[3]):
        x[0, 100:110] = float("inf")
    o_b, ht_b = _run_raw(bad, kw, scr)
    torch.cuda.synchronize()
    assert torch.equal(o_b[:, :100], o[:, :100]) and torch.equal(ht_b[0], ht[0])


# ---------------------------------------------------------------------- stage 1 handing over the norms (raw_out)
def test_raw_out_needs_w_in_stage_2_and_the_l2norm():
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    with pytest.raises(ValueError, match="raw_out"):
        intra_tc.KdaFwdIntraTC(True, True, True, True, False, 1, t_out=True, raw_out=True)  # no x_out
    with pytest.raises(ValueError, match="use_qk_l2norm"):
        intra_tc.KdaFwdIntraTC(False, True, True, True, False, 1, t_out=True, x_out=True, raw_out=True)


@pytest.mark.parametrize("target, base", [
    ("intra_tc_t_out_block32_pack_x_ctas3_raw", "intra_tc_t_out_block32_pack_x_ctas3"),
    ("intra_tc_t_out_block32_x_ctas3_raw", "intra_tc_t_out_block32_x_ctas3")])
def test_ptx_raw_out_stage_1_is_leaner(target, base):
    """Stage 1 for the raw tiles (the three-CTA defaults, packed and unpacked): qg, kgᵀ and -X neither stored nor
    (kgᵀ) formed; the rows' norms leave as two 32-byte vectors a half-warp; no spills, within the 168 registers of
    three CTAs; the same products (wgmma) and bulk copies; fewer exp2 (kgᵀ's factors) and fp32 multiplies; and
    (where ptxas and cuobjdump are at hand) at least 500 SASS instructions a thread fewer (session 39: 4,800 →
    4,080 packed, 4,544 → 3,912 unpacked)."""
    pytest.importorskip("cutlass")
    from cula.kernels.common import sass
    from cula.kernels.common.ptx_check import ptx_report

    rep, ref = ptx_report("cula.kernels.sm90.kda_fwd", target), ptx_report("cula.kernels.sm90.kda_fwd", base)
    assert rep.spill_bytes == 0 and ".local" not in rep.ptx and rep.max_registers <= 168
    assert rep.count("wgmma.mma_async") == ref.count("wgmma.mma_async")
    assert rep.count("cp.async.bulk.tensor") == ref.count("cp.async.bulk.tensor")
    assert rep.count("st.global") <= ref.count("st.global") - 10
    assert rep.count("st.global.v4.f32") >= ref.count("st.global.v4.f32") + 4  # the norms (2 x 2 x 16 B)
    assert rep.count("ex2.approx") < ref.count("ex2.approx")
    assert rep.count("mul.f32") <= ref.count("mul.f32") - 256
    if sass.find_cuobjdump() and __import__("shutil").which("ptxas"):
        n_rep, n_ref = (len(sass.parse(sass.sass_of(r.ptx))) for r in (rep, ref))
        assert n_rep <= n_ref - 500, (n_rep, n_ref)


# ---------------------------------------------------------------------- kda_fwd with the raw tiles (RAW_TILES)
@pytest.mark.parametrize("pack", ["0", "1"], ids=["unpacked", "packed"])
def test_host_path_raw_tiles(monkeypatch, pack):
    """CULA_KDA_RAW_TILES: stage 1 compiles with raw_out and writes the norms through its kgᵀ pointer into a
    [HV, NC, 2, 64] fp32 buffer (its qg and w pointers the same buffer, never written); stage 2 is the raw-tile
    kernel reading the caller's k, q, g, that buffer, A_log and dt_bias, the [Aqk | T'] rows and γ stage 1 wrote,
    v, with the group and the lower bound; off (the default), neither key changes. The SIMT stage 1 never takes it."""
    pytest.importorskip("cutlass")
    from _kda_host import record_kda_launches

    from tests.test_kernel_kda_fwd import _case

    calls = record_kda_launches(monkeypatch)
    monkeypatch.setattr(kda_fwd, "U_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "W_IN_RECUR", True)
    monkeypatch.setattr(kda_fwd, "PACK", pack)
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0, safe_gate=True)
    args, kw = _case(1, 600, 1, 2, None, seed=2, **flags)  # 10 chunks, GVA group 2
    args = tuple(x.bfloat16() for x in args)
    kda_fwd.kda_fwd(*args, **kw)
    (_, key1d, _, _), (kind2d, key2d, _, _) = calls
    assert kind2d == "recur" and "raw_out" not in dict(key1d[0])
    calls.clear()
    monkeypatch.setattr(kda_fwd, "RAW_TILES", True)
    kda_fwd.kda_fwd(*args, **kw)
    (kind1, key1, _, v1), (kind2, key2, specs2, v2) = calls
    assert kind1 == "intra_tc" and dict(key1[0])["raw_out"] is True
    assert kind2 == "recur_raw" and key2[2] == "sigmoid" and "t_in" not in dict(key2[0])
    assert dict(key2[0]).get("pack", False) == (pack == "1")
    q, k, v, g, _ = args
    nrm_ptr = v1[12]  # stage 1's kgᵀ pointer
    assert v1[8] == v1[10] == nrm_ptr  # w and qg: the same buffer
    assert v2[:4] == (k.data_ptr(), q.data_ptr(), g.data_ptr(), nrm_ptr)
    assert v2[4] == kw["A_log"].data_ptr() and v2[5] == kw["dt_bias"].data_ptr()
    assert v2[6] == v1[11] and v2[8] == v1[13]  # [Aqk | T'] and γ as stage 1 wrote them
    assert v2[7] == v.data_ptr()
    assert v2[-3:-1] == (2, -5.0) and len(v2) == len(specs2)
    calls.clear()
    kda_fwd.kda_fwd(*args, **{**kw, "use_qk_l2norm_in_kernel": False})  # the SIMT stage 1
    assert [c[0] for c in calls] == ["intra", "recur"]


@pytest.mark.gpu
@pytest.mark.parametrize("T,cu", [(300, None), (300, [0, 0, 15, 79, 200, 300]), (1000, [0, 1, 1000])],
                         ids=["fixed-T300", "varlen-zero", "varlen-1-999"])
def test_gpu_raw_tiles_pipeline_matches_the_default(T, cu, monkeypatch):
    """kda_fwd with the raw tiles (stage 1 writing the norms, stage 2 forming the tiles) gives o and the final state
    of the default within 1e-2 (the products against exp2 of the cumulative gate: one bf16 step at ~0.03% of the
    tiles' elements), bitwise on a rerun; packed and unpacked as the default picks."""
    dev = torch.device("cuda")
    args, kw = _raw_case(dev, T, cu)
    o_d, ht_d = kda_fwd.kda_fwd(*args, **kw)
    monkeypatch.setattr(kda_fwd, "RAW_TILES", True)
    o, ht = kda_fwd.kda_fwd(*args, **kw)
    o2, ht2 = kda_fwd.kda_fwd(*args, **kw)
    torch.cuda.synchronize()
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
    assert rel(o, o_d) < 1e-2 and rel(ht, ht_d) < 1e-2, (rel(o, o_d), rel(ht, ht_d))
    assert torch.equal(o, o2) and torch.equal(ht, ht2)

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

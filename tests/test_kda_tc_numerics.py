"""Numerics of the planned tensor-core form of KDA's intra-chunk products (kernels/sm90/kda_fwd.md,
"Next steps" 3), checked in torch before any kernel is written.

Plan: within a 64-token chunk, split rows into 16-token blocks; for each block pair (I, J) with J ≤ I
factor the per-dimension decay around the log2-gate cumsum Γ at the first row r of block I:

    A[i, j] = Σ_d (x_id 2^(Γ_id − Γ_rd)) · (k_jd 2^(Γ_rd − Γ_jd))      (x = q for Aqk, k for Akk)

and feed both factors to the tensor cores as bf16 with fp32 accumulation. The left factor is ≤ 1.
The right one is ≤ 1 off the diagonal (j < r); on the diagonal block it grows up to 2^(15·|g|max)
for the masked (j > i) entries — finite in bf16/fp32 (max 2^127) while the per-token log2 gate stays
above −127/15 ≈ −8.4, which safe_gate's lower bound −5 (natural log: −7.2 in log2) guarantees. The
tests measure the resulting error against fp64 and show the overflow the plan must avoid without it.
"""

from __future__ import annotations

import math

import pytest
import torch

from cula.ref._gates import decay_gate, l2norm

C, SUB, D = 64, 16, 128


def _chunk(lower_bound, seed=0, strength=1.0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(C, D, generator=g, dtype=torch.float64))
    k = l2norm(torch.randn(C, D, generator=g, dtype=torch.float64))
    raw = torch.randn(C, 1, D, generator=g, dtype=torch.float64) * strength
    a_log = torch.zeros(1, dtype=torch.float64)
    gate = decay_gate(raw, a_log, None, lower_bound)[:, 0] / math.log(2.0)  # log2 units
    return q, k, gate.cumsum(0)


def exact(x, k, G, strict):
    """fp64 A[i, j] = Σ_d x_id k_jd 2^(G_id − G_jd) on the causal entries."""
    diff = G[:, None, :] - G[None, :, :]
    mask = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    dec = torch.where(mask[..., None], diff, torch.full_like(diff, -math.inf)).exp2()
    return torch.einsum("id,jd,ijd->ij", x, k, dec)


def factorised_bf16(x, k, G, strict):
    """The planned tensor-core form: bf16 factors per 16-row block, fp32 accumulation, causal mask."""
    out = torch.zeros(C, C, dtype=torch.float32)
    for bi in range(C // SUB):
        rows = slice(bi * SUB, (bi + 1) * SUB)
        ref = G[bi * SUB]
        left = (x[rows] * (G[rows] - ref).exp2()).to(torch.bfloat16).float()
        cols = slice(0, (bi + 1) * SUB)  # blocks J <= I
        right = (k[cols] * (ref - G[cols]).exp2()).to(torch.bfloat16).float()
        out[rows, cols] = left @ right.T
    mask = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    return torch.where(mask, out, torch.zeros_like(out))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("strength", [1.0, 4.0])
def test_safe_gate_factorisation_is_finite_and_bf16_accurate(seed, strength):
    q, k, G = _chunk(lower_bound=-5.0, seed=seed, strength=strength)
    for x, strict in ((q, False), (k, True)):
        want = exact(x, k, G, strict)
        got = factorised_bf16(x, k, G, strict)
        assert torch.isfinite(got).all()
        err = float((got.double() - want).norm() / want.norm())
        # two bf16 roundings per term (2^-9 each) over ~128-term sums of mixed signs: measured
        # 1.9-2.6e-3 on these cases, the bf16 level FLA's Aqk already has (it stores Aqk in bf16)
        assert err < 1e-2, err


def test_lower_bound_five_keeps_every_factor_in_range():
    q, k, G = _chunk(lower_bound=-5.0, strength=50.0)  # saturated gates: every token at the bound
    worst = max(float((G[bi * SUB] - G[bi * SUB:(bi + 1) * SUB]).max()) for bi in range(C // SUB))
    assert worst <= 15 * 5.0 / math.log(2.0) + 1e-9 < 127


def test_without_a_lower_bound_the_diagonal_factor_overflows():
    # the softplus gate is unbounded: a strong gate drives the diagonal block's right factor past
    # bf16's range, so those blocks must stay on the exact SIMT path when safe_gate is off
    q, k, G = _chunk(lower_bound=None, strength=30.0)
    got = factorised_bf16(q, k, G, strict=False)
    assert not torch.isfinite(got).all()


def _ftz(x):
    """fp32 flush-to-zero, as ex2.approx.ftz and the kernel's products leave sub-2^-126 values."""
    return torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)


@pytest.mark.parametrize("lb", [-11.0, -5.0, -0.1, 0.0])
@pytest.mark.parametrize("saturated", [True, False])
def test_gate_halves_match_the_direct_factor(lb, saturated):
    """GATE_FACTORS="halves": q·2^Γ and k·2^Γ as (x·2^(Γ−C))·h·h with h = 2^(C/2), in fp32 with flush-to-zero, at
    the lower bounds the tensor-core stage 1 takes (down to MIN_LOWER_BOUND, every gate at the bound when
    saturated): finite, and within 2^-16 (relative) of x·2^Γ wherever the direct exp2 does not flush it (where it
    does, the halves are below 2^-100 too). The 2^-16: Γ − C is rounded to fp32 before its exp2, an absolute
    error up to half an ulp of |Γ − C| <= 2 shift < 256, i.e. 2^-17 in log2 units; 1/128 of the bf16 ulp the
    products are rounded to next. h = 2^C in one factor would fail here: it flushes at C < -126
    while 2^Γ, up to 2^shift larger, does not."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    assert tc.MIN_LOWER_BOUND <= lb <= 0.0
    g = torch.Generator().manual_seed(3)
    lb2 = lb / math.log(2.0)
    step = torch.full((C, D), lb2) if saturated else lb2 * torch.rand(C, D, generator=g, dtype=torch.float64)
    gam = step.float().cumsum(0)  # Γ within the chunk, log2 units, fp32 as the kernel's scan
    shift = -7.5 * lb / math.log(2.0)
    cref = (gam[::SUB] - shift).repeat_interleave(SUB, 0)  # C of each row's 16-row block
    x = torch.empty(C, D).uniform_(-1.0, 1.0, generator=g)
    fa = _ftz(torch.exp2(gam - cref))
    h = _ftz(torch.exp2(cref * 0.5))
    halves = _ftz(_ftz(_ftz(x * fa) * h) * h)
    direct = x.double() * _ftz(torch.exp2(gam.double()))
    assert torch.isfinite(fa).all() and torch.isfinite(halves).all()
    live = direct.abs() >= 2.0 ** -100  # clear of the flush, so a relative bound is meaningful
    rel = (halves.double() - direct).abs() / direct.abs()
    assert (rel <= 2.0 ** -16)[live].all(), rel[live].max()
    assert (halves.double().abs() <= 2.0 ** -100)[~live].all()
    if saturated and lb <= -5.0:  # the range case: blocks whose C is below -126 still carry 2^Γ > 0
        assert ((cref < -126) & (direct != 0)).any()
        assert (_ftz(torch.exp2(cref)) * fa == 0)[(cref < -126) & (direct != 0)].all()


def test_stage1_shared_memory_fits_two_ctas():
    """Stage 1's tiles (the B'_1..3 tiles of the off-diagonal blocks, 24 KB, among them) and bf16 factors:
    two CTAs per SM fit (the launch bound the kernel is compiled for), with the driver's 1 KB per CTA.
    115,712 B with the struct's 1 KB alignment, so two CTAs use the SM's 228 KB exactly: one more field
    would drop the kernel to one CTA per SM."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90.kda_fwd_intra_tc import SMEM_PER_SM, KdaFwdIntraTC

    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                 allow_neg_eigval=False, group=1)
    smem = KdaFwdIntraTC(**flags).storage_class().size_in_bytes()
    assert smem == 115712
    assert 2 * (smem + 1024) <= SMEM_PER_SM


def test_timing_diagnostics_are_named_and_off_by_default():
    """CULA_KDA_TC_DIAG's options are checked by name, and none is on unless the environment asks."""
    pytest.importorskip("cutlass")
    import os

    from cula.kernels.sm90.kda_fwd_intra_tc import DIAG, KdaFwdIntraTC

    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                 allow_neg_eigval=False, group=1)
    assert KdaFwdIntraTC(**flags).diag == ()
    assert (DIAG == ()) == (not os.environ.get("CULA_KDA_TC_DIAG"))
    with pytest.raises(ValueError, match="CULA_KDA_TC_DIAG.*no_stores"):
        KdaFwdIntraTC(**flags, diag=("no_stores",))


def test_one_cta_diagnostic_leaves_room_for_one_cta_only():
    """``one_cta`` times stage 1 at one CTA per SM: its request must exceed half of the SM and fit one CTA."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90.kda_fwd_intra_tc import SMEM_PER_SM, KdaFwdIntraTC

    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                 allow_neg_eigval=False, group=1)
    storage = KdaFwdIntraTC(**flags).storage_class().size_in_bytes()
    assert KdaFwdIntraTC(**flags).launch_smem(storage) == storage
    one = KdaFwdIntraTC(**flags, diag=("one_cta",)).launch_smem(storage)
    assert 2 * (one + 1024) > SMEM_PER_SM and one + 1024 <= SMEM_PER_SM - 4096  # 227 KB per CTA at most


@pytest.mark.gpu
def test_gpu_stage1_runs_its_ctas_per_sm(monkeypatch, tmp_path):
    """The driver agrees with each stage 1 built on how many CTAs fit an SM: two for the full storage (2 x (115,712
    + 1,024) B is exactly the H200's 228 KB) and three for the w-in-stage-2 one with 32-row blocks (``ctas=3``:
    70,656 B and 168 registers). A larger per-CTA reservation, one more shared field or a few more registers would
    cut the kernel's warps per SM without any other symptom than time."""
    import ctypes

    import cutlass.cute as cute

    from cula.kernels.common import aot
    from cula.kernels.sm90 import kda_fwd
    from cula.kernels.sm90 import kda_fwd_check as chk
    from cula.kernels.sm90.decode_launch_probe import load_function
    from cula.kernels.sm90.kda_fwd_intra_tc import THREADS, KdaFwdIntraTC

    # No driver function handle reaches Python from the DSL (its host code loads the kernel; an ahead-of-time
    # module likewise, session 34): stage 1 compiles here (~40 s a flag set) keeping its cubin, which we load
    # ourselves. Stage 2 may still come from a module.
    find, compile_ = aot.find, cute.compile
    monkeypatch.setattr(aot, "find", lambda kind, key, specs: None if kind == "intra_tc" else find(kind, key, specs))
    monkeypatch.setattr(kda_fwd, "_LAUNCHERS", {})
    dumps = iter(range(1000))

    def keep_cubin(fn, *args, **kw):
        dump = tmp_path / str(next(dumps))  # one folder a compile: every kernel's files have the same name
        dump.mkdir()
        return compile_(fn, *args, options=f"--keep-cubin --keep-ptx --dump-dir {dump}", **kw)

    monkeypatch.setattr(cute, "compile", keep_cubin)
    for name in ("tc-T1", "tc-lb11-strong"):  # 32-row blocks (three CTAs), a bound below -5.37 (16-row: two)
        case = next(c for c in chk.CASES if c[0] == name)
        args, kw = chk._inputs(*case, dev=torch.device("cuda"))
        kda_fwd.kda_fwd(*args, **kw)
    torch.cuda.synchronize()
    libcuda = ctypes.CDLL("libcuda.so.1")
    built = {}
    for (kind, key), launcher in kda_fwd._LAUNCHERS.items():
        if kind != "intra_tc":
            continue
        kernel = KdaFwdIntraTC(**dict(key[0]))
        smem = kernel.launch_smem(kernel.storage_class().size_in_bytes())
        fn = ctypes.c_void_p(load_function(launcher.compiled))
        # as the launch does: the dynamic shared memory allowed (attribute 8) and the largest carveout (9)
        assert libcuda.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)) == 0
        assert libcuda.cuFuncSetAttribute(fn, 9, ctypes.c_int(100)) == 0
        n = ctypes.c_int()
        rc = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, ctypes.c_int(THREADS),
                                                                 ctypes.c_size_t(smem))
        assert rc == 0, rc
        assert n.value == kernel.ctas, (dict(key[0]), smem, n.value)
        built[kernel.ctas] = smem
    assert set(built) == {2, 3}, built  # both tiles were built and checked


@pytest.mark.parametrize("factor_block, kgt", [(32, "ref"), (32, "kh"), (16, None)])
def test_stage1_kgt_is_accurate_element_by_element_when_half_a_chunk_saturates(factor_block, kgt):
    """kgᵀ = k̂ 2^(Γ_last − Γ) as stage 1's model forms it (32-row blocks: (K̃ 2^(ref − C)) 2^(Γ_last − ref), ref = Γ at
    row 32 for block 0's rows, C_1 for block 1's; "kh" and 16-row blocks: K̂ 2^(Γ_last − E)) is within bf16 rounding
    of the fp64 value in every element, normal or not, when rows 0-31 sit at the bound (−5.36, 32-row blocks'
    lowest) and rows 32-63 decay by ~2^-9 in all: block 0's values are then 2^-9 to 2^-249 of |k̂|. The one-factor form
    K̃ 2^(Γ_last − C_0) would flush the largest of them to zero (2^(Γ_last − C_0) < 2^-126), which the case checks
    it reaches."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as tc

    lb = -5.36
    assert lb >= tc.BLOCK32_MIN_LOWER_BOUND
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(C, 1, D, generator=gen).bfloat16() for _ in range(3))
    g = torch.full((C, 1, D), -0.2)
    g[:32] = lb
    beta = torch.rand(C, 1, generator=gen).bfloat16()
    chunks = torch.tensor([[0, C]], dtype=torch.int32)
    model = tc.emulate(q, k, v, g, beta, chunks, D ** -0.5, lb, use_qk_l2norm=True, log_gate=True,
                       factor_block=factor_block, kgt=kgt)
    kh = l2norm(k[:, 0].double())
    gam = (g[:, 0].double().clamp(lb, 0.0) / math.log(2.0)).cumsum(0)
    want = kh * (gam[-1:] - gam).exp2()  # [C, D]
    got = model["kgt"][0].double().T
    assert want[:32].abs().max() > 2.0 ** -12  # block 0's largest values are not negligible
    assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 2.0 ** -133).all()  # bf16's subnormals: 2^-133 apart
    # the case reaches the flush the two-factor forms avoid: one factor 2^(Γ_last − C_0) is zero in fp32
    shift = tc.factor_shift(32) * lb
    assert (gam[-1] - (gam[0] - shift)).max() < -126


@pytest.mark.parametrize("lb, block", [(-5.36, 32), (-5.0, 32), (-11.0, 16)])
def test_square_gate_factor_error_is_absolute_and_below_bf16_rounding(lb, block):
    """GATE_FACTORS "square": k 2^Γ as (k 2^(Γ − C)) 2^C with 2^C = h h formed once a column in fp32, whose FMUL keeps
    subnormals (C + 149 bits below 2^-126, zero below 2^-149), against fp64 on gates at the bound (the references
    reach C < −149). Its error is absolute: below |k| 2^(shift − 149) + bf16's half step of the value, where the
    halved form ((k 2^(Γ − C)) h) h is within the half step alone; the case does reach 2^C below 2^-126."""
    gen = torch.Generator().manual_seed(11)
    ftz = lambda y: torch.where(y.abs() < 2.0 ** -126, torch.zeros_like(y), y)  # ex2.approx.ftz's results
    rows = 64
    k = l2norm(torch.randn(rows, D, generator=gen, dtype=torch.float64))
    g = lb * torch.rand(rows, D, generator=gen, dtype=torch.float64) ** 0.25  # mostly near the bound
    gam = (g / math.log(2.0)).cumsum(0)
    shift = (block / 2 - 0.5) * -lb / math.log(2.0)
    first = gam[::block].repeat_interleave(block, 0)
    c = (first - shift).float()
    fa = ftz(torch.exp2(gam.float() - c))
    h = ftz(torch.exp2(c * 0.5))
    ka = k.float() * fa
    square = (ka * (h * h)).bfloat16().double()
    halves = ((ka * h) * h).bfloat16().double()
    exact = k * torch.exp2(gam)
    half_step = 2.0 ** -8 * exact.abs()  # bf16: 8 significant bits
    bound = k.abs() * 2.0 ** (shift - 149)
    assert ((square - exact).abs() <= half_step * 1.01 + bound + 2.0 ** -133).all()
    assert ((halves - exact).abs() <= half_step * 1.01 + 2.0 ** -133).all()
    hh = (h * h).double()
    assert (hh < 2.0 ** -126).any()  # the case reaches 2^C below the normal range
    assert shift - 149 <= -29

"""KDA forward, stage 1 of 2: the token-parallel intra-chunk work, one CTA per (chunk, value head).

For a chunk of 64 tokens of one value head this kernel applies the in-kernel transforms (gate,
beta sigmoid, q/k l2norm), takes the in-chunk cumsum of the log2 gate Γ, forms the gated products

    Akk[i,j] = β_i Σ_d k_id k_jd 2^(Γ_id − Γ_jd)  (j < i),   Aqk[i,j] = Σ_d q_id k_jd 2^(Γ_id − Γ_jd)  (j ≤ i)

inverts the unit lower triangular ``I + Akk`` and writes what the recurrence stage needs, all in a
chunk-padded scratch layout (row ``c*64 + r`` of head ``hv`` is token ``r`` of global chunk ``c``;
rows past a sequence's end are zeros):

    w   [HV, NC*64, 128] bf16   T diag(β) (k ⊙ 2^Γ)
    u   [HV, NC*64, 128] bf16   T diag(β) v
    qg  [HV, NC*64, 128] bf16   scale q ⊙ 2^Γ
    aqk [HV, NC*64, 64]  bf16   scale Aqk (upper triangle zero)
    kgt [HV, 128, NC*64] bf16   (k ⊙ 2^(Γ_last − Γ))ᵀ   (tokens contiguous: the K-major B operand)
    gam [HV, NC, 128]    fp32   2^Γ_last

All arithmetic is fp32 on the CUDA cores (a first landing; the tensor-core version is next, see
kda_fwd.md). Exponent safety: every factor is 2^(Γ_i − Γ_j) with j ≤ i (≤ 1); the off-diagonal
16-row blocks are factorised around the first row of the row block, so both factors stay ≤ 1.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

CHUNK = 64  # tokens per chunk (FLA's chunk_size)
DK = 128  # key head dim (the only one this kernel is built for)
DV = 128  # value head dim
SUB = 16  # row block of the factorised off-diagonal products
THREADS = 256
PAD = DK + 1  # fp32 row pitch in smem: consecutive rows start in different banks
RCP_LN2 = 1.0 / math.log(2.0)
L2NORM_EPS = 1e-6
# How T = (I + Akk)^-1 is formed: "column" (validated on the H200 2026-12-02) runs a 64-step forward
# substitution per column; "blocked" inverts the four 16x16 diagonal blocks the same way (16 steps),
# then fills the off-diagonal blocks by 16x16 products, distance by distance (not yet run on a GPU).
INVERSES = ("column", "blocked")


class KdaFwdIntra:
    """Compile-time configuration (flags and dtypes) of the intra-chunk kernel."""

    def __init__(
        self,
        use_qk_l2norm: bool,
        use_gate: bool,
        has_a_log: bool,
        has_dt_bias: bool,
        use_lower_bound: bool,
        use_beta_sigmoid: bool,
        allow_neg_eigval: bool,
        group: int,
        inverse: str = "column",
    ):
        self.use_qk_l2norm = use_qk_l2norm
        self.use_gate = use_gate
        self.has_a_log = has_a_log
        self.has_dt_bias = has_dt_bias
        self.use_lower_bound = use_lower_bound
        self.use_beta_sigmoid = use_beta_sigmoid
        self.beta_mult = 2.0 if allow_neg_eigval else 1.0
        self.group = group  # HV // H
        if inverse not in INVERSES:
            raise ValueError(f"inverse: expected one of {INVERSES}, got {inverse!r}")
        self.inverse = inverse

    @cute.jit
    def __call__(
        self,
        pQ: cute.Pointer,  # [TT, H, 128]
        pK: cute.Pointer,  # [TT, H, 128]
        pV: cute.Pointer,  # [TT, HV, 128]
        pG: cute.Pointer,  # [TT, HV, 128]
        pBeta: cute.Pointer,  # [TT, HV]
        pALog: cute.Pointer,  # [HV] fp32 (dummy when unused)
        pDtBias: cute.Pointer,  # [HV * 128] fp32 (dummy when unused)
        pChunks: cute.Pointer,  # [NC, 2] int32: first token, valid rows
        pW: cute.Pointer,  # [HV, NC*64, 128] bf16
        pU: cute.Pointer,  # [HV, NC*64, 128] bf16
        pQG: cute.Pointer,  # [HV, NC*64, 128] bf16
        pAqk: cute.Pointer,  # [HV, NC*64, 64] bf16
        pKGT: cute.Pointer,  # [HV, 128, NC*64] bf16
        pGam: cute.Pointer,  # [HV, NC, 128] fp32
        total_tokens: cutlass.Int32,
        num_heads: cutlass.Int32,
        num_heads_v: cutlass.Int32,
        num_chunks: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        stream,
    ):
        # Raw pointers + sizes (not cute tensors) cross the host boundary: the compiled signature is
        # then independent of how a runtime tensor would be marked dynamic, and calls are cheap.
        TT, H, HV, NC = total_tokens, num_heads, num_heads_v, num_chunks
        R = NC * CHUNK
        mQ = cute.make_tensor(pQ, cute.make_layout((TT, H, DK), stride=(H * DK, DK, 1)))
        mK = cute.make_tensor(pK, cute.make_layout((TT, H, DK), stride=(H * DK, DK, 1)))
        mV = cute.make_tensor(pV, cute.make_layout((TT, HV, DV), stride=(HV * DV, DV, 1)))
        mG = cute.make_tensor(pG, cute.make_layout((TT, HV, DK), stride=(HV * DK, DK, 1)))
        mBeta = cute.make_tensor(pBeta, cute.make_layout((TT, HV), stride=(HV, 1)))
        mALog = cute.make_tensor(pALog, cute.make_layout(HV))
        mDtBias = cute.make_tensor(pDtBias, cute.make_layout(HV * DK))
        mChunks = cute.make_tensor(pChunks, cute.make_layout((NC, 2), stride=(2, 1)))
        mW = cute.make_tensor(pW, cute.make_layout((HV, R, DK), stride=(R * DK, DK, 1)))
        mU = cute.make_tensor(pU, cute.make_layout((HV, R, DV), stride=(R * DV, DV, 1)))
        mQG = cute.make_tensor(pQG, cute.make_layout((HV, R, DK), stride=(R * DK, DK, 1)))
        mAqk = cute.make_tensor(pAqk, cute.make_layout((HV, R, CHUNK), stride=(R * CHUNK, CHUNK, 1)))
        mKGT = cute.make_tensor(pKGT, cute.make_layout((HV, DK, R), stride=(DK * R, R, 1)))
        mGam = cute.make_tensor(pGam, cute.make_layout((HV, NC, DK), stride=(NC * DK, DK, 1)))
        self.kernel(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mChunks, mW, mU, mQG, mAqk, mKGT, mGam,
            scale, lower_bound,
        ).launch(grid=[NC, HV, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mChunks: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mQG: cute.Tensor,
        mAqk: cute.Tensor,
        mKGT: cute.Tensor,
        mGam: cute.Tensor,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, hv, _ = cute.arch.block_idx()
        hq = hv // self.group
        tok0 = mChunks[chunk, 0]
        nvalid = mChunks[chunk, 1]
        row0 = chunk * CHUNK

        f32 = cutlass.Float32
        smem = cutlass.utils.SmemAllocator()
        row_major = cute.make_layout((CHUNK, DK), stride=(PAD, 1))
        sG = smem.allocate_tensor(f32, row_major, 16)  # Γ (log2, in-chunk inclusive cumsum)
        sK = smem.allocate_tensor(f32, row_major, 16)  # k (normalised)
        sQ = smem.allocate_tensor(f32, row_major, 16)  # scale * q (normalised); later β k 2^Γ
        sX = smem.allocate_tensor(f32, row_major, 16)  # scratch: right/left factors; later β v
        sA = smem.allocate_tensor(f32, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)), 16)
        sT = smem.allocate_tensor(f32, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)), 16)
        sQl = smem.allocate_tensor(f32, cute.make_layout((SUB, DK), stride=(PAD, 1)), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout(CHUNK), 16)
        sRstd = smem.allocate_tensor(f32, cute.make_layout(2 * CHUNK), 16)

        a_exp = f32(1.0)
        if cutlass.const_expr(self.use_gate and self.has_a_log):
            a_exp = cute.math.exp(mALog[hv].to(f32))

        # ---- phase 0: load q, k, the gate (transformed to log2 units) and beta; zero past the end
        for it in cutlass.range_constexpr(CHUNK * DK // THREADS):
            e = tidx + it * THREADS
            r = e // DK
            d = e % DK
            qv = f32(0.0)
            kv = f32(0.0)
            gv = f32(0.0)
            if r < nvalid:
                tok = tok0 + r
                qv = mQ[tok, hq, d].to(f32)
                kv = mK[tok, hq, d].to(f32)
                graw = mG[tok, hv, d].to(f32)
                if cutlass.const_expr(self.use_gate):
                    x = graw
                    if cutlass.const_expr(self.has_dt_bias):
                        x = x + mDtBias[hv * DK + d].to(f32)
                    if cutlass.const_expr(self.use_lower_bound):
                        z = a_exp * x
                        gv = lower_bound / (f32(1.0) + cute.math.exp(-z))
                    else:
                        sp = x
                        if x <= f32(20.0):
                            sp = cute.math.log(f32(1.0) + cute.math.exp(x))
                        gv = -a_exp * sp
                else:
                    gv = graw
            sQ[r, d] = qv
            sK[r, d] = kv
            sG[r, d] = gv * f32(RCP_LN2)
        if tidx < CHUNK:
            bv = f32(0.0)
            if tidx < nvalid:
                bv = mBeta[tok0 + tidx, hv].to(f32)
                if cutlass.const_expr(self.use_beta_sigmoid):
                    bv = f32(self.beta_mult) / (f32(1.0) + cute.math.exp(-bv))
            sBeta[tidx] = bv
        cute.arch.sync_threads()

        # ---- phase 1: cumsum of the gate down each column; row norms of q and k
        if tidx < DK:
            acc = f32(0.0)
            for r in cutlass.range_constexpr(CHUNK):
                acc = acc + sG[r, tidx]
                sG[r, tidx] = acc
        else:
            j = tidx - DK  # 0..63: q rows, 64..127: k rows
            if cutlass.const_expr(self.use_qk_l2norm):
                r = j % CHUNK
                ss = f32(0.0)
                if j < CHUNK:
                    for d in cutlass.range(DK, unroll=8):
                        ss = ss + sQ[r, d] * sQ[r, d]
                else:
                    for d in cutlass.range(DK, unroll=8):
                        ss = ss + sK[r, d] * sK[r, d]
                sRstd[j] = cute.math.rsqrt(ss + f32(L2NORM_EPS))
            else:
                sRstd[j] = f32(1.0)
        cute.arch.sync_threads()

        # ---- phase 2: normalise (q also takes the scale), write qg, kgᵀ and γ
        for it in cutlass.range_constexpr(CHUNK * DK // THREADS):
            e = tidx + it * THREADS
            r = e // DK
            d = e % DK
            qn = sQ[r, d] * sRstd[r] * scale
            sQ[r, d] = qn
            sK[r, d] = sK[r, d] * sRstd[CHUNK + r]
            mQG[hv, row0 + r, d] = (qn * cute.math.exp2(sG[r, d])).to(mQG.element_type)
        cute.arch.sync_threads()
        for it in cutlass.range_constexpr(CHUNK * DK // THREADS):
            e = tidx + it * THREADS
            r = e % CHUNK  # tokens fastest: kgt is token-contiguous
            d = e // CHUNK
            kgv = sK[r, d] * cute.math.exp2(sG[CHUNK - 1, d] - sG[r, d])
            mKGT[hv, d, row0 + r] = kgv.to(mKGT.element_type)
        if tidx < DK:
            mGam[hv, chunk, tidx] = cute.math.exp2(sG[CHUNK - 1, tidx])

        # ---- phase 3: diagonal 16x16 blocks, element by element (exact for any gate)
        ii = tidx // SUB
        jj = tidx % SUB
        dots = cute.make_rmem_tensor(cute.make_layout(2), f32)  # (Σ k k f, Σ q k f)
        for blk in cutlass.range_constexpr(CHUNK // SUB):
            i = blk * SUB + ii
            j = blk * SUB + jj
            jc = blk * SUB + cutlass.min(jj, ii)  # upper entries: compute a finite pair, drop it
            dots.fill(0.0)
            for d in cutlass.range(DK, unroll=8):
                f = cute.math.exp2(sG[i, d] - sG[jc, d])
                kf = sK[jc, d] * f
                dots[0] = dots[0] + sK[i, d] * kf
                dots[1] = dots[1] + sQ[i, d] * kf
            dot_k = dots[0]
            dot_q = dots[1]
            if jj > ii:
                dot_q = f32(0.0)
            a_kk = f32(0.0)
            if jj < ii:
                a_kk = dot_k * sBeta[i]
            sA[i, j] = a_kk
            mAqk[hv, row0 + i, j] = dot_q.to(mAqk.element_type)
        # upper off-diagonal blocks are zero
        for bi, bj in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)):  # one 16x16 block per pass
            i = bi * SUB + ii
            j = bj * SUB + jj
            sA[i, j] = f32(0.0)
            mAqk[hv, row0 + i, j] = f32(0.0).to(mAqk.element_type)

        # ---- phase 4: off-diagonal blocks (I > J), factorised around r_I = Γ[16 I]
        # sX rows 0..47: right factors k_j 2^(r - Γ_j) (j < 16 I); rows 48..63: left k factors;
        # sQl: left q factors.
        for bI in cutlass.range_constexpr(1, CHUNK // SUB):
            cute.arch.sync_threads()
            nright = bI * SUB
            for it in cutlass.range_constexpr((nright + SUB) * DK // THREADS):
                e = tidx + it * THREADS
                r = e // DK
                d = e % DK
                ref = sG[bI * SUB, d]
                if r < nright:
                    sX[r, d] = sK[r, d] * cute.math.exp2(ref - sG[r, d])
                else:
                    il = bI * SUB + (r - nright)
                    fl = cute.math.exp2(sG[il, d] - ref)
                    sX[48 + r - nright, d] = sK[il, d] * fl
                    sQl[r - nright, d] = sQ[il, d] * fl
            cute.arch.sync_threads()
            for m in cutlass.range_constexpr(bI):
                jr = jj + m * SUB
                dots.fill(0.0)
                for d in cutlass.range(DK, unroll=8):
                    kr = sX[jr, d]
                    dots[0] = dots[0] + sX[48 + ii, d] * kr
                    dots[1] = dots[1] + sQl[ii, d] * kr
                dot_k = dots[0]
                dot_q = dots[1]
                i = bI * SUB + ii
                sA[i, jr] = dot_k * sBeta[i]
                mAqk[hv, row0 + i, jr] = dot_q.to(mAqk.element_type)
        cute.arch.sync_threads()

        # ---- phase 5: T = (I + Akk)^-1 (threads 0..63, one column each, in registers);
        # the other threads stage β k 2^Γ (into sQ) and β v (into sX) for phase 6.
        if tidx < CHUNK:
            if cutlass.const_expr(self.inverse == "column"):
                # column c = tidx of T by forward substitution: T[i,c] = δ_ic − Σ_{c≤j<i} Akk[i,j] T[j,c]
                # (entries above the diagonal are zero, so the sum may start at j = 0)
                for i in cutlass.range(CHUNK, unroll=1):
                    acc = f32(0.0)
                    if tidx == i:
                        acc = f32(1.0)
                    for jk in cutlass.range(i, unroll=4):
                        acc = acc - sA[i, jk] * sT[jk, tidx]
                    sT[i, tidx] = acc
            else:
                # the same substitution inside the 16x16 diagonal block of column tidx only: a
                # 16-step dependency chain instead of 64 (the off-diagonal blocks follow below)
                base = (tidx // SUB) * SUB
                for i in cutlass.range_constexpr(SUB):
                    acc = f32(0.0)
                    if tidx % SUB == i:
                        acc = f32(1.0)
                    for jk in cutlass.range_constexpr(i):
                        acc = acc - sA[base + i, base + jk] * sT[base + jk, tidx]
                    sT[base + i, tidx] = acc
                for r in cutlass.range(base, unroll=1):  # above the diagonal block: zero
                    sT[r, tidx] = f32(0.0)
        else:
            for it in cutlass.range(CHUNK * DK // (THREADS - CHUNK) + 1, unroll=1):
                e = (tidx - CHUNK) + it * (THREADS - CHUNK)
                if e < CHUNK * DK:
                    r = e // DK
                    d = e % DK
                    b = sBeta[r]
                    sQ[r, d] = b * sK[r, d] * cute.math.exp2(sG[r, d])
                    vv = f32(0.0)
                    if r < nvalid:
                        vv = mV[tok0 + r, hv, d].to(f32)
                    sX[r, d] = b * vv
        cute.arch.sync_threads()
        if cutlass.const_expr(self.inverse == "blocked"):
            # off-diagonal blocks, nearest the diagonal first (block row I, column J = I - dist):
            #   T_IJ = −T_II Σ_{J≤K<I} A_IK T_KJ      (L = I + Akk unit lower triangular, T_II = L_II^-1)
            # one 16x16 element (ii, jj) per thread and block; X = Σ A T is staged in sQl (free now).
            for dist in cutlass.range_constexpr(1, CHUNK // SUB):
                for m in cutlass.range_constexpr(CHUNK // SUB - dist):
                    bi = m + dist
                    acc = f32(0.0)
                    for kk in cutlass.range_constexpr(dist * SUB):
                        acc = acc + sA[bi * SUB + ii, m * SUB + kk] * sT[m * SUB + kk, m * SUB + jj]
                    sQl[ii, m * SUB + jj] = acc
                cute.arch.sync_threads()
                for m in cutlass.range_constexpr(CHUNK // SUB - dist):
                    bi = m + dist
                    acc = f32(0.0)
                    for kk in cutlass.range_constexpr(SUB):
                        acc = acc + sT[bi * SUB + ii, bi * SUB + kk] * sQl[kk, m * SUB + jj]
                    sT[bi * SUB + ii, m * SUB + jj] = -acc
                cute.arch.sync_threads()

        # ---- phase 6: w = T (β k 2^Γ), u = T (β v); thread = one column d, 32 interleaved rows
        d = tidx % DK
        half = tidx // DK
        acc_w = cute.make_rmem_tensor(cute.make_layout(CHUNK // 2), f32)
        acc_u = cute.make_rmem_tensor(cute.make_layout(CHUNK // 2), f32)
        for m in cutlass.range_constexpr(CHUNK // 2):
            acc_w[m] = f32(0.0)
            acc_u[m] = f32(0.0)
        for j in cutlass.range(CHUNK, unroll=2):
            kx = sQ[j, d]
            vx = sX[j, d]
            for m in cutlass.range_constexpr(CHUNK // 2):
                t = sT[2 * m + half, j]
                acc_w[m] = acc_w[m] + t * kx
                acc_u[m] = acc_u[m] + t * vx
        for m in cutlass.range_constexpr(CHUNK // 2):
            i = 2 * m + half
            mW[hv, row0 + i, d] = acc_w[m].to(mW.element_type)
            mU[hv, row0 + i, d] = acc_u[m].to(mU.element_type)


def fake_args(q_dtype, g_dtype, beta_dtype):
    """Placeholder pointers and sizes for a CPU compile (the kernel never runs on them)."""
    from cula.kernels.common.ptx_check import fake_ptr

    f32, bf16, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
    dts = [q_dtype, q_dtype, q_dtype, g_dtype, beta_dtype, f32, f32, i32, bf16, bf16, bf16, bf16, bf16, f32]
    aligns = [16, 16, 16, 16, 4, 4, 4, 8, 16, 16, 16, 16, 16, 16]
    ptrs = [fake_ptr(i, dt, a) for i, (dt, a) in enumerate(zip(dts, aligns))]
    return (*ptrs, i32(1000), i32(2), i32(2), i32(16), f32(0.088), f32(-5.0))


def compile_targets():
    """CPU PTX-check targets: the most general flag set, bf16 and fp32 gate inputs."""
    from cutlass.cute.runtime import make_fake_stream

    def build(g_dtype, **flags):
        def make():
            kern = KdaFwdIntra(**flags)
            return kern, (*fake_args(cutlass.BFloat16, g_dtype, g_dtype), make_fake_stream())
        return make

    full = dict(use_qk_l2norm=True, use_gate=True, has_a_log=True, has_dt_bias=True,
                use_lower_bound=False, use_beta_sigmoid=True, allow_neg_eigval=False, group=1)
    return {
        "default": build(cutlass.BFloat16, **full),
        "lower_bound_fp32": build(cutlass.Float32, **{**full, "use_lower_bound": True}),
        "plain": build(cutlass.Float32, **{**full, "use_gate": False, "use_qk_l2norm": False,
                                           "use_beta_sigmoid": False}),
        "blocked_inverse": build(cutlass.BFloat16, **{**full, "inverse": "blocked"}),
    }

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

from cula.kernels.common.l2_prefetch import LINE_BYTES, prefetch_line_l2

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
# Kernel body: "v1" (validated on the H200 2026-12-02) or "v2" (CPU-emulated only, not yet run on a
# GPU): register-blocked phases 3/4/6 (fewer shared loads per FMA) and ~106 KB of smem (q/k tiles in
# bf16 as FLA keeps them, Γ fp32, aliased scratch) so two CTAs share an SM and hide each other's
# barrier and shared-memory latency. See kernel_v2.
VARIANTS = ("v1", "v2")
V2_CTAS_PER_SM = 2  # launch bound of v2: 2 x 256 threads x 128 registers fill the register file
PAD_BF16 = DK + 2  # bf16 row pitch: 65 words, odd, so consecutive rows start in different banks
TILES = SUB // 2  # 2x2 output tiles per side of a 16x16 block (phases 3 and 4 of v2)
TRI_TILES = TILES * (TILES + 1) // 2  # tiles on or below the diagonal of one diagonal block
DIAG_TILES = (CHUNK // SUB) * TRI_TILES  # v2 phase 3: one thread per such tile (144 of 256)
KSPLIT = 4  # v2 phase 4: the 128-long dot products split over 4 adjacent lanes (butterfly sum)
DGROUP = 32 // KSPLIT  # consecutive d of one lane per 32 d (spreads a warp's loads over all banks)
WARPS = THREADS // 32
W_ROWS = CHUNK // WARPS  # v2 phase 6: rows of w/u per thread (8, interleaved by warp)
W_COLS = DK // 32  # v2 phase 6: columns of w/u per thread (4, lane + 32 s)
# v2 scratch union (fp32): phase 4's left k/q and right factors of one 16x16 block (3 x 16 rows),
# later T (64 x 65) and the blocked inverse's 16 x 64 product.
V2_UNION_FLOATS = max(3 * SUB * PAD, CHUNK * (CHUNK + 1) + SUB * (CHUNK + 1))
# v2's allocations in bytes (Γ, k, q, Akk, union, β, rstd; each a multiple of the 16-byte alignment).
# Passed to the launch explicitly: the DSL sizes the 2-CTA carveout from the launch's smem argument
# before the allocator has run, so leaving it automatic would ask for a 0% carveout.
V2_SMEM_BYTES = (4 * CHUNK * PAD + 2 * 2 * CHUNK * PAD_BF16 + 4 * CHUNK * (CHUNK + 1) + 4 * V2_UNION_FLOATS
                 + 4 * CHUNK + 4 * 2 * CHUNK)
SMEM_PER_SM = 233472  # H100/H200: 228 KB per SM (answers the DSL's device query on a CPU compile)
#: v1 asks L2 (per-thread ``prefetch.global.L2``, 2 lines a thread for bf16 inputs) for the q, k, v, g rows
#: of the CTA this many places later in launch order (0: off), as the tensor-core stage 1 does since
#: session 9. Session 10's A/B/A splits on this kernel: 66 ahead 5.6% faster than off (B1 T16384 10.08 ->
#: 9.55 ms), 132 ahead 2.9%. ``CULA_KDA_SIMT_PREFETCH`` sets it for A/B runs (0: off).
PREFETCH_AHEAD = int(__import__("os").environ.get("CULA_KDA_SIMT_PREFETCH", "66"))


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
        variant: str = "v1",
        prefetch_ahead: int = PREFETCH_AHEAD,
    ):
        self.prefetch_ahead = prefetch_ahead  # v1: CTAs ahead whose inputs this CTA asks L2 for (0: none)
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
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
        self.variant = variant

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
        if cutlass.const_expr(self.variant == "v1"):
            self.kernel(
                mQ, mK, mV, mG, mBeta, mALog, mDtBias, mChunks, mW, mU, mQG, mAqk, mKGT, mGam,
                scale, lower_bound,
            ).launch(grid=[NC, HV, 1], block=[THREADS, 1, 1], stream=stream)
        else:
            self.kernel_v2(
                mQ, mK, mV, mG, mBeta, mALog, mDtBias, mChunks, mW, mU, mQG, mAqk, mKGT, mGam,
                scale, lower_bound,
            ).launch(grid=[NC, HV, 1], block=[THREADS, 1, 1], stream=stream,
                      smem=V2_SMEM_BYTES, min_blocks_per_mp=V2_CTAS_PER_SM)

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
        if cutlass.const_expr(self.prefetch_ahead > 0):
            self.prefetch_later_chunk(mQ, mK, mV, mG, mChunks, tidx, chunk, hv)

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

    @cute.jit
    def prefetch_later_chunk(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                             mChunks: cute.Tensor, tidx, chunk, hv):
        """Ask L2 for the q, k, v, g rows of the CTA ``prefetch_ahead`` places later in launch order
        (chunk fastest, then head): thread t takes row t % 64 of tensor t // 64 (q, k, v, g), every
        128-byte line of it."""
        NC = mChunks.shape[0]
        HV = mV.shape[1]
        nxt = hv * NC + chunk + self.prefetch_ahead
        if nxt < HV * NC:
            hv_n = nxt // NC
            c_n = nxt - hv_n * NC
            row = tidx % CHUNK
            if row < mChunks[c_n, 1]:
                tok = mChunks[c_n, 0] + row
                which = tidx // CHUNK
                for i, (m, head) in enumerate(((mQ, hv_n // self.group), (mK, hv_n // self.group),
                                               (mV, hv_n), (mG, hv_n))):
                    if which == i:
                        per_line = LINE_BYTES * 8 // m.element_type.width
                        for ln in cutlass.range_constexpr(m.shape[2] // per_line):
                            prefetch_line_l2(m.iterator + (tok * m.shape[1] + head) * m.shape[2] + ln * per_line)

    @cute.kernel
    def kernel_v2(
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
        """The v1 computation with register-blocked products and half the shared memory.

        Same formulas, fp32 arithmetic and exponent-safety factorisation as ``kernel``; what differs:
        - normalised q and k are kept in bf16 tiles (the inputs are bf16; FLA keeps them so too);
          qg and kgᵀ are still formed from the fp32 normalised values, so they equal v1's.
        - phase 3: one thread per 2x2 tile on or below the diagonal (10 shared loads for 4 entries
          instead of 20; the strictly upper tiles are no longer computed and dropped).
        - phase 4: one 16x16 block at a time, 2x2 tiles, each dot product split over 4 lanes and
          summed by butterfly shuffles (6 loads per 8 FMA instead of 3 per 2; all 256 threads busy).
        - phase 6: 8 rows x 4 columns per thread (17 loads per 64 FMA instead of 34); β k 2^Γ
          overwrites Γ and β v is formed from a bf16 copy of v (exact: v arrives in bf16).

        Phases 0-2 repeat ``kernel``'s on purpose: ``kernel`` is the GPU-validated body and stays
        byte-for-byte as validated; once v2 passes its GPU check it replaces ``kernel`` outright.
        """
        tidx, _, _ = cute.arch.thread_idx()
        chunk, hv, _ = cute.arch.block_idx()
        hq = hv // self.group
        tok0 = mChunks[chunk, 0]
        nvalid = mChunks[chunk, 1]
        row0 = chunk * CHUNK
        lane = tidx % 32
        warp = tidx // 32

        f32 = cutlass.Float32
        bf16 = cutlass.BFloat16
        smem = cutlass.utils.SmemAllocator()
        half_rows = cute.make_layout((CHUNK, DK), stride=(PAD_BF16, 1))
        sG = smem.allocate_tensor(f32, cute.make_layout((CHUNK, DK), stride=(PAD, 1)), 16)  # Γ; later β k 2^Γ
        sK = smem.allocate_tensor(bf16, half_rows, 16)  # k (raw, then normalised)
        sQ = smem.allocate_tensor(bf16, half_rows, 16)  # q (raw, then scale * normalised); later v
        sA = smem.allocate_tensor(f32, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)), 16)
        sUnion = smem.allocate_tensor(f32, cute.make_layout(V2_UNION_FLOATS), 16)
        sBeta = smem.allocate_tensor(f32, cute.make_layout(CHUNK), 16)
        sRstd = smem.allocate_tensor(f32, cute.make_layout(2 * CHUNK), 16)
        block_rows = cute.make_layout((SUB, DK), stride=(PAD, 1))
        sLk = cute.make_tensor(sUnion.iterator, block_rows)  # phase 4: left k factors
        sLq = cute.make_tensor(sUnion.iterator + SUB * PAD, block_rows)  # left q factors
        sR = cute.make_tensor(sUnion.iterator + 2 * SUB * PAD, block_rows)  # right factors
        sT = cute.make_tensor(sUnion.iterator, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)))
        sXb = cute.make_tensor(sUnion.iterator + CHUNK * (CHUNK + 1),
                               cute.make_layout((SUB, CHUNK), stride=(CHUNK + 1, 1)))
        sV = sQ  # q is dead after phase 4

        a_exp = f32(1.0)
        if cutlass.const_expr(self.use_gate and self.has_a_log):
            a_exp = cute.math.exp(mALog[hv].to(f32))

        # ---- phase 0: load q, k (bf16 tiles: exact), the gate in log2 units and beta
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
            sQ[r, d] = qv.to(bf16)
            sK[r, d] = kv.to(bf16)
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
            csum = f32(0.0)
            for r in cutlass.range_constexpr(CHUNK):
                csum = csum + sG[r, tidx]
                sG[r, tidx] = csum
        else:
            j = tidx - DK  # 0..63: q rows, 64..127: k rows
            if cutlass.const_expr(self.use_qk_l2norm):
                r = j % CHUNK
                ss = f32(0.0)
                if j < CHUNK:
                    for d in cutlass.range(DK, unroll=8):
                        xq = sQ[r, d].to(f32)
                        ss = ss + xq * xq
                else:
                    for d in cutlass.range(DK, unroll=8):
                        xk = sK[r, d].to(f32)
                        ss = ss + xk * xk
                sRstd[j] = cute.math.rsqrt(ss + f32(L2NORM_EPS))
            else:
                sRstd[j] = f32(1.0)
        cute.arch.sync_threads()

        # ---- phase 2: normalise in place; qg and kgᵀ from the fp32 values (as v1), then γ.
        # Each element is read and rewritten by one thread, so the q and k passes need no barrier.
        for it in cutlass.range_constexpr(CHUNK * DK // THREADS):
            e = tidx + it * THREADS
            r = e // DK
            d = e % DK
            qn = sQ[r, d].to(f32) * sRstd[r] * scale
            sQ[r, d] = qn.to(bf16)
            mQG[hv, row0 + r, d] = (qn * cute.math.exp2(sG[r, d])).to(mQG.element_type)
        for it in cutlass.range_constexpr(CHUNK * DK // THREADS):
            e = tidx + it * THREADS
            r = e % CHUNK  # tokens fastest: kgt is token-contiguous
            d = e // CHUNK
            kn = sK[r, d].to(f32) * sRstd[CHUNK + r]
            sK[r, d] = kn.to(bf16)
            kgv = kn * cute.math.exp2(sG[CHUNK - 1, d] - sG[r, d])
            mKGT[hv, d, row0 + r] = kgv.to(mKGT.element_type)
        if tidx < DK:
            mGam[hv, chunk, tidx] = cute.math.exp2(sG[CHUNK - 1, tidx])
        cute.arch.sync_threads()

        # ---- phase 3: diagonal 16x16 blocks, element by element (exact for any gate).
        # Threads 0..143: one 2x2 tile (rows i0, i0+1; columns j0, j0+1) on or below the diagonal
        # of block blk; threads 144..255: the 4 x 28 strictly upper tiles, which are zero.
        acc = cute.make_rmem_tensor(cute.make_layout(8), f32)  # (Σ k k f, Σ q k f) per tile entry
        if tidx < DIAG_TILES:
            blk = tidx // TRI_TILES
            p = tidx % TRI_TILES
            ti = cutlass.Int32(0)  # p -> (ti, tj), tj <= ti, row-major over the lower triangle
            for r in cutlass.range_constexpr(1, TILES):
                if p >= r * (r + 1) // 2:
                    ti = cutlass.Int32(r)
            tj = p - ti * (ti + 1) // 2
            i0 = blk * SUB + 2 * ti
            j0 = blk * SUB + 2 * tj
            # (i0, j0 + 1) lies above the diagonal in a diagonal tile: its exponent is zeroed (a
            # finite dropped value); times 1.0 elsewhere, which is exact.
            keep01 = f32(0.0)
            if ti > tj:
                keep01 = f32(1.0)
            acc.fill(0.0)
            for d in cutlass.range(DK, unroll=4):
                gi0 = sG[i0, d]
                gi1 = sG[i0 + 1, d]
                gj0 = sG[j0, d]
                gj1 = sG[j0 + 1, d]
                ki0 = sK[i0, d].to(f32)
                ki1 = sK[i0 + 1, d].to(f32)
                qi0 = sQ[i0, d].to(f32)
                qi1 = sQ[i0 + 1, d].to(f32)
                kj0 = sK[j0, d].to(f32)
                kj1 = sK[j0 + 1, d].to(f32)
                kf00 = kj0 * cute.math.exp2(gi0 - gj0)
                kf01 = kj1 * cute.math.exp2((gi0 - gj1) * keep01)
                kf10 = kj0 * cute.math.exp2(gi1 - gj0)
                kf11 = kj1 * cute.math.exp2(gi1 - gj1)
                acc[0] = acc[0] + ki0 * kf00
                acc[1] = acc[1] + qi0 * kf00
                acc[2] = acc[2] + ki0 * kf01
                acc[3] = acc[3] + qi0 * kf01
                acc[4] = acc[4] + ki1 * kf10
                acc[5] = acc[5] + qi1 * kf10
                acc[6] = acc[6] + ki1 * kf11
                acc[7] = acc[7] + qi1 * kf11
            for e in cutlass.range_constexpr(4):
                i = i0 + e // 2
                j = j0 + e % 2
                dot_q = acc[2 * e + 1]
                if j > i:
                    dot_q = f32(0.0)
                a_kk = f32(0.0)
                if j < i:
                    a_kk = acc[2 * e] * sBeta[i]
                sA[i, j] = a_kk
                mAqk[hv, row0 + i, j] = dot_q.to(mAqk.element_type)
        else:
            u = tidx - DIAG_TILES
            blk = u // (TRI_TILES - TILES)
            p = u % (TRI_TILES - TILES)
            hi = cutlass.Int32(1)  # p -> (lo, hi), lo < hi, over the strictly lower triangle
            for r in cutlass.range_constexpr(2, TILES):
                if p >= r * (r - 1) // 2:
                    hi = cutlass.Int32(r)
            lo = p - hi * (hi - 1) // 2
            for e in cutlass.range_constexpr(4):
                i = blk * SUB + 2 * lo + e // 2
                j = blk * SUB + 2 * hi + e % 2
                sA[i, j] = f32(0.0)
                mAqk[hv, row0 + i, j] = f32(0.0).to(mAqk.element_type)
        ii = tidx // SUB
        jj = tidx % SUB
        for bi, bj in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)):  # upper off-diagonal blocks: zero
            i = bi * SUB + ii
            j = bj * SUB + jj
            sA[i, j] = f32(0.0)
            mAqk[hv, row0 + i, j] = f32(0.0).to(mAqk.element_type)

        # ---- phase 4: off-diagonal blocks (I > J), factorised around r_I = Γ[16 I] as in v1, one
        # 16x16 block (I, J) per round: stage its right factors (and, for J = 0, the left ones).
        # Lane q of 4 adjacent lanes sums d = 32 a + b + 8 q (b < 8): with the 129-float pitch the
        # warp's 16 distinct rows x 4 lanes then fall in distinct banks.
        q4 = lane % KSPLIT
        tw = lane // KSPLIT  # tile within the warp: 2 tile rows x 4 tile columns
        ti4 = 2 * (warp // 2) + tw // 4
        tj4 = 4 * (warp % 2) + tw % 4
        for bI in cutlass.range_constexpr(1, CHUNK // SUB):
            for bJ in cutlass.range_constexpr(bI):
                cute.arch.sync_threads()  # the previous round's readers are done with the staging area
                for it in cutlass.range_constexpr(SUB * DK // THREADS):
                    e = tidx + it * THREADS
                    r = e // DK
                    d = e % DK
                    ref = sG[bI * SUB, d]
                    jr = bJ * SUB + r
                    sR[r, d] = sK[jr, d].to(f32) * cute.math.exp2(ref - sG[jr, d])
                    if cutlass.const_expr(bJ == 0):
                        il = bI * SUB + r
                        fl = cute.math.exp2(sG[il, d] - ref)
                        sLk[r, d] = sK[il, d].to(f32) * fl
                        sLq[r, d] = sQ[il, d].to(f32) * fl
                cute.arch.sync_threads()
                acc.fill(0.0)
                for da in cutlass.range_constexpr(DK // 32):
                    for db in cutlass.range_constexpr(DGROUP):
                        d = da * 32 + db + DGROUP * q4
                        lk0 = sLk[2 * ti4, d]
                        lk1 = sLk[2 * ti4 + 1, d]
                        lq0 = sLq[2 * ti4, d]
                        lq1 = sLq[2 * ti4 + 1, d]
                        kr0 = sR[2 * tj4, d]
                        kr1 = sR[2 * tj4 + 1, d]
                        acc[0] = acc[0] + lk0 * kr0
                        acc[1] = acc[1] + lq0 * kr0
                        acc[2] = acc[2] + lk0 * kr1
                        acc[3] = acc[3] + lq0 * kr1
                        acc[4] = acc[4] + lk1 * kr0
                        acc[5] = acc[5] + lq1 * kr0
                        acc[6] = acc[6] + lk1 * kr1
                        acc[7] = acc[7] + lq1 * kr1
                for e in cutlass.range_constexpr(8):  # every lane of the 4 ends with the same sums
                    part = acc[e]
                    part = part + cute.arch.shuffle_sync_bfly(part, offset=1)
                    part = part + cute.arch.shuffle_sync_bfly(part, offset=2)
                    acc[e] = part
                for e in cutlass.range_constexpr(4):  # lane q writes tile entry q
                    if q4 == e:
                        i = bI * SUB + 2 * ti4 + e // 2
                        jr = bJ * SUB + 2 * tj4 + e % 2
                        sA[i, jr] = acc[2 * e] * sBeta[i]
                        mAqk[hv, row0 + i, jr] = acc[2 * e + 1].to(mAqk.element_type)
        cute.arch.sync_threads()

        # ---- phase 5: T = (I + Akk)^-1 (threads 0..63, as v1, T now in the staging area);
        # the other threads overwrite Γ with β k 2^Γ and q with v for phase 6.
        if tidx < CHUNK:
            if cutlass.const_expr(self.inverse == "column"):
                for i in cutlass.range(CHUNK, unroll=1):
                    acc1 = f32(0.0)
                    if tidx == i:
                        acc1 = f32(1.0)
                    for jk in cutlass.range(i, unroll=4):
                        acc1 = acc1 - sA[i, jk] * sT[jk, tidx]
                    sT[i, tidx] = acc1
            else:
                # as v1 but rolled loops: fully unrolled, its hoisted loads spilled 16 bytes under
                # the 128-register bound
                base = (tidx // SUB) * SUB
                for i in cutlass.range(SUB, unroll=1):
                    acc1 = f32(0.0)
                    if tidx % SUB == i:
                        acc1 = f32(1.0)
                    for jk in cutlass.range(i, unroll=4):
                        acc1 = acc1 - sA[base + i, base + jk] * sT[base + jk, tidx]
                    sT[base + i, tidx] = acc1
                for r in cutlass.range(base, unroll=1):
                    sT[r, tidx] = f32(0.0)
        else:
            for it in cutlass.range(CHUNK * DK // (THREADS - CHUNK) + 1, unroll=1):
                e = (tidx - CHUNK) + it * (THREADS - CHUNK)
                if e < CHUNK * DK:
                    r = e // DK
                    d = e % DK
                    sG[r, d] = sBeta[r] * sK[r, d].to(f32) * cute.math.exp2(sG[r, d])
                    vv = f32(0.0)
                    if r < nvalid:
                        vv = mV[tok0 + r, hv, d].to(f32)
                    sV[r, d] = vv.to(sV.element_type)  # exact: v arrives in bf16 (supports())
        cute.arch.sync_threads()
        if cutlass.const_expr(self.inverse == "blocked"):
            for dist in cutlass.range_constexpr(1, CHUNK // SUB):
                for m in cutlass.range_constexpr(CHUNK // SUB - dist):
                    bi = m + dist
                    acc1 = f32(0.0)
                    for kk in cutlass.range_constexpr(dist * SUB):
                        acc1 = acc1 + sA[bi * SUB + ii, m * SUB + kk] * sT[m * SUB + kk, m * SUB + jj]
                    sXb[ii, m * SUB + jj] = acc1
                cute.arch.sync_threads()
                for m in cutlass.range_constexpr(CHUNK // SUB - dist):
                    bi = m + dist
                    acc1 = f32(0.0)
                    for kk in cutlass.range_constexpr(SUB):
                        acc1 = acc1 + sT[bi * SUB + ii, bi * SUB + kk] * sXb[kk, m * SUB + jj]
                    sT[bi * SUB + ii, m * SUB + jj] = -acc1
                cute.arch.sync_threads()

        # ---- phase 6: w = T (β k 2^Γ), u = T (β v); thread = rows warp + 8 m, columns lane + 32 s
        # (a warp reads one T entry per row: a broadcast; one k/v row: consecutive words)
        acc_w = cute.make_rmem_tensor(cute.make_layout(W_ROWS * W_COLS), f32)
        acc_u = cute.make_rmem_tensor(cute.make_layout(W_ROWS * W_COLS), f32)
        kx = cute.make_rmem_tensor(cute.make_layout(W_COLS), f32)
        vx = cute.make_rmem_tensor(cute.make_layout(W_COLS), f32)
        acc_w.fill(0.0)
        acc_u.fill(0.0)
        for j in cutlass.range(CHUNK, unroll=2):
            b = sBeta[j]
            for s in cutlass.range_constexpr(W_COLS):
                kx[s] = sG[j, lane + 32 * s]
                vx[s] = b * sV[j, lane + 32 * s].to(f32)
            for m in cutlass.range_constexpr(W_ROWS):
                t = sT[WARPS * m + warp, j]
                for s in cutlass.range_constexpr(W_COLS):
                    acc_w[m * W_COLS + s] = acc_w[m * W_COLS + s] + t * kx[s]
                    acc_u[m * W_COLS + s] = acc_u[m * W_COLS + s] + t * vx[s]
        for m in cutlass.range_constexpr(W_ROWS):
            i = WARPS * m + warp
            for s in cutlass.range_constexpr(W_COLS):
                mW[hv, row0 + i, lane + 32 * s] = acc_w[m * W_COLS + s].to(mW.element_type)
                mU[hv, row0 + i, lane + 32 * s] = acc_u[m * W_COLS + s].to(mU.element_type)


def fake_args(q_dtype, g_dtype, beta_dtype):
    """Placeholder pointers and sizes for a CPU compile (the kernel never runs on them)."""
    from cula.kernels.common.ptx_check import fake_ptr

    f32, bf16, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
    dts = [q_dtype, q_dtype, q_dtype, g_dtype, beta_dtype, f32, f32, i32, bf16, bf16, bf16, bf16, bf16, f32]
    aligns = [16, 16, 16, 16, 4, 4, 4, 8, 16, 16, 16, 16, 16, 16]
    ptrs = [fake_ptr(i, dt, a) for i, (dt, a) in enumerate(zip(dts, aligns))]
    return (*ptrs, i32(1000), i32(2), i32(2), i32(16), f32(0.088), f32(-5.0))


def _compile_without_driver() -> None:
    """v2's 2-CTA launch bound makes the DSL query the device's shared memory per SM at compile
    time; without a GPU (the CPU PTX check) answer it with the H200's value."""
    import torch

    if torch.cuda.is_available():
        return
    from cutlass.base_dsl.runtime import cuda as dsl_cuda

    dsl_cuda.get_device_attribute = lambda attribute, device_id=0: SMEM_PER_SM


def compile_targets():
    """CPU PTX-check targets: the most general flag set, bf16 and fp32 gate inputs."""
    from cutlass.cute.runtime import make_fake_stream

    def build(g_dtype, **flags):
        def make():
            if flags.get("variant", "v1") != "v1":
                _compile_without_driver()
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
        "v2": build(cutlass.BFloat16, **{**full, "variant": "v2"}),
        "v2_blocked_inverse": build(cutlass.BFloat16, **{**full, "variant": "v2", "inverse": "blocked"}),
        "prefetch": build(cutlass.Float32, **{**full, "prefetch_ahead": 66}),
    }

"""KDA forward, stage 2 of 2: the chunk recurrence on tensor cores (wgmma) fed by TMA.

One CTA (one warpgroup, 128 threads) per (sequence, value head, 64-wide V tile). The state is kept
transposed, ``Sᵀ: [64 v, 128 k]`` fp32, as a wgmma accumulator (64 registers per thread); a bf16 copy
of it in shared memory is the A operand of the next chunk's products. Per chunk (scratch written by
``kda_fwd_intra``, chunk-padded, so every TMA box is a full 64-row tile of one sequence):

    v_newᵀ = uᵀ − Sᵀ wᵀ              A = Sᵀ (smem bf16)  B = w   [64 tok, 128 k]   M64 N64 K128
    oᵀ     = Sᵀ qgᵀ + v_newᵀ Aqkᵀ    A = Sᵀ, B = qg;  A = v_newᵀ (smem bf16), B = Aqk  M64 N64 K128+64
    Sᵀ     = Sᵀ diag(γ) + v_newᵀ kg  A = v_newᵀ, B = kgᵀ [128 k, 64 tok]          M64 N128 K64

All operands are K-major. w, qg, Aqk and kgᵀ tiles come through a 2-stage TMA/mbarrier pipeline
(56 KB a stage) issued one chunk ahead by thread 0; u and γ are read with plain loads in the
accumulator's layout; o is written with predicated plain stores (sequence tails).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

CHUNK = 64
DK = 128
DV = 128
BV = 64  # V tile of the state per CTA
STAGES = 2
THREADS = 128


class KdaFwdRecur:
    """Compile-time configuration of the recurrence kernel."""

    def __init__(self, has_initial_state: bool, output_final_state: bool, state_v_first: bool):
        self.has_h0 = has_initial_state
        self.store_ht = output_final_state
        self.v_first = state_v_first

    def _setup(self):
        """MMA atoms and smem layouts (needs the DSL's IR context: called inside __call__)."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        kmaj = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        # 64x64 products (v_newᵀ, oᵀ) and the 64x128 state update
        self.mma_n64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, f32, (1, 1, 1), (BV, CHUNK))
        self.mma_n128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, f32, (1, 1, 1), (BV, DK))
        row = utils.LayoutEnum.ROW_MAJOR
        self.st_layout = sm90_utils.make_smem_layout_a(row, (BV, CHUNK, DK), bf16, 1)  # Sᵀ [64, 128]
        self.vt_layout = sm90_utils.make_smem_layout_a(row, (BV, DK, CHUNK), bf16, 1)  # v_newᵀ [64, 64]
        self.w_layout = sm90_utils.make_smem_layout_b(row, (BV, CHUNK, DK), bf16, STAGES)  # [64 tok, 128]
        self.aqk_layout = sm90_utils.make_smem_layout_b(row, (BV, CHUNK, CHUNK), bf16, STAGES)  # [64, 64]
        self.kgt_layout = sm90_utils.make_smem_layout_b(row, (BV, DK, CHUNK), bf16, STAGES)  # [128, 64 tok]


    @cute.jit
    def __call__(
        self,
        pW: cute.Pointer,  # [HV, NC*64, 128] bf16
        pQG: cute.Pointer,  # [HV, NC*64, 128] bf16
        pAqk: cute.Pointer,  # [HV, NC*64, 64] bf16
        pKGT: cute.Pointer,  # [HV, 128, NC*64] bf16
        pU: cute.Pointer,  # [HV, NC*64, 128] bf16
        pGam: cute.Pointer,  # [HV, NC, 128] fp32
        pChunks: cute.Pointer,  # [NC, 2] int32: first token, valid rows
        pSeq: cute.Pointer,  # [N, 2] int32: first chunk, number of chunks
        pO: cute.Pointer,  # [TT, HV, 128]
        pH0: cute.Pointer,  # [N, HV, 128, 128] fp32 (dummy when absent)
        pHT: cute.Pointer,  # [N, HV, 128, 128] fp32 (dummy when not stored)
        total_tokens: cutlass.Int32,
        num_heads_v: cutlass.Int32,
        num_chunks: cutlass.Int32,
        num_seqs: cutlass.Int32,
        stream,
    ):
        # Raw pointers + sizes cross the host boundary (see kda_fwd_intra); the scratch is viewed with
        # the head last, (rows, 128, HV), so one TMA box is a 64-row tile of one head.
        TT, HV, NC, N = total_tokens, num_heads_v, num_chunks, num_seqs
        R = NC * CHUNK
        mW = cute.make_tensor(pW, cute.make_layout((R, DK, HV), stride=(DK, 1, R * DK)))
        mQG = cute.make_tensor(pQG, cute.make_layout((R, DK, HV), stride=(DK, 1, R * DK)))
        mAqk = cute.make_tensor(pAqk, cute.make_layout((R, CHUNK, HV), stride=(CHUNK, 1, R * CHUNK)))
        mKGT = cute.make_tensor(pKGT, cute.make_layout((DK, R, HV), stride=(R, 1, DK * R)))
        mU = cute.make_tensor(pU, cute.make_layout((HV, R, DV), stride=(R * DV, DV, 1)))
        mGam = cute.make_tensor(pGam, cute.make_layout((HV, NC, DK), stride=(NC * DK, DK, 1)))
        mChunks = cute.make_tensor(pChunks, cute.make_layout((NC, 2), stride=(2, 1)))
        mSeq = cute.make_tensor(pSeq, cute.make_layout((N, 2), stride=(2, 1)))
        mO = cute.make_tensor(pO, cute.make_layout((TT, HV, DV), stride=(HV * DV, DV, 1)))
        state = cute.make_layout((N, HV, DK, DV), stride=(HV * DK * DV, DK * DV, DV, 1))
        mH0 = cute.make_tensor(pH0, state)
        mHT = cute.make_tensor(pHT, state)
        self._setup()
        w_one = cute.slice_(self.w_layout, (None, None, 0))
        aqk_one = cute.slice_(self.aqk_layout, (None, None, 0))
        kgt_one = cute.slice_(self.kgt_layout, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mW, w_one, (CHUNK, DK))
        tma_qg, tQG = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQG, w_one, (CHUNK, DK))
        tma_aqk, tAqk = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mAqk, aqk_one, (CHUNK, CHUNK))
        tma_kgt, tKGT = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKGT, kgt_one, (DK, CHUNK))
        self.tx_bytes = (
            2 * cute.size_in_bytes(cutlass.BFloat16, w_one)
            + cute.size_in_bytes(cutlass.BFloat16, aqk_one)
            + cute.size_in_bytes(cutlass.BFloat16, kgt_one)
        )

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.w_layout)], 1024]
            sQG: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.w_layout)], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.aqk_layout)], 1024]
            sKGT: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.kgt_layout)], 1024]
            sST: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.st_layout)], 1024]
            sVT: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.vt_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_w, tW, tma_qg, tQG, tma_aqk, tAqk, tma_kgt, tKGT, mU, mGam, mChunks, mSeq, mO, mH0, mHT,
            self.mma_n64, self.mma_n128,
            self.w_layout, self.aqk_layout, self.kgt_layout, self.st_layout, self.vt_layout,
        ).launch(grid=[DV // BV, HV, N], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_qg: cute.CopyAtom,
        tQG: cute.Tensor,
        tma_aqk: cute.CopyAtom,
        tAqk: cute.Tensor,
        tma_kgt: cute.CopyAtom,
        tKGT: cute.Tensor,
        mU: cute.Tensor,
        mGam: cute.Tensor,
        mChunks: cute.Tensor,
        mSeq: cute.Tensor,
        mO: cute.Tensor,
        mH0: cute.Tensor,
        mHT: cute.Tensor,
        mma_n64: cute.TiledMma,
        mma_n128: cute.TiledMma,
        w_layout: cute.ComposedLayout,
        aqk_layout: cute.ComposedLayout,
        kgt_layout: cute.ComposedLayout,
        st_layout: cute.ComposedLayout,
        vt_layout: cute.ComposedLayout,
    ):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        vtile, hv, seq = cute.arch.block_idx()
        v0 = vtile * BV
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        c_first = mSeq[seq, 0]
        n_chunks = mSeq[seq, 1]

        if warp_idx == 0:
            for atom in (tma_w, tma_qg, tma_aqk, tma_kgt):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
            tx_count=self.tx_bytes,
        )
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        sQG = storage.sQG.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        sAqk = storage.sAqk.get_tensor(aqk_layout.outer, swizzle=aqk_layout.inner)
        sKGT = storage.sKGT.get_tensor(kgt_layout.outer, swizzle=kgt_layout.inner)
        sST = storage.sST.get_tensor(st_layout.outer, swizzle=st_layout.inner)
        sVT = storage.sVT.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)

        # ---- TMA views: (tile, chunk) of this head
        gW = cute.local_tile(tW[None, None, hv], (CHUNK, DK), (None, 0))
        gQG = cute.local_tile(tQG[None, None, hv], (CHUNK, DK), (None, 0))
        gAqk = cute.local_tile(tAqk[None, None, hv], (CHUNK, CHUNK), (None, 0))
        gKGT = cute.local_tile(tKGT[None, None, hv], (DK, CHUNK), (0, None))
        one = cute.make_layout(1)
        tWs, tWg = cute.nvgpu.cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tQs, tQg = cute.nvgpu.cpasync.tma_partition(tma_qg, 0, one, cute.group_modes(sQG, 0, 2), cute.group_modes(gQG, 0, 2))
        tAs, tAg = cute.nvgpu.cpasync.tma_partition(tma_aqk, 0, one, cute.group_modes(sAqk, 0, 2), cute.group_modes(gAqk, 0, 2))
        tKs, tKg = cute.nvgpu.cpasync.tma_partition(tma_kgt, 0, one, cute.group_modes(sKGT, 0, 2), cute.group_modes(gKGT, 0, 2))

        # ---- MMA fragments
        thr64 = mma_n64.get_slice(tidx)
        thr128 = mma_n128.get_slice(tidx)
        rA_st = mma_n64.make_fragment_A(thr64.partition_A(sST))
        rB_w = mma_n64.make_fragment_B(thr64.partition_B(sW))
        rB_qg = mma_n64.make_fragment_B(thr64.partition_B(sQG))
        rA_vt = mma_n64.make_fragment_A(thr64.partition_A(sVT))
        rB_aqk = mma_n64.make_fragment_B(thr64.partition_B(sAqk))
        rA_vt2 = mma_n128.make_fragment_A(thr128.partition_A(sVT))
        rB_kgt = mma_n128.make_fragment_B(thr128.partition_B(sKGT))

        sST2 = sST[None, None, 0]
        sVT2 = sVT[None, None, 0]
        tSTs = thr128.partition_C(sST2)  # where each state accumulator element goes as bf16
        tVTs = thr64.partition_C(sVT2)
        cS = thr128.partition_C(cute.make_identity_tensor((BV, DK)))  # (v, k) coordinates
        cN = thr64.partition_C(cute.make_identity_tensor((BV, CHUNK)))  # (v, tok) coordinates
        acc_s = cute.make_rmem_tensor(cS.shape, f32)
        acc_vt = cute.make_rmem_tensor(cN.shape, f32)
        acc_ot = cute.make_rmem_tensor(cN.shape, f32)

        # ---- initial state (either layout), as Sᵀ[v, k]
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = cS[i]
            h = f32(0.0)
            if cutlass.const_expr(self.has_h0):
                if cutlass.const_expr(self.v_first):
                    h = mH0[seq, hv, v0 + vv, kk]
                else:
                    h = mH0[seq, hv, kk, v0 + vv]
            acc_s[i] = h
        self.store_bf16(acc_s, tSTs)
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()

        # ---- prologue: issue the first STAGES chunks
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(n_chunks, STAGES), unroll=1):
                self.issue(pipe, prod, c_first, tma_w, tWg, tWs, tma_qg, tQg, tQs, tma_aqk, tAg, tAs, tma_kgt, tKg, tKs)
                prod.advance()

        for ci in cutlass.range(n_chunks, unroll=1):
            c = c_first + ci
            row0 = c * CHUNK
            tok0 = mChunks[c, 0]
            nvalid = mChunks[c, 1]
            pipe.consumer_wait(cons)
            st = cons.index

            # v_newᵀ = -(Sᵀ wᵀ) + uᵀ ;  oᵀ = Sᵀ qgᵀ (issued together: both read only Sᵀ)
            cute.nvgpu.warpgroup.fence()
            mma_n64.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(cute.size(rA_st, mode=[2])):
                cute.gemm(mma_n64, acc_vt, rA_st[None, None, kb, 0], rB_w[None, None, kb, st], acc_vt)
                mma_n64.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            mma_n64.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(cute.size(rA_st, mode=[2])):
                cute.gemm(mma_n64, acc_ot, rA_st[None, None, kb, 0], rB_qg[None, None, kb, st], acc_ot)
                mma_n64.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)

            for i in cutlass.range_constexpr(cute.size(acc_vt)):
                vv, tt = cN[i]
                acc_vt[i] = mU[hv, row0 + tt, v0 + vv].to(f32) - acc_vt[i]
            self.store_bf16(acc_vt, tVTs)
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
            cute.arch.sync_threads()

            # oᵀ += v_newᵀ Aqkᵀ ;  Sᵀ = Sᵀ diag(γ) + v_newᵀ kg
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cS[i]
                acc_s[i] = acc_s[i] * mGam[hv, c, kk]
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(rA_vt, mode=[2])):
                cute.gemm(mma_n64, acc_ot, rA_vt[None, None, kb, 0], rB_aqk[None, None, kb, st], acc_ot)
            mma_n128.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(cute.size(rA_vt2, mode=[2])):
                cute.gemm(mma_n128, acc_s, rA_vt2[None, None, kb, 0], rB_kgt[None, None, kb, st], acc_s)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(cons)
            cons.advance()

            # o rows of this chunk (tokens past the sequence end are not stored)
            for i in cutlass.range_constexpr(cute.size(acc_ot)):
                vv, tt = cN[i]
                if tt < nvalid:
                    mO[tok0 + tt, hv, v0 + vv] = acc_ot[i].to(mO.element_type)
            # the bf16 copy of the new state, A operand of the next chunk; all warps are past
            # this chunk's wgmma reads of sST/sVT once the barrier below is crossed
            cute.arch.sync_threads()
            self.store_bf16(acc_s, tSTs)
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
            cute.arch.sync_threads()

            if warp_idx == 0:
                if prod.count < n_chunks:
                    self.issue(pipe, prod, c_first, tma_w, tWg, tWs, tma_qg, tQg, tQs, tma_aqk, tAg, tAs, tma_kgt, tKg, tKs)
                    prod.advance()

        if cutlass.const_expr(self.store_ht):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cS[i]
                if cutlass.const_expr(self.v_first):
                    mHT[seq, hv, v0 + vv, kk] = acc_s[i]
                else:
                    mHT[seq, hv, kk, v0 + vv] = acc_s[i]

    @cute.jit
    def store_bf16(self, acc: cute.Tensor, dst: cute.Tensor):
        """fp32 accumulator fragment -> bf16 -> its (swizzled) smem image, element for element."""
        tmp = cute.make_rmem_tensor(acc.shape, cutlass.BFloat16)
        tmp.store(acc.load().to(cutlass.BFloat16))
        cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16), tmp, dst)

    @cute.jit
    def issue(self, pipe, prod, c_first, tma_w, tWg, tWs, tma_qg, tQg, tQs, tma_aqk, tAg, tAs, tma_kgt, tKg, tKs):
        """Thread 0 of warp 0: load chunk ``c_first + prod.count`` into stage ``prod.index``."""
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        c = c_first + prod.count
        cute.copy(tma_w, tWg[None, c], tWs[None, prod.index], tma_bar_ptr=bar)
        cute.copy(tma_qg, tQg[None, c], tQs[None, prod.index], tma_bar_ptr=bar)
        cute.copy(tma_aqk, tAg[None, c], tAs[None, prod.index], tma_bar_ptr=bar)
        cute.copy(tma_kgt, tKg[None, c], tKs[None, prod.index], tma_bar_ptr=bar)
        pipe.producer_commit(prod)


def fake_args(o_dtype=cutlass.BFloat16):
    """Placeholder pointers and sizes for a CPU compile (the kernel never runs on them)."""
    from cula.kernels.common.ptx_check import fake_ptr

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    dts = [bf16, bf16, bf16, bf16, bf16, f32, i32, i32, o_dtype, f32, f32]
    aligns = [16, 16, 16, 16, 16, 16, 8, 8, 16, 16, 16]
    ptrs = [fake_ptr(i, dt, a) for i, (dt, a) in enumerate(zip(dts, aligns))]
    return (*ptrs, i32(1000), i32(2), i32(16), i32(1))


def compile_targets():
    """CPU PTX-check targets."""
    from cutlass.cute.runtime import make_fake_stream

    def build(**flags):
        def make():
            return KdaFwdRecur(**flags), (*fake_args(), make_fake_stream())
        return make

    return {
        "default": build(has_initial_state=True, output_final_state=True, state_v_first=False),
        "v_first": build(has_initial_state=True, output_final_state=True, state_v_first=True),
        "no_state": build(has_initial_state=False, output_final_state=False, state_v_first=False),
    }

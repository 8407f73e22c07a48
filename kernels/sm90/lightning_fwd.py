"""Lightning Attention prefill (forward) for Hopper (SM90a): one CuTe DSL kernel, TMA + wgmma.

    S_t = exp(-decay[hv]) S_{t-1} + k_t^T v_t        (S: [K, V] fp32 per sequence and value head)
    o_t = scale * q_t S_t

Equal to FLA 0.6.0 ``chunk_simple_gla(q, k, v, g_gamma=-decay, ...)``. Shapes: ``q, k: [B, T, H, 128]``
bf16, ``v: [B, T, HV, 128]`` bf16 (``HV`` a multiple of ``H``), ``decay: [HV]`` fp32 >= 0,
``initial_state / final_state: [N, HV, 128, 128]`` fp32, ``cu_seqlens: [N+1]`` (packed, ``B == 1``).

One CTA per work unit (sequence, value head, 64-wide V tile); it walks the sequence in 64-token chunks
with the fp32 state in registers (the wgmma accumulator of the state update). The design, the
shared-memory budget and the numerics are in ``lightning_fwd.md`` beside this file.

``python -m cula.kernels.sm90.lightning_fwd --check [--bench]`` compiles, compares with the reference
and times one shape on a GPU machine.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_ptr

from cula.kernels.common import dsl_compile
from cula.kernels.common.fast_launch import sm_count
from cula.kernels.common.tensor_cache import PerTensorCache
from cula.kernels.common.wgmma_frag import a_operand_layout as _a_operand_layout

# ---------------------------------------------------------------------------------------------------
# Constants (static for every compiled variant)
# ---------------------------------------------------------------------------------------------------
HEAD_DIM = 128  # K = V = 128: the only head size this kernel is built for
CHUNK = 64  # tokens per chunk: one wgmma M-tile, and FLA's chunk size
STAGES = 2  # Q/K/V shared-memory stages in the TMA pipeline (2 CTAs/SM fit 2 stages each)
V_TILE = 64  # default V columns per CTA: 2 CTAs per (sequence, head) doubles the parallelism
CONSUMER_THREADS = 128  # warpgroup 0 does all the math
PRODUCER_WARP = 4  # warpgroup 1's first warp issues the TMA loads; its other 3 warps idle
THREADS = 2 * CONSUMER_THREADS
CTAS_PER_SM = 2  # 2 CTAs x 8 warps: 128 registers per thread at launch, then rebalanced:
PRODUCER_REGS = 24  # the load warpgroup gives registers back ...
CONSUMER_REGS = 232  # ... to the math warpgroup: (24 + 232) x 2 CTAs x 4 warps x 32 = 64K
CONSUMER_BARRIER = 1  # named barrier id for the consumer warpgroup (0 is __syncthreads)
LOG2E = 1.4426950408889634
# What supports() answers for inputs the kernel can take: None once the GPU tests passed on the device.
VALIDATION_STATUS: str | None = None
# Launch through kernels/common/fast_launch.Launcher (prebuilt argument cells: the eager small-shape
# rows are host-bound). On since 2026-12-03: its GPU tests passed on the H200 and eager B1 T512 H64
# dropped from 0.143 to 0.020 ms (B4 T2048: 0.294 -> 0.172 ms); `lightning_fwd_check --bench` with and
# without `--fast-launch`.
FAST_LAUNCH = True

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


# ---------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------
class LightningFwdSm90:
    """Chunked Lightning prefill: one CTA per (sequence, value head, V tile), state kept on chip.

    Static configuration (one compiled kernel per combination): ``v_tile`` (32 or 64),
    ``has_initial_state``, ``store_final_state``. Token counts, heads and sequences are dynamic.
    """

    def __init__(self, v_tile: int = V_TILE, has_initial_state: bool = False,
                 store_final_state: bool = False, stages: int = STAGES):
        if v_tile not in (32, 64):
            raise ValueError(f"v_tile: expected 32 or 64, got {v_tile}")
        self.vt = v_tile
        self.n_vt = HEAD_DIM // v_tile
        self.has_init = has_initial_state
        self.store_final = store_final_state
        self.stages = stages
        # V tiles are MN-major (v contiguous): one smem row (128 B at Vt=64, 64 B at Vt=32) per token.
        self.v_row_chunks = v_tile // 8  # 16-byte chunks per smem row of a V tile
        self.o_chunks_per_row = v_tile // 8  # 16-byte chunks per output row
        # 128-byte swizzle (3 bits) for 64-wide tiles, 64-byte (2 bits) for 32-wide ones
        self.swizzle_mask = 7 if v_tile == 64 else 3

    # -------------------------------------------------------------------------------- host side --
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        decay_ptr: cute.Pointer,
        cu_ptr: cute.Pointer,
        order_ptr: cute.Pointer,
        s0_ptr: cute.Pointer,
        sf_ptr: cute.Pointer,
        total_tokens: cutlass.Int32,
        num_heads: cutlass.Int32,
        num_v_heads: cutlass.Int32,
        num_seqs: cutlass.Int32,
        scale: cutlass.Float32,
        stream,
    ):
        D = HEAD_DIM
        Vt = self.vt
        BT, H, HV = total_tokens, num_heads, num_v_heads
        # Global views: TMA walks (token, dim, head); the head stride is D, the token stride H*D.
        mQ = cute.make_tensor(q_ptr, cute.make_layout((BT, D, H), stride=(H * D, 1, D)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((BT, D, H), stride=(H * D, 1, D)))
        # V as (v, token, head): the P.V and K^T.V products read V tiles with v contiguous (MN-major).
        mV = cute.make_tensor(v_ptr, cute.make_layout((D, BT, HV), stride=(1, HV * D, D)))

        k_major = utils.LayoutEnum.ROW_MAJOR
        mn_major = utils.LayoutEnum.COL_MAJOR
        # Shared-memory layouts (swizzled wgmma canonical layouts), staged.
        q_layout = sm90_utils.make_smem_layout_a(k_major, (CHUNK, CHUNK, D), BF16, self.stages)
        k_layout = sm90_utils.make_smem_layout_b(k_major, (CHUNK, CHUNK, D), BF16, self.stages)
        v_layout = sm90_utils.make_smem_layout_b(mn_major, (CHUNK, Vt, CHUNK), BF16, self.stages)
        vd_layout = sm90_utils.make_smem_layout_b(mn_major, (CHUNK, Vt, CHUNK), BF16, 1)
        s_layout = sm90_utils.make_smem_layout_b(mn_major, (CHUNK, Vt, D), BF16, 1)
        o_layout = sm90_utils.make_smem_layout_epi(BF16, k_major, (CHUNK, Vt), 1)

        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.slice_(q_layout, (None, None, 0)), (CHUNK, D))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(k_layout, (None, None, 0)), (CHUNK, D))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(v_layout, (None, None, 0)), (Vt, CHUNK))

        kmaj = warpgroup.OperandMajorMode.K
        mnmaj = warpgroup.OperandMajorMode.MN
        # A = Q (K-major), B = K (K-major): scores Q K^T            [64 tok, 64 tok]
        mma_qk = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmaj, kmaj, F32, (1, 1, 1), (CHUNK, CHUNK))
        # A = Q, B = S (bf16 copy of the state, v contiguous): Q S   [64 tok, Vt]
        mma_qs = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmaj, mnmaj, F32, (1, 1, 1), (CHUNK, Vt))
        # A = P (registers), B = V (v contiguous): P V                [64 tok, Vt]
        mma_pv = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmaj, mnmaj, F32, (1, 1, 1), (CHUNK, Vt),
                                                   warpgroup.OperandSource.RMEM)
        # A = K^T (the K tile read d-contiguous), B = decayed V: state update   [128 d, Vt]
        mma_kv = sm90_utils.make_trivial_tiled_mma(BF16, BF16, mnmaj, mnmaj, F32, (1, 1, 1), (CHUNK, Vt))


        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(v_layout)], 1024]
            sVd: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(vd_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(s_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(o_layout)], 1024]
            load_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]

        self.shared_storage = SharedStorage
        n_units = num_seqs * HV * self.n_vt

        self.kernel(
            tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV,
            mma_qk, mma_qs, mma_pv, mma_kv,
            q_layout, k_layout, v_layout, vd_layout, s_layout, o_layout,
            o_ptr, decay_ptr, cu_ptr, order_ptr, s0_ptr, sf_ptr,
            H, HV, scale,
        ).launch(
            grid=[n_units, 1, 1],
            block=[THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=CTAS_PER_SM,
        )

    # ------------------------------------------------------------------------------ device side --
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        tma_mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tma_mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tma_mV: cute.Tensor,
        mma_qk: cute.TiledMma,
        mma_qs: cute.TiledMma,
        mma_pv: cute.TiledMma,
        mma_kv: cute.TiledMma,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        vd_layout: cute.ComposedLayout,
        s_layout: cute.ComposedLayout,
        o_layout: cute.ComposedLayout,
        o_ptr: cute.Pointer,
        decay_ptr: cute.Pointer,
        cu_ptr: cute.Pointer,
        order_ptr: cute.Pointer,
        s0_ptr: cute.Pointer,
        sf_ptr: cute.Pointer,
        H: cutlass.Int32,
        HV: cutlass.Int32,
        scale: cutlass.Float32,
    ):
        D = HEAD_DIM
        Vt = self.vt
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        unit, _, _ = cute.arch.block_idx()

        # ---- shared memory
        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        # K^T view of the same bytes: (d, token, stage), the MN-major A operand of the state update
        sKt = storage.sK.get_tensor(cute.select(k_layout.outer, mode=[1, 0, 2]), swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sVd = storage.sVd.get_tensor(vd_layout.outer, swizzle=vd_layout.inner)
        sS = storage.sS.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        # (d, v) view of the state copy, for writing it from the state accumulator
        sS_dv = storage.sS.get_tensor(cute.select(s_layout.outer, mode=[1, 0, 2]), swizzle=s_layout.inner)
        sO = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)

        # raw (unswizzled) pointers for the byte-level passes over V tiles and the output tile
        sv_base = storage.sV.data_ptr()
        svd_base = storage.sVd.data_ptr()
        so_base = storage.sO.data_ptr()
        mbar_ptr = storage.load_mbar.data_ptr()

        tx_bytes = (CHUNK * D + CHUNK * D + CHUNK * Vt) * 2  # bytes one stage's three TMA loads deliver
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar_ptr,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=tx_bytes,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        # One if/else: each warpgroup's role is one branch, so setmaxnreg applies cleanly.
        if warp_idx >= CONSUMER_THREADS // 32:
            cute.arch.warpgroup_reg_dealloc(PRODUCER_REGS)
            if warp_idx == PRODUCER_WARP:
                seq, hv, vt, h, bos, seq_len, n_chunks, g = self.decode_unit(
                    cu_ptr, order_ptr, decay_ptr, H, HV)
                # ============================ producer: TMA loads of Q, K, V chunk tiles ============
                cpasync.prefetch_descriptor(tma_q)
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                # Tiles start at the sequence's first token (any offset: TMA takes element coordinates).
                gQ = cute.flat_divide(cute.domain_offset((bos, 0, 0), tma_mQ), (CHUNK, D))  # (64,128,nT,1,H)
                gK = cute.flat_divide(cute.domain_offset((bos, 0, 0), tma_mK), (CHUNK, D))
                gV = cute.flat_divide(cute.domain_offset((0, bos, 0), tma_mV), (Vt, CHUNK))  # (Vt,64,nV,nT,HV)
                tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                                   cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                                   cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                   cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for c in cutlass.range(n_chunks, unroll=1):
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    cute.copy(tma_q, tQgQ[None, c, 0, h], tQsQ[None, prod.index], tma_bar_ptr=bar)
                    cute.copy(tma_k, tKgK[None, c, 0, h], tKsK[None, prod.index], tma_bar_ptr=bar)
                    cute.copy(tma_v, tVgV[None, vt, c, hv], tVsV[None, prod.index], tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()
        else:
            # ============================ consumer warpgroup: all the math =======================
            cute.arch.warpgroup_reg_alloc(CONSUMER_REGS)
            # decoded after the register split: values live across it would be spilled
            seq, hv, vt, h, bos, seq_len, n_chunks, g = self.decode_unit(cu_ptr, order_ptr, decay_ptr, H, HV)
            thr_qk = mma_qk.get_slice(tidx)
            thr_qs = mma_qs.get_slice(tidx)
            thr_pv = mma_pv.get_slice(tidx)
            thr_kv = mma_kv.get_slice(tidx)
            tQKrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, 8, STAGES)
            tQKrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, 8, STAGES)
            tQSrQ = thr_qs.make_fragment_A(thr_qs.partition_A(sQ))  # (MMA, 1, 8, STAGES)
            tQSrS = thr_qs.make_fragment_B(thr_qs.partition_B(sS))  # (MMA, 1, 8, 1)
            tPVrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, 4, STAGES)
            tKVrK = thr_kv.make_fragment_A(thr_kv.partition_A(sKt))  # (MMA, 2, 4, STAGES)
            tKVrVd = thr_kv.make_fragment_B(thr_kv.partition_B(sVd))  # (MMA, 1, 4, 1)

            acc_qk = thr_qk.make_fragment_C(thr_qk.partition_shape_C((CHUNK, CHUNK)))
            acc_o = thr_qs.make_fragment_C(thr_qs.partition_shape_C((CHUNK, Vt)))
            acc_s = thr_kv.make_fragment_C(thr_kv.partition_shape_C((D, Vt)))
            # P in the register A-operand layout of the P.V product (same registers as a C fragment)
            rP = cute.make_rmem_tensor(_a_operand_layout(acc_qk.layout), BF16)
            rP_as_c = cute.make_tensor(rP.iterator, acc_qk.layout)
            rO = cute.make_rmem_tensor(acc_o.layout, BF16)
            rS = cute.make_rmem_tensor(acc_s.layout, BF16)

            # coordinates (row, col) of each accumulator element held by this thread
            cQK = thr_qk.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
            cO = thr_qs.partition_C(cute.make_identity_tensor((CHUNK, Vt)))
            cS = thr_kv.partition_C(cute.make_identity_tensor((D, Vt)))
            # register -> smem copies of bf16 accumulators through stmatrix (handles the swizzle)
            st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BF16)
            st_s = cute.make_tiled_copy_C(st_atom, mma_kv)
            st_o = cute.make_tiled_copy_C(st_atom, mma_qs)
            tSsS = st_s.get_slice(tidx).partition_D(sS_dv[None, None, 0])
            tSrS = st_s.retile(rS)
            tOsO = st_o.get_slice(tidx).partition_D(sO[None, None, 0])
            tOrO = st_o.retile(rO)

            # ---- initial state
            state_base = (cutlass.Int64(seq) * HV + hv) * (D * D) + vt * Vt
            if cutlass.const_expr(self.has_init):
                g_s0 = cute.make_tensor(s0_ptr + state_base, cute.make_layout((D, Vt), stride=(D, 1)))
                t_s0 = thr_kv.partition_C(g_s0)
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[e] = t_s0[e]
            else:
                acc_s.fill(0.0)
            rS.store(acc_s.load().to(BF16))
            cute.copy(st_s, tSrS, tSsS)
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMER_THREADS)

            row_stride_o = cutlass.Int64(HV) * D
            o_head = o_ptr + (cutlass.Int64(hv) * D + vt * Vt)

            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for c in cutlass.range(n_chunks, unroll=1):
                n_valid = cutlass.min(seq_len - c * CHUNK, CHUNK)
                pipe.consumer_wait(cons)
                stage = cons.index

                # -- MMA 1+2: scores Q K^T and inter-chunk Q S (both read Q; S is the bf16 state copy)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tQKrQ, mode=[2])):
                    mma_qk.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(mma_qk, acc_qk, tQKrQ[None, None, kb, stage], tQKrK[None, None, kb, stage], acc_qk)
                for kb in cutlass.range_constexpr(cute.size(tQSrQ, mode=[2])):
                    mma_qs.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(mma_qs, acc_o, tQSrQ[None, None, kb, stage], tQSrS[None, None, kb, 0], acc_o)
                warpgroup.commit_group()

                # -- while they run: V~ = diag(w) V with w_j = exp2(g (n-1-j)), 0 for j >= n (tail)
                self.decay_v_tile(sv_base, svd_base, stage, tidx, g, n_valid)
                cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMER_THREADS)
                warpgroup.wait_group(0)

                # -- P = scale * (Q K^T) * exp2(g (i-j)) on i >= j; O rows scaled by scale*exp2(g (i+1))
                self.mask_scores(acc_qk, cQK, g, scale)
                rP_as_c.store(acc_qk.load().to(BF16))
                self.scale_rows(acc_o, cO, g, scale)
                chunk_decay = cute.math.exp2(g * n_valid.to(F32), fastmath=True)
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[e] = acc_s[e] * chunk_decay

                # -- MMA 3+4: O += P V (A from registers); S = S*exp2(g n) + K^T V~
                warpgroup.fence()
                mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(rP, mode=[2])):
                    cute.gemm(mma_pv, acc_o, rP[None, None, kb], tPVrV[None, None, kb, stage], acc_o)
                mma_kv.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(tKVrK, mode=[2])):
                    cute.gemm(mma_kv, acc_s, tKVrK[None, None, kb, stage], tKVrVd[None, None, kb, 0], acc_s)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pipe.consumer_release(cons)
                cons.advance()

                # -- epilogue: O -> bf16 -> sO (swizzled rows), S -> bf16 -> sS (next chunk's Q S)
                rO.store(acc_o.load().to(BF16))
                cute.copy(st_o, tOrO, tOsO)
                rS.store(acc_s.load().to(BF16))
                cute.copy(st_s, tSrS, tSsS)
                cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMER_THREADS)
                # rows past the sequence end belong to the next sequence: never written
                row0 = cutlass.Int64(bos + c * CHUNK)
                self.copy_o_out(so_base, o_layout, o_head, row0, row_stride_o, tidx, n_valid)

            # ---- final state
            if cutlass.const_expr(self.store_final):
                g_sf = cute.make_tensor(sf_ptr + state_base, cute.make_layout((D, Vt), stride=(D, 1)))
                t_sf = thr_kv.partition_C(g_sf)
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    t_sf[e] = acc_s[e]

    # ------------------------------------------------------------------------- device helpers --
    @cute.jit
    def decode_unit(self, cu_ptr, order_ptr, decay_ptr, H, HV):
        """This CTA's work unit -> (seq, value head, V tile, q/k head, first token, length, chunks, g).

        Units are numbered sequence-major over the longest-first order[] (so the longest sequences start
        first) and V-tile-minor (the CTAs sharing one head's Q/K tiles run side by side and share L2).
        g = -decay * log2(e): every decay factor in the kernel is exp2(g * distance), distance >= 0.
        """
        unit, _, _ = cute.arch.block_idx()
        per_seq = HV * self.n_vt
        rank = unit // per_seq
        rem = unit - rank * per_seq
        hv = rem // self.n_vt
        vt = rem - hv * self.n_vt
        h = hv // (HV // H)
        order = cute.make_tensor(order_ptr, cute.make_layout(rank + 1))
        seq = order[rank]
        cu = cute.make_tensor(cu_ptr, cute.make_layout(seq + 2))
        bos = cu[seq]
        seq_len = cu[seq + 1] - bos
        n_chunks = (seq_len + (CHUNK - 1)) // CHUNK
        decay_t = cute.make_tensor(decay_ptr, cute.make_layout(hv + 1))
        g = -decay_t[hv] * LOG2E
        return seq, hv, vt, h, bos, seq_len, n_chunks, g

    @cute.jit
    def decay_v_tile(self, sv_base, svd_base, stage, tidx, g, n_valid):
        """sVd[j, :] = exp2(g (n-1-j)) sV[stage][j, :] for tokens j < n, 0 otherwise (16-byte chunks).

        Works on raw bytes: both tiles share one swizzled layout, and a swizzle only permutes the
        16-byte chunks inside one smem row, so the token of a chunk is its row: (chunk // cpr) % 64.
        """
        Vt = self.vt
        src_stage = sv_base + stage * (CHUNK * Vt)
        for i in cutlass.range_constexpr(CHUNK * Vt // 8 // CONSUMER_THREADS):
            q = tidx + i * CONSUMER_THREADS
            tok = (q // self.v_row_chunks) % CHUNK
            off = cute.assume(q * 8, divby=8)
            src = cute.make_tensor(src_stage + off, cute.make_layout(8))
            dst = cute.make_tensor(svd_base + off, cute.make_layout(8))
            w = cute.math.exp2(g * (n_valid - 1 - tok).to(F32), fastmath=True)
            if tok >= n_valid:
                w = F32(0.0)
            x = src.load().to(F32) * w
            dst.store(x.to(BF16))

    @cute.jit
    def mask_scores(self, acc_qk, coords, g, scale):
        """acc[i, j] <- scale * acc[i, j] * exp2(g (i - j)) for j <= i, else 0 (the decay mask)."""
        for e in cutlass.range_constexpr(cute.size(acc_qk)):
            i, j = coords[e]
            val = acc_qk[e] * scale * cute.math.exp2(g * (i - j).to(F32), fastmath=True)
            if j > i:
                val = F32(0.0)
            acc_qk[e] = val

    @cute.jit
    def scale_rows(self, acc_o, coords, g, scale):
        """acc[i, :] <- scale * exp2(g (i+1)) acc[i, :]: decay of the inter-chunk term q_i S."""
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            i, _ = coords[e]
            acc_o[e] = acc_o[e] * (scale * cute.math.exp2(g * (i + 1).to(F32), fastmath=True))

    @cute.jit
    def copy_o_out(self, so_base, o_layout, o_head, row0, row_stride, tidx, n_valid):
        """sO -> global o rows [row0, row0 + n): 16-byte vectors, 8 threads per 128-byte row.

        sO is a swizzled [64, Vt] tile; the physical address of a 16-byte chunk is its logical offset
        with the byte swizzle applied (bits [4, 4+B) ^= bits [7, 7+B)), which keeps the chunk whole.
        """
        Vt = self.vt
        for i in cutlass.range_constexpr(CHUNK * Vt // 8 // CONSUMER_THREADS):
            q = tidx + i * CONSUMER_THREADS
            r = q // self.o_chunks_per_row
            cc = q - r * self.o_chunks_per_row
            if r < n_valid:
                lin = cute.crd2idx((r, cc * 8, 0), o_layout.outer) * 2  # bytes
                phys = lin ^ (((lin >> 7) & self.swizzle_mask) << 4)
                src = cute.make_tensor(so_base + cute.assume(phys // 2, divby=8), cute.make_layout(8))
                dst_off = cute.assume((row0 + r) * row_stride + cc * 8, divby=8)
                dst = cute.make_tensor(o_head + dst_off, cute.make_layout(8))
                dst.store(src.load())


# ---------------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------------
_COMPILED: dict[tuple, Callable] = {}
_AUX: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _gmem_ptr(t: torch.Tensor, dtype, align: int = 16):
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _compile_key(v_tile: int, has_init: bool, store_final: bool) -> tuple:
    return (v_tile, has_init, store_final, STAGES)


def _compile(v_tile: int, has_init: bool, store_final: bool, args: tuple) -> Callable:
    key = _compile_key(v_tile, has_init, store_final)
    fn = _COMPILED.get(key)
    if fn is None:
        kern = LightningFwdSm90(v_tile, has_init, store_final)
        fn = dsl_compile.compile(kern, *args)  # (cute.compile without source-text lookups: the same PTX)
        _COMPILED[key] = fn
    return fn


def _fixed_length_aux(B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens and the (identity) longest-first order for B equal sequences, cached per shape."""
    key = (B, T, str(device))
    aux = _AUX.get(key)
    if aux is None:
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * T
        order = torch.arange(B, device=device, dtype=torch.int32)
        aux = (cu, order)
        from cula.kernels.common.fast_launch import stream_capturing

        if not stream_capturing():  # made inside a capture, these hold their values only once it runs
            _AUX[key] = aux
    return aux


#: The varlen aux of recent cu_seqlens tensors: the int32 copy and the longest-first order (an argsort:
#: several kernel launches) are made once per tensor and version.
_VARLEN_AUX = PerTensorCache()


def _varlen_aux(cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 cu_seqlens on ``device`` and the sequences longest first (stable), cached per tensor."""
    hit = _VARLEN_AUX.get(cu_seqlens, str(device))
    if hit is not None:
        return hit
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    order = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
    return _VARLEN_AUX.put(cu_seqlens, str(device), (cu, order))


def _choose_v_tile(num_seqs: int, num_v_heads: int, device) -> int:
    """64-wide V tiles (2 CTAs per sequence and head) unless that fills less than half the SMs; then
    32-wide tiles double the CTAs (each re-reads Q and K, mostly from L2)."""
    return 32 if num_seqs * num_v_heads * (HEAD_DIM // 64) < sm_count(device) // 2 else V_TILE


def _check_inputs(q, k, v, decay, scale, initial_state, cu_seqlens) -> None:
    """Raise ValueError for malformed inputs (argument, what was expected, what was given)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, T, heads, dim], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v: expected HV a multiple of H = {H}, got HV = {HV}")
    if not isinstance(decay, torch.Tensor) or decay.numel() != HV:
        raise ValueError(f"decay: expected a tensor of {HV} elements [HV], got "
                         f"{getattr(decay, 'shape', type(decay).__name__)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"q: expected B == 1 with cu_seqlens, got B = {B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        expected = (N, HV, K, v.shape[3])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state: expected shape {expected}, got {tuple(initial_state.shape)}")


def supports(q=None, k=None, v=None, decay=None, scale=None, initial_state=None,
             output_final_state=False, cu_seqlens=None, **_ignored) -> str | None:
    """None when this kernel can run these inputs, else the reason it cannot (the dispatcher falls back).

    Shape and dtype reasons come first (they hold on any machine), device reasons after.
    """
    if q is None or k is None or v is None or decay is None:
        return "q, k, v and decay are required"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return f"{name} is not 4-D"
        if t.dtype != torch.bfloat16:
            return f"{name} dtype {t.dtype} (the kernel is built for bfloat16)"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"head dims K={q.shape[-1]}, V={v.shape[-1]} (the kernel is built for {HEAD_DIM})"
    if q.shape[2] == 0 or v.shape[2] % q.shape[2] != 0:
        return "HV is not a multiple of H"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"initial_state dtype {initial_state.dtype} (the kernel keeps a float32 state)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            return f"{name} is not on a CUDA device"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"compute capability {major}.x (the kernel is built for sm_90a)"
    return VALIDATION_STATUS


def lightning_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    v_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention prefill on the SM90 kernel.

    Args:
        q, k: ``[B, T, H, 128]`` bf16.  v: ``[B, T, HV, 128]`` bf16, ``HV % H == 0``.
        decay: ``[HV]`` fp32 (>= 0); the per-token state factor is ``exp(-decay)``.
        scale: defaults to ``128 ** -0.5``.
        initial_state: ``[N, HV, 128, 128]`` fp32 or None.  output_final_state: return the final state.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (``B == 1``) or None.
        out: optional preallocated ``o`` (contiguous bf16 ``[B, T, HV, 128]``); tests pass a poisoned
            one to prove every element is written.
        v_tile: V columns per CTA (32 or 64); None picks by the amount of parallel work.
    Returns:
        ``o: [B, T, HV, 128]`` bf16 and ``final_state: [N, HV, 128, 128]`` fp32 (or None).
    """
    _check_inputs(q, k, v, decay, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v = _dense(q), _dense(k), _dense(v)
    decay = decay.reshape(HV).to(device=q.device, dtype=torch.float32).contiguous()
    if out is not None:
        if out.shape != (B, T, HV, HEAD_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous bf16 tensor {(B, T, HV, HEAD_DIM)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        o = out
    else:
        o = torch.empty(B, T, HV, HEAD_DIM, device=q.device, dtype=torch.bfloat16)
    if N == 0 or B * T == 0:
        # no tokens: nothing to launch; the state passes through unchanged
        final = None
        if output_final_state:
            final = (initial_state.to(torch.float32).clone() if initial_state is not None else
                     torch.zeros(N, HV, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32))
        return o, final
    final = (torch.empty(N, HV, HEAD_DIM, HEAD_DIM, device=q.device, dtype=torch.float32)
             if output_final_state else None)
    if cu_seqlens is None:
        cu, order = _fixed_length_aux(B, T, q.device)
    else:
        cu, order = _varlen_aux(cu_seqlens, q.device)
    s0 = _dense(initial_state.to(torch.float32)) if initial_state is not None else None
    v_tile = v_tile or _choose_v_tile(N, HV, q.device)
    dummy = o  # any 16-byte aligned device pointer for the state pointers a variant never touches
    if FAST_LAUNCH:
        # the same arguments as plain values, in the order of _launch_specs()
        _launcher(v_tile, s0 is not None, output_final_state)(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), decay.data_ptr(), cu.data_ptr(),
            order.data_ptr(), (s0 if s0 is not None else dummy).data_ptr(),
            (final if final is not None else dummy).data_ptr(), B * T, H, HV, N, scale,
            _stream_handle(q.device))
        return o, final
    args = (
        _gmem_ptr(q, BF16), _gmem_ptr(k, BF16), _gmem_ptr(v, BF16), _gmem_ptr(o, BF16),
        _gmem_ptr(decay, F32, 4), _gmem_ptr(cu, cutlass.Int32, 4), _gmem_ptr(order, cutlass.Int32, 4),
        _gmem_ptr(s0 if s0 is not None else dummy, F32), _gmem_ptr(final if final is not None else dummy, F32),
        cutlass.Int32(B * T), cutlass.Int32(H), cutlass.Int32(HV), cutlass.Int32(N), cutlass.Float32(scale),
        _current_stream(),
    )
    fn = _compile(v_tile, s0 is not None, output_final_state, args)
    fn(*args)
    return o, final


def _launch_specs():
    """What each runtime argument of the host function is (fast_launch.ArgSpec), in order."""
    from cula.kernels.common.fast_launch import ArgSpec

    ptrs = [(BF16, 16)] * 4 + [(F32, 4), (cutlass.Int32, 4), (cutlass.Int32, 4), (F32, 16), (F32, 16)]
    return (*(ArgSpec("ptr", d, a) for d, a in ptrs), *(ArgSpec("i32") for _ in range(4)),
            ArgSpec("f32"), ArgSpec("stream"))


_LAUNCHERS: dict[tuple, Callable] = {}


def _launcher(v_tile: int, has_init: bool, store_final: bool):
    key = _compile_key(v_tile, has_init, store_final)
    hit = _LAUNCHERS.get(key)
    if hit is None:
        from cula.kernels.common.fast_launch import compile_launcher

        hit = compile_launcher(LightningFwdSm90(v_tile, has_init, store_final), _launch_specs())
        _LAUNCHERS[key] = hit
    return hit


def _stream_handle(device) -> int:
    from cula.kernels.common.fast_launch import current_stream_handle

    return current_stream_handle(device.index if device.index is not None else torch.cuda.current_device())


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (TMA descriptors and 16-byte vector accesses need both)."""
    t = t.contiguous()
    if t.data_ptr() % 16 != 0:
        t = t.clone()
    return t


def _current_stream():
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)


# ---------------------------------------------------------------------------------------------------
# CPU compile targets (cula.kernels.common.ptx_check)
# ---------------------------------------------------------------------------------------------------
def _fake_args(v_tile: int = V_TILE):
    import cuda.bindings.driver as cuda_driver

    def ptr(dtype, addr):
        return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16 if dtype.width >= 16 else 4)

    base = 1 << 32
    return (
        ptr(BF16, base), ptr(BF16, base + (1 << 28)), ptr(BF16, base + (2 << 28)), ptr(BF16, base + (3 << 28)),
        make_ptr(F32, base + (4 << 28), cute.AddressSpace.gmem, assumed_align=4),
        make_ptr(cutlass.Int32, base + (5 << 28), cute.AddressSpace.gmem, assumed_align=4),
        make_ptr(cutlass.Int32, base + (6 << 28), cute.AddressSpace.gmem, assumed_align=4),
        ptr(F32, base + (7 << 28)), ptr(F32, base + (8 << 28)),
        cutlass.Int32(4096), cutlass.Int32(64), cutlass.Int32(64), cutlass.Int32(2), cutlass.Float32(0.088),
        cuda_driver.CUstream(0),
    )


def _allow_compile_without_driver() -> None:
    """On a machine without a GPU, answer the DSL's one device query (shared memory per SM, used to
    set the carveout for 2 CTAs/SM) with the H100/H200 value so the compile-only check can run."""
    if torch.cuda.is_available():
        return
    from cutlass.base_dsl.runtime import cuda as dsl_cuda

    dsl_cuda.get_device_attribute = lambda attribute, device_id=0: 233472


def compile_targets() -> dict[str, Callable[[], tuple]]:
    """Named builders of (jit entry, args) for the CPU PTX check."""

    def build(v_tile: int, has_init: bool, store_final: bool):
        def make():
            _allow_compile_without_driver()
            return LightningFwdSm90(v_tile, has_init, store_final), _fake_args(v_tile)

        return make

    def build_fast(v_tile: int, has_init: bool, store_final: bool):
        def make():  # what _launcher compiles: placeholder values of _launch_specs()
            from cula.kernels.common.fast_launch import compile_args

            _allow_compile_without_driver()
            return LightningFwdSm90(v_tile, has_init, store_final), tuple(compile_args(_launch_specs()))

        return make

    return {
        "default": build(V_TILE, False, False),
        "state": build(V_TILE, True, True),
        "vt32": build(32, True, True),
        "fast_launch_state": build_fast(V_TILE, True, True),
    }


if __name__ == "__main__":
    import sys

    from cula.kernels.sm90 import lightning_fwd_check

    raise SystemExit(lightning_fwd_check.main(sys.argv[1:]))

"""KDA decode (T <= 8 tokens per sequence) on Hopper: the fp32 state stays in registers for all tokens.

Per value head, with the per-key-dim decay ``a_t = exp(g_t)`` (g after the in-kernel gate)::

    S' = diag(a_t) S              (K-first S: [K, V]; V-first: S^T)
    u  = beta_t (v_t - k_t^T S')
    S  = S' + k_t u^T
    o_t = (scale q_t)^T S = (scale q_t)^T S' + (scale q_t . k_t) u

The last form lets one warp reduction give both ``k^T S'`` and ``q^T S'`` (FLA's fused_recurrent_kda
reduces twice). Numerics: fp32 throughout; the state is read once and written once per call.

Work split: one CTA of 4 warps per (batch row, value head, 32 values of V), or of 2 / 1 warps when the
batch is too small to give the 132 SMs one CTA each (``pick_warps``); each warp owns 8 values of V and
all of K, so every reduction over K is a warp shuffle (no shared-memory round trip per token):

- K-first ``[K, V]`` (V contiguous): lane = 2 * la + lb; a thread holds rows ``la*K/16 .. +K/16`` x 4
  columns; a warp load covers 16 rows x 32 contiguous bytes. Reduction over the 16 ``la`` lanes.
- V-first ``[V, K]`` (K contiguous): lane = 16 * la + lb; a thread holds 4 V rows x (K/64 chunks of 4
  K); a warp load covers 2 rows x 256 contiguous bytes. Reduction over the 16 ``lb`` lanes.

Every state access is a 16-byte ``ld.global.v4`` / ``st.global.v4``. Before the token loop the CTA
stages the per-token vectors in shared memory, computed once per CTA: the gate (softplus or
lower-bound sigmoid of ``g + dt_bias`` scaled by ``exp(A_log)``) as the decay factor, l2-normalised and
scaled q, normalised k, ``q.k``, the beta sigmoid and the CTA's values of v (token t is prepared by
warp ``t % warps``, which issues the loads of all its tokens before any of the math). The state loads are
issued before that prologue, so its latency hides under theirs.

State pool: with ``state_indices`` row b reads slot ``state_indices[b]`` (negative: the row is skipped,
its outputs are zero, its final state is zero when written out of place, and its slot is untouched);
``inplace`` writes the new state back into that slot.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import cutlass
import cutlass.cute as cute
import torch

from cula.kernels.common.decode_host import (
    ACT_DTYPES,
    DecodeRunner,
    INPLACE,
    MAX_T,
    V_ALIGN,
    V_PER_WARP,
    WARP_CHOICES,
    cached_runner,
    check_out,
    check_pool,
    cuda_tensors,
    decode_dims as _dims,
    cutlass_dtype,
    expect_numel,
    expect_shape,
    pick_warps,
    state_reason,
)
from cula.kernels.common.decode_tile import butterfly_sum, load1, vec, warp_sum
from cula.kernels.common.fast_launch import ArgSpec, compile_launcher, stream_query

HEAD_DIMS_K = (64, 128, 256)  # K: 16 lanes x K/16 rows (K-first) or 16 lanes x 4 x K/64 (V-first)
L2NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum(x^2) + eps)
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it, as FLA's
#: Flipped to True once tests/test_kernel_kda_decode.py passed on the H200 (supports() says so until then).
GPU_VALIDATED = True


class KdaDecode:
    """Compile-time configuration of the KDA decode kernel (head dims, layout and the in-kernel flags)."""

    def __init__(
        self,
        K: int,
        V: int,
        state_v_first: bool,
        use_qk_l2norm: bool,
        use_gate: bool,
        has_a_log: bool,
        has_dt_bias: bool,
        use_lower_bound: bool,
        use_beta_sigmoid: bool,
        allow_neg_eigval: bool,
        has_initial_state: bool,
        store_state: bool,
        inplace: bool,
        has_indices: bool,
        warps: int = 4,
    ):
        assert K in HEAD_DIMS_K and V % V_ALIGN == 0 and warps in WARP_CHOICES
        self.K, self.V = K, V
        self.v_first = state_v_first
        self.use_qk_l2norm = use_qk_l2norm
        self.use_gate = use_gate
        self.has_a_log = has_a_log
        self.has_dt_bias = has_dt_bias
        self.use_lower_bound = use_lower_bound
        self.use_beta_sigmoid = use_beta_sigmoid
        self.beta_mult = 2.0 if allow_neg_eigval else 1.0
        self.has_h0 = has_initial_state
        self.store_state = store_state
        self.inplace = inplace
        self.has_indices = has_indices
        self.kpl = K // 32  # prologue: K elements per lane
        self.rows = K // 16  # K-first: state rows per thread
        self.chunks = K // 64  # V-first: 4-wide K vectors per thread and V row
        self.warps = warps
        self.v_cta = V_PER_WARP * warps  # values of V per CTA
        # prologue: jobs (tokens) per warp (token t goes to warp t % warps)
        self.slots = -(-MAX_T // warps)

    # ---------------------------------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self,
        pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pG: cute.Pointer, pBeta: cute.Pointer,
        pALog: cute.Pointer, pDtBias: cute.Pointer, pH0: cute.Pointer, pHt: cute.Pointer,
        pO: cute.Pointer, pIdx: cute.Pointer,
        B: cutlass.Int32, T: cutlass.Int32, H: cutlass.Int32, HV: cutlass.Int32,
        scale: cutlass.Float32, lower_bound: cutlass.Float32,
        stream,
    ):
        self.kernel(
            pQ, pK, pV, pG, pBeta, pALog, pDtBias, pH0, pHt, pO, pIdx, T, H, HV, scale, lower_bound,
        ).launch(grid=[self.V // self.v_cta, HV, B], block=[32 * self.warps, 1, 1], stream=stream)

    # -------------------------------------------------------------------------------------- device

    @cute.kernel
    def kernel(
        self,
        pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pG: cute.Pointer, pBeta: cute.Pointer,
        pALog: cute.Pointer, pDtBias: cute.Pointer, pH0: cute.Pointer, pHt: cute.Pointer,
        pO: cute.Pointer, pIdx: cute.Pointer,
        T: cutlass.Int32, H: cutlass.Int32, HV: cutlass.Int32,
        scale: cutlass.Float32, lower_bound: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, hv, b = cute.arch.block_idx()
        slot = cutlass.Int64(b)
        if cutlass.const_expr(self.has_indices):
            slot = cutlass.Int64(load1(pIdx, b))
        if slot >= 0:
            self.run_row(pQ, pK, pV, pG, pBeta, pALog, pDtBias, pH0, pHt, pO, pIdx,
                         tidx, vs, hv, b, slot, T, H, HV, scale, lower_bound)
        else:
            self.skip_row(pHt, pO, tidx, vs, hv, b, T, HV)

    def lane_layout(self, tidx):
        """(warp, lane, la, lb, first V index within the CTA) of this thread's slice of the state tile."""
        warp = tidx // 32
        lane = tidx % 32
        if self.v_first:
            la, lb = lane // 16, lane % 16
            v0 = warp * V_PER_WARP + la * 4
        else:
            la, lb = lane // 2, lane % 2
            v0 = warp * V_PER_WARP + lb * 4
        return warp, lane, la, lb, v0

    def tile_offset(self, la, lb, v0, m: int, c: int):
        """Element offset (within one head's state) of the thread's 4-vector ``(m, c)``.

        K-first: row ``la*rows + m``, columns ``v0 .. v0+3`` (``c`` unused). V-first: V row ``v0 + m``,
        K ``c*64 + lb*4 .. +3``. ``v0`` already includes the CTA's V offset.
        """
        if self.v_first:
            return (v0 + m) * self.K + c * 64 + lb * 4
        return (la * self.rows + m) * self.V + v0

    def tile_shape(self) -> tuple[int, int]:
        """(vectors along the non-contiguous axis, vectors along the contiguous axis) per thread."""
        if self.v_first:
            return 4, self.chunks
        return self.rows, 1

    @cute.jit
    def run_row(self, pQ, pK, pV, pG, pBeta, pALog, pDtBias, pH0, pHt, pO, pIdx,
                tidx, vs, hv, b, slot, T, H, HV, scale, lower_bound):
        warp, lane, la, lb, v0w = self.lane_layout(tidx)
        v0 = vs * self.v_cta + v0w
        hq = hv // (HV // H)
        # ---- 1. issue the state loads first: their latency covers the prologue below
        state = self.load_state(pH0, slot, hv, HV, la, lb, v0)
        # ---- 2. prologue: per-token vectors in shared memory, once per CTA
        smem = self.prologue(pQ, pK, pV, pG, pBeta, pALog, pDtBias, warp, lane, vs, hv, hq, b, T, H, HV, scale,
                             lower_bound)
        cute.arch.sync_threads()
        # ---- 3. the tokens, in order, on the register-resident state; 4. the state back
        self.finish_row(state, smem, pHt, pO, la, lb, v0w, v0, hv, b, slot, T, HV)

    @cute.jit
    def load_state(self, pH0, slot, hv, HV, la, lb, v0):
        """The thread's slice of pool slot ``slot``'s state, as 16-byte loads (zeros without h0)."""
        f32 = cutlass.Float32
        na, nb = self.tile_shape()
        state = cute.make_rmem_tensor(cute.make_layout((4, nb, na), stride=(1, 4, 4 * nb)), f32)
        head_in = (slot * HV + hv) * (self.K * self.V)
        if cutlass.const_expr(self.has_h0):
            for m in cutlass.range_constexpr(na):
                for c in cutlass.range_constexpr(nb):
                    cute.autovec_copy(vec(pH0, head_in + self.tile_offset(la, lb, v0, m, c), 4, 4),
                                      state[None, c, m])
        else:
            for e in cutlass.range_constexpr(4 * nb * na):
                state[e] = f32(0.0)
        return state

    @cute.jit
    def prologue(self, pQ, pK, pV, pG, pBeta, pALog, pDtBias, warp, lane, vs, hv, hq, b, T, H, HV, scale,
                 lower_bound):
        """Per-token vectors in shared memory, once per CTA: the gate's decay factors, l2-normalised and
        scaled q, normalised k, q.k, the beta sigmoid and the CTA's values of v of batch row ``b``. Token
        t goes to warp ``t % warps``. Returns (sQ, sK, sD, sV, sS)."""
        f32 = cutlass.Float32
        K, V = self.K, self.V
        v_cta = vs * self.v_cta
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(f32, cute.make_layout((MAX_T, K), stride=(K, 1)), 16)
        sK = smem.allocate_tensor(f32, cute.make_layout((MAX_T, K), stride=(K, 1)), 16)
        sD = smem.allocate_tensor(f32, cute.make_layout((MAX_T, K), stride=(K, 1)), 16)
        sV = smem.allocate_tensor(f32, cute.make_layout((MAX_T, self.v_cta), stride=(self.v_cta, 1)), 16)
        sS = smem.allocate_tensor(f32, cute.make_layout((MAX_T, 2), stride=(2, 1)), 16)  # beta, q.k

        kpl = self.kpl
        kk = lane * kpl
        a_exp = f32(1.0)
        if cutlass.const_expr(self.use_gate and self.has_a_log):
            a_exp = cute.math.exp(load1(pALog, hv).to(f32))
        bias = cute.make_rmem_tensor(cute.make_layout(kpl), f32)
        for j in cutlass.range_constexpr(kpl):
            bias[j] = f32(0.0)
        if cutlass.const_expr(self.use_gate and self.has_dt_bias):
            for j in cutlass.range_constexpr(kpl):
                bias[j] = load1(pDtBias, hv * K + kk + j).to(f32)

        # all loads of this warp's tokens first (token t -> warp t % warps, slot t // warps), so their
        # latencies overlap; then the math, whose warp reductions wait on them
        nt = self.slots
        qr = cute.make_rmem_tensor(cute.make_layout((kpl, nt), stride=(1, kpl)), pQ.dtype)
        kr = cute.make_rmem_tensor(cute.make_layout((kpl, nt), stride=(1, kpl)), pK.dtype)
        gr = cute.make_rmem_tensor(cute.make_layout((kpl, nt), stride=(1, kpl)), pG.dtype)
        vr = cute.make_rmem_tensor(cute.make_layout(nt), pV.dtype)
        br = cute.make_rmem_tensor(cute.make_layout(nt), pBeta.dtype)
        for j in cutlass.range_constexpr(nt):
            t = warp + j * self.warps
            if t < T:
                row_q = (cutlass.Int64(b) * T + t) * H + hq
                row_v = (cutlass.Int64(b) * T + t) * HV + hv
                cute.autovec_copy(vec(pQ, row_q * K + kk, kpl, kpl), qr[None, j])
                cute.autovec_copy(vec(pK, row_q * K + kk, kpl, kpl), kr[None, j])
                cute.autovec_copy(vec(pG, row_v * K + kk, kpl, kpl), gr[None, j])
                if lane < self.v_cta:
                    vr[j] = load1(pV, row_v * V + v_cta + lane)
                if lane == 0:
                    br[j] = load1(pBeta, row_v)
        for j in cutlass.range_constexpr(nt):
            t = warp + j * self.warps
            if t < T:
                qq = f32(0.0)
                kk2 = f32(0.0)
                qk = f32(0.0)
                for e in cutlass.range_constexpr(kpl):
                    qj = qr[e, j].to(f32)
                    kj = kr[e, j].to(f32)
                    qq = qq + qj * qj
                    kk2 = kk2 + kj * kj
                    qk = qk + qj * kj
                qk = warp_sum(qk)
                rq = f32(1.0)
                rk = f32(1.0)
                if cutlass.const_expr(self.use_qk_l2norm):
                    rq = cute.math.rsqrt(warp_sum(qq) + f32(L2NORM_EPS))
                    rk = cute.math.rsqrt(warp_sum(kk2) + f32(L2NORM_EPS))
                qs = rq * scale
                for e in cutlass.range_constexpr(kpl):
                    sQ[t, kk + e] = qr[e, j].to(f32) * qs
                    sK[t, kk + e] = kr[e, j].to(f32) * rk
                    sD[t, kk + e] = cute.math.exp(self.gate(gr[e, j].to(f32) + bias[e], a_exp, lower_bound))
                if lane < self.v_cta:
                    sV[t, lane] = vr[j].to(f32)
                if lane == 0:
                    beta = br[j].to(f32)
                    if cutlass.const_expr(self.use_beta_sigmoid):
                        beta = f32(self.beta_mult) / (f32(1.0) + cute.math.exp(-beta))
                    sS[t, 0] = beta
                    sS[t, 1] = qk * qs * rk
        return sQ, sK, sD, sV, sS

    @cute.jit
    def finish_row(self, state, smem, pHt, pO, la, lb, v0w, v0, hv, b, slot, T, HV):
        """The tokens of batch row ``b``, in order, on the register-resident state, then the state back
        (the pool slot in place, or the out-of-place final state)."""
        sQ, sK, sD, sV, sS = smem
        na, nb = self.tile_shape()
        for t in cutlass.range(T, unroll=1):
            self.token_step(state, sQ, sK, sD, sV, sS, pO, t, la, lb, v0w, v0, b, T, HV, hv)
        if cutlass.const_expr(self.store_state):
            kv = self.K * self.V
            head_out = (cutlass.Int64(b) * HV + hv) * kv
            if cutlass.const_expr(self.inplace):
                head_out = (slot * HV + hv) * kv
            for m in cutlass.range_constexpr(na):
                for c in cutlass.range_constexpr(nb):
                    cute.autovec_copy(state[None, c, m],
                                      vec(pHt, head_out + self.tile_offset(la, lb, v0, m, c), 4, 4))

    @cute.jit
    def gate(self, x, a_exp, lower_bound):
        """Log-decay of one key dim from the raw gate input ``x`` (bias already added)."""
        f32 = cutlass.Float32
        out = x
        if cutlass.const_expr(self.use_gate):
            if cutlass.const_expr(self.use_lower_bound):
                out = lower_bound / (f32(1.0) + cute.math.exp(-(a_exp * x)))
            else:
                sp = x
                if x <= f32(SOFTPLUS_THRESHOLD):
                    sp = cute.math.log(f32(1.0) + cute.math.exp(x))
                out = -a_exp * sp
        return out

    @cute.jit
    def token_step(self, state, sQ, sK, sD, sV, sS, pO, t, la, lb, v0w, v0, b, T, HV, hv):
        """One token on the thread's state slice; writes its 4 outputs from one lane per group."""
        f32 = cutlass.Float32
        K = self.K
        na, nb = self.tile_shape()
        beta = sS[t, 0]
        qk = sS[t, 1]
        vv = cute.make_rmem_tensor(cute.make_layout(4), f32)
        cute.autovec_copy(vec(sV.iterator, t * self.v_cta + v0w, 4, 4), vv)
        red = cute.make_rmem_tensor(cute.make_layout(8), f32)  # k^T S' (4), q^T S' (4)
        for e in cutlass.range_constexpr(8):
            red[e] = f32(0.0)
        if cutlass.const_expr(self.v_first):
            # thread: V rows v0+m (m < 4) x K vectors c*64 + lb*4 (c < chunks)
            dk = cute.make_rmem_tensor(cute.make_layout((4, nb), stride=(1, 4)), f32)
            kq = cute.make_rmem_tensor(cute.make_layout((4, nb), stride=(1, 4)), f32)
            qq = cute.make_rmem_tensor(cute.make_layout((4, nb), stride=(1, 4)), f32)
            for c in cutlass.range_constexpr(nb):
                off = t * K + c * 64 + lb * 4
                cute.autovec_copy(vec(sD.iterator, off, 4, 4), dk[None, c])
                cute.autovec_copy(vec(sK.iterator, off, 4, 4), kq[None, c])
                cute.autovec_copy(vec(sQ.iterator, off, 4, 4), qq[None, c])
            for m in cutlass.range_constexpr(na):
                for c in cutlass.range_constexpr(nb):
                    for j in cutlass.range_constexpr(4):
                        s = state[j, c, m] * dk[j, c]
                        state[j, c, m] = s
                        red[m] = red[m] + kq[j, c] * s
                        red[4 + m] = red[4 + m] + qq[j, c] * s
            butterfly_sum(red, 8, (1, 2, 4, 8))
            u = cute.make_rmem_tensor(cute.make_layout(4), f32)
            for m in cutlass.range_constexpr(4):
                u[m] = beta * (vv[m] - red[m])
            for m in cutlass.range_constexpr(na):
                for c in cutlass.range_constexpr(nb):
                    for j in cutlass.range_constexpr(4):
                        state[j, c, m] = state[j, c, m] + kq[j, c] * u[m]
            if lb == 0:
                self.store_out(pO, red, u, qk, b, t, T, HV, hv, v0)
        else:
            # thread: K rows la*rows + m (m < rows) x V columns v0 .. v0+3
            rows = self.rows
            dk = cute.make_rmem_tensor(cute.make_layout(rows), f32)
            kq = cute.make_rmem_tensor(cute.make_layout(rows), f32)
            qq = cute.make_rmem_tensor(cute.make_layout(rows), f32)
            off = t * K + la * rows
            cute.autovec_copy(vec(sD.iterator, off, rows, 4), dk)
            cute.autovec_copy(vec(sK.iterator, off, rows, 4), kq)
            cute.autovec_copy(vec(sQ.iterator, off, rows, 4), qq)
            for m in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(4):
                    s = state[j, 0, m] * dk[m]
                    state[j, 0, m] = s
                    red[j] = red[j] + kq[m] * s
                    red[4 + j] = red[4 + j] + qq[m] * s
            butterfly_sum(red, 8, (2, 4, 8, 16))
            u = cute.make_rmem_tensor(cute.make_layout(4), f32)
            for j in cutlass.range_constexpr(4):
                u[j] = beta * (vv[j] - red[j])
            for m in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(4):
                    state[j, 0, m] = state[j, 0, m] + kq[m] * u[j]
            if la == 0:
                self.store_out(pO, red, u, qk, b, t, T, HV, hv, v0)

    @cute.jit
    def store_out(self, pO, red, u, qk, b, t, T, HV, hv, v0):
        """o[b, t, hv, v0 .. v0+3] = q^T S' + (q.k) u, as one vector store."""
        o = cute.make_rmem_tensor(cute.make_layout(4), pO.dtype)
        for j in cutlass.range_constexpr(4):
            o[j] = (red[4 + j] + qk * u[j]).to(pO.dtype)
        row_v = (cutlass.Int64(b) * T + t) * HV + hv
        cute.autovec_copy(o, vec(pO, row_v * self.V + v0, 4, 4))

    @cute.jit
    def skip_row(self, pHt, pO, tidx, vs, hv, b, T, HV):
        """A skipped row (negative slot): zero outputs, zero out-of-place final state, slot untouched."""
        f32 = cutlass.Float32
        warp, lane, la, lb, v0w = self.lane_layout(tidx)
        v0 = vs * self.v_cta + v0w
        na, nb = self.tile_shape()
        zo = cute.make_rmem_tensor(cute.make_layout(4), pO.dtype)
        for j in cutlass.range_constexpr(4):
            zo[j] = f32(0.0).to(pO.dtype)
        writer = la == 0
        if cutlass.const_expr(self.v_first):
            writer = lb == 0
        if writer:
            for t in cutlass.range(T, unroll=1):
                row_v = (cutlass.Int64(b) * T + t) * HV + hv
                cute.autovec_copy(zo, vec(pO, row_v * self.V + v0, 4, 4))
        if cutlass.const_expr(self.store_state and not self.inplace):
            zs = cute.make_rmem_tensor(cute.make_layout(4), f32)
            for j in cutlass.range_constexpr(4):
                zs[j] = f32(0.0)
            head_out = (cutlass.Int64(b) * HV + hv) * (self.K * self.V)
            for m in cutlass.range_constexpr(na):
                for c in cutlass.range_constexpr(nb):
                    cute.autovec_copy(zs, vec(pHt, head_out + self.tile_offset(la, lb, v0, m, c), 4, 4))


# ------------------------------------------------------------------------------------------------ host

#: Runtime arguments of ``KdaDecode.__call__``, in order (names for error messages and ArgSpecs).
_ARG_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "final_state", "o",
              "state_indices", "B", "T", "H", "HV", "scale", "lower_bound", "stream")

_cache: dict[tuple, Any] = {}
#: DecodeRunner per checked static signature (they hold launchers from _cache)
_runners: dict[tuple, DecodeRunner] = {}
#: The tensor arguments of kda_decode, in order (a runner takes those it uses, in this order).
_TENSOR_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "state_indices")
_ACT = frozenset(ACT_DTYPES)


def _specs(dtypes: tuple) -> tuple[ArgSpec, ...]:
    """ArgSpecs for pointer dtypes ``dtypes`` (torch dtypes of q, k, v, g, beta, A_log, dt_bias, o, idx)."""
    dq, dk, dv, dg, db, da, dd, do, di = (cutlass_dtype(d) for d in dtypes)
    f32 = cutlass_dtype(torch.float32)
    ptrs = (dq, dk, dv, dg, db, da, dd, f32, f32, do, di)
    return (*(ArgSpec("ptr", d) for d in ptrs), *(ArgSpec("i32") for _ in range(4)),
            ArgSpec("f32"), ArgSpec("f32"), ArgSpec("stream"))



def _launcher(key: tuple):
    """The compiled kernel for a static configuration (compiled on first use, then cached)."""
    hit = _cache.get(key)
    if hit is None:
        config, dtypes = key
        hit = compile_launcher(KdaDecode(*config), _specs(dtypes))
        _cache[key] = hit
    return hit



def supports(
    q=None, k=None, v=None, g=None, beta=None, A_log=None, dt_bias=None, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
    state_indices=None, inplace=False, **_: Any,
) -> str | None:
    """None when :func:`kda_decode` can run these inputs on the GPU, else the reason it cannot."""
    if not GPU_VALIDATED:
        return "not validated on GPU yet"
    return kernel_reason(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, lower_bound, state_v_first, state_indices, inplace)


def kernel_reason(
    q=None, k=None, v=None, g=None, beta=None, A_log=None, dt_bias=None, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
    state_indices=None, inplace=False,
) -> str | None:
    """Why the kernel cannot take these (valid) inputs, or None: head dims, T, dtypes, device, state."""
    if q.dim() != 4 or v.dim() != 4:
        return "the kernel takes [B, T, H, K] / [B, T, HV, V] inputs"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K not in HEAD_DIMS_K:
        return f"the kernel is built for K in {HEAD_DIMS_K}, got K = {K}"
    if V % V_ALIGN or V == 0:
        return f"the kernel needs V a multiple of {V_ALIGN}, got V = {V}"
    if not 1 <= T <= MAX_T:
        return f"the decode kernel takes 1..{MAX_T} tokens per sequence, got T = {T}"
    if H == 0 or HV % H:
        return f"HV = {HV} is not a multiple of H = {H}"
    if B > 65535 or HV > 65535:
        return f"the grid takes at most 65535 rows and value heads, got B = {B}, HV = {HV}"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and x.dtype not in _ACT:
            return f"{name} is {x.dtype}; the kernel takes {', '.join(map(str, ACT_DTYPES))}"
    if beta is None or beta.dim() != 3:
        return "the kernel takes a per-head beta [B, T, HV] (no head-wise [B, T, HV, V] beta)"
    if g is None or g.dim() != 4:
        return "the kernel takes g [B, T, HV, K]"
    if not cuda_tensors(q, k, v, g, beta, A_log, dt_bias, initial_state, state_indices):
        return "the kernel takes CUDA tensors"
    reason = state_reason(initial_state)
    if reason is not None:
        return reason
    return None


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA decode step(s) on the GPU, FLA ``fused_recurrent_kda`` semantics plus a state pool.

    Args:
        q, k: ``[B, T, H, K]`` (T <= 8), bf16 / fp16 / fp32.
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H`` (GVA).
        g: ``[B, T, HV, K]`` log-decay, or the raw gate input with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (gate parameters, used with ``use_gate_in_kernel``).
        scale: defaults to ``K ** -0.5``.
        initial_state: fp32 ``[B, HV, K, V]`` (``[B, HV, V, K]`` with ``state_v_first``), or a pool
            ``[P, HV, K, V]`` with ``state_indices``; None = zero states.
        state_indices: ``[B]`` int32/int64 pool slot per row; negative = skip the row.
        inplace: write the new states into ``initial_state`` (the pool) and return it as final state.
        out: optional ``[B, T, HV, V]`` output buffer (dtype of v), for allocation-free CUDA graphs.
    Returns:
        ``o: [B, T, HV, V]`` (dtype of v) and the final state: the pool when ``inplace``, a new fp32
        ``[B, HV, K, V]`` (or V-first) tensor when ``output_final_state``, else None.
    """
    run = runner(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                 lower_bound, state_v_first, state_indices, inplace)
    check_out(out, v)
    return run.run(run.take((q, k, v, g, beta, A_log, dt_bias, initial_state, state_indices)), out)


def runner(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace: bool = False,
) -> DecodeRunner:
    """Check the arguments of :func:`kda_decode` (the same ValueErrors) and return the
    :class:`DecodeRunner` of their static signature: call it with the tensors it names
    (``.names``, positionally) to run ``kda_decode`` on them, or on any tensors of the same metadata."""
    B, T, H, K, HV, V = _dims(q, k, v)
    expect_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    expect_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    state_shape = (HV, V, K) if state_v_first else (HV, K, V)
    check_pool(initial_state, state_indices, inplace, B, state_shape, "HV, V, K" if state_v_first else "HV, K, V")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True alongside it, got False")
    use_lb = bool(use_gate_in_kernel and lower_bound is not None)
    has_a = bool(use_gate_in_kernel and A_log is not None)
    has_bias = bool(use_gate_in_kernel and dt_bias is not None)
    if use_gate_in_kernel and not has_a and not use_lb:
        raise ValueError("A_log: expected a [HV] tensor with use_gate_in_kernel and no lower_bound, got None")
    if has_a:
        expect_numel("A_log", A_log, HV, "one per value head")
    if has_bias:
        expect_numel("dt_bias", dt_bias, HV * K, "HV * K")
    reason = kernel_reason(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound, state_v_first, state_indices, inplace)
    if reason is not None:
        raise ValueError(f"kda_decode: unsupported inputs ({reason})")

    has_h0, has_idx = initial_state is not None, state_indices is not None
    store = bool(inplace or output_final_state)
    idx_dtype = state_indices.dtype if has_idx else torch.int32
    config = (K, V, bool(state_v_first), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), has_a,
              has_bias, use_lb, bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
              has_h0, store, bool(inplace), has_idx, pick_warps(B, HV, V))
    dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, A_log.dtype if has_a else torch.float32,
              dt_bias.dtype if has_bias else torch.float32, v.dtype, idx_dtype)
    statics = (B, T, H, HV, float(K ** -0.5 if scale is None else scale), float(lower_bound) if use_lb else 0.0)
    used = (q, k, v, g, beta, A_log if has_a else None, dt_bias if has_bias else None, initial_state, state_indices)
    final = INPLACE if inplace else ((B, *state_shape) if output_final_state else None)
    return cached_runner(_runners, _TENSOR_ARGS, used, config, dtypes, statics, final,
                         lambda: _launcher((config, dtypes)), stream_query)


# ------------------------------------------------------------------------------------------ CPU checks


def compile_targets():
    """PTX-check targets (``cula.kernels.common.ptx_check``): both layouts, the full flag set, pools."""
    from cula.kernels.common.fast_launch import compile_args

    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    full = dict(K=128, V=128, state_v_first=False, use_qk_l2norm=True, use_gate=True, has_a_log=True,
                has_dt_bias=True, use_lower_bound=False, use_beta_sigmoid=True, allow_neg_eigval=False,
                has_initial_state=True, store_state=True, inplace=True, has_indices=True)

    def build(dtypes=(bf16, bf16, bf16, f32, bf16, f32, f32, bf16, i32), **over):
        def make():
            kern = KdaDecode(**{**full, **over})
            return kern, compile_args(_specs(dtypes))
        return make

    return {
        "default": build(),
        "v_first": build(state_v_first=True),
        "lower_bound": build(use_lower_bound=True, has_a_log=False, inplace=False),
        "plain_fp32": build((f32,) * 8 + (torch.int64,), use_qk_l2norm=False, use_gate=False,
                            use_beta_sigmoid=False, has_indices=False, inplace=False, has_initial_state=False),
        "k64": build(K=64, V=64, state_v_first=True),
        "k256": build(K=256, V=256),
        "one_warp_v_first": build(state_v_first=True, warps=1),
        "two_warps": build(warps=2),
    }


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """``--check``: compile, compare with the fp64 reference (pool, in place), time one shape vs FLA."""
    import argparse

    from cula.kernels.sm90 import decode_bench as db

    ap = argparse.ArgumentParser(prog=f"python -m {__name__}", description=main.__doc__)
    ap.add_argument("--check", action="store_true", help="run the check (the default action)")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--G", type=int, default=1, help="value heads per q/k head (GVA)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    ok = True
    for pool in ("inplace", "plain"):
        case = db.DecodeCase("kda", args.B, args.T, args.H, args.H * args.G, pool=pool, flags=db.KDA_SERVING_FLAGS)
        inputs = db.make_inputs(case)
        h0 = inputs["initial_state"]
        o_ref, s_ref = db.reference(case, {**inputs, "initial_state": h0.clone()})
        t0 = time.perf_counter()
        o, ht = kda_decode(**inputs)
        torch.cuda.synchronize()
        e_o, e_s = db.rel_err(o, o_ref), db.rel_err(ht, s_ref)
        ok &= e_o < 6e-3 and e_s < 2e-4
        print(f"{case.label}: first call {(time.perf_counter() - t0) * 1e3:.0f} ms (compile included), "
              f"rel err o {e_o:.2e}, state {e_s:.2e}")
    row = db.bench_case(db.DecodeCase("kda", args.B, args.T, args.H, args.H * args.G, flags=db.KDA_SERVING_FLAGS),
                        db.copy_bandwidth())
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

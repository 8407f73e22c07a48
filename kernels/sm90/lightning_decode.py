"""Lightning Attention decode (T <= 8 tokens per sequence) on Hopper, state in registers for all tokens.

Per value head, with the constant per-head decay ``lam = exp(-decay[hv])``::

    S   = lam S + k_t v_t^T          (S: [K, V] fp32, K-first)
    o_t = scale q_t^T S = lam (scale q_t)^T S_prev + (scale q_t . k_t) v_t

so one warp reduction per token (``q^T S`` over K) gives the output. Numerics: fp32 throughout; the
state is read once and written once per call, whatever T.

Work split (as the KDA decode kernel, K-first): one CTA of 4 warps per (batch row, value head, 32 values
of V), 2 or 1 warps at small batch (``pick_warps``); each warp owns 8 columns of V and all of K;
lane = 2 * la + lb holds rows ``la*K/16 .. +K/16`` x 4 columns, so a warp load covers 16 rows x 32
contiguous bytes and every state access is a 16-byte ``ld.global.v4`` / ``st.global.v4``. The reduction over K runs over the 16 ``la`` lanes (shuffles only).
Before the token loop the CTA stages scaled q, k, ``q.k`` and its values of v per token in shared
memory; the state loads are issued first so their latency covers that prologue.

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
    pick_warps,
    state_reason,
)
from cula.kernels.common.decode_tile import butterfly_sum, load1, vec, warp_sum
from cula.kernels.common.fast_launch import ArgSpec, compile_launcher, stream_query

HEAD_DIMS_K = (64, 128, 256)  # 16 lanes x K/16 rows per thread
#: Flipped to True once tests/test_kernel_lightning_decode.py passed on the H200.
GPU_VALIDATED = True


class LightningDecode:
    """Compile-time configuration of the Lightning decode kernel."""

    def __init__(self, K: int, V: int, has_initial_state: bool, store_state: bool, inplace: bool,
                 has_indices: bool, warps: int = 4):
        assert K in HEAD_DIMS_K and V % V_ALIGN == 0 and warps in WARP_CHOICES
        self.K, self.V = K, V
        self.has_h0 = has_initial_state
        self.store_state = store_state
        self.inplace = inplace
        self.has_indices = has_indices
        self.kpl = K // 32  # prologue: K elements per lane
        self.rows = K // 16  # state rows per thread
        self.warps = warps
        self.v_cta = V_PER_WARP * warps  # columns of V per CTA
        self.slots = -(-MAX_T // warps)  # prologue: tokens per warp (token t goes to warp t % warps)

    @cute.jit
    def __call__(
        self,
        pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pDecay: cute.Pointer,
        pH0: cute.Pointer, pHt: cute.Pointer, pO: cute.Pointer, pIdx: cute.Pointer,
        B: cutlass.Int32, T: cutlass.Int32, H: cutlass.Int32, HV: cutlass.Int32,
        scale: cutlass.Float32,
        stream,
    ):
        self.kernel(pQ, pK, pV, pDecay, pH0, pHt, pO, pIdx, T, H, HV, scale).launch(
            grid=[self.V // self.v_cta, HV, B], block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pDecay: cute.Pointer,
        pH0: cute.Pointer, pHt: cute.Pointer, pO: cute.Pointer, pIdx: cute.Pointer,
        T: cutlass.Int32, H: cutlass.Int32, HV: cutlass.Int32, scale: cutlass.Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, hv, b = cute.arch.block_idx()
        slot = cutlass.Int64(b)
        if cutlass.const_expr(self.has_indices):
            slot = cutlass.Int64(load1(pIdx, b))
        if slot >= 0:
            self.run_row(pQ, pK, pV, pDecay, pH0, pHt, pO, tidx, vs, hv, b, slot, T, H, HV, scale)
        else:
            self.skip_row(pHt, pO, tidx, vs, hv, b, T, HV)

    def lane_layout(self, tidx):
        """(warp, lane, la, lb, first V column within the CTA) of this thread."""
        warp = tidx // 32
        lane = tidx % 32
        la, lb = lane // 2, lane % 2
        return warp, lane, la, lb, warp * V_PER_WARP + lb * 4

    def tile_offset(self, la, v0, m: int):
        """Element offset (within one head's state) of the thread's row ``m``, columns ``v0 .. v0+3``."""
        return (la * self.rows + m) * self.V + v0

    @cute.jit
    def run_row(self, pQ, pK, pV, pDecay, pH0, pHt, pO, tidx, vs, hv, b, slot, T, H, HV, scale):
        f32 = cutlass.Float32
        K, V = self.K, self.V
        rows = self.rows
        warp, lane, la, lb, v0w = self.lane_layout(tidx)
        v_cta = vs * self.v_cta
        v0 = v_cta + v0w
        hq = hv // (HV // H)

        # ---- 1. state loads first
        state = cute.make_rmem_tensor(cute.make_layout((4, rows), stride=(1, 4)), f32)
        kv = K * V
        head_in = (slot * HV + hv) * kv
        if cutlass.const_expr(self.has_h0):
            for m in cutlass.range_constexpr(rows):
                cute.autovec_copy(vec(pH0, head_in + self.tile_offset(la, v0, m), 4, 4), state[None, m])
        else:
            for e in cutlass.range_constexpr(4 * rows):
                state[e] = f32(0.0)

        # ---- 2. prologue: scale*q, k, q.k and the CTA's v per token in shared memory
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(f32, cute.make_layout((MAX_T, K), stride=(K, 1)), 16)
        sK = smem.allocate_tensor(f32, cute.make_layout((MAX_T, K), stride=(K, 1)), 16)
        sV = smem.allocate_tensor(f32, cute.make_layout((MAX_T, self.v_cta), stride=(self.v_cta, 1)), 16)
        sQK = smem.allocate_tensor(f32, cute.make_layout(MAX_T), 16)
        lam = cute.math.exp(-load1(pDecay, hv).to(f32))

        kpl = self.kpl
        kk = lane * kpl
        # all loads of this warp's tokens first (token t -> warp t % warps), then the math
        nt = self.slots
        qr = cute.make_rmem_tensor(cute.make_layout((kpl, nt), stride=(1, kpl)), pQ.dtype)
        kr = cute.make_rmem_tensor(cute.make_layout((kpl, nt), stride=(1, kpl)), pK.dtype)
        vr = cute.make_rmem_tensor(cute.make_layout(nt), pV.dtype)
        for j in cutlass.range_constexpr(nt):
            t = warp + j * self.warps
            if t < T:
                row_q = (cutlass.Int64(b) * T + t) * H + hq
                row_v = (cutlass.Int64(b) * T + t) * HV + hv
                cute.autovec_copy(vec(pQ, row_q * K + kk, kpl, kpl), qr[None, j])
                cute.autovec_copy(vec(pK, row_q * K + kk, kpl, kpl), kr[None, j])
                if lane < self.v_cta:
                    vr[j] = load1(pV, row_v * V + v_cta + lane)
        for j in cutlass.range_constexpr(nt):
            t = warp + j * self.warps
            if t < T:
                qk = f32(0.0)
                for e in cutlass.range_constexpr(kpl):
                    qj = qr[e, j].to(f32) * scale
                    kj = kr[e, j].to(f32)
                    qk = qk + qj * kj
                    sQ[t, kk + e] = qj
                    sK[t, kk + e] = kj
                qk = warp_sum(qk)
                if lane < self.v_cta:
                    sV[t, lane] = vr[j].to(f32)
                if lane == 0:
                    sQK[t] = qk
        cute.arch.sync_threads()

        # ---- 3. the tokens, in order
        for t in cutlass.range(T, unroll=1):
            kq = cute.make_rmem_tensor(cute.make_layout(rows), f32)
            qq = cute.make_rmem_tensor(cute.make_layout(rows), f32)
            vv = cute.make_rmem_tensor(cute.make_layout(4), f32)
            off = t * K + la * rows
            cute.autovec_copy(vec(sK.iterator, off, rows, 4), kq)
            cute.autovec_copy(vec(sQ.iterator, off, rows, 4), qq)
            cute.autovec_copy(vec(sV.iterator, t * self.v_cta + v0w, 4, 4), vv)
            red = cute.make_rmem_tensor(cute.make_layout(4), f32)  # q^T S' per column
            for j in cutlass.range_constexpr(4):
                red[j] = f32(0.0)
            for m in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(4):
                    s = state[j, m] * lam
                    red[j] = red[j] + qq[m] * s
                    state[j, m] = s + kq[m] * vv[j]
            butterfly_sum(red, 4, (2, 4, 8, 16))
            if la == 0:
                qk = sQK[t]
                o = cute.make_rmem_tensor(cute.make_layout(4), pO.dtype)
                for j in cutlass.range_constexpr(4):
                    o[j] = (red[j] + qk * vv[j]).to(pO.dtype)
                row_v = (cutlass.Int64(b) * T + t) * HV + hv
                cute.autovec_copy(o, vec(pO, row_v * V + v0, 4, 4))

        # ---- 4. write the state back
        if cutlass.const_expr(self.store_state):
            head_out = (cutlass.Int64(b) * HV + hv) * kv
            if cutlass.const_expr(self.inplace):
                head_out = head_in
            for m in cutlass.range_constexpr(rows):
                cute.autovec_copy(state[None, m], vec(pHt, head_out + self.tile_offset(la, v0, m), 4, 4))

    @cute.jit
    def skip_row(self, pHt, pO, tidx, vs, hv, b, T, HV):
        """A skipped row (negative slot): zero outputs, zero out-of-place final state, slot untouched."""
        f32 = cutlass.Float32
        warp, lane, la, lb, v0w = self.lane_layout(tidx)
        v0 = vs * self.v_cta + v0w
        zo = cute.make_rmem_tensor(cute.make_layout(4), pO.dtype)
        for j in cutlass.range_constexpr(4):
            zo[j] = f32(0.0).to(pO.dtype)
        if la == 0:
            for t in cutlass.range(T, unroll=1):
                row_v = (cutlass.Int64(b) * T + t) * HV + hv
                cute.autovec_copy(zo, vec(pO, row_v * self.V + v0, 4, 4))
        if cutlass.const_expr(self.store_state and not self.inplace):
            zs = cute.make_rmem_tensor(cute.make_layout(4), f32)
            for j in cutlass.range_constexpr(4):
                zs[j] = f32(0.0)
            head_out = (cutlass.Int64(b) * HV + hv) * (self.K * self.V)
            for m in cutlass.range_constexpr(self.rows):
                cute.autovec_copy(zs, vec(pHt, head_out + self.tile_offset(la, v0, m), 4, 4))


# ------------------------------------------------------------------------------------------------ host

_cache: dict[tuple, Any] = {}
#: DecodeRunner per checked static signature (they hold launchers from _cache)
_runners: dict[tuple, DecodeRunner] = {}
#: The tensor arguments of lightning_decode, in order (a runner takes those it uses, in this order).
_TENSOR_ARGS = ("q", "k", "v", "decay", "initial_state", "state_indices")
_ACT = frozenset(ACT_DTYPES)


def _specs(dtypes: tuple) -> tuple[ArgSpec, ...]:
    """ArgSpecs for the torch dtypes of (q, k, v, decay, o, state_indices)."""
    dq, dk, dv, dd, do, di = (cutlass_dtype(d) for d in dtypes)
    f32 = cutlass_dtype(torch.float32)
    ptrs = (dq, dk, dv, dd, f32, f32, do, di)
    return (*(ArgSpec("ptr", d) for d in ptrs), *(ArgSpec("i32") for _ in range(4)),
            ArgSpec("f32"), ArgSpec("stream"))



def _launcher(key: tuple):
    hit = _cache.get(key)
    if hit is None:
        config, dtypes = key
        hit = compile_launcher(LightningDecode(*config), _specs(dtypes))
        _cache[key] = hit
    return hit



def supports(
    q=None, k=None, v=None, decay=None, scale=None, initial_state=None, output_final_state=False,
    state_indices=None, inplace=False, **_: Any,
) -> str | None:
    """None when :func:`lightning_decode` can run these inputs on the GPU, else the reason it cannot."""
    if not GPU_VALIDATED:
        return "not validated on GPU yet"
    return kernel_reason(q, k, v, decay, scale, initial_state, output_final_state, state_indices, inplace)


def kernel_reason(
    q=None, k=None, v=None, decay=None, scale=None, initial_state=None, output_final_state=False,
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
    for name, x in (("q", q), ("k", k), ("v", v), ("decay", decay)):
        if x is not None and x.dtype not in _ACT:
            return f"{name} is {x.dtype}; the kernel takes {', '.join(map(str, ACT_DTYPES))}"
    if not cuda_tensors(q, k, v, decay, initial_state, state_indices):
        return "the kernel takes CUDA tensors"
    return state_reason(initial_state)


def lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention decode step(s) on the GPU (``S = exp(-decay) S + k^T v``, ``o = scale q S``).

    Args:
        q, k: ``[B, T, H, K]`` (T <= 8), bf16 / fp16 / fp32.
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H`` (GVA).
        decay: ``[HV]`` decay rates (the per-token factor is ``exp(-decay)``).
        scale: defaults to ``K ** -0.5``.
        initial_state: fp32 ``[B, HV, K, V]``, or a pool ``[P, HV, K, V]`` with ``state_indices``;
            None = zero states.
        state_indices: ``[B]`` int32/int64 pool slot per row; negative = skip the row.
        inplace: write the new states into ``initial_state`` (the pool) and return it as final state.
        out: optional ``[B, T, HV, V]`` output buffer (dtype of v), for allocation-free CUDA graphs.
    Returns:
        ``o: [B, T, HV, V]`` (dtype of v) and the final state: the pool when ``inplace``, a new fp32
        ``[B, HV, K, V]`` tensor when ``output_final_state``, else None.
    """
    run = runner(q, k, v, decay, scale, initial_state, output_final_state, state_indices, inplace)
    check_out(out, v)
    return run.run(run.take((q, k, v, decay, initial_state, state_indices)), out)


def runner(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_indices: torch.Tensor | None = None,
    inplace: bool = False,
) -> DecodeRunner:
    """Check the arguments of :func:`lightning_decode` (the same ValueErrors) and return the
    :class:`DecodeRunner` of their static signature: call it with the tensors it names
    (``.names``, positionally) to run ``lightning_decode`` on them, or on any tensors of the same
    metadata."""
    B, T, H, K, HV, V = _dims(q, k, v)
    expect_numel("decay", decay, HV, "one decay rate per value head")
    check_pool(initial_state, state_indices, inplace, B, (HV, K, V), "HV, K, V")
    reason = kernel_reason(q, k, v, decay, scale, initial_state, output_final_state, state_indices, inplace)
    if reason is not None:
        raise ValueError(f"lightning_decode: unsupported inputs ({reason})")

    has_h0, has_idx = initial_state is not None, state_indices is not None
    store = bool(inplace or output_final_state)
    idx_dtype = state_indices.dtype if has_idx else torch.int32
    config = (K, V, has_h0, store, bool(inplace), has_idx, pick_warps(B, HV, V))
    dtypes = (q.dtype, k.dtype, v.dtype, decay.dtype, v.dtype, idx_dtype)
    statics = (B, T, H, HV, float(K ** -0.5 if scale is None else scale))
    used = (q, k, v, decay, initial_state, state_indices)
    final = INPLACE if inplace else ((B, HV, K, V) if output_final_state else None)
    return cached_runner(_runners, _TENSOR_ARGS, used, config, dtypes, statics, final,
                         lambda: _launcher((config, dtypes)), stream_query)


# ------------------------------------------------------------------------------------------ CPU checks


def compile_targets():
    """PTX-check targets (``cula.kernels.common.ptx_check``)."""
    from cula.kernels.common.fast_launch import compile_args

    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32

    def build(K=128, V=128, dtypes=(bf16, bf16, bf16, f32, bf16, i32), **flags):
        cfg = {**dict(has_initial_state=True, store_state=True, inplace=True, has_indices=True), **flags}

        def make():
            return LightningDecode(K, V, **cfg), compile_args(_specs(dtypes))
        return make

    return {
        "default": build(),
        "out_of_place": build(inplace=False, has_indices=False),
        "fp32_k64": build(64, 64, (f32, f32, f32, f32, f32, torch.int64)),
        "one_warp": build(warps=1),
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
        case = db.DecodeCase("lightning", args.B, args.T, args.H, args.H * args.G, pool=pool, flags={})
        inputs = db.make_inputs(case)
        h0 = inputs["initial_state"]
        o_ref, s_ref = db.reference(case, {**inputs, "initial_state": h0.clone()})
        t0 = time.perf_counter()
        o, ht = lightning_decode(**inputs)
        torch.cuda.synchronize()
        e_o, e_s = db.rel_err(o, o_ref), db.rel_err(ht, s_ref)
        ok &= e_o < 6e-3 and e_s < 2e-4
        print(f"{case.label}: first call {(time.perf_counter() - t0) * 1e3:.0f} ms (compile included), "
              f"rel err o {e_o:.2e}, state {e_s:.2e}")
    row = db.bench_case(db.DecodeCase("lightning", args.B, args.T, args.H, args.H * args.G, flags={}),
                        db.copy_bandwidth())
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

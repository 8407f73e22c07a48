"""The "raw tiles" transform designed for stage 2: its torch model and its CuTe DSL form (session 39).

Its premise was first measured on an H100 in session 36 (~1% of both stages, kda_fwd.md, "Where the time goes"), but
that run compared two CTAs against three (found in session 38); ``device_round.sh s38_raw`` remeasures it at three.

Today stage 1 writes qg, kgᵀ and −X (768 of its 1,676 B a token-head) and stage 2 reads them back. In this
design stage 2 reads q, k and g instead (the same bytes) and a second warpgroup forms the three operand tiles in
shared memory, without exp2 of the cumulative gate: down a key column, 2^Γ_i is the running product of the tokens'
factors 2^g'_s (s ≤ i) and 2^(Γ_C − Γ_i) the product of those after i. Stage 1 hands over only what needs a whole
row: the inverse row norms of q and k.

A thread owns two key columns and one half of the chunk's rows (``HALF`` = 32): 64 column pairs × 2 halves are the
warpgroup's 128 threads, the two halves of a column pair in one warp. Each half forms its local products; the halves
then exchange totals (the upper half's prefix total scales the lower half's prefixes, the lower half's total scales
the upper half's suffixes). The products and roundings are the scheme's, in its order; the per-token gate is stage
1's model's
(``kda_fwd_intra_tc.gate_log2``). tests/test_kda_raw_tiles.py checks the model against that of stage 1
(``kda_fwd_intra_tc.emulate``), and the DSL form (:class:`RawTiles`, run by :class:`RawTilesProbe` on one chunk)
against the model under the CPU emulator. Stage 2 runs it in ``kda_fwd_recur.KdaFwdRecurRaw`` (a warpgroup of its
own) after stage 1 built with ``raw_out`` (the norms instead of the tiles); ``kda_fwd`` launches the pair behind
``CULA_KDA_RAW_TILES=1``. Measured in session 40 (H100): correct, and a loss (stage 1 −23%, stage 2 3.5x slower at
B2 T16384; +14-52% even with the transform skipped), so opt-in; kda_fwd.md, "raw tiles".
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch

# stage 1's constants (kda_fwd_intra_tc imports stage 2, which imports this file: not imported from there;
# tests/test_kda_raw_tiles.py checks they are equal)
CHUNK = 64
DK = 128
L2NORM_EPS = 1e-6
RCP_LN2 = 1.0 / math.log(2.0)
LOG2E = RCP_LN2
SOFTPLUS_THRESHOLD = 20.0

HALF = 32  # rows a transform thread walks: the chunk's two halves run on two threads
PAIR = 2  # key columns a transform thread owns: a warp's 32 threads read 64 consecutive bf16 of a row (128 B)
THREADS = (DK // PAIR) * (CHUNK // HALF)  # the transform warpgroup (128)
GATES = ("sigmoid", "softplus", "log")  # lb·sigmoid(a(g + dt_bias)), FLA's softplus gate clamped at lb, log-space g
HALF_LANES = 16  # a warp's lanes per half: lanes 0-15 walk rows 0-31, lanes 16-31 rows 32-63 of the same columns
SEGMENT_CLAMP = ((32 - HALF_LANES) << 8) | 31  # shfl.sync.idx's c operand for 16-lane segments (the lane's half)


def half_products(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e: [..., 64, K]`` the factors 2^g' (fp32). Returns (prefix, suffix): prefix_i = Π_{s ≤ i} e_s = 2^Γ_i and
    suffix_i = Π_{s > i} e_s = 2^(Γ_C − Γ_i), each formed as the two-half scheme forms it: a running product down
    each half in fp32, then one multiply by the other half's total."""
    pre = torch.empty_like(e)
    suf = torch.empty_like(e)
    for h in range(CHUNK // HALF):
        r0 = h * HALF
        run = torch.ones_like(e[..., 0, :])
        for r in range(r0, r0 + HALF):  # down the half: the prefix includes the row itself
            run = run * e[..., r, :]
            pre[..., r, :] = run
        run = torch.ones_like(e[..., 0, :])
        for r in range(r0 + HALF - 1, r0 - 1, -1):  # up the half: the suffix excludes the row itself
            suf[..., r, :] = run
            run = run * e[..., r, :]
    top_total = pre[..., HALF - 1, :].clone()  # Π over rows 0..31
    bottom_total = suf[..., HALF, :] * e[..., HALF, :]  # Π over rows 32..63
    pre[..., HALF:, :] = top_total[..., None, :] * pre[..., HALF:, :]
    suf[..., :HALF, :] = bottom_total[..., None, :] * suf[..., :HALF, :]
    return pre, suf


def raw_tiles(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, keep: torch.Tensor, scale: float,
              lower_bound: float, a: torch.Tensor, dt_bias: torch.Tensor, use_qk_l2norm: bool = True,
              softplus_gate: bool = False, log_gate: bool = False) -> dict[str, torch.Tensor]:
    """The tiles stage 2 would form for a batch of chunks. ``q, k, g: [..., 64, K]`` one chunk's rows per leading
    index (rows past a sequence's end hold anything finite), ``keep: [..., 64]`` bool, the rows inside it; ``a: [...]``
    exp(A_log) per head, ``dt_bias: [..., K]``. Returns ``qg`` (scale q̂ ⊙ 2^Γ), ``x`` (k̂ ⊙ 2^Γ: stage 1 stores its
    negation), ``kg`` (k̂ ⊙ 2^(Γ_C − Γ), stage 1 stores its transpose) in bf16 and ``gam`` (2^Γ_C, fp32, [..., K])."""
    from cula.kernels.sm90.kda_fwd_intra_tc import gate_log2

    kf = keep[..., None].float()
    qf, kf_ = q.float() * kf, k.float() * kf
    nq = torch.full_like(qf[..., :1], scale)
    nk = torch.ones_like(kf_[..., :1])
    if use_qk_l2norm:  # stage 1 hands these over (8 B a token-head)
        nq = scale * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        nk = torch.rsqrt((kf_ * kf_).sum(-1, keepdim=True) + L2NORM_EPS)
    e = torch.exp2(gate_log2(g.float(), lower_bound, a[..., None, None], dt_bias[..., None, :], softplus_gate,
                             log_gate) * kf)
    pre, suf = half_products(e)
    qs, ks = qf * nq, kf_ * nk
    gam = pre[..., CHUNK - 1, :]
    return dict(qg=(qs * pre).to(torch.bfloat16), x=(ks * pre).to(torch.bfloat16), kg=(ks * suf).to(torch.bfloat16),
                gam=gam)


# ------------------------------------------------------------------------------------------------ the DSL form
F32 = cutlass.Float32
BF16 = cutlass.BFloat16


def first_column(tidx):
    """The first of the ``PAIR`` key columns that thread ``tidx`` (0..127) of the transform warpgroup owns."""
    return ((tidx // 32) * HALF_LANES + tidx % HALF_LANES) * PAIR


class RawTiles:
    """One chunk's transform by a warpgroup, in place in shared memory: q → qg (scale q̂ ⊙ 2^Γ), k → −X (−k̂ ⊙ 2^Γ,
    stage 2's sign), g → kg (k̂ ⊙ 2^(Γ_C − Γ), token-major: the state update reads it MN-major). Tiles are
    ``[64 tok, 128 k]`` bf16 tensors under any layout (coordinates only); the rows' inverse norms (fp32, the scale
    folded into q's) come in registers, two rows a lane (:meth:`lane_norms`). Rows at or past ``nvalid`` come out
    zero, with a factor of one (Γ stops at the last valid row).

    Warp w's lanes 0-15 take rows 0-31 and lanes 16-31 rows 32-63 of the same 16 column pairs (``PAIR`` columns a
    lane), so the halves' totals cross by one shuffle (no shared memory, no barrier). Both halves then read the
    same columns of rows 32 apart, which the 128-byte swizzle maps to the same banks: two-way conflicts on the
    transform's shared-memory accesses (a skew of the upper half's rows would remove them)."""

    def __init__(self, gate: str = "sigmoid", swizzled: bool = False, diag: str = ""):
        if gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {gate!r}")
        if diag not in ("", "pass1"):
            raise ValueError(f"diag: expected '' or 'pass1', got {diag!r}")
        self.gate = gate
        # "pass1" (timing only, wrong tiles): the factors and the exchange, then one element written per thread
        self.diag = diag
        # stage 2's tiles are 128-byte swizzled (S<3,4,3> on byte addresses), which the DSL's element access does
        # not apply: the offsets are swizzled here (the probe's tiles are plain)
        self.swizzled = swizzled

    @cute.jit
    def pair(self, base: cute.Pointer, layout: cute.Layout, i: int, col) -> cute.Tensor:
        """The two bf16 at (token ``i`` of the half, key ``c`` and ``c + 1``) of a tile: ``base`` the half's
        (unswizzled) start in it, ``layout`` the tile's (token, key) layout, keys contiguous (the swizzle keeps
        16-byte pieces whole), ``col`` = ``crd2idx((0, c), layout)``. With ``i`` a constant, the offset is a
        constant plus the thread's column and the swizzle's row bits are known: a row costs no register (ptxas kept
        one a row and tile when it got the whole row index, and spilled). Exact where the half's start has no bits
        the swizzle reads (``kda_fwd_recur.layout_facts``, raw_half_split_mismatches)."""
        off = cute.crd2idx((i, 0), layout) + col
        if cutlass.const_expr(self.swizzled):
            lin = off * 2
            off = (lin ^ (((lin >> 7) & 7) << 4)) // 2
        return cute.make_tensor(base + off, cute.make_layout(PAIR))

    @cute.jit
    def factor(self, x: F32, dtb: F32, a_nl2e: F32, neg_a: F32, lb_log2: F32) -> F32:
        """2^g' of one raw gate element ``x``, as stage 1's phase 1 forms g' (log2 units): ``dtb`` is dt_bias (in
        log2 units for the softplus gate), ``a_nl2e`` = −exp(A_log)/ln 2, ``neg_a`` = −exp(A_log)."""
        gl = F32(0.0)
        if cutlass.const_expr(self.gate == "log"):
            y = cute.arch.fmax(x * F32(RCP_LN2), lb_log2)
            gl = -cute.arch.fmax(-y, F32(0.0))
        elif cutlass.const_expr(self.gate == "softplus"):
            y = x * F32(LOG2E) + dtb
            y_cut = -cute.arch.fmax(-y, F32(-SOFTPLUS_THRESHOLD * LOG2E))
            sp = cute.math.log2(F32(1.0) + cute.math.exp2(y_cut, fastmath=True), fastmath=True)
            gl = cute.arch.fmax(neg_a * cute.arch.fmax(sp, y), lb_log2)
        else:
            ez = cute.math.exp2(a_nl2e * (x + dtb), fastmath=True)
            gl = lb_log2 * cute.arch.rcp_approx(F32(1.0) + ez)
        return cute.math.exp2(gl, fastmath=True)

    @cute.jit
    def lane_norms(self, nq_rows: cute.Tensor, nk_rows: cute.Tensor, tidx, nrm: cute.Tensor):
        """``nrm`` (register tensor [4]) := the inverse norms of lane ``tidx % 32``'s two rows of its half (q's two,
        then k's): a half-warp's 16 lanes hold its half's 32 rows, which :meth:`chunk` passes round by shuffles.
        Issued ahead of the chunk (the next chunk's while this one is formed), the loads' latency is off the
        rows' path: read inside the row loops, one global load a row cost stage 2 3.5x (H100, session 40)."""
        lane = tidx % 32
        r = (lane // HALF_LANES) * HALF + (lane % HALF_LANES) * 2
        for j in cutlass.range_constexpr(2):
            nrm[j] = nq_rows[r + j]
            nrm[2 + j] = nk_rows[r + j]

    @cute.jit
    def row_norm(self, nrm: cute.Tensor, which: int, i: int, half, segment: bool = False):
        """The inverse norm of row ``i`` (0..31) of this lane's half, q's (``which`` 0) or k's (2), from the lane
        that holds it (:meth:`lane_norms`). Every lane of the warp takes part. ``segment``: the same value by a
        shuffle within 16-lane segments (``SEGMENT_CLAMP``), which ptxas does not merge with the whole-warp one:
        merged, k's 32 norms stayed live from the up pass to the down pass and the transform spilled 140 bytes."""
        if cutlass.const_expr(segment):
            return cute.arch.shuffle_sync(nrm[which + i % 2], i // 2, mask_and_clamp=SEGMENT_CLAMP)
        return cute.arch.shuffle_sync(nrm[which + i % 2], half * HALF_LANES + i // 2)

    @cute.jit
    def chunk(self, q_base: cute.Pointer, k_base: cute.Pointer, g_base: cute.Pointer, qk_layout: cute.Layout,
              g_layout: cute.Layout, nrm: cute.Tensor, dtb: cute.Tensor, nvalid, a_nl2e: F32, neg_a: F32,
              lb_log2: F32, tidx):
        """The thread ``tidx`` (0..127) of the warpgroup; the tiles' starts and (token, key) layouts (q's and k's
        alike); ``nrm`` this lane's rows' inverse norms (:meth:`lane_norms`); ``dtb`` its two columns' dt_bias
        (register tensor [2]). Rows at or past ``nvalid`` are written as zeros by a select, not a product: they
        hold the next sequence's tokens, where an Inf times a zero norm would be a NaN."""
        lane = tidx % 32
        c0 = first_column(tidx)
        half = lane // HALF_LANES
        r0 = half * HALF
        lim = nvalid - r0  # the half's valid rows: compared with the row's constant index, no register a row
        # the half's starts in the tiles and the thread's columns (pair)
        q_half = q_base + cute.crd2idx((r0, 0), qk_layout)
        k_half = k_base + cute.crd2idx((r0, 0), qk_layout)
        g_half = g_base + cute.crd2idx((r0, 0), g_layout)
        qk_col = cute.crd2idx((0, c0), qk_layout)
        g_col = cute.crd2idx((0, c0), g_layout)
        fac = cute.make_rmem_tensor(cute.make_layout((HALF, PAIR)), F32)
        run = cute.make_rmem_tensor(cute.make_layout(PAIR), F32)
        for j in cutlass.range_constexpr(PAIR):
            run[j] = F32(1.0)
        # down the half: the factors and the half's total (the prefixes are formed again below, in the same order:
        # keeping them would take 64 more registers)
        for i in cutlass.range_constexpr(HALF):
            g2 = self.pair(g_half, g_layout, i, g_col)
            for j in cutlass.range_constexpr(PAIR):
                f = F32(1.0)
                if i < lim:
                    f = self.factor(g2[j].to(F32), dtb[j], a_nl2e, neg_a, lb_log2)
                fac[i, j] = f
                run[j] = run[j] * f
        # the upper half's total scales the lower half's prefixes; the lower half's total the upper's suffixes
        pre_mul = cute.make_rmem_tensor(cute.make_layout(PAIR), F32)
        suf_mul = cute.make_rmem_tensor(cute.make_layout(PAIR), F32)
        for j in cutlass.range_constexpr(PAIR):
            other = cute.arch.shuffle_sync_bfly(run[j], offset=HALF_LANES)
            pre_mul[j] = F32(1.0)
            suf_mul[j] = F32(1.0)
            if half == 0:
                suf_mul[j] = other
            else:
                pre_mul[j] = other
            run[j] = F32(1.0)
        if cutlass.const_expr(self.diag == "pass1"):
            g2 = self.pair(g_half, g_layout, 0, g_col)
            for j in cutlass.range_constexpr(PAIR):
                g2[j] = BF16(pre_mul[j] * suf_mul[j])
            return
        # up the half: the suffix products (the row itself excluded) and kg in g's place
        for ii in cutlass.range_constexpr(HALF):
            i = HALF - 1 - ii
            nk = self.row_norm(nrm, 2, i, half, segment=True)
            k2 = self.pair(k_half, qk_layout, i, qk_col)
            g2 = self.pair(g_half, g_layout, i, g_col)
            for j in cutlass.range_constexpr(PAIR):
                v = (k2[j].to(F32) * nk) * (suf_mul[j] * run[j])
                if i >= lim:
                    v = F32(0.0)
                g2[j] = BF16(v)
                run[j] = run[j] * fac[i, j]
        # down again: the prefix products (the row itself included), qg and -X in q's and k's places
        for j in cutlass.range_constexpr(PAIR):
            run[j] = F32(1.0)
        for i in cutlass.range_constexpr(HALF):
            nq = self.row_norm(nrm, 0, i, half)
            nk = self.row_norm(nrm, 2, i, half)
            q2 = self.pair(q_half, qk_layout, i, qk_col)
            k2 = self.pair(k_half, qk_layout, i, qk_col)
            for j in cutlass.range_constexpr(PAIR):
                run[j] = run[j] * fac[i, j]
                p = pre_mul[j] * run[j]
                vq = (q2[j].to(F32) * nq) * p
                vx = -((k2[j].to(F32) * nk) * p)
                if i >= lim:
                    vq = F32(0.0)
                    vx = F32(0.0)
                q2[j] = BF16(vq)
                k2[j] = BF16(vx)


class RawTilesProbe:
    """One chunk through :class:`RawTiles` on one CTA of 128 threads: q, k, g ([64, 128] bf16, row-major) copied
    into shared memory, transformed, copied out to qg, −X and kg; for the CPU emulator and the compile check."""

    def __init__(self, gate: str = "sigmoid"):
        self.t = RawTiles(gate)
        self.gate = gate

    @cute.jit
    def __call__(self, pQ: cute.Pointer, pK: cute.Pointer, pG: cute.Pointer, pNq: cute.Pointer, pNk: cute.Pointer,
                 pDtb: cute.Pointer, pQG: cute.Pointer, pX: cute.Pointer, pKG: cute.Pointer, nvalid: cutlass.Int32,
                 a_exp: cutlass.Float32, lower_bound: cutlass.Float32, stream):
        tile = cute.make_layout((CHUNK, DK), stride=(DK, 1))
        rows = cute.make_layout(CHUNK)
        self.kernel(
            cute.make_tensor(pQ, tile), cute.make_tensor(pK, tile), cute.make_tensor(pG, tile),
            cute.make_tensor(pNq, rows), cute.make_tensor(pNk, rows), cute.make_tensor(pDtb, cute.make_layout(DK)),
            cute.make_tensor(pQG, tile), cute.make_tensor(pX, tile), cute.make_tensor(pKG, tile),
            nvalid, a_exp, lower_bound,
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mNq: cute.Tensor, mNk: cute.Tensor,
               mDtb: cute.Tensor, mQG: cute.Tensor, mX: cute.Tensor, mKG: cute.Tensor, nvalid: cutlass.Int32,
               a_exp: cutlass.Float32, lower_bound: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        tile = cute.make_layout((CHUNK, DK), stride=(DK, 1))
        sQ = smem.allocate_tensor(BF16, tile, 16)
        sK = smem.allocate_tensor(BF16, tile, 16)
        sG = smem.allocate_tensor(BF16, tile, 16)
        sNq = smem.allocate_tensor(F32, cute.make_layout(CHUNK), 16)
        sNk = smem.allocate_tensor(F32, cute.make_layout(CHUNK), 16)
        for n in cutlass.range_constexpr(CHUNK * DK // THREADS):
            r = (n * THREADS + tidx) // DK
            c = (n * THREADS + tidx) % DK
            sQ[(r, c)] = mQ[(r, c)]
            sK[(r, c)] = mK[(r, c)]
            sG[(r, c)] = mG[(r, c)]
        if tidx < CHUNK:
            sNq[tidx] = mNq[tidx]
            sNk[tidx] = mNk[tidx]
        cute.arch.sync_threads()
        c0 = first_column(tidx)
        dtb = cute.make_rmem_tensor(cute.make_layout(PAIR), F32)
        for j in cutlass.range_constexpr(PAIR):
            dtb[j] = mDtb[c0 + j]
            if cutlass.const_expr(self.gate == "softplus"):
                dtb[j] = dtb[j] * F32(LOG2E)
        nrm = cute.make_rmem_tensor(cute.make_layout(4), F32)
        self.t.lane_norms(sNq, sNk, tidx, nrm)
        self.t.chunk(sQ.iterator, sK.iterator, sG.iterator, tile, tile, nrm, dtb, nvalid,
                     a_exp * F32(-RCP_LN2), -a_exp, lower_bound * F32(RCP_LN2), tidx)
        cute.arch.sync_threads()
        for n in cutlass.range_constexpr(CHUNK * DK // THREADS):
            r = (n * THREADS + tidx) // DK
            c = (n * THREADS + tidx) % DK
            mQG[(r, c)] = sQ[(r, c)]
            mX[(r, c)] = sK[(r, c)]
            mKG[(r, c)] = sG[(r, c)]


def fake_args():
    """Placeholder pointers and scalars for a CPU compile of the probe (it never runs on them)."""
    from cula.kernels.common.ptx_check import fake_ptr

    dts = [BF16] * 3 + [F32] * 3 + [BF16] * 3
    return (*(fake_ptr(i, dt, 16) for i, dt in enumerate(dts)), cutlass.Int32(64), F32(1.0), F32(-5.0))


def compile_targets() -> dict:
    """CPU PTX-check targets: the probe for each gate form."""
    from cutlass.cute.runtime import make_fake_stream

    def build(gate):
        def make():
            return RawTilesProbe(gate), (*fake_args(), make_fake_stream())
        return make

    return {f"probe_{gate}": build(gate) for gate in GATES}

"""KDA forward, stage 1 of 2 on tensor cores: the intra-chunk work of one (chunk, value head) per CTA.

Same outputs, scratch layout and meaning as ``kda_fwd_intra`` (read its docstring): w, u, qg, aqk,
kgt (bf16) and gam (fp32) in the chunk-padded layout that ``kda_fwd_recur`` reads. What differs is how
they are made: the gated products ``Akk``, ``Aqk`` and ``w = T diag(β) k2^Γ``, ``u = T diag(β) v`` run
on wgmma (bf16 operands, fp32 accumulate, as FLA's chunk pipeline), and only the gate, the cumsum, the
norms and the 64x64 triangular inverse stay on the CUDA cores (fp32).

Exponent safety needs a bounded gate: this kernel is built for the in-kernel gate with a lower bound
(``lower_bound <= g < 0`` per token, FLA's ``safe_gate``), and for FLA's unbounded softplus gate clamped
at ``SOFTPLUS_FLOOR`` (read its comment for what the clamp costs). Per 16-row block ``I`` the gated
products use

    diagonal block:      2^(Γ_i − Γ_j) = 2^(Γ_i − C_I) · 2^(C_I − Γ_j),   C_I = Γ_{16I} − SHIFT
    block J < I:         2^(Γ_i − Γ_j) = 2^(Γ_i − C_I) · 2^(R_I − Γ_j) · 2^-SHIFT,   R_I = Γ_{16I}

``C_I`` is the block's first cumulative gate moved by half the block's largest possible gate range
(``SHIFT = 7.5 |lower_bound| / ln 2``), so both diagonal factors stay within ``2^±(7.5·|lb|/ln2)``
(``2^±54`` at ``lb = -5``) and depend on no token later than the row they scale (no future-gate
leakage through rounding; FLA's KDA intra makes the same choice). Off the diagonal the B operand
``k̂_j 2^(R_I − Γ_j)`` is ``<= 1`` and underflows only where the true term is below ``2^-126``; the fp32
accumulator carries ``2^SHIFT`` (``<= 2^119``, with l2-normalised q and k) until the combine takes it off.
It is formed as ``K̂ ⊙ 2^(R_I − E_J)`` from ``K̂ = k̂ 2^(E_J − Γ)``, ``E_J = Γ_{16J+15}``.
The host sends other gates to ``kda_fwd_intra`` (exact for any gate).

One warpgroup (128 threads) per CTA, two CTAs per SM (113 KB of shared memory each), or three where ``ctas=3``
drops the tiles that the w-in-stage-2 hand-off leaves dead (69 KB each, see CTAS). Phases:
  1. loads (16-byte, coalesced): q, k, v, g of the chunk; thread t owns rows 8(t/16)..+7 and columns
     8(t%16)..+7, so a row's 16 owners are one half-warp (row norms by shuffles) and warp w owns
     16-row block w. Gate transform, in-thread cumsum down its 8 rows, group totals via smem.
  2. pointwise: Γ, the reference factors, Ka = k̂ 2^(Γ−C), Qa = scale q̂ 2^(Γ−C), K̃ = k̂ 2^(C−Γ),
     K̂ = k̂ 2^(E−Γ), X = k̂ 2^Γ into swizzled smem operand tiles; qg, kgᵀ, gam straight to global.
  3. all threads scale K̂ into the B'_I tiles (``B'_I = K̂ ⊙ 2^(R_I − E_J)``, rows j < 16 I, packed bf16);
     wgmma: diagonal blocks ``Ka K̃ᵀ`` / ``Qa K̃ᵀ`` (SS, m64n64, 16 instructions) and for each row block
     I ``Ka B'_Iᵀ`` / ``Qa B'_Iᵀ`` (SS, m64n(16 I), 48 instructions), of which warp I keeps its rows.
     Combined in registers: the m64n(16 I) fragment is a prefix of the m64n64 one (same threads, rows
     and columns). (Until session 15 each warp scaled its own A rows by ``2^(C_I − E_J)`` in registers
     for an RS m64n16 product per column block J: 544 SASS instructions more, warp 3 the laggard.)
  4. T = (I + Akk)^-1 in fp32: 16x16 diagonal blocks by substitution, then T_10, T_32 and the
     lower-left 32x32 by the doubling formula T_BA = −T_B A_BA T_A (its two 32x32 products on wgmma
     over a bf16 hi/lo split of the fp32 operands, ``INV_WGMMA``; the rest on the CUDA cores).
  5. wgmma: w = T' X, u = T' v with T' = T diag(β) in bf16 (SS, m64n128k16, 8 instructions).
  6. stmatrix into swizzled tiles, TMA stores of w, u and aqk.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from cula.kernels.common.bf16_widen import WIDEN_MODES, widen_bf16
from cula.kernels.common.l2_prefetch import LINE_BYTES, prefetch_line_l2
from cula.kernels.common.sm_clock import clock32, smid
from cula.kernels.common.wgmma_frag import a_operand_layout
from cula.kernels.sm90.kda_fwd_clock import STAMP_NAMES as CLOCK_STAMPS
from cula.kernels.sm90.kda_fwd_recur import GAM_PITCH_PACK

CHUNK = 64  # tokens per chunk (FLA's chunk_size): one wgmma M tile
DK = 128  # key head dim
DV = 128  # value head dim
SUB = 16  # row block: one warp's rows of an m64 wgmma tile, and the reference-factor granularity
NBLK = CHUNK // SUB  # 4 row blocks
THREADS = 128  # one warpgroup
ROWS_PER_THREAD = 8  # pointwise phase: 8 consecutive rows ...
COLS_PER_THREAD = 8  # ... x 8 consecutive columns (one 16-byte bf16 vector per row)
GROUPS = CHUNK // ROWS_PER_THREAD  # 8 row groups of 8; group g is lanes 16(g%2).. of warp g//2
GROUPS_PER_BLOCK = SUB // ROWS_PER_THREAD  # 2 row groups per 16-row block (one warp)
CTAS_PER_SM = 2  # ~104 KB smem and <= 255 registers each: two chunks in flight per SM
#: CTAs per SM (``CULA_KDA_TC_CTAS``, session 33): 3 is for the w-in-stage-2 stage 1 with 32-row blocks (``x_out``,
#: factor_block 32), whose dead tiles then go: -X leaves from registers as qg does (no X tile), the v tile and the
#: 48-row B' tile were never touched, and the g copy lands in K̃'s tile (dead until phase 2 writes K̃). That is 70 KB
#: a CTA, and ptxas keeps the code under the 168 registers three CTAs leave a thread: 12 warps per SM instead of 8 to
#: cover the loads' wait, a fifth of a chunk's life at two CTAs. (Session 33 took it for the packed tile only: the
#: unpacked one spilled 8 bytes until -X's store moved up beside K̃'s in session 34.)
CTAS_MODES = (CTAS_PER_SM, 3)
#: The default where the host can take it (w in stage 2, 32-row blocks: packed since session 33, unpacked since 34);
#: 2 for A/B. H100, packed: stage 1 -12% at B2 T16384 (1.524 -> 1.340 ms), the kda suite 2.98x -> 3.14x FLA on one
#: card (kda_fwd_log.md).
CTAS = int(__import__("os").environ.get("CULA_KDA_TC_CTAS", str(CTAS_MODES[1])))
PAD = CHUNK + 4  # fp32 row pitch of the 64x64 matrices of the inverse: 16-byte rows, rows 4 apart on other banks
YPAD = 2 * SUB  # fp32 row pitch of the inverse's 32x32 scratch Y
#: fp32 elements by which the padded 64x64 matrices overrun their 16 KB operand tiles (sA into sQa, sT into
#: sKb1); the inverse's scratch Y starts after sA's overrun
INV_SPILL = CHUNK * PAD - CHUNK * DK // 2
PAIRS = ((1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2))  # (I, J) off-diagonal block pairs, I > J
#: Rows per reference-factor block (``CULA_KDA_TC_FACTOR_BLOCK``): 16 takes every bound down to MIN_LOWER_BOUND;
#: 32 needs ``lower_bound >= BLOCK32_MIN_LOWER_BOUND`` and has one off-diagonal block instead of six (one B' tile
#: of 32 rows, one m64n32 product per matrix; kda_fwd_log.md, sessions 23-24). The host's choice (32, the default
#: since session 24, wherever the bound allows: kda_fwd.factor_block): on an H100 eight tc checks passed at the
#: FLA-level errors of the 16-row blocks, and stage 1 took 1.734 ms against 1.838 at B2 T16384 H64 (-5.7%) and
#: -6.8 to -7.4% on the varlen n20 T4096 rows (--split worst, twice each). ``CULA_KDA_TC_FACTOR_BLOCK=16`` for A/B.
FACTOR_BLOCKS = (16, 32)
_FACTOR_BLOCK_ENV = __import__("os").environ.get("CULA_KDA_TC_FACTOR_BLOCK", str(FACTOR_BLOCKS[1]))
if _FACTOR_BLOCK_ENV not in [str(b) for b in FACTOR_BLOCKS]:
    raise ValueError(f"CULA_KDA_TC_FACTOR_BLOCK: expected one of {FACTOR_BLOCKS}, got {_FACTOR_BLOCK_ENV!r}")
FACTOR_BLOCK = int(_FACTOR_BLOCK_ENV)
#: Precomputed log-space gates (``log_gate``) take them too since session 25 (device_round loggate32 on an H100:
#: tc-loggate-safe-varlen PASS, o 4.08e-3 against the fp64 reference where FLA's is 4.35e-3; tc-loggate-safe-floor
#: PASS, its floor keeping 16-row blocks); ``CULA_KDA_TC_LOGGATE_BLOCK32=0`` keeps them at 16 rows
LOG_GATE_BLOCK32 = __import__("os").environ.get("CULA_KDA_TC_LOGGATE_BLOCK32", "1") == "1"
RCP_LN2 = 1.0 / math.log(2.0)
L2NORM_EPS = 1e-6
#: The gate bound this kernel takes: the diagonal factors reach 2^(7.5 |lb| / ln 2) = 2^119 at lb = -11
#: (fp32 and bf16 overflow at 2^128). kda_fwd sends looser or no bounds to the exact SIMT kernel.
MIN_LOWER_BOUND = -11.0
#: The softplus gate ``-exp(A_log) softplus(x + dt_bias)`` (FLA's in-kernel gate without a lower bound,
#: what its KimiDeltaAttention layer calls) has no bound, so this kernel clamps it per token and channel
#: at ``SOFTPLUS_FLOOR`` (the host passes it as ``lower_bound``): a token that would decay a channel by
#: more than e^-11 = 1.7e-5 decays it by exactly that. The exact result differs by at most that factor
#: times what the clamped decay was applied to, 1.7e-5 relative, far below bf16's 3.9e-3 rounding of o.
SOFTPLUS_FLOOR = MIN_LOWER_BOUND
#: 32-row factor blocks: the factors reach 2^(15.5 |lb| / ln 2) and the off-diagonal accumulator sums 128 such
#: terms, within 2^127 while 15.5 |lb| / ln 2 <= 120
BLOCK32_MIN_LOWER_BOUND = -120.0 * math.log(2.0) / 15.5
SOFTPLUS_THRESHOLD = 20.0  # softplus(z) = z above it, as torch's and FLA's
LOG2E = 1.0 / math.log(2.0)
SMEM_PER_SM = 233472  # H100/H200: answers the DSL's device query on a CPU compile
#: Step 3 of the inverse (the lower-left 32x32 block: 512 FMA and ~110 shared loads per thread on the
#: CUDA cores) as two wgmma products on a bf16 hi/lo split of each fp32 operand (three passes:
#: hi·hi + hi·lo + lo·hi, ~2^-17 relative against fp32's 2^-24; T' is rounded to bf16 right after).
#: One warpgroup only. On since its H200 A/B (session 7: six check cases pass with the SIMT path's
#: errors to three digits; stage 1 1.5% faster at B1 T16384); ``CULA_KDA_TC_INV_WGMMA=0`` restores SIMT.
INV_WGMMA = __import__("os").environ.get("CULA_KDA_TC_INV_WGMMA", "1") == "1"
#: Each CTA asks L2 (per-thread ``prefetch.global.L2``, 4 lines a thread for bf16 inputs) for the q, k,
#: v, g rows of the CTA this many places later in launch order (0: off), so that CTA's 32 loads a thread
#: hit L2. On since its H200 A/B (session 9: stage 1 6-8% faster at 66, 4.6% at 132; suite graph geomean
#: 2.29x -> 2.39x). Session 6's TMA bulk prefetch of the same rows was 1-12% slower (the per-thread form
#: also won over the bulk one in stage 2, session 8). Where TMA brings q, k and g (a bf16 gate under the TMA phase
#: 1s) it no longer pays and is off (session 28, H100: 0 against 66 −0.5% of stage 1 at B2 T16384, within noise
#: on the n20 rows; with phase 1 "tma_g_first", −2.0%: kda_fwd_log.md): KdaFwdIntraTC.prefetch_for.
#: ``CULA_KDA_TC_PREFETCH`` sets it for every build (A/B runs); unset (None), the rule above decides.
PREFETCH_LOADS = 66
PREFETCH_AHEAD = (lambda v: int(v) if v else None)(__import__("os").environ.get("CULA_KDA_TC_PREFETCH"))
#: How phase 2 forms its reference factors per element (kda_fwd_log.md, sessions 20-21): "halves" (the default since
#: session 21) 2^(Γ−C) and 2^(C−Γ) by exp2, 2^Γ never formed: the products that need it, q·2^Γ and k·2^Γ, are
#: (q·2^(Γ−C))·2^(C/2)·2^(C/2) from the q·2^(Γ−C) already formed (136 MUFU per thread, no drift; the halves keep
#: every intermediate in range, see the branch); "direct" also 2^Γ by exp2 (192 MUFU, 24 fewer instructions).
#: Session 21 (H100, `--split worst`, twice each, left-looking substitution): halves 0.8% faster than direct at B2
#: T16384 and 1.2-1.9% on the n20 rows, six tc checks PASS. Session 22 (H100, with the right-looking substitution):
#: halves 1.1% slower than direct at B2 T16384, 1.3% faster on two n20 rows. Session 23 (H100): direct passes all six
#: checks; against halves -0.7% of both stages at B2 T16384 and +0.4-0.8% on the n20 rows, so halves stays the
#: default (kda_fwd_log.md, sessions 22-23). (Session 19's running products, "chain", with the same MUFU
#: saving, more instructions and a few ulps of drift, were removed unmeasured.) ``CULA_KDA_TC_GATE_FACTORS=direct``
#: for A/B. "square" (session 37, opt-in): 2^C = h h once a column, one FMUL an element for X and for qg (see phase 2;
#: SASS 4,800 -> 4,679 a thread); H100: nine checks PASS, stage 1 at B2 T16384 within noise (1.316 / 1.315 -> 1.318 /
#: 1.308 ms), about -1% on the n20 rows: not worth the absolute error it adds below 2^-126.
GATE_FACTOR_MODES = ("halves", "direct", "square")
GATE_FACTORS = __import__("os").environ.get("CULA_KDA_TC_GATE_FACTORS", "halves")
#: How the inverse's four 16x16 diagonal blocks are substituted (session 21): "right" (the default) the block's A
#: in registers first, then each final entry updates every later row (a 15-FMA chain; same terms, same order);
#: "left" a row's dot product at a time, its A row loaded just before (chains of ~64 FMAs and 16 shared loads).
#: Session 21 (H100, `--split worst`, twice each): right 3.0% faster at B2 T16384 (stage 1 1.887 -> 1.830 ms),
#: 1.3-1.4% on the n20 rows. ``CULA_KDA_TC_SUBST=left`` for A/B.
SUBST_MODES = ("right", "left")
SUBST = __import__("os").environ.get("CULA_KDA_TC_SUBST", "right")
#: Phase 1's form. "tma_g_first" (session 28, the default since its H100 run) brings q, k and a bf16 gate by TMA on
#: two mbarriers, g's issued first: phase 1 (the gate, the cumsum, the group totals), the column pass and phase 2's
#: gate factors run while q and k are still arriving; the threads wait for them, read them back and take the l2
#: norms just before phase 2's rows (the clock, session 28: phase 1 waited 5,374 cycles of a chunk's 23,131 for
#: its loads at two CTAs per SM, then worked 2,719). An fp32 gate keeps "tma_qk"'s one barrier. H100, session 28
#: (`--split worst`, with the L2 prefetch off: PREFETCH_AHEAD): stage 1 −2.0% at B2 T16384 against "tma_qkg" with
#: it (1.622 -> 1.590 ms, three times each), −1 to −3% on the n20 rows; with the prefetch on, ±0; nine checks PASS.
#: "tma_qkg" (session 28's first default) is "tma_qk" with a bf16 gate arriving by TMA too, on the same mbarrier:
#: its 64 rows land in the X tile (dead until phase 2 writes X) and are read back like q, k; the 8 per-thread
#: 16-byte g loads and their addresses go, and a last chunk's rows past the end are zeroed with q's and k's (a NaN
#: there would survive the sigmoid gate's zero factor). H100, session 28 (twice each against tma_qk): stage 1
#: −1.1% at B2 T16384 (1.641 -> 1.623 ms), −0.6 / −1.2 / −1.7% on the uniform / random / skewed n20 rows.
#: "tma_qk" (session 27) is "lean" with q and k arriving by TMA straight into the Qa / Ka tiles (warp 0, two
#: copies, an mbarrier): no per-thread global loads, address arithmetic or raw-tile stores for them; the threads
#: read their rows back from shared memory for the l2 sums. Rows past a partial chunk's end are the next tokens
#: there (zeros past the tensor): in a sequence's last chunk each thread zeroes its own part of them before
#: reading, so nothing of another sequence is multiplied (by zero: Inf would make NaN). Outputs bitwise the lean
#: phase 1's. H100, session 27 (twice each against lean): stage 1 −3.5% at B2 T16384 (1.691 -> 1.632 ms), −2.1 /
#: −3.1 / −3.4% on the uniform / random / skewed n20 rows. "lean" (session 26) takes the l2 norms' sums over a
#: half-warp by recursive halving (31 shuffles and one rsqrt per lane instead of a butterfly's 64 shuffles and 16
#: rsqrt; the same sums, bitwise), the lower-bounded gate's exponent as one FFMA and the group totals as 16-byte
#: stores: SASS 4,928 -> 4,736, 201 -> 197 registers (t_out, 32-row blocks). "pre26" is session 25's phase 1.
#: Every mode's outputs are bitwise the same. ``CULA_KDA_TC_PHASE1=tma_qkg`` (with ``CULA_KDA_TC_PREFETCH=66``:
#: session 28's first default) / ``tma_qk`` / ``lean`` / ``pre26`` for A/B runs. ("mma_norms", the row norms as
#: the diagonals of two wgmma products Q Qᵀ, K Kᵀ, was measured in session 27 and removed: −1.1% at B2 T16384 at
#: best, +1 to +3% on the n20 rows; kda_fwd.md.)
PHASE1_MODES = ("tma_g_first", "tma_qkg", "tma_qk", "lean", "pre26")
PHASE1 = __import__("os").environ.get("CULA_KDA_TC_PHASE1", PHASE1_MODES[0])
#: The order the CTAs are launched in (session 31). "head_rev" (the default since session 31): value head fastest, the
#: chunks last to first (grid [HV, NC]), so the CTAs resident together read the same 64 tokens of every head (q, k, g
#: rows are [token, head, 128]: one contiguous MB a tensor) and the last CTAs are the first chunks of the first
#: sequences, every head: what stage 2 reads first. "chunk" (before): chunk fastest, then value head (grid [NC, HV]).
#: The outputs are the same. H100, session 31 (`--split l2` and `all`, twice each in turn): stage 1 −2.1% at B2 T16384
#: (1.592 -> 1.559 ms; both stages 2.628 -> 2.594), both −1.9% at B1 T1024, −0.3 to −1.3% at B1 / B2 T4096, B1 / B2
#: T512 unchanged, within ±0.4% on the varlen rows, B1 T16384 +0.2%. Stage 2 alone and "both − stage 1" did not
#: move: L2 carries no measurable share of the hand-off; the gain is stage 1's own reads. (Evict-first q, k, g TMA
#: loads were measured with it and removed: +0.6% at B2 T16384, stage 1 +3% on the n20 rows; the code is at d71cb43.)
#: ``CULA_KDA_TC_ORDER=chunk`` for A/B.
ORDER_MODES = ("head_rev", "chunk")
ORDER = __import__("os").environ.get("CULA_KDA_TC_ORDER", ORDER_MODES[0])
WIDEN = __import__("os").environ.get("CULA_KDA_TC_WIDEN", WIDEN_MODES[0])
#: How 32-row blocks form kgᵀ = k̂ 2^(Γ_last − Γ) (session 37): "ref", (K̃ 2^(ref − C)) 2^(Γ_last − ref) with ref = Γ at
#: row 32 for block 0's rows (the first product is then B', which those rows form anyway) and C_1 for block 1's, two
#: FMUL an element; "kh", (K̃ 2^(E − C)) 2^(Γ_last − E) with E the block's last Γ, three with B' (before session 37;
#: ``CULA_KDA_TC_KGT=kh`` for A/B). 16-row blocks always take "kh".
KGT_MODES = ("ref", "kh")
KGT = __import__("os").environ.get("CULA_KDA_TC_KGT", KGT_MODES[0])
MAX_GRID_Y = 65535  # "head_rev" launches [HV, NC]: longer inputs keep "chunk" (kda_fwd)
#: Timing diagnostics (``CULA_KDA_TC_DIAG``, comma-separated; the outputs are WRONG with any of them, and
#: kda_fwd warns): which part of stage 1's time is memory. They apply to whichever stage 1 is the default
#: (since session 18 u in stage 2's, ``t_out``). ``l2_loads``: every CTA reads its head's first rows (L2 hits
#: instead of DRAM); ``no_qg_kgt`` / ``no_wu_store`` / ``no_aqk_store`` (T' too with ``t_out``): those stores
#: sit under a condition that is false at run time but opaque to the compiler (``scale < 0``; ``nvalid < 0``
#: was folded away, the values with it), so the values are still formed; ``no_inverse``: phase 4 is
#: skipped the same way; ``no_v_u``: without ``t_out``, stage 1 as it would be with u = T' v formed in stage 2
#: (no v loads, prefetches or tile, no u product or store: removed at compile time; the T' store missing;
#: kda_fwd_log.md, session 16's reading; a no-op with ``t_out``); ``one_cta``: the launch asks for ``ONE_CTA_SMEM``
#: of shared memory, so one CTA runs per SM instead of two (same code and values: only the warps per SM change;
#: what a fused kernel with one stage-1 warpgroup per SM would keep of stage 1's throughput, kda_fwd_log.md session
#: 23). A split per option against none says what each costs. ``clock`` (outputs right): the threads read the SM's
#: cycle counter where each phase ends (after its CTA barrier); thread 0 stores CLOCK_SLOTS int32 per chunk after
#: γ's floats in the same buffer (kda_fwd.LAST_CLOCKS; ``python -m cula.kernels.sm90.kda_fwd_clock`` reads them):
#: the phases' time per chunk, and from the SM ids how much of a CTA's life it shares its SM. ``no_tp_store``
#: (``t_out``): T''s store alone skipped, Aqk's kept: 8 KB a chunk fewer written, what packing Aqk and T' into one
#: 64 x 64 tile would save stage 1 at most (session 29).
DIAG_OPTIONS = ("l2_loads", "no_qg_kgt", "no_wu_store", "no_aqk_store", "no_inverse", "no_v_u", "one_cta", "clock",
                "no_tp_store")
#: the ``one_cta`` diagnostic's shared-memory request: more than half of an SM's 228 KB, within a CTA's 227 KB
ONE_CTA_SMEM = 160 * 1024
#: the diagnostics whose stage-1 outputs are right (kda_fwd warns for the others): one_cta changes only the warps per SM
SAME_OUTPUT_DIAGS = ("one_cta", "clock")
#: the ``clock`` diagnostic's int32 slots per chunk: the low 32 bits of the cycle counter at each stamp of
#: CLOCK_STAMPS, in that order (the stamp after a step a build skips, e.g. the B' pass of 32-row factor blocks,
#: follows at once; kda_fwd_clock unwraps them), then the SM id in the last slot
CLOCK_SLOTS = 20  # a multiple of 4: thread 0 stores them 16 bytes at a time
assert len(CLOCK_STAMPS) < CLOCK_SLOTS
#: the diagnostics the three-CTA stage 1 takes (session 38; before it any diagnostic ran the two-CTA build, so
#: session 36's raw_premise timed the stores' absence at two CTAs against the default at three): the clock (its
#: 32-bit stamps fit) and the skipped stores (the −X rows' register stores too), no spills in any of them
CTAS3_DIAGS = ("clock", "no_qg_kgt", "no_wu_store", "no_aqk_store")
#: the diagnostics that keep stage 1's values (all but no_v_u): what device_round's diag_split times one by one
SAME_VALUE_DIAGS = tuple(d for d in DIAG_OPTIONS if d != "no_v_u")
DIAG = tuple(x for x in __import__("os").environ.get("CULA_KDA_TC_DIAG", "").split(",") if x)
SPLIT_PASSES = ((0, 0), (0, 1), (1, 0))  # (A part, B part) of each pass, 0 = hi, 1 = lo: lo·lo is dropped

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


def factor_shift(block: int) -> float:
    """``shift / lower_bound``: half of a ``block``-row block's largest gate range, in log2 units (negated)."""
    return -(block / 2 - 0.5) * RCP_LN2


def pair_index(i_blk: int, j_blk: int) -> int:
    """Index of (I, J), I > J, in ``PAIRS`` (row-major over the strictly lower block triangle)."""
    return i_blk * (i_blk - 1) // 2 + j_blk


class KdaFwdIntraTC:
    """Compile-time configuration (flags and dtypes) of the tensor-core intra-chunk kernel."""

    def __init__(
        self,
        use_qk_l2norm: bool,
        has_a_log: bool,
        has_dt_bias: bool,
        use_beta_sigmoid: bool,
        allow_neg_eigval: bool,
        group: int,
        inv_wgmma: bool = True,
        pdl_trigger: str = "start",
        prefetch_ahead: int | None = PREFETCH_AHEAD,
        softplus_gate: bool = False,
        emit_akk: bool = False,
        log_gate: bool = False,
        t_out: bool = False,
        diag: tuple = (),
        gate_factors: str = GATE_FACTOR_MODES[0],
        subst: str = SUBST_MODES[0],
        factor_block: int = FACTOR_BLOCKS[0],
        phase1: str = PHASE1_MODES[0],
        pack: bool = False,
        order: str = ORDER_MODES[0],
        x_out: bool = False,
        ctas: int = CTAS_MODES[0],
        widen: str = WIDEN_MODES[0],
        kgt: str = KGT_MODES[0],
        raw_out: bool = False,
    ):
        unknown = [d for d in diag if d not in DIAG_OPTIONS]
        if unknown:
            raise ValueError(f"diag (CULA_KDA_TC_DIAG): expected names from {DIAG_OPTIONS}, got {unknown}")
        self.diag = tuple(diag)  # timing diagnostics only (see DIAG)
        # False: the lower-bounded sigmoid gate lb * sigmoid(exp(A_log) (x + dt_bias)); True: the softplus
        # gate, clamped at the runtime lower_bound (SOFTPLUS_FLOOR)
        self.softplus_gate = softplus_gate
        # True: g is already the log-space decay (natural log; FLA's use_gate_in_kernel=False with safe_gate,
        # i.e. the caller bounds it), taken to log2 units and clamped to [lower_bound, 0] (the exponent
        # safety needs the bound; SOFTPLUS_FLOOR when the caller gives none)
        assert not (log_gate and softplus_gate), "one gate form"
        self.log_gate = log_gate
        # also store bf16(T), T = (I + Akk)^-1, as FLA's saved ``Akk`` (chunk-padded [HV, NC*64, 64] rows
        # right after qg's [HV, NC*64, 128] in the same buffer, so the argument list stays kda_fwd_intra's):
        # what FLA's backward needs besides Aqk to run after this forward (cula.kda._train)
        self.emit_akk = emit_akk
        # "u in stage 2" (kda_fwd.U_IN_RECUR): stage 1 neither reads v nor forms u = T' v; it stores T' (bf16,
        # [64, 64] per chunk) beside Aqk (the Aqk buffer is [HV, NC*64, 128]: Aqk in columns 0-63, T' in 64-127,
        # so stage 2 loads both with one TMA box) and -w instead of w (from -X; stage 2 then forms v_new =
        # T' v + S^T(-w) in one accumulator); pU is not used
        assert not (t_out and emit_akk), "emit_akk keeps u (the training path runs the default stages)"
        self.t_out = t_out
        # packed [Aqk | T'] (kda_fwd.PACK, t_out only): one [64, 64] tile per chunk, Aqk on and below the diagonal
        # and T' strictly below it stored transposed (T'[i, j] at row j, column i), so the Aqk buffer is
        # [HV, NC*64, 64]; T''s diagonal (bf16(β)) goes to γ's row, whose pitch becomes GAM_PITCH_PACK floats
        # (γ's 128, then 64 bf16). Stage 2 (KdaFwdRecur(pack=True)) reads the tile twice and masks each copy.
        if pack and not t_out:
            raise ValueError("pack (CULA_KDA_PACK): needs t_out (u in stage 2), got t_out=False")
        self.pack = pack
        # "w in stage 2" (kda_fwd.W_IN_RECUR, t_out only): no w = T'(-X) product; the -X tile itself leaves by TMA
        # into the w buffer as soon as phase 2 has formed it, and stage 2 (KdaFwdRecur(x_in=True)) forms
        # v_new = T'(v - X S) with the T' it reads anyway (kda_fwd.md, "w in stage 2")
        if x_out and not t_out:
            raise ValueError("x_out (CULA_KDA_W_IN_RECUR): needs t_out (u in stage 2), got t_out=False")
        self.x_out = x_out
        # raw tiles (kda_fwd_raw_tiles, session 39): stage 2 forms qg, -X and kg from q, k, g, so none of them is
        # stored (kgᵀ not even formed); the rows' inverse norms leave instead, [HV, NC, 2, 64] fp32 (q's times the
        # scale, then k's) through the kgᵀ pointer
        if raw_out and not (x_out and use_qk_l2norm):
            raise ValueError(f"raw_out (raw tiles): needs x_out and use_qk_l2norm, got x_out={x_out}, "
                             f"use_qk_l2norm={use_qk_l2norm}")
        self.raw_out = raw_out
        # CTAs per SM (CTAS): 3 drops the X, v and 48-row B' tiles, which only x_out with 32-row blocks leaves dead
        if ctas not in CTAS_MODES:
            raise ValueError(f"ctas (CULA_KDA_TC_CTAS): expected one of {CTAS_MODES}, got {ctas!r}")
        # and of the diagnostics only those that keep its tiles and registers (CTAS3_DIAGS)
        if ctas != CTAS_MODES[0] and not (x_out and factor_block != SUB and set(diag) <= set(CTAS3_DIAGS)):
            raise ValueError(f"ctas (CULA_KDA_TC_CTAS) = {ctas}: needs x_out (w in stage 2), 32-row factor blocks "
                             f"and no diagnostic but {', '.join(CTAS3_DIAGS)}, got x_out={x_out}, "
                             f"factor_block={factor_block}, diag={tuple(diag)}")
        self.ctas = ctas
        self.lean_smem = ctas != CTAS_MODES[0]  # no X, v or 48-row B' tile; g lands in K̃'s
        # no v loads, prefetches or tile and no u product or store: t_out, or the diagnostic that times it
        self.skip_vu = t_out or "no_v_u" in self.diag
        self.clock = "clock" in self.diag  # phase timestamps (CLOCK_STAMPS), the outputs unchanged
        self.inv_wgmma = inv_wgmma
        if gate_factors not in GATE_FACTOR_MODES:
            raise ValueError(f"gate_factors (CULA_KDA_TC_GATE_FACTORS): expected one of {GATE_FACTOR_MODES}, "
                             f"got {gate_factors!r}")
        self.gate_factors = gate_factors  # GATE_FACTORS
        if subst not in SUBST_MODES:
            raise ValueError(f"subst (CULA_KDA_TC_SUBST): expected one of {SUBST_MODES}, got {subst!r}")
        self.subst = subst  # SUBST
        if phase1 not in PHASE1_MODES:
            raise ValueError(f"phase1 (CULA_KDA_TC_PHASE1): expected one of {PHASE1_MODES}, got {phase1!r}")
        self.lean = phase1 != "pre26"  # PHASE1
        self.tma_qk = phase1 in ("tma_qkg", "tma_g_first", "tma_qk")  # q and k by TMA
        self.tma_g = phase1 in ("tma_qkg", "tma_g_first")  # g too; for a bf16 gate only (g_by_tma)
        self.g_first = phase1 == "tma_g_first"  # g on its own barrier, q and k waited for late (g_first_by_tma)
        if factor_block not in FACTOR_BLOCKS:
            raise ValueError(f"factor_block (CULA_KDA_TC_FACTOR_BLOCK): expected one of {FACTOR_BLOCKS}, "
                             f"got {factor_block!r}")
        assert factor_block == SUB or not softplus_gate, "32-row blocks: the softplus gate's floor is below their bound"
        self.factor_block = factor_block  # FACTOR_BLOCK; the host takes 32 only for bounds >= BLOCK32_MIN_LOWER_BOUND
        # when to signal griddepcontrol.launch_dependents: "start" (on entry: stage 2, launched with
        # programmatic dependent launch, may start once every CTA of this grid is resident, i.e. during
        # the last wave), "end" (after the chunk's work) or "" (never: stage 2 starts at this grid's end)
        assert pdl_trigger in ("start", "end", ""), pdl_trigger
        self.pdl_trigger = pdl_trigger
        # CTAs ahead whose inputs this CTA asks L2 for (0: none; None: prefetch_for's rule)
        self.prefetch_ahead = prefetch_ahead
        self.use_qk_l2norm = use_qk_l2norm
        self.has_a_log = has_a_log
        self.has_dt_bias = has_dt_bias
        self.use_beta_sigmoid = use_beta_sigmoid
        self.beta_mult = 2.0 if allow_neg_eigval else 1.0
        self.group = group  # HV // H
        if order not in ORDER_MODES:
            raise ValueError(f"order (CULA_KDA_TC_ORDER): expected one of {ORDER_MODES}, got {order!r}")
        self.order = order  # ORDER
        if widen not in WIDEN_MODES:
            raise ValueError(f"widen (CULA_KDA_TC_WIDEN): expected one of {WIDEN_MODES}, got {widen!r}")
        self.widen = widen  # WIDEN: how bf16 inputs become fp32 (bf16_widen; same bits either way)
        if kgt not in KGT_MODES:
            raise ValueError(f"kgt (CULA_KDA_TC_KGT): expected one of {KGT_MODES}, got {kgt!r}")
        self.kgt_ref = kgt == "ref" and factor_block != SUB  # KGT

    # ------------------------------------------------------------------------------ host side --
    @cute.jit
    def __call__(
        self,
        pQ: cute.Pointer,  # [TT, H, 128]
        pK: cute.Pointer,  # [TT, H, 128]
        pV: cute.Pointer,  # [TT, HV, 128]
        pG: cute.Pointer,  # [TT, HV, 128] raw gate
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
        # The argument list is kda_fwd_intra's: the host launches either kernel with the same values.
        HV, NC = num_heads_v, num_chunks
        R = NC * CHUNK
        kmaj = utils.LayoutEnum.ROW_MAJOR
        mnmaj = utils.LayoutEnum.COL_MAJOR
        # operand tiles (swizzled wgmma canonical layouts; see the smem budget in kda_fwd.md)
        self.a_layout = sm90_utils.make_smem_layout_a(kmaj, (CHUNK, CHUNK, DK), BF16, 1)  # Ka, Qa [64, 128]
        self.kt_layout = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, DK), BF16, 1)  # K̃ [64 tok, 128]
        self.x_layout = sm90_utils.make_smem_layout_b(mnmaj, (CHUNK, DV, CHUNK), BF16, 1)  # X, v: (d, tok)
        self.tb_layout = sm90_utils.make_smem_layout_a(kmaj, (CHUNK, DV, CHUNK), BF16, 1)  # T' [64, 64]
        # output staging for the TMA stores: the layouts kda_fwd_recur's TMA loads read back
        self.w_layout = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, DK), BF16, 1)  # w, u [64 tok, 128]
        self.aqk_layout = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, CHUNK), BF16, 1)  # [64, 64]

        mW = cute.make_tensor(pW, cute.make_layout((R, DK, HV), stride=(DK, 1, R * DK)))
        mU = cute.make_tensor(pU, cute.make_layout((R, DV, HV), stride=(DV, 1, R * DV)))
        aqk_w = 2 * CHUNK if cutlass.const_expr(self.t_out and not self.pack) else CHUNK  # row pitch: Aqk (| T')
        mAqk = cute.make_tensor(pAqk, cute.make_layout((R, aqk_w, HV), stride=(aqk_w, 1, R * aqk_w)))
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        w_one = cute.slice_(self.w_layout, (None, None, 0))
        aqk_one = cute.slice_(self.aqk_layout, (None, None, 0))
        if cutlass.const_expr(self.x_out):  # -X leaves from its operand tile (d, token): the w rows, read d first
            mXt = cute.make_tensor(pW, cute.make_layout((DK, R, HV), stride=(1, DK, R * DK)))
            x_one = cute.slice_(self.x_layout, (None, None, 0))
            tma_w, tW = cpasync.make_tiled_tma_atom(s2g, mXt, x_one, (DK, CHUNK))
        else:
            tma_w, tW = cpasync.make_tiled_tma_atom(s2g, mW, w_one, (CHUNK, DK))
        tma_u, tU = cpasync.make_tiled_tma_atom(s2g, mU, w_one, (CHUNK, DV))
        tma_aqk, tAqk = cpasync.make_tiled_tma_atom(s2g, mAqk, aqk_one, (CHUNK, CHUNK))
        tma_q = tQ = tma_k = tK = tma_g = tG = None
        if cutlass.const_expr(self.tma_qk):
            # q, k as (token, d, head): a box is one head's 64 rows from any first token into a Qa / Ka tile
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            a_one = cute.slice_(self.a_layout, (None, None, 0))
            qk = cute.make_layout((total_tokens, DK, num_heads), stride=(num_heads * DK, 1, DK))
            tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(pQ, qk), a_one, (CHUNK, DK))
            tma_k, tK = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(pK, qk), a_one, (CHUNK, DK))
            if cutlass.const_expr(self.g_by_tma(pG.dtype)):  # g as (token, d, value head): a K-major tile in X
                gl = cute.make_layout((total_tokens, DK, num_heads_v), stride=(num_heads_v * DK, 1, DK))
                tma_g, tG = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(pG, gl), a_one, (CHUNK, DK))

        kmode = warpgroup.OperandMajorMode.K
        mnmode = warpgroup.OperandMajorMode.MN
        # diagonal blocks: A = Ka / Qa (smem), B = K̃ (smem)                     [64 i, 64 j]
        mma_diag = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, kmode, F32, (1, 1, 1), (CHUNK, CHUNK))
        # row block I's off-diagonal part: A = Ka / Qa (smem), B = B'_I, rows j < 16 I (smem)  [64 i, 16 I j]
        kb_layouts = [sm90_utils.make_smem_layout_b(kmaj, (CHUNK, SUB * ib, DK), BF16, 1) for ib in (1, 2, 3)]
        mma_offs = [sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, kmode, F32, (1, 1, 1), (CHUNK, SUB * ib))
                    for ib in (1, 2, 3)]
        # w = T' X and u = T' v: A = T' (smem), B = X / v with d contiguous             [64 i, 128 d]
        mma_wu = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, mnmode, F32, (1, 1, 1), (CHUNK, DK))

        SharedStorage = self.storage_class()
        self.shared_storage = SharedStorage
        self.kernel(
            pQ, pK, pV, pG, pBeta, pALog, pDtBias, pChunks, pQG, pKGT, pGam,
            tma_w, tW, tma_u, tU, tma_aqk, tAqk, tma_q, tQ, tma_k, tK, tma_g, tG,
            mma_diag, mma_offs[0], mma_offs[1], mma_offs[2], mma_wu,
            self.a_layout, self.kt_layout, kb_layouts[0], kb_layouts[1], kb_layouts[2], self.x_layout,
            self.tb_layout, self.w_layout, self.aqk_layout,
            num_heads, HV, NC, scale, lower_bound, pW if cutlass.const_expr(self.lean_smem) else None,
        ).launch(grid=self.grid(NC, HV), block=[THREADS, 1, 1], stream=stream,
                 smem=self.launch_smem(SharedStorage.size_in_bytes()), min_blocks_per_mp=self.ctas)

    def grid(self, NC, HV) -> list:
        """The launch grid of ``order``: one CTA per (chunk, value head); "head_rev" needs NC <= MAX_GRID_Y."""
        return [HV, NC, 1] if self.order == "head_rev" else [NC, HV, 1]

    @cute.jit
    def launch_coords(self, pos, HV, NC):
        """(chunk, value head) of the CTA at launch position ``pos`` (0 first) under ``order``."""
        if cutlass.const_expr(self.order == "head_rev"):
            q = pos // HV
            return NC - 1 - q, pos - q * HV
        else:
            hv = pos // NC
            return pos - hv * NC, hv

    @cute.jit
    def my_coords(self, HV, NC):
        """(chunk, value head) of this CTA (read off the grid's two dimensions: a division here cost 19 registers)."""
        bx, by, _ = cute.arch.block_idx()
        chunk, hv = bx, by
        if cutlass.const_expr(self.order != "chunk"):
            chunk, hv = NC - 1 - by, bx
        return chunk, hv

    def g_by_tma(self, g_dtype) -> bool:
        """phase1 "tma_qkg" / "tma_g_first" bring a bf16 gate by TMA only: an fp32 one keeps the per-thread loads."""
        return self.tma_g and g_dtype.width == 16

    def prefetch_for(self, g_dtype) -> int:
        """CTAs ahead for the per-thread L2 prefetch: ``prefetch_ahead`` where given, else none where TMA brings
        q, k and g (it no longer pays there, session 28) and PREFETCH_LOADS where threads load g themselves."""
        if self.prefetch_ahead is not None:
            return self.prefetch_ahead
        return 0 if self.g_by_tma(g_dtype) else PREFETCH_LOADS

    def g_first_by_tma(self, g_dtype) -> bool:
        """phase1 "tma_g_first" splits the loads' barrier for a bf16 gate only (the one g_by_tma brings)."""
        return self.g_first and self.g_by_tma(g_dtype)

    def launch_smem(self, storage_bytes: int) -> int:
        """Dynamic shared memory the launch asks for: the storage, or ONE_CTA_SMEM under the ``one_cta`` diagnostic."""
        return max(storage_bytes, ONE_CTA_SMEM) if "one_cta" in self.diag else storage_bytes

    def storage_class(self):
        """The kernel's shared memory (see the smem budget in kda_fwd.md): the three B'_I tiles (16, 32, 48
        rows; 24 KB, contiguous: the inverse's sT overruns into the first, the Aqk staging follows) and bf16
        factors, 113 KB in all, so two CTAs fit an SM (2 x (113 + 1) KB: all of its 228). ``lean_smem`` (ctas=3)
        drops B'_3, X and v: 69 KB, three CTAs (3 x (69 + 1) KB)."""
        mr, al = cute.struct.MemRange, cute.struct.Align
        tile = al[mr[BF16, CHUNK * DK], 1024]
        fields = dict(sKa=tile, sQa=tile, sKt=tile, sKb1=al[mr[BF16, SUB * DK], 1024],
                      sKb2=al[mr[BF16, 2 * SUB * DK], 1024], sKb3=al[mr[BF16, 3 * SUB * DK], 1024],
                      sX=tile, sV=al[mr[BF16, CHUNK * DV], 1024],
                      sTot=al[mr[F32, (GROUPS + 1) * DK], 16], sFirst=al[mr[F32, NBLK * DK], 16],
                      sC=al[mr[BF16, len(PAIRS) * DK], 16], sBeta=al[mr[F32, CHUNK], 16])
        if self.lean_smem:  # (sKb1 and sKb2 stay side by side: the Aqk staging spans them)
            for dead in ("sKb3", "sX", "sV"):
                del fields[dead]
        if self.tma_qk:  # the loads' mbarrier(s: g_first), in the struct's 1 KB alignment padding (same total)
            fields["sMbar"] = al[mr[cutlass.Int64, 2 if self.g_first else 1], 8]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------------------- device side --
    @cute.kernel
    def kernel(
        self,
        pQ: cute.Pointer,
        pK: cute.Pointer,
        pV: cute.Pointer,
        pG: cute.Pointer,
        pBeta: cute.Pointer,
        pALog: cute.Pointer,
        pDtBias: cute.Pointer,
        pChunks: cute.Pointer,
        pQG: cute.Pointer,
        pKGT: cute.Pointer,
        pGam: cute.Pointer,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_u: cute.CopyAtom,
        tU: cute.Tensor,
        tma_aqk: cute.CopyAtom,
        tAqk: cute.Tensor,
        tma_q,  # phase1 "tma_qk": the q / k loads' atoms and tensors (None otherwise)
        tQ,
        tma_k,
        tK,
        tma_g,  # g by TMA (g_by_tma): the g load's atom and tensor (None otherwise)
        tG,
        mma_diag: cute.TiledMma,
        mma_off1: cute.TiledMma,
        mma_off2: cute.TiledMma,
        mma_off3: cute.TiledMma,
        mma_wu: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        kt_layout: cute.ComposedLayout,
        kb1_layout: cute.ComposedLayout,
        kb2_layout: cute.ComposedLayout,
        kb3_layout: cute.ComposedLayout,
        x_layout: cute.ComposedLayout,
        tb_layout: cute.ComposedLayout,
        w_layout: cute.ComposedLayout,
        aqk_layout: cute.ComposedLayout,
        H: cutlass.Int32,
        HV: cutlass.Int32,
        NC: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        pXd,  # lean_smem: the w buffer, where -X goes straight from registers (None otherwise)
    ):
        if cutlass.const_expr(self.pdl_trigger == "start"):
            cute.arch.griddepcontrol_launch_dependents()
        # The sync-free varlen tables end in dummy chunks (nvalid = 0) that nobody reads: leave at once.
        chunk, _ = self.my_coords(HV, NC)
        chunks = cute.make_tensor(pChunks, cute.make_layout((chunk + 1, 2), stride=(2, 1)))
        if chunks[chunk, 1] > 0:
            self.chunk_body(
                pQ, pK, pV, pG, pBeta, pALog, pDtBias, pChunks, pQG, pKGT, pGam, tma_w, tW,
                tma_u, tU, tma_aqk, tAqk, tma_q, tQ, tma_k, tK, tma_g, tG, mma_diag, mma_off1, mma_off2, mma_off3,
                mma_wu,
                a_layout, kt_layout, kb1_layout, kb2_layout, kb3_layout, x_layout, tb_layout, w_layout, aqk_layout, H,
                HV, NC, scale, lower_bound, pXd,
            )
        if cutlass.const_expr(self.pdl_trigger == "end"):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def store_tile(self, tma, tG: cute.Tensor, s_tile: cute.Tensor, hv, tile: cutlass.Constexpr,
                   coord: cutlass.Constexpr, chunk, skip: cutlass.Constexpr, scale, warp, lane):
        """Warp 0 stores ``s_tile`` through the TMA atom ``tma`` into ``chunk``'s ``tile``-shaped box of head ``hv``'s
        slice of ``tG`` (``coord``: the box's local_tile coordinate, None where the chunk index goes) and commits it:
        the [64, 64] Aqk staging into column block 0 (Aqk or the packed tile) or 1 (T' beside Aqk) of the Aqk rows,
        or the -X tile (d, token) into the w rows (``x_out``). ``skip``: a timing diagnostic's store, issued only
        under a condition that is false at run time."""
        one = cute.make_layout(1)
        if warp == 0:
            g_t = cute.local_tile(tG[None, None, hv], tile, coord)
            ts_t, tg_t = cpasync.tma_partition(tma, 0, one, cute.group_modes(s_tile, 0, 2),
                                               cute.group_modes(g_t, 0, 2))
            if lane == 0:
                if cutlass.const_expr(skip):
                    if scale < F32(0.0):  # never (timing only)
                        cute.copy(tma, ts_t[None, 0], tg_t[None, chunk])
                else:
                    cute.copy(tma, ts_t[None, 0], tg_t[None, chunk])
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_x_row(self, x_head: cute.Pointer, offset, obf: cute.Tensor, scale: cutlass.Float32):
        """Three CTAs an SM: eight bf16 of a −X row straight to the w rows (under ``no_wu_store`` behind a
        condition false at run time, the values still formed, as the tile stores are)."""
        if cutlass.const_expr("no_wu_store" in self.diag):
            if scale < F32(0.0):  # never (timing only)
                _vec(x_head, offset, COLS_PER_THREAD).store(obf.load())
        else:
            _vec(x_head, offset, COLS_PER_THREAD).store(obf.load())

    @cute.jit
    def stamp(self, ts, name: cutlass.Constexpr, tidx):
        """``clock`` diagnostic: the SM's cycle counter as stamp ``name`` (CLOCK_STAMPS). Every thread reads it (no
        branch to split the code around the stamp: it would change how ptxas schedules it); thread 0 stores them."""
        if cutlass.const_expr(self.clock):
            ts[CLOCK_STAMPS.index(name)] = clock32()

    @cute.jit
    def prefetch_later_chunk(self, pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pG: cute.Pointer,
                             pChunks: cute.Pointer, tidx, H, HV, NC):
        """Ask L2 for the q, k, v, g rows of the CTA ``prefetch_for`` places later in launch order
        (``order``). Thread t takes row t % 64: q and k for t < 64, v and g otherwise, every 128-byte line of
        each row."""
        bx, by, _ = cute.arch.block_idx()
        grid_x = HV if cutlass.const_expr(self.order == "head_rev") else NC
        nxt = by * grid_x + bx + self.prefetch_for(pG.dtype)  # this CTA's launch position, plus the distance
        if nxt < HV * NC:
            c_n, hv_n = self.launch_coords(nxt, HV, NC)
            later = cute.make_tensor(pChunks, cute.make_layout((c_n + 1, 2), stride=(2, 1)))
            row = tidx % CHUNK
            if row < later[c_n, 1]:
                tok = later[c_n, 0] + row
                if tidx < CHUNK:
                    hq_n = hv_n // self.group
                    for p in (pQ, pK):
                        for ln in cutlass.range_constexpr(DK * p.dtype.width // 8 // LINE_BYTES):
                            prefetch_line_l2(p + (tok * H + hq_n) * DK + ln * (LINE_BYTES * 8 // p.dtype.width))
                else:
                    vg = ((pG, DK),) if cutlass.const_expr(self.skip_vu) else ((pV, DV), (pG, DK))
                    for p, d in vg:
                        for ln in cutlass.range_constexpr(d * p.dtype.width // 8 // LINE_BYTES):
                            prefetch_line_l2(p + (tok * HV + hv_n) * d + ln * (LINE_BYTES * 8 // p.dtype.width))

    @cute.jit
    def row_norms(self, ssq: cute.Tensor, lane):
        """ssq[m] <- 1 / sqrt(Σ over the half-warp of ssq[m] + eps) for the 16 partial sums of a lane.

        A row's 128 columns live on one half-warp. Recursive halving at lane offsets 1, 2, 4, 8: a lane keeps
        half of its partial sums and adds its partner's copy of that half, so after 15 shuffles lane l holds
        the full sum of index ``bitrev4(l % 16)``; it takes that one reciprocal square root and the half-warp
        broadcasts the 16 results (16 shuffles). A butterfly over all 16 values took 64 shuffles and 16 MUFU.
        The additions form the same pairwise tree over the lanes as the butterfly's, so the sums are equal.
        """
        cur = [ssq[m] for m in range(2 * ROWS_PER_THREAD)]
        for s in cutlass.range_constexpr(4):
            half = len(cur) // 2
            upper = ((lane >> s) & 1) == 1  # this lane keeps the upper half of its current sums
            nxt = []
            for j in cutlass.range_constexpr(half):
                send = cutlass.select_(upper, cur[j], cur[j + half])
                keep = cutlass.select_(upper, cur[j + half], cur[j])
                nxt.append(keep + cute.arch.shuffle_sync_bfly(send, offset=1 << s))
            cur = nxt
        own = cute.math.rsqrt(cur[0] + F32(L2NORM_EPS))
        for m in cutlass.range_constexpr(2 * ROWS_PER_THREAD):
            # 16-lane segments (c = 0x101F): the source is lane bitrev4(m) of this lane's half-warp
            ssq[m] = cute.arch.shuffle_sync(own, offset=_bitrev4(m), mask_and_clamp=0x101F)

    @cute.jit
    def column_pass(self, sTot: cute.Tensor, sFirst: cute.Tensor, sC: cute.Tensor, col):
        """Thread = key column ``col``: the group totals' exclusive prefix in place (the chunk total in
        row ``groups``) and the off-diagonal factors ``2^(R_I − E_J)`` of that column (bf16, <= 1)."""
        gpb = GROUPS_PER_BLOCK
        tot_col = cute.make_rmem_tensor(cute.make_layout(GROUPS + 1), F32)  # exclusive prefix by group
        tot_col[0] = F32(0.0)
        for gq in cutlass.range_constexpr(GROUPS):
            tot_col[gq + 1] = tot_col[gq] + sTot[gq, col]
        if cutlass.const_expr(self.factor_block == SUB):  # 32-row blocks fold their one factor in phase 2
            for p in cutlass.range_constexpr(len(PAIRS)):
                ib, jb = PAIRS[p]
                r_i = tot_col[gpb * ib] + sFirst[ib, col]  # R_I: Γ at row 16 I
                e_j = tot_col[gpb * jb + gpb]
                sC[p, col] = BF16(cute.math.exp2(r_i - e_j, fastmath=True))
        for gq in cutlass.range_constexpr(GROUPS + 1):
            sTot[gq, col] = tot_col[gq]

    @cute.jit
    def lower_value(self, e: cutlass.Constexpr, i, j, acc_diag: cute.Tensor, acc_rows: list, wl, incl,
                    per_blk: cutlass.Constexpr, unshift):
        """Value ``e`` (row i, column j) of a product's lower part as this thread holds it: below the block
        diagonal value ``e`` of row block ``I``'s own off-diagonal product ``acc_rows[I - 1]`` (m64n(fbk I): its
        fragment is a prefix of the m64n64 one) times ``unshift``, on the block diagonal the diagonal product's
        where ``j < i + incl``, zero elsewhere. Blocks are ``self.factor_block`` rows; warp ``wl`` holds 16 rows of
        block ``wl // (factor_block / 16)``, and a thread holds ``per_blk`` values per 16 columns."""
        wpb = self.factor_block // SUB  # warps (16-column groups) per factor block
        nblk = CHUNK // self.factor_block
        jb = e // (per_blk * wpb)
        rb = wl
        if cutlass.const_expr(wpb > 1):
            rb = wl // wpb
        v = F32(0.0)
        if cutlass.const_expr(jb < nblk - 1):
            for ib in cutlass.range_constexpr(jb + 1, nblk):
                if rb == ib:
                    v = acc_rows[ib - 1][e]
            v = v * unshift  # (zero where the row block is <= jb)
        if rb == jb:
            if j < i + incl:
                v = acc_diag[e]
        return v

    @cute.jit
    def offdiag_b(self, sC: cute.Tensor, kb_raws: tuple, kb_layouts: tuple, tidx):
        """B'_I = K̂ ⊙ 2^(R_I − E_J) for the rows j < 16 I of the B'_I tiles, from K̂ in
        B'_3's rows (B'_3 scaled in place). Thread t: column chunk t % 16, rows t // 16 and + 8 of each
        block J < 3, so every thread forms 2 x (3 + 2 + 1) vectors of 8 (packed bf16 products).

        Session 15 moved the factor here from the A rows, which warp I scaled in registers (warp 3 three
        blocks while warp 0 waited at each wgmma): 544 fewer SASS instructions, no factor underflow where
        the true term is above 2^-126; on the H200 six checks gave the same errors and stage 1 was 0.3-0.6%
        faster on the n20 T4096 rows, flat at B2 T16384 (kda_fwd_log.md, session 15)."""
        c8 = (tidx % (DK // COLS_PER_THREAD)) * COLS_PER_THREAD
        s8 = tidx // (DK // COLS_PER_THREAD)
        f = [cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), BF16) for _ in PAIRS]
        for p in cutlass.range_constexpr(len(PAIRS)):
            cute.autovec_copy(_vec(sC.iterator, p * DK + c8, COLS_PER_THREAD), f[p])
        vals = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), BF16)
        out = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), BF16)
        for jb in cutlass.range_constexpr(NBLK - 1):
            for h in cutlass.range_constexpr(SUB // 8):
                j = jb * SUB + s8 + 8 * h
                _ld8(kb_layouts[2], kb_raws[2], (j, c8, 0), vals)
                for ib in cutlass.range_constexpr(jb + 1, NBLK):
                    out.store(vals.load() * f[pair_index(ib, jb)].load())
                    _st8(kb_layouts[ib - 1], kb_raws[ib - 1], (j, c8, 0), out)

    @cute.jit
    def chunk_body(
        self,
        pQ: cute.Pointer,
        pK: cute.Pointer,
        pV: cute.Pointer,
        pG: cute.Pointer,
        pBeta: cute.Pointer,
        pALog: cute.Pointer,
        pDtBias: cute.Pointer,
        pChunks: cute.Pointer,
        pQG: cute.Pointer,
        pKGT: cute.Pointer,
        pGam: cute.Pointer,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_u: cute.CopyAtom,
        tU: cute.Tensor,
        tma_aqk: cute.CopyAtom,
        tAqk: cute.Tensor,
        tma_q,  # phase1 "tma_qk": the q / k loads' atoms and tensors (None otherwise)
        tQ,
        tma_k,
        tK,
        tma_g,  # g by TMA (g_by_tma): the g load's atom and tensor (None otherwise)
        tG,
        mma_diag: cute.TiledMma,
        mma_off1: cute.TiledMma,
        mma_off2: cute.TiledMma,
        mma_off3: cute.TiledMma,
        mma_wu: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        kt_layout: cute.ComposedLayout,
        kb1_layout: cute.ComposedLayout,
        kb2_layout: cute.ComposedLayout,
        kb3_layout: cute.ComposedLayout,
        x_layout: cute.ComposedLayout,
        tb_layout: cute.ComposedLayout,
        w_layout: cute.ComposedLayout,
        aqk_layout: cute.ComposedLayout,
        H: cutlass.Int32,
        HV: cutlass.Int32,
        NC: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        pXd,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        ts = None  # the clock diagnostic's stamps (thread 0's registers)
        if cutlass.const_expr(self.clock):
            ts = cute.make_rmem_tensor(cute.make_layout(CLOCK_SLOTS), cutlass.Int32)
            ts.fill(0)
        self.stamp(ts, "entry", tidx)
        chunk, hv = self.my_coords(HV, NC)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        grp = tidx // 16  # row group: rows rpt grp .. + rpt - 1 (block grp // 2 = warp)
        d0 = (tidx % 16) * COLS_PER_THREAD  # first of the 8 columns this thread owns
        rpt = ROWS_PER_THREAD
        r0 = grp * rpt
        hq = hv // self.group
        chunks = cute.make_tensor(pChunks, cute.make_layout((chunk + 1, 2), stride=(2, 1)))
        tok0 = chunks[chunk, 0]
        nvalid = chunks[chunk, 1]
        R = NC * CHUNK
        row0 = chunk * CHUNK

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        sKa = st.sKa.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sQa = st.sQa.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sKt = st.sKt.get_tensor(kt_layout.outer, swizzle=kt_layout.inner)
        sX = sV = None
        if cutlass.const_expr(not self.lean_smem):
            sX = st.sX.get_tensor(x_layout.outer, swizzle=x_layout.inner)
            sV = st.sV.get_tensor(x_layout.outer, swizzle=x_layout.inner)
        # group totals of g (phase 1), then their exclusive prefix by group plus the chunk total in row
        # groups (phase 2's column pass)
        sTot = st.sTot.get_tensor(cute.make_layout((GROUPS + 1, DK), stride=(DK, 1)))
        sFirst = st.sFirst.get_tensor(cute.make_layout((NBLK, DK), stride=(DK, 1)))
        sC = st.sC.get_tensor(cute.make_layout((len(PAIRS), DK), stride=(DK, 1)))
        sBeta = st.sBeta.get_tensor(cute.make_layout(CHUNK))
        # after the products of phase 3 the operand tiles are dead: the inverse and the aqk staging
        # reuse them (sA overruns 1 KB into sQa, Y follows; sT 1 KB into sKb1, before the aqk staging at 2 KB)
        f32_base_ka = cute.recast_ptr(st.sKa.data_ptr(), dtype=F32)
        f32_base_qa = cute.recast_ptr(st.sQa.data_ptr(), dtype=F32)
        f32_base_kt = cute.recast_ptr(st.sKt.data_ptr(), dtype=F32)
        sA = cute.make_tensor(f32_base_ka, cute.make_layout((CHUNK, CHUNK), stride=(PAD, 1)))
        sT = cute.make_tensor(f32_base_kt, cute.make_layout((CHUNK, CHUNK), stride=(PAD, 1)))
        sY = cute.make_tensor(f32_base_qa + INV_SPILL, cute.make_layout((2 * SUB, 2 * SUB), stride=(YPAD, 1)))
        tb_raw = st.sQa.data_ptr() + CHUNK * DK // 2  # 8 KB into sQa: 1024-byte aligned
        sTb = _tile(tb_raw, tb_layout)
        aqk_raw = st.sKb1.data_ptr() + 2 * 1024
        sAqk = _tile(aqk_raw, aqk_layout)
        # B'_1..3 (K̂ itself lands in B'_3's rows, which hold blocks 0-2)
        kb3_raw = kb3_tile = sWst = sUst = x_raw = v_raw = None
        if cutlass.const_expr(not self.lean_smem):
            kb3_raw = st.sKb3.data_ptr()
            kb3_tile = st.sKb3.get_tensor(kb3_layout.outer, swizzle=kb3_layout.inner)
            sWst = st.sX.get_tensor(w_layout.outer, swizzle=w_layout.inner)
            sUst = st.sV.get_tensor(w_layout.outer, swizzle=w_layout.inner)
            x_raw = st.sX.data_ptr()
            v_raw = st.sV.data_ptr()
        kb_raws = (st.sKb1.data_ptr(), st.sKb2.data_ptr(), kb3_raw)
        kb_tiles = (st.sKb1.get_tensor(kb1_layout.outer, swizzle=kb1_layout.inner),
                    st.sKb2.get_tensor(kb2_layout.outer, swizzle=kb2_layout.inner), kb3_tile)
        # unswizzled tile starts, for the 16-byte vector accesses of the pointwise phases
        ka_raw = st.sKa.data_ptr()
        qa_raw = st.sQa.data_ptr()
        kt_raw = st.sKt.data_ptr()
        g_raw = kt_raw if cutlass.const_expr(self.lean_smem) else x_raw  # where a TMA'd g lands (tma_qkg, g_first)

        # ================================================================ phase 1: loads, gate, scan
        a_exp = F32(1.0)
        if cutlass.const_expr(self.has_a_log):
            a_exp = cute.math.exp(cute.make_tensor(pALog, cute.make_layout(hv + 1))[hv].to(F32))
        dtb = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        dtb.fill(0.0)
        if cutlass.const_expr(self.has_dt_bias):
            dtb.store(_vec(pDtBias, hv * DK + d0, COLS_PER_THREAD).load().to(F32))
        if cutlass.const_expr(self.softplus_gate):  # the softplus gate reads dt_bias in log2 units
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                dtb[c] = dtb[c] * F32(LOG2E)
        gl = cute.make_rmem_tensor(cute.make_layout((rpt, COLS_PER_THREAD),
                                                    stride=(COLS_PER_THREAD, 1)), F32)  # Γ, local scan
        ssq = cute.make_rmem_tensor(cute.make_layout(2 * rpt), F32)  # Σx² of q, k rows; 1 / ‖x‖ after row_norms
        xq = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        xk = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        xg = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        obf = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), BF16)
        # every global load of the chunk is issued before the first use: 32 independent 16-byte loads
        # per thread in flight instead of one row's 4 at a time (rows past the end read the chunk's
        # last valid row, in bounds and this sequence's own data; phase 2 zeroes their q and k)
        rows8 = cute.make_layout((rpt, COLS_PER_THREAD), stride=(COLS_PER_THREAD, 1))
        raw_q = cute.make_rmem_tensor(rows8, BF16)
        raw_k = cute.make_rmem_tensor(rows8, BF16)
        raw_v = cute.make_rmem_tensor(rows8, BF16)
        raw_g = cute.make_rmem_tensor(rows8, pG.dtype)
        mbar = None
        mbar_qk = None
        g_by_tma = self.g_by_tma(pG.dtype)
        g_first = self.g_first_by_tma(pG.dtype)
        if cutlass.const_expr(self.tma_qk):  # q and k straight into the Qa / Ka tiles, issued first
            mbar = st.sMbar.data_ptr()
            mbar_qk = mbar + 1 if cutlass.const_expr(g_first) else mbar  # g_first: g on mbar, q and k on this
            s_g = sX  # tma_qkg: the X tile, read as a K-major tile (dead until phase 2 writes X; lean_smem: K̃'s)
            if cutlass.const_expr(g_by_tma and self.lean_smem):
                s_g = _tile(g_raw, a_layout)
            elif cutlass.const_expr(g_by_tma):
                s_g = st.sX.get_tensor(a_layout.outer, swizzle=a_layout.inner)
            if warp == 0:  # a TMA copy is issued by a whole warp (it elects its one issuing lane)
                if lane == 0:
                    cute.arch.mbarrier_init(mbar, 1)
                    if cutlass.const_expr(g_first):
                        cute.arch.mbarrier_init(mbar_qk, 1)
                    cute.arch.mbarrier_init_fence()
                # ptxas issues the init on the warp's uniform datapath: racecheck then sees it and lane 0's
                # arrive as two lanes' accesses (a warning, 16 a launch on tc-T1, session 28) unless the warp
                # synchronises between them
                cute.arch.sync_warp()
                if lane == 0:
                    tile_bytes = CHUNK * DK * BF16.width // 8
                    if cutlass.const_expr(g_first):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar, tile_bytes)
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar_qk, 2 * tile_bytes)
                    else:
                        n_tiles = 3 if cutlass.const_expr(g_by_tma) else 2
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar, n_tiles * tile_bytes)
                cute.arch.sync_warp()
                one = cute.make_layout(1)
                loads = [(tma_q, tQ, sQa, hq, mbar_qk), (tma_k, tK, sKa, hq, mbar_qk)]
                if cutlass.const_expr(g_first):  # g first, then k, then q: the order phase 1 needs them in
                    loads = [(tma_g, tG, s_g, hv, mbar), loads[1], loads[0]]
                elif cutlass.const_expr(g_by_tma):
                    loads.append((tma_g, tG, s_g, hv, mbar))
                for tma_x, t_x, s_x, head, bar in loads:
                    g_x = cute.local_tile(cute.domain_offset((tok0, 0), t_x[None, None, head]), (CHUNK, DK),
                                          (None, 0))
                    ts_x, tg_x = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(s_x, 0, 2),
                                                       cute.group_modes(g_x, 0, 2))
                    cute.copy(tma_x, tg_x[None, 0], ts_x[None, 0], tma_bar_ptr=bar)
        for rr in cutlass.range_constexpr(rpt):
            tok = tok0 + cutlass.min(r0 + rr, nvalid - 1)
            if cutlass.const_expr("l2_loads" in self.diag):  # timing only: the head's first rows, L2 hits
                tok = cutlass.min(r0 + rr, nvalid - 1)
            if cutlass.const_expr(not self.tma_qk):
                raw_q[rr, None].store(_vec(pQ, (tok * H + hq) * DK + d0, COLS_PER_THREAD).load())
                raw_k[rr, None].store(_vec(pK, (tok * H + hq) * DK + d0, COLS_PER_THREAD).load())
            if cutlass.const_expr(not self.skip_vu):
                raw_v[rr, None].store(_vec(pV, (tok * HV + hv) * DV + d0, COLS_PER_THREAD).load())
            if cutlass.const_expr(not g_by_tma):
                raw_g[rr, None].store(_vec(pG, (tok * HV + hv) * DK + d0, COLS_PER_THREAD).load())
        if cutlass.const_expr(self.prefetch_for(pG.dtype) > 0):
            self.prefetch_later_chunk(pQ, pK, pV, pG, pChunks, tidx, H, HV, NC)
        if tidx < CHUNK:
            keep_b = F32(1.0)
            if tidx >= nvalid:
                keep_b = F32(0.0)
            tb = tok0 + cutlass.min(tidx, nvalid - 1)
            bv = cute.make_tensor(pBeta, cute.make_layout((tb + 1) * HV))[tb * HV + hv].to(F32)
            if cutlass.const_expr(self.use_beta_sigmoid):
                bv = F32(self.beta_mult) / (F32(1.0) + cute.math.exp(-bv, fastmath=True))
            sBeta[tidx] = bv * keep_b
        lb_log2 = lower_bound * F32(RCP_LN2)
        a_nl2e = a_exp * F32(-RCP_LN2)  # the gate's e^(-a x) as 2^(a_nl2e x) (1/ln 2 = log2 e)
        neg_a = -a_exp
        # the lower-bounded gate's exponent a_nl2e (x + dt_bias) as one FFMA a_nl2e x + adt per element
        adt = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        if cutlass.const_expr(self.lean):
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                adt[c] = a_nl2e * dtb[c]
        if cutlass.const_expr(not self.tma_qk):
            self.stamp(ts, "tma_wait", tidx)  # no TMA: the span is empty
        if cutlass.const_expr(self.tma_qk):
            cute.arch.sync_threads()  # the mbarrier's initialisation is visible to every thread
            cute.arch.mbarrier_wait(mbar, 0)
            self.stamp(ts, "tma_wait", tidx)  # q, k (and g) have landed (g_first: g alone)
            landed = [] if cutlass.const_expr(g_first) else [(qa_raw, raw_q), (ka_raw, raw_k)]
            if cutlass.const_expr(g_by_tma):
                landed.append((g_raw, raw_g))
            _read_landed_rows(a_layout, landed, nvalid, r0, d0)
        for rr in cutlass.range_constexpr(rpt):
            r = r0 + rr
            keep = F32(1.0)
            if r >= nvalid:
                keep = F32(0.0)
            # Rows past the end hold a copy of the last valid row (finite): phase 2 zeroes their q and k
            # through the row scale, and their v is only read through T' columns that β = 0 zeroes.
            if cutlass.const_expr(not g_first):
                widen_bf16(raw_q[rr, None], xq, self.widen)
                widen_bf16(raw_k[rr, None], xk, self.widen)
            widen_bf16(raw_g[rr, None], xg, self.widen)
            # raw q, k, v to their tiles (q and k are rewritten in place in phase 2)
            if cutlass.const_expr(not self.tma_qk):
                _st8(a_layout, qa_raw, (r, d0, 0), raw_q[rr, None])
                _st8(a_layout, ka_raw, (r, d0, 0), raw_k[rr, None])
            if cutlass.const_expr(not self.skip_vu):
                _st8(x_layout, v_raw, (d0, r, 0), raw_v[rr, None])  # MN-major: (d, token)
            sq = F32(0.0)
            sk = F32(0.0)
            lb_keep = lb_log2 * keep
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                if cutlass.const_expr(not g_first):
                    sq = sq + xq[c] * xq[c]
                    sk = sk + xk[c] * xk[c]
                # lower-bounded gate, in log2 units: lb * sigmoid(a (g + dt_bias)) / ln 2, with
                # e^(-z) = 2^(-a log2(e) (g + dt_bias)) and keep folded into lb: one FMUL and the cumsum
                # step an FFMA (was three FMUL and an FADD)
                prev = F32(0.0)
                if cutlass.const_expr(rr > 0):
                    prev = gl[rr - 1, c]
                if cutlass.const_expr(self.log_gate):
                    # min(max(g / ln 2, lb / ln 2), 0), the min as -max(-y, 0)
                    y = cute.arch.fmax(xg[c] * F32(RCP_LN2), lb_log2)
                    gl[rr, c] = prev - keep * cute.arch.fmax(-y, F32(0.0))
                elif cutlass.const_expr(self.softplus_gate):
                    # softplus in log2 units, log2(1 + 2^y) with y = (x + dt_bias) log2(e), and y itself
                    # past the threshold (there log2(1 + 2^T) < y: a max, no branch); times -a, clamped
                    # at the floor lb / ln 2
                    # (fmax: one max.f32 each; min(y, T) as -max(-y, -T))
                    y = xg[c] * F32(LOG2E) + dtb[c]
                    y_cut = -cute.arch.fmax(-y, F32(-SOFTPLUS_THRESHOLD * LOG2E))
                    sp = cute.math.log2(F32(1.0) + cute.math.exp2(y_cut, fastmath=True), fastmath=True)
                    gl[rr, c] = prev + keep * cute.arch.fmax(neg_a * cute.arch.fmax(sp, y), lb_log2)
                else:
                    if cutlass.const_expr(self.lean):
                        ez = cute.math.exp2(a_nl2e * xg[c] + adt[c], fastmath=True)
                    else:
                        ez = cute.math.exp2(a_nl2e * (xg[c] + dtb[c]), fastmath=True)
                    gl[rr, c] = prev + lb_keep * cute.arch.rcp_approx(F32(1.0) + ez)
            ssq[rr] = sq
            ssq[rpt + rr] = sk
        if cutlass.const_expr(self.lean):
            if cutlass.const_expr(self.use_qk_l2norm and not g_first):
                self.row_norms(ssq, lane)
            cute.autovec_copy(gl[rpt - 1, None], _vec(sTot.iterator, grp * DK + d0, COLS_PER_THREAD))
            if grp % GROUPS_PER_BLOCK == 0:
                cute.autovec_copy(gl[0, None],
                                  _vec(sFirst.iterator, (grp // GROUPS_PER_BLOCK) * DK + d0, COLS_PER_THREAD))
        else:
            # a row's 128 columns live on one half-warp: butterfly over lanes 1, 2, 4, 8
            for s in cutlass.range_constexpr(4):
                for m in cutlass.range_constexpr(2 * rpt):
                    ssq[m] = ssq[m] + cute.arch.shuffle_sync_bfly(ssq[m], offset=1 << s)
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                sTot[grp, d0 + c] = gl[rpt - 1, c]
                if grp % GROUPS_PER_BLOCK == 0:
                    sFirst[grp // GROUPS_PER_BLOCK, d0 + c] = gl[0, c]
        cute.arch.sync_threads()
        self.stamp(ts, "phase1", tidx)

        # ============================================ phase 2: reference factors and operand tiles
        fbk = self.factor_block
        fgpb = fbk // ROWS_PER_THREAD  # row groups per factor block
        shift = lower_bound * F32(factor_shift(fbk))  # half of a block's largest gate range (log2)
        blk = grp // fgpb  # this thread's factor block (16 rows: its warp)
        # column pass (thread = column tidx): the group totals' exclusive prefix in place, the chunk total
        # in row groups, and the off-diagonal factors 2^(C_I − E_J); then every thread reads the few
        # prefixes it needs as 16-byte vectors (instead of selecting them out of a 64-step scan)
        self.column_pass(sTot, sFirst, sC, tidx)
        cute.arch.sync_threads()
        self.stamp(ts, "column_pass", tidx)
        pre = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # Γ before row 8 grp
        cref = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # C_blk
        eref = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # E_blk
        run = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # Γ at the chunk end
        first = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        cute.autovec_copy(_vec(sTot.iterator, grp * DK + d0, COLS_PER_THREAD), pre)
        cute.autovec_copy(_vec(sTot.iterator, fgpb * blk * DK + d0, COLS_PER_THREAD), cref)
        cute.autovec_copy(_vec(sTot.iterator, fgpb * (blk + 1) * DK + d0, COLS_PER_THREAD), eref)
        cute.autovec_copy(_vec(sTot.iterator, GROUPS * DK + d0, COLS_PER_THREAD), run)
        cute.autovec_copy(_vec(sFirst.iterator, (fbk // SUB) * blk * DK + d0, COLS_PER_THREAD), first)
        for c in cutlass.range_constexpr(COLS_PER_THREAD):
            cref[c] = cref[c] + first[c] - shift
        # 32-row blocks: the one off-diagonal block's B operand, k̂ 2^(R − Γ) (R = Γ at row 32, <= 1), is K̃ times
        # fpair = 2^(R − C_0), formed for block 0's rows (2^(R − C_0) >= 2^(−16.5 |lb| / ln 2): normal). KGT "ref":
        # kgᵀ = k̂ 2^(Γ_last − Γ) is that times fk = 2^(Γ_last − R) <= 1 there; block 1's rows take ref = C_1
        # instead of R (fpair = 2^0 = 1 exactly, and Γ_last − C_1 >= −15.5 |lb| / ln 2 > −126: fk is normal), so every
        # thread forms kgᵀ as (K̃ fpair) fk, two FMUL an element ("kh": K̂ = K̃ 2^(E − C), then K̂ 2^(Γ_last − E))
        kgt_ref = self.kgt_ref
        fpair = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        fh = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # 2^(E − C): K̃ -> K̂ ("kh")
        fk = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # 2^(Γ_last − E) ("ref": − ref): -> kg
        if cutlass.const_expr(fbk != SUB):
            rtot = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            cute.autovec_copy(_vec(sTot.iterator, fgpb * DK + d0, COLS_PER_THREAD), rtot)
            cute.autovec_copy(_vec(sFirst.iterator, (fbk // SUB) * DK + d0, COLS_PER_THREAD), fpair)
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                ref = rtot[c] + fpair[c]  # R
                if cutlass.const_expr(kgt_ref):
                    if blk > 0:
                        ref = cref[c]
                    fk[c] = cute.math.exp2(run[c] - ref, fastmath=True)
                fpair[c] = cute.math.exp2(ref - cref[c], fastmath=True)
        if cutlass.const_expr(not kgt_ref):
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                fh[c] = cute.math.exp2(eref[c] - cref[c], fastmath=True)
                fk[c] = cute.math.exp2(run[c] - eref[c], fastmath=True)

        rq = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        rk = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
        kgt = cute.make_rmem_tensor(cute.make_layout((COLS_PER_THREAD, rpt), stride=(rpt, 1)), BF16)  # [c][rr]
        square = self.gate_factors == "square"
        halves = self.gate_factors == "halves" or square
        # "halves": Γ − C = gl + (pre − C), and 2^Γ = 2^(Γ−C) h h with h = 2^(C/2). C <= 0 (Γ of the block's
        # first row less shift >= 0), so 2^(Γ−C) h = 2^(Γ − C/2) lies between 2^Γ and 2^(Γ−C) <= 2^shift <
        # 2^128: nothing overflows, and an intermediate that underflows has a result that does too. h itself
        # is normal down to C = −252; below, Γ <= C + shift < −252 + 119 flushes to zero either way.
        # "square" (session 37): 2^C = h h formed once a column, then one FMUL an element for X and for qg (two
        # fewer). FMUL keeps subnormals, so 2^C has C + 149 bits below 2^-126 and is 0 below 2^-149; the values it
        # scales are <= |k̂| 2^(C + shift), so the absolute error of X and qg stays below |k̂| 2^(shift − 149) <=
        # 2^-29 |k̂| (|q̂| scale for qg), under bf16's rounding of any value above 2^-20 |k̂| (test_kda_tc_numerics).
        pc = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # pre − C
        hc = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # 2^(C/2)
        hx = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)  # ±h: X's sign (t_out) rides on it
        if cutlass.const_expr(halves):
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                pc[c] = pre[c] - cref[c]
                hc[c] = cute.math.exp2(cref[c] * F32(0.5), fastmath=True)
                hx[c] = -hc[c] if cutlass.const_expr(self.t_out) else hc[c]
                if cutlass.const_expr(square):  # h h = 2^C once a column (FMUL keeps subnormals)
                    hx[c] = hx[c] * hc[c]
                    hc[c] = hc[c] * hc[c]
        if cutlass.const_expr(g_first):  # q and k, waited for only now: their zeroed tail, row sums and norms
            cute.arch.mbarrier_wait(mbar_qk, 0)
            _read_landed_rows(a_layout, [(qa_raw, raw_q), (ka_raw, raw_k)], nvalid, r0, d0)
            for rr in cutlass.range_constexpr(rpt):
                # cvt here: the integer widening of these rows made ptxas spill (18 spill instructions, session 37)
                widen_bf16(raw_q[rr, None], xq, "cvt")
                widen_bf16(raw_k[rr, None], xk, "cvt")
                sq = F32(0.0)
                sk = F32(0.0)
                for c in cutlass.range_constexpr(COLS_PER_THREAD):
                    sq = sq + xq[c] * xq[c]
                    sk = sk + xk[c] * xk[c]
                ssq[rr] = sq
                ssq[rpt + rr] = sk
            if cutlass.const_expr(self.use_qk_l2norm):
                self.row_norms(ssq, lane)
        qg_head = pQG + (hv * R + row0) * DK
        x_head = None
        if cutlass.const_expr(self.lean_smem):
            x_head = pXd + (hv * R + row0) * DK
        nrm_q = nrm_k = None
        if cutlass.const_expr(self.raw_out):
            nrm_q = cute.make_rmem_tensor(cute.make_layout(rpt), F32)
            nrm_k = cute.make_rmem_tensor(cute.make_layout(rpt), F32)
        for rr in cutlass.range_constexpr(rpt):
            r = r0 + rr
            keep = F32(1.0)  # rows past the end: q̂ = k̂ = 0 (so Ka, Qa, K̃, K̂, X, qg, kg are zero)
            if r >= nvalid:
                keep = F32(0.0)
            nq = scale * keep
            nk = keep
            if cutlass.const_expr(self.use_qk_l2norm):
                if cutlass.const_expr(self.lean):
                    nq = nq * ssq[rr]
                    nk = nk * ssq[rpt + rr]
                else:
                    nq = nq * cute.math.rsqrt(ssq[rr] + F32(L2NORM_EPS))
                    nk = nk * cute.math.rsqrt(ssq[rpt + rr] + F32(L2NORM_EPS))
            _ld8(a_layout, qa_raw, (r, d0, 0), obf)
            widen_bf16(obf, rq, self.widen)
            rq.store(rq.load() * nq)
            _ld8(a_layout, ka_raw, (r, d0, 0), obf)
            widen_bf16(obf, rk, self.widen)
            rk.store(rk.load() * nk)
            ka = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            qa = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            kt = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            kh = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            bp = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            xx = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            qg = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                if cutlass.const_expr(halves):
                    rel_h = gl[rr, c] + pc[c]
                    fa = cute.math.exp2(rel_h, fastmath=True)  # <= 2^shift
                    fb = cute.math.exp2(-rel_h, fastmath=True)  # <= 2^shift
                else:
                    gam = gl[rr, c] + pre[c]  # Γ of (r, d0 + c)
                    rel_c = gam - cref[c]  # a − b = −(b − a) exactly: fb negates the operand, no FADD
                    fa = cute.math.exp2(rel_c, fastmath=True)  # <= 2^shift
                    fb = cute.math.exp2(-rel_c, fastmath=True)  # <= 2^shift
                    fg = cute.math.exp2(gam, fastmath=True)  # <= 1
                ka[c] = rk[c] * fa
                qa[c] = rq[c] * fa
                kt[c] = rk[c] * fb
                if cutlass.const_expr(kgt_ref):
                    bp[c] = kt[c] * fpair[c]  # block 0: k̂ 2^(R − Γ) <= |k̂|; block 1: K̃
                    if cutlass.const_expr(not self.raw_out):
                        kgt[c, rr] = (bp[c] * fk[c]).to(BF16)  # k̂ 2^(Γ_last − Γ)
                else:
                    if cutlass.const_expr(not self.raw_out):
                        kh[c] = kt[c] * fh[c]  # k̂ 2^(E − Γ) <= |k̂|
                        kgt[c, rr] = (kh[c] * fk[c]).to(BF16)  # k̂ 2^(Γ_last − Γ)
                    if cutlass.const_expr(fbk != SUB):
                        bp[c] = kt[c] * fpair[c]
                if cutlass.const_expr(square):  # k 2^Γ and q 2^Γ as (k 2^(Γ−C)) 2^C, (q 2^(Γ−C)) 2^C
                    xx[c] = ka[c] * hx[c]
                    qg[c] = qa[c] * hc[c]
                elif cutlass.const_expr(halves):  # k 2^Γ and q 2^Γ as (k 2^(Γ−C)) h h, (q 2^(Γ−C)) h h
                    xx[c] = (ka[c] * hc[c]) * hx[c]
                    qg[c] = (qa[c] * hc[c]) * hc[c]
                elif cutlass.const_expr(self.t_out):  # -X, so that w = T'X leaves as -w (ptxas folds the sign)
                    xx[c] = (-rk[c]) * fg
                    qg[c] = rq[c] * fg
                else:
                    xx[c] = rk[c] * fg
                    qg[c] = rq[c] * fg
            obf.store(ka.load().to(BF16))
            _st8(a_layout, ka_raw, (r, d0, 0), obf)
            obf.store(qa.load().to(BF16))
            _st8(a_layout, qa_raw, (r, d0, 0), obf)
            obf.store(kt.load().to(BF16))
            _st8(kt_layout, kt_raw, (r, d0, 0), obf)
            if cutlass.const_expr(self.lean_smem and not self.pack and not self.raw_out):  # -X to the w rows (below,
                # this tile spilled 8 B)
                obf.store(xx.load().to(BF16))
                self.store_x_row(x_head, r * DK + d0, obf, scale)
            if cutlass.const_expr(fbk == SUB):
                if warp < NBLK - 1:  # K̂ of block 3 is never a B operand
                    obf.store(kh.load().to(BF16))
                    _st8(kb3_layout, kb_raws[2], (r, d0, 0), obf)
            else:
                if warp < 2:  # rows 0..31: the off-diagonal block's B operand, into the 32-row B' tile
                    obf.store(bp.load().to(BF16))
                    _st8(kb2_layout, kb_raws[1], (r, d0, 0), obf)
            if cutlass.const_expr(self.raw_out):
                pass  # (stage 2 forms -X and qg)
            elif cutlass.const_expr(self.lean_smem and self.pack):  # -X to the w rows (this tile spilled 40 B)
                obf.store(xx.load().to(BF16))
                self.store_x_row(x_head, r * DK + d0, obf, scale)
            elif cutlass.const_expr(not self.lean_smem):
                obf.store(xx.load().to(BF16))
                _st8(x_layout, x_raw, (d0, r, 0), obf)
            if cutlass.const_expr(self.raw_out):
                nrm_q[rr] = nq
                nrm_k[rr] = nk
            else:
                obf.store(qg.load().to(BF16))
                if cutlass.const_expr("no_qg_kgt" in self.diag):
                    if scale < F32(0.0):  # never (timing only): formed, not stored
                        _vec(qg_head, r * DK + d0, COLS_PER_THREAD).store(obf.load())
                else:
                    _vec(qg_head, r * DK + d0, COLS_PER_THREAD).store(obf.load())
        if cutlass.const_expr(self.raw_out):
            # the half-warp's lanes hold the same 8 rows' norms: its first lane stores them, q's then k's (2 x 32 B)
            if d0 == 0:
                p_nrm = cute.recast_ptr(pKGT, dtype=F32) + (hv * NC + chunk) * (2 * CHUNK)
                _vec(p_nrm, r0, rpt).store(nrm_q.load())
                _vec(p_nrm, r0 + CHUNK, rpt).store(nrm_k.load())
        else:
            # kgᵀ: this thread's 8 rows are 8 consecutive tokens of one column: one 16-byte store each
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                dst = _vec(pKGT, (hv * DK + d0 + c) * R + row0 + r0, rpt)
                if cutlass.const_expr("no_qg_kgt" in self.diag):
                    if scale < F32(0.0):
                        dst.store(kgt[c, None].load())
                else:
                    dst.store(kgt[c, None].load())
        if grp == 0:
            gam_out = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), F32)
            for c in cutlass.range_constexpr(COLS_PER_THREAD):
                gam_out[c] = cute.math.exp2(run[c], fastmath=True)
            gp = GAM_PITCH_PACK if cutlass.const_expr(self.pack) else DK  # γ's row pitch (floats)
            _vec(pGam, (hv * NC + chunk) * gp + d0, COLS_PER_THREAD).store(gam_out.load())
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()
        self.stamp(ts, "phase2", tidx)
        if cutlass.const_expr(self.x_out and not self.lean_smem and not self.raw_out):  # -X leaves, under phases 3-4
            self.store_tile(tma_w, tW, sX, hv, (DK, CHUNK), (0, None), chunk, "no_wu_store" in self.diag, scale, warp,
                            lane)
        if cutlass.const_expr(fbk == SUB):
            self.offdiag_b(sC, kb_raws, (kb1_layout, kb2_layout, kb3_layout), tidx)
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
            cute.arch.sync_threads()
        self.stamp(ts, "b_prime", tidx)

        # ================================================================ phase 3: Akk, Aqk on wgmma
        a_tiles = (sKa, sQa)
        nprod = len(a_tiles)
        thr_d = mma_diag.get_slice(tidx)
        tA_d = [thr_d.make_fragment_A(thr_d.partition_A(t)) for t in a_tiles]
        tBkt = thr_d.make_fragment_B(thr_d.partition_B(sKt))
        acc_d = [thr_d.make_fragment_C(thr_d.partition_shape_C((CHUNK, CHUNK))) for _ in a_tiles]
        warpgroup.fence()
        for x in cutlass.range_constexpr(nprod):
            _gemm_ss(mma_diag, acc_d[x], tA_d[x], tBkt)
        acc_ob = [[] for _ in a_tiles]  # [product][row block I - 1], m64n(fbk I)
        # row block I's off-diagonal part is rows fbk I.. of Ka B'_Iᵀ (the other rows are never read): per
        # block I, its tiled MMA and B' tile (16-row blocks: m64n16 / n32 / n48; 32-row blocks: one m64n32)
        offs = ((mma_off2, kb_tiles[1]),)
        if cutlass.const_expr(fbk == SUB):
            offs = ((mma_off1, kb_tiles[0]), (mma_off2, kb_tiles[1]), (mma_off3, kb_tiles[2]))
        for ib in cutlass.range_constexpr(1, CHUNK // fbk):
            mma_i, kb_i = offs[ib - 1]
            thr_i = mma_i.get_slice(tidx)
            tB_i = thr_i.make_fragment_B(thr_i.partition_B(kb_i))
            for x in cutlass.range_constexpr(nprod):
                tA_i = thr_i.make_fragment_A(thr_i.partition_A(a_tiles[x]))
                acc_i = thr_i.make_fragment_C(thr_i.partition_shape_C((CHUNK, fbk * ib)))
                _gemm_ss(mma_i, acc_i, tA_i, tB_i)
                acc_ob[x].append(acc_i)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        self.stamp(ts, "wgmma_wait", tidx)

        thr_wu = mma_wu.get_slice(tidx)
        cute.arch.sync_threads()  # every warp is past its reads of the operand tiles: reuse them
        self.stamp(ts, "wgmma_bar", tidx)

        # ------------------------------------------------ combine: Akk β -> sA (fp32), Aqk -> staging
        cD = thr_d.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        rAqk = cute.make_rmem_tensor(acc_d[0].layout, BF16)
        per_blk = cute.size(acc_d[0]) // NBLK  # 8 values of a thread per 16-column block
        unshift = cute.math.exp2(-shift, fastmath=True)  # 2^(C_I − R_I): what Ka B'_Iᵀ carries extra
        for e in cutlass.range_constexpr(cute.size(acc_d[0])):
            i, j = cD[e]
            sA[i, j] = self.lower_value(e, i, j, acc_d[0], acc_ob[0], warp, 0, per_blk, unshift) * sBeta[i]
            rAqk[e] = self.lower_value(e, i, j, acc_d[1], acc_ob[1], warp, 1, per_blk, unshift).to(BF16)
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BF16)
        st_d = cute.make_tiled_copy_C(st_atom, mma_diag)
        cute.copy(st_d, st_d.retile(rAqk), st_d.get_slice(tidx).partition_D(sAqk[None, None, 0]))
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()
        self.stamp(ts, "combine", tidx)
        one = cute.make_layout(1)
        if cutlass.const_expr(not self.pack):  # pack: Aqk leaves with T' (after phase 4)
            self.store_tile(tma_aqk, tAqk, sAqk, hv, (CHUNK, CHUNK), (None, 0), chunk, "no_aqk_store" in self.diag,
                            scale, warp, lane)

        # ==================================================== phase 4: T = (I + Akk)^-1, fp32 SIMT
        if cutlass.const_expr("no_inverse" in self.diag):
            if scale < F32(0.0):  # never (timing only): T' is formed from whatever sT holds
                self.invert(sA, sT, sY, warp, lane, tidx, tb_raw, ts)
        else:
            self.invert(sA, sT, sY, warp, lane, tidx, tb_raw, ts)
        self.stamp(ts, "inverse", tidx)
        # T' = T diag(β) in bf16 (upper blocks zero): the A operand of w and u; each thread forms
        # 8-column pieces of one row
        tpr = THREADS // CHUNK  # threads per row
        ti = tidx // tpr
        tj0 = (tidx % tpr) * (CHUNK // tpr)
        t8 = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), F32)
        b8 = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), F32)
        for v8 in cutlass.range_constexpr(CHUNK // tpr // 8):
            j0 = tj0 + v8 * 8
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(_vec(sT.iterator, ti * PAD + j0 + 4 * h, 4), t8[h, None])
                cute.autovec_copy(_vec(sBeta.iterator, j0 + 4 * h, 4), b8[h, None])
            tv = cute.make_rmem_tensor(cute.make_layout(8), F32)
            for c in cutlass.range_constexpr(8):
                tv[c] = t8[c // 4, c % 4] * b8[c // 4, c % 4]
                if j0 // SUB > ti // SUB:
                    tv[c] = F32(0.0)
            obf.store(tv.load().to(BF16))
            if cutlass.const_expr(not (self.x_out and self.pack)):  # the w product's A operand, or T''s store
                _st8(tb_layout, tb_raw, (ti, j0, 0), obf)
            if cutlass.const_expr(self.pack):
                # T' below the diagonal into the Aqk staging, transposed (its Aqk half is zero there): element
                # (j, ti) of the 128-byte-swizzled staging is at j*64 + ((ti/8) ^ (j%8))*8 + ti%8, and j % 8 is c
                # here (j0 is a multiple of 8: layout_facts "aqk_staging_offsets")
                for c in cutlass.range_constexpr(8):
                    if j0 + c < ti:
                        off = (j0 + c) * CHUNK + (((ti >> 3) ^ c) << 3) + (ti & 7)
                        cute.make_tensor(aqk_raw + off, cute.make_layout(1))[0] = obf[c]
            if cutlass.const_expr(self.emit_akk):
                for c in cutlass.range_constexpr(8):
                    tv[c] = t8[c // 4, c % 4]
                    if j0 // SUB > ti // SUB:
                        tv[c] = F32(0.0)
                obf.store(tv.load().to(BF16))
                cute.autovec_copy(obf, _vec(pQG + HV * R * DK, (hv * R + row0 + ti) * CHUNK + j0, 8))
        if cutlass.const_expr(self.pack):
            if tidx % tpr == 0:  # T''s diagonal (formed as above: T_ii β_i), after γ in γ's row
                p_diag = cute.recast_ptr(pGam, dtype=BF16) + ((hv * NC + chunk) * GAM_PITCH_PACK + DK) * 2
                _vec(p_diag, ti, 1)[0] = (sT[ti, ti] * sBeta[ti]).to(BF16)
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()
        self.stamp(ts, "t_prime", tidx)
        if cutlass.const_expr(self.pack):
            # the packed tile (Aqk, T' transposed above the diagonal) leaves while phase 5 runs
            self.store_tile(tma_aqk, tAqk, sAqk, hv, (CHUNK, CHUNK), (None, 0), chunk, "no_aqk_store" in self.diag,
                            scale, warp, lane)  # (no_aqk_store skipped nothing here before session 38)
        elif cutlass.const_expr(self.t_out):
            # T' leaves for stage 2 (columns 64-127 of the Aqk rows) while phase 5 reads the same tile
            # (the Aqk staging layout is T''s operand layout: kda_fwd_intra_tc.layout_facts)
            skip = "no_aqk_store" in self.diag or "no_tp_store" in self.diag
            self.store_tile(tma_aqk, tAqk, _tile(tb_raw, aqk_layout), hv, (CHUNK, CHUNK), (None, 1), chunk, skip,
                            scale, warp, lane)

        if cutlass.const_expr(self.x_out):  # no phases 5-6: the tiles must outlive the bulk copies' reads
            self.stamp(ts, "phase5", tidx)
            self.stamp(ts, "phase6", tidx)
            if warp == 0:
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            # ====================================================== phase 5: w = T' X, u = T' v (wgmma)
            # each result is staged in the tile its B operand came from
            st_wu = cute.make_tiled_copy_C(st_atom, mma_wu)
            b_tiles = (sX, sV)
            stage_tiles = (sWst, sUst)
            if cutlass.const_expr(self.skip_vu):  # w alone (u is stage 2's; the diagnostic times that)
                b_tiles = (sX,)
                stage_tiles = (sWst,)
            tAtb = thr_wu.make_fragment_A(thr_wu.partition_A(sTb))
            tB_wu = [thr_wu.make_fragment_B(thr_wu.partition_B(t)) for t in b_tiles]
            acc_wu = [thr_wu.make_fragment_C(thr_wu.partition_shape_C((CHUNK, DK))) for _ in b_tiles]
            warpgroup.fence()
            for x in cutlass.range_constexpr(len(b_tiles)):
                _gemm_ss(mma_wu, acc_wu[x], tAtb, tB_wu[x])
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # T', X and v are read: the X / v tiles become the w / u staging
            self.stamp(ts, "phase5", tidx)

            # ================================================ phase 6: w, u -> swizzled tiles -> TMA stores
            thr_st = st_wu.get_slice(tidx)
            for x in cutlass.range_constexpr(len(b_tiles)):
                r_out = cute.make_rmem_tensor(acc_wu[x].layout, BF16)
                r_out.store(acc_wu[x].load().to(BF16))
                cute.copy(st_wu, st_wu.retile(r_out), thr_st.partition_D(stage_tiles[x][None, None, 0]))
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
            cute.arch.sync_threads()
            self.stamp(ts, "phase6", tidx)
            if warp == 0:
                gW = cute.local_tile(tW[None, None, hv], (CHUNK, DK), (None, 0))
                gU = cute.local_tile(tU[None, None, hv], (CHUNK, DV), (None, 0))
                tWs, tWg = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sWst, 0, 2),
                                                 cute.group_modes(gW, 0, 2))
                tUs, tUg = cpasync.tma_partition(tma_u, 0, one, cute.group_modes(sUst, 0, 2),
                                                 cute.group_modes(gU, 0, 2))
                if lane == 0:
                    if cutlass.const_expr("no_wu_store" in self.diag):
                        if scale < F32(0.0):  # never (timing only)
                            cute.copy(tma_w, tWs[None, 0], tWg[None, chunk])
                            if cutlass.const_expr(not self.skip_vu):
                                cute.copy(tma_u, tUs[None, 0], tUg[None, chunk])
                    elif cutlass.const_expr(self.skip_vu):
                        cute.copy(tma_w, tWs[None, 0], tWg[None, chunk])
                    else:
                        cute.copy(tma_w, tWs[None, 0], tWg[None, chunk])
                        cute.copy(tma_u, tUs[None, 0], tUg[None, chunk])
                    cute.arch.cp_async_bulk_commit_group()
                    # shared memory must outlive the bulk copies' reads of it
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(self.clock):
            self.stamp(ts, "end", tidx)
            if tidx == 0:  # after γ's [HV, NC, pitch] floats: CLOCK_SLOTS int32 per (head, chunk)
                ts[CLOCK_SLOTS - 1] = smid()
                gp = GAM_PITCH_PACK if cutlass.const_expr(self.pack) else DK
                base = cute.recast_ptr(pGam, dtype=cutlass.Int32) + HV * NC * gp
                cute.autovec_copy(ts, _vec(base, (hv * NC + chunk) * CLOCK_SLOTS, CLOCK_SLOTS))

    @cute.jit
    def invert(self, sA: cute.Tensor, sT: cute.Tensor, sY: cute.Tensor, warp, lane, tidx, b_raw: cute.Pointer,
               ts=None):
        """sT <- (I + sA)^-1 on and below the diagonal blocks (sA strictly lower, fp32, row pitch PAD).

        1. warp w, lanes 0..15: column ``lane`` of the 16x16 diagonal block w by forward substitution
           (lanes 16..31 of warps 0 and 2 zero the blocks (0,1) and (2,3), which steps 2/3 read);
        2. T_10 = −T_11 (A_10 T_00), T_32 = −T_33 (A_32 T_22);
        3. the lower-left 32x32 block: T_BA = −T_B (A_BA T_A), T_A / T_B the upper / lower 32x32
           diagonal blocks of T (lower block triangular, so L^-1 = [[T_A, 0], [−T_B A_BA T_A, T_B]]);
           with ``inv_wgmma`` on the tensor cores (:meth:`lower_left_wgmma`, 8 KB of scratch at ``b_raw``).

        The products of steps 2-3 give each thread a small register tile (2x2, 4x2) and read rows of the
        left factor as 16-byte vectors and pairs of the right one as 8-byte vectors: ~0.75 shared loads per
        FMA instead of 2 (PAD and YPAD keep every such vector aligned).
        """
        pA = sA.iterator
        pT = sT.iterator
        pY = sY.iterator
        self.diagonal_blocks(pA, sT, warp, lane)
        cute.arch.sync_threads()
        self.stamp(ts, "inv_diag", tidx)
        # step 2: the first half of the threads block (1, 0), the second half block (3, 2); a thread owns
        # rows r2 rg .. + r2 - 1 and columns 2cp, 2cp+1
        r2 = 2
        half_threads = THREADS // 2
        bp = tidx // half_threads
        ib = 2 * bp + 1
        jb = 2 * bp
        rg = (tidx % half_threads) // 8
        cp = tidx % 8
        acc2 = cute.make_rmem_tensor(cute.make_layout((r2, 2), stride=(2, 1)), F32)
        self._tile_product(pA, PAD, ib * SUB + r2 * rg, jb * SUB, pT, PAD, jb * SUB, jb * SUB + 2 * cp,
                           SUB, r2, acc2)
        for x in cutlass.range_constexpr(r2):
            cute.autovec_copy(acc2[x, None], _vec(pY, (bp * SUB + r2 * rg + x) * YPAD + 2 * cp, 2))
        cute.arch.sync_threads()
        self._tile_product(pT, PAD, ib * SUB + r2 * rg, ib * SUB, pY, YPAD, bp * SUB, 2 * cp, SUB, r2, acc2)
        for x in cutlass.range_constexpr(r2):
            for y in cutlass.range_constexpr(2):
                acc2[x, y] = -acc2[x, y]
            cute.autovec_copy(acc2[x, None], _vec(pT, (ib * SUB + r2 * rg + x) * PAD + jb * SUB + 2 * cp, 2))
        cute.arch.sync_threads()
        self.stamp(ts, "inv_step2", tidx)
        if cutlass.const_expr(self.inv_wgmma):
            self.lower_left_wgmma(sA, sT, b_raw, warp, tidx)
        else:
            self.lower_left_simt(sA, sT, sY, tidx)

    @cute.jit
    def lower_left_simt(self, sA: cute.Tensor, sT: cute.Tensor, sY: cute.Tensor, tidx):
        """Step 3 of :meth:`invert` on the CUDA cores (fp32)."""
        pA = sA.iterator
        pT = sT.iterator
        pY = sY.iterator
        # step 3: Y = A_BA T_A, then T_BA = −T_B Y (32x32 each, k < 32); a thread owns rows r3 rg3 ..
        # + r3 - 1 and columns 2cp, 2cp+1
        half = 2 * SUB
        r3 = 4
        rg3 = tidx // 16
        cp3 = tidx % 16
        acc3 = cute.make_rmem_tensor(cute.make_layout((r3, 2), stride=(2, 1)), F32)
        self._tile_product(pA, PAD, half + r3 * rg3, 0, pT, PAD, 0, 2 * cp3, half, r3, acc3)
        for x in cutlass.range_constexpr(r3):
            cute.autovec_copy(acc3[x, None], _vec(pY, (r3 * rg3 + x) * YPAD + 2 * cp3, 2))
        cute.arch.sync_threads()
        self._tile_product(pT, PAD, half + r3 * rg3, half, pY, YPAD, 0, 2 * cp3, half, r3, acc3)
        for x in cutlass.range_constexpr(r3):
            for y in cutlass.range_constexpr(2):
                acc3[x, y] = -acc3[x, y]
            cute.autovec_copy(acc3[x, None], _vec(pT, (half + r3 * rg3 + x) * PAD + 2 * cp3, 2))
        cute.arch.sync_threads()

    @cute.jit
    def lower_left_wgmma(self, sA: cute.Tensor, sT: cute.Tensor, b_raw: cute.Pointer, warp, tidx):
        """Step 3 of :meth:`invert` on wgmma: Y = A_BA T_A, then T_BA = −T_B Y.

        Each product is m64n64k32 with A from registers and B (MN-major, [64 n, 32 k], columns n >= 32
        unused) from two 4 KB smem tiles at ``b_raw``: hi = bf16(x) and lo = bf16(x − hi), accumulated
        as A_hi B_hi + A_hi B_lo + A_lo B_hi in fp32. Rows 32..63 of the m64 tile (warps 2 and 3) are
        the block's rows; warps 0 and 1 feed zero A rows and discard theirs.
        """
        half = 2 * SUB
        kmode = warpgroup.OperandMajorMode.K
        mnmode = warpgroup.OperandMajorMode.MN
        rsrc = warpgroup.OperandSource.RMEM
        mma = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, mnmode, F32, (1, 1, 1), (CHUNK, CHUNK), rsrc)
        # a K = 32 A operand is addressed through the C fragment of an m64n32 product (never issued)
        mma_k = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, mnmode, F32, (1, 1, 1), (CHUNK, half), rsrc)
        b_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, (CHUNK, CHUNK, half), BF16, 1)
        lo_raw = b_raw + CHUNK * half
        sB = [_tile(r, b_layout) for r in (b_raw, lo_raw)]
        thr = mma.get_slice(tidx)
        tB = [thr.make_fragment_B(thr.partition_B(t)) for t in sB]
        acc = thr.make_fragment_C(thr.partition_shape_C((CHUNK, CHUNK)))
        cC = thr.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))  # (row i, column n)
        thr_k = mma_k.get_slice(tidx)
        ck = thr_k.make_fragment_C(thr_k.partition_shape_C((CHUNK, half)))
        cK = thr_k.partition_C(cute.make_identity_tensor((CHUNK, half)))  # (row i, k)
        rA = [cute.make_rmem_tensor(a_operand_layout(ck.layout), BF16) for _ in range(2)]
        rA_c = [cute.make_tensor(r.iterator, ck.layout) for r in rA]
        pA = sA.iterator
        pT = sT.iterator
        obf = cute.make_rmem_tensor(cute.make_layout(8), BF16)

        # ---- product 1: B[n, k] = T_A[k, n] (thread: row k of T_A, columns n0 .. n0 + 7), A = A_BA
        kk = tidx // 4
        n0 = (tidx % 4) * 8
        t8 = cute.make_rmem_tensor(cute.make_layout(8), F32)
        for h in cutlass.range_constexpr(2):
            t4 = cute.make_tensor(t8.iterator + 4 * h, cute.make_layout(4))
            cute.autovec_copy(_vec(pT, kk * PAD + n0 + 4 * h, 4), t4)
        self.split_store8(t8, b_layout, (b_raw, lo_raw), (n0, kk, 0), obf)
        self.split_a(pA, 0, rA_c, cK, warp)
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()
        self.split_gemm(mma, acc, rA, tB)
        cute.arch.sync_threads()  # every warp is past the product: its B tiles can be rewritten

        # ---- product 2: B[n, k] = Y[k, n] (warps 2, 3 hold Y in rows 32 + k), A = T_B
        if warp >= 2:
            for e in cutlass.range_constexpr(0, cute.size(acc), 2):
                i, n = cC[e]
                if n < half:
                    pair = cute.make_rmem_tensor(cute.make_layout(2), F32)
                    pair[0] = acc[e]
                    pair[1] = acc[e + 1]
                    hi, lo = _hi_lo(pair.load())
                    off = cute.assume(_swizzled_offset(b_layout, (n, i - half, 0)), divby=2)
                    cute.make_tensor(b_raw + off, cute.make_layout(2)).store(hi)
                    cute.make_tensor(lo_raw + off, cute.make_layout(2)).store(lo)
        self.split_a(pT, half, rA_c, cK, warp)
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.sync_threads()
        self.split_gemm(mma, acc, rA, tB)
        if warp >= 2:
            for e in cutlass.range_constexpr(0, cute.size(acc), 2):
                i, n = cC[e]
                if n < half:
                    pair = cute.make_rmem_tensor(cute.make_layout(2), F32)
                    pair[0] = -acc[e]
                    pair[1] = -acc[e + 1]
                    cute.autovec_copy(pair, _vec(pT, i * PAD + n, 2))
        cute.arch.sync_threads()

    @cute.jit
    def split_store8(self, vals: cute.Tensor, layout: cute.ComposedLayout, raws: tuple, coord, obf: cute.Tensor):
        """Store 8 fp32 values as bf16 hi = bf16(x) and lo = bf16(x − hi) at ``coord`` of two swizzled tiles."""
        hi, lo = _hi_lo(vals.load())
        obf.store(hi)
        _st8(layout, raws[0], coord, obf)
        obf.store(lo)
        _st8(layout, raws[1], coord, obf)

    @cute.jit
    def split_a(self, pSrc: cute.Pointer, col0: cutlass.Constexpr, rA_c: list, cK: cute.Tensor, warp):
        """A operand (hi, lo) of a K = 32 product: rows 32..63 of the fp32 matrix at ``pSrc`` (pitch PAD),
        columns ``col0`` .. + 31, on warps 2 and 3; zeros on warps 0 and 1."""
        for x in cutlass.range_constexpr(2):
            rA_c[x].fill(0.0)
        if warp >= 2:
            for e in cutlass.range_constexpr(0, cute.size(rA_c[0]), 2):
                i, k = cK[e]
                pair = cute.make_rmem_tensor(cute.make_layout(2), F32)
                cute.autovec_copy(_vec(pSrc, i * PAD + col0 + k, 2), pair)
                hi, lo = _hi_lo(pair.load())
                for h in cutlass.range_constexpr(2):
                    rA_c[0][e + h] = hi[h]
                    rA_c[1][e + h] = lo[h]

    @cute.jit
    def split_gemm(self, mma: cute.TiledMma, acc: cute.Tensor, rA: list, tB: list):
        """acc = A_hi B_hi + A_hi B_lo + A_lo B_hi (fp32 accumulate; the first pass overwrites acc)."""
        warpgroup.fence()
        for p in cutlass.range_constexpr(len(SPLIT_PASSES)):
            a_i, b_i = SPLIT_PASSES[p]
            for kb in cutlass.range_constexpr(cute.size(rA[a_i], mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, p != 0 or kb != 0)
                cute.gemm(mma, acc, rA[a_i][None, None, kb], tB[b_i][None, None, kb, 0], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def diagonal_blocks(self, pA: cute.Pointer, sT: cute.Tensor, warp, lane):
        """Step 1 of :meth:`invert`: warp w < 4, lanes 0..15, column ``lane`` of the 16x16 diagonal block w
        by forward substitution; lanes 16..31 of warps 0 and 2 zero the blocks (0,1) and (2,3)."""
        base = warp * SUB
        if lane < SUB:
            if cutlass.const_expr(self.subst == "right"):
                self.substitute_right(pA, sT, base, lane)
            else:
                col = cute.make_rmem_tensor(cute.make_layout(SUB), F32)
                arow = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), F32)
                for i in cutlass.range_constexpr(SUB):
                    # row i of the diagonal block, columns 0 .. i-1 (as whole 4-vectors: the rest is unused)
                    for q in cutlass.range_constexpr((i + 3) // 4):
                        cute.autovec_copy(_vec(pA, (base + i) * PAD + base + 4 * q, 4), arow[q, None])
                    acc0 = F32(0.0)
                    acc1 = F32(0.0)  # two partial sums halve the dependency chain (four measured no faster)
                    if lane == i:
                        acc0 = F32(1.0)
                    for j in cutlass.range_constexpr(i):
                        if cutlass.const_expr(j % 2 == 0):
                            acc0 = acc0 - arow[j // 4, j % 4] * col[j]
                        else:
                            acc1 = acc1 - arow[j // 4, j % 4] * col[j]
                    col[i] = acc0 + acc1
                    sT[base + i, base + lane] = col[i]
        else:
            if warp % 2 == 0:
                for i in cutlass.range_constexpr(SUB):
                    sT[base + i, base + lane] = F32(0.0)

    @cute.jit
    def substitute_right(self, pA: cute.Pointer, sT: cute.Tensor, base, lane):
        """Column ``lane`` of the inverse of the 16x16 diagonal block at ``base`` (``subst="right"``).

        The block's strictly lower part of A comes into registers first (36 16-byte loads, none waiting on a
        store to sT), then the substitution runs column by column of A: once T[j] is final, every later row
        takes its term at once. A row's value is final one FMA after the row above's, so the dependent chain is
        15 FMAs long instead of a row's dot product per row (the left-looking form in ``diagonal_blocks``: ~64
        FMAs in chains and a shared load before each row); the sums are the same terms in the same order as a single
        accumulator's.
        """
        arow = cute.make_rmem_tensor(cute.make_layout((SUB, SUB // 4, 4), stride=(SUB, 4, 1)), F32)
        for i in cutlass.range_constexpr(1, SUB):
            for q in cutlass.range_constexpr((i + 3) // 4):  # columns 0 .. i-1 as whole 4-vectors
                cute.autovec_copy(_vec(pA, (base + i) * PAD + base + 4 * q, 4), arow[i, q, None])
        acc = cute.make_rmem_tensor(cute.make_layout(SUB), F32)
        for i in cutlass.range_constexpr(SUB):
            acc[i] = F32(0.0)
            if lane == i:
                acc[i] = F32(1.0)
        for j in cutlass.range_constexpr(SUB):
            sT[base + j, base + lane] = acc[j]
            for i in cutlass.range_constexpr(j + 1, SUB):
                acc[i] = acc[i] - arow[i, j // 4, j % 4] * acc[j]

    @cute.jit
    def _tile_product(self, pL: cute.Pointer, ldl: cutlass.Constexpr, row0, k0l, pR: cute.Pointer,
                      ldr: cutlass.Constexpr, k0r, col0, nk: cutlass.Constexpr, nrows: cutlass.Constexpr,
                      acc: cute.Tensor):
        """acc[x, y] = Σ_{kk < nk} L[row0 + x, k0l + kk] · R[k0r + kk, col0 + y] (fp32, smem operands).

        ``acc`` is a (nrows, 2) register tile; rows of L are read 4 columns at a time (16-byte loads),
        R two columns at a time (8-byte loads). ``row0 * ldl + k0l`` and ``col0`` must be even and
        ``k0l`` a multiple of 4.
        """
        acc.fill(0.0)
        lrow = cute.make_rmem_tensor(cute.make_layout((nrows, 4), stride=(4, 1)), F32)
        rpair = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(2, 1)), F32)
        for q in cutlass.range_constexpr(nk // 4):
            for x in cutlass.range_constexpr(nrows):
                cute.autovec_copy(_vec(pL, (row0 + x) * ldl + k0l + 4 * q, 4), lrow[x, None])
            for h in cutlass.range_constexpr(4):
                cute.autovec_copy(_vec(pR, (k0r + 4 * q + h) * ldr + col0, 2), rpair[h, None])
            for h in cutlass.range_constexpr(4):
                for x in cutlass.range_constexpr(nrows):
                    for y in cutlass.range_constexpr(2):
                        acc[x, y] = acc[x, y] + lrow[x, h] * rpair[h, y]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
@cute.jit
def _gemm_ss(mma: cute.TiledMma, acc: cute.Tensor, t_a: cute.Tensor, t_b: cute.Tensor):
    """acc = A B over every k-block of single-stage smem fragments (the first block overwrites acc)."""
    for kb in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(mma, acc, t_a[None, None, kb, 0], t_b[None, None, kb, 0], acc)


def _bitrev4(m: int) -> int:
    """The 4-bit reversal of ``m`` (0 <= m < 16): which lane of a half-warp holds sum m after row_norms' halving."""
    return int(f"{m:04b}"[::-1], 2)


@cute.jit
def _tile(raw: cute.Pointer, layout: cute.ComposedLayout) -> cute.Tensor:
    """The swizzled bf16 tile of ``layout`` at the unswizzled start ``raw``."""
    return cute.make_tensor(cute.recast_ptr(raw, swizzle_=layout.inner, dtype=BF16), layout.outer)


@cute.jit
def _hi_lo(x):
    """fp32 values as two bf16 parts: hi = bf16(x), lo = bf16(x − hi) (x − hi is exact in fp32)."""
    hi = x.to(BF16)
    return hi, (x - hi.to(F32)).to(BF16)


# ------------------------------------------------------------------------------------------------
# addressing helpers
# ------------------------------------------------------------------------------------------------
@cute.jit
def _vec(ptr: cute.Pointer, off, n: cutlass.Constexpr) -> cute.Tensor:
    """``(n,)`` contiguous elements at ``ptr + off``, ``off`` a multiple of ``n``: with a base aligned to
    ``n`` elements a copy of it is one ``n``-element vector access (global or shared memory)."""
    return cute.make_tensor(ptr + cute.assume(off, divby=n), cute.make_layout(n))


@cute.jit
def _swizzled_offset(layout: cute.ComposedLayout, coord) -> cutlass.Int32:
    """Element offset of ``coord`` in a 128-byte-swizzled 16-bit tile (S<3,4,3> on byte addresses).

    The swizzle permutes 16-byte chunks inside each 128-byte row, so 8 consecutive elements starting at a
    multiple of 8 stay one contiguous, 16-byte-aligned vector.
    """
    lin = cute.crd2idx(coord, layout.outer) * 2
    return (lin ^ (((lin >> 7) & 7) << 4)) // 2


@cute.jit
def _st8(layout: cute.ComposedLayout, base: cute.Pointer, coord, vals: cute.Tensor):
    """Store 8 bf16 values (one st.shared.v4) at ``coord`` of a swizzled tile and the 7 elements after
    it along the tile's contiguous mode; ``base`` is the tile's unswizzled start."""
    off = _swizzled_offset(layout, coord)
    cute.make_tensor(base + cute.assume(off, divby=8), cute.make_layout(8)).store(vals.load())


@cute.jit
def _ld8(layout: cute.ComposedLayout, base: cute.Pointer, coord, out: cute.Tensor):
    """Load 8 bf16 values at ``coord`` of a swizzled tile (and the 7 after it) into ``out``."""
    off = _swizzled_offset(layout, coord)
    out.store(cute.make_tensor(base + cute.assume(off, divby=8), cute.make_layout(8)).load())


@cute.jit
def _read_landed_rows(layout: cute.ComposedLayout, tiles: list, nvalid, r0, d0):
    """This thread's rows ``r0 ..`` (columns ``d0 ..``) of the TMA-filled tiles ``tiles`` ((unswizzled start,
    [rows, 8] register array) pairs) into registers. In a sequence's last chunk (a uniform branch) its part of the
    rows past the end, another sequence's tokens or TMA's zeros, is zeroed in the tiles first: nothing of another
    sequence is multiplied by a zero factor later (Inf would make NaN)."""
    zero8 = cute.make_rmem_tensor(cute.make_layout(COLS_PER_THREAD), BF16)
    zero8.fill(0.0)
    if nvalid < CHUNK:
        for rr in cutlass.range_constexpr(ROWS_PER_THREAD):
            if r0 + rr >= nvalid:
                for base, _ in tiles:
                    _st8(layout, base, (r0 + rr, d0, 0), zero8)
    for rr in cutlass.range_constexpr(ROWS_PER_THREAD):
        for base, rows in tiles:
            _ld8(layout, base, (r0 + rr, d0, 0), rows[rr, None])


# ------------------------------------------------------------------------------------------------
# CPU compile targets
# ------------------------------------------------------------------------------------------------
def _compile_without_driver() -> None:
    """The 2-CTA launch bound makes the DSL query the device's shared memory per SM at compile time;
    without a GPU (the CPU PTX check) answer it with the H200's value."""
    import torch

    if torch.cuda.is_available():
        return
    from cutlass.base_dsl.runtime import cuda as dsl_cuda

    dsl_cuda.get_device_attribute = lambda attribute, device_id=0: SMEM_PER_SM


def compile_targets():
    """CPU PTX-check targets: the suite's flag set (bf16 and fp32 gate inputs) and a plain one."""
    from cutlass.cute.runtime import make_fake_stream

    from cula.kernels.sm90.kda_fwd_intra import fake_args

    def build(g_dtype, **flags):
        def make():
            _compile_without_driver()
            return KdaFwdIntraTC(**flags), (*fake_args(cutlass.BFloat16, g_dtype, g_dtype), make_fake_stream())
        return make

    full = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True,
                allow_neg_eigval=False, group=1)
    return {
        "default": build(cutlass.BFloat16, **full),
        "fp32_gate": build(cutlass.Float32, **full),
        "plain_gva": build(cutlass.BFloat16, **{**full, "use_qk_l2norm": False, "has_a_log": False,
                                                 "has_dt_bias": False, "use_beta_sigmoid": False,
                                                 "allow_neg_eigval": True, "group": 2}),
        "simt_inverse": build(cutlass.BFloat16, **full, inv_wgmma=False),
        "prefetch": build(cutlass.BFloat16, **full, prefetch_ahead=132),
        "pdl_end": build(cutlass.BFloat16, **full, pdl_trigger="end"),
        "softplus_gate": build(cutlass.BFloat16, **full, softplus_gate=True),
        "softplus_fp32_gate_gva": build(cutlass.Float32, **{**full, "group": 2}, softplus_gate=True),
        # every same-values diagnostic at once; no_v_u (a different stage 1: no v, no u) on its own
        "diag_all": build(cutlass.BFloat16, **full, diag=SAME_VALUE_DIAGS),
        "diag_no_v_u": build(cutlass.BFloat16, **full, diag=("no_v_u",)),
        "emit_akk": build(cutlass.BFloat16, **full, emit_akk=True),
        # u in stage 2: T' beside Aqk, -w, no v and no u (kda_fwd.U_IN_RECUR)
        "t_out": build(cutlass.BFloat16, **full, t_out=True),
        "t_out_softplus_gva": build(cutlass.BFloat16, **{**full, "group": 2}, softplus_gate=True, t_out=True),
        # the timing diagnostics on the default stage 1 (device_round diag_split)
        "t_out_diag_all": build(cutlass.BFloat16, **full, t_out=True, diag=SAME_VALUE_DIAGS),
        # the pre-session-21 forms on the default stage 1: 2^Γ by exp2 (GATE_FACTORS), left-looking substitution
        # (SUBST), both (PTX byte-identical to 744476b's t_out)
        "t_out_gate_direct": build(cutlass.BFloat16, **full, t_out=True, gate_factors="direct"),
        "t_out_subst_left": build(cutlass.BFloat16, **full, t_out=True, subst="left"),
        "t_out_direct_left": build(cutlass.BFloat16, **full, t_out=True, gate_factors="direct", subst="left"),
        # 32-row reference-factor blocks (FACTOR_BLOCKS) on the default stage 1, and with the training outputs
        "t_out_block32": build(cutlass.BFloat16, **full, t_out=True, factor_block=32),
        "emit_akk_block32": build(cutlass.BFloat16, **full, emit_akk=True, factor_block=32),
        "t_out_block32_direct": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, gate_factors="direct"),
        # session 25's phase 1 on the default stage 1 (PHASE1; PTX byte-identical to 3a1c8de's t_out_block32)
        "t_out_block32_pre26": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, phase1="pre26"),
        # session 26's phase 1 (q, k by per-thread loads; PHASE1 "lean")
        "t_out_block32_lean": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, phase1="lean"),
        # session 28's first phase 1 (q, k, g by TMA on one barrier; PHASE1 "tma_qkg"); session 27's (q, k by TMA)
        "t_out_block32_tma_qkg": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, phase1="tma_qkg"),
        "t_out_block32_tma_qk": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, phase1="tma_qk"),
        # the packed [Aqk | T'] tile (kda_fwd.PACK) on the default stage 1
        "t_out_block32_pack": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True),
        # the packed default launched in the order before session 31 (ORDER "chunk": chunk fastest)
        "t_out_block32_pack_chunk": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                          order="chunk"),
        # w in stage 2 (kda_fwd.W_IN_RECUR): -X stored from its tile, no w product; packed and unpacked
        "t_out_block32_pack_x": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True, x_out=True),
        "t_out_block32_x": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, x_out=True),
        # both at three CTAs per SM (CTAS: no X, v or 48-row B' tile, -X from registers)
        "t_out_block32_x_ctas3": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, x_out=True, ctas=3),
        "t_out_block32_pack_x_ctas3": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                            x_out=True, ctas=3),
        # the three-CTA default widening bf16 inputs by cvt.f32.bf16 (WIDEN "cvt"), and also forming kgᵀ as K̂ 2^(Γ_last
        # − E) (KGT "kh"): both before session 37
        "t_out_block32_pack_x_ctas3_cvt": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                                x_out=True, ctas=3, widen="cvt"),
        "t_out_block32_pack_x_ctas3_square": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                                   x_out=True, ctas=3, gate_factors="square"),
        "t_out_block32_pack_x_ctas3_s36": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                                x_out=True, ctas=3, widen="cvt", kgt="kh"),
        # phase timestamps (kda_fwd_clock): the default stage 1 with thread 0 reading the SM's cycle counter
        "t_out_clock": build(cutlass.BFloat16, **full, t_out=True, diag=("clock",)),
        # ... and the three-CTA defaults with it (32-bit stamps, session 38), unpacked and packed
        "t_out_block32_x_ctas3_clock": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, x_out=True,
                                             ctas=3, diag=("clock",)),
        "t_out_block32_pack_x_ctas3_clock": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                                  x_out=True, ctas=3, diag=("clock",)),
        # the three-CTA defaults without their scratch stores (session 38: diagnostics ran at two CTAs before)
        "t_out_block32_x_ctas3_no_stores": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, x_out=True,
                                                 ctas=3, diag=("no_qg_kgt", "no_wu_store", "no_aqk_store")),
        "t_out_block32_pack_x_ctas3_no_stores": build(cutlass.BFloat16, **full, t_out=True, factor_block=32,
                                                      pack=True, x_out=True, ctas=3,
                                                      diag=("no_qg_kgt", "no_wu_store", "no_aqk_store")),
        # raw tiles (session 39): the three-CTA defaults storing the rows' norms instead of qg, kgᵀ and -X
        "t_out_block32_x_ctas3_raw": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, x_out=True, ctas=3,
                                           raw_out=True),
        "t_out_block32_pack_x_ctas3_raw": build(cutlass.BFloat16, **full, t_out=True, factor_block=32, pack=True,
                                                x_out=True, ctas=3, raw_out=True),
        # FLA's safe_gate with precomputed (log-space) gates, fp32 as its gate kernels write them
        "log_gate": build(cutlass.Float32, **{**full, "has_a_log": False, "has_dt_bias": False}, log_gate=True),
    }


# ------------------------------------------------------------------------------------------------
# torch model of the kernel (same factorisation, inverse steps and bf16 rounding points)
# ------------------------------------------------------------------------------------------------
def gate_log2(g, lower_bound: float, a_exp, dtb, softplus_gate: bool = False, log_gate: bool = False):
    """The per-token gate in log2 units (torch, fp32 in, fp32 out) as this kernel's model forms it: ``g`` the raw
    gate (or, with ``log_gate``, the log-space decay), ``a_exp`` = exp(A_log) and ``dtb`` = dt_bias, both already
    broadcastable against ``g``; the lower-bounded sigmoid gate, FLA's softplus gate clamped at ``lower_bound``, or
    the log-space decay clamped to ``[lower_bound, 0]``."""
    import torch

    if log_gate:
        return torch.clamp(g, min=lower_bound, max=0.0) * RCP_LN2
    if softplus_gate:
        sp = torch.nn.functional.softplus(g + dtb, threshold=SOFTPLUS_THRESHOLD)
        return torch.clamp(-a_exp * sp, min=lower_bound) * RCP_LN2
    return lower_bound * RCP_LN2 / (1 + torch.exp(-(a_exp * (g + dtb))))


def emulate(q, k, v, g, beta, chunks, scale, lower_bound, A_log=None, dt_bias=None,
            use_qk_l2norm=False, use_beta_sigmoid=False, allow_neg_eigval=False, softplus_gate=False,
            log_gate=False, factor_block=SUB, kgt=None):
    """The stage-1 scratch exactly as this kernel forms it, in torch (CPU or GPU).

    ``q, k: [TT, H, 128]``, ``v, g: [TT, HV, 128]``, ``beta: [TT, HV]`` (flattened tokens), ``chunks``
    the ``[NC, 2]`` table of ``kda_fwd.chunk_tables``. Returns the dict of ``kda_fwd.emulate_stages``
    (w, u, qg, aqk, kgt in bf16; gam fp32) plus ``akk``, bf16(T) as ``emit_akk`` stores it; off the block
    diagonal the factor is on the B side, K̂ ⊙ bf16(2^(R_I − E_J)) rounded once (what mul.bf16x2 does),
    and the product times 2^-shift in fp32; ``softplus_gate``: the softplus gate clamped at
    ``lower_bound`` (``SOFTPLUS_FLOOR``); ``log_gate``: ``g`` is the log-space decay, clamped to
    ``[lower_bound, 0]``; ``factor_block`` 32: the reference factors per 32-row block (``FACTOR_BLOCKS``), one
    off-diagonal block whose B factor ``k̂ 2^(R − Γ)`` is formed in fp32 and rounded once, and kgᵀ formed as ``kgt``
    (one of ``KGT_MODES``; None: the module's ``KGT``) says. It exists to test the
    algorithm (reference factors, block
    inverse, where bf16 rounding happens) on a CPU against the exact emulation; the GPU check compares
    the kernel with ``kda_fwd.emulate_stages`` directly.
    """
    import torch

    f32, bf16 = torch.float32, torch.bfloat16
    HV, H = v.shape[1], q.shape[1]
    G = HV // H
    NC = chunks.shape[0]
    dev = q.device
    rows = torch.arange(CHUNK, device=dev)
    keep = rows[None] < chunks[:, 1:].long()  # [NC, 64]
    idx = chunks[:, :1].long() + torch.minimum(rows[None], chunks[:, 1:].long() - 1)
    kf = keep[:, None, :, None].to(f32)

    def gather(x, heads_from):  # [TT, h, D] -> [NC, HV, 64, D] (q/k heads repeated over the group)
        x = x[idx].transpose(1, 2).to(f32)  # [NC, h, 64, D]
        return x.repeat_interleave(G, 1) if heads_from == "q" else x

    qc, kc = gather(q, "q") * kf, gather(k, "q") * kf
    vc, gc = gather(v, "v") * kf, gather(g, "v")
    a_exp = torch.ones(HV, device=dev) if A_log is None else A_log.float().exp()
    dtb = torch.zeros(HV, DK, device=dev) if dt_bias is None else dt_bias.float().reshape(HV, DK)
    gv = gate_log2(gc, lower_bound, a_exp[None, :, None, None], dtb[None, :, None, :], softplus_gate, log_gate) * kf
    gam = gv.cumsum(2)  # Γ [NC, HV, 64, K]
    bc = beta[idx].transpose(1, 2).to(f32)  # [NC, HV, 64]
    if use_beta_sigmoid:
        bc = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(bc)
    bc = bc * keep[:, None].to(f32)
    nq = torch.full_like(qc[..., :1], scale)
    nk = torch.ones_like(kc[..., :1])
    if use_qk_l2norm:
        nq = scale * torch.rsqrt((qc * qc).sum(-1, keepdim=True) + L2NORM_EPS)
        nk = torch.rsqrt((kc * kc).sum(-1, keepdim=True) + L2NORM_EPS)
    qs, ks = qc * nq, kc * nk
    fbk = factor_block
    shift = factor_shift(fbk) * lower_bound
    blk_first = gam[:, :, ::fbk]  # Γ at rows fbk I: [NC, HV, 64 / fbk, K]
    blk_last = gam[:, :, fbk - 1::fbk]  # E_I
    cref = (blk_first - shift).repeat_interleave(fbk, 2)
    eref = blk_last.repeat_interleave(fbk, 2)
    last = gam[:, :, -1:]

    def ex2(x):  # the kernel's exp2 factors: ex2.approx.ftz, whose subnormal results are zero (its FMULs keep them)
        y = torch.exp2(x)
        return torch.where(y.abs() < 2.0 ** -126, torch.zeros_like(y), y)

    fb = ex2(cref - gam)
    ka = (ks * ex2(gam - cref)).to(bf16)
    qa = (qs * ex2(gam - cref)).to(bf16)
    kt = (ks * fb).to(bf16)
    kh_f = ks * fb * ex2(eref - cref)
    kh = kh_f.to(bf16)
    xx = (ks * torch.exp2(gam)).to(bf16)
    qg = (qs * torch.exp2(gam)).to(bf16)
    if fbk == SUB or (KGT if kgt is None else kgt) != "ref":
        kg = (kh_f * ex2(last - eref)).to(bf16)
    else:  # (K̃ 2^(ref − C)) 2^(Γ_last − ref): ref = R (Γ at row 32) for block 0's rows, C_1 for block 1's
        ref = torch.where((rows < fbk)[None, None, :, None], gam[:, :, fbk:fbk + 1], cref)
        kg = ((ks * fb * ex2(ref - cref)) * ex2(last - ref)).to(bf16)
    akk_d = ka.float() @ kt.float().transpose(-1, -2)
    aqk_d = qa.float() @ kt.float().transpose(-1, -2)
    akk = torch.zeros_like(akk_d)
    aqk = torch.zeros_like(aqk_d)
    ii = rows[:, None]
    jj = rows[None, :]
    same = (ii // fbk) == (jj // fbk)
    akk = torch.where(same & (jj < ii), akk_d, akk)
    aqk = torch.where(same & (jj <= ii), aqk_d, aqk)
    for ib, jb in (PAIRS if fbk == SUB else ((1, 0),)):
        r = slice(ib * fbk, (ib + 1) * fbk)
        cs = slice(jb * fbk, (jb + 1) * fbk)
        if fbk == SUB:
            f_ij = ex2(blk_first[:, :, ib] - blk_last[:, :, jb]).to(bf16)  # 2^(R_I − E_J)
            b = (kh[:, :, cs] * f_ij[:, :, None]).float().transpose(-1, -2)
        else:  # K̃ (fp32) times 2^(R_1 − C_0), rounded once
            f_rc = ex2(blk_first[:, :, ib] - (blk_first[:, :, jb] - shift))
            b = (ks[:, :, cs] * fb[:, :, cs] * f_rc[:, :, None]).to(bf16).float().transpose(-1, -2)
        akk[:, :, r, cs] = (ka[:, :, r].float() @ b) * 2.0 ** -shift
        aqk[:, :, r, cs] = (qa[:, :, r].float() @ b) * 2.0 ** -shift
    akk = akk * bc[..., :, None]
    t = _invert_blocked(akk)
    tp = (t * bc[..., None, :]).to(bf16).float()
    w = (tp @ xx.float()).to(bf16)
    u = (tp @ vc.to(bf16).float()).to(bf16)

    def rows_of(x):  # [NC, HV, 64, D] -> [HV, NC*64, D]
        return x.permute(1, 0, 2, 3).reshape(HV, NC * CHUNK, x.shape[-1])

    return dict(w=rows_of(w), u=rows_of(u), qg=rows_of(qg), aqk=rows_of(aqk.to(bf16)),
                kgt=rows_of(kg).transpose(1, 2), gam=torch.exp2(last[:, :, 0]).permute(1, 0, 2),
                akk=rows_of(t.to(bf16)))  # what emit_akk stores (FLA's saved Akk)


def _invert_blocked(a):
    """(I + a)^-1 for strictly lower ``a [..., 64, 64]`` by the kernel's steps (fp32)."""
    import torch

    t = torch.zeros_like(a)
    eye = torch.eye(SUB, dtype=a.dtype, device=a.device)
    for b in range(NBLK):
        s = slice(b * SUB, (b + 1) * SUB)
        t[..., s, s] = torch.linalg.solve_triangular(eye + a[..., s, s], eye.expand_as(a[..., s, s]),
                                                     upper=False, unitriangular=True)
    for ib, jb in ((1, 0), (3, 2)):
        ri, rj = slice(ib * SUB, (ib + 1) * SUB), slice(jb * SUB, (jb + 1) * SUB)
        t[..., ri, rj] = -t[..., ri, ri] @ (a[..., ri, rj] @ t[..., rj, rj])
    lo, hi = slice(0, 2 * SUB), slice(2 * SUB, CHUNK)
    t[..., hi, lo] = -t[..., hi, hi] @ (a[..., hi, lo] @ t[..., lo, lo])
    return t


# ------------------------------------------------------------------------------------------------
# layout facts the kernel relies on (checked on the CPU by the tests)
# ------------------------------------------------------------------------------------------------
def layout_facts() -> dict:
    """Trace the DSL's layouts (no GPU) and report the facts the kernel's hand-made addressing assumes."""
    kmode, mnmode = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    kmaj, mnmaj = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    facts: dict = {}

    def coord(t, lay):
        return tuple(int(x) for x in lay(cute.idx2crd(t, lay.shape)))

    @cute.jit(preprocess=False)  # plain Python control flow: everything here is static
    def trace():
        diag = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, kmode, F32, (1, 1, 1), (CHUNK, CHUNK))
        # an RS product (A from registers, as the inverse's wgmma step feeds it)
        off = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, kmode, F32, (1, 1, 1), (CHUNK, SUB),
                                                warpgroup.OperandSource.RMEM)
        wu = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, mnmode, F32, (1, 1, 1), (CHUNK, DK))
        bad_a = 0
        for t in (0, 1, 5, 31, 37, 64, 99, 127):
            # a_operand_layout: the k-th register of an RS A operand holds the element that the C fragment
            # of a product with that K as N puts there
            a_ref = off.get_slice(t).partition_A(cute.make_identity_tensor((CHUNK, DK))).layout
            c128 = wu.get_slice(t).partition_C(cute.make_identity_tensor((CHUNK, DK))).layout
            a_regs = a_operand_layout(cute.make_layout(wu.get_slice(t).partition_shape_C((CHUNK, DK))))
            for p in range(cute.size(a_regs)):
                bad_a += int(coord(p, a_ref) != coord(int(a_regs(cute.idx2crd(p, a_regs.shape))), c128))
        facts["a_register_mismatches"] = bad_a
        # value e of the m64n(16 I) product is value e of the m64n64 one (a prefix), and
        # the B'_I tiles keep 8 consecutive columns of a row as one 16-byte vector (_ld8 / _st8)
        bad_prefix = 0
        bad_vec = 0
        for ib in (1, 2, 3):
            mma_i = sm90_utils.make_trivial_tiled_mma(BF16, BF16, kmode, kmode, F32, (1, 1, 1), (CHUNK, SUB * ib))
            for t in (0, 1, 5, 31, 37, 64, 99, 127):
                c64 = diag.get_slice(t).partition_C(cute.make_identity_tensor((CHUNK, CHUNK))).layout
                ci = mma_i.get_slice(t).partition_C(cute.make_identity_tensor((CHUNK, SUB * ib))).layout
                bad_prefix += sum(int(coord(e, c64) != coord(e, ci)) for e in range(cute.size(ci)))
            kb = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, SUB * ib, DK), BF16, 1)
            facts[f"swizzle_kb{ib}"] = str(kb.inner)

            def swz(j, d):  # _swizzled_offset in plain Python (S<3,4,3> on byte addresses)
                lin = int(cute.crd2idx((j, d, 0), kb.outer)) * 2
                return (lin ^ (((lin >> 7) & 7) << 4)) // 2

            for j in range(SUB * ib):
                for c8 in range(0, DK, 8):
                    base = swz(j, c8)
                    bad_vec += int(base % 8 != 0 or any(swz(j, c8 + x) != base + x for x in range(8)))
        facts["offdiag_prefix_mismatches"] = bad_prefix
        facts["offdiag_b_vector_mismatches"] = bad_vec
        a_l = sm90_utils.make_smem_layout_a(kmaj, (CHUNK, CHUNK, DK), BF16, 1)
        x_l = sm90_utils.make_smem_layout_b(mnmaj, (CHUNK, DV, CHUNK), BF16, 1)
        w_l = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, DK), BF16, 1)
        facts["x_is_a_transposed"] = all(
            int(cute.crd2idx((d, r, 0), x_l.outer)) == int(cute.crd2idx((r, d, 0), a_l.outer))
            for r in range(CHUNK) for d in range(0, DK, 8))
        facts["w_staging_is_a"] = str(w_l) == str(a_l)
        # t_out stores T' from its operand tile through the Aqk store's TMA atom
        facts["tb_is_aqk_staging"] = str(sm90_utils.make_smem_layout_a(kmaj, (CHUNK, DV, CHUNK), BF16, 1)) == str(
            sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, CHUNK), BF16, 1))
        aqk_l = sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, CHUNK), BF16, 1)

        def swz_aqk(j, i):  # _swizzled_offset on the Aqk staging, in plain Python
            lin = int(cute.crd2idx((j, i, 0), aqk_l.outer)) * 2
            return (lin ^ (((lin >> 7) & 7) << 4)) // 2

        # pack: the T' scatter's offsets (element (j, i) of the staging, j = 8 k + c)
        facts["aqk_staging_offsets"] = all(
            swz_aqk(j, i) == j * CHUNK + (((i >> 3) ^ (j % 8)) << 3) + (i & 7)
            for j in range(CHUNK) for i in range(CHUNK))
        for name, lay in (("a", a_l), ("x", x_l), ("w", w_l),
                          ("tb", sm90_utils.make_smem_layout_a(kmaj, (CHUNK, DV, CHUNK), BF16, 1)),
                          ("aqk", sm90_utils.make_smem_layout_b(kmaj, (CHUNK, CHUNK, CHUNK), BF16, 1))):
            facts[f"swizzle_{name}"] = str(lay.inner)

    from cula.kernels.common.ptx_check import trace_without_gpu

    return trace_without_gpu(trace, facts)


if __name__ == "__main__":
    import json
    import sys

    if "--layout-facts" in sys.argv:  # run with CUTE_DSL_ARCH=sm_90a set before Python starts
        print(json.dumps(layout_facts()))
    else:
        print(__doc__)

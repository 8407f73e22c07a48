"""KDA forward, stage 2 of 2: the chunk recurrence on tensor cores (wgmma) fed by TMA.

One work item per (sequence, value head, 64-wide V tile): v1 runs one CTA each, v2 persistent CTAs
walk them. The state is kept transposed, ``Sᵀ: [64 v, 128 k]`` fp32, as a wgmma accumulator (64
registers per thread of one warpgroup). Per chunk (scratch written by ``kda_fwd_intra``, chunk-padded,
so every TMA box is a full 64-row tile of one sequence):

    v_newᵀ = uᵀ − Sᵀ wᵀ              A = Sᵀ (bf16)        B = w   [64 tok, 128 k]   M64 N64 K128
    oᵀ     = Sᵀ qgᵀ + v_newᵀ Aqkᵀ    A = Sᵀ, B = qg;  A = v_newᵀ (bf16), B = Aqk    M64 N64 K128+64
    Sᵀ     = Sᵀ diag(γ) + v_newᵀ kg  A = v_newᵀ, B = kgᵀ [128 k, 64 tok]          M64 N128 K64

All operands are K-major. Two kernel bodies (``RECUR_VARIANT``):

- ``v1`` (validated on the H200 2026-12-02): one warpgroup; bf16 copies of Sᵀ and v_newᵀ go through
  shared memory (A operands from smem, a CTA barrier each); w, qg, Aqk, kgᵀ arrive through a 2-stage
  TMA ring issued by thread 0 at the end of each chunk; u and γ are read from global memory in the
  accumulator's layout on the critical path; o is written with predicated scalar stores.
- ``v2`` (the default): a math warpgroup plus a TMA warp, persistent (session 7: one CTA per SM
  walks the (V tile, head, sequence) items, so the TMA ring runs on across item boundaries). The bf16 copies
  of Sᵀ and v_newᵀ stay in registers as wgmma A operands (the C fragment of an m64nN product is the A
  fragment of the next K = N product), so the math warpgroup needs no barrier at all inside a chunk;
  u [64 tok, 64 v] and γ [128] come through a 3-stage TMA ring with w, qg, Aqk, kgᵀ; the TMA warp
  refills a stage as soon as it is released; o leaves through a per-warp smem tile as 16-byte rows.
  Same products in the same order on the same bf16 values: o and the final state should be bitwise v1's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from cula.kernels.common.l2_prefetch import LINE_BYTES, prefetch_line_l2
from cula.kernels.common.wgmma_frag import a_operand_layout
from cula.kernels.sm90.kda_fwd_raw_tiles import GATES as RAW_GATES
from cula.kernels.sm90.kda_fwd_raw_tiles import HALF as RAW_HALF
from cula.kernels.sm90.kda_fwd_raw_tiles import LOG2E as RAW_LOG2E
from cula.kernels.sm90.kda_fwd_raw_tiles import PAIR as RAW_PAIR
from cula.kernels.sm90.kda_fwd_raw_tiles import RCP_LN2 as RAW_RCP_LN2
from cula.kernels.sm90.kda_fwd_raw_tiles import RawTiles
from cula.kernels.sm90.kda_fwd_raw_tiles import first_column as raw_first_column

CHUNK = 64
DK = 128
DV = 128
BV = 64  # V tile of the state per CTA: the M of one warpgroup's wgmma (64), two CTAs per head
STAGES = 2  # v1's TMA ring (56 KB a stage: w, qg, Aqk, kgᵀ)
THREADS = 128  # v1: one warpgroup does everything, thread 0 also issues the TMA loads

# Which kernel body KdaFwdRecur builds (read when the object is made; kda_fwd builds one per compile).
# "v2" is the default since 2026-12-03: on the H200 it gave o and the final state bitwise equal to v1's
# at B1/B2 T16384 and B8 T4096 H64 and ran 4.2x faster (B1 T16384: 1.520 -> 0.361 ms, 4.1 TB/s of
# scratch traffic; `kda_fwd_recur --bench`), and the `kda` suite run 20261203-070755-h200-4aa088a-2790
# used it. Its V-first, no-state and zero-length-segment paths have run only on the CPU so far
# (tests/test_kernel_kda_fwd.py -k gpu_recur_v2 is the GPU test to run). v1 stays for A/B runs.
VARIANTS = ("v1", "v2")
RECUR_VARIANT = __import__("os").environ.get("CULA_KDA_RECUR_VARIANT", "v2")  # env: A/B runs on a GPU

# ---- v2
# One CTA per SM either way (v1 ~145 KB): the B1 H64 grid is 128 items for 132 SMs, so the depth goes
# into stages instead; varlen batches have many short items, which the persistent grid chains. A stage is w + qg (2 x 16 KB) + Aqk (8 KB) + kgᵀ (16 KB) + u (8 KB) + γ (512 B)
# = 66,048 B; three of them keep two chunks of loads in flight behind the one being consumed, which
# is what the scratch stream needs at ~4 TB/s (B1 T16384 H64 reads ~1.2 GB of scratch).
#: Timing diagnostics of v2 (``CULA_KDA_RECUR_DIAG``, comma-separated; o and the final state are WRONG with any):
#: ``half_at`` (t_in): the [Aqk | T'] box is read through a view whose rows are 64 elements apart instead of 128,
#: so each chunk's box covers ~8 KB of distinct memory instead of 16 KB (the same 16 KB reach shared memory): what
#: packing Aqk and T' into one 64 x 64 tile would save stage 2 in DRAM traffic (session 29).
RECUR_DIAG_OPTIONS = ("half_at",)
RECUR_DIAG = tuple(x for x in __import__("os").environ.get("CULA_KDA_RECUR_DIAG", "").split(",") if x)
V2_STAGES = int(__import__("os").environ.get("CULA_KDA_RECUR_STAGES", "3"))  # env: A/B runs (2 frees 66 KB)
V2_MATH_THREADS = 128  # warpgroup 0: every wgmma, the element-wise work and the o stores
V2_TMA_WARP = 4  # the fifth warp issues the TMA loads; it holds no accumulators
V2_THREADS = V2_MATH_THREADS + 32  # no setmaxnreg: at 1 CTA/SM 160 threads may use 255 registers each
V2_WARPS = V2_MATH_THREADS // 32
V2_O_ROWS = BV // V2_WARPS  # v rows of the o tile each warp holds in its accumulator (16)
# Row pitch (bf16) of a warp's o staging tile [64 tok, 16 v]: 48 B, an odd number of 16-byte units,
# so 8 consecutive tokens' 16-byte reads hit 8 distinct bank quads and the 2-byte writes of tokens
# 0, 2, 4, 6 land in 4 distinct quads as well (no bank conflicts either way).
V2_O_PITCH = 24
V2_O_TILE = CHUNK * V2_O_PITCH  # elements of one warp's staging tile
V2_O_VECS = CHUNK * V2_O_ROWS // 8 // 32  # 16-byte vectors per lane per chunk (4)
# "u in stage 2" (t_in) needs 8 KB more per stage (3 x 74,240 B): its o staging drops the padding. A warp's
# tile is then [64 tok, 16 v] at a 32-byte pitch (2 KB), the two 16-byte halves of token tt swapped when
# bit 2 of tt is set: the 2-byte writes of tokens 0, 2, 4, 6 (or 1, 3, 5, 7) and the 16-byte reads of 8
# consecutive tokens both land on distinct banks (layout_facts counts them).
V2_O_PITCH_COMPACT = V2_O_ROWS
# (t_in: v_newᵀ = Sᵀ(-w)ᵀ + vᵀ T'ᵀ in one accumulator, Sᵀ(-w)ᵀ issued first since session 30: with pack, the chunk's
# copies of the packed tile are masked while it runs, and vᵀ T'ᵀ follows; the other order, vᵀ T'ᵀ first with the
# next chunk masked during groups 3-4 after a wait for its loads, is at cb69c30 (CULA_KDA_RECUR_ORDER=vt_first):
# measured the same unpacked, stage 2 +1 to +5% packed (kda_fwd_log.md, session 30). Issuing vᵀ T'ᵀ a chunk early,
# while the threads convert Sᵀ to bf16, would hide it, but ptxas then serialises the wgmma pipeline (C7514/C7517:
# the conversions read accumulator registers while a wgmma is in flight).)
#: The math warps, once an item's state is in registers, ask L2 for the state tile of the CTA's next
#: item (32 KB: 2 lines per thread), so that item does not start with a DRAM round trip (varlen
#: batches chain ~20 short items per CTA). ``CULA_KDA_RECUR_H0_PREFETCH=0`` turns it off for A/B runs.
V2_H0_PREFETCH = __import__("os").environ.get("CULA_KDA_RECUR_H0_PREFETCH", "1") == "1"
#: ...for items of at most this many chunks (~0.7 µs each): L2 keeps a line ~10 µs under the stream.
V2_H0_PREFETCH_MAX_CHUNKS = 16
#: Short items (varlen batches): the state moves through one shared-memory buffer instead of 64 scalar
#: global loads and stores per thread on the critical path. The math warps ask for the next item's initial
#: state with ``cp.async`` (16-byte pieces, no registers) as soon as an item starts; at the next item's
#: start each thread swaps its fragment with the buffer (the new initial state in, the finished item's
#: final state out) and the warpgroup copies the buffer out as 16-byte rows. It takes the third TMA
#: stage's 66 KB (two stages), which costs long items more than the buffer saves, so it is used where
#: sequences average at most ``STATE_SMEM_MAX_CHUNKS`` chunks. H200, session 12 (`--split worst / items`,
#: A/B/A/B, both stages): varlen n20 T4096 (4 chunks a sequence) 0.505 -> 0.491 ms (stage 2 0.181 ->
#: 0.168), n20 T8192 (7) 0.838 -> 0.836, n20 T16384 and n10 T8192 (13) +1.7% / +2.1%, n10 T16384 (26)
#: +3%, B2 T16384 +4%. ``CULA_KDA_RECUR_STATE_SMEM=0|1`` overrides the choice for A/B runs.
STATE_SMEM_MAX_CHUNKS = 7
STATE_SMEM_ENV = __import__("os").environ.get("CULA_KDA_RECUR_STATE_SMEM")
STATE_PITCH_KF = BV + 4  # K-first buffer [128 k][64 v] rows: 16-byte aligned, fragment reads conflict-free
STATE_PITCH_VF = DK + 4  # V-first buffer [64 v][128 k] rows
STATE_BUF = max(DK * STATE_PITCH_KF, BV * STATE_PITCH_VF)  # fp32 elements (34,816 B)
STATE_PIECES = BV * DK // 4 // V2_MATH_THREADS  # 16-byte pieces of a state tile per math thread (16)
STATE_BARRIER = 1  # named barrier of the 128 math threads (0 is the CTA's)
V_ZERO_BARRIER = 2  # t_in: the math threads' zeroing of a partial chunk's v rows is done
PACK_BARRIER = 3  # pack: the math threads' masking of a stage's two copies of the packed tile is done
#: How the math threads mask the packed tile's two copies: "rows" (mask_packed_rows, the default since session 44:
#: two passes, the off-diagonal pieces, then row r's diagonal piece by thread r; ~380 -> ~115 instructions a math
#: warp a chunk; H100: stage 2 -3.7% at B2 T16384, -4.4% at B1 T16384, bitwise the unpacked path) or "words"
#: (mask_packed_words, sessions 29-43: each warp's diagonal lanes word by word while the others wait).
#: ``CULA_KDA_PACK_MASK`` sets the 160-thread launch's; the 384-thread ones (pair, raw_in) take WIDE_PACK_MASK
#: whatever it says: the rows mask spills in pair's 232 registers, and raw_in ran its GPU tests with the word mask.
PACK_MASKS = ("rows", "words")
PACK_MASK = __import__("os").environ.get("CULA_KDA_PACK_MASK", "rows")
WIDE_PACK_MASK = "words"


def pack_mask_for(pair: bool, raw_in: bool) -> str:
    """The packed tile's mask a launch takes unless told: WIDE_PACK_MASK for the 384-thread ones, else PACK_MASK."""
    return WIDE_PACK_MASK if pair or raw_in else PACK_MASK


def packed_piece_offset(st, r, p):
    """Element offset of 16-byte piece ``p`` (columns 8p..8p+7) of row ``r`` in stage ``st``'s copy of the packed
    tile: the 128-byte swizzle puts it at 16-byte column p ^ (r % 8) (layout_facts' pack_mask_offset_mismatches)."""
    return st * (CHUNK * CHUNK) + r * CHUNK + (p ^ (r % 8)) * 8

# "pair" (session 43; CULA_KDA_RECUR_PAIR: "0", the default until it has run on a GPU, "1" or "auto"): one CTA per
# (head, sequence) item with two math warpgroups, warpgroup w taking the state's V half w, both reading one copy of
# the stage's -X, qg, [Aqk | T'], kgᵀ and γ (only v differs: both halves land, one slot each). A stage-2 chunk step
# costs a CTA ~2 µs wherever its inputs are (session 42's L2 premise), so stage 2 is bound by one warpgroup's chain
# per SM; two chains per SM interleave their issue and their tensor work, and the shared tiles halve the bytes from
# L2 into the SM. Items halve too, so a grid of fewer items than SMs (B1 H64: 64 pairs) would leave SMs idle: "auto"
# takes pairs only where the V halves outnumber the SMs. 2 x 128 math threads + the TMA warp (warp 8): Hopper
# allocates registers by warpgroup, so the launch is 384 threads' worth at 168 a thread (as raw_in's); setmaxnreg
# gives the math warpgroups 232 and leaves the TMA warpgroup 40 (2 x 232 + 40 = 3 x 168). With the word mask
# (WIDE_PACK_MASK) every state option fits without spills; the rows mask (the split launch's default) does not:
# with a final state ptxas spills the persistent loop's item counter (4 bytes, once an item; session 44's SASS),
# so pair takes the word mask. Two stages (80.7 KB each: v's two halves) and eight warps' o staging fit 227 KB; the
# state buffer does not, so pair is never combined with state_smem. The values are the split launch's bitwise: each
# warpgroup runs the same instructions on the same operands as the CTA of its V half would.
PAIR_MODES = ("0", "1", "auto")
PAIR_ENV = __import__("os").environ.get("CULA_KDA_RECUR_PAIR", "0")
PAIR_MATH_THREADS = 2 * V2_MATH_THREADS
PAIR_TMA_WARP = 8
PAIR_BLOCK = 3 * 128
PAIR_MATH_REGS = 232
PAIR_TMA_REGS = 40
PAIR_STAGES = 2
V_ZERO_BARRIER_WG1 = 4  # pair: warpgroup 1's zeroing of its v rows (warpgroup 0 keeps V_ZERO_BARRIER)

# raw_in: warpgroup 1 (warps 4-7) forms qg, -X and kg in shared memory from q, k and g (kda_fwd_raw_tiles); the TMA
# warp is warp 8, its warpgroup's other three idle. Hopper allocates registers by warpgroup, so 9 warps would launch
# at 168 a thread (384 threads' worth) with the math spilling: setmaxnreg gives the math warpgroup what the default
# has (222) from the TMA warpgroup, and the transform as many: 224 + 224 + 56 = 3 x 168, the launch's pool (a
# setmaxnreg.dec above the launch's count is an illegal instruction: H100, session 39). At 216 the transform
# spilled 4 bytes with the log-space gate once its rows' norms were loaded a chunk ahead (session 40).
RAW_THREADS = 128
RAW_FIRST_THREAD = V2_MATH_THREADS
RAW_TMA_WARP = 8
RAW_BLOCK = 3 * 128
RAW_MATH_REGS = 224
RAW_TRANSFORM_REGS = 224
RAW_TMA_REGS = 56
#: Timing diagnostics of the raw-tile stage 2 (``bench_raw``'s variants; o and the final state are WRONG with any):
#: ``skip`` the transform warps only wait for a stage's loads and pass it on; ``pass1`` they form the factors and
#: exchange the halves' totals but write no tile (kda_fwd_raw_tiles.RawTiles ``diag``).
RAW_DIAGS = ("", "skip", "pass1")
#: pack (session 29): γ's row in floats, γ's DK then T''s diagonal as 64 bf16 (stage 1 writes both)
GAM_PITCH_PACK = DK + CHUNK // 2


def use_pair(num_seqs: int, num_heads_v: int, sms: int) -> bool:
    """Whether ``kda_fwd`` runs stage 2 as pairs (both V halves of an item in one CTA; ``CULA_KDA_RECUR_PAIR``):
    "auto" where the V halves (2 x heads x sequences) outnumber the SMs, "1" always, "0" (the default) never."""
    if PAIR_ENV not in PAIR_MODES:
        raise ValueError(f"CULA_KDA_RECUR_PAIR: expected one of {PAIR_MODES}, got {PAIR_ENV!r}")
    if PAIR_ENV == "auto":
        return (DV // BV) * num_heads_v * num_seqs > sms
    return PAIR_ENV == "1"


def pair_refusal(x_in: bool, raw_in: bool, pack: bool, pack_mask: str, state_smem: bool) -> str | None:
    """Why stage 2 cannot run as pairs with these build options (the constructor raises it; ``kda_fwd`` then keeps
    the split launch), or None."""
    if not x_in:
        return "needs x_in (w in stage 2), got x_in=False"
    if raw_in:
        return "not with raw_in (its transform warpgroup), got raw_in=True"
    if pack and pack_mask != WIDE_PACK_MASK:
        return f"the packed tile with the word mask only (the rows mask spills there), got pack_mask={pack_mask!r}"
    if state_smem:
        return "the state buffer does not fit beside two V halves' stages, got state_smem=True"
    return None


def use_state_smem(num_seqs: int, num_chunks: int, has_state: bool) -> bool:
    """Whether ``kda_fwd`` moves stage 2's state through shared memory: short sequences (on average at most
    ``STATE_SMEM_MAX_CHUNKS`` chunks) with an initial or a final state, unless the environment says."""
    if STATE_SMEM_ENV is not None:
        return STATE_SMEM_ENV == "1" and has_state
    return has_state and num_chunks <= STATE_SMEM_MAX_CHUNKS * max(num_seqs, 1)
#: Programmatic dependent launch: v2 is launched while stage 1 still runs its last wave (stage 1's CTAs
#: signal ``griddepcontrol.launch_dependents`` on entry), so its launch, mbarrier setup and first state
#: loads overlap stage 1's tail; only the TMA warp, the one reader of stage 1's scratch, waits for stage 1
#: to finish (``griddepcontrol.wait``). ``CULA_KDA_PDL=0`` launches the stages back to back for A/B runs.
PDL = __import__("os").environ.get("CULA_KDA_PDL", "1") == "1"
#: ...only where stage 1 has at most this many CTAs (NC x HV). On the H200 (session 9, A/B/A/B splits)
#: the programmatic launch saves 3-11 us on the suite's shortest rows (B1 T512 0.098 -> 0.087 ms, B2
#: T1024 0.214 -> 0.211) but makes the long ones slower, stage 2 by ~16% (B1 T16384 1.428 -> 1.487 ms,
#: B2 T16384 2.858 -> 2.98; B1 T4096, 4,096 CTAs, +1%); session 10's reading is below.
PDL_MAX_STAGE1_CTAS = int(__import__("os").environ.get("CULA_KDA_PDL_MAX_CTAS", "2048"))
#: Where stage 1's CTAs signal: "start" (measured above), "end" (after their work) or "none" (stage 2
#: starts when stage 1 ends, saving only the launch); ``CULA_KDA_PDL_TRIGGER`` for A/B runs. Session 10
#: (cap lifted, all rows): signalling only in the last 528 CTAs lost as much on long rows as "start"
#: (B2 T16384 2.869 / 2.877 ms against 2.721 with PDL off), so the loss is not a per-signal cost but
#: stage 2 being resident during stage 1's last wave; "end" and "none" matched PDL off (2.720 / 2.722).
PDL_TRIGGER = __import__("os").environ.get("CULA_KDA_PDL_TRIGGER", "start")
SMEM_PER_BLOCK = 232448  # H100/H200: the most dynamic shared memory one CTA may have (227 KB)


def _item_coords(item, dims):
    """(V tile, head, sequence) of v2's work item ``item``, ``dims`` = (V tiles, heads, sequences): V tile
    fastest, then head, then sequence."""
    n_vt, n_hv, _ = dims
    return item % n_vt, (item // n_vt) % n_hv, item // (n_vt * n_hv)


def _item_tile(item, dims):
    """(sequence * HV + head, first V index) of v2's work item ``item``: where its state tile starts in the
    [N, HV, ., .] states."""
    # its own expression: through _item_coords the default PTX is not byte-identical to the form validated on
    # the H200 (checked on the CPU)
    n_vt, n_hv, _ = dims
    return (item // (n_vt * n_hv)) * n_hv + (item // n_vt) % n_hv, (item % n_vt) * BV


class KdaFwdRecur:
    """Compile-time configuration of the recurrence kernel."""

    def __init__(self, has_initial_state: bool, output_final_state: bool, state_v_first: bool,
                 variant: str | None = None, h0_prefetch: bool | None = None, pdl: bool | None = None,
                 state_smem: bool = False, t_in: bool = False, diag: tuple = (), pack: bool = False,
                 x_in: bool = False, raw_in: bool = False, gate: str = "sigmoid", pack_mask: str | None = None,
                 pair: bool = False):
        unknown = [d for d in diag if d not in RECUR_DIAG_OPTIONS]
        if unknown:
            raise ValueError(f"diag (CULA_KDA_RECUR_DIAG): expected names from {RECUR_DIAG_OPTIONS}, got {unknown}")
        if "half_at" in diag and not t_in:
            raise ValueError("diag half_at (CULA_KDA_RECUR_DIAG): needs t_in (the [Aqk | T'] rows), got t_in=False")
        self.diag = tuple(diag)
        self.has_h0 = has_initial_state
        self.pdl = PDL if pdl is None else pdl
        self.h0_prefetch = V2_H0_PREFETCH if h0_prefetch is None else h0_prefetch
        self.store_ht = output_final_state
        self.v_first = state_v_first
        variant = RECUR_VARIANT if variant is None else variant
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        # the state through shared memory (v2 only, and only when there is a state to move)
        self.state_smem = bool(state_smem and variant == "v2" and (has_initial_state or output_final_state))
        self.stages = 2 if self.state_smem else V2_STAGES
        # "u in stage 2" (kda_fwd.U_IN_RECUR; stage 1 compiled with t_out): the pAqk rows are [Aqk | T'] (128
        # wide), pW holds -w and pU is the input v [TT, HV, 128]; each chunk starts with v_newᵀ = vᵀ T'ᵀ +
        # Sᵀ(-w)ᵀ in one accumulator, so u never goes through memory (kda_fwd_log.md, session 17)
        if t_in and variant != "v2":
            raise ValueError(f"t_in: expected variant 'v2', got {variant!r}")
        self.t_in = t_in
        # packed [Aqk | T'] (kda_fwd.PACK; stage 1 built with pack): one [64, 64] tile a chunk, Aqk on and below
        # the diagonal, T' transposed above it, T''s diagonal after γ. It is loaded twice, into the Aqk tile (read
        # K-major, as unpacked) and into a T' tile read MN-major (B = the tile's transpose); the math warps zero
        # each copy's other half (and set T''s diagonal) while the chunk's first product, Sᵀ(-w)ᵀ, runs
        # (mask_packed_rows, PACK_MASK's default, or mask_packed_words: pair's, WIDE_PACK_MASK).
        if pack and not t_in:
            raise ValueError("pack (CULA_KDA_PACK): needs t_in (u in stage 2), got t_in=False")
        self.pack = pack
        if pack_mask is None:
            pack_mask = pack_mask_for(pair, raw_in)
        if pack_mask not in PACK_MASKS:
            raise ValueError(f"pack_mask (CULA_KDA_PACK_MASK): expected one of {PACK_MASKS}, got {pack_mask!r}")
        self.pack_mask = pack_mask
        # "w in stage 2" (kda_fwd.W_IN_RECUR; stage 1 built with x_out): pW holds -X = -(k̂ 2^Γ), and each chunk
        # forms Yᵀ = vᵀ + Sᵀ(-X)ᵀ (Sᵀ(-X)ᵀ where Sᵀ(-w)ᵀ was, v added from the v tile), then v_newᵀ = bf16(Yᵀ) T'ᵀ:
        # v_new = T'(v - X S) = u - w S without w, one k64 product more on the chain and vᵀ T'ᵀ's product less
        if x_in and not t_in:
            raise ValueError("x_in (CULA_KDA_W_IN_RECUR): needs t_in (u in stage 2), got t_in=False")
        self.x_in = x_in
        # "raw tiles" (kda_fwd_raw_tiles; stage 1 then stores neither qg, kgᵀ nor -X): the TMA warp loads q, k and g
        # where it loaded qg, -X and kgᵀ, and a transform warpgroup forms qg, -X and kg in place (kg token-major: the
        # state update reads it MN-major; the rows' inverse norms loaded a chunk ahead) before the math warps read
        # the stage. Measured a loss (H100, session 40: stage 2 3.5x slower), so opt-in
        if raw_in and not x_in:
            raise ValueError("raw_in (raw tiles): needs x_in (w in stage 2), got x_in=False")
        if raw_in and variant != "v2":
            raise ValueError(f"raw_in (raw tiles): expected variant 'v2', got {variant!r}")
        if gate not in RAW_GATES:
            raise ValueError(f"gate: expected one of {RAW_GATES}, got {gate!r}")
        self.raw_in, self.gate = raw_in, gate
        # pair (PAIR_ENV): both V halves of a (head, sequence) item in one CTA, one math warpgroup each
        refusal = pair_refusal(x_in, raw_in, pack, pack_mask, self.state_smem) if pair else None
        if refusal:
            raise ValueError(f"pair (CULA_KDA_RECUR_PAIR): {refusal}")
        self.pair = pair
        self.item_vtiles = 1 if pair else DV // BV  # V tiles a work item splits into (pair: one item, both halves)
        if pair:
            self.stages = PAIR_STAGES
        self.math_threads = PAIR_MATH_THREADS if pair else V2_MATH_THREADS
        self.raw_diag = ""  # KdaFwdRecurRaw's timing diagnostics (RAW_DIAGS)
        self.raw_tiles = RawTiles(gate, swizzled=True) if raw_in else None
        self.threads_v2 = RAW_BLOCK if raw_in else (PAIR_BLOCK if pair else V2_THREADS)
        self.tma_warp = RAW_TMA_WARP if raw_in else (PAIR_TMA_WARP if pair else V2_TMA_WARP)
        # the TMA warpgroup's registers after setmaxnreg (None: a 160-thread block, no setmaxnreg)
        self.tma_regs = RAW_TMA_REGS if raw_in else (PAIR_TMA_REGS if pair else None)
        self.gam_pitch = GAM_PITCH_PACK if pack else DK
        self.o_pitch = V2_O_PITCH_COMPACT if t_in else V2_O_PITCH
        self.aqk_cols = 2 * CHUNK if t_in and not pack else CHUNK  # a chunk's Aqk (| T') box
        self.tp_k0 = 0 if pack else CHUNK // 16  # T''s first k block in its B fragment

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
        max_ctas: cutlass.Int32,
        stream,
    ):
        args = (pW, pQG, pAqk, pKGT, pU, pGam, pChunks, pSeq, pO, pH0, pHT,
                total_tokens, num_heads_v, num_chunks, num_seqs, max_ctas, stream)
        if cutlass.const_expr(self.variant == "v1"):
            self.launch_v1(*args)
        else:
            self.launch_v2(*args)

    @cute.jit
    def launch_v1(
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
        max_ctas: cutlass.Int32,
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
        self.load_state(acc_s, cS, mH0, seq, hv, v0)
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
            self.store_state(acc_s, cS, mHT, seq, hv, v0)

    @cute.jit
    def load_state(self, acc_s: cute.Tensor, cS: cute.Tensor, mH0: cute.Tensor, seq, hv, v0):
        """Sᵀ[v, k] of this V tile from the initial state (either layout) into the accumulator; zeros
        without one."""
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = cS[i]
            h = cutlass.Float32(0.0)
            if cutlass.const_expr(self.has_h0):
                if cutlass.const_expr(self.v_first):
                    h = mH0[seq, hv, v0 + vv, kk]
                else:
                    h = mH0[seq, hv, kk, v0 + vv]
            acc_s[i] = h

    @cute.jit
    def store_state(self, acc_s: cute.Tensor, cS: cute.Tensor, mHT: cute.Tensor, seq, hv, v0):
        """The accumulator Sᵀ[v, k] to the final state (either layout)."""
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


    # ====================================================================================== v2 ==
    def _setup_v2(self):
        """v2's MMA atoms (A from registers) and smem layouts (needs the DSL's IR context)."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        kmaj = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        rmem = warpgroup.OperandSource.RMEM
        # A = Sᵀ or v_newᵀ straight from the registers that hold their bf16 copies
        self.mma_rs_n64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, f32, (1, 1, 1), (BV, CHUNK), rmem)
        # raw_in: kg [64 tok, 128 k] stays token-major, the B operand (N = k, K = tok) read MN-major
        kg_major = utils.LayoutEnum.COL_MAJOR.sm90_mma_major_mode() if self.raw_in else kmaj
        self.mma_rs_n128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kg_major, f32, (1, 1, 1), (BV, DK),
                                                             rmem)
        row = utils.LayoutEnum.ROW_MAJOR
        S = self.stages
        self.w2_layout = sm90_utils.make_smem_layout_b(row, (BV, CHUNK, DK), bf16, S)  # w, qg [64 tok, 128 k]
        # Aqk [64 tok, 64 tok] and u [64 tok, 64 v]: the same 128-byte-swizzled 64x64 tile. The swizzle
        # also makes the element reads of u conflict-free: the tokens 0, 2, 4, 6 a warp reads at one
        # v sit in different 16-byte columns.
        self.t64_layout = sm90_utils.make_smem_layout_b(row, (BV, CHUNK, CHUNK), bf16, S)
        self.kgt2_layout = sm90_utils.make_smem_layout_b(row, (BV, DK, CHUNK), bf16, S)  # [128 k, 64 tok]
        if self.raw_in:  # g (then kg) as (k, tok): k contiguous
            self.kgt2_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, (BV, DK, CHUNK), bf16, S)
        gp = self.gam_pitch  # pack: T''s diagonal after γ
        self.gam_layout = cute.make_layout((gp, 1, S), stride=(1, gp, gp))  # γ [128] (| T''s diagonal) per stage
        # t_in: [Aqk | T'] rows in one [64 tok, 128] tile (two t64 tiles back to back: layout_facts), and
        # v [64 tok, 64 v] as the A operand vᵀ (M = v contiguous, i.e. MN-major) of an SS product
        self.aqk2_layout = self.w2_layout if self.t_in and not self.pack else self.t64_layout
        col = utils.LayoutEnum.COL_MAJOR
        # pack: T' as the B operand of vᵀ T'ᵀ read MN-major from a copy of the packed tile, whose T' half is the
        # transpose (the same bytes as a K-major t64 tile: layout_facts)
        self.tp_layout = sm90_utils.make_smem_layout_b(col, (BV, CHUNK, CHUNK), bf16, S) if self.pack else None
        # pair: v's two halves a stage, stage st's half w in slot 2 st + w
        self.va_layout = (sm90_utils.make_smem_layout_a(col, (BV, CHUNK, CHUNK), bf16, 2 * S if self.pair else S)
                          if self.t_in else self.t64_layout)

    @cute.jit
    def launch_v2(
        self,
        pW: cute.Pointer,
        pQG: cute.Pointer,
        pAqk: cute.Pointer,
        pKGT: cute.Pointer,
        pU: cute.Pointer,
        pGam: cute.Pointer,
        pChunks: cute.Pointer,
        pSeq: cute.Pointer,
        pO: cute.Pointer,
        pH0: cute.Pointer,
        pHT: cute.Pointer,
        total_tokens: cutlass.Int32,
        num_heads_v: cutlass.Int32,
        num_chunks: cutlass.Int32,
        num_seqs: cutlass.Int32,
        max_ctas: cutlass.Int32,
        stream,
        raw=None,  # raw_in: (pNrm, pAlog, pDtb, lower_bound, group); pW, pQG, pKGT are then k, q and g
    ):
        TT, HV, NC, N = total_tokens, num_heads_v, num_chunks, num_seqs
        R = NC * CHUNK
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        # TMA views with the head last, as v1; u as (row, v, head) so a box is this CTA's V half of
        # a chunk, γ as (k, chunk, head) so a box is one chunk's 128 floats
        mNrm = mAlog = mDtb = lower_bound = group = None
        if cutlass.const_expr(self.raw_in):
            # k, q as (token, k, q/k head), g as (k, token, head): boxes at any first token (the g box is kg's
            # MN-major tile); the inverse norms as (row, q's | k's, chunk, head), read by the transform threads
            pNrm, pAlog, pDtb, lower_bound, group = raw
            H = HV // group
            mW = cute.make_tensor(pW, cute.make_layout((TT, DK, H), stride=(H * DK, 1, DK)))
            mQG = cute.make_tensor(pQG, cute.make_layout((TT, DK, H), stride=(H * DK, 1, DK)))
            mKGT = cute.make_tensor(pKGT, cute.make_layout((DK, TT, HV), stride=(1, HV * DK, DK)))
            mNrm = cute.make_tensor(pNrm, cute.make_layout((CHUNK, 2, NC, HV), stride=(1, CHUNK, 2 * CHUNK,
                                                                                       NC * 2 * CHUNK)))
            mAlog = cute.make_tensor(pAlog, cute.make_layout(HV))
            mDtb = cute.make_tensor(pDtb, cute.make_layout((HV, DK), stride=(DK, 1)))
        else:
            mW = cute.make_tensor(pW, cute.make_layout((R, DK, HV), stride=(DK, 1, R * DK)))
            mQG = cute.make_tensor(pQG, cute.make_layout((R, DK, HV), stride=(DK, 1, R * DK)))
            mKGT = cute.make_tensor(pKGT, cute.make_layout((DK, R, HV), stride=(R, 1, DK * R)))
        gp = self.gam_pitch
        mGam = cute.make_tensor(pGam, cute.make_layout((gp, NC, HV), stride=(1, gp, NC * gp)))
        self._setup_v2()
        tma_tp = tTp = None
        if cutlass.const_expr(self.pack):
            # the packed tile as Aqk rows (token i, token j) and, for the T' copy, as (j, i): T'[i, j] = P[j, i]
            mAqk = cute.make_tensor(pAqk, cute.make_layout((R, CHUNK, HV), stride=(CHUNK, 1, R * CHUNK)))
            mTp = cute.make_tensor(pAqk, cute.make_layout((CHUNK, R, HV), stride=(1, CHUNK, R * CHUNK)))
            mU = cute.make_tensor(pU, cute.make_layout((DV, TT, HV), stride=(1, HV * DV, DV)))
        elif cutlass.const_expr(self.t_in):
            # [Aqk | T'] rows; v as (v, token, head): a box is vᵀ of the CTA's V half, at any first token
            row_pitch = CHUNK if cutlass.const_expr("half_at" in self.diag) else 2 * CHUNK  # half_at: rows overlap
            mAqk = cute.make_tensor(pAqk, cute.make_layout((R, 2 * CHUNK, HV), stride=(row_pitch, 1, R * 2 * CHUNK)))
            mU = cute.make_tensor(pU, cute.make_layout((DV, TT, HV), stride=(1, HV * DV, DV)))
        else:
            mAqk = cute.make_tensor(pAqk, cute.make_layout((R, CHUNK, HV), stride=(CHUNK, 1, R * CHUNK)))
            mU = cute.make_tensor(pU, cute.make_layout((R, DV, HV), stride=(DV, 1, R * DV)))
        mChunks = cute.make_tensor(pChunks, cute.make_layout((NC, 2), stride=(2, 1)))
        mSeq = cute.make_tensor(pSeq, cute.make_layout((N, 2), stride=(2, 1)))
        mO = cute.make_tensor(pO, cute.make_layout((TT, HV, DV), stride=(HV * DV, DV, 1)))
        state = cute.make_layout((N, HV, DK, DV), stride=(HV * DK * DV, DK * DV, DV, 1))
        mH0 = cute.make_tensor(pH0, state)
        mHT = cute.make_tensor(pHT, state)
        w_one = cute.slice_(self.w2_layout, (None, None, 0))
        t64_one = cute.slice_(self.t64_layout, (None, None, 0))
        kgt_one = cute.slice_(self.kgt2_layout, (None, None, 0))
        gam_one = cute.slice_(self.gam_layout, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mW, w_one, (CHUNK, DK))
        tma_qg, tQG = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQG, w_one, (CHUNK, DK))
        tma_kgt, tKGT = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKGT, kgt_one, (DK, CHUNK))
        tma_gam, tGam = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mGam, gam_one, (gp, 1))
        if cutlass.const_expr(self.pack):
            va_one = cute.slice_(self.va_layout, (None, None, 0))
            tp_one = cute.slice_(self.tp_layout, (None, None, 0))
            tma_aqk, tAqk = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mAqk, t64_one, (CHUNK, CHUNK))
            tma_tp, tTp = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mTp, tp_one, (CHUNK, CHUNK))
            tma_u, tU = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mU, va_one, (BV, CHUNK))
            aqk_bytes = cute.size_in_bytes(bf16, t64_one) + cute.size_in_bytes(bf16, tp_one)
            u_bytes = cute.size_in_bytes(bf16, va_one)
        elif cutlass.const_expr(self.t_in):
            va_one = cute.slice_(self.va_layout, (None, None, 0))
            tma_aqk, tAqk = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mAqk, w_one, (CHUNK, 2 * CHUNK))
            tma_u, tU = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mU, va_one, (BV, CHUNK))
            aqk_bytes, u_bytes = cute.size_in_bytes(bf16, w_one), cute.size_in_bytes(bf16, va_one)
        else:
            tma_aqk, tAqk = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mAqk, t64_one, (CHUNK, CHUNK))
            tma_u, tU = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mU, t64_one, (CHUNK, BV))
            aqk_bytes = u_bytes = cute.size_in_bytes(bf16, t64_one)
        if cutlass.const_expr(self.pair):
            u_bytes = 2 * u_bytes  # both V halves
        self.tx_bytes_v2 = (
            2 * cute.size_in_bytes(bf16, w_one)
            + aqk_bytes + u_bytes
            + cute.size_in_bytes(bf16, kgt_one)
            + cute.size_in_bytes(f32, gam_one)
        )

        SharedStorageV2 = self.storage_class_v2(mO.element_type)
        self.shared_storage_v2 = SharedStorageV2
        assert SharedStorageV2.size_in_bytes() <= SMEM_PER_BLOCK, "v2's stages do not fit one CTA"
        self.kernel_v2(
            tma_w, tW, tma_qg, tQG, tma_aqk, tAqk, tma_kgt, tKGT, tma_u, tU, tma_gam, tGam,
            mChunks, mSeq, mO, mH0, mHT, self.mma_rs_n64, self.mma_rs_n128,
            self.w2_layout, self.t64_layout, self.kgt2_layout, self.gam_layout, self.aqk2_layout, self.va_layout,
            tma_tp, tTp, self.tp_layout, mNrm, mAlog, mDtb, lower_bound, group,
        ).launch(grid=[cutlass.min(self.item_vtiles * HV * N, max_ctas), 1, 1],
                 block=[self.threads_v2, 1, 1],
                 smem=SharedStorageV2.size_in_bytes(), stream=stream, use_pdl=self.pdl)

    def storage_class_v2(self, o_dtype):
        """v2's shared memory: the stages' tiles, γ, the o staging and the state buffer (a plain method: the jit's
        rewriting of ``if`` would reach into a class body)."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        mem, align = cute.struct.MemRange, cute.struct.Align
        members = {  # (built as a dict: this module's annotations are strings, which cute.struct does not read)
            "bars": mem[cutlass.Int64, self.stages * 2],
            # raw_in: the transform's pipeline, in the 1 KB before the first swizzled tile (the default fills it
            # to 227 KB: nothing else fits)
            "tbars": mem[cutlass.Int64, self.stages * 2 if self.raw_in else 1],
            "sW": align[mem[bf16, cute.cosize(self.w2_layout)], 1024],
            "sQG": align[mem[bf16, cute.cosize(self.w2_layout)], 1024],
            "sAqk": align[mem[bf16, cute.cosize(self.aqk2_layout)], 1024],
            "sKGT": align[mem[bf16, cute.cosize(self.kgt2_layout)], 1024],
            "sU": align[mem[bf16, cute.cosize(self.va_layout)], 1024],
        }
        if self.pack:  # T''s copy of the packed tile
            members["sTp"] = align[mem[bf16, cute.cosize(self.tp_layout)], 1024]
        members.update({
            "sGam": align[mem[f32, cute.cosize(self.gam_layout)], 128],
            "sO": align[mem[o_dtype, self.math_threads // 32 * CHUNK * self.o_pitch], 128],
            "sH": align[mem[f32, STATE_BUF if self.state_smem else 4], 128],
        })

        return cute.struct(type("SharedStorageV2", (), {"__annotations__": members}))

    @cute.kernel
    def kernel_v2(
        self,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_qg: cute.CopyAtom,
        tQG: cute.Tensor,
        tma_aqk: cute.CopyAtom,
        tAqk: cute.Tensor,
        tma_kgt: cute.CopyAtom,
        tKGT: cute.Tensor,
        tma_u: cute.CopyAtom,
        tU: cute.Tensor,
        tma_gam: cute.CopyAtom,
        tGam: cute.Tensor,
        mChunks: cute.Tensor,
        mSeq: cute.Tensor,
        mO: cute.Tensor,
        mH0: cute.Tensor,
        mHT: cute.Tensor,
        mma_n64: cute.TiledMma,
        mma_n128: cute.TiledMma,
        w_layout: cute.ComposedLayout,
        t64_layout: cute.ComposedLayout,
        kgt_layout: cute.ComposedLayout,
        gam_layout: cute.Layout,
        aqk_layout: cute.ComposedLayout,
        u_layout: cute.ComposedLayout,
        tma_tp,  # pack: the T' copy's atom, tensor and smem layout (None otherwise)
        tTp,
        tp_layout,
        mNrm,  # raw_in: [HV, NC, 2, 64] fp32 the rows' inverse norms, and the gate's inputs (None otherwise); tma_w,
        # tma_qg and tma_kgt then load k, q (head hv // group, at the chunk's first token) and g (head hv)
        mAlog,  # [HV] fp32: A_log
        mDtb,  # [HV, 128] fp32: dt_bias (zeros when absent)
        lower_bound,  # fp32 (the gate's bound, or the softplus gate's floor)
        group,  # Int32: value heads per q/k head
    ):
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        # Persistent: CTA b takes the work items b, b + grid, ... in order, item = (vtile, head, seq)
        # with the V tile fastest, so the two V halves of a head stay side by side on neighbouring CTAs
        # (their shared w, qg, Aqk, kgᵀ, γ loads meet in L2). The TMA ring runs on across items: the
        # next item's first chunks load while this one finishes (a fresh CTA per item paid the ring's
        # fill, the launch and the drain each time, ~2.8 µs an item at varlen n20 T8192).
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        n_vt = self.item_vtiles
        n_hv = mO.shape[1]
        n_items = n_vt * n_hv * mSeq.shape[0]
        dims = (n_vt, n_hv, mSeq.shape[0])
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage_v2)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.math_threads // 32),
            tx_count=self.tx_bytes_v2,
            defer_sync=True,
        )
        tpipe = q_raw = k_raw = g_raw = qk_tile = g_tile = None
        if cutlass.const_expr(self.raw_in):
            # the transform's view of a stage: the tiles' unswizzled starts and (token, key) layouts
            q_raw, k_raw, g_raw = storage.sQG.data_ptr(), storage.sW.data_ptr(), storage.sKGT.data_ptr()
            qk_tile = cute.slice_(w_layout.outer, (None, None, 0))
            g_tile = cute.select(cute.slice_(kgt_layout.outer, (None, None, 0)), mode=[1, 0])
            # the transform warpgroup's tiles: each of its threads arrives once a stage's three tiles are formed,
            # each math thread once the stage is consumed
            tpipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.tbars.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, RAW_THREADS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, V2_MATH_THREADS),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()  # the CTA's only full barrier: the mbarriers are initialised
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        sQG = storage.sQG.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        sAqk = storage.sAqk.get_tensor(aqk_layout.outer, swizzle=aqk_layout.inner)  # t_in: (tok, Aqk | T', stage)
        sKGT = storage.sKGT.get_tensor(kgt_layout.outer, swizzle=kgt_layout.inner)
        sU = storage.sU.get_tensor(u_layout.outer, swizzle=u_layout.inner)  # (tok, v, stage); t_in: (v, tok, stage)
        # (v, tok, stage) view of the same bytes: partitioned like the v_newᵀ accumulator
        sU_vt = storage.sU.get_tensor(cute.select(u_layout.outer, mode=[1, 0, 2]), swizzle=u_layout.inner)
        sGam = storage.sGam.get_tensor(gam_layout)  # (k, 1, stage)
        # this warp's o staging tile [64 tok, 16 v] (a warp's accumulator rows are 16 v of the 64)
        sO_w = storage.sO.data_ptr() + warp_idx * (CHUNK * self.o_pitch)
        sH = storage.sH.get_tensor(cute.make_layout(STATE_BUF if self.state_smem else 4))  # the state buffer
        u_raw = storage.sU.data_ptr()  # the u / v tiles' unswizzled start
        sTp = tp_raw = aqk_raw = gam_bf16 = None
        if cutlass.const_expr(self.pack):
            sTp = storage.sTp.get_tensor(tp_layout.outer, swizzle=tp_layout.inner)  # (i, j, stage): T'
            tp_raw, aqk_raw = storage.sTp.data_ptr(), storage.sAqk.data_ptr()  # the copies' unswizzled starts
            gam_bf16 = cute.recast_ptr(storage.sGam.data_ptr(), dtype=bf16)  # T''s diagonal: after γ in its row

        if warp_idx == self.tma_warp:
            # ============ TMA warp: each stage is refilled as soon as the math warps release it
            if cutlass.const_expr(self.tma_regs is not None):
                cute.arch.warpgroup_reg_dealloc(self.tma_regs)
            for atom in (tma_w, tma_qg, tma_aqk, tma_kgt, tma_u, tma_gam):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.pack):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_tp)
            if cutlass.const_expr(self.pdl):
                # stage 1's scratch is complete and visible past this point. The math warps read only
                # the initial state, the chunk tables (both written before stage 1 started) and what
                # this warp's copies deliver, and write o / the final state, which stage 1 never touches.
                cute.arch.griddepcontrol_wait()
            one = cute.make_layout(1)
            part = cute.nvgpu.cpasync.tma_partition
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for item in cutlass.range(cta, n_items, n_ctas, unroll=1):
                vtile, hv, seq = _item_coords(item, dims)
                c_first = mSeq[seq, 0]
                n_chunks = mSeq[seq, 1]
                gW = cute.local_tile(tW[None, None, hv], (CHUNK, DK), (None, 0))
                gQG = cute.local_tile(tQG[None, None, hv], (CHUNK, DK), (None, 0))
                gAqk = cute.local_tile(tAqk[None, None, hv], (CHUNK, self.aqk_cols), (None, 0))
                gKGT = cute.local_tile(tKGT[None, None, hv], (DK, CHUNK), (0, None))
                gU = tU  # t_in: tiled per chunk below (a chunk starts at any token)
                if cutlass.const_expr(not self.t_in):
                    gU = cute.local_tile(tU[None, None, hv], (CHUNK, BV), (None, vtile))
                gG = cute.local_tile(tGam[None, None, hv], (self.gam_pitch, 1), (0, None))
                tWs, tWg = part(tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                tQs, tQg = part(tma_qg, 0, one, cute.group_modes(sQG, 0, 2), cute.group_modes(gQG, 0, 2))
                tAs, tAg = part(tma_aqk, 0, one, cute.group_modes(sAqk, 0, 2), cute.group_modes(gAqk, 0, 2))
                tKs, tKg = part(tma_kgt, 0, one, cute.group_modes(sKGT, 0, 2), cute.group_modes(gKGT, 0, 2))
                tUs, tUg = sU, gU
                if cutlass.const_expr(not self.t_in):
                    tUs, tUg = part(tma_u, 0, one, cute.group_modes(sU, 0, 2), cute.group_modes(gU, 0, 2))
                tGs, tGg = part(tma_gam, 0, one, cute.group_modes(sGam, 0, 2), cute.group_modes(gG, 0, 2))
                tPs = tPg = None
                if cutlass.const_expr(self.pack):
                    gTp = cute.local_tile(tTp[None, None, hv], (CHUNK, CHUNK), (0, None))
                    tPs, tPg = part(tma_tp, 0, one, cute.group_modes(sTp, 0, 2), cute.group_modes(gTp, 0, 2))
                h = hv
                if cutlass.const_expr(self.raw_in):
                    h = hv // group
                for ci in cutlass.range(n_chunks, unroll=1):
                    c = c_first + ci
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    st = prod.index
                    if cutlass.const_expr(self.raw_in):
                        # k, q (head h) and g (head hv) of the chunk's 64 tokens from its first one (rows past the
                        # sequence's end: the next one's tokens, or zeros past the tensor; the transform zeroes them)
                        tok0 = mChunks[c, 0]
                        gKr = cute.local_tile(cute.domain_offset((tok0, 0), tW[None, None, h]), (CHUNK, DK), (None, 0))
                        gQr = cute.local_tile(cute.domain_offset((tok0, 0), tQG[None, None, h]), (CHUNK, DK),
                                             (None, 0))
                        gGr = cute.local_tile(cute.domain_offset((0, tok0), tKGT[None, None, hv]), (DK, CHUNK),
                                             (0, None))
                        tKs2, tKg2 = part(tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gKr, 0, 2))
                        tQs2, tQg2 = part(tma_qg, 0, one, cute.group_modes(sQG, 0, 2), cute.group_modes(gQr, 0, 2))
                        tGs2, tGg2 = part(tma_kgt, 0, one, cute.group_modes(sKGT, 0, 2), cute.group_modes(gGr, 0, 2))
                        cute.copy(tma_w, tKg2[None, 0], tKs2[None, st], tma_bar_ptr=bar)
                        cute.copy(tma_qg, tQg2[None, 0], tQs2[None, st], tma_bar_ptr=bar)
                        cute.copy(tma_kgt, tGg2[None, 0], tGs2[None, st], tma_bar_ptr=bar)
                    else:
                        cute.copy(tma_w, tWg[None, c], tWs[None, st], tma_bar_ptr=bar)
                        cute.copy(tma_qg, tQg[None, c], tQs[None, st], tma_bar_ptr=bar)
                    if cutlass.const_expr(self.t_in):
                        # vᵀ of the chunk's 64 tokens (rows past the sequence's end are the next one's
                        # tokens, or zeros past the tensor: the math warps zero them before use)
                        if cutlass.const_expr(self.pair):  # both halves, half h into slot 2 st + h
                            for h2 in cutlass.range_constexpr(DV // BV):
                                gV = cute.local_tile(cute.domain_offset((0, mChunks[c, 0]), tU[None, None, hv]),
                                                     (BV, CHUNK), (h2, None))
                                tVs, tVg = part(tma_u, 0, one, cute.group_modes(sU, 0, 2),
                                                cute.group_modes(gV, 0, 2))
                                cute.copy(tma_u, tVg[None, 0], tVs[None, 2 * st + h2], tma_bar_ptr=bar)
                        else:
                            gV = cute.local_tile(cute.domain_offset((0, mChunks[c, 0]), tU[None, None, hv]),
                                                 (BV, CHUNK), (vtile, None))
                            tVs, tVg = part(tma_u, 0, one, cute.group_modes(sU, 0, 2), cute.group_modes(gV, 0, 2))
                            cute.copy(tma_u, tVg[None, 0], tVs[None, st], tma_bar_ptr=bar)
                    else:
                        cute.copy(tma_u, tUg[None, c], tUs[None, st], tma_bar_ptr=bar)
                    cute.copy(tma_gam, tGg[None, c], tGs[None, st], tma_bar_ptr=bar)
                    if cutlass.const_expr(not self.raw_in):
                        cute.copy(tma_kgt, tKg[None, c], tKs[None, st], tma_bar_ptr=bar)
                    cute.copy(tma_aqk, tAg[None, c], tAs[None, st], tma_bar_ptr=bar)
                    if cutlass.const_expr(self.pack):
                        cute.copy(tma_tp, tPg[None, c], tPs[None, st], tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()
        else:
            if cutlass.const_expr(self.raw_in):
                if warp_idx > self.tma_warp:
                    cute.arch.warpgroup_reg_dealloc(self.tma_regs)  # the TMA warpgroup's idle warps
                elif warp_idx >= V2_WARPS:
                    cute.arch.warpgroup_reg_alloc(RAW_TRANSFORM_REGS)  # (above the launch's 168: an increase)
                    self.transform_v2(tidx - RAW_FIRST_THREAD, cta, n_ctas, n_items, dims, pipe, tpipe, mChunks, mSeq,
                                      q_raw, k_raw, g_raw, qk_tile, g_tile, mNrm, mAlog, mDtb, lower_bound)
                else:
                    cute.arch.warpgroup_reg_alloc(RAW_MATH_REGS)
                    self.math_v2(tidx, warp_idx, cta, n_ctas, n_items, dims, pipe, tpipe, mma_n64, mma_n128, mChunks,
                                 mSeq, mO, mH0, mHT, sW, sQG, sAqk, sKGT, sU, sU_vt, sGam, sO_w, sH, u_raw, sTp, tp_raw,
                                 aqk_raw, gam_bf16)
            elif cutlass.const_expr(self.pair):
                if warp_idx > self.tma_warp:
                    cute.arch.warpgroup_reg_dealloc(self.tma_regs)  # the TMA warpgroup's idle warps
                else:
                    cute.arch.warpgroup_reg_alloc(PAIR_MATH_REGS)
                    self.math_v2(tidx % V2_MATH_THREADS, warp_idx, cta, n_ctas, n_items, dims, pipe, tpipe, mma_n64,
                                 mma_n128, mChunks, mSeq, mO, mH0, mHT, sW, sQG, sAqk, sKGT, sU, sU_vt, sGam, sO_w, sH,
                                 u_raw, sTp, tp_raw, aqk_raw, gam_bf16, wg=warp_idx // V2_WARPS)
            else:
                self.math_v2(tidx, warp_idx, cta, n_ctas, n_items, dims, pipe, tpipe, mma_n64, mma_n128, mChunks, mSeq,
                             mO, mH0, mHT, sW, sQG, sAqk, sKGT, sU, sU_vt, sGam, sO_w, sH, u_raw, sTp, tp_raw, aqk_raw,
                             gam_bf16)

    @cute.jit
    def transform_v2(self, ttid, cta, n_ctas, n_items, dims, pipe, tpipe, mChunks: cute.Tensor, mSeq: cute.Tensor,
                     q_raw: cute.Pointer, k_raw: cute.Pointer, g_raw: cute.Pointer, qk_tile: cute.Layout,
                     g_tile: cute.Layout, mNrm: cute.Tensor, mAlog: cute.Tensor, mDtb: cute.Tensor, lower_bound):
        """raw_in, warps 4-7 (``ttid`` 0-127): for each chunk the TMA warp loads, once its loads land, form qg, -X and
        kg in place (kda_fwd_raw_tiles.RawTiles; the rows' inverse norms loaded from global memory a chunk ahead,
        two rows a lane), then a fence for the async proxy (wgmma reads them) and an arrive for the math warps.
        Walks the CTA's items and chunks in the TMA warp's order."""
        f32 = cutlass.Float32
        tile_elems = CHUNK * DK  # a stage's tile (16 KB: whole swizzle periods)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        c0 = raw_first_column(ttid)
        dtb = cute.make_rmem_tensor(cute.make_layout(RAW_PAIR), f32)
        nrm = cute.make_rmem_tensor(cute.make_layout(4), f32)  # this chunk's rows' norms (RawTiles.lane_norms)
        nxt = cute.make_rmem_tensor(cute.make_layout(4), f32)  # the next chunk's, loading meanwhile
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the norms are stage 1's output (once it writes them)
        lb_log2 = lower_bound * f32(RAW_RCP_LN2)
        for item in cutlass.range(cta, n_items, n_ctas, unroll=1):
            vtile, hv, seq = _item_coords(item, dims)
            c_first = mSeq[seq, 0]
            n_chunks = mSeq[seq, 1]
            a_exp = f32(0.0)
            if cutlass.const_expr(self.gate != "log"):  # (the log-space gate has no A)
                a_exp = cute.math.exp(mAlog[hv])
            for j in cutlass.range_constexpr(RAW_PAIR):
                dtb[j] = mDtb[hv, c0 + j]
                if cutlass.const_expr(self.gate == "softplus"):  # (its dt_bias in log2 units, as stage 1's)
                    dtb[j] = dtb[j] * f32(RAW_LOG2E)
            if n_chunks > 0:
                self.raw_tiles.lane_norms(mNrm[None, 0, c_first, hv], mNrm[None, 1, c_first, hv], ttid, nxt)
            for ci in cutlass.range(n_chunks, unroll=1):
                c = c_first + ci
                for j in cutlass.range_constexpr(4):
                    nrm[j] = nxt[j]
                if ci + 1 < n_chunks:
                    self.raw_tiles.lane_norms(mNrm[None, 0, c + 1, hv], mNrm[None, 1, c + 1, hv], ttid, nxt)
                pipe.consumer_wait(cons)
                tpipe.producer_acquire(prod)
                st = cons.index
                if cutlass.const_expr(self.raw_diag != "skip"):
                    self.raw_tiles.chunk(q_raw + st * tile_elems, k_raw + st * tile_elems, g_raw + st * tile_elems,
                                         qk_tile, g_tile, nrm, dtb, mChunks[c, 1], a_exp * f32(-RAW_RCP_LN2), -a_exp,
                                         lb_log2, ttid)
                cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
                tpipe.producer_commit(prod)
                cons.advance()
                prod.advance()

    @cute.jit
    def math_v2(self, tidx, warp_idx, cta, n_ctas, n_items, dims, pipe, tpipe, mma_n64: cute.TiledMma,
                mma_n128: cute.TiledMma, mChunks: cute.Tensor, mSeq: cute.Tensor, mO: cute.Tensor, mH0: cute.Tensor,
                mHT: cute.Tensor, sW, sQG, sAqk, sKGT, sU, sU_vt, sGam, sO_w, sH, u_raw, sTp, tp_raw, aqk_raw,
                gam_bf16, wg=0):
        """v2's math warpgroup (warps 0-3): every wgmma, the element-wise work and the o stores. raw_in: it waits for
        the transform warpgroup's tiles (``tpipe``) as well as for the loads, and releases both. pair: warpgroup
        ``wg`` (``tidx`` its own thread index, 0-127) of two, the item's V half ``wg``."""
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        # ============ math warpgroup
        thr64 = mma_n64.get_slice(tidx)
        thr128 = mma_n128.get_slice(tidx)
        rB_w = mma_n64.make_fragment_B(thr64.partition_B(sW))
        rB_qg = mma_n64.make_fragment_B(thr64.partition_B(sQG))
        rB_aqk = mma_n64.make_fragment_B(thr64.partition_B(sAqk))  # t_in: k blocks 0-3 Aqk, 4-7 T'
        rA_v = rB_tp = None
        if cutlass.const_expr(self.t_in):
            mma_t = self.make_mma_t()  # vᵀ T'ᵀ's (x_in: Yᵀ T'ᵀ's) operand partitions
            thr_t = mma_t.get_slice(tidx)
            tp_src = sAqk  # k blocks 4-7: T'
            if cutlass.const_expr(self.pack):
                tp_src = sTp  # its own tile (k blocks 0-3), MN-major
            rB_tp = mma_t.make_fragment_B(thr_t.partition_B(tp_src))
            if cutlass.const_expr(not self.x_in):
                rA_v = mma_t.make_fragment_A(thr_t.partition_A(sU))  # vᵀ
        rB_kgt = mma_n128.make_fragment_B(thr128.partition_B(sKGT))
        acc_s = thr128.make_fragment_C(thr128.partition_shape_C((BV, DK)))
        acc_vt = thr64.make_fragment_C(thr64.partition_shape_C((BV, CHUNK)))
        acc_ot = thr64.make_fragment_C(thr64.partition_shape_C((BV, CHUNK)))
        # bf16 Sᵀ and v_newᵀ: written through their C-fragment view, read by wgmma as A fragments
        rS = cute.make_rmem_tensor(a_operand_layout(acc_s.layout), bf16)
        rS_c = cute.make_tensor(rS.iterator, acc_s.layout)
        rV = cute.make_rmem_tensor(a_operand_layout(acc_vt.layout), bf16)
        rV_c = cute.make_tensor(rV.iterator, acc_vt.layout)
        rU = cute.make_rmem_tensor(acc_vt.layout, bf16)
        rO = cute.make_rmem_tensor(acc_ot.layout, mO.element_type)
        u_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16)
        cS = thr128.partition_C(cute.make_identity_tensor((BV, DK)))  # (v, k)
        cN = thr64.partition_C(cute.make_identity_tensor((BV, CHUNK)))  # (v, tok)
        tOs = cute.make_tensor(sO_w, cute.make_layout((CHUNK, V2_O_ROWS), stride=(self.o_pitch, 1)))
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        owarp = warp_idx  # the warp's 16 rows of the V half
        if cutlass.const_expr(self.pair):
            owarp = warp_idx % V2_WARPS
        if cutlass.const_expr(self.state_smem):
            acc_s.fill(0.0)  # what the first swap parks in the buffer (never copied out)
            if cutlass.const_expr(self.has_h0):
                self.state_in_async(mH0, sH, cta, dims, tidx)  # the grid has at most n_items CTAs
        for item in cutlass.range(cta, n_items, n_ctas, unroll=1):
            vtile, hv, seq = _item_coords(item, dims)
            v0 = vtile * BV
            if cutlass.const_expr(self.pair):
                v0 = wg * BV
            c_first = mSeq[seq, 0]
            n_chunks = mSeq[seq, 1]
            # ---- initial state (either layout), as Sᵀ[v, k]
            if cutlass.const_expr(self.state_smem):
                self.state_swap(acc_s, cS, sH, mH0, mHT, item, cta, n_ctas, n_items, dims, tidx)
            else:
                self.load_state(acc_s, cS, mH0, seq, hv, v0)
            rS_c.store(acc_s.load().to(bf16))
            if cutlass.const_expr(self.has_h0 and self.h0_prefetch and not self.state_smem):
                # only when the next item starts soon: a line asked for a long item earlier is
                # evicted by the scratch stream before it is read (B2 T16384: stage 2 4% slower)
                if n_chunks <= V2_H0_PREFETCH_MAX_CHUNKS and item + n_ctas < n_items:
                    self.prefetch_next_state(mH0, item + n_ctas, dims, tidx, wg)

            # tokens of this sequence: its chunks are consecutive, [bos, seq_end)
            bos = cutlass.Int32(0)
            seq_end = cutlass.Int32(0)
            if n_chunks > 0:
                last = c_first + n_chunks - 1
                bos = mChunks[c_first, 0]
                seq_end = mChunks[last, 0] + mChunks[last, 1]

            for ci in cutlass.range(n_chunks, unroll=1):
                pipe.consumer_wait(cons)
                if cutlass.const_expr(self.raw_in):
                    tpipe.consumer_wait(cons)  # (the same stages in the same order: one state for both)
                st = cons.index
                ust = st  # the stage's v slot
                if cutlass.const_expr(self.pair):
                    ust = 2 * st + wg
                # group 1: Sᵀ wᵀ, the head of the chain through the chunk (t_in: Sᵀ(-w)ᵀ, then vᵀ T'ᵀ onto it in
                # the same accumulator, so it is v_newᵀ itself; with pack, the copies of the packed tile masked
                # while Sᵀ(-w)ᵀ runs); group 2: oᵀ = Sᵀ qgᵀ, off the chain, keeps the tensor pipe busy while
                # v_new is formed
                warpgroup.fence()
                mma_n64.set(warpgroup.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(cute.size(rS, mode=[2])):
                    cute.gemm(mma_n64, acc_vt, rS[None, None, kb], rB_w[None, None, kb, st], acc_vt)
                    mma_n64.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                if cutlass.const_expr(self.t_in):
                    if cutlass.const_expr(self.pack):
                        mtid = tidx  # pair: both warpgroups share the masking of the one copy
                        if cutlass.const_expr(self.pair):
                            mtid = tidx + wg * V2_MATH_THREADS
                        if cutlass.const_expr(self.pack_mask == "rows"):
                            self.mask_packed_rows(aqk_raw, tp_raw, gam_bf16, st, mtid)
                        else:
                            self.mask_packed_words(aqk_raw, tp_raw, gam_bf16, st, mtid)
                    if cutlass.const_expr(not self.x_in):
                        self.issue_vt(acc_vt, rA_v, rB_tp, u_raw, ust, seq_end - (bos + ci * CHUNK), tidx)
                # x_in: group 2's first half only (its second follows Yᵀ T'ᵀ, so neither half delays the chain's
                # next product by more than the element-wise work it hides under)
                n_qg = cute.size(rS, mode=[2]) // 2 if cutlass.const_expr(self.x_in) else cute.size(rS, mode=[2])
                mma_n64.set(warpgroup.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(n_qg):
                    cute.gemm(mma_n64, acc_ot, rS[None, None, kb], rB_qg[None, None, kb, st], acc_ot)
                    mma_n64.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                # while they run: the previous chunk's o (from its bf16 copy: registers a wgmma wrote
                # in the previous iteration make ptxas wait for the groups in flight), and u
                if ci > 0:
                    self.store_o_v2(rO, cN, tOs, sO_w, mO, hv, v0, owarp, tidx, bos, seq_end, ci - 1)
                if cutlass.const_expr(not self.t_in):
                    cute.copy(u_copy, thr64.partition_C(sU_vt[None, None, st]), rU)
                if cutlass.const_expr(self.x_in):  # vᵀ (rows past the end zeroed)
                    self.v_fragment(rU, thr64, sU, u_raw, ust, seq_end - (bos + ci * CHUNK), tidx, wg)
                warpgroup.wait_group(1)  # group 1 done

                # v_newᵀ and Sᵀ diag(γ) (after the wait for the same reason as o)
                if cutlass.const_expr(self.x_in):
                    # Yᵀ = vᵀ + Sᵀ(-X)ᵀ, then v_newᵀ = bf16(Yᵀ) T'ᵀ while Sᵀ diag(γ) is formed
                    for i in cutlass.range_constexpr(cute.size(acc_vt)):
                        acc_vt[i] = rU[i].to(f32) + acc_vt[i]
                    rV_c.store(acc_vt.load().to(bf16))
                    self.issue_yt(acc_vt, rV, rB_tp, st)
                    mma_n64.set(warpgroup.Field.ACCUMULATE, True)
                    for kb in cutlass.range_constexpr(n_qg, cute.size(rS, mode=[2])):
                        cute.gemm(mma_n64, acc_ot, rS[None, None, kb], rB_qg[None, None, kb, st], acc_ot)
                    warpgroup.commit_group()
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        vv, kk = cS[i]
                        acc_s[i] = acc_s[i] * sGam[kk, 0, st]
                    warpgroup.wait_group(1)  # Yᵀ T'ᵀ done
                    rV_c.store(acc_vt.load().to(bf16))
                else:
                    if cutlass.const_expr(not self.t_in):
                        for i in cutlass.range_constexpr(cute.size(acc_vt)):
                            acc_vt[i] = rU[i].to(f32) - acc_vt[i]
                    rV_c.store(acc_vt.load().to(bf16))
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        vv, kk = cS[i]
                        acc_s[i] = acc_s[i] * sGam[kk, 0, st]
                # group 3: Sᵀ += v_newᵀ kg (the chain); group 4: oᵀ += v_newᵀ Aqkᵀ
                warpgroup.fence()
                mma_n128.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(rV, mode=[2])):
                    cute.gemm(mma_n128, acc_s, rV[None, None, kb], rB_kgt[None, None, kb, st], acc_s)
                warpgroup.commit_group()
                mma_n64.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(rV, mode=[2])):
                    cute.gemm(mma_n64, acc_ot, rV[None, None, kb], rB_aqk[None, None, kb, st], acc_ot)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pipe.consumer_release(cons)
                if cutlass.const_expr(self.raw_in):
                    tpipe.consumer_release(cons)
                cons.advance()
                rS_c.store(acc_s.load().to(bf16))  # the next chunk's A operand
                rO.store(acc_ot.load().to(mO.element_type))

            if n_chunks > 0:
                self.store_o_v2(rO, cN, tOs, sO_w, mO, hv, v0, owarp, tidx, bos, seq_end, n_chunks - 1)

            if cutlass.const_expr(self.store_ht and not self.state_smem):
                self.store_state(acc_s, cS, mHT, seq, hv, v0)

        if cutlass.const_expr(self.state_smem and self.store_ht):
            # the CTA's last item: its final state through the buffer (no swap left to carry it)
            last = cta + ((n_items - 1 - cta) // n_ctas) * n_ctas
            cute.arch.barrier(barrier_id=STATE_BARRIER, number_of_threads=V2_MATH_THREADS)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cS[i]
                sH[self.state_offset(vv, kk)] = acc_s[i]
            cute.arch.barrier(barrier_id=STATE_BARRIER, number_of_threads=V2_MATH_THREADS)
            self.state_out(sH, mHT, last, dims, tidx)

    def state_offset(self, vv, kk):
        """Where the state element (v, k) of a tile sits in the buffer (padded rows: see STATE_PITCH_*)."""
        if cutlass.const_expr(self.v_first):
            return vv * STATE_PITCH_VF + kk
        return kk * STATE_PITCH_KF + vv

    def state_piece(self, item, dims, tidx, m: int):
        """This thread's m-th 16-byte piece of item ``item``'s state tile: (buffer offset, element offset
        in the [N, HV, ., .] state). Consecutive threads take consecutive pieces of a row (256 B K-first,
        512 B V-first), so a warp's accesses are whole rows on both sides."""
        head, v0 = _item_tile(item, dims)
        c = tidx + V2_MATH_THREADS * m
        if cutlass.const_expr(self.v_first):
            r, p = c // (DK // 4), c % (DK // 4)
            return r * STATE_PITCH_VF + 4 * p, head * (DK * DV) + (v0 + r) * DK + 4 * p
        r, p = c // (BV // 4), c % (BV // 4)
        return r * STATE_PITCH_KF + 4 * p, head * (DK * DV) + r * DV + v0 + 4 * p

    @cute.jit
    def state_in_async(self, mH0: cute.Tensor, sH: cute.Tensor, item, dims, tidx):
        """cp.async item ``item``'s initial state tile into the buffer (one commit group per call)."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                   cutlass.Float32, num_bits_per_copy=128)
        for m in cutlass.range_constexpr(STATE_PIECES):
            so, go = self.state_piece(item, dims, tidx, m)
            src = cute.make_tensor(mH0.iterator + cute.assume(go, divby=4), cute.make_layout(4))
            dst = cute.make_tensor(sH.iterator + cute.assume(so, divby=4), cute.make_layout(4))
            cute.copy(atom, src, dst)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def state_out(self, sH: cute.Tensor, mHT: cute.Tensor, item, dims, tidx):
        """The buffer -> item ``item``'s final state tile, 16-byte pieces."""
        for m in cutlass.range_constexpr(STATE_PIECES):
            so, go = self.state_piece(item, dims, tidx, m)
            src = cute.make_tensor(sH.iterator + cute.assume(so, divby=4), cute.make_layout(4))
            dst = cute.make_tensor(mHT.iterator + cute.assume(go, divby=4), cute.make_layout(4))
            dst.store(src.load())

    @cute.jit
    def state_swap(self, acc_s, cS, sH, mH0, mHT, item, cta, n_ctas, n_items, dims, tidx):
        """Item ``item``'s start: its initial state (in the buffer since the previous item started) into
        the accumulator, the previous item's final state (in the accumulator) out through the buffer; then
        the next item's initial state is asked for. Each thread swaps only its own fragment's elements."""
        if cutlass.const_expr(self.has_h0):
            cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=STATE_BARRIER, number_of_threads=V2_MATH_THREADS)
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = cS[i]
            off = self.state_offset(vv, kk)
            h = cutlass.Float32(0.0)
            if cutlass.const_expr(self.has_h0):
                h = sH[off]
            if cutlass.const_expr(self.store_ht):
                sH[off] = acc_s[i]
            acc_s[i] = h
        if cutlass.const_expr(self.store_ht):
            cute.arch.barrier(barrier_id=STATE_BARRIER, number_of_threads=V2_MATH_THREADS)
            if item != cta:
                self.state_out(sH, mHT, item - n_ctas, dims, tidx)
            # every read of the buffer is done before the next initial state lands in it
            cute.arch.barrier(barrier_id=STATE_BARRIER, number_of_threads=V2_MATH_THREADS)
        if cutlass.const_expr(self.has_h0):
            if item + n_ctas < n_items:
                self.state_in_async(mH0, sH, item + n_ctas, dims, tidx)

    @cute.jit
    def prefetch_next_state(self, mH0: cute.Tensor, nxt, dims, tidx, wg=0):
        """Ask L2 for item ``nxt``'s state tile (this CTA's next item): its V tile of the head's
        [128, 128] fp32 state, 256 lines of 128 bytes, 2 per thread. K-first: row k = tidx, its 256
        bytes of the tile's 64 values; V-first: 32 KB in one piece."""
        head, v0 = _item_tile(nxt, dims)
        if cutlass.const_expr(self.pair):
            v0 = wg * BV
        per_line = LINE_BYTES // 4
        if cutlass.const_expr(self.v_first):  # rows v0 .. v0+63 are one contiguous 32 KB piece
            first = head * (DK * DV) + v0 * DK + tidx * (2 * per_line)
        else:  # row k = tidx, its values v0 .. v0+63
            first = head * (DK * DV) + tidx * DV + v0
        prefetch_line_l2(mH0.iterator + first)
        prefetch_line_l2(mH0.iterator + first + per_line)

    def o_offset(self, tt, vv):
        """Element offset of (token tt, v vv of the warp's 16) in a warp's o staging tile."""
        if cutlass.const_expr(self.t_in):  # compact: the 16-byte halves swapped where bit 2 of tt is set
            return tt * V2_O_PITCH_COMPACT + (vv ^ (((tt >> 2) & 1) << 3))
        return tt * V2_O_PITCH + vv

    def make_mma_t(self):
        """t_in's vᵀ T'ᵀ: A = vᵀ from shared memory, MN-major (made in the kernel: a TiledMma argument adds a
        kernel parameter, and the default's PTX stays byte-identical this way)."""
        bf16 = cutlass.BFloat16
        b_major = utils.LayoutEnum.COL_MAJOR if self.pack else utils.LayoutEnum.ROW_MAJOR  # pack: T' transposed
        return sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, utils.LayoutEnum.COL_MAJOR.sm90_mma_major_mode(),
            b_major.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1), (BV, CHUNK))

    @cute.jit
    def issue_vt(self, acc_vt, rA_v, rB_tp, u_raw, st, nvalid, tidx):
        """t_in: acc_vt += vᵀ T'ᵀ of the chunk in stage ``st`` (``nvalid`` of its rows in the sequence), one commit
        group. A partial chunk's v rows past the sequence's end hold the next sequence's tokens: T' has zero columns
        there, but 0 x Inf is not 0, so they are zeroed first."""
        if nvalid < CHUNK:
            self.zero_v_rows(u_raw, st, nvalid, tidx)
        mma_t = self.make_mma_t()  # its own: a TiledMma's ACCUMULATE field is SSA state of one region
        warpgroup.fence()
        mma_t.set(warpgroup.Field.ACCUMULATE, True)
        for kb in cutlass.range_constexpr(cute.size(rA_v, mode=[2])):
            cute.gemm(mma_t, acc_vt, rA_v[None, None, kb, st], rB_tp[None, None, kb + self.tp_k0, st], acc_vt)
            mma_t.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    def make_mma_yt(self):
        """x_in's Yᵀ T'ᵀ: A = bf16(Yᵀ) from registers, B = T' as in :meth:`make_mma_t` (made in the kernel, for
        the reason given there)."""
        bf16 = cutlass.BFloat16
        b_major = utils.LayoutEnum.COL_MAJOR if self.pack else utils.LayoutEnum.ROW_MAJOR
        return sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
            cutlass.Float32, (1, 1, 1), (BV, CHUNK), warpgroup.OperandSource.RMEM)

    @cute.jit
    def issue_yt(self, acc_vt, rY, rB_tp, st):
        """x_in: acc_vt = Yᵀ T'ᵀ (``rY``: bf16(Yᵀ) as A fragments; ``rB_tp``: T''s B fragments), one commit group."""
        mma_yt = self.make_mma_yt()
        warpgroup.fence()
        mma_yt.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(rY, mode=[2])):
            cute.gemm(mma_yt, acc_vt, rY[None, None, kb], rB_tp[None, None, kb + self.tp_k0, st], acc_vt)
            mma_yt.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def v_fragment(self, rV16, thr64, sU: cute.Tensor, u_raw: cute.Pointer, st, nvalid, tidx, wg=0):
        """x_in: ``rV16`` (bf16, the v_newᵀ accumulator's layout) = vᵀ of the chunk in stage ``st``, from the
        (v, token) tile. A partial chunk's rows past the sequence's end are zeroed first, as :meth:`zero_v_rows`
        says why."""
        if nvalid < CHUNK:
            self.zero_v_rows(u_raw, st, nvalid, tidx, wg)
        u_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16)
        cute.copy(u_copy, thr64.partition_C(sU[None, None, st]), rV16)

    @cute.jit
    def mask_packed_words(self, aqk_raw: cute.Pointer, tp_raw: cute.Pointer, gam_bf16: cute.Pointer, st, tidx):
        """pack, by the math threads: mask stage ``st``'s two copies of the packed tile P (P[r, c] is Aqk[r, c] for
        c <= r and T'[c, r] for c > r; ``aqk_raw``, ``tp_raw``: the tiles' unswizzled starts): the Aqk copy keeps
        c <= r, the T' copy c > r plus T''s diagonal, bf16(β_r), from γ's row. A thread takes four of the 512
        16-byte pieces (8 threads a 128-byte row: conflict-free); a piece wholly on one side is zeroed in the other
        copy without a read, the diagonal's is masked as 32-bit words of scalar code (a register array written
        under run-time conditions went to local memory). Then a fence for the async proxy and a barrier of the
        math threads: the next products read the tiles."""
        i32 = cutlass.Int32
        zero = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        zero.fill(0.0)
        gam32 = cute.recast_ptr(gam_bf16, dtype=i32)
        for m in cutlass.range_constexpr(CHUNK * 8 // self.math_threads):
            q = tidx + self.math_threads * m
            r = q // 8
            p = q % 8
            off = packed_piece_offset(st, r, p)
            if 8 * p + 7 < r:  # below the diagonal: Aqk's, so not T''s
                cute.make_tensor(tp_raw + cute.assume(off, divby=8), cute.make_layout(8)).store(zero.load())
            elif 8 * p > r:  # above it: T''s, so not Aqk's
                cute.make_tensor(aqk_raw + cute.assume(off, divby=8), cute.make_layout(8)).store(zero.load())
            else:
                # β_r is half (r % 2) of the word r // 2 after γ (little-endian pairs)
                tail = cute.make_tensor(gam32 + (st * GAM_PITCH_PACK + DK + r // 2), cute.make_layout(1))[0]
                half = i32(0xFFFF) - (r % 2) * i32(0x1FFFF)  # 0x0000FFFF or 0xFFFF0000
                a32 = cute.recast_ptr(aqk_raw, dtype=i32) + (off // 2)
                t32 = cute.recast_ptr(tp_raw, dtype=i32) + (off // 2)
                for w in cutlass.range_constexpr(4):
                    col = 8 * p + 2 * w  # the word's two columns: col (low half), col + 1 (high half)
                    keep_a = i32(col <= r) * i32(0xFFFF) + i32(col + 1 <= r) * i32(-0x10000)
                    wa = cute.make_tensor(a32 + w, cute.make_layout(1))
                    wt = cute.make_tensor(t32 + w, cute.make_layout(1))
                    wa[0] = wa[0] & keep_a
                    wt[0] = (wt[0] & ~keep_a) | (tail & half) * i32(col == r - r % 2)  # T': c > r, and β_r
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.barrier(barrier_id=PACK_BARRIER, number_of_threads=self.math_threads)

    @cute.jit
    def mask_packed_rows(self, aqk_raw: cute.Pointer, tp_raw: cute.Pointer, gam_bf16: cute.Pointer, st, tidx):
        """pack, by the math threads: mask stage ``st``'s two copies of the packed tile P (P[r, c] is Aqk[r, c] for
        c <= r and T'[c, r] for c > r; ``aqk_raw``, ``tp_raw``: the tiles' unswizzled starts): the Aqk copy keeps
        c <= r, the T' copy c > r plus T''s diagonal, bf16(β_r), from γ's row. Two passes over the 512 16-byte
        pieces (8 a 128-byte row). First every thread takes four pieces (8 threads a row: conflict-free) and zeroes
        one wholly on one side in the other copy, without a read. Then the 64 diagonal pieces, row r's by thread r
        (warps 0-1; warps 2-3 skip it whole): one 16-byte read, two 16-byte writes of 32-bit words masked by
        r % 8 (constant indices keep the words in registers). :meth:`mask_packed_words` has each of a warp's four
        diagonal lanes mask its piece word by word while the other 28 lanes wait: ~380 of a math warp's ~900
        instructions a chunk, in a stage 2 bound by its issue (ncu, H100, one warp a scheduler). Then a fence for
        the async proxy and a barrier of the math threads: the next products read the tiles."""
        i32 = cutlass.Int32
        zero = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        zero.fill(0.0)
        for m in cutlass.range_constexpr(CHUNK * 8 // self.math_threads):
            q = tidx + self.math_threads * m
            r = q // 8
            p = q % 8
            off = packed_piece_offset(st, r, p)
            if 8 * p + 7 < r:  # below the diagonal: Aqk's, so not T''s
                cute.make_tensor(tp_raw + cute.assume(off, divby=8), cute.make_layout(8)).store(zero.load())
            elif 8 * p > r:  # above it: T''s, so not Aqk's
                cute.make_tensor(aqk_raw + cute.assume(off, divby=8), cute.make_layout(8)).store(zero.load())
        if tidx < CHUNK:
            r = tidx
            d = r % 8  # the diagonal's column within row r's piece r // 8
            off2 = packed_piece_offset(st, r, r // 8) // 2  # in 32-bit words
            words = cute.make_rmem_tensor(cute.make_layout(4), i32)
            words.store(cute.make_tensor(cute.recast_ptr(aqk_raw, dtype=i32) + cute.assume(off2, divby=4),
                                         cute.make_layout(4)).load())
            # β_r is half (r % 2) of the word r // 2 after γ (little-endian pairs)
            tail = cute.make_tensor(cute.recast_ptr(gam_bf16, dtype=i32) + (st * GAM_PITCH_PACK + DK + r // 2),
                                    cute.make_layout(1))[0]
            beta = tail & (i32(0xFFFF) - (d % 2) * i32(0x1FFFF))  # 0x0000FFFF or 0xFFFF0000
            t_words = cute.make_rmem_tensor(cute.make_layout(4), i32)
            for w in cutlass.range_constexpr(4):
                # the word's two columns 2w, 2w + 1 of the piece: Aqk's where they are <= d
                keep_a = i32(2 * w <= d) * i32(0xFFFF) + i32(2 * w + 1 <= d) * i32(-0x10000)
                t_words[w] = (words[w] & ~keep_a) | beta * i32(2 * w == d - d % 2)  # T': c > r, and β_r
                words[w] = words[w] & keep_a
            cute.make_tensor(cute.recast_ptr(aqk_raw, dtype=i32) + cute.assume(off2, divby=4),
                             cute.make_layout(4)).store(words.load())
            cute.make_tensor(cute.recast_ptr(tp_raw, dtype=i32) + cute.assume(off2, divby=4),
                             cute.make_layout(4)).store(t_words.load())
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        cute.arch.barrier(barrier_id=PACK_BARRIER, number_of_threads=self.math_threads)

    @cute.jit
    def zero_v_rows(self, u_raw: cute.Pointer, st, nvalid, tidx, wg=0):
        """t_in: zero the token rows >= nvalid of stage ``st``'s vᵀ tile (``u_raw``: its unswizzled start)
        before the wgmma reads it. A token's 64 values are one 128-byte row of the tile, permuted inside the
        row by the swizzle (layout_facts), so whole rows are zeroed as 8 16-byte pieces, swizzle or not."""
        zero = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        zero.fill(0.0)
        for r in cutlass.range_constexpr(CHUNK * 8 // V2_MATH_THREADS):
            row = tidx // 8 + (V2_MATH_THREADS // 8) * r
            if row >= nvalid:
                off = st * (CHUNK * BV) + row * BV + (tidx % 8) * 8
                cute.make_tensor(u_raw + cute.assume(off, divby=8), cute.make_layout(8)).store(zero.load())
        # generic-proxy writes, read next by wgmma (the async proxy), by every math warp
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
        if cutlass.const_expr(self.pair):  # (each warpgroup zeroes only its own half's slot)
            cute.arch.barrier(barrier_id=V_ZERO_BARRIER + (V_ZERO_BARRIER_WG1 - V_ZERO_BARRIER) * wg,
                              number_of_threads=V2_MATH_THREADS)
        else:
            cute.arch.barrier(barrier_id=V_ZERO_BARRIER, number_of_threads=V2_MATH_THREADS)

    @cute.jit
    def store_o_v2(self, rO, cN, tOs, sO_w, mO, hv, v0, warp, tidx, bos, seq_end, ci):
        """oᵀ of chunk ``ci`` (its copy in o's dtype) -> o rows: through this warp's smem tile [64 tok, 16 v], then 16-byte
        stores (lanes 0-15 and 16-31 write the two halves of 16 consecutive token rows: whole 32-byte
        sectors). Only the warp's own lanes touch its tile, so __syncwarp is the only barrier."""
        tok0 = bos + ci * CHUNK
        nvalid = cutlass.min(seq_end - tok0, CHUNK)
        cute.arch.sync_warp()  # the previous chunk's reads of the tile are done
        # compact tile: every token of a thread's fragment has the same bit 2 (tokens 2 (lane % 4) + {0, 1} + 8 j:
        # layout_facts), so the half swap is one value per thread
        swap = ((cN[0][1] >> 2) & 1) << 3
        for i in cutlass.range_constexpr(cute.size(rO)):
            vv, tt = cN[i]
            if cutlass.const_expr(self.t_in):
                cute.make_tensor(sO_w, cute.make_layout(CHUNK * V2_O_PITCH_COMPACT))[
                    tt * V2_O_PITCH_COMPACT + ((vv % V2_O_ROWS) ^ swap)] = rO[i]
            else:
                tOs[tt, vv % V2_O_ROWS] = rO[i]
        cute.arch.sync_warp()
        lane = tidx % 32
        half = lane // 16
        for j in cutlass.range_constexpr(V2_O_VECS):
            tt = lane % 16 + 16 * j
            if tt < nvalid:
                src = cute.make_tensor(sO_w + cute.assume(self.o_offset(tt, half * 8), divby=8), cute.make_layout(8))
                dst_off = cute.crd2idx((tok0 + tt, hv, v0 + warp * V2_O_ROWS + half * 8), mO.layout)
                dst = cute.make_tensor(mO.iterator + cute.assume(dst_off, divby=8), cute.make_layout(8))
                dst.store(src.load())


class KdaFwdRecurRaw(KdaFwdRecur):
    """Stage 2 with the raw tiles (v2, u and w in stage 2, ``raw_in``): reads q, k and g where the default reads qg,
    -X and kgᵀ, and the rows' inverse norms from stage 1 (kda_fwd_raw_tiles)."""

    def __init__(self, has_initial_state: bool, output_final_state: bool, state_v_first: bool, gate: str = "sigmoid",
                 diag: str = "", **flags):
        super().__init__(has_initial_state, output_final_state, state_v_first, variant="v2", t_in=True, x_in=True,
                         raw_in=True, gate=gate, **flags)
        if diag not in RAW_DIAGS:
            raise ValueError(f"diag: expected one of {RAW_DIAGS}, got {diag!r}")
        self.raw_diag = diag
        if diag == "pass1":
            self.raw_tiles = RawTiles(gate, swizzled=True, diag="pass1")

    @cute.jit
    def __call__(
        self,
        pK: cute.Pointer,  # [TT, H, 128] bf16
        pQ: cute.Pointer,  # [TT, H, 128] bf16
        pG: cute.Pointer,  # [TT, HV, 128] bf16: the raw gate (or the log-space decay)
        pNrm: cute.Pointer,  # [HV, NC, 2, 64] fp32: q's (times the scale) and k's inverse norms per chunk row
        pAlog: cute.Pointer,  # [HV] fp32
        pDtb: cute.Pointer,  # [HV, 128] fp32 (zeros when absent)
        pAqk: cute.Pointer,  # [HV, NC*64, 64 | 128] bf16: the packed tile or [Aqk | T']
        pV: cute.Pointer,  # [TT, HV, 128] bf16
        pGam: cute.Pointer,  # [HV, NC, 128 (| +32)] fp32
        pChunks: cute.Pointer,
        pSeq: cute.Pointer,
        pO: cute.Pointer,
        pH0: cute.Pointer,
        pHT: cute.Pointer,
        total_tokens: cutlass.Int32,
        num_heads_v: cutlass.Int32,
        num_chunks: cutlass.Int32,
        num_seqs: cutlass.Int32,
        max_ctas: cutlass.Int32,
        group: cutlass.Int32,  # value heads per q/k head
        lower_bound: cutlass.Float32,
        stream,
    ):
        self.launch_v2(pK, pQ, pAqk, pG, pV, pGam, pChunks, pSeq, pO, pH0, pHT, total_tokens, num_heads_v, num_chunks,
                       num_seqs, max_ctas, stream, (pNrm, pAlog, pDtb, lower_bound, group))


def fake_args(o_dtype=cutlass.BFloat16, raw: bool = False):
    """Placeholder pointers and sizes for a CPU compile (the kernel never runs on them); ``raw``: those of
    :class:`KdaFwdRecurRaw`."""
    from cula.kernels.common.ptx_check import fake_ptr

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    if raw:
        dts = [bf16, bf16, bf16, f32, f32, f32, bf16, bf16, f32, i32, i32, o_dtype, f32, f32]
        aligns = [16, 16, 16, 16, 4, 4, 16, 16, 16, 8, 8, 16, 16, 16]  # (A_log, dt_bias: the caller's, 4-aligned)
        ptrs = [fake_ptr(i, dt, a) for i, (dt, a) in enumerate(zip(dts, aligns))]
        return (*ptrs, i32(1000), i32(2), i32(16), i32(1), i32(132), i32(1), f32(-5.0))
    dts = [bf16, bf16, bf16, bf16, bf16, f32, i32, i32, o_dtype, f32, f32]
    aligns = [16, 16, 16, 16, 16, 16, 8, 8, 16, 16, 16]
    ptrs = [fake_ptr(i, dt, a) for i, (dt, a) in enumerate(zip(dts, aligns))]
    return (*ptrs, i32(1000), i32(2), i32(16), i32(1), i32(132))


def compile_targets():
    """CPU PTX-check targets: both kernel bodies, each state option."""
    from cutlass.cute.runtime import make_fake_stream

    def build(**flags):
        def make():
            return KdaFwdRecur(**flags), (*fake_args(), make_fake_stream())
        return make

    full = dict(has_initial_state=True, output_final_state=True, state_v_first=False)
    targets = {}
    for variant in VARIANTS:
        pre = "" if variant == "v1" else f"{variant}_"
        targets["default" if variant == "v1" else variant] = build(**full, variant=variant)
        targets[f"{pre}v_first"] = build(**{**full, "state_v_first": True}, variant=variant)
        targets[f"{pre}no_state"] = build(has_initial_state=False, output_final_state=False, state_v_first=False,
                                          variant=variant)
    targets["v2_state_smem"] = build(**full, variant="v2", state_smem=True)
    targets["v2_state_smem_v_first"] = build(**{**full, "state_v_first": True}, variant="v2", state_smem=True)
    targets["v2_state_smem_h0_only"] = build(**{**full, "output_final_state": False}, variant="v2", state_smem=True)
    targets["v2_state_smem_ht_only"] = build(**{**full, "has_initial_state": False}, variant="v2", state_smem=True)
    # u in stage 2 (kda_fwd.U_IN_RECUR): three stages, and two with the state buffer
    targets["v2_t_in"] = build(**full, variant="v2", t_in=True)
    targets["v2_t_in_no_state"] = build(has_initial_state=False, output_final_state=False, state_v_first=False,
                                        variant="v2", t_in=True)
    targets["v2_t_in_state_smem"] = build(**full, variant="v2", state_smem=True, t_in=True)
    # the packed [Aqk | T'] tile (kda_fwd.PACK): with a state, without, and the state buffer
    targets["v2_t_in_pack"] = build(**full, variant="v2", t_in=True, pack=True)
    targets["v2_t_in_pack_no_state"] = build(has_initial_state=False, output_final_state=False, state_v_first=False,
                                             variant="v2", t_in=True, pack=True)
    targets["v2_t_in_pack_state_smem"] = build(**full, variant="v2", state_smem=True, t_in=True, pack=True)
    # w in stage 2 (kda_fwd.W_IN_RECUR): v_new = T'(v - X S), packed and unpacked, with the state buffer too
    targets["v2_t_in_pack_x"] = build(**full, variant="v2", t_in=True, pack=True, x_in=True)
    targets["v2_t_in_pack_x_words"] = build(**full, variant="v2", t_in=True, pack=True, x_in=True,
                                            pack_mask="words")  # CULA_KDA_PACK_MASK=words (pair's mask)
    targets["v2_t_in_x"] = build(**full, variant="v2", t_in=True, x_in=True)
    # pair (PAIR_ENV): both V halves in one CTA, packed and unpacked, each state option, V-first
    targets["v2_t_in_pack_x_pair"] = build(**full, variant="v2", t_in=True, pack=True, x_in=True, pair=True)
    targets["v2_t_in_x_pair"] = build(**full, variant="v2", t_in=True, x_in=True, pair=True)
    none = dict(has_initial_state=False, output_final_state=False, state_v_first=False)
    targets["v2_t_in_pack_x_pair_no_state"] = build(**none, variant="v2", t_in=True, pack=True, x_in=True, pair=True)
    for only, st in (("h0", dict(output_final_state=False)), ("ht", dict(has_initial_state=False))):
        targets[f"v2_t_in_pack_x_pair_{only}_only"] = build(**{**full, **st}, variant="v2", t_in=True, pack=True,
                                                           x_in=True, pair=True)
    targets["v2_t_in_x_pair_v_first"] = build(**{**full, "state_v_first": True}, variant="v2", t_in=True, x_in=True,
                                              pair=True)
    targets["v2_t_in_x_state_smem"] = build(**full, variant="v2", state_smem=True, t_in=True, x_in=True)

    # raw tiles (kda_fwd_raw_tiles): packed and unpacked, each gate form on the packed default
    def build_raw(**flags):
        def make():
            return KdaFwdRecurRaw(**flags), (*fake_args(raw=True), make_fake_stream())
        return make

    for gate in RAW_GATES:
        targets[f"v2_t_in_pack_x_raw_{gate}"] = build_raw(**full, pack=True, gate=gate)
    targets["v2_t_in_x_raw_sigmoid"] = build_raw(**full, gate="sigmoid")
    for diag in RAW_DIAGS[1:]:  # timing diagnostics (bench_raw)
        targets[f"v2_t_in_pack_x_raw_diag_{diag}"] = build_raw(**full, pack=True, diag=diag)
    return targets


# ------------------------------------------------------------------------------------------------
# layout facts v2 relies on (checked on the CPU by the tests)
# ------------------------------------------------------------------------------------------------
def _swizzle_128b(byte_offset: int) -> int:
    """S<3,4,3> on byte offsets: the 16-byte column inside a 128-byte row XOR the row index mod 8."""
    return byte_offset ^ (((byte_offset >> 7) & 7) << 4)


def _bank_conflicts(addresses: list[int], width: int) -> int:
    """Extra shared-memory wavefronts of one warp access (``width``-byte elements at ``addresses``):
    accesses of up to 4 bytes go in one pass over 32 banks, 8/16-byte ones per half / quarter warp;
    lanes reading the same 4-byte word share it (an access touches the words its own bytes are in)."""
    lanes_per_pass = 32 if width <= 4 else 128 // width
    extra = 0
    for p in range(0, len(addresses), lanes_per_pass):
        words_per_bank: dict[int, set] = {}
        for a in addresses[p:p + lanes_per_pass]:
            for w in range(a // 4, (a + width - 1) // 4 + 1):
                words_per_bank.setdefault(w % 32, set()).add(w)
        extra += max(len(ws) for ws in words_per_bank.values()) - 1
    return extra


def layout_facts() -> dict:
    """Trace the DSL's layouts (no GPU) and report what v2's register reuse and hand-made addressing
    assume: the bf16 copies of the Sᵀ / v_newᵀ accumulators are the RS products' A operands element for
    element; a warp's accumulator rows are its 16 v of the tile (the o staging tile); the u and o
    accesses are free of bank conflicts."""
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    kmaj = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
    rmem = warpgroup.OperandSource.RMEM
    facts: dict = {}

    def coord(i, lay):
        return tuple(int(x) for x in lay(cute.idx2crd(i, lay.shape)))

    @cute.jit(preprocess=False)  # plain Python: everything traced here is static
    def trace():
        rs_n64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, f32, (1, 1, 1), (BV, CHUNK), rmem)
        rs_n128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, kmaj, kmaj, f32, (1, 1, 1), (BV, DK), rmem)
        bad_a = 0
        bad_rows = 0
        staged: dict[int, list] = {w: [] for w in range(V2_WARPS)}
        u_conflicts = 0
        o_write_conflicts = 0
        t64 = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BV, CHUNK, CHUNK), bf16, 1)
        per_value_u: dict[int, list] = {}
        per_value_o: dict[int, list] = {}
        per_value_oc: dict[int, list] = {}  # t_in's compact o staging
        compact = KdaFwdRecur(True, True, False, variant="v2", t_in=True)
        bad_swap = 0
        for t in range(V2_MATH_THREADS):
            # (producer C fragment, consumer mma, K): Sᵀ feeds K = 128 of the n64 products; v_newᵀ
            # feeds K = 64 of the n64 (Aqk) and n128 (state) products
            for c_mma, c_n, a_mma in ((rs_n128, DK, rs_n64), (rs_n64, CHUNK, rs_n64), (rs_n64, CHUNK, rs_n128)):
                if t % 5 and t != V2_MATH_THREADS - 1:  # a sample of lanes in every warp is enough
                    continue
                c_crd = c_mma.get_slice(t).partition_C(cute.make_identity_tensor((BV, c_n)))
                a_crd = a_mma.get_slice(t).partition_A(cute.make_identity_tensor((BV, c_n)))
                bad_a += int(tuple(int(x) for x in c_crd.iterator) != tuple(int(x) for x in a_crd.iterator))
                regs = a_operand_layout(cute.make_layout(c_mma.get_slice(t).partition_shape_C((BV, c_n))))
                for p in range(cute.size(regs)):
                    r = int(regs(cute.idx2crd(p, regs.shape)))
                    bad_a += int(coord(p, a_crd.layout) != coord(r, c_crd.layout))
            c_t = rs_n64.get_slice(t).partition_C(cute.make_identity_tensor((BV, CHUNK)))
            base = tuple(int(x) for x in c_t.iterator)  # the layout alone is relative to it
            for i in range(cute.size(c_t)):
                vv, tt = (b + x for b, x in zip(base, coord(i, c_t.layout)))
                bad_rows += int(vv // V2_O_ROWS != t // 32)
                staged[t // 32].append((tt, vv % V2_O_ROWS))
                if t < 32:  # warp 0's accesses, value by value
                    u_byte = 2 * int(cute.crd2idx((tt, vv, 0), t64.outer))
                    per_value_u.setdefault(i, []).append(_swizzle_128b(u_byte))
                    per_value_o.setdefault(i, []).append(2 * (tt * V2_O_PITCH + vv % V2_O_ROWS))
                    per_value_oc.setdefault(i, []).append(2 * compact.o_offset(tt, vv % V2_O_ROWS))
                bad_swap += int((tt >> 2) & 1 != (base[1] >> 2) & 1)  # store_o_v2's one swap per thread
        for i in per_value_u:
            u_conflicts += _bank_conflicts(per_value_u[i], 2)
            o_write_conflicts += _bank_conflicts(per_value_o[i], 2)
        full = sorted((tt, v) for tt in range(CHUNK) for v in range(V2_O_ROWS))
        facts["a_register_mismatches"] = bad_a
        facts["warp_row_mismatches"] = bad_rows
        facts["o_staging_exact_cover"] = all(sorted(staged[w]) == full for w in range(V2_WARPS))
        facts["u_read_conflicts"] = u_conflicts
        facts["o_write_conflicts"] = o_write_conflicts
        facts["o_read_conflicts"] = sum(
            _bank_conflicts([2 * ((lane % 16 + 16 * j) * V2_O_PITCH + 8 * (lane // 16)) for lane in range(32)], 16)
            for j in range(V2_O_VECS))
        # t_in: the compact o tile (2-byte writes value by value, 16-byte reads), each element once; the vᵀ
        # tile's token rows are whole 128-byte rows (what zero_v_rows clears); [Aqk | T'] is two t64 tiles
        facts["o_compact_write_conflicts"] = sum(_bank_conflicts(a, 2) for a in per_value_oc.values())
        facts["o_compact_read_conflicts"] = sum(
            _bank_conflicts([2 * compact.o_offset(lane % 16 + 16 * j, 8 * (lane // 16)) for lane in range(32)], 16)
            for j in range(V2_O_VECS))
        facts["o_compact_swap_mismatches"] = bad_swap
        facts["o_compact_exact_cover"] = sorted(
            compact.o_offset(tt, v) for tt in range(CHUNK) for v in range(V2_O_ROWS)) == list(range(CHUNK * V2_O_ROWS))
        va = sm90_utils.make_smem_layout_a(utils.LayoutEnum.COL_MAJOR, (BV, CHUNK, CHUNK), bf16, 2)
        facts["va_token_rows"] = all(
            sorted(int(cute.crd2idx((m, k, st), va.outer)) for m in range(BV))
            == list(range(st * CHUNK * BV + k * BV, st * CHUNK * BV + (k + 1) * BV))
            for k in range(CHUNK) for st in range(2))
        w2 = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BV, CHUNK, DK), bf16, 1)
        facts["aqk_t_halves_are_t64"] = all(
            int(cute.crd2idx((n, c, 0), w2.outer))
            == (c // CHUNK) * CHUNK * CHUNK + int(cute.crd2idx((n, c % CHUNK, 0), t64.outer))
            for n in range(CHUNK) for c in range(DK))
        facts["swizzle_va"] = str(va.inner)
        # pack: T''s copy, an MN-major B tile, holds the packed tile's bytes as the K-major t64 tile does (element
        # (i, j) of T' at P's (j, i)), both 128-byte swizzled; mask_packed's piece offsets are the swizzled ones
        t64s = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BV, CHUNK, CHUNK), bf16, 2)
        tp = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, (BV, CHUNK, CHUNK), bf16, 2)
        facts["pack_tp_is_t64_transposed"] = str(tp.inner) == str(t64s.inner) and all(
            int(cute.crd2idx((i, j, st), tp.outer)) == int(cute.crd2idx((j, i, st), t64s.outer))
            for i in range(CHUNK) for j in range(CHUNK) for st in range(2))

        def swizzled(r, c, st):  # S<3,4,3> on byte addresses, in elements
            lin = int(cute.crd2idx((r, c, st), t64s.outer)) * 2
            return (lin ^ (((lin >> 7) & 7) << 4)) // 2

        facts["pack_mask_offset_mismatches"] = sum(
            int(packed_piece_offset(st, r, p) + c != swizzled(r, 8 * p + c, st))
            for r in range(CHUNK) for p in range(8) for c in range(8) for st in range(2))
        # raw_in: RawTiles.pair swizzles only a half's local offset (row i < 32 of the half, key c) and adds the
        # half's start: exact where the starts have none of the bits the swizzle reads, for q / k's tile and g's
        raw = KdaFwdRecurRaw(True, True, False)
        raw._setup_v2()

        def swz(off):
            return (off * 2 ^ (((off * 2 >> 7) & 7) << 4)) // 2

        split_bad = 0
        for tile in (cute.slice_(raw.w2_layout.outer, (None, None, 0)),
                     cute.select(cute.slice_(raw.kgt2_layout.outer, (None, None, 0)), mode=[1, 0])):
            # a (token, key) offset is its token's plus its key's (the modes' sum): two tables, not 8,192 calls
            rows = [int(cute.crd2idx((r, 0), tile)) for r in range(CHUNK)]
            cols = [int(cute.crd2idx((0, c), tile)) for c in range(0, DK, RAW_PAIR)]
            split_bad += sum(int(swz(rows[r0 + i] + col) != rows[r0] + swz(rows[i] + col))
                             for r0 in (0, RAW_HALF) for i in range(RAW_HALF) for col in cols)
        facts["raw_half_split_mismatches"] = split_bad
        facts["raw_swizzles"] = f"{raw.w2_layout.inner} {raw.kgt2_layout.inner}"
        # the state buffer: every fragment access of warp 0 (4-byte, value by value), per layout
        # (each lane's (v, k) of each value, traced once for both layouts)
        lane_crds = []
        for t in range(32):
            crd = rs_n128.get_slice(t).partition_C(cute.make_identity_tensor((BV, DK)))
            base = tuple(int(x) for x in crd.iterator)
            lane_crds.append([tuple(b + x for b, x in zip(base, coord(i, crd.layout)))
                              for i in range(cute.size(crd))])
        for v_first in (False, True):
            kern = KdaFwdRecur(True, True, v_first, variant="v2", state_smem=True)
            extra = 0
            for i in range(len(lane_crds[0])):
                addrs = [4 * int(kern.state_offset(*lane_crds[t][i])) for t in range(32)]
                extra += _bank_conflicts(addrs, 4)
            facts[f"state_{'vf' if v_first else 'kf'}_padded_conflicts"] = extra
        facts["swizzle_t64"] = str(t64.inner)
        facts["u_tile_is_aqk_tile"] = str(t64) == str(
            sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (BV, CHUNK, BV), bf16, 1))

    from cula.kernels.common.ptx_check import trace_without_gpu

    return trace_without_gpu(trace, facts)


# ------------------------------------------------------------------------------------------------
# stage 2 alone on a GPU: either body on a given scratch (tests, timing)
# ------------------------------------------------------------------------------------------------
def run(scratch: dict, chunks, seqs, total_tokens: int, initial_state=None, output_final_state: bool = True,
        state_v_first: bool = False, variant: str | None = None, o_dtype=None, max_ctas: int | None = None,
        state_smem: bool = False):
    """Launch only the recurrence (``variant``: ``VARIANTS``, default ``RECUR_VARIANT``) on a stage-1
    scratch in the kernels' dtypes (w, qg, aqk, kgt, u bf16; gam fp32) and chunk tables on the GPU.
    ``max_ctas`` caps v2's persistent grid (default: one CTA per SM; tests use a few CTAs so each walks
    many work items; ``state_smem``: v2 moves the state through shared memory). Returns
    ``(o [TT, HV, 128], final state or None)``."""
    launch, o, ht = prepare(scratch, chunks, seqs, total_tokens, initial_state, output_final_state,
                            state_v_first, variant, o_dtype, max_ctas, state_smem)
    launch()
    return o, ht


def prepare(scratch: dict, chunks, seqs, total_tokens: int, initial_state=None, output_final_state: bool = True,
            state_v_first: bool = False, variant: str | None = None, o_dtype=None, max_ctas: int | None = None,
            state_smem: bool = False):
    """``run`` split in two: compiles (once per variant and flags, into ``kda_fwd``'s cache under its own
    key, so it never replaces what ``kda_fwd()`` launches) and returns ``(launch, o, final state or
    None)``; each ``launch()`` queues the kernel again on the same buffers (timing without host work)."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import make_fake_stream

    from cula.kernels.sm90 import kda_fwd as kf

    variant = RECUR_VARIANT if variant is None else variant
    o_dtype = torch.bfloat16 if o_dtype is None else o_dtype
    dev = scratch["w"].device
    HV = scratch["w"].shape[0]
    N, NC = seqs.shape[0], chunks.shape[0]
    o = torch.zeros(total_tokens, HV, DV, dtype=o_dtype, device=dev)
    h0 = (initial_state.contiguous() if initial_state is not None
          else torch.zeros(1, HV, DK, DV, dtype=torch.float32, device=dev))
    ht = torch.empty(max(N, 1), HV, DK, DV, dtype=torch.float32, device=dev)
    if NC == 0:  # every sequence empty: the state passes through
        ht = h0.clone() if initial_state is not None else torch.zeros(max(N, 1), HV, DK, DV, device=dev)
        return (lambda: None), o, (ht[:N] if output_final_state else None)
    bufs = [scratch[n].contiguous() for n in ("w", "qg", "aqk", "kgt", "u", "gam")]
    tables = [chunks.to(dev, torch.int32).contiguous(), seqs.to(dev, torch.int32).contiguous()]
    flags = dict(has_initial_state=initial_state is not None, output_final_state=bool(output_final_state),
                 state_v_first=bool(state_v_first))
    o_dt = kf._cute_dtype(o_dtype)
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    i32 = cutlass.Int32
    args = (*(kf._ptr(t) for t in bufs), kf._ptr(tables[0], 8), kf._ptr(tables[1], 8),
            *(kf._ptr(t) for t in (o, h0, ht)), i32(total_tokens), i32(HV), i32(NC), i32(N),
            i32(max_ctas if max_ctas is not None else kf.sm_count(dev)), stream)
    key = (f"recur_{variant}", (tuple(sorted(flags.items())), o_dt, bool(state_smem)))
    if key not in kf._COMPILED:
        kern = KdaFwdRecur(**flags, variant=variant, state_smem=state_smem)
        kf._COMPILED[key] = cute.compile(kern, *fake_args(o_dt), make_fake_stream())
    fn = kf._COMPILED[key]
    keep = (bufs, tables, h0)  # the pointers alone do not keep this memory alive

    def launch():
        assert keep
        fn(*args)

    return launch, o, (ht[:N] if output_final_state else None)


def raw_norms(q, k, chunks, num_heads_v: int, scale: float, use_qk_l2norm: bool = True):
    """Stage 2's raw-tile norms from q, k ``[TT, H, 128]``: ``[HV, NC, 2, 64]`` fp32, per chunk row scale / ‖q‖ and
    1 / ‖k‖ (l2norm; else scale and 1), rows past a chunk's end zero: what stage 1 built with ``raw_out`` writes,
    in torch (the GPU tests feed stage 2 alone with it)."""
    import torch

    from cula.kernels.sm90.kda_fwd_raw_tiles import L2NORM_EPS

    TT, H = q.shape[0], q.shape[1]
    NC = chunks.shape[0]
    qf, kf = q.float(), k.float()
    nq = torch.full((TT, H), scale, device=q.device)
    nk = torch.ones(TT, H, device=q.device)
    if use_qk_l2norm:
        nq = scale * torch.rsqrt((qf * qf).sum(-1) + L2NORM_EPS)
        nk = torch.rsqrt((kf * kf).sum(-1) + L2NORM_EPS)
    r = torch.arange(CHUNK, device=q.device)
    tok = chunks[:, :1].long() + r[None]  # [NC, 64]
    valid = r[None] < chunks[:, 1:].long()
    tok = torch.where(valid, tok, 0)
    out = torch.stack([nq[tok], nk[tok]], 1) * valid[:, None, :, None]  # [NC, 2, 64, H]
    return out.repeat_interleave(num_heads_v // H, -1).permute(3, 0, 1, 2).contiguous()


def run_raw(q, k, g, v, norms, A_log, dt_bias, aqk_rows, gam, chunks, seqs, initial_state=None,
            output_final_state: bool = True, gate: str = "sigmoid", lower_bound: float = -5.0, pack: bool = False,
            max_ctas: int | None = None, diag: str = ""):
    """Launch only the raw-tile stage 2 (:class:`KdaFwdRecurRaw`) on stage 1's [Aqk | T'] rows (``aqk_rows``
    [HV, NC*64, 128], or the packed [HV, NC*64, 64] with ``pack``) and γ rows, reading q, k ``[TT, H, 128]``, g, v
    ``[TT, HV, 128]`` bf16 and ``norms`` (:func:`raw_norms`); A_log ``[HV]``, dt_bias ``[HV, 128]`` fp32. Returns
    ``(o [TT, HV, 128] bf16, final state or None)``. For the GPU tests and ``bench_raw`` (stage 2 alone on the
    default stage 1's scratch; ``kda_fwd`` launches both stages with ``CULA_KDA_RAW_TILES=1``)."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import make_fake_stream

    from cula.kernels.sm90 import kda_fwd as kf

    dev = q.device
    TT, H, HV = q.shape[0], q.shape[1], g.shape[1]
    N, NC = seqs.shape[0], chunks.shape[0]
    o = torch.zeros(TT, HV, DV, dtype=torch.bfloat16, device=dev)
    h0 = (initial_state.contiguous() if initial_state is not None
          else torch.zeros(1, HV, DK, DV, dtype=torch.float32, device=dev))
    ht = torch.empty(max(N, 1), HV, DK, DV, dtype=torch.float32, device=dev)
    bufs = [t.contiguous() for t in (k, q, g, norms, A_log.float(), dt_bias.float().reshape(HV, DK), aqk_rows, v,
                                     gam)]
    tables = [chunks.to(dev, torch.int32).contiguous(), seqs.to(dev, torch.int32).contiguous()]
    flags = dict(has_initial_state=initial_state is not None, output_final_state=bool(output_final_state),
                 state_v_first=False)
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    i32, f32 = cutlass.Int32, cutlass.Float32
    args = (*(kf._ptr(t) for t in bufs), kf._ptr(tables[0], 8), kf._ptr(tables[1], 8),
            *(kf._ptr(t) for t in (o, h0, ht)), i32(TT), i32(HV), i32(NC), i32(N),
            i32(max_ctas if max_ctas is not None else kf.sm_count(dev)), i32(HV // H), f32(lower_bound), stream)
    key = ("recur_raw", tuple(sorted(flags.items())), gate, bool(pack), diag)
    if key not in kf._COMPILED:
        kern = KdaFwdRecurRaw(**flags, gate=gate, pack=pack, diag=diag)
        kf._COMPILED[key] = cute.compile(kern, *fake_args(raw=True), make_fake_stream())
    kf._COMPILED[key](*args)
    return o, (ht[:N] if output_final_state else None)


def pack_aqk_tp(aqk, tp, gam):
    """The unpacked [Aqk], [T'] rows ([HV, NC*64, 64] bf16) and γ ([HV, NC, 128] fp32) as stage 1 packs them
    (the inverse of ``kda_fwd.unpack_aqk_tp``): Aqk on and below each chunk's diagonal, T' transposed above it,
    and γ's rows followed by T''s diagonal as 64 bf16."""
    import torch

    HV, R, _ = aqk.shape
    a = aqk.view(HV, R // CHUNK, CHUNK, CHUNK)
    t = tp.view(HV, R // CHUNK, CHUNK, CHUNK)
    packed = a.tril() + t.transpose(-1, -2).triu(1)
    diag = torch.diagonal(t, dim1=-2, dim2=-1).contiguous().view(torch.float32)  # 64 bf16 as 32 fp32
    return packed.reshape(HV, R, CHUNK).contiguous(), torch.cat([gam, diag], -1).contiguous()


def bench_raw(shapes=((2, 16384, 64), (1, 8192, 64)), reps: int = 30, diags: tuple = ()) -> list[dict]:
    """Stage 2 alone, the default (w in stage 2, packed) against the raw tiles (:class:`KdaFwdRecurRaw`, packed),
    interleaved rep by rep, L2 flushed before each launch; on the inputs of the ``kda`` suite (in-kernel gate,
    lower bound -5, l2norm, beta sigmoid, fp32 initial and final state). Prints and returns the medians. ``diags``:
    ``RAW_DIAGS`` variants timed in the same rotation (their results are wrong)."""
    import torch

    from cula.bench.timing import event_ms
    from cula.kernels.sm90 import kda_fwd as kf

    dev = torch.device("cuda")
    flush = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    rows = []
    for B, T, HV in shapes:
        gen = torch.Generator(device=dev).manual_seed(0)

        def r(*shape):
            return torch.randn(*shape, generator=gen, device=dev)

        q, k, v, g = (r(B, T, HV, DK).bfloat16() for _ in range(4))
        beta = r(B, T, HV).bfloat16()
        kw = dict(initial_state=0.1 * r(B, HV, DK, DV), output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=0.5 * r(HV), dt_bias=0.1 * r(HV * DK),
                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0)
        _, _, scr = kf.kda_fwd(q, k, v, g, beta, **kw, return_scratch=True)
        packed, gam = pack_aqk_tp(scr["aqk"], scr["tp"], scr["gam"])
        cu = kf._fixed_cu_seqlens(B, T, dev)
        chunks, seqs, _ = kf.chunk_tables(cu)
        flat = [x.reshape(B * T, HV, -1) for x in (q, k, g, v)]
        norms = raw_norms(flat[0], flat[1], chunks, HV, DK ** -0.5)

        def default():
            kf.kda_fwd(q, k, v, g, beta, **kw, stages=("recur",))

        def rawt(diag=""):
            def launch():
                run_raw(flat[0], flat[1], flat[2], flat[3], norms, kw["A_log"], kw["dt_bias"], packed, gam, chunks,
                        seqs, kw["initial_state"], True, "sigmoid", -5.0, pack=True, diag=diag)
            return launch

        fns = {"default": default, "raw": rawt(), **{f"raw_{d}": rawt(d) for d in diags}}
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()  # compile, warm
        for _ in range(reps):
            for name, fn in fns.items():
                flush.zero_()
                times[name].append(event_ms(fn))
        row = dict(B=B, T=T, HV=HV, **{f"{n}_ms": sorted(t)[len(t) // 2] for n, t in times.items()})
        print(row, flush=True)
        rows.append(row)
    return rows


def synthetic_scratch(HV: int, num_chunks: int, device, seed: int = 0) -> dict:
    """Random scratch of stage-1 magnitudes for timing (state stays bounded: γ < 1, small w and kg)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    R = num_chunks * CHUNK

    def r(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    return dict(w=r(HV, R, DK, scale=0.02), qg=r(HV, R, DK, scale=0.1), aqk=r(HV, R, CHUNK, scale=0.05),
                kgt=r(HV, DK, R, scale=0.02), u=r(HV, R, DV, scale=1.0),
                gam=0.9 + 0.1 * torch.rand(HV, num_chunks, DK, generator=gen, device=device))


BENCH_SHAPES = ((1, 4096, 64), (1, 16384, 64), (2, 16384, 64), (8, 4096, 64))


def bench(shapes=BENCH_SHAPES, variants=VARIANTS) -> list[dict]:
    """Time the recurrence alone per variant (median ms, L2 flushed between runs) on synthetic scratch
    with h0 and ht (the suite's flags), and check every variant's o and final state against v1's."""
    import torch
    import triton.testing

    from cula.kernels.sm90 import kda_fwd as kf

    dev = torch.device("cuda")
    rows = []
    for B, T, HV in shapes:
        chunks, seqs, NC = kf.fixed_length_tables(B, T, dev)
        scratch = synthetic_scratch(HV, NC, dev)
        h0 = torch.randn(B, HV, DK, DV, device=dev) * 0.1
        # bytes one call must move at least once: the scratch it reads and o it writes
        nbytes = sum(t.numel() * t.element_size() for t in scratch.values()) + B * T * HV * DV * 2
        row = dict(B=B, T=T, HV=HV)
        ref = None
        for variant in variants:
            launch, o, ht = prepare(scratch, chunks, seqs, B * T, h0, True, False, variant)
            launch()
            torch.cuda.synchronize()
            if ref is None:
                ref = (o, ht)
            same = torch.equal(o, ref[0]) and torch.equal(ht, ref[1])
            rel = max(((o.double() - ref[0].double()).norm() / ref[0].double().norm().clamp_min(1e-30)).item(),
                      ((ht.double() - ref[1].double()).norm() / ref[1].double().norm().clamp_min(1e-30)).item())
            ms = triton.testing.do_bench(launch, warmup=10, rep=100, return_mode="median")
            per_chunk_us = 1e3 * ms / (T // CHUNK)
            row[variant] = ms
            print(f"recur B{B} T{T} HV{HV} {variant}: {ms:.3f} ms  {per_chunk_us:.2f} us/chunk/CTA  "
                  f"{nbytes / ms / 1e6:.0f} GB/s  vs_{variants[0]}: {'bitwise' if same else f'rel {rel:.1e}'}",
                  flush=True)
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    import json

    if "--layout-facts" in argv:  # run with CUTE_DSL_ARCH=sm_90a set before Python starts
        print(json.dumps(layout_facts()))
        return 0
    if "--raw-bench" in argv:  # stage 2 with the raw tiles against the default (GPU); --raw-diag skip,pass1
        diags = argv[argv.index("--raw-diag") + 1].split(",") if "--raw-diag" in argv else ()
        bench_raw(diags=tuple(diags))
        return 0
    if "--bench" in argv:
        shapes = BENCH_SHAPES
        if "--shapes" in argv:  # "B,T,HV;B,T,HV"
            shapes = tuple(tuple(int(x) for x in s.split(",")) for s in argv[argv.index("--shapes") + 1].split(";"))
        bench(shapes)
        return 0
    print(__doc__)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))

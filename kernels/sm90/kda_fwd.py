"""KDA fused forward prefill for Hopper: host side of the two-kernel pipeline.

``kda_fwd(...)`` takes the arguments of ``fla.ops.kda.chunk_kda`` (0.6.0) that change the math and
returns ``(o, final_state)``. Stage 1 (``kda_fwd_intra``) does the token-parallel work per (chunk,
value head) into a chunk-padded bf16 scratch; stage 2 (``kda_fwd_recur``) runs the chunk recurrence
per (sequence, value head, V tile) with the state on chip (TMA + wgmma). See ``kda_fwd.md``.

``emulate_stages(...)`` is the same two-stage computation written in torch (float32/64), with the
same scratch layout: the CPU tests check it against ``cula.ref.kda``, and the GPU check compares each
kernel's scratch against it, so a wrong kernel points at its stage.

Run ``python -m cula.kernels.sm90.kda_fwd --check`` on a Hopper machine to compile, compare with the
references and time a few shapes.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import torch

from cula.kernels.common.fast_launch import sm_count  # the persistent recurrence's CTA cap
from cula.kernels.common.tensor_cache import PerTensorCache

CHUNK = 64
HEAD_DIM = 128
# Flipped to True only once the GPU tests in tests/test_kernel_kda_fwd.py pass on the device.
GPU_VALIDATED = True
# Dispatch takes this kernel by default since the `kda` suite run 20261203-070755-h200-4aa088a-2790
# (tensor-core stage 1 + recurrence v2): geomean 2.21x FLA fixed-length eager (1.79x CUDA graph),
# 1.12x varlen eager; B2 T16384 3.59 ms vs FLA 7.07 ms. (Before: run 20261202-172916-h200-510df0f-4304,
# SIMT stage 1 + recurrence v1, 0.44x fixed / 0.29x varlen, when it was off.)
# Stage 1's way of inverting I + Akk (kda_fwd_intra.INVERSES): "column" is the validated one;
# "blocked" passed the CPU emulation of the kernel source and awaits its GPU check
# (python -m cula.kernels.sm90.kda_fwd --check --inverse blocked).
INTRA_INVERSE = "column"
# Stage 1's kernel body (kda_fwd_intra.VARIANTS): "v1" is the validated one; "v2" (register-blocked
# products, ~106 KB smem for 2 CTAs/SM, bf16 q/k tiles) passed the CPU emulation of the kernel
# source and awaits its GPU check (python -m cula.kernels.sm90.kda_fwd --check --variant v2).
INTRA_VARIANT = "v1"
# The tensor-core stage 1 (kda_fwd_intra_tc) for the inputs whose math it is built for: the in-kernel
# gate with a lower bound in [MIN_LOWER_BOUND, 0] (bounded reference factors) or the softplus one, which
# it clamps at SOFTPLUS_FLOOR (a bounded 1.7e-5 approximation), and q/k l2norm (without it
# I + Akk can be ill-conditioned enough that the bf16 T' of the w/u products, FLA's choice too, loses
# accuracy the SIMT kernel's fp32 T keeps). Everything else takes the SIMT stage 1 above.
INTRA_TC = True
DISPATCH_OFF: str | None = None
#: ``CULA_KERNELS`` name that keeps the inputs of the SIMT stage 1 on this kernel although FLA is faster
#: there (see ``simt_reason``).
SIMT_OPT_IN = "kda_fwd_simt"
#: Log-space gates declared bounded (safe_gate) on the tensor-core stage 1 (session 16): validated on an H200 in
#: session 20 (tc-loggate-safe-varlen and tc-loggate-safe-floor PASS against the fp64 reference and FLA), so
#: dispatch takes them; False sends them to FLA again unless ``CULA_KERNELS=kda_fwd_loggate``.
LOG_GATE_VALIDATED = True
LOG_GATE_OPT_IN = "kda_fwd_loggate"
#: "u in stage 2" (session 17): with the tensor-core stage 1, stage 1 stops reading v and writing u and stores
#: T' = bf16(T diag β) beside Aqk (and -w for w); stage 2 loads v by TMA and forms v_newᵀ = vᵀ T'ᵀ + Sᵀ(-w)ᵀ in
#: one accumulator. Counted traffic per token and value head: stage 1 2,176 -> 1,792 B, stage 2 +128 B. On by
#: default since its H200 run (session 17): the 15 GPU tests of tests/test_kernel_kda_fwd.py -k u_in_recur pass,
#: and --split worst gave B2 T16384 H64 2.705 -> 2.612 ms (stage 1 1.988 -> 1.835), varlen n20 T4096 -3.2 to
#: -3.9%. ``CULA_KDA_U_IN_RECUR=0`` turns it off for A/B runs.
U_IN_RECUR = __import__("os").environ.get("CULA_KDA_U_IN_RECUR", "1") == "1"
#: Packed [Aqk | T'] (session 29, with U_IN_RECUR): stage 1 stores one [64, 64] tile a chunk, Aqk on and below the
#: diagonal and T' transposed above it, and T''s diagonal after γ in γ's row (recur.GAM_PITCH_PACK floats); stage 2
#: loads the tile twice and its math threads mask each copy while the chunk's first product, Sᵀ(-w)ᵀ, runs. 8 KB
#: fewer a chunk and value head written by stage 1 and read by stage 2 (of ~112 and ~96 KB). H100, session 30:
#: stage 2 -8.6%, both stages -3.0% at B2 T16384; on the varlen n20 T4096 rows (3-4 chunks a sequence, stage 2's
#: two-stage ring with the state buffer) stage 2 -1 to -3% and stage 1 +1 to +2% (its T' scatter), both -1 to
#: +0.5%: so by default where sequences average more than PACK_ABOVE_CHUNKS chunks, the lengths whose stage 2
#: runs three stages (recur.STATE_SMEM_MAX_CHUNKS; use_pack); with the clock diagnostic too (its slots follow γ's
#: packed rows since session 38). ``CULA_KDA_PACK=1`` / ``=0`` forces it on / off.
PACK = __import__("os").environ.get("CULA_KDA_PACK")
#: "w in stage 2" (session 32, with U_IN_RECUR): stage 1 stores -X = -(k̂ 2^Γ) (the w product's B operand) instead
#: of -w = T'(-X), straight from its operand tile as soon as phase 2 has formed it, and drops the w product and its
#: staging; stage 2 forms Yᵀ = vᵀ + Sᵀ(-X)ᵀ and v_newᵀ = bf16(Yᵀ) T'ᵀ: the same bytes, one k64 product off stage 1
#: and onto stage 2's chain. H100, session 32: the kda suite on one card with it on / off, 3.00x / 2.96x FLA (graph
#: geomean), every one of the 28 rows 0.2-3.0% faster with it (B2 T16384 2.538 / 2.579 ms); the split rows twice each:
#: stage 1 -3.3%, stage 2 +3 to +4% at B2 T16384, the n20 T4096 rows -0.9 to -1.5%; the 18 checks (unpacked and
#: packed) and 18 GPU tests pass. On by default; ``CULA_KDA_W_IN_RECUR=0`` turns it off.
W_IN_RECUR = __import__("os").environ.get("CULA_KDA_W_IN_RECUR", "1") == "1"
#: "Raw tiles" (session 39, opt-in): stage 1 stores the rows' inverse norms instead of qg, kgᵀ and -X (``raw_out``)
#: and stage 2 forms those tiles from q, k and g in a warpgroup of its own (``kda_fwd_recur.KdaFwdRecurRaw``). Needs
#: w in stage 2, the l2norm and a bf16 gate. Its GPU tests pass, but it loses (H100, session 40, B2 T16384: stage 1
#: 1.309 -> 1.009 ms, stage 2 1.051 -> 3.70 ms; kda_fwd.md). ``CULA_KDA_RAW_TILES=1`` turns it on.
RAW_TILES = __import__("os").environ.get("CULA_KDA_RAW_TILES", "0") == "1"
PACK_ABOVE_CHUNKS = 7  # = kda_fwd_recur.STATE_SMEM_MAX_CHUNKS (tests check it)


def use_pack(num_seqs: int, num_chunks: int) -> bool:
    """Whether kda_fwd packs [Aqk | T'] (with u in stage 2): CULA_KDA_PACK if set, else sequences of more than
    PACK_ABOVE_CHUNKS chunks on average (``num_chunks``: the chunk tables' rows, an upper bound for varlen)."""
    if PACK is not None:
        if PACK not in ("0", "1"):
            raise ValueError(f"CULA_KDA_PACK: expected '0' or '1' (or unset), got {PACK!r}")
        return PACK == "1"
    return num_chunks > PACK_ABOVE_CHUNKS * max(num_seqs, 1)


# --------------------------------------------------------------------------------------------------
# what the kernels accept
# --------------------------------------------------------------------------------------------------
def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    **_ignored,
) -> str | None:
    """None when ``kda_fwd`` can run these inputs, else the reason it cannot (for the dispatch table)."""
    if not GPU_VALIDATED:
        return "cula-sm90 kda_fwd: not validated on GPU yet"
    if not (q.is_cuda and torch.cuda.is_available()):
        return "cula-sm90 kda_fwd: inputs are not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"cula-sm90 kda_fwd: needs an SM90 (Hopper) GPU, got sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
    if chunk_size != CHUNK:
        return f"cula-sm90 kda_fwd: chunk_size {chunk_size} (only 64)"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"cula-sm90 kda_fwd: head dims K={q.shape[-1]}, V={v.shape[-1]} (only 128, 128)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            return f"cula-sm90 kda_fwd: {name} dtype {t.dtype} (only bfloat16)"
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            return f"cula-sm90 kda_fwd: {name} dtype {t.dtype} (bfloat16 or float32)"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"cula-sm90 kda_fwd: initial_state dtype {initial_state.dtype} (only float32)"
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)
    ):
        return "cula-sm90 kda_fwd: forward only (inputs require grad: FLA's autograd path is used)"
    misaligned = _misaligned(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if misaligned:
        return f"cula-sm90 kda_fwd: {misaligned}"
    return simt_reason(use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, safe_gate)


def simt_reason(use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, lower_bound: float | None,
                safe_gate: bool = False) -> str | None:
    """Why dispatch hands inputs that need the exact SIMT stage 1 to FLA, or None.

    Only the tensor-core stage 1 is faster than FLA. The SIMT one (every input without q/k l2norm or
    without a bounded gate, e.g. FLA's default call with a log-space ``g`` and no ``safe_gate``) measured
    0.38x FLA under CUDA graphs over the ``kda_exact`` suite (run 20261203-201413; B1 T16384 H64 10.2
    against 3.9 ms). So those inputs go to FLA when it is installed; ``CULA_KERNELS=kda_fwd_simt`` keeps them here, and
    without FLA this kernel still beats the torch reference by far.
    """
    from cula._dispatch import fla_installed, opted_in
    from cula.kernels.sm90.kda_fwd_intra_tc import MIN_LOWER_BOUND

    if intra_kind(use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, safe_gate) == "tc":
        if use_gate_in_kernel or LOG_GATE_VALIDATED or opted_in(LOG_GATE_OPT_IN):
            return None
        return ("cula-sm90 kda_fwd: log-space gates (safe_gate) on the tensor-core stage 1 are not yet validated "
                f"on a GPU; FLA runs them (CULA_KERNELS={LOG_GATE_OPT_IN} opts in)")
    if opted_in(SIMT_OPT_IN) or not fla_installed():
        return None
    return ("cula-sm90 kda_fwd: these inputs need its exact SIMT stage 1 (the tensor-core one takes "
            f"use_qk_l2norm_in_kernel with use_gate_in_kernel, or a log-space g declared bounded by "
            f"safe_gate, and no lower_bound or one in [{MIN_LOWER_BOUND:g}, 0]), "
            f"which measured 0.38x FLA; FLA runs them (CULA_KERNELS={SIMT_OPT_IN} keeps them here)")


#: Byte alignment the kernels are compiled for (16-byte vector and TMA accesses; beta is read by element).
_ALIGN = dict(q=16, k=16, v=16, g=16, beta=4, initial_state=16)


def _misaligned(**tensors) -> str | None:
    """Which input's data pointer the compiled kernels cannot take (views at odd offsets), or None."""
    for name, t in tensors.items():
        if t is not None and t.data_ptr() % _ALIGN[name]:
            return f"{name} data pointer is not {_ALIGN[name]}-byte aligned (a view at an odd offset)"
    return None


def _too_big(total_tokens: int, num_heads_v: int, cu_seqlens: torch.Tensor | None, batch: int) -> str | None:
    """Why the kernels' 32-bit offsets cannot address these sizes (None when they can)."""
    n_seq = batch if cu_seqlens is None else max(cu_seqlens.numel() - 1, 1)
    # chunk-padded scratch rows: at most one partial chunk per sequence
    rows = total_tokens + CHUNK * n_seq
    worst = max(rows * num_heads_v * HEAD_DIM, n_seq * num_heads_v * HEAD_DIM * HEAD_DIM)
    if worst >= MAX_ELEMENTS:
        return f"{worst} elements in one tensor exceed the 32-bit offsets (< {MAX_ELEMENTS})"
    return None


# --------------------------------------------------------------------------------------------------
# chunk bookkeeping shared by the kernels and the emulation
# --------------------------------------------------------------------------------------------------
def chunk_tables(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-chunk ``[NC, 2]`` (first token, valid rows) and per-sequence ``[N, 2]`` (first chunk,
    number of chunks), int32 on ``cu_seqlens``' device, and ``NC``. Zero-length sequences own no chunk."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    nch = (lens + CHUNK - 1) // CHUNK
    first = torch.cumsum(nch, 0) - nch
    num_chunks = int(nch.sum().item())
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), nch)
    local = torch.arange(num_chunks, device=cu.device) - first[seq_of]
    tok0 = cu[:-1][seq_of] + CHUNK * local
    nvalid = torch.minimum(cu[1:][seq_of] - tok0, torch.full_like(tok0, CHUNK))
    chunks = torch.stack([tok0, nvalid], 1).to(torch.int32).contiguous()
    seqs = torch.stack([first, nch], 1).to(torch.int32).contiguous()
    return chunks, seqs, num_chunks


_FIXED_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def fixed_length_tables(B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_tables` of ``B`` sequences of ``T`` tokens, built on the host once per shape and kept
    on ``device``: a fixed-length call then needs no device-to-host sync (CUDA-graph capturable)."""
    key = (B, T, str(device))
    tables = _FIXED_TABLES.get(key)
    if tables is None:
        chunks, seqs, nc = chunk_tables(torch.arange(B + 1, dtype=torch.int64) * T)
        tables = (chunks.to(device), seqs.to(device), nc)
        if not _capturing():  # copies made inside a capture hold their values only once it runs
            _FIXED_TABLES[key] = tables
    return tables


#: Sequence-sized tables of recent varlen calls: a model passes one cu_seqlens to every layer, so the
#: tables are built once per tensor and version.
_VARLEN_TABLES = PerTensorCache()


def varlen_tables(cu_seqlens: torch.Tensor, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_tables` without a device-to-host copy: ``NC`` is the bound
    ``total_tokens // 64 + N`` (no sequence has more than ``len // 64 + 1`` chunks), known from shapes.

    Chunks past the real count are dummies ``(first token 0, 0 valid rows)``: the tensor-core stage 1
    returns at once for them, the SIMT one (whose loads are guarded by the row count) writes zeros, into
    scratch rows nobody reads; stage 2 only walks each sequence's own chunks (``seqs``). So a varlen call
    needs no sync and can be captured in a CUDA graph. Built on ``cu_seqlens``' device with torch ops;
    cached per tensor and in-place version.
    """
    hit = _VARLEN_TABLES.get(cu_seqlens, total_tokens)
    if hit is not None:
        return hit
    cu = cu_seqlens.to(torch.int64)
    n_seq = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + CHUNK - 1) // CHUNK
    ends = torch.cumsum(nch, 0)
    first = ends - nch
    nc_max = total_tokens // CHUNK + n_seq
    c = torch.arange(nc_max, device=cu.device)
    owner = torch.searchsorted(ends, c, right=True)  # the sequence whose chunk range holds c (N: none)
    real = owner < n_seq
    seq_c = owner.clamp(max=n_seq - 1)
    tok0 = cu[:-1][seq_c] + CHUNK * (c - first[seq_c])
    nvalid = torch.minimum(cu[1:][seq_c] - tok0, torch.full_like(tok0, CHUNK))
    tok0 = torch.where(real, tok0, torch.zeros_like(tok0))
    nvalid = torch.where(real, nvalid, torch.zeros_like(nvalid))
    chunks = torch.stack([tok0, nvalid], 1).to(torch.int32)
    seqs = torch.stack([first, nch], 1).to(torch.int32)
    return _VARLEN_TABLES.put(cu_seqlens, total_tokens, (chunks, seqs, nc_max))


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (nothing cached then)."""
    from cula.kernels.common.fast_launch import stream_capturing

    return stream_capturing()


_DUMMY: dict[str, torch.Tensor] = {}


def _dummy(device) -> torch.Tensor:
    """A 16-byte-aligned fp32 buffer for pointer arguments a compiled flag set never dereferences."""
    key = str(device)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.zeros(64, dtype=torch.float32, device=device)
    return t


def _flatten(q, k, v, g, beta):
    """q, k, v, g, beta with the batch and time dims merged (views)."""
    B, T = q.shape[:2]
    return tuple(x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))


def _fixed_cu_seqlens(B: int, T: int, device) -> torch.Tensor:
    """The cu_seqlens of ``B`` sequences of ``T`` tokens (the emulation's chunk tables need them; the
    kernel path keeps cached tables instead, so a fixed-length call launches nothing but its kernels)."""
    return torch.arange(B + 1, device=device, dtype=torch.int64) * T


def _gate_and_norm(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, dtype):
    from cula.ref._gates import beta_sigmoid, decay_gate, l2norm

    q, k, g, beta = (x.to(dtype) for x in (q, k, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    if use_gate_in_kernel:
        g = decay_gate(g, None if A_log is None else A_log.to(dtype),
                       None if dt_bias is None else dt_bias.to(dtype), lower_bound)
    return q, k, g, beta


# --------------------------------------------------------------------------------------------------
# torch emulation of the two stages (same scratch layout, no bf16 rounding)
# --------------------------------------------------------------------------------------------------
def emulate_stages(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                   use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
                   lower_bound=None, state_v_first=False, cu_seqlens=None, *, dtype=torch.float64,
                   identity_response=False, u_in_recur=False, w_in_recur=False):
    """Returns ``(o, final_state, scratch)``; ``scratch`` holds w, u, qg, aqk, kgt, gam as the kernels
    write them (``[HV, NC*64, ...]``), in ``dtype``; with ``u_in_recur`` (``U_IN_RECUR``'s scratch) -w for w,
    ``tp`` = T diag(β) ``[HV, NC*64, 64]`` for u, and ``v``, the chunk-padded input rows stage 2 reads; with
    ``w_in_recur`` too (``W_IN_RECUR``'s scratch) ``x`` = -(k̂ 2^Γ) for -w.
    With ``identity_response`` also ``o_I`` and ``M`` as :func:`kda_fwd` computes them (stage 2 again with
    ``u = 0`` from ``S0 = I``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    qf, kf, vf, gf, bf = _flatten(q, k, v, g, beta)
    cu = cu_seqlens if cu_seqlens is not None else _fixed_cu_seqlens(B, T, q.device)
    qf, kf, gf, bf = _gate_and_norm(qf, kf, gf, bf, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
                                    dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, dtype)
    vf = vf.to(dtype)
    G = HV // H
    qf, kf = qf.repeat_interleave(G, 1) * 1.0, kf.repeat_interleave(G, 1)
    chunks, seqs, NC = chunk_tables(cu)
    R = NC * CHUNK
    dev = q.device
    # gather each chunk's rows (zeros past the end): [NC, 64, HV, D]
    idx = chunks[:, :1].long() + torch.arange(CHUNK, device=dev)[None]
    valid = torch.arange(CHUNK, device=dev)[None] < chunks[:, 1:].long()
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    m = valid[..., None, None].to(dtype)
    qc, kc, vc, gc = (x[idx] * m for x in (qf, kf, vf, gf))
    bc = bf[idx] * valid[..., None].to(dtype)
    gam_log = gc.cumsum(1) / math.log(2.0)  # Γ in log2 units: [NC, 64, HV, K]
    qc = qc * scale
    # per (chunk, head) matrices: move heads next to chunks -> [NC, HV, 64, D]
    qc, kc, vc, Gm = (x.transpose(1, 2) for x in (qc, kc, vc, gam_log))
    bc = bc.transpose(1, 2)
    diff = Gm[..., :, None, :] - Gm[..., None, :, :]  # [NC, HV, i, j, K]
    lower = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=dev))
    fac = torch.where(lower[..., None], torch.exp2(torch.where(lower[..., None], diff, 0)), 0)
    akk = torch.einsum("nhid,nhjd,nhijd->nhij", kc, kc, fac) * bc[..., :, None]
    akk = akk.tril(-1)
    aqk = torch.einsum("nhid,nhjd,nhijd->nhij", qc, kc, fac)
    eye = torch.eye(CHUNK, dtype=dtype, device=dev)
    tinv = torch.linalg.solve_triangular(eye + akk, eye.expand_as(akk), upper=False, unitriangular=True)
    w = tinv @ (bc[..., None] * kc * torch.exp2(Gm))
    u = tinv @ (bc[..., None] * vc)
    qg = qc * torch.exp2(Gm)
    glast = Gm[..., -1:, :]
    kg = kc * torch.exp2(glast - Gm)
    gam = torch.exp2(glast[..., 0, :])  # [NC, HV, K]

    def rows(x):  # [NC, HV, 64, D] -> [HV, NC*64, D]
        return x.permute(1, 0, 2, 3).reshape(HV, R, x.shape[-1])

    scratch = dict(w=rows(w), u=rows(u), qg=rows(qg), aqk=rows(aqk), kgt=rows(kg).transpose(1, 2),
                   gam=gam.permute(1, 0, 2))
    if u_in_recur:
        assert not identity_response, "the identity response runs the default stages"
        del scratch["u"]
        scratch.update(w=-scratch["w"], tp=rows(tinv * bc[..., None, :]), v=rows(vc))
        if w_in_recur:
            del scratch["w"]
            scratch.update(x=-rows(kc * torch.exp2(Gm)))
    else:
        assert not w_in_recur, "w in stage 2 needs u in stage 2"
    o, ht = emulate_recurrence(scratch, chunks, seqs, B * T, initial_state, output_final_state,
                               state_v_first, dtype)
    if not identity_response:
        return o.reshape(B, T, HV, V), ht, scratch
    eye = torch.eye(K, dtype=dtype, device=dev).expand(seqs.shape[0], HV, K, K)
    u_zero = scratch["u"].new_zeros(*scratch["u"].shape[:2], K)
    o_id, m_id = emulate_recurrence(scratch | dict(u=u_zero), chunks, seqs, B * T, eye,
                                    True, False, dtype)
    return o.reshape(B, T, HV, V), ht, scratch, o_id.reshape(B, T, HV, K), m_id


def emulate_recurrence(scratch, chunks, seqs, total_tokens, initial_state, output_final_state,
                       state_v_first, dtype):
    """Stage 2 in torch: ``(o [TT, HV, V], final_state)`` from the scratch of stage 1 (either form:
    ``u``, or ``tp``, ``v`` and -w for ``U_IN_RECUR``, or ``tp``, ``v`` and -X for ``W_IN_RECUR``)."""
    x_in = "x" in scratch
    w, qg, aqk, kgt, gam = (scratch[n].to(dtype) for n in ("x" if x_in else "w", "qg", "aqk", "kgt", "gam"))
    t_in = "tp" in scratch
    u, tp, vr = ((None, scratch["tp"].to(dtype), scratch["v"].to(dtype)) if t_in
                 else (scratch["u"].to(dtype), None, None))
    HV, _, K = w.shape
    V = (vr if t_in else u).shape[-1]
    N = seqs.shape[0]
    o = torch.zeros(total_tokens, HV, V, dtype=dtype, device=w.device)
    hts = []
    for n in range(N):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
            S = S.transpose(-1, -2) if state_v_first else S
        else:
            S = torch.zeros(HV, K, V, dtype=dtype, device=w.device)
        c0, nc = int(seqs[n, 0]), int(seqs[n, 1])
        for c in range(c0, c0 + nc):
            r = slice(c * CHUNK, (c + 1) * CHUNK)
            if x_in:  # w holds -X: v_new = T'(v - X S)
                vn = tp[:, r] @ (vr[:, r] + w[:, r] @ S)
            else:
                vn = tp[:, r] @ vr[:, r] + w[:, r] @ S if t_in else u[:, r] - w[:, r] @ S
            oc = qg[:, r] @ S + aqk[:, r] @ vn
            S = gam[:, c, :, None] * S + kgt[:, :, r] @ vn
            tok0, nv = int(chunks[c, 0]), int(chunks[c, 1])
            o[tok0:tok0 + nv] = oc[:, :nv].transpose(0, 1)
        hts.append(S.transpose(-1, -2) if state_v_first else S)
    ht = torch.stack(hts) if output_final_state and N > 0 else None
    return o, ht


# --------------------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------------------
_COMPILED: dict[tuple, Callable] = {}


def _cute_dtype(dt: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}[dt]


#: Offsets inside the kernels are 32-bit: every tensor they index must have fewer elements than this.
MAX_ELEMENTS = 2 ** 31


def _ptr(t: torch.Tensor, align: int = 16):
    """A global-memory pointer to ``t``'s data; ``align`` must equal what the kernel was compiled with."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    _check_aligned((t, align))
    dtype = _cute_dtype(t.dtype)
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


#: Launch through kernels/common/fast_launch.Launcher: its first call per compiled kernel goes through the
#: DSL's own path and compares the packed arguments byte for byte, then later calls skip the DSL's
#: per-argument wrapping (tens of microseconds per kernel); any mismatch falls back with one warning.
FAST_LAUNCH = True
_LAUNCHERS: dict[tuple, object] = {}


@functools.cache  # per dtype triple: a call's host path then builds no specs (~20 dataclasses)
def _intra_specs(q_dt, g_dt, beta_dt) -> tuple:
    """Runtime arguments of both stage-1 kernels, as ``kda_fwd_intra.fake_args`` compiles them."""
    import cutlass

    from cula.kernels.common.fast_launch import ArgSpec

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [(q_dt, 16), (q_dt, 16), (q_dt, 16), (g_dt, 16), (beta_dt, 4), (f32, 4), (f32, 4), (i32, 8),
            (bf16, 16), (bf16, 16), (bf16, 16), (bf16, 16), (bf16, 16), (f32, 16)]
    return (*(ArgSpec("ptr", d, a) for d, a in ptrs), *(ArgSpec("i32") for _ in range(4)),
            ArgSpec("f32"), ArgSpec("f32"), ArgSpec("stream"))


@functools.cache
def _recur_specs(o_dt) -> tuple:
    """Runtime arguments of the recurrence kernel, as ``kda_fwd_recur.fake_args`` compiles them."""
    import cutlass

    from cula.kernels.common.fast_launch import ArgSpec

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [(bf16, 16)] * 5 + [(f32, 16), (i32, 8), (i32, 8), (o_dt, 16), (f32, 16), (f32, 16)]
    return (*(ArgSpec("ptr", d, a) for d, a in ptrs), *(ArgSpec("i32") for _ in range(5)), ArgSpec("stream"))


@functools.cache
def _recur_raw_specs(o_dt) -> tuple:
    """Runtime arguments of the raw-tile recurrence (``KdaFwdRecurRaw``), as ``kda_fwd_recur.fake_args(raw=True)``
    compiles them."""
    import cutlass

    from cula.kernels.common.fast_launch import ArgSpec

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [(bf16, 16)] * 3 + [(f32, 16), (f32, 4), (f32, 4), (bf16, 16), (bf16, 16), (f32, 16), (i32, 8), (i32, 8),
                               (o_dt, 16), (f32, 16), (f32, 16)]
    return (*(ArgSpec("ptr", d, a) for d, a in ptrs), *(ArgSpec("i32") for _ in range(6)), ArgSpec("f32"),
            ArgSpec("stream"))


def _launcher(kind: str, key: tuple, make_kernel: Callable, specs: tuple):
    """The compiled kernel of ``(kind, key)`` behind a Launcher (one compile per static flag set)."""
    hit = _LAUNCHERS.get((kind, key))
    if hit is None:
        from cula.kernels.common.fast_launch import compile_launcher

        hit = _LAUNCHERS[(kind, key)] = compile_launcher(make_kernel(), specs, fast=FAST_LAUNCH, aot_key=(kind, key))
    return hit


def _check_aligned(*tensors_and_aligns) -> None:
    for t, align in tensors_and_aligns:
        if t.data_ptr() % align:
            raise ValueError(f"tensor data pointer {t.data_ptr():#x} is not {align}-byte aligned")


def kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    return_scratch: bool = False,
    stages: tuple[str, ...] = ("intra", "recur"),
    identity_response: bool = False,
    fla_factors: bool = False,
):
    """KDA forward on the two SM90 kernels.

    Args: as ``fla.ops.kda.chunk_kda`` 0.6.0 — q, k ``[B, T, H, 128]`` bf16; v ``[B, T, HV, 128]`` bf16;
    g ``[B, T, HV, 128]`` bf16/fp32 (log-space, or raw with ``use_gate_in_kernel``); beta ``[B, T, HV]``
    bf16/fp32; initial_state fp32 ``[N, HV, 128, 128]`` (K-first, or V-first with ``state_v_first``);
    cu_seqlens int32/int64 ``[N+1]`` with ``B == 1``. ``safe_gate`` changes nothing here (the math is
    exact for any gate).
    Returns: ``o [B, T, HV, 128]`` (v's dtype) and the fp32 final state (or None); with
    ``return_scratch`` also the stage-1 scratch dict. ``stages`` (profiling only) names the kernels
    to launch; leaving one out gives wrong outputs but times the other alone.

    ``identity_response`` (context parallel): also return each sequence's response to its initial state,
    ``o_I [B, T, HV, K]`` (v's dtype; ``o_I[t] @ S0`` is S0's contribution to ``o_t``) and its transition
    ``M [N, HV, K, K]`` fp32 K-first (``S_end = M S0 + S_end(0)``), as ``(o, ht, o_I, M)``. They come from
    a second stage-2 launch on the same stage-1 scratch with ``u = 0`` and ``S0 = I`` (value columns
    evolve independently), run on a side stream so the two sequential passes overlap.

    ``fla_factors`` (training: ``cula.kda._train``): also return what FLA 0.6.0's ``chunk_kda`` saves
    for its backward from its intra-chunk pass, as ``(o, ht, Aqk, Akk)``: ``Aqk [B, T, HV, 64]``
    (``scale · q̂ᵢ·(k̂ⱼ ⊙ 2^(Γᵢ−Γⱼ))`` for j ≤ i of i's chunk, zero above) and ``Akk [B, T, HV, 64]``
    (``T = (I + Akk)^-1``, unit lower triangular), both bf16, in FLA's token-major layout. Only for the
    tensor-core stage 1 (l2norm and the in-kernel gate) and inputs within the 32-bit offsets.
    """
    from cula.kernels.common.fast_launch import current_stream_handle
    from cula.kernels.sm90 import kda_fwd_intra as intra
    from cula.kernels.sm90 import kda_fwd_recur as recur

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    TT = B * T
    scale = K ** -0.5 if scale is None else float(scale)
    if fla_factors:
        reason = fla_factors_reason(TT, HV, cu_seqlens, B, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                    lower_bound, identity_response, return_scratch, stages, safe_gate)
        if reason is not None:
            raise ValueError(f"fla_factors: {reason}")
    if _too_big(TT, HV, cu_seqlens, B):  # before the dense copies below: each piece makes its own
        return _fwd_in_pieces(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                              identity_response, return_scratch, stages,
                              dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                                   state_v_first=state_v_first))
    qf, kf, vf, gf, bf = (x.contiguous() for x in _flatten(q, k, v, g, beta))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    # every token belongs to one sequence (cu_seqlens[-1] == B*T is validated): o is fully written
    o = torch.empty(TT, HV, V, dtype=v.dtype, device=dev)
    h0 = initial_state.contiguous() if initial_state is not None else None
    ht = torch.empty(max(N, 1), HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    if TT == 0 or N == 0:  # no tokens: the state passes through
        if output_final_state:
            ht = h0.clone() if h0 is not None else torch.zeros(N, HV, K, V, device=dev)
            ht = ht if N > 0 else None
        out = o.reshape(B, T, HV, V)
        if fla_factors:
            return out, ht, q.new_empty(B, T, HV, CHUNK), q.new_empty(B, T, HV, CHUNK)
        if identity_response:  # the identity passes through too
            eye = torch.eye(K, dtype=torch.float32, device=dev).expand(N, HV, K, K).contiguous()
            return out, ht, o.new_zeros(B, T, HV, K), eye
        return (out, ht) if not return_scratch else (out, ht, {})
    if cu_seqlens is None:
        chunks, seqs, NC = fixed_length_tables(B, T, dev)
    elif return_scratch:  # exact chunk count (one sync): the checks compare the scratch row for row
        chunks, seqs, NC = chunk_tables(cu_seqlens.to(dev))
    else:
        chunks, seqs, NC = varlen_tables(cu_seqlens, TT)
    R = NC * CHUNK
    bf16 = torch.bfloat16
    kind = intra_kind(use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, safe_gate)
    # the tensor-core stage 1 and the v2 recurrence, without the path that runs the default stages (stage 1's
    # timing diagnostics, CULA_KDA_TC_DIAG, time whatever the default is: since session 18 u in stage 2's)
    tc_v2 = kind == "tc" and recur.RECUR_VARIANT == "v2" and not identity_response
    # u in stage 2 (U_IN_RECUR): the Aqk rows get T' beside them, w is stored negated, u is not formed
    u_split = U_IN_RECUR and tc_v2 and not fla_factors
    pack = u_split and use_pack(N, NC)
    x_split = u_split and W_IN_RECUR  # w in stage 2: the w buffer holds -X
    # raw tiles: stage 1 writes only the norms ([HV, NC, 2, 64] fp32, through the kgᵀ pointer; the qg and w
    # pointers get the same buffer, never written), stage 2 reads q, k, g
    raw = (RAW_TILES and x_split and kind == "tc" and bool(use_qk_l2norm_in_kernel) and g.dtype == bf16
           and v.dtype == bf16 and not return_scratch)
    if raw:
        nrm = torch.empty(HV, NC, 2, CHUNK, dtype=torch.float32, device=dev)
    w = torch.empty(HV, R, K, dtype=bf16, device=dev) if not raw else nrm
    u = None if u_split else torch.empty(HV, R, V, dtype=bf16, device=dev)
    # with fla_factors stage 1 writes bf16(T) right after qg in the same buffer (kda_fwd_intra_tc.emit_akk)
    qg_akk = (torch.empty(HV * R * (K + (CHUNK if fla_factors else 0)), dtype=bf16, device=dev) if not raw
              else nrm)
    qg = qg_akk[:HV * R * K].view(HV, R, K) if not raw else nrm
    # Aqk (| T'), or the packed tile
    aqk_tp = torch.empty(HV, R, 2 * CHUNK if u_split and not pack else CHUNK, dtype=bf16, device=dev)
    aqk = aqk_tp[..., :CHUNK]
    kgt = torch.empty(HV, K, R, dtype=bf16, device=dev) if not raw else nrm
    if kind == "tc" and "intra" in stages and _stage1_clock():
        gam = _clock_buffer(HV, NC, recur.GAM_PITCH_PACK if pack else K, chunks, dev)
    else:
        gam = torch.empty(HV, NC, recur.GAM_PITCH_PACK if pack else K, dtype=torch.float32, device=dev)
    dummy = _dummy(dev)
    a_log = A_log.float().contiguous() if (use_gate_in_kernel and A_log is not None) else dummy
    dtb = dt_bias.float().contiguous() if (use_gate_in_kernel and dt_bias is not None) else dummy
    if raw:  # the transform reads A_log and dt_bias whatever the gate (zeros: A = 1, no bias)
        raw_alog = a_log if a_log is not dummy else torch.zeros(HV, dtype=torch.float32, device=dev)
        raw_dtb = dtb if dtb is not dummy else torch.zeros(HV * K, dtype=torch.float32, device=dev)
    stream = current_stream_handle(dev.index if dev.index is not None else torch.cuda.current_device())
    _check_aligned((qf, 16), (kf, 16), (vf, 16), (gf, 16), (bf, 4), (a_log, 4), (dtb, 4), (o, 16),
                   *(((h0, 16),) if h0 is not None else ()))

    dts = (_cute_dtype(q.dtype), _cute_dtype(g.dtype), _cute_dtype(beta.dtype))
    log_tc = kind == "tc" and not use_gate_in_kernel  # a precomputed gate, bounded by the caller
    softplus_tc = kind == "tc" and use_gate_in_kernel and lower_bound is None
    if (softplus_tc or log_tc) and lower_bound is None:  # the tensor-core stage 1 clamps at this floor
        from cula.kernels.sm90.kda_fwd_intra_tc import SOFTPLUS_FLOOR
        lb = SOFTPLUS_FLOOR
    else:
        lb = float(lower_bound) if lower_bound is not None else 0.0
    intra_values = (qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(), bf.data_ptr(), a_log.data_ptr(),
                    dtb.data_ptr(), chunks.data_ptr(), w.data_ptr(), (aqk_tp if u_split else u).data_ptr(),
                    qg.data_ptr(), aqk.data_ptr(),
                    kgt.data_ptr(), gam.data_ptr(), TT, H, HV, NC, scale, lb, stream)
    o_dt = _cute_dtype(v.dtype)
    variant, pf = recur.RECUR_VARIANT, recur.V2_H0_PREFETCH

    def launch_recur(u_in, h_in, o_out, h_out, v_first: bool, pdl: bool, stream_handle: int) -> None:
        rflags = dict(has_initial_state=h_in is not None, output_final_state=h_out is not None,
                      state_v_first=v_first)
        ssm = variant == "v2" and recur.use_state_smem(N, NC, h_in is not None or h_out is not None)
        pair = (recur.pair_refusal(x_split, raw, pack, recur.WIDE_PACK_MASK, ssm) is None
                and recur.use_pair(N, HV, sm_count(dev)))
        if u_split:  # only set, so the keys of the other calls stay as before (u_in is the input v)
            rflags.update(t_in=True)
            if pack:  # the mask named in the key (pair and raw take the word mask, the split launch PACK_MASK's)
                rflags.update(pack=True, pack_mask=recur.pack_mask_for(pair, raw))
            if x_split:
                rflags.update(x_in=True)
            if recur.RECUR_DIAG:  # timing diagnostics: o is wrong
                warnings.warn(f"CULA_KDA_RECUR_DIAG={','.join(recur.RECUR_DIAG)}: stage 2's outputs are wrong "
                              "(timing only)", stacklevel=2)
                rflags.update(diag=recur.RECUR_DIAG)
        if pair:
            rflags.update(pair=True)  # (only set: the other keys stay as before)
        if raw:
            gate = "log" if log_tc else ("softplus" if softplus_tc else "sigmoid")
            for name in ("t_in", "x_in"):
                rflags.pop(name)
            launcher = _launcher("recur_raw", (tuple(sorted(rflags.items())), o_dt, gate, pf, pdl, ssm),
                                 lambda: recur.KdaFwdRecurRaw(**rflags, gate=gate, h0_prefetch=pf, pdl=pdl,
                                                              state_smem=ssm),
                                 _recur_raw_specs(o_dt))
            launcher(
                kf.data_ptr(), qf.data_ptr(), gf.data_ptr(), nrm.data_ptr(), raw_alog.data_ptr(), raw_dtb.data_ptr(),
                aqk.data_ptr(), u_in.data_ptr(), gam.data_ptr(), chunks.data_ptr(), seqs.data_ptr(), o_out.data_ptr(),
                (h_in if h_in is not None else dummy).data_ptr(), (h_out if h_out is not None else dummy).data_ptr(),
                TT, HV, NC, N, sm_count(dev), HV // H, lb, stream_handle)
            return
        launcher = _launcher("recur", (tuple(sorted(rflags.items())), o_dt, variant, pf, pdl, ssm),
                             lambda: recur.KdaFwdRecur(**rflags, variant=variant, h0_prefetch=pf, pdl=pdl,
                                                       state_smem=ssm),
                             _recur_specs(o_dt))
        launcher(
            w.data_ptr(), qg.data_ptr(), aqk.data_ptr(), kgt.data_ptr(), u_in.data_ptr(), gam.data_ptr(),
            chunks.data_ptr(), seqs.data_ptr(), o_out.data_ptr(), (h_in if h_in is not None else dummy).data_ptr(),
            (h_out if h_out is not None else dummy).data_ptr(), TT, HV, NC, N,
            sm_count(dev), stream_handle)

    intra_launch = None
    if "intra" in stages and kind == "tc":
        from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

        tc_flags = dict(use_qk_l2norm=True, has_a_log=A_log is not None, has_dt_bias=dt_bias is not None,
                        use_beta_sigmoid=bool(use_beta_sigmoid_in_kernel),
                        allow_neg_eigval=bool(allow_neg_eigval), group=HV // H,
                        inv_wgmma=intra_tc.INV_WGMMA,
                        pdl_trigger=recur.PDL_TRIGGER if recur.PDL and recur.PDL_TRIGGER != "none" else "",
                        prefetch_ahead=intra_tc.PREFETCH_AHEAD, softplus_gate=softplus_tc)
        if fla_factors:  # only set, so the keys of the other calls stay as before
            tc_flags.update(emit_akk=True)
        if u_split:  # (pU, unused then, gets the Aqk buffer: valid memory for the descriptor it is given)
            tc_flags.update(t_out=True)
            if pack:
                tc_flags.update(pack=True)
            if x_split:
                tc_flags.update(x_out=True)
            if raw:
                tc_flags.update(raw_out=True)
        if log_tc:
            tc_flags.update(log_gate=True, has_a_log=False, has_dt_bias=False)
        if intra_tc.GATE_FACTORS != intra_tc.GATE_FACTOR_MODES[0]:  # A/B runs only: the default keys stay short
            tc_flags.update(gate_factors=intra_tc.GATE_FACTORS)
        if intra_tc.SUBST != intra_tc.SUBST_MODES[0]:
            tc_flags.update(subst=intra_tc.SUBST)
        block = factor_block(lb, softplus_tc, log_tc)
        if intra_tc.PHASE1 != intra_tc.PHASE1_MODES[0]:
            tc_flags.update(phase1=intra_tc.PHASE1)
        order = intra_tc.ORDER if NC <= intra_tc.MAX_GRID_Y else "chunk"  # "head_rev"'s grid is [HV, NC]
        if order != intra_tc.ORDER_MODES[0]:
            tc_flags.update(order=order)
        if block != intra_tc.FACTOR_BLOCKS[0]:
            tc_flags.update(factor_block=block)
        if intra_tc.WIDEN != intra_tc.WIDEN_MODES[0]:
            tc_flags.update(widen=intra_tc.WIDEN)
        if intra_tc.KGT != intra_tc.KGT_MODES[0] and block != intra_tc.SUB:
            tc_flags.update(kgt=intra_tc.KGT)
        if intra_tc.CTAS != intra_tc.CTAS_MODES[0] and x_split and block != intra_tc.SUB:
            if set(intra_tc.DIAG) <= set(intra_tc.CTAS3_DIAGS):
                tc_flags.update(ctas=intra_tc.CTAS)  # three CTAs an SM: only this stage 1 leaves the tiles to drop
            else:  # session 36 compared such a run with the default unawares
                warnings.warn(f"CULA_KDA_TC_DIAG={','.join(intra_tc.DIAG)}: stage 1 runs at {intra_tc.CTAS_MODES[0]} "
                              f"CTAs an SM, not the default's {intra_tc.CTAS} (the three-CTA build takes only "
                              f"{', '.join(intra_tc.CTAS3_DIAGS)}): time it against CULA_KDA_TC_CTAS="
                              f"{intra_tc.CTAS_MODES[0]}", RuntimeWarning, stacklevel=2)
        if intra_tc.DIAG:  # timing diagnostics: only set, so the keys stay as before
            if set(intra_tc.DIAG) - set(intra_tc.SAME_OUTPUT_DIAGS):
                warnings.warn(f"CULA_KDA_TC_DIAG={','.join(intra_tc.DIAG)}: stage 1's outputs are wrong (timing "
                              "only)", RuntimeWarning, stacklevel=2)
            tc_flags.update(diag=intra_tc.DIAG)
        intra_launch = _launcher("intra_tc", (tuple(sorted(tc_flags.items())), dts),
                                 lambda: intra_tc.KdaFwdIntraTC(**tc_flags), _intra_specs(*dts))
    elif "intra" in stages:
        flags = dict(
            use_qk_l2norm=bool(use_qk_l2norm_in_kernel), use_gate=bool(use_gate_in_kernel),
            has_a_log=A_log is not None, has_dt_bias=dt_bias is not None,
            use_lower_bound=bool(use_gate_in_kernel and lower_bound is not None),
            use_beta_sigmoid=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
            group=HV // H, inverse=INTRA_INVERSE, variant=INTRA_VARIANT, prefetch_ahead=intra.PREFETCH_AHEAD,
        )
        intra_launch = _launcher("intra", (tuple(sorted(flags.items())), dts), lambda: intra.KdaFwdIntra(**flags),
                                 _intra_specs(*dts))
    if intra_launch is not None:
        intra_launch(*intra_values)

    identity = None
    if identity_response and "recur" in stages:
        # Own buffers, allocated before the fork: the side stream only reads what stage 1 wrote.
        o_id = torch.empty(TT, HV, K, dtype=v.dtype, device=dev)
        m_id = torch.empty(N, HV, K, K, dtype=torch.float32, device=dev)
        eye = torch.eye(K, dtype=torch.float32, device=dev).expand(N, HV, K, K).contiguous()
        u_zero = torch.empty_like(u)
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            u_zero.zero_()
            launch_recur(u_zero, eye, o_id, m_id, False, False, side.cuda_stream)
        identity = (o_id, m_id, side)
    if "recur" in stages:
        launch_recur(vf if u_split else u, h0, o, ht, bool(state_v_first),
                     recur.PDL and NC * HV <= recur.PDL_MAX_STAGE1_CTAS, stream)
    out = o.reshape(B, T, HV, V)
    if identity is not None:
        o_id, m_id, side = identity
        # Join before the scratch dies: its memory may be reused by the next kernels of this stream.
        torch.cuda.current_stream(dev).wait_stream(side)
        return out, ht, o_id.reshape(B, T, HV, K), m_id
    if fla_factors:
        rows = token_rows(chunks, TT)
        akk = qg_akk[HV * R * K:].view(HV, R, CHUNK)
        return (out, ht, *(x.transpose(0, 1).index_select(0, rows).view(B, T, HV, CHUNK) for x in (aqk, akk)))
    if return_scratch:  # with u_split: -w for w, and T' as tp instead of u; with x_split -X as x for -w
        wx = dict(x=w) if x_split else dict(w=w)
        if pack:  # the packed tile and T''s diagonal taken apart into the unpacked scratch
            return out, ht, dict(**wx, qg=qg, kgt=kgt, **unpack_aqk_tp(aqk_tp, gam, K))
        return out, ht, dict(**wx, qg=qg, aqk=aqk, kgt=kgt, gam=gam,
                             **(dict(tp=aqk_tp[..., CHUNK:]) if u_split else dict(u=u)))
    return out, ht


def unpack_aqk_tp(packed: torch.Tensor, gam_rows: torch.Tensor, K: int) -> dict:
    """The packed stage-1 scratch (PACK) as the unpacked one: ``packed`` [HV, NC*64, 64] holds Aqk on and below each
    chunk's diagonal and T' transposed above it, ``gam_rows`` [HV, NC, K + 32] fp32 γ and then T''s diagonal as 64
    bf16. Returns ``aqk`` and ``tp`` [HV, NC*64, 64] bf16 and ``gam`` [HV, NC, K] fp32."""
    HV, R, _ = packed.shape
    p = packed.view(HV, R // CHUNK, CHUNK, CHUNK)
    diag = gam_rows[..., K:].contiguous().view(torch.bfloat16)  # [HV, NC, 64]
    tp = p.triu(1).transpose(-1, -2) + torch.diag_embed(diag)
    return dict(aqk=p.tril().reshape(HV, R, CHUNK), tp=tp.reshape(HV, R, CHUNK), gam=gam_rows[..., :K])


def token_rows(chunks: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """``[TT]`` int64: the chunk-padded scratch row of each token (chunk ``c``'s valid rows are
    ``64c .. 64c + nvalid − 1`` for tokens ``tok0 ..``). Torch ops on ``chunks``' device, no host sync:
    rows of dummy chunks and past a chunk's end scatter into one discarded slot."""
    nc = chunks.shape[0]
    r = torch.arange(nc * CHUNK, device=chunks.device)
    c, i = r // CHUNK, r % CHUNK
    tok0, nvalid = chunks[c, 0].to(torch.int64), chunks[c, 1].to(torch.int64)
    dest = torch.where(i < nvalid, tok0 + i, total_tokens)
    rows = torch.zeros(total_tokens + 1, dtype=torch.int64, device=chunks.device)
    return rows.scatter_(0, dest, r)[:total_tokens]


def fla_factors_reason(total_tokens: int, num_heads_v: int, cu_seqlens, batch: int, use_qk_l2norm_in_kernel: bool,
                       use_gate_in_kernel: bool, lower_bound, identity_response: bool = False,
                       return_scratch: bool = False, stages=("intra", "recur"), safe_gate: bool = False) -> str | None:
    """Why ``kda_fwd(fla_factors=True)`` cannot serve these inputs, or None."""
    if intra_kind(use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, safe_gate) != "tc":
        return ("FLA's Akk comes from the tensor-core stage 1 only (use_qk_l2norm_in_kernel with use_gate_in_kernel "
                f"or a safe_gate log-space g, and lower_bound None or in [{_min_lower_bound()}, 0])")
    too_big = _too_big(total_tokens, num_heads_v, cu_seqlens, batch)
    if too_big:
        return f"the input runs in pieces ({too_big})"
    if identity_response or return_scratch or tuple(stages) != ("intra", "recur"):
        return "not with identity_response, return_scratch or a partial stages"
    return None


def _min_lower_bound() -> float:
    from cula.kernels.sm90.kda_fwd_intra_tc import MIN_LOWER_BOUND

    return MIN_LOWER_BOUND


def _fwd_in_pieces(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, identity_response,
                   return_scratch, stages, flags):
    """``kda_fwd`` on inputs past the 32-bit offsets: consecutive pieces, states carried (kda_fwd_pieces)."""
    from cula.kernels.sm90 import kda_fwd_pieces as pieces

    if identity_response or return_scratch or tuple(stages) != ("intra", "recur"):
        raise ValueError("kda_fwd: identity_response, return_scratch and stages need an input within the "
                         f"32-bit offsets ({_too_big(q.shape[0] * q.shape[1], v.shape[2], cu_seqlens, q.shape[0])})")
    B, T = q.shape[:2]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    cu = (cu_seqlens.tolist() if cu_seqlens is not None else [i * T for i in range(B + 1)])
    packed = {name: x.reshape(1, B * T, *x.shape[2:]) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    plan = pieces.plan(cu, HV, MAX_ELEMENTS)
    o, ht = pieces.run_in_pieces(kda_fwd, packed, cu, initial_state, output_final_state, plan, (HV, K, V),
                                 scale=scale, **flags)
    return o.reshape(B, T, HV, V), ht


#: The ``clock`` diagnostic's last stamps (kda_fwd_intra_tc.CLOCK_STAMPS): (int32 [HV, NC, CLOCK_SLOTS], the chunk
#: table [NC, 2] of that call); rows of dummy chunks (nvalid 0) stay zero. None until a call runs with it.
LAST_CLOCKS: tuple | None = None


def _stage1_clock() -> bool:
    """Whether the tensor-core stage 1 runs with the ``clock`` diagnostic (CULA_KDA_TC_DIAG)."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    return "clock" in intra_tc.DIAG


def _clock_buffer(HV: int, NC: int, pitch: int, chunks: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """γ's [HV, NC, pitch] fp32 (pitch: K, or recur.GAM_PITCH_PACK packed) with the clock diagnostic's zeroed
    int32 stamps after it (where stage 1 writes them); the stamps are kept in ``LAST_CLOCKS``."""
    from cula.kernels.sm90.kda_fwd_intra_tc import CLOCK_SLOTS

    global LAST_CLOCKS
    n = HV * NC * pitch
    buf = torch.empty(n + HV * NC * CLOCK_SLOTS, dtype=torch.float32, device=dev)
    LAST_CLOCKS = (buf[n:].view(torch.int32).view(HV, NC, CLOCK_SLOTS).zero_(), chunks)
    return buf[:n].view(HV, NC, pitch)


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(dev: torch.device) -> "torch.cuda.Stream":
    """One reusable side stream per device (creating a stream per call costs host time)."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def factor_block(lower_bound: float, softplus_gate: bool, log_gate: bool = False) -> int:
    """Rows per reference-factor block of the tensor-core stage 1 for the bound its kernel is given: the
    ``CULA_KDA_TC_FACTOR_BLOCK`` choice (32 unless set) where the bound allows it (32 needs ``lower_bound >=
    BLOCK32_MIN_LOWER_BOUND``; the softplus gate's floor never does), precomputed log-space gates included
    unless ``LOG_GATE_BLOCK32`` is off; 16 otherwise."""
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    block = intra_tc.FACTOR_BLOCK
    if block != intra_tc.FACTOR_BLOCKS[0] and (softplus_gate or lower_bound < intra_tc.BLOCK32_MIN_LOWER_BOUND
                                               or (log_gate and not intra_tc.LOG_GATE_BLOCK32)):
        return intra_tc.FACTOR_BLOCKS[0]
    return block


def intra_kind(use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, lower_bound: float | None,
               safe_gate: bool = False) -> str:
    """Which stage-1 kernel ``kda_fwd`` runs: ``"tc"`` (tensor cores) or ``"simt"`` (exact for any gate).

    The tensor-core one needs q/k l2norm and a per-token bound on the gate: the in-kernel gate (its
    lower_bound, or the softplus form clamped at SOFTPLUS_FLOOR), or a log-space gate the caller declares
    bounded with ``safe_gate`` (FLA's contract for precomputed gates; clamped to [lower_bound, 0], the
    floor when lower_bound is None)."""
    from cula.kernels.sm90.kda_fwd_intra_tc import MIN_LOWER_BOUND

    bounded = use_gate_in_kernel or safe_gate
    if (INTRA_TC and use_qk_l2norm_in_kernel and bounded
            and (lower_bound is None or MIN_LOWER_BOUND <= lower_bound <= 0.0)):
        return "tc"
    return "simt"


def compile_targets() -> dict:
    """CPU PTX-check targets of both stages: ``intra*`` and ``recur*``."""
    from cula.kernels.sm90 import kda_fwd_intra as intra
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90 import kda_fwd_recur as recur

    targets = {f"intra_{n}" if n != "default" else "intra": f for n, f in intra.compile_targets().items()}
    targets.update({f"recur_{n}" if n != "default" else "recur": f for n, f in recur.compile_targets().items()})
    targets.update({f"intra_tc_{n}" if n != "default" else "intra_tc": f for n, f in intra_tc.compile_targets().items()})
    targets["default"] = targets["recur"]
    return targets


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv:
        from cula.kernels.sm90 import kda_fwd_check

        raise SystemExit(kda_fwd_check.main(sys.argv[1:]))
    print(__doc__)

"""Context-parallel KDA forward (``chunk_kda`` with ``cp_context``).

Per value head the KDA recurrence is ``S_t = A_t S_{t-1} + beta_t k_t v_t^T`` with
``A_t = (I - beta_t k_t k_t^T) diag(exp(g_t))``: affine in the initial state, and each value column of
the state evolves on its own. So one call of the local forward with ``K`` extra value columns set to zero
and the extra state columns started from the identity returns, besides the usual results,

- in the extra state columns: ``M = A_L ... A_1`` (``[K, K]``), the segment's state transition, and
- in the extra output columns: ``o_I[t] = scale q_t^T A_t ... A_1`` (``[T, K]``), the response to the
  initial state, so that the carried-in state ``S0`` contributes exactly ``o_I[t] @ S0`` to ``o_t``.

(FLA's CP computes the same ``[h_local | M]`` pair with a dedicated kernel; here it comes from the local
op itself, so CP works with any backend.) Per rank:

1. local pass: the first segment, if it carries a state in, also gets its identity response (the ``V + K``
   augmented columns, or the kernel's own second stage-2 pass); the other segments run as usual with their
   true initial states (a last segment that only carries a state out starts its chain, so its plain end
   state is its summary);
2. scan: the last segment's ``(M, b)`` goes through :func:`cula.cp.scan.exclusive_scan`;
3. correction: ``o += o_I @ S0`` on the first segment, its end state ``b + M S0``.

Cost over the plain local forward: the boundary segments' value-side work grows by ``(V + K) / V`` (the
intra-chunk ``k``/``g``/``beta`` work is shared), plus one ``[L_first, K] x [K, V]`` product per head and, in
the all-gather scan, ``pre_num_ranks`` products ``[K, K] x [K, V]`` per head.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cula.cp import _local
from cula.cp.context import CPContext, check_global_cu_seqlens, emulated_contexts
from cula.cp.gather import assemble_final_state, concat_tokens, split_tokens
from cula.cp.scan import emulated_initial_states, exclusive_scan, inputs_require_grad, scan_dtype

# chunk_kda arguments CP cannot honour when set.
_UNSUPPORTED = ("return_intermediate_states", "use_graph")


@dataclass
class _Piece:
    """A run of local segments ``[seg_lo, seg_hi)`` computed by one local call."""

    seg_lo: int
    seg_hi: int
    boundary: bool  # one segment, run with the identity-augmented columns


@dataclass
class _PieceResult:
    o: torch.Tensor  # [1, L, HV, V]
    final: torch.Tensor | None  # [n, HV, K, V], K-first
    o_identity: torch.Tensor | None = None  # [1, L, HV, K], boundary pieces
    transition: torch.Tensor | None = None  # [HV, K, K], boundary pieces


def _plan(ctx: CPContext) -> list[_Piece]:
    """A first segment that carries a state in runs alone (it needs the identity response); the rest in one
    piece. A last segment that only carries a state out needs no transition: it starts its chain, so the
    scan applies its ``b`` (which includes any user initial state) to a zero start."""
    n = ctx.num_seqs
    boundary = {0} if ctx.carries_in else set()
    pieces: list[_Piece] = []
    lo = 0
    for i in range(n):
        if i in boundary:
            if lo < i:
                pieces.append(_Piece(lo, i, False))
            pieces.append(_Piece(i, i + 1, True))
            lo = i + 1
    if lo < n:
        pieces.append(_Piece(lo, n, False))
    return pieces


def _k_first(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """States in ``[.., K, V]`` layout (the op's layout is ``[.., V, K]`` with ``state_v_first``)."""
    return state.transpose(-1, -2) if (state is not None and state_v_first) else state


@dataclass(frozen=True)
class _LocalCall:
    """How to call the local forward: the op, the arguments every call shares, the identity-column mode."""

    fn: _local.LocalFn
    scale: float
    state_v_first: bool
    options: dict
    identity_columns: str  # "appended": one call with V + K columns; "separate": a second call with K

    def __call__(self, sliced: dict, initial_state, output_final_state: bool, cu_seqlens):
        o, final = self.fn(**sliced, scale=self.scale, initial_state=_k_first(initial_state, self.state_v_first),
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           state_v_first=self.state_v_first, **self.options)
        return o, _k_first(final, self.state_v_first)


IDENTITY_COLUMNS = ("auto", "kernel", "appended", "separate")


def _identity_kernel():
    """The SM90 KDA forward, which returns the identity response beside the forward (None if unavailable)."""
    try:
        from cula.kernels.sm90 import kda_fwd
    except ImportError:
        return None
    return kda_fwd


def _kernel_arguments(kernel, options: dict) -> dict:
    names = inspect.signature(kernel.kda_fwd).parameters
    return {n: val for n, val in options.items() if n in names}


def _needs_grad(tokens: dict, initial_state, call: _LocalCall) -> bool:
    """Whether autograd runs through this call: any token tensor, the initial state or the gate parameters."""
    return inputs_require_grad(*tokens.values(), initial_state, call.options.get("A_log"), call.options.get("dt_bias"))


def _resolve_identity_columns(call: _LocalCall, tokens: dict, default_fn: bool, grad: bool) -> _LocalCall:
    """``auto``: the kernel's identity response when the SM90 kernel runs these inputs (default local op, no
    autograd), else ``appended``. ``kernel`` asked for explicitly must be runnable (with a ``local_fn`` it
    replaces only the carried-in segment's call)."""
    if call.identity_columns not in ("auto", "kernel"):
        return call
    kernel = _identity_kernel()
    if kernel is None:
        reason = "cula.kernels.sm90.kda_fwd is not importable"
    elif grad:
        reason = "inputs require grad (the kernel is forward only)"
    elif not default_fn and call.identity_columns == "auto":
        reason = "a local_fn was given (the kernel would replace it on the carried-in segment)"
    else:
        reason = kernel.supports(**tokens, scale=call.scale, output_final_state=True,
                                 state_v_first=False, **call.options)
    if reason is None:
        return dataclasses.replace(call, identity_columns="kernel")
    if call.identity_columns == "kernel":
        raise ValueError(f"identity_columns: 'kernel' needs the SM90 kernel to run these inputs, but {reason}")
    return dataclasses.replace(call, identity_columns="appended")


def _run_piece(piece: _Piece, tokens: dict, init_rows, ctx: CPContext, call: _LocalCall,
               need_final: bool) -> _PieceResult:
    """One local call (two with ``identity_columns="separate"``) over the piece's tokens.

    ``init_rows`` are K-first. A boundary piece also returns the identity response ``o_I`` and ``M``.
    """
    cu = ctx.cu_seqlens_cpu
    start, end = int(cu[piece.seg_lo]), int(cu[piece.seg_hi])
    sliced = {name: x[:, start:end] for name, x in tokens.items()}
    cu_piece = (ctx.cu_seqlens[piece.seg_lo: piece.seg_hi + 1] - ctx.cu_seqlens[piece.seg_lo])
    init = None if init_rows is None else init_rows[piece.seg_lo: piece.seg_hi]
    if not piece.boundary:
        o, final = call(sliced, init, need_final, cu_piece)
        return _PieceResult(o, final)

    v = sliced["v"]
    HV, V, K = v.shape[2], v.shape[3], sliced["q"].shape[3]
    state_dtype = torch.float32 if init is None else init.dtype
    h_start = torch.zeros(1, HV, K, V, device=v.device, dtype=state_dtype) if init is None else init
    eye = torch.eye(K, device=v.device, dtype=state_dtype).expand(1, HV, K, K)
    if call.identity_columns == "kernel":
        kernel = _identity_kernel()
        # A boundary piece carries its state in, so its own initial state is zero: pass none.
        o, final, o_identity, transition = kernel.kda_fwd(
            **sliced, scale=call.scale, initial_state=None, output_final_state=True, state_v_first=False,
            cu_seqlens=cu_piece, identity_response=True, **_kernel_arguments(kernel, call.options))
        return _PieceResult(o=o, final=final, o_identity=o_identity, transition=transition[0])
    zeros_k = v.new_zeros(*v.shape[:3], K)
    if call.identity_columns == "separate":
        o, final = call(sliced, h_start, True, cu_piece)
        o_identity, transition = call(sliced | dict(v=zeros_k), eye.contiguous(), True, cu_piece)
        return _PieceResult(o=o, final=final, o_identity=o_identity, transition=transition[0])
    # Value columns evolve independently: [v | 0] from [h_start | I] gives both responses in one call.
    o_aug, final_aug = call(sliced | dict(v=torch.cat([v, zeros_k], dim=-1)), torch.cat([h_start, eye], dim=-1),
                            True, cu_piece)
    return _PieceResult(o=o_aug[..., :V], final=final_aug[..., :V], o_identity=o_aug[..., V:],
                        transition=final_aug[0, :, :, V:])


def _local_pass(tokens: dict, initial_state, output_final_state, ctx: CPContext, call: _LocalCall):
    """Step 1: run the pieces; return them with this rank's summary ``(M, b)``."""
    need_final = output_final_state or ctx.world_size > 1  # rank-uniform state dtype for the scan
    init_rows = _k_first(_local.local_initial_states(initial_state, ctx), call.state_v_first)
    results = [_run_piece(p, tokens, init_rows, ctx, call, need_final) for p in _plan(ctx)]
    v, q = tokens["v"], tokens["q"]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    sdt = scan_dtype(results[-1].final.dtype if results[-1].final is not None else torch.float32)
    m = torch.zeros(HV, K, K, device=v.device, dtype=sdt)
    b = torch.zeros(HV, K, V, device=v.device, dtype=sdt)
    if ctx.carries_out:
        last = results[-1]
        b = last.final[-1].to(sdt)
        # The transition matters only where the carried-in state passes through (one segment, both ways).
        if last.transition is not None:
            m = last.transition.to(sdt)
    return results, m, b


def _finish(results: list[_PieceResult], h0, anchor, output_final_state, state_v_first):
    """Step 3: add the carried-in state's contribution to the first segment, then concatenate the pieces."""
    if h0 is not None:
        first = results[0]
        o = _local.add_state_product(first.o, first.o_identity[0], h0)
        final = first.final
        if final is not None:
            end = first.final[0].to(h0.dtype) + torch.matmul(first.transition.to(h0.dtype), h0)
            final = torch.cat([end[None].to(first.final.dtype), first.final[1:]])
        results = [_PieceResult(o, final)] + results[1:]
    o = results[0].o if len(results) == 1 else torch.cat([r.o for r in results], dim=1)
    if anchor is not None:
        o = o + anchor.to(o.dtype)
    if not output_final_state:
        return o, None
    final = torch.cat([r.final for r in results])
    return o, _k_first(final, state_v_first)


def _split_options(kwargs: dict) -> dict:
    """Drop the arguments CP handles itself; refuse the ones it cannot honour."""
    for name in _UNSUPPORTED:
        if kwargs.pop(name, False):
            raise NotImplementedError(f"{name}: not supported with cp_context (got True)")
    kwargs.pop("cu_seqlens_cpu", None)  # checked by the caller; the context has its own CPU copy
    kwargs.pop("max_num_seqs", None)  # only meaningful with use_graph
    return kwargs


def chunk_kda(
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
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cp_context: Any,
    local_fn: _local.LocalFn | None = None,
    identity_columns: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward over a sequence split across the ranks of ``cp_context.group`` (a collective).

    Arguments as ``fla.ops.kda.chunk_kda`` 0.6.0 (``A_log``, ``dt_bias``, ``chunk_size`` ... by keyword),
    token-wise inputs being this rank's piece:

    Args:
        q, k: ``[1, T_local, H, K]``; v: ``[1, T_local, HV, V]``; g: ``[1, T_local, HV, K]``;
            beta: ``[1, T_local, HV]`` (``cula.cp.split_tokens`` of the packed global stream).
        initial_state: ``None`` or the global ``[N, HV, K, V]`` fp32 states (``[N, HV, V, K]`` with
            ``state_v_first``), the same on every rank (FLA's CP takes none).
        output_final_state: also return the local final states (FLA's CP returns none).
        cu_seqlens: ``None`` or the context's boundaries; the context's local ones are used.
        cp_context: from :func:`cula.cp.build_cp_context` (an FLA ``FLACPContext`` is accepted too).
        local_fn: the single-device forward run locally (default: the public op ``cula.kda.chunk_kda``).
            With ``identity_columns="appended"`` a carried-in first segment calls it with ``V + K`` value
            columns.
        identity_columns: how a segment that carries a state in gets its identity response ``o_I`` and
            transition ``M``. ``"kernel"``: the SM90 kernel returns them with the forward (stage 1 shared, the
            two stage-2 passes overlapped on two streams); ``"appended"``: one local call with ``V + K`` value
            columns; ``"separate"``: two calls, with ``V`` and with ``K`` columns (for a local op that only takes
            the usual head sizes; it repeats the intra-chunk work). ``"auto"`` (default): ``"kernel"`` when the
            kernel runs these inputs with the default local op and no autograd, else ``"appended"``.
    Returns:
        ``o: [1, T_local, HV, V]`` and, with ``output_final_state``, ``[N_local, HV, K, V]`` (or V-first):
        the true state at the end of each local segment (``cula.cp.gather_final_state`` makes ``[N, ...]``).
    """
    ctx = _local.as_context(cp_context)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _local.check_local_tokens(name, x, ctx)
    _check_beta(beta, ctx)
    _local.check_cu_seqlens_arg(cu_seqlens, ctx)
    _local.check_cu_seqlens_arg(kwargs.get("cu_seqlens_cpu"), ctx)
    _local.check_global_initial_state(initial_state, ctx)
    call = _local_call(local_fn, q, scale, state_v_first, identity_columns, kwargs, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound)
    tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
    grad = _needs_grad(tokens, initial_state, call)
    call = _resolve_identity_columns(call, tokens, local_fn is None, grad)

    results, m, b = _local_pass(tokens, initial_state, output_final_state, ctx, call)
    h0, anchor = exclusive_scan(m, b, ctx, requires_grad=grad)
    return _finish(results, h0, anchor, output_final_state, state_v_first)


def _check_beta(beta: torch.Tensor, ctx: CPContext) -> None:
    if not isinstance(beta, torch.Tensor) or beta.dim() != 3 or beta.shape[:2] != (1, ctx.num_tokens):
        shape = list(beta.shape) if isinstance(beta, torch.Tensor) else type(beta).__name__
        raise ValueError(f"beta: expected this rank's piece [1, T_local={ctx.num_tokens}, HV] under cp_context, "
                         f"got {shape}")


def _local_call(local_fn, q, scale, state_v_first, identity_columns, kwargs, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound) -> _LocalCall:
    """Resolve the defaults; the flags, gate parameters, chunk_size ... pass unchanged to every local call."""
    if identity_columns not in IDENTITY_COLUMNS:
        raise ValueError(f"identity_columns: expected one of {IDENTITY_COLUMNS}, got {identity_columns!r}")
    options = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        **_split_options(dict(kwargs)),
    )
    return _LocalCall(fn=local_fn or _local.default_local_fn("kda"),
                      scale=q.shape[-1] ** -0.5 if scale is None else scale,
                      state_v_first=state_v_first, options=options, identity_columns=identity_columns)


def emulate_chunk_kda(
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
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    world_size: int,
    offsets: Sequence[int] | None = None,
    local_fn: _local.LocalFn | None = None,
    identity_columns: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Single-process emulation of :func:`chunk_kda` on ``world_size`` ranks (no torch.distributed).

    Takes and returns the global tensors of ``chunk_kda`` (``[B, T, ...]`` or packed with ``cu_seqlens``).
    """
    call = _local_call(local_fn, q, scale, state_v_first, identity_columns, kwargs, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound)
    batch, length = q.shape[0], q.shape[1]
    packed = cu_seqlens is None
    tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
    call = _resolve_identity_columns(call, tokens, local_fn is None, _needs_grad(tokens, initial_state, call))
    if packed:
        tokens = {name: _local.pack_batch(x) for name, x in tokens.items()}
        cu_seqlens = _local.uniform_cu_seqlens(batch, length, q.device)
    check_global_cu_seqlens(cu_seqlens)
    contexts = emulated_contexts(cu_seqlens, world_size, offsets)

    passes = [
        _local_pass({n: split_tokens(x, c) for n, x in tokens.items()}, initial_state, output_final_state, c, call)
        for c in contexts
    ]
    h0s = emulated_initial_states([(m, b) for _, m, b in passes], contexts)
    results = [_finish(r, h0, None, output_final_state, state_v_first) for (r, _, _), h0 in zip(passes, h0s)]
    o = concat_tokens([r[0] for r in results])
    if packed:
        o = o.reshape(batch, length, *o.shape[2:])
    final = assemble_final_state([r[1] for r in results], contexts, initial_state) if output_final_state else None
    return o, final

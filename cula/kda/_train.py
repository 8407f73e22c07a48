"""chunk_kda with gradients: cula's SM90 forward, FLA 0.6.0's backward (``cula-sm90+fla-bwd``).

FLA's ``chunk_kda`` saves, by default (``disable_recompute=False``), the l2-normalised q and k with their
reciprocal norms, v, the raw gate and beta, sigmoid(beta), ``A_log`` / ``dt_bias``, the initial state,
and two products of its intra-chunk pass: ``Aqk`` and ``Akk = (I + strictly-lower β K Kᵀ ⊙ gates)^-1``;
its backward recomputes everything else (the gate cumsum, w, u, the chunk states) from those. Our
forward (``kda_fwd(fla_factors=True)``) writes both products in FLA's layout, the cheap elementwise
pieces come from FLA's own kernels (``l2norm_fwd``, ``fused_beta_sigmoid``), so FLA's backward runs on
exactly the tensors it expects.

Which calls take this path: CUDA inputs on Hopper needing gradients that the tensor-core forward
serves (bf16 q/k/v with K = V = 128, ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` or a log-space
``g`` with ``safe_gate``, ``lower_bound`` None or in [-11, 0]), with ``disable_recompute=False``,
``chunk_size=64``, no ``cp_context``, ``use_graph`` or ``return_intermediate_states``. With a log-space
``g`` FLA saves its chunk-local cumsum (log2 units) instead of recomputing the gate: FLA's
``chunk_local_cumsum`` forms it here. Everything else with gradients runs FLA's whole ``chunk_kda``.

Numerics: o and the final state are not the inference path's bit for bit: inference forms u in stage 2
from a bf16 T' (``kda_fwd.U_IN_RECUR``), while this path's stage 1 forms u itself (it writes bf16(T) for FLA
instead of T'), so the two differ by bf16 roundings of the same quantities (a few ulps; the first GPU run
found one ulp in o). The backward sees our bf16 ``Aqk`` / ``Akk`` where FLA's forward would have given its own
(both bf16 roundings of the same exact quantities; ours are formed from fp32-normalised q and k, FLA's
from its bf16 q̂, k̂), so gradients agree with FLA's to bf16 rounding, not bitwise. With
``lower_bound=None`` our forward clamps the softplus gate at -11 per token (``SOFTPLUS_FLOOR``) while
FLA's backward recomputes the unclamped gate: they differ only where a token's decay is below e^-11.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cula._dispatch import resolved_scale

CHUNK = 64
#: (opt-in name, why the path is off by default, or None: on). On since tests/test_kda_train.py's GPU cases
#: (five gradient cases, three saved-factor cases) passed at 16b0362 on an H100 (sm_90a, the same kernels and
#: numerics as an H200); ``CULA_KERNELS_OFF=kda_fwd_train`` turns it off (FLA's whole chunk_kda runs).
SWITCH: tuple[str, str | None] = ("kda_fwd_train", None)


def limits(inputs: Mapping[str, Any]) -> str | None:
    """Why these (gradient-needing) inputs cannot take cula's forward with FLA's backward, or None."""
    from cula._dispatch import kernel_kwargs, load_kernel

    if inputs.get("disable_recompute"):
        return ("disable_recompute=True saves FLA's forward intermediates (w, u, h, v_new), which cula's forward "
                "does not form")
    if inputs.get("return_intermediate_states") or inputs.get("use_graph") or inputs.get("cp_context") is not None:
        return "return_intermediate_states, use_graph and cp_context run FLA's chunk_kda"
    if inputs.get("chunk_size", CHUNK) != CHUNK:
        return f"chunk_size {inputs.get('chunk_size')}: FLA's saved Akk is per 64-token chunk here, expected 64"
    module, reason = load_kernel("kda_fwd")
    if reason is not None:
        return reason
    kwargs = kernel_kwargs("kda_fwd", inputs)
    with torch.no_grad():  # the kernel runs inside the autograd Function's forward, where grad is off
        reason = module.supports(**kwargs)
    if reason is not None:
        return f"kernel: {reason}"
    q, v = inputs["q"], inputs["v"]
    B, T = q.shape[:2]
    return module.fla_factors_reason(B * T, v.shape[2], inputs["cu_seqlens"], B, inputs["use_qk_l2norm_in_kernel"],
                                     inputs["use_gate_in_kernel"], inputs["lower_bound"],
                                     safe_gate=bool(inputs["safe_gate"]))


def chunk(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``chunk_kda`` with cula's forward and FLA's backward (see the module docstring)."""
    opts = _Options(
        scale=resolved_scale(inputs),
        output_final_state=bool(inputs["output_final_state"]),
        use_gate_in_kernel=bool(inputs["use_gate_in_kernel"]),
        use_beta_sigmoid_in_kernel=bool(inputs["use_beta_sigmoid_in_kernel"]),
        allow_neg_eigval=bool(inputs["allow_neg_eigval"]),
        safe_gate=bool(inputs["safe_gate"]),
        lower_bound=inputs["lower_bound"],
        state_v_first=bool(inputs["state_v_first"]),
        cu_seqlens_cpu=inputs.get("cu_seqlens_cpu"),
    )
    o, ht = _CulaForwardFlaBackward.apply(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], inputs["A_log"], inputs["dt_bias"],
        inputs["initial_state"], inputs["cu_seqlens"], opts,
    )
    return o, (ht if opts.output_final_state else None)


class _Options:
    """The non-tensor arguments of one call (autograd.Function.apply takes tensors and plain objects)."""

    __slots__ = ("scale", "output_final_state", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                 "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first", "cu_seqlens_cpu")

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.allow_neg_eigval else 1.0


class _CulaForwardFlaBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: _Options):
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.gate import fused_beta_sigmoid
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum
        from fla.ops.utils.index import prepare_chunk_indices

        from cula.kernels.sm90.kda_fwd import kda_fwd

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        with torch.cuda.device(q.device):  # FLA's kernels launch on the current device
            # FLA's varlen chunk table reads cu_seqlens on the host (a sync, unless cu_seqlens_cpu is given): taken
            # first, as FLA's own forward does, so the host does not wait for our kernels before it goes on to
            # launch the rest of the step (after them, it did: the eager step is host-bound on short inputs)
            chunk_indices = None
            if cu_seqlens is not None:
                chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK, cu_seqlens_cpu=opts.cu_seqlens_cpu)
            o, ht, aqk, akk = kda_fwd(
                q, k, v, g, beta, scale=opts.scale, initial_state=initial_state,
                output_final_state=opts.output_final_state, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=opts.use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=opts.allow_neg_eigval, safe_gate=opts.safe_gate, lower_bound=opts.lower_bound,
                state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens, fla_factors=True,
            )
            # what FLA's forward would have saved (the normalised q, k in q's dtype, their fp32 1/norms, β)
            q_n, q_rstd = l2norm_fwd(q)
            k_n, k_rstd = l2norm_fwd(k)
            beta_s = fused_beta_sigmoid(beta, scale=opts.beta_scale) if opts.use_beta_sigmoid_in_kernel else beta
            g_cumsum = None  # the in-kernel gate: FLA's backward recomputes it from the raw g
            if not opts.use_gate_in_kernel:  # a log-space g: FLA saves its chunk-local cumsum in log2 units
                g_cumsum = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                              chunk_indices=chunk_indices)
        ctx.save_for_backward(q_n, q_rstd, k_n, k_rstd, v, g, g_cumsum, beta, beta_s, A_log, dt_bias, aqk, akk,
                              initial_state, cu_seqlens, chunk_indices)
        ctx.opts = opts
        if ht is None:  # autograd wants a tensor in each output slot; the public op returns None for it
            ht = o.new_empty(0)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from fla.modules.norm.l2norm import l2norm_bwd
        from fla.ops.common.gate import fused_beta_sigmoid_bwd
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd

        (q_n, q_rstd, k_n, k_rstd, v, g, g_cumsum, beta, beta_s, A_log, dt_bias, aqk, akk, initial_state,
         cu_seqlens, chunk_indices) = ctx.saved_tensors
        opts = ctx.opts
        in_kernel = opts.use_gate_in_kernel
        if not opts.output_final_state or (dht is not None and dht.numel() == 0):
            dht = None
        with torch.cuda.device(q_n.device):
            dq, dk, dv, db, dg, dh0, dA, dbias = chunk_kda_bwd(
                q=q_n, k=k_n, v=v, beta=beta_s, Aqk=aqk, Akk=akk, scale=opts.scale, initial_state=initial_state,
                do=do.contiguous(), dht=dht, g=g_cumsum, g_org=g if in_kernel else None,
                state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                chunk_size=CHUNK, safe_gate=opts.safe_gate, lower_bound=opts.lower_bound,
                use_gate_in_kernel=in_kernel, A_log=A_log, dt_bias=dt_bias,
                disable_recompute=False,
            )
            dq = l2norm_bwd(q_n, q_rstd, dq)
            dk = l2norm_bwd(k_n, k_rstd, dk)
            if opts.use_beta_sigmoid_in_kernel:
                db = fused_beta_sigmoid_bwd(x=beta, dy=db, scale=opts.beta_scale)
        # autograd refuses a gradient for an input that was None
        dA = dA if A_log is not None else None
        dbias = dbias if dt_bias is not None else None
        dh0 = dh0 if initial_state is not None else None
        return (dq.to(q_n.dtype), dk.to(k_n.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype),
                dA, dbias, dh0, None, None)

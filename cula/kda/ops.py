"""Public KDA ops with FLA 0.6.0's signatures."""

from __future__ import annotations

from typing import Any

import torch

from cula import _validate as V
from cula._op import pop_known, public_op, state_v_first_alias

KDA_CHUNK_SIZES = (32, 64)
# the **kwargs fused_recurrent_kda takes silently (FLA's names and ours)
POOL_KWARGS = frozenset({"state_indices", "ssm_state_indices", "inplace", "inplace_final_state"})


def _check_gate_flags(a: dict[str, Any], dims: V.Dims, device: torch.device, *, chunked: bool) -> None:
    V.check_flag_pair_neg_eigval(a["allow_neg_eigval"], a["use_beta_sigmoid_in_kernel"])
    lower_bound = a["lower_bound"]
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
        raise ValueError(f"lower_bound: expected a float or None, got {V.describe(lower_bound)}")
    if not a["use_gate_in_kernel"]:
        return
    if a["A_log"] is None and lower_bound is None:
        raise ValueError("A_log: expected a [HV] tensor when use_gate_in_kernel=True and lower_bound is None, got None")
    if a["A_log"] is not None:
        V.check_param("A_log", a["A_log"], dims.HV, f"[HV] = [{dims.HV}], one per value head", device)
    if a["dt_bias"] is not None:
        V.check_param("dt_bias", a["dt_bias"], dims.HV * dims.K, f"[HV * K] = [{dims.HV * dims.K}]", device)
    if chunked and a["safe_gate"]:
        if lower_bound is None:
            raise ValueError("lower_bound: expected a float in [-5, 0) with safe_gate=True and use_gate_in_kernel=True, got None")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound: expected a value in [-5, 0) with safe_gate=True, got {lower_bound}")


def _prepare_chunk(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    a["state_v_first"] = state_v_first_alias(extra, a["state_v_first"])
    a.update(pop_known(extra, "chunk_kda", {"A_log": None, "dt_bias": None, "chunk_size": 64}))
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"])
    device = q.device
    V.check_scale(a["scale"])
    # with cp_context the token inputs are this rank's piece while initial_state / cu_seqlens are
    # global: cula.cp checks those against the context
    cp = a["cp_context"] is not None
    if not cp:
        dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device, a["cu_seqlens_cpu"])
    B, T, HV, K = dims.B, dims.T, dims.HV, dims.K
    V.check_gate("g", a["g"], (B, T, HV, K), "[B, T, HV, K]", device)
    V.check_gate("beta", a["beta"], (B, T, HV), "[B, T, HV]", device)
    if not cp:
        V.check_state("initial_state", a["initial_state"], dims, device, state_v_first=a["state_v_first"])
    _check_gate_flags(a, dims, device, chunked=True)
    V.check_chunk_size(a["chunk_size"], KDA_CHUNK_SIZES)
    return a


def _prepare_recurrent(a: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    a["state_v_first"] = state_v_first_alias(extra, a["state_v_first"])
    pool = pop_known(extra, "fused_recurrent_kda", {
        "state_indices": None, "ssm_state_indices": None, "inplace": None, "inplace_final_state": None,
    })
    for ours, fla in (("state_indices", "ssm_state_indices"), ("inplace", "inplace_final_state")):
        if pool[ours] is not None and pool[fla] is not None:
            raise ValueError(f"{fla}: expected it alone (FLA's name for {ours}), got both {ours} and {fla}")
    a["state_indices"] = pool["state_indices"] if pool["state_indices"] is not None else pool["ssm_state_indices"]
    a["inplace"] = bool(pool["inplace"] if pool["inplace"] is not None else pool["inplace_final_state"])
    q = a["q"]
    dims = V.check_qkv(q, a["k"], a["v"])
    device = q.device
    V.check_scale(a["scale"])
    dims = V.check_cu_seqlens(a["cu_seqlens"], dims, device)
    B, T, HV, K = dims.B, dims.T, dims.HV, dims.K
    V.check_gate("g", a["g"], (B, T, HV, K), "[B, T, HV, K]", device)
    beta = a["beta"]
    if not (isinstance(beta, torch.Tensor) and beta.dim() == 4):
        V.check_gate("beta", beta, (B, T, HV), "[B, T, HV]", device)
    else:  # FLA's fused recurrent kernel also takes one beta per value channel
        V.check_gate("beta", beta, (B, T, HV, dims.V), "[B, T, HV, V]", device)
    a["safe_gate"] = False
    _check_gate_flags(a, dims, device, chunked=False)
    V.check_pool_arguments(a, dims, device, state_v_first=a["state_v_first"])
    return a


@public_op("chunk_kda", _prepare_chunk, plan_kwargs=frozenset({"A_log", "dt_bias", "chunk_size"}))
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
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
):
    r"""Chunked KDA, a drop-in for ``fla.ops.kda.chunk_kda`` (0.6.0).

    Per value head: ``S'_t = diag(exp(g_t)) S_{t-1}``, ``S_t = S'_t + beta_t k_t (v_t - k_t^T S'_t)^T``,
    ``o_t = scale q_t^T S_t``.

    Args:
        q: queries ``[B, T, H, K]``, fp16/bf16/fp32 (fp64: torch reference only).
        k: keys ``[B, T, H, K]``, dtype of ``q``.
        v: values ``[B, T, HV, V]``, dtype of ``q``; ``HV`` a multiple of ``H`` (grouped value heads).
        g: log-space forget gate ``[B, T, HV, K]``: the decay itself, or with ``use_gate_in_kernel`` the
            raw input of ``-exp(A_log) * softplus(g + dt_bias)``.
        beta: ``[B, T, HV]``: the delta-rule step (post-sigmoid), or logits with ``use_beta_sigmoid_in_kernel``.
        scale: factor on ``q``; defaults to ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), one per sequence
            (``N = B``, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the fp32 final state, shaped like ``initial_state``.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) first.
        use_gate_in_kernel: compute the decay from raw ``g`` in the op: ``-exp(A_log) * softplus(g +
            dt_bias)``, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound`` is
            set (``A_log`` may then be None). Pass ``A_log`` ``[HV]`` and the optional ``dt_bias``
            ``[HV * K]`` as keywords.
        use_beta_sigmoid_in_kernel: apply ``sigmoid`` to ``beta`` in the op.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, use ``2 * sigmoid(beta)`` (range ``(0, 2)``).
        safe_gate: FLA's bounded-gate fast path (math unchanged); with ``use_gate_in_kernel`` it needs
            ``lower_bound`` in ``[-5, 0)``.
        lower_bound: the log-space floor of the sigmoid gate (see ``use_gate_in_kernel``).
        disable_recompute: FLA keeps activations for the backward instead of recomputing (FLA path only).
        return_intermediate_states: FLA's inference mode returning ``(o, final_state, h)``, ``h`` the
            bf16 per-chunk states ``[B, NT, HV, K, V]`` (FLA path only, inside ``torch.inference_mode()``).
        state_v_first: states in the V-first layout ``[N, HV, V, K]``.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        cu_seqlens_cpu: a host copy of ``cu_seqlens``; lets cula (and FLA) check and plan without a sync.
        cp_context: a context-parallel context: ``cula.cp.build_cp_context(...)`` (runs through
            :mod:`cula.cp`, states allowed) or FLA's ``FLACPContext`` (FLA's own CP on CUDA when no
            states are asked for, else :mod:`cula.cp`). Inputs are then this rank's tokens.
        use_graph, max_num_seqs: FLA's fixed-shape varlen planning for CUDA-graph capture.
        **kwargs: ``A_log``, ``dt_bias``, ``chunk_size`` (32 or 64) and the deprecated
            ``transpose_state_layout``, as FLA takes them; unknown names are ignored with a warning.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``, ``final_state`` or ``None``
        (``(o, final_state, h)`` with ``return_intermediate_states``).

    Backends, in order: cula's SM90 ``kda_fwd`` kernel (Hopper, supported inputs, no gradients
    requested), FLA's Triton ``chunk_kda`` on CUDA, the chunked torch reference. The kernel takes q/k
    l2norm with the in-kernel gate, or with a log-space ``g`` the caller declares bounded (``safe_gate``,
    FLA's contract for precomputed gates: clamped to ``[lower_bound, 0]``, ``lower_bound`` or -11); without
    ``lower_bound`` it clamps the softplus gate per token and channel at -11 (a decay below e^-11 = 1.7e-5
    counts as 1.7e-5: at most that relative change, far under bf16 rounding); other inputs go to FLA when
    it is installed. Gradients: cula has no KDA backward kernel yet; on Hopper a call that needs them and
    that the kernel serves runs our forward under FLA's backward (``cula-sm90+fla-bwd``; off with
    ``CULA_KERNELS_OFF=kda_fwd_train``; docs/api.md), otherwise FLA on CUDA and the differentiable
    reference on CPU.
    """


@public_op("fused_recurrent_kda", _prepare_recurrent, plan_kwargs=POOL_KWARGS)
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Token-by-token KDA (decode), a drop-in for ``fla.ops.kda.fused_recurrent_kda`` (0.6.0).

    Same recurrence as :func:`chunk_kda`, one step per token.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``), one float dtype.
        g: log-space decay ``[B, T, HV, K]`` (raw gate input with ``use_gate_in_kernel``).
        beta: ``[B, T, HV]`` (or one per value channel, ``[B, T, HV, V]``).
        A_log: ``[HV]``, for ``use_gate_in_kernel`` (may be None when ``lower_bound`` is set).
        dt_bias: ``[HV * K]`` bias added to ``g`` before the gate activation (``use_gate_in_kernel``).
        scale: defaults to ``K ** -0.5``.
        initial_state: the states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), or with
            ``state_indices`` a state pool ``[P, HV, K, V]``; fp32 (fp16/bf16 pools: computed in fp32,
            stored back in their dtype).
        output_final_state: return the fp32 final states ``[N, HV, K, V]``.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            lower_bound: as in :func:`chunk_kda`.
        state_v_first: states in the V-first layout.
        cu_seqlens: int32/int64 ``[N+1]`` cumulative lengths of packed inputs (``B == 1``).
        **kwargs: the state pool, by keyword: ``state_indices`` (FLA: ``ssm_state_indices``), int32/int64
            ``[N]``, sequence ``n`` reads and writes slot ``state_indices[n]`` (negative: skipped, zero
            output, slot untouched); ``inplace`` (FLA: ``inplace_final_state``): write the new states
            back into ``initial_state`` and return it as ``final_state``. Also the deprecated
            ``transpose_state_layout``. Unknown names are ignored with a warning.

    Returns:
        ``(o, final_state)``: ``o: [B, T, HV, V]`` in the dtype of ``q``; ``final_state`` is the pool with
        ``inplace``, else the new states if ``output_final_state``, else ``None``.

    Backends: cula's SM90 ``kda_decode`` kernel, then FLA's Triton ``fused_recurrent_kda`` (pool
    gather/scatter in torch), then the torch reference. FLA's recurrent KDA has no backward, so a call
    that needs gradients runs the differentiable torch reference (on the inputs' device).
    """

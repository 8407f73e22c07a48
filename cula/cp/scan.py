"""Exclusive scan of affine state summaries over the ranks of a context-parallel group.

Both recurrences are affine in the initial state: over a token range, ``S_end = M S_in + b``, where ``b`` is
the end state from a zero start and ``M`` the range's state transition (Lightning: one scalar
``exp(-decay * L)`` per head, shape ``[HV]``; KDA: a ``[HV, K, K]`` matrix). A rank whose last local
segment continues on the next rank publishes its summary ``(M, b)``; rank ``r`` then gets the true
initial state of its first local segment by applying, in order, the summaries of the ``pre_num_ranks``
ranks before it, starting from zero:

    h = 0;  for j in r - pre_num_ranks .. r - 1:  h = M_j h + b_j

(the chain's first rank folds any user initial state into its own ``b``, so starting from zero is exact).

Two transports compute the same thing: ``allgather`` (one collective of every rank's summary, then local
composition; differentiable) and ``ring`` (point-to-point, rank ``r`` receives ``h`` from ``r - 1`` and sends
``M_r h + b_r`` to ``r + 1``; forward only, W-1 sequential hops but only ``[HV, K, V]`` per hop).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from cula.cp.context import CPContext

Summary = tuple[torch.Tensor, torch.Tensor]  # (M, b): M [HV] or [HV, K, K]; b [HV, K, V]


def apply_transition(m: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``M h`` for a state ``h: [HV, K, V]`` and ``M: [HV]`` (scalar per head) or ``[HV, K, K]``."""
    if m.dim() == 1:
        return m[:, None, None] * h
    return torch.matmul(m, h)


def compose_chain(summaries: Sequence[Summary]) -> torch.Tensor | None:
    """The state after applying ``summaries`` in order to a zero start (``None`` for an empty chain)."""
    h = None
    for m, b in summaries:
        h = b if h is None else apply_transition(m, h) + b
    return h


def scan_dtype(state_dtype: torch.dtype) -> torch.dtype:
    """States travel and compose in at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(state_dtype, torch.float32)


def emulated_initial_states(summaries: Sequence[Summary], contexts: Sequence[CPContext]) -> list[torch.Tensor | None]:
    """Single-process version of the scan: the carried-in state of every emulated rank (``None`` if none)."""
    out: list[torch.Tensor | None] = []
    for ctx in contexts:
        if ctx.is_first_rank:
            out.append(None)
        else:
            out.append(compose_chain(summaries[ctx.rank - ctx.pre_num_ranks: ctx.rank]))
    return out


class _AllGather(torch.autograd.Function):
    """All-gather ``x`` into ``[W, *x.shape]``; backward sums each slice's gradient over ranks (all-reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group = group
        ctx.rank = dist.get_rank(group=group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import torch.distributed as dist

        # Every rank's loss may depend on every slice: the gradient of our slice is the sum over ranks.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


class _Tie(torch.autograd.Function):
    """A zero scalar that depends on ``x`` in autograd's eyes (its gradient to ``x`` is zero).

    Added to a rank's output, it makes the backward reach the all-gather on ranks that use none of the
    gathered summaries; unlike ``0 * x.sum()`` it stays zero when ``x`` holds inf.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        return torch.zeros((), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def inputs_require_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records the CP op: grad mode on and some input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _allgather_scan(
    m: torch.Tensor, b: torch.Tensor, ctx: CPContext, requires_grad: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    flat = torch.cat([m.reshape(-1), b.reshape(-1)])
    if requires_grad and not flat.requires_grad:
        # A rank with nothing to send (zeros) must still record the gather so it joins the backward.
        flat = flat.detach().requires_grad_()
    gathered = _AllGather.apply(flat, ctx.group)
    chain = [
        (row[: m.numel()].view_as(m), row[m.numel():].view_as(b))
        for row in gathered[ctx.rank - ctx.pre_num_ranks: ctx.rank]
    ]
    h0 = compose_chain(chain)
    # Ranks that use no slice must still join the backward all-reduce: tie the gathered tensor into the output.
    anchor = _Tie.apply(gathered) if gathered.requires_grad else None
    return h0, anchor


def _ring_scan(m: torch.Tensor, b: torch.Tensor, ctx: CPContext) -> torch.Tensor | None:
    import torch.distributed as dist

    h0 = None
    if ctx.carries_in:
        h0 = torch.empty_like(b)
        dist.recv(h0, src=dist.get_global_rank(ctx.group, ctx.rank - 1), group=ctx.group)
    if ctx.carries_out:
        # The carried-in state reaches the outgoing one only when both belong to the same (only) segment.
        passes_through = h0 is not None and ctx.num_seqs == 1
        h_out = apply_transition(m, h0) + b if passes_through else b
        dist.send(h_out.contiguous(), dst=dist.get_global_rank(ctx.group, ctx.rank + 1), group=ctx.group)
    return h0


_warned_ring_grad = False


def exclusive_scan(
    m: torch.Tensor, b: torch.Tensor, ctx: CPContext, *, requires_grad: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's carried-in state from every rank's summary (a collective: all ranks must call it).

    Args:
        m: this rank's transition, ``[HV]`` or ``[HV, K, K]`` (zeros when ``ctx.is_last_rank``).
        b: this rank's zero-start end state of its last local segment, ``[HV, K, V]`` (zeros likewise).
        ctx: the rank's context; ``ctx.group`` must be set when ``world_size > 1``.
        requires_grad: whether autograd records the op (:func:`inputs_require_grad` of the inputs); it
            must be the same on every rank, since it decides which collectives run in the backward.
    Returns:
        ``(h0, anchor)``: ``h0`` ``[HV, K, V]`` in ``b``'s dtype, or ``None`` when ``ctx.is_first_rank``;
        ``anchor`` a zero scalar to add to the output when autograd is recording (else ``None``), so that
        every rank takes part in the backward collective.
    """
    if ctx.world_size == 1:
        return None, None
    if ctx.group is None:
        raise ValueError(
            "cp_context: group is None (an emulated rank); use cula.cp.emulate_* for single-process runs"
        )
    if ctx.scan == "ring":
        if not requires_grad:
            return _ring_scan(m, b, ctx), None
        global _warned_ring_grad
        if not _warned_ring_grad:
            warnings.warn("cula.cp: scan='ring' is forward-only; using 'allgather' so gradients cross ranks",
                          stacklevel=3)
            _warned_ring_grad = True
    return _allgather_scan(m, b, ctx, requires_grad)

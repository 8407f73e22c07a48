"""Moving tokens and final states between the global layout and the ranks' local pieces.

The CP ops take and return local pieces only (like FLA's). These helpers slice global tensors for a rank,
put gathered pieces back together, and assemble the global ``[N, HV, K, V]`` final states from the ranks'
local ones: the true state of global sequence ``n`` is the local final state of its last segment, which
lives on the rank where ``n`` ends.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cula.cp.context import CPContext


def split_tokens(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """This rank's slice ``x[:, start:end]`` of a packed global tensor ``[1, T, ...]`` (contiguous)."""
    start, end = ctx.token_range
    total = ctx._need_global("split_tokens")[-1]
    if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != total:
        raise ValueError(f"x: expected a packed tensor [1, {total}, ...], got shape {list(x.shape)}")
    return x[:, start:end].contiguous()


def concat_tokens(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global ``[1, T, ...]`` from the ranks' local pieces in rank order (single process)."""
    return torch.cat(list(pieces), dim=1)


def gather_tokens(x_local: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """All-gather the ranks' ``[1, T_r, ...]`` pieces into the global ``[1, T, ...]`` on every rank."""
    import torch.distributed as dist

    offsets = ctx._need_global("gather_tokens")
    if ctx.world_size == 1:
        return x_local
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    width = max(lengths)
    padded = x_local.new_zeros((1, width, *x_local.shape[2:]))
    padded[:, : x_local.shape[1]] = x_local
    parts = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded, group=ctx.group)
    return torch.cat([p[:, :n] for p, n in zip(parts, lengths)], dim=1)


def _owned_final_states(local_final: torch.Tensor, ctx: CPContext, out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` the rows of the global sequences that end on this rank."""
    ctx._need_global("final states")
    ids = list(ctx.seq_ids)
    if ctx.carries_out:
        ids, local_final = ids[:-1], local_final[:-1]  # that sequence ends on a later rank
    if ids:
        out[ids] = local_final.to(out.dtype)
    return out


def _fill_empty_sequences(out: torch.Tensor, ctx: CPContext, initial_state: torch.Tensor | None) -> torch.Tensor:
    """Zero-length sequences have no segment anywhere: their final state is their initial state (or 0)."""
    cu = ctx.cu_seqlens_global_cpu
    empty = torch.nonzero(cu[1:] == cu[:-1]).flatten().tolist()
    if empty and initial_state is not None:
        out[empty] = initial_state[empty].to(out.dtype)
    return out


def assemble_final_state(
    local_finals: Sequence[torch.Tensor], contexts: Sequence[CPContext], initial_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Global ``[N, ...]`` final states from every emulated rank's local ones (single process)."""
    ctx0 = contexts[0]
    ctx0._need_global("assemble_final_state")
    n = len(ctx0.cu_seqlens_global_cpu) - 1
    out = local_finals[0].new_zeros((n, *local_finals[0].shape[1:]))
    for final, ctx in zip(local_finals, contexts):
        _owned_final_states(final, ctx, out)
    return _fill_empty_sequences(out, ctx0, initial_state)


def gather_final_state(
    local_final: torch.Tensor, ctx: CPContext, initial_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Global ``[N, ...]`` final states on every rank, from each rank's local ``[N_local, ...]`` (all-reduce).

    ``initial_state`` (global ``[N, ...]``) supplies the final state of zero-length sequences.
    """
    import torch.distributed as dist

    ctx._need_global("gather_final_state")
    n = len(ctx.cu_seqlens_global_cpu) - 1
    out = local_final.new_zeros((n, *local_final.shape[1:]))
    _owned_final_states(local_final, ctx, out)
    if ctx.world_size > 1:
        # Each sequence ends on exactly one rank and the others add zeros, so the sum is exact.
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
    return _fill_empty_sequences(out, ctx, initial_state)

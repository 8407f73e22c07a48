"""KDA forward on inputs too large for the kernels' 32-bit offsets: run them in pieces along the tokens.

The kernels address ``[rows, HV, 128]`` scratch and ``[N, HV, 128, 128]`` states with 32-bit offsets, so a
call must keep ``(tokens + 64 N) * HV * 128`` and ``N * HV * 128 * 128`` below ``2**31`` (``kda_fwd._too_big``):
at ``HV = 16`` that is one sequence of ~1M tokens. Larger inputs run as consecutive pieces of the packed
token stream. A sequence cut by a piece boundary is cut at a multiple of the chunk (64 tokens) from its
own start, so every chunk is the chunk of the unsplit call, and its fp32 end state is the next piece's
initial state: the kernels read and write the state in fp32, so the result is the unsplit call's, bit for
bit. The cost is the pieces' launches and one host sync to read ``cu_seqlens`` (such calls take tens of
milliseconds; they are not CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

CHUNK = 64
HEAD_DIM = 128


@dataclass(frozen=True)
class Piece:
    """Tokens ``[tok_lo, tok_hi)`` holding (parts of) sequences ``[seq_lo, seq_hi)``."""

    tok_lo: int
    tok_hi: int
    seq_lo: int
    seq_hi: int
    carry_in: bool  # the first sequence started in an earlier piece
    carry_out: bool  # the last sequence continues in the next piece
    cu: tuple[int, ...]  # local boundaries, starting at 0


def plan(cu_seqlens: list[int], num_heads_v: int, max_elements: int) -> list[Piece]:
    """Consecutive pieces each within the kernels' bounds (the bounds of ``kda_fwd._too_big``)."""
    row_elems = num_heads_v * HEAD_DIM
    # rows + 64 per segment (the padded-scratch bound) must stay below max_elements / row_elems
    cap_rows = (max_elements - 1) // row_elems
    max_segs = (max_elements - 1) // (row_elems * HEAD_DIM)  # the [N, HV, 128, 128] states' bound
    if cap_rows < 3 * CHUNK or max_segs < 1:
        raise ValueError(f"num_heads_v: {num_heads_v} heads leave no room for one chunk under the 32-bit "
                         f"offsets (max {max_elements} elements)")
    pieces: list[Piece] = []
    n = len(cu_seqlens) - 1
    seq, offset = 0, 0  # next token to place: sequence `seq`, `offset` tokens in
    while seq < n or not pieces:
        tok_lo, seq_lo, carry_in = cu_seqlens[seq] + offset if seq < n else cu_seqlens[-1], seq, offset > 0
        bounds, used = [0], 0
        carry_out = False
        while seq < n and len(bounds) - 1 < max_segs:
            rem = cu_seqlens[seq + 1] - cu_seqlens[seq] - offset
            room = cap_rows - used - CHUNK * len(bounds)  # the new segment's own 64 rows of slack included
            if room < 0:  # even an empty sequence counts 64 rows in the bound
                break
            take = rem if rem <= room else (room // CHUNK) * CHUNK
            if take <= 0 and rem > 0:
                break
            bounds.append(bounds[-1] + take)
            used += -(-take // CHUNK) * CHUNK
            if take < rem:
                offset += take
                carry_out = True
                break
            seq, offset = seq + 1, 0
        seq_hi = seq + 1 if carry_out else seq
        pieces.append(Piece(tok_lo, tok_lo + bounds[-1], seq_lo, seq_hi, carry_in, carry_out, tuple(bounds)))
        if seq >= n:
            break
    return pieces


def run_in_pieces(
    fwd: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    tokens: dict[str, torch.Tensor],
    cu_seqlens: list[int],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    pieces: list[Piece],
    state_shape: tuple[int, ...],
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``fwd`` (``kda_fwd``'s signature, packed ``[1, T, ...]`` tokens) piece by piece with the states
    carried across the cuts; returns the packed ``o`` and the ``[N, ...]`` final states (or None)."""
    some = next(iter(tokens.values()))
    outs: list[torch.Tensor] = []
    finals: list[torch.Tensor | None] = [None] * (len(cu_seqlens) - 1)
    carried: torch.Tensor | None = None
    for p in pieces:
        piece_tokens = {name: x[:, p.tok_lo:p.tok_hi] for name, x in tokens.items()}
        rows = None
        if initial_state is not None or p.carry_in:
            if initial_state is not None:
                rows = initial_state[p.seq_lo:p.seq_hi].clone()
            else:  # the carried state's dtype (fp32 from the kernels)
                rows = torch.zeros(p.seq_hi - p.seq_lo, *state_shape, device=some.device, dtype=carried.dtype)
            if p.carry_in:
                rows[0] = carried
        need_final = output_final_state or p.carry_out
        cu = torch.tensor(p.cu, device=some.device, dtype=torch.int32)
        o, ht = fwd(**piece_tokens, initial_state=rows, output_final_state=need_final, cu_seqlens=cu, **kwargs)
        outs.append(o)
        if need_final:
            for i in range(p.seq_hi - p.seq_lo):
                finals[p.seq_lo + i] = ht[i]
            carried = ht[-1] if p.carry_out else None
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if not output_final_state:
        return o, None
    return o, torch.stack(finals) if finals else None

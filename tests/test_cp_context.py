"""The CP partition: local boundaries and chain flags, by hand and against FLA 0.6.0's, plus bad input."""

from __future__ import annotations

import pytest
import torch

from cula.cp import build_cp_context
from cula.cp.context import emulated_contexts


def _meta(ctx):
    return (ctx.cu_seqlens_cpu.tolist(), ctx.seq_ids, ctx.is_first_rank, ctx.pre_num_ranks,
            ctx.is_last_rank, ctx.post_num_ranks)


def test_partition_by_hand_varlen_with_empty_sequences():
    # Sequences [0,3) [3,3) [3,20) [20,30) [30,40) over 4 ranks of 10 tokens.
    ctxs = emulated_contexts(torch.tensor([0, 3, 3, 20, 30, 40]), 4)
    assert [_meta(c) for c in ctxs] == [
        ([0, 3, 10], (0, 2), True, 0, False, 1),  # sequence 2 continues on rank 1
        ([0, 10], (2,), False, 1, True, 0),
        ([0, 10], (3,), True, 0, True, 0),  # sequence 3 starts exactly on the boundary
        ([0, 10], (4,), True, 0, True, 0),
    ]
    assert ctxs[1].token_range == (10, 20)
    assert ctxs[0].cu_seqlens.dtype == torch.int32


def test_partition_by_hand_one_sequence_over_all_ranks():
    ctxs = emulated_contexts(torch.tensor([0, 44]), 4)
    assert [_meta(c) for c in ctxs] == [
        ([0, 11], (0,), True, 0, False, 3),
        ([0, 11], (0,), False, 1, False, 2),
        ([0, 11], (0,), False, 2, False, 1),
        ([0, 11], (0,), False, 3, True, 0),
    ]


def test_partition_uneven_offsets():
    ctx = build_cp_context(torch.tensor([0, 5, 9]), rank=1, world_size=3, offsets=(0, 2, 7, 9))
    assert _meta(ctx) == ([0, 3, 5], (0, 1), False, 1, False, 1)
    # Default offsets with a remainder: r * T // W.
    assert emulated_contexts(torch.tensor([0, 10]), 3)[0].offsets == (0, 3, 6, 10)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_partition_matches_fla(world_size):
    from fla.ops.cp.context import get_cp_cu_seqlens

    gen = torch.Generator().manual_seed(world_size)
    for _ in range(20):
        lengths = torch.randint(0, 9, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        lengths[-1] += world_size - int(lengths.sum()) % world_size  # FLA needs T % W == 0
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        for rank in range(world_size):
            ours = build_cp_context(cu, rank=rank, world_size=world_size)
            fla = get_cp_cu_seqlens(cu.clone(), world_size=world_size, rank=rank)
            assert ours.cu_seqlens_cpu.tolist() == fla.cu_seqlens_cpu.tolist(), (cu.tolist(), rank)
            assert (ours.is_first_rank, ours.pre_num_ranks, ours.is_last_rank, ours.post_num_ranks) == (
                fla.is_first_rank, fla.pre_num_ranks, fla.is_last_rank, fla.post_num_ranks), (cu.tolist(), rank)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=torch.tensor([1, 4])), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 4, 3])), "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "dtype"),
        (dict(cu_seqlens=torch.tensor([[0, 4]])), "1-D"),
        (dict(cu_seqlens=torch.tensor([0, 1]), world_size=2), "at least world_size"),
        (dict(rank=2, world_size=2), "rank"),
        (dict(rank=None, world_size=2), "required when group is None"),
        (dict(offsets=(0, 4, 4, 8), world_size=3), "strictly increasing"),
        (dict(offsets=(0, 3)), "offsets"),
        (dict(scan="tree"), "scan"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = dict(cu_seqlens=torch.tensor([0, 5, 8]), rank=0, world_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        build_cp_context(args.pop("cu_seqlens"), **args)


def test_zigzag_layout_is_refused():
    with pytest.raises(NotImplementedError, match="contiguous"):
        build_cp_context(torch.tensor([0, 8]), rank=0, world_size=2, layout="zigzag")

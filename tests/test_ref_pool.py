"""cula.ref.pool: decode state-pool gather / scatter with skipped (negative-index) rows."""

from __future__ import annotations

import pytest
import torch

from _ref_cases import F64, gen, randn
from cula.ref import lightning, pool


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_reads_slots_and_zeros_skipped_rows(index_dtype):
    P = randn(gen(1), 6, 2, 4, 3)
    idx = torch.tensor([4, -1, 0, 2], dtype=index_dtype)
    out = pool.gather_states(P, idx)
    assert out.shape == (4, 2, 4, 3) and out.dtype == P.dtype
    assert torch.equal(out[0], P[4]) and torch.equal(out[2], P[0]) and torch.equal(out[3], P[2])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out[0] += 1  # a copy: the pool is untouched
    assert not torch.equal(out[0], P[4])


def test_scatter_writes_slots_in_place_and_leaves_others_untouched():
    P = randn(gen(2), 5, 2, 3)
    before = P.clone()
    states = randn(gen(3), 3, 2, 3)
    idx = torch.tensor([3, -1, 0])
    ret = pool.scatter_states(P, states, idx)
    assert ret is P
    assert torch.equal(P[3], states[0]) and torch.equal(P[0], states[2])
    for slot in (1, 2, 4):  # including the slot a skipped row might have hit
        assert torch.equal(P[slot], before[slot])


def test_scatter_casts_to_pool_dtype():
    P = torch.zeros(3, 2, dtype=torch.float32)
    pool.scatter_states(P, torch.ones(1, 2, dtype=F64), torch.tensor([1]))
    assert P.dtype == torch.float32 and torch.equal(P[1], torch.ones(2))


def test_gather_is_differentiable_and_skips_gradient_of_skipped_rows():
    P = randn(gen(4), 4, 3).requires_grad_()
    idx = torch.tensor([2, -1, 0])
    (pool.gather_states(P, idx) * torch.arange(1.0, 4.0, dtype=F64)[:, None]).sum().backward()
    expected = torch.zeros(4, 3, dtype=F64)
    expected[2] = 1.0
    expected[0] = 3.0
    assert torch.equal(P.grad, expected)


def test_decode_round_trip_equals_per_row_recurrence():
    # gather -> one-token recurrence -> scatter, as the decode op does it, against running each row
    # from its slot directly; the skipped row's output is zeroed and its slot kept.
    r = gen(5)
    B, H, HV, K, V, P_slots = 3, 1, 2, 4, 3, 5
    P = randn(r, P_slots, HV, K, V)
    before = P.clone()
    q, k, v = randn(r, B, 1, H, K), randn(r, B, 1, H, K), randn(r, B, 1, HV, V)
    decay = torch.tensor([0.3, 0.9], dtype=F64)
    idx = torch.tensor([4, -1, 1])
    h0 = pool.gather_states(P, idx)
    o, ht = lightning.recurrent(q, k, v, decay, initial_state=h0, output_final_state=True, dtype=F64)
    o = pool.zero_skipped_rows(o, idx)
    pool.scatter_states(P, ht, idx)
    for b, slot in ((0, 4), (2, 1)):
        o_b, s_b = lightning.recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], decay,
                                       initial_state=before[slot:slot + 1], output_final_state=True, dtype=F64)
        torch.testing.assert_close(o[b:b + 1], o_b, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(P[slot:slot + 1], s_b, rtol=1e-14, atol=1e-14)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    for slot in (0, 2, 3):
        assert torch.equal(P[slot], before[slot])


@pytest.mark.parametrize(
    "idx,states_rows,match",
    [
        (torch.tensor([0, 5]), 2, "pool size"),
        (torch.tensor([1, 1]), 2, "distinct"),
        (torch.tensor([[0, 1]]), 2, "1-D"),
        (torch.tensor([0.0, 1.0]), 2, "dtype"),
        (torch.tensor([0, 1, 2]), 2, "entries"),
    ],
)
def test_bad_indices_raise_value_error(idx, states_rows, match):
    P = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="state_indices"):
        pool.scatter_states(P, torch.zeros(states_rows, 2), idx)
    if match != "entries":
        with pytest.raises(ValueError, match=match):
            pool.gather_states(P, idx)


def test_scatter_rejects_mismatched_state_shape():
    with pytest.raises(ValueError, match="states"):
        pool.scatter_states(torch.zeros(5, 2, 3), torch.zeros(2, 3, 2), torch.tensor([0, 1]))

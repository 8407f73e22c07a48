"""Packed batches in the references: segments padded in length groups give each segment's own result.

Tolerance FP64_FORMS = 1e-10 (as test_ref_kda.py): a group runs its segments as one padded batch, a
segment alone runs unpadded; both are fp64 with the same chunk boundaries, so only summation order can
differ (observed ~1e-15), while a segment landing in the wrong slot or a wrong state row is O(1).
"""

from __future__ import annotations

import pytest
import torch

from _ref_cases import F64, delta_inputs, rel_err, split_by_cu, varlen_cu
from cula.ref import kda
from cula.ref._varlen import GROUP_SLACK, length_groups

FP64_FORMS = 1e-10

SKEWED = [700, 3, 0, 41, 64, 0, 9, 130, 1, 12]


@pytest.mark.parametrize("lengths", [SKEWED, [5] * 7, [0, 0, 0], [1000], [64, 65, 63, 0, 128, 2]])
def test_length_groups_cover_each_segment_once_within_slack(lengths):
    groups = length_groups(lengths)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    for g in groups:
        width = max(lengths[i] for i in g)
        real = sum(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * width <= GROUP_SLACK * max(real, 1)


def test_skewed_batch_pads_far_less_than_to_the_longest():
    # The case the training oracle ran out of memory on: one segment holding most tokens.
    padded = sum(len(g) * max(SKEWED[i] for i in g) for g in length_groups(SKEWED))
    assert padded <= 1.5 * sum(SKEWED)
    assert len(SKEWED) * max(SKEWED) > 6 * sum(SKEWED)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_grouped_packed_equals_each_segment_alone_with_gradients(form):
    fn = {"recurrent": kda.recurrent, "chunked": kda.chunked}[form]
    lengths = [70, 3, 0, 20, 1, 0, 9]
    cu = varlen_cu(lengths)
    T = sum(lengths)
    q, k, v, g, beta, _ = delta_inputs(5, 1, T, 2, 8, 4, HV=4)
    h0 = torch.randn(len(lengths), 4, 8, 4, dtype=F64, generator=torch.Generator().manual_seed(6))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, dtype=F64)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad([o, s], leaves, [do, ds])

    for i, parts in enumerate(zip(*(split_by_cu(x, cu) for x in (q, k, v, g, beta, do)))):
        seg = [x.clone().requires_grad_(True) for x in parts[:5]] + [h0[i:i + 1].clone().requires_grad_(True)]
        o_i, s_i = fn(*seg[:5], initial_state=seg[5], output_final_state=True, dtype=F64)
        assert rel_err(o[:, cu[i]:cu[i + 1]], o_i) < FP64_FORMS if lengths[i] else o_i.numel() == 0
        assert rel_err(s[i:i + 1], s_i) < FP64_FORMS
        if lengths[i] == 0:
            continue
        want = torch.autograd.grad([o_i, s_i], seg, [parts[5], ds[i:i + 1]])
        for name, got_all, w in zip("q k v g beta".split(), grads, want):
            got = got_all[:, cu[i]:cu[i + 1]]
            assert rel_err(got, w) < FP64_FORMS, (name, i)
        assert rel_err(grads[5][i:i + 1], want[5]) < FP64_FORMS

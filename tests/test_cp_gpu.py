"""GPU: single-process emulation of the CP split with the public ops (cula kernels) in bf16.

The same criterion as ``python -m cula.cp.multigpu``: measured against the fp32 torch reference, the CP
result's relative L2 error is at most 2 x the single-call error + 1e-3 (o and final states).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", ["fixed", "varlen"])
@pytest.mark.parametrize("variant", ["lightning", "kda"])
@pytest.mark.parametrize("K, V", [(64, 64), (128, 128)])
def test_emulated_cp_matches_single_gpu(variant, layout, world_size, K, V):
    from cula.cp import emulate_chunk_kda, emulate_lightning_attn_fwd
    from cula.cp._local import default_local_fn
    from cula.cp.multigpu import _rel_l2, check_layouts, make_inputs, reference

    T, H = 2048, 4
    device = torch.device("cuda")
    inputs = make_inputs(variant, T, H, K, V, torch.bfloat16, device, seed=7)
    lens = check_layouts(T, world_size)[layout]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    emulate = emulate_lightning_attn_fwd if variant == "lightning" else emulate_chunk_kda
    op = default_local_fn(variant)

    o_cp, s_cp = emulate(**inputs, output_final_state=True, cu_seqlens=cu, world_size=world_size)
    o_one, s_one = op(**inputs, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = reference(variant)(**inputs, output_final_state=True, cu_seqlens=cu)
    assert _rel_l2(o_cp, o_ref) <= 2 * _rel_l2(o_one, o_ref) + 1e-3
    assert _rel_l2(s_cp, s_ref) <= 2 * _rel_l2(s_one, s_ref) + 1e-3

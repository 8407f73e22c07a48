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


def test_kda_kernel_identity_response():
    """kda_fwd(identity_response=True): o_I and M against the fp64 emulation of the same two stage-2 passes,
    and the affinity CP relies on: the forward with initial state S0 equals o + o_I S0 (per sequence).

    Tolerance 1e-2 relative L2: the kernel's bf16 operands and bf16 o/o_I outputs give ~3-5e-3 against fp64
    (the CP checks see 4e-3 for o); a wrong pass, stream race or missing join is off by O(1)."""
    from cula.cp.multigpu import _rel_l2, make_inputs
    from cula.kernels.sm90 import kda_fwd as kernel

    device = torch.device("cuda")
    H, lens = 4, [300, 0, 700, 65]
    inputs = make_inputs("kda", sum(lens), H, 128, 128, torch.bfloat16, device, seed=3)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    o, ht, o_id, m = kernel.kda_fwd(**inputs, output_final_state=True, cu_seqlens=cu, identity_response=True)
    *_, o_id_ref, m_ref = kernel.emulate_stages(**inputs, output_final_state=True, cu_seqlens=cu,
                                                identity_response=True)
    assert o_id.shape == (1, sum(lens), H, 128) and m.shape == (len(lens), H, 128, 128)
    assert _rel_l2(o_id, o_id_ref) < 1e-2
    assert _rel_l2(m, m_ref) < 1e-2
    assert torch.equal(m[1], torch.eye(128, device=device).expand(H, 128, 128))  # zero-length sequence

    s0 = 0.1 * torch.randn(len(lens), H, 128, 128, device=device, generator=torch.Generator(device).manual_seed(4))
    o1, h1 = kernel.kda_fwd(**inputs, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    carried = torch.einsum("thk,thkv->thv", o_id[0].float(), s0[seq_of])
    assert _rel_l2(o[0].float() + carried, o1[0]) < 1e-2
    assert _rel_l2(ht + m @ s0, h1) < 1e-2

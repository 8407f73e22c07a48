"""KDA forward in pieces along the tokens (inputs past the kernels' 32-bit offsets).

CPU: the plan's invariants (every piece within the bounds, cuts at chunk multiples of their sequence, all
tokens covered once) and the carried states through the kernel's fp64 emulation, equal to the unsplit
emulation to rounding (1e-10: fp64, the same chunks). GPU: the real kernels with a shrunken element bound,
equal bit for bit to the unsplit call (the state crosses a cut in fp32, the chunks are the same).
"""

from __future__ import annotations

import random

import pytest
import torch

from cula.kernels.sm90 import kda_fwd as kf
from cula.kernels.sm90.kda_fwd_pieces import CHUNK, HEAD_DIM, plan, run_in_pieces


def _check_plan(cu: list[int], hv: int, max_elements: int) -> list:
    pieces = plan(cu, hv, max_elements)
    assert pieces[0].tok_lo == 0 and pieces[-1].tok_hi == cu[-1]
    for a, b in zip(pieces, pieces[1:]):
        assert a.tok_hi == b.tok_lo and a.carry_out == b.carry_in
        assert b.seq_lo == (a.seq_hi - 1 if a.carry_out else a.seq_hi)
    for p in pieces:
        n = len(p.cu) - 1
        assert n == p.seq_hi - p.seq_lo
        tokens = p.cu[-1]
        assert (tokens + CHUNK * n) * hv * HEAD_DIM < max_elements  # kda_fwd._too_big's bound
        assert n * hv * HEAD_DIM * HEAD_DIM < max_elements
        if p.carry_out:  # cut at a chunk multiple of the sequence's own start
            start_in_piece = p.tok_lo + p.cu[-2]
            seq_start = cu[p.seq_hi - 1]
            assert (start_in_piece + (p.cu[-1] - p.cu[-2]) - seq_start) % CHUNK == 0
    return pieces


@pytest.mark.parametrize("seed", range(200))
def test_plan_invariants(seed):
    rng = random.Random(seed)
    hv = rng.choice([1, 2, 4])
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 12))]
    if sum(lens) == 0:
        lens.append(5)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    max_elements = hv * HEAD_DIM * rng.randint(3 * CHUNK + 1, 4000)
    pieces = _check_plan(cu, hv, max_elements)
    if (cu[-1] + CHUNK * len(lens)) * hv * HEAD_DIM >= max_elements:
        assert len(pieces) > 1


def test_plan_of_one_million_tokens_at_16_heads():
    pieces = _check_plan([0, 1 << 20], 16, kf.MAX_ELEMENTS)
    assert len(pieces) == 2 and pieces[0].carry_out and pieces[0].tok_hi % CHUNK == 0


def test_plan_refuses_heads_without_room():
    with pytest.raises(ValueError, match="num_heads_v"):
        plan([0, 100], 1 << 20, kf.MAX_ELEMENTS)


@pytest.mark.parametrize("lens, with_state, v_first, rows", [
    ((700,), False, False, 250), ((130, 0, 400, 65), True, False, 250), ((130, 0, 400, 65), True, True, 300),
    ((1, 63, 64, 200), False, False, 300)])
def test_pieces_carry_the_state_exactly(lens, with_state, v_first, rows):
    """Through the fp64 emulation of the two kernels: the pieces' result is the unsplit one."""
    gen = torch.Generator().manual_seed(sum(lens))
    T, H, HV = sum(lens), 1, 2
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = dict(q=torch.randn(1, T, H, 128, generator=gen), k=torch.nn.functional.normalize(
        torch.randn(1, T, H, 128, generator=gen), dim=-1), v=torch.randn(1, T, HV, 128, generator=gen),
        g=-0.1 * torch.rand(1, T, HV, 128, generator=gen), beta=torch.rand(1, T, HV, generator=gen))
    h0 = torch.randn(len(lens), HV, 128, 128, generator=gen, dtype=torch.float64) if with_state else None

    def emulated(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        o, ht, _ = kf.emulate_stages(q, k, v, g, beta, initial_state=initial_state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kw)
        return o, ht

    o_ref, ht_ref = emulated(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, state_v_first=v_first)
    pieces = plan(cu.tolist(), HV, HV * HEAD_DIM * rows)
    assert len(pieces) > 2
    o, ht = run_in_pieces(emulated, x, cu.tolist(), h0, True, pieces, (HV, 128, 128), state_v_first=v_first)
    scale = o_ref.abs().max()
    assert (o - o_ref).abs().max() / scale < 1e-10
    assert (ht - ht_ref).abs().max() / ht_ref.abs().max() < 1e-10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["fixed", "varlen"])
def test_gpu_pieces_are_bitwise_the_unsplit_call(layout, monkeypatch):
    from cula.cp.multigpu import make_inputs

    dev = torch.device("cuda")
    lens = [3000] if layout == "fixed" else [700, 0, 1500, 65, 735]
    x = make_inputs("kda", sum(lens), 4, 128, 128, torch.bfloat16, dev, seed=5)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    h0 = 0.1 * torch.randn(len(lens), 4, 128, 128, device=dev)
    o_ref, ht_ref = kf.kda_fwd(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    monkeypatch.setattr(kf, "MAX_ELEMENTS", 4 * HEAD_DIM * 1000)  # pieces of < 1000 rows
    o, ht = kf.kda_fwd(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)

"""The tensor-core stage 1's triangular inverse (``KdaFwdIntraTC.invert`` with its fp32 SIMT lower-left
block, ``lower_left_simt``) run from its own DSL
source on the CPU under tests/_dsl_emulator.py: 128 emulated threads, the kernel's shared-memory pitches,
every vector access checked for alignment and every shared read for a prior write.

The GPU check only sees the inverse through w and u (after bf16 rounding), so this is where a wrong
register tile, a wrong block offset or a missing barrier shows up directly.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import _dsl_emulator as emu

pytest.importorskip("cutlass")
from cula.kernels.sm90 import kda_fwd_intra_tc as tc  # noqa: E402

Spec = namedtuple("Spec", "kind dtype")


def _strictly_lower(seed: int, decay: float) -> torch.Tensor:
    """β_i Σ_d k_id k_jd 2^(Γ_id − Γ_jd) for j < i with unit-norm keys: the Akk the kernel inverts."""
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(64, generator=g, dtype=torch.float64)
    gam = (-decay * torch.rand(64, 128, generator=g, dtype=torch.float64)).cumsum(0)
    a = torch.einsum("id,jd->ij", k * torch.exp2(gam), k * torch.exp2(-gam)) * beta[:, None]
    return torch.tril(a, -1)


def run_invert(a: torch.Tensor, subst: str = "left") -> torch.Tensor:
    ns = {"cute": emu.cute, "cutlass": emu.cutlass, "F32": emu.cutlass.Float32}
    ns["_vec"] = emu.rebind(tc._vec, ns)
    invert = emu.rebind(tc.KdaFwdIntraTC.invert, ns)
    tile = emu.rebind(tc.KdaFwdIntraTC._tile_product, ns)
    diagonal = emu.rebind(tc.KdaFwdIntraTC.diagonal_blocks, ns)
    right = emu.rebind(tc.KdaFwdIntraTC.substitute_right, ns)
    lower_left = emu.rebind(tc.KdaFwdIntraTC.lower_left_simt, ns)

    class Cfg:
        pass

    cfg = Cfg()
    cfg._tile_product = lambda *args: tile(cfg, *args)
    cfg.diagonal_blocks = lambda *args: diagonal(cfg, *args)
    cfg.subst = subst  # the diagonal blocks' substitution order (tc.SUBST_MODES)
    cfg.substitute_right = lambda *args: right(cfg, *args)
    # the fp32 SIMT lower-left block (INV_WGMMA=0); the default kernel forms that block on wgmma, which
    # the emulator cannot run: the GPU checks cover it
    cfg.inv_wgmma = False
    cfg.lower_left_simt = lambda *args: lower_left(cfg, *args)
    cfg.stamp = lambda *args: None  # the clock diagnostic's stamps: off, as KdaFwdIntraTC.stamp is without it
    # the kernel's fp32 matrices: row pitch PAD; the upper triangle of A holds zeros (as the combine writes)
    a_mem = torch.zeros(64, tc.PAD, dtype=torch.float32)
    a_mem[:, :64] = a.float()
    t_mem = torch.full((64, tc.PAD), float("nan"), dtype=torch.float32)
    y_mem = torch.full((2 * tc.SUB, tc.YPAD), float("nan"), dtype=torch.float32)
    mem = emu.Memory()
    mem.register(a_mem, t_mem, y_mem)
    import cutlass

    ptrs, backs = mem.pointers([Spec("ptr", cutlass.Float32)] * 3, [x.data_ptr() for x in (a_mem, t_mem, y_mem)])

    def kernel(p_a, p_t, p_y):
        tidx, _, _ = emu.cute.arch.thread_idx()
        lay = emu.cute.make_layout((64, 64), stride=(tc.PAD, 1))
        s_a = emu.cute.make_tensor(p_a, lay)
        s_t = emu.cute.make_tensor(p_t, lay)
        s_y = emu.cute.make_tensor(p_y, emu.cute.make_layout((2 * tc.SUB, 2 * tc.SUB), stride=(tc.YPAD, 1)))
        invert(cfg, s_a, s_t, s_y, tidx // 32, tidx % 32, tidx, None)

    emu.launch(kernel, [1, 1, 1], tc.THREADS, ptrs)
    emu.Memory.write_back(backs)
    return t_mem[:, :64]


@pytest.mark.parametrize("subst", tc.SUBST_MODES)
@pytest.mark.parametrize("seed,decay", [(0, 0.02), (1, 0.5), (3, 0.1)])
def test_invert_source_matches_the_exact_inverse(seed, decay, subst):
    """The kernel's inverse source (substitutions, doubling products, the SIMT lower-left block) run by
    the CPU emulator gives the exact T."""
    a = _strictly_lower(seed, decay)
    want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + a)
    got = run_invert(a, subst)
    # the kernel writes T on and below the diagonal blocks; the upper blocks of its sT are never read
    lower = torch.ones(64, 64, dtype=torch.bool).tril()
    blocks = (torch.arange(64)[:, None] // tc.SUB) >= (torch.arange(64)[None, :] // tc.SUB)
    assert not torch.isnan(got[blocks]).any(), "an entry of T was never written"
    err = (got.double() - want)[lower].norm() / want[lower].norm()
    assert err < 1e-5, err  # fp32 arithmetic: observed ~1e-7
    # the (0,1) and (2,3) blocks, which the products read, are exact zeros
    assert (got[:16, 16:32] == 0).all() and (got[32:48, 48:64] == 0).all()


@pytest.mark.parametrize("at", [(40, 3), (37, 34)])  # an off-diagonal block, a diagonal block
@pytest.mark.parametrize("subst", tc.SUBST_MODES)
def test_invert_check_can_fail(subst, at):
    """A planted error (one wrong entry of A after the kernel's copy) changes T beyond the tolerance."""
    a = _strictly_lower(2, 0.02)
    want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + a)
    bad = a.clone()
    bad[at] += 0.5
    got = run_invert(bad, subst)
    lower = torch.ones(64, 64, dtype=torch.bool).tril()
    assert (got.double() - want)[lower].norm() / want[lower].norm() > 1e-3

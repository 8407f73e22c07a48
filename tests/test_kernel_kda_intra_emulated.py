"""The KDA intra-chunk kernel's own source, run on the CPU under tests/_dsl_emulator.py.

Stage 1 of kda_fwd is SIMT, so the emulator can execute its DSL source one Python thread per CUDA
thread: the scratch it writes (w, u, qg, Aqk, kgᵀ, γ) must match the torch emulation of the same
stage (``kda_fwd.emulate_stages``, fp64), and the emulator checks bounds, reads of unwritten shared
memory and barrier participation. One or two chunks of one head keep it to seconds; the GPU check
covers the rest.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import _dsl_emulator as emu
from cula.kernels.sm90 import kda_fwd as kf
from cula.kernels.sm90 import kda_fwd_intra as intra

Spec = namedtuple("Spec", "kind dtype")
BF16_TOL = 2e-2  # bf16 scratch (8 mantissa bits), relative L2 per tensor; fp32 γ much tighter


def _inputs(T, cu, seed, flags):
    g = torch.Generator().manual_seed(seed)
    H = HV = 1
    q = torch.randn(1, T, H, 128, generator=g).bfloat16()
    k = torch.randn(1, T, H, 128, generator=g).bfloat16()
    v = torch.randn(1, T, HV, 128, generator=g).bfloat16()
    flags = dict(flags)
    weak = flags.pop("weak_decay", None)
    if weak is not None:  # log-space gate close to 0: far-apart tokens still interact (T's far blocks matter)
        gate = (-weak * torch.rand(1, T, HV, 128, generator=g)).bfloat16()
    else:
        gate = torch.randn(1, T, HV, 128, generator=g).bfloat16()
    beta = torch.randn(1, T, HV, generator=g).bfloat16()
    kw = dict(flags)
    if flags.get("use_gate_in_kernel"):
        kw["A_log"] = torch.randn(HV, generator=g) * 0.5
        kw["dt_bias"] = torch.randn(HV * 128, generator=g) * 0.1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    return (q, k, v, gate, beta), kw, cu_t


def run_intra(kernel_kwargs, args, kw, cu):
    """Launch the emulated intra kernel as kda_fwd would; returns the scratch dict."""
    q, k, v, g, beta = args
    B, T, H, K = q.shape
    HV = v.shape[2]
    qf, kq, vf, gf, bf = kf._flatten(q, k, v, g, beta)
    cu_all = cu if cu is not None else kf._fixed_cu_seqlens(B, T, q.device)
    chunks, seqs, NC = kf.chunk_tables(cu_all)
    R = NC * 64
    bf16 = torch.bfloat16
    scratch = dict(w=torch.full((HV, R, K), float("nan"), dtype=bf16),
                   u=torch.full((HV, R, 128), float("nan"), dtype=bf16),
                   qg=torch.full((HV, R, K), float("nan"), dtype=bf16),
                   aqk=torch.full((HV, R, 64), float("nan"), dtype=bf16),
                   kgt=torch.full((HV, K, R), float("nan"), dtype=bf16),
                   gam=torch.full((HV, NC, K), float("nan"), dtype=torch.float32))
    a_log = kw.get("A_log", torch.zeros(1)).float().contiguous()
    dtb = kw.get("dt_bias", torch.zeros(1)).float().contiguous()
    tensors = [qf.contiguous(), kq.contiguous(), vf.contiguous(), gf.contiguous(), bf.contiguous(), a_log, dtb,
               chunks, *scratch.values()]
    mem = emu.Memory()
    mem.register(*tensors)
    import cutlass

    dts = [cutlass.BFloat16] * 5 + [cutlass.Float32] * 2 + [cutlass.Int32] + [cutlass.BFloat16] * 5 + [cutlass.Float32]
    specs = [Spec("ptr", dt) for dt in dts] + [Spec("i32", None)] * 4 + [Spec("f32", None)] * 2
    lb = kw.get("lower_bound")
    values = [t.data_ptr() for t in tensors] + [B * T, H, HV, NC, K ** -0.5, lb if lb is not None else 0.0]
    kernel_name = "kernel_v2" if kernel_kwargs.get("variant", "v1") == "v2" else "kernel"
    kern = emu.emulated_instance(intra.KdaFwdIntra(**kernel_kwargs), {}, kernel_name=kernel_name)
    ptrs, backs = mem.pointers(specs, values)
    kern(*ptrs, None)
    emu.Memory.write_back(backs)
    return scratch


def _flags(kw, H=1, HV=1):
    return dict(use_qk_l2norm=bool(kw.get("use_qk_l2norm_in_kernel")), use_gate=bool(kw.get("use_gate_in_kernel")),
                has_a_log="A_log" in kw, has_dt_bias="dt_bias" in kw,
                use_lower_bound=bool(kw.get("use_gate_in_kernel") and kw.get("lower_bound") is not None),
                use_beta_sigmoid=bool(kw.get("use_beta_sigmoid_in_kernel")),
                allow_neg_eigval=bool(kw.get("allow_neg_eigval")), group=HV // H)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


CASES = [
    ("T64-full-flags", 64, None, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)),
    ("varlen-tail", 80, [0, 1, 80], dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)),
    # strong gates make T almost block diagonal; a weak one exercises every block of the inverse
    ("T64-weak-decay", 64, None, dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      weak_decay=0.02)),
]


# (variant, inverse) per case: every case for v1 x both inverses and v2 x column, except the varlen tail's v1 x
# column (a tail is masked where the rows load; neither inverse reads nvalid, and T64 covers both: ~30 s saved);
# v2 x blocked on the weak-decay case only (the one where every block of T matters); ~12 s an emulated chunk.
COMBOS = [(c, "v1", inv) for c in CASES for inv in intra.INVERSES if (c[0], inv) != ("varlen-tail", "column")] \
    + [(c, "v2", "column") for c in CASES] + [(CASES[2], "v2", "blocked")]


@pytest.mark.parametrize("name, T, cu, flags, variant, inverse", [(*c, v, inv) for c, v, inv in COMBOS],
                         ids=[f"{c[0]}-{v}-{inv}" for c, v, inv in COMBOS])
def test_intra_kernel_source_matches_the_stage_emulation(name, T, cu, flags, variant, inverse):
    args, kw, cu_t = _inputs(T, cu, seed=0, flags=flags)
    kw.pop("weak_decay", None)
    got = run_intra({**_flags(kw), "inverse": inverse, "variant": variant}, args, kw, cu_t)
    _, _, want = kf.emulate_stages(*args, **kw, cu_seqlens=cu_t, dtype=torch.float64)
    for key in ("w", "u", "qg", "aqk", "kgt"):
        assert torch.isfinite(got[key].float()).all(), f"{key}: unwritten elements"
        assert rel(got[key], want[key]) < BF16_TOL, (key, rel(got[key], want[key]))
    assert rel(got["gam"], want["gam"]) < 1e-5

"""Seeded inputs, local forwards and single-process oracles shared by the tests/test_cp_*.py files.

The local forward of every CP test is the torch reference (``cula.ref.<variant>.chunked``, fp64, a small
chunk so that rank boundaries fall inside chunks); the oracle is the same reference run on the whole,
unsplit input in one process. So a test measures only what CP adds: the split, the scan and the correction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

F64 = torch.float64
CHUNK = 8


def lightning_local(*args, **kwargs):
    """Lightning local forward: the chunked reference in fp64."""
    from cula.ref.lightning import chunked

    return chunked(*args, chunk_size=CHUNK, dtype=F64, **kwargs)


def kda_local(**kwargs):
    """KDA local forward: the chunked reference in fp64."""
    from cula.ref.kda import chunked

    kwargs.setdefault("chunk_size", CHUNK)
    return chunked(**kwargs, dtype=F64)


LOCAL_FNS = {"lightning": lightning_local, "kda": kda_local}


@dataclass(frozen=True)
class Case:
    """One CP scenario: a global input and how it is split."""

    name: str
    variant: str  # "lightning" | "kda"
    seqlens: tuple[int, ...] | None = None  # packed varlen lengths (zeros allowed)
    batch: tuple[int, int] | None = None  # (B, T) fixed-length input, cu_seqlens=None
    H: int = 2
    HV: int = 2
    K: int = 8
    V: int = 4
    with_state: bool = False
    state_v_first: bool = False
    offsets: tuple[int, ...] | None = None  # explicit rank offsets (emulation only)
    seed: int = 0
    options: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.batch[0] * self.batch[1]

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.batch[0]


def make_inputs(case: Case) -> dict:
    """Global inputs of ``case`` as keyword arguments of the single-device op (fp64, CPU)."""
    gen = torch.Generator().manual_seed(case.seed)
    if case.seqlens is not None:
        B, T = 1, case.total
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int64)
    else:
        (B, T), cu = case.batch, None

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    H, HV, K, V, N = case.H, case.HV, case.K, case.V, case.num_seqs
    out: dict = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, V), cu_seqlens=cu)
    if case.variant == "lightning":
        # Slow decays so that state carried across a rank boundary still matters many tokens later.
        out["decay"] = 0.05 + 0.2 * torch.rand(HV, generator=gen, dtype=F64)
    else:
        out["k"] = F.normalize(out["k"], dim=-1)  # keeps the delta rule contractive
        out["g"] = -0.15 * torch.rand(B, T, HV, K, generator=gen, dtype=F64)
        out["beta"] = torch.rand(B, T, HV, generator=gen, dtype=F64)
        out["state_v_first"] = case.state_v_first
        out.update(case.options)
        if case.options.get("use_gate_in_kernel"):
            out["g"] = randn(B, T, HV, K)  # raw gate input: g <- -exp(A_log) softplus(g + dt_bias)
            out["A_log"] = -2.0 + 0.5 * randn(HV)
            out["dt_bias"] = 0.1 * randn(HV * K)
    if case.with_state:
        shape = (N, HV, V, K) if case.state_v_first else (N, HV, K, V)
        out["initial_state"] = randn(*shape)
    return out


def oracle(case: Case, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process result ``(o, final_state)`` on the unsplit input."""
    return LOCAL_FNS[case.variant](**inputs, output_final_state=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return (got.to(F64) - want.to(F64)).abs().max().item() / max(want.abs().max().item(), 1e-30)


# Cases run in the gloo tests (both world sizes) and in the emulation tests. Lengths chosen so that, for
# W = 2 and 4, sequences cross rank boundaries, one sequence spans more than two ranks, zero-length
# segments sit at the start, in the middle and on a rank boundary, and ranks start mid-chunk.
DIST_CASES = (
    Case("lightning-fixed", "lightning", batch=(2, 24)),
    Case("lightning-varlen", "lightning", seqlens=(0, 5, 30, 0, 3, 10), HV=4, with_state=True, seed=1),
    Case("lightning-one-long", "lightning", seqlens=(44,), seed=2),
    Case("kda-fixed", "kda", batch=(2, 24), seed=3),
    Case("kda-varlen", "kda", seqlens=(0, 5, 30, 0, 3, 10), HV=4, with_state=True, seed=4),
    Case("kda-one-long-vfirst", "kda", seqlens=(44,), with_state=True, state_v_first=True, seed=5),
    Case("kda-gates-in-kernel", "kda", seqlens=(7, 21, 16), HV=4, seed=6,
         options=dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)),
)

"""Single-process emulation of the CP split: equal to the unsplit result (o, final state, gradients).

Tolerances: everything runs in fp64 through the same chunked reference, so CP's only error is rounding in
the extra products (observed ~1e-15 relative); 1e-8 leaves room for reduction-order noise while a missing
or wrong carry is off by 1e-2 or more (``test_carry_matters`` checks that for every case).
"""

from __future__ import annotations

import pytest
import torch

import cula.cp.kda as cp_kda
import cula.cp.lightning as cp_lightning
from cula.cp import build_cp_context, chunk_kda, emulate_chunk_kda, emulate_lightning_attn_fwd, lightning_attn_fwd
from _cp_cases import DIST_CASES, LOCAL_FNS, Case, make_inputs, oracle, rel_err

TOL = 1e-8
EMULATE = {"lightning": emulate_lightning_attn_fwd, "kda": emulate_chunk_kda}


def _emulate(case: Case, inputs: dict, world_size: int, **kw):
    return EMULATE[case.variant](**inputs, output_final_state=True, world_size=world_size,
                                 offsets=case.offsets, local_fn=LOCAL_FNS[case.variant], **kw)


EXTRA_CASES = (
    Case("lightning-gva-uneven", "lightning", seqlens=(9, 0, 12), H=1, HV=3, offsets=(0, 2, 3, 15, 21), seed=7),
    Case("kda-gva-uneven", "kda", seqlens=(9, 0, 12), H=1, HV=3, with_state=True, offsets=(0, 2, 3, 15, 21), seed=8),
    Case("kda-one-token-per-rank", "kda", seqlens=(3, 4), with_state=True, seed=9),
    Case("lightning-one-token-per-rank", "lightning", seqlens=(3, 4), with_state=True, seed=10),
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: c.name)
def test_emulated_split_equals_single_process(case, world_size):
    inputs = make_inputs(case)
    o_ref, s_ref = oracle(case, inputs)
    o, s = _emulate(case, inputs, world_size)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: c.name)
def test_emulated_uneven_and_tiny_splits(case):
    inputs = make_inputs(case)
    o_ref, s_ref = oracle(case, inputs)
    world_size = 4 if case.offsets else 7  # 7 tokens over 7 ranks: every rank holds one token
    o, s = _emulate(case, inputs, world_size)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("case", [c for c in DIST_CASES if c.variant == "kda"], ids=lambda c: c.name)
def test_kda_identity_columns_in_a_separate_call(case):
    """The transition from a second local call (K columns only) gives the same result as appended columns."""
    inputs = make_inputs(case)
    o_ref, s_ref = oracle(case, inputs)
    o, s = _emulate(case, inputs, 3, identity_columns="separate")
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: c.name)
def test_carry_matters(case, monkeypatch):
    """Dropping the scan (every rank from zero) must break these cases, or the test above proves nothing."""
    inputs = make_inputs(case)
    o_ref, _ = oracle(case, inputs)
    module = cp_lightning if case.variant == "lightning" else cp_kda
    monkeypatch.setattr(module, "emulated_initial_states", lambda summaries, contexts: [None] * len(contexts))
    o, _ = _emulate(case, inputs, 4)
    assert rel_err(o, o_ref) > 1e-2


@pytest.mark.parametrize("variant", ["lightning", "kda"])
def test_gradients_cross_ranks(variant):
    case = Case(f"{variant}-grad", variant, seqlens=(5, 19), HV=2, with_state=True, seed=11)
    names = ["q", "k", "v", "initial_state"] + (["decay"] if variant == "lightning" else ["g", "beta"])
    grads = []
    for run in ("single", "cp"):
        inputs = make_inputs(case)
        for n in names:
            inputs[n].requires_grad_(True)
        o, s = oracle(case, inputs) if run == "single" else _emulate(case, inputs, 3)
        weight = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        ((o * weight).sum() + s.square().sum()).backward()
        grads.append({n: inputs[n].grad for n in names})
    for n in names:
        assert rel_err(grads[1][n], grads[0][n]) < TOL, n


@pytest.mark.parametrize("variant", ["lightning", "kda"])
def test_default_local_forward(variant):
    """Without ``local_fn`` CP runs the public op (or, while it is missing, the reference with a warning)."""
    import warnings

    case = Case(f"{variant}-default", variant, seqlens=(6, 20), seed=12)
    inputs = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
              for n, x in make_inputs(case).items()}
    o_ref, s_ref = oracle(case, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, s = EMULATE[variant](**inputs, output_final_state=True, world_size=3)
    assert rel_err(o, o_ref) < 1e-4
    assert rel_err(s, s_ref) < 1e-4


def test_single_rank_context_is_the_plain_op():
    case = DIST_CASES[1]
    inputs = make_inputs(case)
    o_ref, s_ref = oracle(case, inputs)
    ctx = build_cp_context(inputs["cu_seqlens"], rank=0, world_size=1)
    o, s_local = lightning_attn_fwd(**inputs, output_final_state=True, cp_context=ctx, local_fn=LOCAL_FNS["lightning"])
    assert rel_err(o, o_ref) < TOL
    # Local final states cover the non-empty sequences only.
    nonempty = [i for i, n in enumerate(case.seqlens) if n > 0]
    assert rel_err(s_local, s_ref[nonempty]) < TOL


def _kda_local_inputs(world_size=2, rank=0):
    case = DIST_CASES[4]
    inputs = make_inputs(case)
    ctx = build_cp_context(inputs["cu_seqlens"], rank=rank, world_size=world_size)
    start, end = ctx.token_range
    for n in ("q", "k", "v", "g", "beta"):
        inputs[n] = inputs[n][:, start:end]
    return inputs, ctx


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q="full"), ValueError, "q: expected this rank's packed piece"),
        (dict(beta="2d"), ValueError, "beta"),
        (dict(cu_seqlens=torch.tensor([0, 3, 9])), ValueError, "cu_seqlens"),
        (dict(initial_state=torch.zeros(2, 4, 8, 4)), ValueError, "initial_state"),
        (dict(cp_context="nope"), ValueError, "cp_context"),
        (dict(return_intermediate_states=True), NotImplementedError, "return_intermediate_states"),
        (dict(identity_columns="both"), ValueError, "identity_columns"),
        (dict(), ValueError, "group is None"),  # a 2-rank context without a process group
    ],
)
def test_kda_bad_input(change, error, match):
    inputs, ctx = _kda_local_inputs()
    full = make_inputs(DIST_CASES[4])
    if change.get("q") == "full":
        change = dict(q=full["q"])
    if change.get("beta") == "2d":
        change = dict(beta=inputs["beta"][0])
    kwargs = inputs | dict(cp_context=ctx, local_fn=LOCAL_FNS["kda"]) | change
    with pytest.raises(error, match=match):
        chunk_kda(**kwargs)


def test_lightning_bad_decay():
    case = DIST_CASES[0]
    inputs = make_inputs(case)
    inputs["cu_seqlens"] = None
    ctx = build_cp_context(torch.tensor([0, 48]), rank=0, world_size=1)
    q, k, v = (x.reshape(1, 48, *x.shape[2:]) for x in (inputs["q"], inputs["k"], inputs["v"]))
    with pytest.raises(ValueError, match="decay"):
        lightning_attn_fwd(q, k, v, torch.ones(3, dtype=torch.float64), cp_context=ctx, local_fn=LOCAL_FNS["lightning"])


def _fake_identity_kernel():
    """The SM90 kernel module's interface backed by its torch emulation (fp64): kda_fwd with the
    identity response, and supports() accepting everything."""
    import functools
    import types

    from cula.kernels.sm90 import kda_fwd as kernel

    @functools.wraps(kernel.kda_fwd)
    def kda_fwd(q, k, v, g, beta, *, identity_response=False, **kw):
        assert identity_response
        o, ht, _, o_id, m = kernel.emulate_stages(q, k, v, g, beta, **kw, identity_response=True)
        return o, ht, o_id, m

    return types.SimpleNamespace(kda_fwd=kda_fwd, supports=lambda *a, **kw: None)


@pytest.mark.parametrize("case", [c for c in DIST_CASES if c.variant == "kda"] + [EXTRA_CASES[1]],
                         ids=lambda c: c.name)
def test_kda_identity_response_from_the_kernel(case, monkeypatch):
    """identity_columns='kernel': the carried-in segment's o_I and M come from the kernel's second stage-2
    pass (here its emulation) instead of extra value columns; the result is the unsplit one."""
    monkeypatch.setattr(cp_kda, "_identity_kernel", _fake_identity_kernel)
    inputs = make_inputs(case)
    o_ref, s_ref = oracle(case, inputs)
    o, s = _emulate(case, inputs, 4 if case.offsets else 3, identity_columns="kernel")
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s, s_ref) < TOL


def test_kda_identity_response_is_affine_in_the_initial_state():
    """The emulated kernel's o_I and M: o(S0) = o(0) + o_I S0 and S_end(S0) = S_end(0) + M S0 per sequence."""
    from cula.kernels.sm90.kda_fwd import emulate_stages

    case = Case("kda-affine", "kda", seqlens=(70, 0, 5), HV=2, K=8, V=4, with_state=True, seed=21)
    inputs = make_inputs(case)
    s0 = inputs.pop("initial_state")
    o0, e0, _, o_id, m = emulate_stages(**inputs, output_final_state=True, identity_response=True)
    o1, e1, _ = emulate_stages(**inputs, initial_state=s0, output_final_state=True)
    cu = inputs["cu_seqlens"].tolist()
    for n in range(len(cu) - 1):
        t = slice(cu[n], cu[n + 1])
        if cu[n + 1] > cu[n]:
            assert rel_err(o0[0, t] + torch.einsum("thk,hkv->thv", o_id[0, t], s0[n]), o1[0, t]) < TOL
        assert rel_err(e0[n] + m[n] @ s0[n], e1[n]) < TOL
    assert torch.equal(m[1], torch.eye(8, dtype=m.dtype).expand(2, 8, 8))  # zero-length: the identity


def test_kda_identity_columns_kernel_needs_the_kernel():
    case = DIST_CASES[0] if DIST_CASES[0].variant == "kda" else next(c for c in DIST_CASES if c.variant == "kda")
    inputs = make_inputs(case)
    with pytest.raises(ValueError, match="identity_columns"):
        _emulate(case, inputs, 2, identity_columns="kernel")  # CPU tensors: the kernel cannot run them

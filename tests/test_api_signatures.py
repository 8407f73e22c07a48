"""The public ops have FLA 0.6.0's exact parameter lists (names, kinds, defaults), Lightning the documented one."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


PAIRS = [
    ("cula.kda", "chunk_kda", "fla.ops.kda", "chunk_kda"),
    ("cula.kda", "fused_recurrent_kda", "fla.ops.kda", "fused_recurrent_kda"),
    ("cula.gdn", "chunk_gated_delta_rule", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    ("cula.gdn", "fused_recurrent_gated_delta_rule", "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    ("cula.gla", "chunk_gla", "fla.ops.gla", "chunk_gla"),
    ("cula.gla", "fused_recurrent_gla", "fla.ops.gla", "fused_recurrent_gla"),
]


@pytest.mark.parametrize("ours_mod, ours, fla_mod, fla", PAIRS, ids=[p[1] for p in PAIRS])
def test_signature_equals_fla(ours_mod, ours, fla_mod, fla):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FLA warns that Triton has no CPU backend
        theirs = getattr(importlib.import_module(fla_mod), fla)
    mine = getattr(importlib.import_module(ours_mod), ours)
    assert _params(mine) == _params(theirs)


P = inspect.Parameter
LIGHTNING_FWD = [
    ("q", P.POSITIONAL_OR_KEYWORD, P.empty), ("k", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("v", P.POSITIONAL_OR_KEYWORD, P.empty), ("decay", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("scale", P.POSITIONAL_OR_KEYWORD, None), ("initial_state", P.POSITIONAL_OR_KEYWORD, None),
    ("output_final_state", P.POSITIONAL_OR_KEYWORD, False), ("cu_seqlens", P.POSITIONAL_OR_KEYWORD, None),
    ("cp_context", P.POSITIONAL_OR_KEYWORD, None),
]
LIGHTNING_DECODE = LIGHTNING_FWD[:-2] + [
    ("state_indices", P.POSITIONAL_OR_KEYWORD, None), ("inplace", P.POSITIONAL_OR_KEYWORD, False),
]


def test_lightning_signatures_match_interfaces():
    from cula.lightning import lightning_attn_decode, lightning_attn_fwd

    assert _params(lightning_attn_fwd) == LIGHTNING_FWD
    assert _params(lightning_attn_decode) == LIGHTNING_DECODE


@pytest.mark.parametrize("mod, name", [(m, n) for m, n, _, _ in PAIRS] + [
    ("cula.lightning", "lightning_attn_fwd"), ("cula.lightning", "lightning_attn_decode")])
def test_docstrings_document_every_parameter(mod, name):
    fn = getattr(importlib.import_module(mod), name)
    doc = fn.__doc__ or ""
    for pname in inspect.signature(fn).parameters:
        assert pname in doc, f"{name}: parameter {pname} undocumented"
    assert "Returns" in doc and "Backends" in doc


def test_import_cula_is_cheap():
    import subprocess
    import sys

    code = "import sys, cula; print('torch' in sys.modules, 'fla' in sys.modules, callable(cula.backends))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_argument_binding_errors_are_python_s():
    import torch

    from cula.gla import chunk_gla
    from cula.lightning import lightning_attn_fwd

    q = torch.randn(1, 4, 2, 8)
    v = torch.randn(1, 4, 2, 4)
    with pytest.raises(TypeError, match="missing required argument: 'decay'"):
        lightning_attn_fwd(q, q, v)
    with pytest.raises(TypeError, match="multiple values for argument 'q'"):
        lightning_attn_fwd(q, q, v, torch.rand(2), q=q)
    with pytest.raises(TypeError, match="takes 9 positional arguments but 10"):
        lightning_attn_fwd(q, q, v, torch.rand(2), None, None, False, None, None, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'gk'"):  # chunk_gla has no **kwargs
        chunk_gla(q, q, v, torch.zeros_like(q), gk=q)
    # positional and keyword spellings bind the same way
    a = lightning_attn_fwd(q, q, v, torch.ones(2), 0.5)[0]
    b = lightning_attn_fwd(v=v, k=q, q=q, decay=torch.ones(2), scale=0.5)[0]
    assert torch.equal(a, b)

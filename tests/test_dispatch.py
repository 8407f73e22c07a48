"""Dispatch decisions: CPU -> torch-ref; a fake Hopper GPU and fake kernel / FLA modules for the rest."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest
from pathlib import Path
import torch

import cula
from cula import CulaFallbackWarning, _dispatch
from cula._dispatch import CULA_CP, CULA_SM90, CULA_SM90_FLA_BWD, FLA_TRITON, TORCH_REF
from cula._warn import reset_fallback_warnings
from cula.kda import chunk_kda, fused_recurrent_kda
from cula.lightning import lightning_attn_decode, lightning_attn_fwd

B, T, H, HV, K, V = 2, 5, 2, 4, 8, 4


@pytest.fixture(autouse=True)
def _fresh():
    _dispatch.clear_caches()
    reset_fallback_warnings()
    yield
    _dispatch.clear_caches()
    reset_fallback_warnings()


@pytest.fixture
def hopper(monkeypatch):
    """Make CPU tensors look like tensors on an sm_90 GPU (FLA installed)."""
    monkeypatch.setattr(_dispatch, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(_dispatch, "cuda_available", lambda: True)
    monkeypatch.setattr(_dispatch, "_current_arch", lambda: (9, 0))
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: True)
    for name in _dispatch.KERNEL_ARGS:  # hide the real kernel modules: tests inject fakes
        monkeypatch.setitem(sys.modules, f"cula.kernels.sm90.{name}", None)


def fake_kernel(monkeypatch, name, reason=None, result=("o", "ht")):
    """Inject ``cula.kernels.sm90.<name>`` whose supports() answers ``reason``; records the host calls."""
    module = types.ModuleType(f"cula.kernels.sm90.{name}")
    module.calls = []
    module.supports_calls = []

    def supports(**kwargs):
        module.supports_calls.append(kwargs)
        return reason(kwargs) if callable(reason) else reason

    def host(**kwargs):
        module.calls.append(kwargs)
        return result

    module.supports = supports
    setattr(module, name, host)
    monkeypatch.setitem(sys.modules, f"cula.kernels.sm90.{name}", module)
    return module


def lightning(t=T, grad=False):
    x = dict(q=torch.randn(B, t, H, K), k=torch.randn(B, t, H, K), v=torch.randn(B, t, HV, V), decay=torch.rand(HV))
    if grad:
        x["q"].requires_grad_()
    return x


def kda(t=T):
    return dict(q=torch.randn(B, t, H, K), k=torch.randn(B, t, H, K), v=torch.randn(B, t, HV, V),
                g=-torch.rand(B, t, HV, K), beta=torch.rand(B, t, HV))


def fake_fla(monkeypatch, module, name, fn):
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
    calls = []

    def recorder(*args, **kwargs):
        calls.append(kwargs)
        return fn(*args, **kwargs)

    monkeypatch.setattr(mod, name, recorder)
    return calls


# --- CPU


@pytest.mark.parametrize("op, inputs", [
    ("lightning_attn_fwd", lightning), ("chunk_kda", kda), ("fused_recurrent_kda", kda)])
def test_cpu_takes_torch_ref_silently(op, inputs):
    d = cula.backends(op, **inputs())
    assert d.backend == TORCH_REF
    assert all(s.environmental for s in d.skipped)
    assert [s.backend for s in d.skipped] == [CULA_SM90, FLA_TRITON]
    fn = {"lightning_attn_fwd": lightning_attn_fwd, "chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}[op]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)
        fn(**inputs())


def test_backends_listing_without_inputs():
    table = cula.backends()
    assert set(table) == set(_dispatch.TABLE)
    assert [s.backend for s in table["chunk_kda"]] == [CULA_CP, CULA_SM90_FLA_BWD, CULA_SM90, FLA_TRITON,
                                                       TORCH_REF]
    assert table["chunk_kda"][0].available  # context parallel runs on any device
    assert table["chunk_kda"][-1].available and table["chunk_kda"][-1].reason is None
    if not torch.cuda.is_available():
        assert table["chunk_kda"][1] == (CULA_SM90_FLA_BWD, False, "no CUDA device")
        assert table["chunk_kda"][2] == (CULA_SM90, False, "no CUDA device")
    assert cula.backends("cula.gla.chunk_gla") == table["chunk_gla"]
    with pytest.raises(ValueError, match="^op:"):
        cula.backends("chunk_kdaa")


def test_backends_validates_like_the_op():
    x = kda()
    x["beta"] = x["beta"][..., :1]
    with pytest.raises(ValueError, match="^beta:"):
        cula.backends("chunk_kda", **x)


def test_no_backend_raises_with_reasons():
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        chunk_kda(**kda(), return_intermediate_states=True)


# --- fake Hopper GPU


def test_hopper_without_kernel_module_takes_fla_silently(hopper, monkeypatch):
    monkeypatch.setitem(sys.modules, "cula.kernels.sm90.lightning_fwd", None)  # as if the module did not exist
    d = cula.backends("lightning_attn_fwd", **lightning())
    assert d.backend == FLA_TRITON
    assert d.skipped[0].backend == CULA_SM90 and d.skipped[0].environmental
    assert "no kernel module cula.kernels.sm90.lightning_fwd" in d.skipped[0].reason


def test_non_hopper_gpu_skips_the_kernel(hopper, monkeypatch):
    fake_kernel(monkeypatch, "lightning_fwd")
    monkeypatch.setattr(_dispatch, "device_arch", lambda device: (8, 0))
    d = cula.backends("lightning_attn_fwd", **lightning())
    assert d.backend == FLA_TRITON and "sm_80" in d.skipped[0].reason and d.skipped[0].environmental


def test_broken_kernel_import_is_a_reason(hopper, monkeypatch):
    real = _dispatch.importlib.import_module

    def import_module(name, *args):
        if name == "cula.kernels.sm90.lightning_fwd":
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return real(name, *args)

    monkeypatch.setattr(_dispatch.importlib, "import_module", import_module)
    d = cula.backends("lightning_attn_fwd", **lightning())
    assert d.backend == FLA_TRITON and d.skipped[0].environmental
    assert "failed to import (ImportError: libcuda.so.1" in d.skipped[0].reason


def test_kernel_path_calls_host_with_interface_arguments(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_fwd", result=("O", "HT"))
    x = lightning()
    assert lightning_attn_fwd(**x, output_final_state=True) == ("O", "HT")
    (call,) = mod.calls
    assert list(call) == list(_dispatch.KERNEL_ARGS["lightning_fwd"])
    assert call["scale"] == pytest.approx(K ** -0.5)  # resolved from None
    assert call["q"] is x["q"] and call["output_final_state"] is True and call["cu_seqlens"] is None
    assert mod.supports_calls[0].keys() == call.keys()
    assert cula.backends("lightning_attn_fwd", **x).backend == CULA_SM90


@pytest.mark.parametrize("opt_in, chosen", [(None, FLA_TRITON), ("kda_fwd", CULA_SM90), ("all", CULA_SM90),
                                             ("lightning_fwd", FLA_TRITON), (" kda_decode , kda_fwd", CULA_SM90)])
def test_a_kernel_slower_than_fla_is_off_by_default_and_opt_in(hopper, monkeypatch, opt_in, chosen):
    mod = fake_kernel(monkeypatch, "kda_fwd")
    mod.DISPATCH_OFF = "cula-sm90 kda_fwd: correct but measured 0.3x FLA"
    if opt_in is None:
        monkeypatch.delenv(_dispatch.OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(_dispatch.OPT_IN_ENV, opt_in)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)  # a policy, not these inputs: no warning
        d = cula.backends("chunk_kda", **kda())
    assert d.backend == chosen
    if chosen == FLA_TRITON:
        skip = d.skipped[0]
        assert skip.backend == CULA_SM90 and skip.environmental
        assert "measured 0.3x FLA" in skip.reason and "CULA_KERNELS=kda_fwd" in skip.reason


def test_real_kda_fwd_is_on_by_default_backed_by_a_committed_run():
    """kda_fwd is dispatched by default only because a committed `kda` suite run shows it ahead of FLA."""
    import pandas as pd

    from cula.kernels.sm90 import kda_fwd

    assert kda_fwd.GPU_VALIDATED and kda_fwd.DISPATCH_OFF is None
    run = "20261203-070755-h200-4aa088a-2790"  # the run cited beside DISPATCH_OFF
    assert run in open(kda_fwd.__file__).read()
    rows = pd.read_parquet(Path(__file__).resolve().parents[1] / "reports" / "results" / f"{run}.parquet")
    ok = rows[rows.status == "ok"].pivot_table(index="config_id", columns="impl", values="eager_ms")
    ok = ok.dropna()
    speedup = ok["fla"] / ok["cula"]
    assert len(speedup) >= 20 and float(np.exp(np.log(speedup).mean())) > 1.0


def test_kda_kernels_get_their_argument_lists(hopper, monkeypatch):
    fwd = fake_kernel(monkeypatch, "kda_fwd")
    dec = fake_kernel(monkeypatch, "kda_decode")
    chunk_kda(**kda(), scale=0.25)
    fused_recurrent_kda(**kda(t=1), initial_state=torch.zeros(7, HV, K, V), state_indices=torch.tensor([3, 1]),
                        inplace=True)
    assert list(fwd.calls[0]) == list(_dispatch.KERNEL_ARGS["kda_fwd"]) and fwd.calls[0]["scale"] == 0.25
    call = dec.calls[0]
    assert call["inplace"] is True and call["state_indices"].tolist() == [3, 1]
    # varlen decode is not the kernel's: FLA takes it (and the kernel's supports() is not even asked)
    x = {n: t.reshape(1, -1, *t.shape[2:]) for n, t in kda(t=1).items()}
    d = cula.backends("fused_recurrent_kda", **x, cu_seqlens=torch.tensor([0, 1, 2]))
    assert d.backend == FLA_TRITON and "cu_seqlens" in d.skipped[0].reason


def test_unsupported_input_warns_once_per_reason(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_fwd", reason=lambda kw: f"head dim {kw['q'].shape[-1]} not supported")
    calls = fake_fla(monkeypatch, "fla.ops.simple_gla", "chunk_simple_gla", lambda *a, **kw: ("fla", None))
    with pytest.warns(CulaFallbackWarning, match=r"'cula-sm90'.*head dim 8 not supported.*'fla-triton'") as rec:
        assert lightning_attn_fwd(**lightning())[0] == "fla"
    assert rec[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)
        lightning_attn_fwd(**lightning())  # same (op, backend, reason): silent
    x = lightning()
    x["q"], x["k"] = torch.randn(B, T, H, 16), torch.randn(B, T, H, 16)
    with pytest.warns(CulaFallbackWarning, match="head dim 16"):
        lightning_attn_fwd(**x)
    assert len(calls) == 3 and not mod.calls


def test_kernel_supports_exception_is_a_reason(hopper, monkeypatch):
    fake_kernel(monkeypatch, "lightning_fwd", reason=lambda kw: 1 / 0)
    d = cula.backends("lightning_attn_fwd", **lightning())
    assert d.backend == FLA_TRITON and "ZeroDivisionError" in d.skipped[0].reason


def test_gradients_skip_the_kernel(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_fwd")
    d = cula.backends("lightning_attn_fwd", **lightning(grad=True))
    assert d.backend == FLA_TRITON and "gradients" in d.skipped[0].reason and not d.skipped[0].environmental
    with torch.no_grad():
        assert cula.backends("lightning_attn_fwd", **lightning(grad=True)).backend == CULA_SM90
    assert not mod.calls


def kda_train(grad=True, **extra):
    """chunk_kda inputs the tensor-core forward serves (l2norm, in-kernel gate), v requiring grad."""
    x = dict(kda(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
             A_log=torch.zeros(HV), **extra)
    if grad:
        x["v"].requires_grad_()
    return x


def fake_kda_fwd(monkeypatch, reason=None, factors_reason=None, opt_in=True):
    mod = fake_kernel(monkeypatch, "kda_fwd", reason=reason)
    mod.fla_factors_reason = lambda *args, **kwargs: factors_reason
    if opt_in:  # off by default until validated on a GPU (cula.kda._train.SWITCH)
        monkeypatch.setenv("CULA_KERNELS", "kda_fwd_train")
    return mod


def test_kda_gradients_path_is_off_until_validated(hopper, monkeypatch):
    from cula.kda import _train

    monkeypatch.setattr(_train, "SWITCH", ("kda_fwd_train", "not yet validated"))
    fake_kda_fwd(monkeypatch, opt_in=False)
    d = cula.backends("chunk_kda", **kda_train())
    assert d.backend == FLA_TRITON
    assert d.skipped[0].backend == CULA_SM90_FLA_BWD and d.skipped[0].environmental  # silent
    assert "CULA_KERNELS=kda_fwd_train" in d.skipped[0].reason
    monkeypatch.setattr(_train, "SWITCH", ("kda_fwd_train", None))  # validated: on for everyone
    _dispatch.clear_caches()
    fake_kda_fwd(monkeypatch, opt_in=False)
    assert cula.backends("chunk_kda", **kda_train()).backend == CULA_SM90_FLA_BWD


def test_kda_gradients_path_is_on_since_validated():
    from cula.kda import _train

    assert _train.SWITCH == ("kda_fwd_train", None)  # tests/test_kda_train.py -m gpu passed at 16b0362


@pytest.mark.parametrize("off, chosen", [("kda_fwd_train", FLA_TRITON), ("kda_fwd", FLA_TRITON),
                                         ("all", FLA_TRITON), ("lightning_fwd", CULA_SM90_FLA_BWD),
                                         (" kda_decode , kda_fwd_train", FLA_TRITON)])
def test_kernels_off_turns_the_gradient_path_off(hopper, monkeypatch, off, chosen):
    from cula.kda import _train

    monkeypatch.setattr(_train, "SWITCH", ("kda_fwd_train", None))
    fake_kda_fwd(monkeypatch)  # CULA_KERNELS=kda_fwd_train as well: the opt-out wins
    monkeypatch.setenv(_dispatch.OPT_OUT_ENV, off)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)  # the user's choice, not these inputs: no warning
        d = cula.backends("chunk_kda", **kda_train())
    assert d.backend == chosen
    if chosen == FLA_TRITON:
        skip = d.skipped[0]
        assert skip.backend == CULA_SM90_FLA_BWD and skip.environmental and "CULA_KERNELS_OFF" in skip.reason


@pytest.mark.parametrize("off, chosen", [(None, CULA_SM90), ("kda_fwd", FLA_TRITON), ("all", FLA_TRITON),
                                         ("kda_fwd_train", CULA_SM90), ("kda_decode", CULA_SM90)])
def test_kernels_off_turns_a_kernel_off(hopper, monkeypatch, off, chosen):
    fake_kernel(monkeypatch, "kda_fwd")
    monkeypatch.setenv(_dispatch.OPT_IN_ENV, "kda_fwd")
    if off is None:
        monkeypatch.delenv(_dispatch.OPT_OUT_ENV, raising=False)
    else:
        monkeypatch.setenv(_dispatch.OPT_OUT_ENV, off)
    d = cula.backends("chunk_kda", **kda())
    assert d.backend == chosen
    if chosen == FLA_TRITON:
        assert d.skipped[0].environmental and "CULA_KERNELS_OFF" in d.skipped[0].reason


def test_a_kernel_turned_off_is_not_imported(hopper, monkeypatch):
    loaded = []
    real = _dispatch.load_kernel
    monkeypatch.setattr(_dispatch, "load_kernel", lambda name: loaded.append(name) or real(name))
    monkeypatch.setenv(_dispatch.OPT_OUT_ENV, "kda_fwd")
    assert cula.backends("chunk_kda", **kda()).backend == FLA_TRITON
    assert "kda_fwd" not in loaded


def test_kda_gradients_take_our_forward_with_flas_backward(hopper, monkeypatch):
    fake_kda_fwd(monkeypatch)
    d = cula.backends("chunk_kda", **kda_train())
    assert d.backend == CULA_SM90_FLA_BWD and not d.skipped
    # without gradients the candidate is not considered at all (no skip, no warning): the kernel runs
    d = cula.backends("chunk_kda", **kda_train(grad=False))
    assert d.backend == CULA_SM90 and not d.skipped
    with torch.no_grad():
        assert cula.backends("chunk_kda", **kda_train()).backend == CULA_SM90


@pytest.mark.parametrize("extra, factors_reason, words", [
    (dict(disable_recompute=True), None, "disable_recompute"),
    (dict(chunk_size=32), None, "chunk_size"),
    (dict(), "the input runs in pieces", "pieces"),
])
def test_kda_gradients_fall_back_to_fla_with_a_reason(hopper, monkeypatch, extra, factors_reason, words):
    fake_kda_fwd(monkeypatch, factors_reason=factors_reason)
    d = cula.backends("chunk_kda", **kda_train(**extra))
    assert d.backend == FLA_TRITON
    assert [s.backend for s in d.skipped] == [CULA_SM90_FLA_BWD, CULA_SM90]
    assert words in d.skipped[0].reason and not d.skipped[0].environmental


def test_kda_gradients_need_fla_for_the_backward(hopper, monkeypatch):
    fake_kda_fwd(monkeypatch)
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: False)
    d = cula.backends("chunk_kda", **kda_train())
    assert d.backend == TORCH_REF
    assert d.skipped[0].backend == CULA_SM90_FLA_BWD and d.skipped[0].environmental
    assert "backward" in d.skipped[0].reason


def test_kda_gradients_kernel_reason_is_named(hopper, monkeypatch):
    fake_kda_fwd(monkeypatch, reason="K=64 is not 128")
    d = cula.backends("chunk_kda", **kda_train())
    assert d.backend == FLA_TRITON and d.skipped[0].reason == "kernel: K=64 is not 128"


def test_decay_requiring_grad_skips_fla_simple_gla(hopper):
    x = lightning()
    x["decay"].requires_grad_()
    d = cula.backends("lightning_attn_fwd", **x)
    assert d.backend == TORCH_REF and "g_gamma" in d.skipped[1].reason


def test_recurrent_kda_with_gradients_runs_the_reference(hopper, monkeypatch):
    fake_kernel(monkeypatch, "kda_decode")
    x = kda()
    x["v"].requires_grad_()
    d = cula.backends("fused_recurrent_kda", **x)
    assert d.backend == TORCH_REF
    assert [s.backend for s in d.skipped] == [CULA_SM90, FLA_TRITON] and "no backward" in d.skipped[1].reason
    with pytest.warns(CulaFallbackWarning):
        o, _ = fused_recurrent_kda(**x)
    o.sum().backward()
    assert x["v"].grad is not None and x["v"].grad.abs().sum() > 0


def test_float64_skips_fla(hopper):
    x = {n: t.double() for n, t in kda().items()}
    d = cula.backends("chunk_kda", **x)
    assert d.backend == TORCH_REF and "float64" in d.skipped[1].reason


def test_fla_head_dim_limit(hopper):
    x = kda()
    x["q"], x["k"], x["g"] = torch.randn(B, T, H, 512), torch.randn(B, T, H, 512), -torch.rand(B, T, HV, 512)
    d = cula.backends("chunk_kda", **x)
    assert d.backend == TORCH_REF and "K <= 256" in d.skipped[1].reason


def test_fla_missing_falls_to_reference(hopper, monkeypatch):
    monkeypatch.setattr(_dispatch, "fla_installed", lambda: False)
    d = cula.backends("chunk_gla", torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 4),
                      torch.zeros(1, 4, 2, 8))
    assert d.backend == TORCH_REF and d.skipped[0].reason == "FLA (fla-core) is not installed"
    assert d.to_dict()["selected"] == TORCH_REF and "fla-triton skipped" in str(d)


# --- FLA runners: argument mapping checked against the reference


def test_fla_lightning_expands_heads_and_negates_decay(hopper, monkeypatch):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def fla_like(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
        assert q.shape[2] == v.shape[2] == HV and cu_seqlens is None  # GVA expanded for FLA
        g = g_gamma.reshape(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
        return naive_recurrent_simple_gla(q, k, v, g, scale, initial_state, output_final_state)

    calls = fake_fla(monkeypatch, "fla.ops.simple_gla", "chunk_simple_gla", fla_like)
    x = lightning()
    h0 = torch.randn(B, HV, K, V)
    o, ht = lightning_attn_fwd(**x, initial_state=h0, output_final_state=True, scale=0.3)
    assert calls
    from cula.ref.lightning import recurrent

    o_ref, ht_ref = recurrent(**x, initial_state=h0, output_final_state=True, scale=0.3)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)


def test_fla_kda_decode_gathers_and_scatters_the_pool(hopper, monkeypatch):
    from fla.ops.kda.naive import naive_recurrent_kda

    def fla_like(q, k, v, g, beta, scale, initial_state, output_final_state, **kw):
        return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)

    calls = fake_fla(monkeypatch, "fla.ops.kda", "fused_recurrent_kda", fla_like)
    x = dict(q=torch.randn(B, 2, HV, K), k=torch.randn(B, 2, HV, K), v=torch.randn(B, 2, HV, V),
             g=-torch.rand(B, 2, HV, K), beta=torch.rand(B, 2, HV))  # H == HV: FLA's naive KDA has no GVA
    pool = torch.randn(6, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([4, -1])
    o, ret = fused_recurrent_kda(**x, initial_state=pool, state_indices=idx, inplace=True)
    assert ret is pool and calls[0]["output_final_state"] is True
    o_row0, h_row0 = naive_recurrent_kda(*(x[n][:1] for n in ("q", "k", "v", "g", "beta")), None,
                                         before[4:5], True)
    torch.testing.assert_close(o[:1], o_row0)
    assert torch.count_nonzero(o[1]) == 0  # skipped row: zero output
    torch.testing.assert_close(pool[4], h_row0[0])
    torch.testing.assert_close(pool[[0, 1, 2, 3, 5]], before[[0, 1, 2, 3, 5]])  # other slots untouched


def test_fla_chunk_kda_gets_every_argument(hopper, monkeypatch):
    calls = fake_fla(monkeypatch, "fla.ops.kda", "chunk_kda", lambda **kw: ("o", None))
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV * K)
    chunk_kda(**kda(), use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=32, use_graph=False)
    (kw,) = calls
    assert kw["A_log"] is A_log and kw["dt_bias"] is dt_bias and kw["chunk_size"] == 32
    assert kw["use_gate_in_kernel"] is True and kw["scale"] is None


def test_lightning_decode_on_fake_hopper_uses_fla(hopper, monkeypatch):
    calls = fake_fla(monkeypatch, "fla.ops.simple_gla", "fused_recurrent_simple_gla",
                     lambda q, k, v, g_gamma, scale, initial_state, output_final_state:
                     (torch.zeros_like(v), torch.ones_like(initial_state)))
    pool = torch.zeros(3, HV, K, V)
    o, ret = lightning_attn_decode(**lightning(t=1), initial_state=pool, state_indices=torch.tensor([2, 0]),
                                   inplace=True)
    assert len(calls) == 1 and ret is pool
    assert pool[2].eq(1).all() and pool[0].eq(1).all() and pool[1].eq(0).all()


@pytest.mark.parametrize("name", sorted(_dispatch.KERNEL_ARGS))
def test_real_kernel_modules_take_the_dispatch_arguments(name):
    """The contract both ways: whatever kernel module exists accepts exactly what dispatch passes."""
    import importlib
    import importlib.util
    import inspect

    if importlib.util.find_spec(f"cula.kernels.sm90.{name}") is None:
        pytest.skip(f"no cula.kernels.sm90.{name} yet")
    try:
        module = importlib.import_module(f"cula.kernels.sm90.{name}")
    except ImportError as exc:
        pytest.skip(f"not importable here: {exc}")
    kwargs = {arg: None for arg in _dispatch.KERNEL_ARGS[name]}
    inspect.signature(getattr(module, name)).bind(**kwargs)
    inspect.signature(module.supports).bind(**kwargs)


def test_cp_context_takes_the_cp_candidate_and_plain_calls_never_see_it():
    """cula-cp is considered only when cp_context is given; a one-rank context equals the plain call."""
    import warnings

    import cula
    from cula.cp import build_cp_context
    from cula.lightning import lightning_attn_fwd

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 16, dtype=torch.float64) for _ in range(3))
    decay = torch.rand(2, dtype=torch.float64)
    h0 = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    cu = torch.tensor([0, 20, 37])
    ctx = build_cp_context(cu, None, rank=0, world_size=1)
    assert cula.backends("lightning_attn_fwd", q, k, v, decay, cp_context=ctx).backend == "cula-cp"
    plain = cula.backends("lightning_attn_fwd", q, k, v, decay)
    assert plain.backend == "torch-ref" and all(s.backend != "cula-cp" for s in plain.skipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning for the ordinary path
        o_ref, s_ref = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, s = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              cp_context=ctx)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)  # fp64 both ways
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)

"""The public ops' call plans (cula._op): a repeated call skips re-validation and re-dispatch, yet a
call that differs in anything validation or dispatch reads never reuses a stale plan, and the
value checks (tensor contents) run on every call."""

from __future__ import annotations

import warnings

import pytest
import torch

from cula import CulaFallbackWarning, _dispatch
from cula._dispatch import CULA_SM90, FLA_TRITON, TORCH_REF
from cula._warn import reset_fallback_warnings
from cula.kda import chunk_kda, fused_recurrent_kda
from cula.lightning import lightning_attn_decode, lightning_attn_fwd
# the hopper fixture, the fake modules and the autouse cache reset (_fresh) come from the dispatch tests
from test_dispatch import HV, K, V, B, _fresh, fake_fla, fake_kernel, hopper, kda, lightning  # noqa: F401


def decode_inputs(**over):
    x = kda(t=1)
    x.update(initial_state=torch.zeros(6, HV, K, V), ssm_state_indices=torch.tensor([3, 1]), inplace_final_state=True)
    x.update(over)
    return x


def test_repeated_calls_reuse_one_plan_and_pass_the_same_arguments(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "kda_decode")
    first = decode_inputs()
    fused_recurrent_kda(**first)
    assert len(fused_recurrent_kda.plans) == 1
    second = decode_inputs()  # new tensors, same metadata
    fused_recurrent_kda(**second)
    assert len(fused_recurrent_kda.plans) == 1 and len(mod.calls) == 2
    assert len(mod.supports_calls) == 1  # the decision was reused
    miss, hit = mod.calls
    assert list(miss) == list(hit) == list(_dispatch.KERNEL_ARGS["kda_decode"])
    for name in miss:
        if isinstance(miss[name], torch.Tensor):
            source = {"initial_state": "initial_state", "state_indices": "ssm_state_indices"}.get(name, name)
            assert miss[name] is first[source] and hit[name] is second[source]
        else:
            assert type(miss[name]) is type(hit[name]) and miss[name] == hit[name]


def test_positional_and_keyword_calls_are_planned_apart(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_decode")
    x = lightning(t=1)
    lightning_attn_decode(**x)
    lightning_attn_decode(x["q"], x["k"], x["v"], x["decay"])
    lightning_attn_decode(x["q"], x["k"], x["v"], x["decay"])
    assert len(lightning_attn_decode.plans) == 2
    assert mod.calls[0].keys() == mod.calls[2].keys() and mod.calls[2]["decay"] is x["decay"]


@pytest.mark.parametrize("change", ["shape", "dtype", "device", "requires_grad", "flag", "stride", "grad_mode"])
def test_a_changed_call_never_reuses_the_plan(hopper, monkeypatch, change):
    fake_kernel(monkeypatch, "lightning_fwd",
                reason=lambda kw: None if kw["q"].shape[-1] == K and kw["q"].dtype == torch.float32
                and kw["v"].is_contiguous() else "not mine")
    fake_fla(monkeypatch, "fla.ops.simple_gla", "chunk_simple_gla", lambda *a, **kw: ("fla", None))
    x = lightning()
    warnings.simplefilter("ignore", CulaFallbackWarning)
    assert lightning_attn_fwd(**x) == ("o", "ht")
    y = lightning()
    if change == "shape":
        y["q"], y["k"] = torch.randn(B, 5, 2, 16), torch.randn(B, 5, 2, 16)
        assert lightning_attn_fwd(**y)[0] == "fla"
    elif change == "dtype":
        y = {n: t.double() for n, t in y.items()}
        assert lightning_attn_fwd(**y)[0].dtype == torch.float64  # fp64: the kernel's dtype aside, not FLA
    elif change == "device":
        y["k"] = y["k"].to("meta")
        with pytest.raises(ValueError, match="^k: expected a tensor on cpu"):
            lightning_attn_fwd(**y)
    elif change == "requires_grad":
        y["q"].requires_grad_()
        assert lightning_attn_fwd(**y)[0] == "fla"  # gradients: not the kernel
        with torch.no_grad():
            assert lightning_attn_fwd(**y) == ("o", "ht")
    elif change == "flag":
        with pytest.raises(ValueError, match="^initial_state"):
            lightning_attn_fwd(**y, output_final_state=True, initial_state=torch.zeros(1, HV, K, V))
        assert lightning_attn_fwd(**y, output_final_state=True) == ("o", "ht")
    elif change == "stride":
        y["v"] = torch.randn(B, 5, V, HV).transpose(2, 3)  # same shape, not contiguous
        assert lightning_attn_fwd(**y)[0] == "fla"
    elif change == "grad_mode":
        y["q"].requires_grad_()
        with torch.no_grad():
            assert lightning_attn_fwd(**y) == ("o", "ht")
        assert lightning_attn_fwd(**y)[0] == "fla"
    assert lightning_attn_fwd(**lightning()) == ("o", "ht")  # the first plan still holds


def test_misaligned_state_asks_the_kernel_again(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "kda_decode",
                      reason=lambda kw: None if kw["initial_state"].data_ptr() % 16 == 0 else "misaligned")
    fake_fla(monkeypatch, "fla.ops.kda", "fused_recurrent_kda", lambda **kw: (torch.zeros_like(kw["v"]), None))
    x = kda(t=1)
    fused_recurrent_kda(**x, initial_state=torch.zeros(B, HV, K, V))
    storage = torch.zeros(B * HV * K * V + 1)
    odd = storage[1:].view(B, HV, K, V)  # same shape and strides, 4-byte aligned
    with pytest.warns(CulaFallbackWarning, match="misaligned"):
        fused_recurrent_kda(**x, initial_state=odd)
    assert len(mod.calls) == 1


def test_flag_types_are_part_of_the_key(hopper, monkeypatch):
    fake_kernel(monkeypatch, "kda_decode")
    x = kda(t=1)
    fused_recurrent_kda(**x, lower_bound=1)  # an int is a valid bound
    with pytest.raises(ValueError, match="^lower_bound: expected a float or None, got bool True"):
        fused_recurrent_kda(**x, lower_bound=True)
    mod = fake_kernel(monkeypatch, "lightning_decode")
    _dispatch.clear_caches()
    y = lightning(t=1)
    lightning_attn_decode(**y, scale=0.0)
    lightning_attn_decode(**y, scale=-0.0)
    assert [str(c["scale"]) for c in mod.calls] == ["0.0", "-0.0"]


def test_environment_changes_are_seen(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "kda_decode")
    mod.DISPATCH_OFF = "slower"
    monkeypatch.delenv(_dispatch.OPT_IN_ENV, raising=False)
    fake_fla(monkeypatch, "fla.ops.kda", "fused_recurrent_kda", lambda **kw: ("fla", None))
    x = kda(t=1)
    assert fused_recurrent_kda(**x)[0] == "fla"
    monkeypatch.setenv(_dispatch.OPT_IN_ENV, "kda_decode")
    assert fused_recurrent_kda(**x)[0] == "o"
    monkeypatch.setenv(_dispatch.OPT_OUT_ENV, "kda_decode")  # the opt-out wins, and the plan sees it
    assert fused_recurrent_kda(**x)[0] == "fla"
    monkeypatch.delenv(_dispatch.OPT_OUT_ENV)
    assert fused_recurrent_kda(**x)[0] == "o"
    monkeypatch.setattr(_dispatch, "device_arch", lambda device: (8, 0))  # a probe patched mid-way
    assert fused_recurrent_kda(**x)[0] == "fla"


def test_debug_checks_env_is_seen(monkeypatch):
    x = kda(t=1)
    pool = torch.zeros(6, HV, K, V)
    monkeypatch.delenv("CULA_DEBUG_CHECKS", raising=False)
    fused_recurrent_kda(**x, initial_state=pool, state_indices=torch.tensor([3, 1]))
    monkeypatch.setenv("CULA_DEBUG_CHECKS", "1")
    fused_recurrent_kda(**x, initial_state=pool, state_indices=torch.tensor([3, 1]))
    assert len(fused_recurrent_kda.plans) == 2


def test_value_checks_run_on_every_call(hopper, monkeypatch):
    fake_kernel(monkeypatch, "kda_decode")
    fake_kernel(monkeypatch, "lightning_decode")
    fake_kernel(monkeypatch, "lightning_fwd")
    fused_recurrent_kda(**decode_inputs())
    with pytest.raises(ValueError, match="^state_indices: expected slots < pool size 6, got 9"):
        fused_recurrent_kda(**decode_inputs(ssm_state_indices=torch.tensor([9, 1])))
    with pytest.raises(ValueError, match="^state_indices: expected distinct"):
        fused_recurrent_kda(**decode_inputs(ssm_state_indices=torch.tensor([1, 1])))
    # the very same tensor, changed in place (its version moves on)
    idx = torch.tensor([3, 1])
    fused_recurrent_kda(**decode_inputs(ssm_state_indices=idx))
    idx[0] = 1
    with pytest.raises(ValueError, match="^state_indices: expected distinct"):
        fused_recurrent_kda(**decode_inputs(ssm_state_indices=idx))

    x = lightning(t=1)
    lightning_attn_decode(**x)
    x["decay"][0] = -1.0
    with pytest.raises(ValueError, match="^decay: expected rates >= 0"):
        lightning_attn_decode(**x)
    y = lightning()
    y["decay"][1] = float("nan")
    with pytest.raises(ValueError, match="^decay"):
        lightning_attn_decode(**y)

    flat = {n: t.reshape(1, -1, *t.shape[2:]) if t.dim() == 4 else t for n, t in lightning().items()}
    lightning_attn_fwd(**flat, cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="^cu_seqlens: expected non-decreasing"):
        lightning_attn_fwd(**flat, cu_seqlens=torch.tensor([0, 7, 5]))
    with pytest.raises(ValueError, match="^cu_seqlens: expected the last value to equal"):
        lightning_attn_fwd(**flat, cu_seqlens=torch.tensor([0, 4, 9]))


def test_fallback_warnings_are_kept_on_the_planned_path(hopper, monkeypatch):
    fake_kernel(monkeypatch, "lightning_fwd", reason="head dim not supported")
    fake_fla(monkeypatch, "fla.ops.simple_gla", "chunk_simple_gla", lambda *a, **kw: ("fla", None))
    with pytest.warns(CulaFallbackWarning, match="head dim not supported"):
        lightning_attn_fwd(**lightning())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)
        lightning_attn_fwd(**lightning())  # once per (op, backend, reason)
    assert len(lightning_attn_fwd.plans) == 1
    reset_fallback_warnings()
    with pytest.warns(CulaFallbackWarning, match="head dim not supported") as rec:
        lightning_attn_fwd(**lightning())  # from the plan
    assert rec[0].filename == __file__


def test_warning_keywords_are_never_planned():
    x = kda(t=1)
    for _ in range(2):
        with pytest.warns(DeprecationWarning):
            fused_recurrent_kda(**x, transpose_state_layout=False)
    with pytest.warns(UserWarning, match="ignoring unknown keyword"):
        fused_recurrent_kda(**x, bogus=1)
    assert not fused_recurrent_kda.plans


def test_aliased_or_derived_tensors_are_not_planned_yet_run(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_decode")
    x = lightning(t=1)
    lightning_attn_decode(x["q"], x["q"], x["v"], x["decay"])  # q passed as k too
    assert not lightning_attn_decode.plans
    lightning_attn_decode(**x)
    lightning_attn_decode(x["q"], x["q"], x["v"], x["decay"])
    assert mod.calls[-1]["k"] is x["q"]
    decay = x["decay"].reshape(HV, 1, 1)
    lightning_attn_decode(**{**x, "decay": decay})
    lightning_attn_decode(**{**x, "decay": decay})
    assert mod.calls[-1]["decay"].shape == (HV,)
    assert len(lightning_attn_decode.plans) == 1  # only the plain call


def test_cpu_results_match_the_full_path():
    torch.manual_seed(0)
    x = kda(t=3)
    pool = torch.randn(6, HV, K, V)
    idx = torch.tensor([4, -1])
    fresh = [fused_recurrent_kda(**x, initial_state=pool.clone(), state_indices=idx, output_final_state=True)
             for _ in range(2)]
    assert len(fused_recurrent_kda.plans) == 1
    _dispatch.clear_caches()
    assert not fused_recurrent_kda.plans
    full = fused_recurrent_kda(**x, initial_state=pool.clone(), state_indices=idx, output_final_state=True)
    for o, ht in fresh:
        torch.testing.assert_close(o, full[0], rtol=0, atol=0)
        torch.testing.assert_close(ht, full[1], rtol=0, atol=0)
    o1, _ = chunk_kda(**kda())
    assert len(chunk_kda.plans) == 1
    assert cula_backend(x) == TORCH_REF


def cula_backend(x):
    import cula

    return cula.backends("fused_recurrent_kda", **x).backend


def test_cache_is_bounded(hopper, monkeypatch):
    from cula import _op

    fake_kernel(monkeypatch, "lightning_decode")
    monkeypatch.setattr(_op, "PLAN_CACHE_MAX", 3)
    x = lightning(t=1)
    for i in range(7):
        lightning_attn_decode(**x, scale=0.1 + i)
    assert 1 <= len(lightning_attn_decode.plans) <= 3


def test_fla_and_kernel_choices_stay_the_same_as_explain(hopper, monkeypatch):
    fake_kernel(monkeypatch, "kda_decode", reason=lambda kw: None if kw["q"].dtype == torch.float32 else "fp32 only")
    fake_fla(monkeypatch, "fla.ops.kda", "fused_recurrent_kda", lambda **kw: ("fla", None))
    warnings.simplefilter("ignore", CulaFallbackWarning)
    import cula

    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        x = {n: t.to(dtype) for n, t in kda(t=1).items()}
        got = fused_recurrent_kda(**x)[0]
        expected = cula.backends("fused_recurrent_kda", **x).backend
        assert (got == "o") == (expected == CULA_SM90) and (got == "fla") == (expected == FLA_TRITON)


def test_the_last_plan_is_forgotten_with_the_rest(hopper, monkeypatch):
    first = fake_kernel(monkeypatch, "lightning_decode")
    x = lightning(t=1)
    for _ in range(2):
        lightning_attn_decode(**x)
    assert lightning_attn_decode.plans.last is not None and len(first.calls) == 2
    _dispatch.clear_caches()  # e.g. a test swapping the kernel module, as here
    assert lightning_attn_decode.plans.last is None
    second = fake_kernel(monkeypatch, "lightning_decode")
    lightning_attn_decode(**x)
    assert len(first.calls) == 2 and len(second.calls) == 1


def test_requires_grad_is_not_in_the_key_without_grad_mode(hopper, monkeypatch):
    mod = fake_kernel(monkeypatch, "lightning_decode")
    with torch.no_grad():
        lightning_attn_decode(**lightning(t=1))
        lightning_attn_decode(**lightning(t=1, grad=True))  # nothing reads requires_grad here
    assert len(lightning_attn_decode.plans) == 1 and len(mod.calls) == 2
    fake_fla(monkeypatch, "fla.ops.simple_gla", "fused_recurrent_simple_gla", lambda *a, **kw: ("fla", None))
    with pytest.warns(CulaFallbackWarning, match="gradients"):
        lightning_attn_decode(**lightning(t=1, grad=True))  # with grad mode on it is
    assert len(mod.calls) == 2 and len(lightning_attn_decode.plans) == 2


def test_device_capability_is_asked_once_per_device(monkeypatch):
    asked = []
    monkeypatch.setattr(_dispatch, "_archs", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    for device in ("cuda:0", "cuda:0", "cuda:1", "cuda", "cuda"):
        assert _dispatch.device_arch(torch.device(device)) == (9, 0)
    assert [str(d) for d in asked] == ["cuda:0", "cuda:1", "cuda", "cuda"]  # "cuda" follows the current device
    assert _dispatch.device_arch(torch.device("cpu")) is None


def test_a_found_fla_is_remembered_a_missing_one_looked_for_again(monkeypatch):
    import importlib.util

    found = []
    monkeypatch.setattr(_dispatch, "_fla_found", [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found.append(name) or (object() if len(found) > 1
                                                                                        else None))
    assert not _dispatch.fla_installed()
    assert _dispatch.fla_installed() and _dispatch.fla_installed()
    assert found == ["fla", "fla"]

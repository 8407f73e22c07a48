"""Every public-op validation error: a ValueError whose message starts with the argument's name."""

from __future__ import annotations

import warnings

import pytest
import torch

from cula import _validate
from cula._op import CulaIgnoredArgumentWarning
from cula._warn import reset_fallback_warnings
from cula.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from cula.gla import chunk_gla, fused_recurrent_gla
from cula.kda import chunk_kda, fused_recurrent_kda
from cula.lightning import lightning_attn_decode, lightning_attn_fwd

B, T, H, HV, K, V = 2, 6, 2, 4, 8, 4


def _raises(arg: str, fn, *args, **kwargs):
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{arg}:"), str(info.value)
    return str(info.value)


def kda_inputs(b=B, t=T, h=H, hv=HV, k=K, v=V, dtype=torch.float32):
    return dict(
        q=torch.randn(b, t, h, k, dtype=dtype), k=torch.randn(b, t, h, k, dtype=dtype),
        v=torch.randn(b, t, hv, v, dtype=dtype), g=-torch.rand(b, t, hv, k, dtype=dtype),
        beta=torch.rand(b, t, hv, dtype=dtype),
    )


def lightning_inputs(b=B, t=T):
    return dict(q=torch.randn(b, t, H, K), k=torch.randn(b, t, H, K), v=torch.randn(b, t, HV, V), decay=torch.rand(HV))


def packed(x, lengths=(5, 7)):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return {n: t.reshape(1, -1, *t.shape[2:]) for n, t in x.items()} | {"cu_seqlens": cu}


# --- q / k / v


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_qkv_rank_dtype_shape_device(op):
    x = kda_inputs()
    _raises("q", op, **(x | {"q": x["q"][0]}))
    _raises("q", op, **(x | {"q": x["q"].to(torch.int32)}))
    _raises("q", op, **(x | {"q": "not a tensor"}))
    _raises("k", op, **(x | {"k": x["k"][:, :, :1]}))
    _raises("k", op, **(x | {"k": x["k"].double()}))
    _raises("v", op, **(x | {"v": x["v"][:, :-1]}))
    _raises("v", op, **(x | {"v": torch.randn(B, T, 3, V)}))  # HV=3 not a multiple of H=2
    _raises("k", op, **(x | {"k": torch.empty(B, T, H, K, device="meta")}))


def test_gla_has_no_grouped_value_heads():
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    msg = _raises("v", chunk_gla, q, k, torch.randn(B, T, HV, V), torch.zeros(B, T, H, K))
    assert "H=2" in msg
    _raises("v", fused_recurrent_gla, q, k, torch.randn(B, T, HV, V))


def test_scale_type():
    _raises("scale", chunk_kda, **kda_inputs(), scale="0.5")
    _raises("scale", lightning_attn_fwd, **lightning_inputs(), scale=torch.tensor(0.5))


# --- cu_seqlens


def test_cu_seqlens_errors():
    x = packed(kda_inputs())
    cu = x.pop("cu_seqlens")
    _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=cu[None])
    _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=cu.float())
    _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=torch.tensor([0]))
    assert "start at 0" in _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=torch.tensor([1, 4, 12]))
    assert "non-decreasing" in _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=torch.tensor([0, 8, 4, 12]))
    assert "T=12" in _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=torch.tensor([0, 4, 10]))
    _raises("cu_seqlens", chunk_kda, **x, cu_seqlens=cu.to("meta"))
    _raises("cu_seqlens", fused_recurrent_kda, **x, cu_seqlens=torch.tensor([0, 4, 11]))
    _raises("cu_seqlens", chunk_gated_delta_rule, **{n: x[n] for n in "qkv"}, g=x["g"][..., 0],
            beta=x["beta"], cu_seqlens=torch.tensor([0, 13]))
    _raises("cu_seqlens", lightning_attn_fwd, **packed(lightning_inputs()) | {"cu_seqlens": torch.tensor([0, 3])})


def test_cu_seqlens_needs_batch_one():
    x = kda_inputs()
    _raises("q", chunk_kda, **x, cu_seqlens=torch.tensor([0, 2, 6]))


def test_cu_seqlens_cpu_is_the_checked_copy():
    x = packed(kda_inputs())
    good = x["cu_seqlens"]
    chunk_kda(**x, cu_seqlens_cpu=good.clone())  # fine
    msg = _raises("cu_seqlens_cpu", chunk_kda, **x, cu_seqlens_cpu=torch.tensor([0, 3, 11]))
    assert "T=12" in msg
    _raises("cu_seqlens_cpu", chunk_kda, **x, cu_seqlens_cpu=torch.tensor([0, 12]))
    _raises("cu_seqlens_cpu", chunk_kda, **(x | {"cu_seqlens": None}), cu_seqlens_cpu=good)


def test_value_checks_run_once_per_tensor_version(monkeypatch):
    calls = []
    real = _validate._check_cu_values
    monkeypatch.setattr(_validate, "_check_cu_values", lambda *a: (calls.append(1), real(*a)))
    x = packed(kda_inputs())
    chunk_kda(**x)
    chunk_kda(**x)
    assert len(calls) == 1  # same tensor, same version: values not read again
    x["cu_seqlens"][1] = 20  # in-place change bumps the version: checked again, and now invalid
    _raises("cu_seqlens", chunk_kda, **x)
    assert len(calls) == 2


# --- states


def test_initial_state_errors():
    x = kda_inputs()
    _raises("initial_state", chunk_kda, **x, initial_state=torch.zeros(B, HV, K, K))
    _raises("initial_state", chunk_kda, **x, initial_state=torch.zeros(B + 1, HV, K, V))
    _raises("initial_state", chunk_kda, **x, initial_state=torch.zeros(B, HV, K, V, dtype=torch.bfloat16))
    _raises("initial_state", chunk_kda, **x, initial_state=[1.0])
    msg = _raises("initial_state", chunk_kda, **x, initial_state=torch.zeros(B, HV, K, V), state_v_first=True)
    assert "state_v_first" in msg
    _raises("initial_state", chunk_kda, **x, initial_state=torch.zeros(B, HV, K, V, device="meta"))
    xp = packed(x)
    _raises("initial_state", chunk_kda, **xp, initial_state=torch.zeros(B + 1, HV, K, V))  # N=2 sequences
    # the recurrent ops take fp16/bf16 states (pools) but not int ones
    fused_recurrent_kda(**x, initial_state=torch.zeros(B, HV, K, V, dtype=torch.bfloat16))
    _raises("initial_state", fused_recurrent_kda, **x, initial_state=torch.zeros(B, HV, K, V, dtype=torch.int32))


# --- gates, beta, per-head parameters, flags


def test_kda_gate_and_beta_shapes():
    x = kda_inputs()
    _raises("g", chunk_kda, **(x | {"g": x["g"][..., :2]}))
    _raises("g", chunk_kda, **(x | {"g": torch.zeros(B, T, H, K)}))  # H instead of HV heads
    _raises("beta", chunk_kda, **(x | {"beta": torch.rand(B, T, H)}))
    _raises("beta", chunk_kda, **(x | {"beta": torch.rand(B, T, HV, V)}))  # per-channel: recurrent only
    fused_recurrent_kda(**(x | {"beta": torch.rand(B, T, HV, V)}))
    _raises("beta", fused_recurrent_kda, **(x | {"beta": torch.rand(B, T, HV, V + 1)}))


def test_kda_in_kernel_gate_parameters():
    x = kda_inputs()
    _raises("A_log", chunk_kda, **x, use_gate_in_kernel=True)
    _raises("A_log", chunk_kda, **x, use_gate_in_kernel=True, A_log=torch.zeros(H))
    _raises("dt_bias", chunk_kda, **x, use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))
    _raises("A_log", fused_recurrent_kda, **x, use_gate_in_kernel=True)
    _raises("dt_bias", fused_recurrent_kda, **x, use_gate_in_kernel=True, A_log=torch.zeros(HV),
            dt_bias=torch.zeros(K))
    _raises("lower_bound", chunk_kda, **x, use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(HV))
    _raises("lower_bound", chunk_kda, **x, use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0)
    _raises("lower_bound", chunk_kda, **x, lower_bound="low")
    # A_log may be None when lower_bound is set
    chunk_kda(**x, use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
def test_allow_neg_eigval_needs_beta_sigmoid(op):
    _raises("allow_neg_eigval", op, **kda_inputs(), allow_neg_eigval=True)


def test_chunk_size():
    _raises("chunk_size", chunk_kda, **kda_inputs(), chunk_size=16)
    x = kda_inputs()
    _raises("chunk_size", chunk_gated_delta_rule, **{n: x[n] for n in "qkv"}, g=x["g"][..., 0], beta=x["beta"],
            chunk_size=128)


def test_gdn_shapes_and_gate():
    x = kda_inputs()
    q, k, v, beta = x["q"], x["k"], x["v"], x["beta"]
    g = -torch.rand(B, T, HV)
    _raises("g", chunk_gated_delta_rule, q, k, v, x["g"], beta)
    _raises("beta", chunk_gated_delta_rule, q, k, v, g, beta[..., :1])
    _raises("A_log", chunk_gated_delta_rule, q, k, v, g, beta, use_gate_in_kernel=True)
    _raises("A_log", chunk_gated_delta_rule, q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(H))
    _raises("dt_bias", chunk_gated_delta_rule, q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(HV),
            dt_bias=torch.zeros(HV * K))
    _raises("head_first", chunk_gated_delta_rule, q, k, v, g, beta, head_first=False)
    _raises("gk", fused_recurrent_gated_delta_rule, q, k, v, gk=torch.zeros(B, T, HV, V + 1))
    _raises("gv", fused_recurrent_gated_delta_rule, q, k, v, gv=torch.zeros(B, T, HV, K + 1))
    _raises("g", fused_recurrent_gated_delta_rule, q, k, v, use_gate_in_kernel=True, A_log=torch.zeros(HV))
    _raises("beta", fused_recurrent_gated_delta_rule, q, k, v, beta=torch.rand(B, T, H))


def test_gla_gate_shapes():
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    _raises("g", chunk_gla, q, k, v, torch.zeros(B, T, H, V))
    _raises("gk", fused_recurrent_gla, q, k, v, gk=torch.zeros(B, T, H, V))
    _raises("gv", fused_recurrent_gla, q, k, v, gv=torch.zeros(B, T, H, K))


def test_lightning_decay():
    x = lightning_inputs()
    _raises("decay", lightning_attn_fwd, **(x | {"decay": torch.rand(H)}))
    _raises("decay", lightning_attn_fwd, **(x | {"decay": torch.tensor([0.1, -0.2, 0.3, 0.4])}))
    _raises("decay", lightning_attn_fwd, **(x | {"decay": torch.tensor([0.1, float("nan"), 0.3, 0.4])}))
    _raises("decay", lightning_attn_fwd, **(x | {"decay": torch.arange(HV)}))
    _raises("decay", lightning_attn_fwd, **(x | {"decay": 0.5}))
    lightning_attn_fwd(**(x | {"decay": torch.rand(HV, 1, 1)}))  # slopes shaped [HV, 1, 1] are fine


# --- decode pool arguments


def test_state_indices_errors():
    x = lightning_inputs(t=1)
    pool = torch.zeros(5, HV, K, V)
    idx = torch.tensor([3, 0])
    lightning_attn_decode(**x, initial_state=pool, state_indices=idx)  # fine
    _raises("state_indices", lightning_attn_decode, **x, initial_state=pool, state_indices=idx[None])
    _raises("state_indices", lightning_attn_decode, **x, initial_state=pool, state_indices=idx.float())
    _raises("state_indices", lightning_attn_decode, **x, initial_state=pool, state_indices=torch.tensor([0]))
    _raises("state_indices", lightning_attn_decode, **x, initial_state=pool, state_indices=torch.tensor([5, 0]))
    _raises("state_indices", lightning_attn_decode, **x, initial_state=pool, state_indices=torch.tensor([2, 2]))
    lightning_attn_decode(**x, initial_state=pool, state_indices=torch.tensor([-1, -1]))  # skipped rows are fine
    _raises("initial_state", lightning_attn_decode, **x, state_indices=idx)
    _raises("initial_state", lightning_attn_decode, **x, inplace=True)
    _raises("initial_state", lightning_attn_decode, **x, initial_state=pool)  # no indices: [B, ...] expected
    _raises("initial_state", lightning_attn_decode, **x, initial_state=torch.zeros(5, HV, V, V), state_indices=idx)
    grad_pool = torch.zeros(B, HV, K, V, requires_grad=True)
    _raises("inplace", lightning_attn_decode, **x, initial_state=grad_pool, inplace=True)


def test_kda_pool_keyword_names():
    x = kda_inputs(t=1)
    pool, idx = torch.zeros(4, HV, K, V), torch.tensor([1, 2])
    _raises("ssm_state_indices", fused_recurrent_kda, **x, initial_state=pool, state_indices=idx, ssm_state_indices=idx)
    _raises("inplace_final_state", fused_recurrent_kda, **x, initial_state=pool, state_indices=idx, inplace=True,
            inplace_final_state=True)
    _raises("state_indices", fused_recurrent_kda, **x, initial_state=pool, ssm_state_indices=torch.tensor([1, 9]))


# --- keyword compatibility


def test_transpose_state_layout_alias():
    x = kda_inputs()
    with pytest.warns(DeprecationWarning):
        chunk_kda(**x, initial_state=torch.zeros(B, HV, V, K), transpose_state_layout=True)
    _raises("transpose_state_layout", chunk_kda, **x, state_v_first=True, transpose_state_layout=True)


def test_unknown_keyword_warns_once():
    reset_fallback_warnings()
    x = kda_inputs()
    with pytest.warns(CulaIgnoredArgumentWarning, match="not_an_fla_arg"):
        chunk_kda(**x, not_an_fla_arg=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaIgnoredArgumentWarning)
        chunk_kda(**x, not_an_fla_arg=1)

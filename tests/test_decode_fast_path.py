"""The decode ops' fast path: a repeated call of one static signature runs the kernel's prepared runner
(``module.runner``) from the public op's call plan, with nothing but the key, the output allocation
and the launch per call.

The real decode kernel modules run here on a fake sm_90 (``cula.bench.host_overhead.fake_hopper``):
their host code is the real one, only the compiled kernel is a null launcher whose last arguments are
read back, so every test sees exactly what would have been launched. The last test runs the kernel
source itself under the CPU emulator through the public op's planned path.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cula import CulaFallbackWarning, _dispatch
from cula._warn import reset_fallback_warnings
from cula.bench import host_overhead as ho
from cula.kda import fused_recurrent_kda
from cula.lightning import lightning_attn_decode

B, T, H, HV, K, V, P = 2, 1, 2, 4, 64, 32, 7
# launch argument positions (KdaDecode / LightningDecode __call__ order)
KDA_PTRS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0", "ht", "o", "idx")
KDA_SCALARS = ("B", "T", "H", "HV", "scale", "lower_bound")
LIGHT_PTRS = ("q", "k", "v", "decay", "h0", "ht", "o", "idx")
LIGHT_SCALARS = ("B", "T", "H", "HV", "scale")


@pytest.fixture
def gpu_like():
    """The real decode kernel modules on a fake sm_90, launching through null launchers."""
    reset_fallback_warnings()
    with ho.fake_hopper(real=("kda_decode", "lightning_decode")) as modules:
        yield modules
    reset_fallback_warnings()


def kda_inputs(b=B, t=T, h=H, hv=HV, k=K, v=V, dtype=torch.bfloat16, pool=True, v_first=False, **over):
    state = (hv, v, k) if v_first else (hv, k, v)
    x = dict(q=torch.randn(b, t, h, k, dtype=dtype), k=torch.randn(b, t, h, k, dtype=dtype),
             v=torch.randn(b, t, hv, v, dtype=dtype), g=torch.randn(b, t, hv, k, dtype=dtype),
             beta=torch.rand(b, t, hv, dtype=dtype), A_log=torch.zeros(hv), dt_bias=torch.zeros(hv * k),
             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, state_v_first=v_first)
    if pool:
        x.update(initial_state=torch.zeros(P, *state), ssm_state_indices=torch.randperm(P)[:b].to(torch.int32),
                 inplace_final_state=True)
    else:
        x.update(initial_state=torch.zeros(b, *state), output_final_state=True)
    x.update(over)
    return x


def light_inputs(b=B, t=T, hv=HV, **over):
    x = dict(q=torch.randn(b, t, H, K), k=torch.randn(b, t, H, K), v=torch.randn(b, t, hv, V), decay=torch.rand(hv),
             initial_state=torch.zeros(P, hv, K, V), state_indices=torch.randperm(P)[:b].to(torch.int32),
             inplace=True)
    x.update(over)
    return x


def launched(module, fn):
    """``(fn(), {argument name: value})`` of the one launch ``fn`` made (None when it launched nothing)."""
    for launcher in module._cache.values():
        launcher._last_values = ()
    result = fn()
    used = [launcher for launcher in module._cache.values() if launcher._last_values]
    assert len(used) <= 1
    if not used:
        return result, None
    names = KDA_PTRS + KDA_SCALARS if "kda" in module.__name__ else LIGHT_PTRS + LIGHT_SCALARS
    values = used[0]._last_values
    assert len(values) == len(names) + 1  # + the stream
    return result, dict(zip(names, values))


def ptr(x):
    return 0 if x is None else x.data_ptr()


def expect_kda_launch(args, x, o, ht):
    """The launch of fused_recurrent_kda(**x) that returned (o, ht) took exactly these tensors."""
    pool = "ssm_state_indices" in x
    q = x["q"]
    assert [args[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")] == \
        [ptr(x[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    assert args["h0"] == ptr(x["initial_state"]) and args["o"] == o.data_ptr() and args["ht"] == ht.data_ptr()
    assert args["idx"] == (x["ssm_state_indices"].data_ptr() if pool else 0)
    assert (args["B"], args["T"], args["H"], args["HV"]) == (q.shape[0], q.shape[1], q.shape[2], x["v"].shape[2])
    assert args["scale"] == pytest.approx(x.get("scale") or q.shape[-1] ** -0.5)
    assert o.shape == x["v"].shape and o.dtype == x["v"].dtype
    if pool:
        assert ht is x["initial_state"]


def test_a_repeated_call_launches_its_own_tensors_through_one_plan(gpu_like):
    kd = gpu_like["kda_decode"]
    first, second = kda_inputs(), kda_inputs()
    (o1, ht1), a1 = launched(kd, lambda: fused_recurrent_kda(**first))
    (o2, ht2), a2 = launched(kd, lambda: fused_recurrent_kda(**second))
    expect_kda_launch(a1, first, o1, ht1)
    expect_kda_launch(a2, second, o2, ht2)
    assert o1 is not o2 and o1.data_ptr() != o2.data_ptr()  # a fresh output per call
    assert len(fused_recurrent_kda.plans) == 1 and len(kd._runners) == 1
    (plan,) = fused_recurrent_kda.plans.values()
    assert plan.runner is next(iter(kd._runners.values()))
    assert next(iter(kd._cache.values())).is_fast and plan.runner._bound is not None  # the bound launch ran


CHANGES = {
    "batch": dict(b=3),
    "value_heads": dict(hv=8),
    "tokens": dict(t=2),
    "layout": dict(v_first=True),
    "no_pool": dict(pool=False),
    "dtype": dict(dtype=torch.float16),
    "scale": dict(scale=0.5),
    "flags": dict(use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=True),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_compatible_change_never_launches_a_stale_signature(gpu_like, change):
    kd = gpu_like["kda_decode"]
    runners = []
    for over in ({}, CHANGES[change], {}, CHANGES[change]):
        x = kda_inputs(**over)
        (o, ht), args = launched(kd, lambda: fused_recurrent_kda(**x))
        expect_kda_launch(args, x, o, ht)
        runners.append(fused_recurrent_kda.plans.last[1].runner)
    assert runners[0] is runners[2] and runners[1] is runners[3] and runners[0] is not runners[1]
    assert len(fused_recurrent_kda.plans) == 2


def test_lightning_changes_and_repeats(gpu_like):
    ld = gpu_like["lightning_decode"]
    for over in ({}, dict(b=3), dict(hv=8), dict(t=3), {}, dict(inplace=False, output_final_state=True)):
        x = light_inputs(**over)
        (o, ht), args = launched(ld, lambda: lightning_attn_decode(**x))
        assert [args[n] for n in ("q", "k", "v", "decay", "h0", "idx")] == \
            [ptr(x[n]) for n in ("q", "k", "v", "decay", "initial_state", "state_indices")]
        assert args["o"] == o.data_ptr() and args["ht"] == ht.data_ptr()
        assert (args["B"], args["T"], args["HV"]) == (x["q"].shape[0], x["q"].shape[1], x["v"].shape[2])
        assert (ht is x["initial_state"]) == x["inplace"]
        if not x["inplace"]:
            assert ht.shape == (x["q"].shape[0], x["v"].shape[2], K, V) and ht.dtype == torch.float32
    assert len(lightning_attn_decode.plans) == 5


def _meta(x):
    return x.to("meta")


BAD = {
    "beta_dtype": (lambda x: x.update(beta=x["beta"].to(torch.int32)), "^beta: expected dtype"),
    "g_shape": (lambda x: x.update(g=x["g"][..., :32]), "^g: expected shape"),
    "k_device": (lambda x: x.update(k=_meta(x["k"])), "^k: expected a tensor on cpu"),
    "v_dtype": (lambda x: x.update(v=x["v"].float()), "^v: expected the dtype of q"),
    "pool_heads": (lambda x: x.update(initial_state=torch.zeros(P, 2 * HV, K, V)), "^initial_state: expected shape"),
    "indices_dtype": (lambda x: x.update(ssm_state_indices=x["ssm_state_indices"].float()),
                      "^state_indices: expected an integer dtype"),
    "indices_values": (lambda x: x.update(ssm_state_indices=torch.tensor([1, 1], dtype=torch.int32)),
                       "^state_indices: expected distinct"),
    "A_log_size": (lambda x: x.update(A_log=torch.zeros(HV + 1)), "^A_log: expected 4 elements"),
    "A_log_missing": (lambda x: x.update(A_log=None), "^A_log: expected a \\[HV\\] tensor"),
    "neg_eigval": (lambda x: x.update(allow_neg_eigval=True), "^allow_neg_eigval"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_call_after_good_ones_raises_what_a_fresh_call_raises(gpu_like, bad):
    kd = gpu_like["kda_decode"]
    edit, match = BAD[bad]
    for _ in range(2):
        fused_recurrent_kda(**kda_inputs())
    x = kda_inputs()
    edit(x)
    with pytest.raises(ValueError, match=match) as planned:
        launched(kd, lambda: fused_recurrent_kda(**x))
    _dispatch.clear_caches()
    with pytest.raises(ValueError) as fresh:
        fused_recurrent_kda(**x)
    assert str(planned.value) == str(fresh.value)
    for launcher in kd._cache.values():
        assert not launcher._last_values  # nothing was launched for it


def test_gradients_fall_back_with_the_warning_and_no_grad_takes_the_kernel_again(gpu_like):
    kd = gpu_like["kda_decode"]
    launched(kd, lambda: fused_recurrent_kda(**kda_inputs()))
    x = kda_inputs()
    x["q"] = x["q"].float().requires_grad_()
    x.update({n: x[n].float() for n in ("k", "v", "g", "beta")})
    with pytest.warns(CulaFallbackWarning, match="gradients"):
        (o, _), args = launched(kd, lambda: fused_recurrent_kda(**x))
    assert args is None and o.requires_grad  # the differentiable torch reference ran
    with torch.no_grad():
        (o, ht), args = launched(kd, lambda: fused_recurrent_kda(**x))
    expect_kda_launch(args, x, o, ht)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CulaFallbackWarning)  # once per cause
        (o, _), args = launched(kd, lambda: fused_recurrent_kda(**x))
    assert args is None and o.requires_grad


def test_non_contiguous_inputs_are_copied_on_the_planned_path_too(gpu_like):
    kd = gpu_like["kda_decode"]
    for layout in ("a", "b", "contiguous"):
        x = kda_inputs()
        if layout == "a":
            x["q"] = torch.randn(B, T, K, H, dtype=torch.bfloat16).transpose(2, 3)
        elif layout == "b":
            x["q"] = torch.randn(K, B, T, H, dtype=torch.bfloat16).permute(1, 2, 3, 0)
        (o, ht), args = launched(kd, lambda: fused_recurrent_kda(**x))
        assert (args["q"] == x["q"].data_ptr()) == (layout == "contiguous")
        assert args["k"] == x["k"].data_ptr()
    # one plan for both non-contiguous layouts (contiguity is what the kernel path reads), one contiguous
    assert len(fused_recurrent_kda.plans) == 2


def test_a_misaligned_pool_after_aligned_ones_falls_back_to_fla(gpu_like, monkeypatch):
    from test_dispatch import fake_fla

    kd = gpu_like["kda_decode"]
    calls = fake_fla(monkeypatch, "fla.ops.kda", "fused_recurrent_kda",
                     lambda **kw: (torch.zeros_like(kw["v"]), kw["initial_state"].clone()))
    x = kda_inputs(pool=False)
    launched(kd, lambda: fused_recurrent_kda(**x))
    storage = torch.zeros(x["initial_state"].numel() + 1)
    x["initial_state"] = storage[1:].view(x["initial_state"].shape)  # same shape and strides, 4-byte aligned
    with pytest.warns(CulaFallbackWarning, match="aligned"):
        _, args = launched(kd, lambda: fused_recurrent_kda(**x))
    assert args is None and len(calls) == 1


def test_runner_signature_keys_cover_the_dense_copies(gpu_like):
    """The kernel module's own runner cache (direct calls) keeps apart inputs that need a copy."""
    kd = gpu_like["kda_decode"]
    kw = _dispatch.kernel_kwargs("kda_decode", fused_recurrent_kda.prepare_inputs(**kda_inputs()))
    dense_runner = kd.runner(**kw)
    kw["g"] = torch.randn(B, T, K, HV, dtype=torch.bfloat16).transpose(2, 3)
    copy_runner = kd.runner(**kw)
    assert dense_runner is not copy_runner and copy_runner is kd.runner(**kw)
    (o, ht), args = launched(kd, lambda: kd.kda_decode(**kw))
    assert args["g"] != kw["g"].data_ptr() and args["q"] == kw["q"].data_ptr()


# ----------------------------------------------------------------------------------- emulated kernel


def test_planned_calls_compute_the_reference_under_the_emulator(monkeypatch):
    """Public op -> call plan -> runner -> the kernel's own source (CPU emulator), against the fp64
    reference: two calls of one signature (the second from the plan) and one of another."""
    import _dsl_emulator as emu
    from test_kernel_decode_emulated import HELPERS

    from cula.kernels.common import decode_host
    from cula.kernels.sm90 import decode_bench as db

    mem = emu.Memory()
    real_empty_like, real_new_state = decode_host._empty_like, decode_host.new_state

    def registered(make):
        def wrapper(*args, **kwargs):
            t = make(*args, **kwargs)
            mem.register(t)
            return t
        return wrapper

    monkeypatch.setattr(decode_host, "_empty_like", registered(real_empty_like))
    monkeypatch.setattr(decode_host, "new_state", registered(real_new_state))
    with ho.fake_hopper(real=("lightning_decode",)) as modules:
        ld = modules["lightning_decode"]

        def launcher(key):
            config, dtypes = key
            kernel = emu.emulated_instance(ld.LightningDecode(*config), HELPERS)
            specs = ld._specs(dtypes)

            def launch(*values):
                args, backs = mem.pointers(specs, values)
                kernel(*args)
                emu.Memory.write_back(backs)
            return launch

        monkeypatch.setattr(ld, "_launcher", launcher)
        monkeypatch.setattr(ld, "pick_warps", lambda B, HV, V: 1)
        for i, batch in enumerate((1, 1, 2)):
            case = db.DecodeCase("lightning", batch, 2, 1, 1, K=64, V=32, pool="pool", seed=5 + i)
            inputs = db.make_inputs(case, device="cpu")
            inputs["output_final_state"] = True
            mem.register(*[t for t in inputs.values() if isinstance(t, torch.Tensor)])
            o_ref, s_ref = db.reference(case, {**inputs, "initial_state": inputs["initial_state"].clone()})
            o, ht = lightning_attn_decode(**inputs)
            assert db.rel_err(o, o_ref) < 6e-3 and db.rel_err(ht, s_ref) < 1e-6
            assert len(lightning_attn_decode.plans) == (1 if batch == 1 else 2)

"""cula.kernels.sm90.kda_decode: CPU compile checks, validation and dispatch; GPU checks vs the references.

CPU: the kernel lowers to sm_90a PTX whose state traffic is 128-bit (``ld/st.global.v4.f32``), with no
spills or local memory and registers under the 128-thread launch bound; bad inputs raise ValueError;
``supports()`` names what it cannot take. GPU (``-m gpu``): against cula's fp64 torch reference over the
issue's grid (B, H, GVA, both layouts, T, pool gaps / skips, in place and out of place), against FLA
0.6.0's ``fused_recurrent_kda``, every output element written, and CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cula.kernels.sm90 import kda_decode as kd

# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("target", ["default", "v_first"])
def test_ptx_moves_the_state_in_128_bit_vectors_without_spills(target):
    from cula.kernels.common.ptx_check import ptx_report

    rep = ptx_report("cula.kernels.sm90.kda_decode", target)
    rows = 128 // 16  # K = 128: each thread holds 8 vectors of 4 fp32 of the state
    assert rep.count("ld.global.v4.f32") >= rows
    assert rep.count("st.global.v4.f32") >= rows
    assert not rep.has("st.global.f32") and not rep.has("ld.local") and not rep.has("st.local")
    assert rep.count("shfl.sync.bfly") >= 8 * 4  # k^T S and q^T S reduced by shuffles, not smem
    assert rep.count("bar.sync") == 1  # one barrier per call (after the prologue), none per token
    assert len(rep.kernels) == 1 and rep.spill_bytes == 0
    assert 0 < rep.max_registers <= 128  # 4+ CTAs of 128 threads per SM keep enough bytes in flight
    loads = [line for line in rep.ptx.splitlines() if "ld.global" in line]
    assert all("v4.f32" in line for line in loads[1:1 + rows])  # the pool index, then the state first


def _cpu_inputs(B=2, T=1, H=2, HV=4, K=128, V=128, **over):
    q = torch.randn(B, T, H, K)
    inputs = dict(q=q, k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V), g=torch.randn(B, T, HV, K),
                  beta=torch.rand(B, T, HV), initial_state=torch.zeros(B, HV, K, V))
    inputs.update(over)
    return inputs


@pytest.mark.parametrize("name,value,match", [
    ("k", torch.randn(2, 1, 2, 64), "k: expected shape"),
    ("g", torch.randn(2, 1, 4, 64), "g: expected shape"),
    ("beta", torch.randn(2, 1, 2), "beta: expected shape"),
    ("v", torch.randn(2, 1, 3, 128), "multiple of H"),
    ("initial_state", torch.zeros(3, 4, 128, 128), "initial_state: expected 2 states"),
    ("initial_state", torch.zeros(2, 4, 64, 128), "initial_state: expected shape"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(name, value, match):
    with pytest.raises(ValueError, match=match):
        kd.kda_decode(**_cpu_inputs(**{name: value}))


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match="state_indices: expected a 1-D"):
        kd.kda_decode(**_cpu_inputs(state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)))
    with pytest.raises(ValueError, match="state_indices: expected dtype"):
        kd.kda_decode(**_cpu_inputs(state_indices=torch.tensor([0.0, 1.0])))
    with pytest.raises(ValueError, match="initial_state: expected a state"):
        kd.kda_decode(**_cpu_inputs(initial_state=None, inplace=True))
    with pytest.raises(ValueError, match="A_log"):
        kd.kda_decode(**_cpu_inputs(use_gate_in_kernel=True))
    with pytest.raises(ValueError, match="dt_bias: expected 512"):
        kd.kda_decode(**_cpu_inputs(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kd.kda_decode(**_cpu_inputs(allow_neg_eigval=True))


def test_valid_inputs_the_kernel_cannot_take_raise_with_the_reason():
    with pytest.raises(ValueError, match="CUDA tensors"):
        kd.kda_decode(**_cpu_inputs())
    with pytest.raises(ValueError, match="1..8 tokens"):
        kd.kda_decode(**_cpu_inputs(T=9))


def test_supports_says_not_validated_until_the_gpu_tests_passed(monkeypatch):
    monkeypatch.setattr(kd, "GPU_VALIDATED", False)
    assert kd.supports(**_cpu_inputs()) == "not validated on GPU yet"


@pytest.mark.parametrize("over,match", [
    (dict(K=96), "K in"),
    (dict(V=48), "multiple of 32"),
    (dict(T=9), "tokens"),
    (dict(), "CUDA"),
])
def test_supports_names_what_the_kernel_cannot_take(monkeypatch, over, match):
    monkeypatch.setattr(kd, "GPU_VALIDATED", True)
    inputs = _cpu_inputs(**{k: v for k, v in over.items() if k in ("T", "K", "V")})
    if "K" in over or "V" in over:
        inputs["initial_state"] = None
    reason = kd.supports(**inputs)
    assert reason is not None and match in reason


def test_supports_refuses_states_it_would_have_to_copy(monkeypatch):
    monkeypatch.setattr(kd, "GPU_VALIDATED", True)
    assert "fp32" in kd.state_reason(torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16))
    assert "contiguous" in kd.state_reason(torch.zeros(2, 4, 8, 8).transpose(2, 3))
    assert "aligned" in kd.state_reason(torch.zeros(2 * 4 * 8 * 8 + 1)[1:].view(2, 4, 8, 8))
    assert "head-wise" in kd.supports(**_cpu_inputs(beta=torch.rand(2, 1, 4, 128)))


def test_module_meets_the_dispatch_contract():
    from cula import _dispatch

    _dispatch.clear_caches()
    module, reason = _dispatch.load_kernel("kda_decode")
    assert reason is None and module is kd
    kwargs = {name: None for name in _dispatch.KERNEL_ARGS["kda_decode"]}
    kwargs.update(_cpu_inputs(), output_final_state=False, inplace=False)
    assert isinstance(kd.supports(**kwargs), str)  # a reason on the CPU, never an exception


# ------------------------------------------------------------------------------------------------ GPU

POOLS = ("plain", "pool", "inplace", "none")
GRID = list(itertools.product((1, 3, 64), (1, 8, 32), (1, 4), (False, True), (1, 2, 8)))


def _check(case, o_tol=6e-3, s_tol=2e-4, drop=()):
    from cula.kernels.sm90.decode_bench import make_inputs, reference, rel_err

    inputs = make_inputs(case)
    for name in drop:
        inputs[name] = None
    o_ref, s_ref = reference(case, {**inputs, "initial_state": None if inputs["initial_state"] is None
                                    else inputs["initial_state"].clone()})
    pool_before = inputs["initial_state"].clone() if inputs["initial_state"] is not None else None
    out = torch.full_like(inputs["v"], float("nan"))  # every element must be written
    o, ht = kd.kda_decode(**inputs, out=out)
    torch.cuda.synchronize()
    assert o is out
    e_o, e_s = rel_err(o, o_ref), rel_err(ht, s_ref)
    assert e_o < o_tol, f"{case.label}: o rel err {e_o:.2e}"
    assert e_s < s_tol, f"{case.label}: state rel err {e_s:.2e}"
    if case.pool == "inplace":
        assert ht is inputs["initial_state"]
        idx = inputs["state_indices"]
        untouched = torch.ones(ht.shape[0], dtype=torch.bool, device=ht.device)
        untouched[idx[idx >= 0].long()] = False
        assert torch.equal(ht[untouched], pool_before[untouched])  # skipped / unused slots bit-equal
    elif case.pool == "pool":
        assert torch.equal(inputs["initial_state"], pool_before)  # out of place: the pool is read only


@pytest.mark.parametrize("B,H,G,v_first,T", GRID,
                         ids=[f"B{b}-H{h}-G{g}-{'vf' if vf else 'kf'}-T{t}" for b, h, g, vf, t in GRID])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_reference_over_the_grid(B, H, G, v_first, T):
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase

    i = GRID.index((B, H, G, v_first, T))
    case = DecodeCase("kda", B, T, H, H * G, state_v_first=v_first, pool=POOLS[i % len(POOLS)],
                      flags=KDA_SERVING_FLAGS, seed=i)
    _check(case)


# (flags, V-first): the gate / norm / beta prologue is shared by both layouts, so each set runs on one
FLAG_SETS = {
    "softplus_gate": (dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True), False),
    "neg_eigval_lower_bound_no_A": (dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                         lower_bound=-5.0), True),
    "plain": (dict(), False),
}


@pytest.mark.parametrize("name", list(FLAG_SETS))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flag_sets(name):
    from cula.kernels.sm90.decode_bench import DecodeCase, make_inputs

    flags, v_first = FLAG_SETS[name]
    case = DecodeCase("kda", 3, 2, 4, 8, state_v_first=v_first, pool="plain", flags=flags, seed=7)
    if name.endswith("no_A"):
        inputs = make_inputs(case)
        assert "A_log" in inputs  # dropped below: lower_bound * sigmoid(g + dt_bias) needs no A_log
    _check(case, drop=("A_log",) if name.endswith("no_A") else ())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_inputs_are_exact_to_fp32_rounding():
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase

    case = DecodeCase("kda", 3, 8, 4, 8, dtype=torch.float32, pool="inplace", flags=KDA_SERVING_FLAGS, seed=3)
    _check(case, o_tol=2e-5, s_tol=2e-5)


@pytest.mark.parametrize("K", [64, 256])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_other_head_dims(K):
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase

    _check(DecodeCase("kda", 3, 2, 2, 4, K=K, V=K, state_v_first=K == 64, pool="pool",
                      flags=KDA_SERVING_FLAGS, seed=5))


@pytest.mark.parametrize("v_first,T,G", [(False, 1, 1), (True, 8, 4)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_fla(v_first, T, G):
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase, fla_call, make_inputs, rel_err

    case = DecodeCase("kda", 8, T, 4, 4 * G, state_v_first=v_first, flags=KDA_SERVING_FLAGS, seed=11)
    inputs = make_inputs(case)
    o_fla, s_fla = fla_call(case, inputs)()
    o, ht = kd.kda_decode(**inputs)
    assert rel_err(o, o_fla) < 6e-3 and rel_err(ht, s_fla) < 2e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replay_equals_eager():
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase, make_inputs

    case = DecodeCase("kda", 5, 2, 4, 8, pool="inplace", flags=KDA_SERVING_FLAGS, seed=13)
    inputs = make_inputs(case)
    eager_pool = inputs["initial_state"].clone()
    graph_pool = inputs["initial_state"].clone()
    o_eager = torch.empty_like(inputs["v"])
    o_graph = torch.empty_like(inputs["v"])
    kd.kda_decode(**{**inputs, "initial_state": eager_pool.clone()}, out=o_eager)  # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kd.kda_decode(**{**inputs, "initial_state": graph_pool}, out=o_graph)
    for _ in range(3):  # three decode steps on the pool, in place: graph replays vs eager calls
        graph.replay()
        kd.kda_decode(**{**inputs, "initial_state": eager_pool}, out=o_eager)
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(graph_pool, eager_pool)
    assert not torch.equal(graph_pool, inputs["initial_state"])  # the steps did change the states


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fast_launch_path_is_on_and_equal_to_the_public_path():
    from cula.kernels.sm90.decode_bench import KDA_SERVING_FLAGS, DecodeCase, make_inputs

    inputs = make_inputs(DecodeCase("kda", 2, 1, 4, 4, flags=KDA_SERVING_FLAGS, seed=17))
    kd.kda_decode(**inputs)  # compile + the first (checked) call
    for lau in kd._cache.values():
        lau._last_values = ()
    o1, s1 = kd.kda_decode(**inputs)  # the fast path
    launcher = next(lau for lau in kd._cache.values() if lau._last_values)
    assert launcher.is_fast, launcher.fast_reason
    o2 = torch.empty_like(o1)
    s2 = torch.empty_like(s1)
    values = list(launcher._last_values)
    values[8], values[9] = s2.data_ptr(), o2.data_ptr()  # final_state and o of this call
    launcher.call_public(*values)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_bench_copy_call_moves_the_kernels_state_bytes():
    """decode_bench's same-size copy reads and writes exactly the fp32 state the kernel moves per call."""
    from cula.kernels.sm90 import decode_bench as db

    case = db.DecodeCase("kda", 3, 1, 2, 4, K=64, V=64, flags=db.KDA_SERVING_FLAGS, seed=1)
    call = db.copy_call(case, db.make_inputs(case, device="cpu"))
    out = call()
    assert out.dtype == torch.float32 and out.numel() * 4 * 2 == db.state_bytes(case)
    src = call.__closure__  # the lambda's captured (dst, src): equal after the call
    a, b = (c.cell_contents for c in src)
    assert torch.equal(a, b)

"""cula.kernels.sm90.lightning_decode: CPU compile checks, validation and dispatch; GPU checks.

CPU: sm_90a PTX with 128-bit state traffic, no spills / local memory, registers under the launch bound;
bad inputs raise ValueError; ``supports()`` names what it cannot take. GPU (``-m gpu``): against cula's
fp64 torch reference over B, H, GVA, T and the pool modes, against FLA 0.6.0's
``fused_recurrent_simple_gla``, every output element written, CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cula.kernels.sm90 import lightning_decode as ld


def test_ptx_moves_the_state_in_128_bit_vectors_without_spills():
    from cula.kernels.common.ptx_check import ptx_report

    rep = ptx_report("cula.kernels.sm90.lightning_decode", "default")
    rows = 128 // 16
    assert rep.count("ld.global.v4.f32") >= rows and rep.count("st.global.v4.f32") >= rows
    assert not rep.has("st.global.f32") and not rep.has("ld.local") and not rep.has("st.local")
    assert rep.count("shfl.sync.bfly") >= 4 * 4 and rep.count("bar.sync") == 1
    assert len(rep.kernels) == 1 and rep.spill_bytes == 0
    assert 0 < rep.max_registers <= 128


def _cpu_inputs(B=2, T=1, H=2, HV=4, K=128, V=128, **over):
    inputs = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                  decay=torch.rand(HV), initial_state=torch.zeros(B, HV, K, V))
    inputs.update(over)
    return inputs


@pytest.mark.parametrize("name,value,match", [
    ("k", torch.randn(2, 1, 2, 64), "k: expected shape"),
    ("v", torch.randn(2, 2, 4, 128), "v: expected shape"),
    ("decay", torch.rand(2), "decay: expected 4 elements"),
    ("initial_state", torch.zeros(2, 4, 128, 64), "initial_state: expected shape"),
    ("state_indices", torch.tensor([0, 1, 2]), "state_indices: expected a 1-D"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(name, value, match):
    with pytest.raises(ValueError, match=match):
        ld.lightning_decode(**_cpu_inputs(**{name: value}))


def test_valid_inputs_the_kernel_cannot_take_raise_with_the_reason():
    with pytest.raises(ValueError, match="CUDA tensors"):
        ld.lightning_decode(**_cpu_inputs())
    with pytest.raises(ValueError, match="K in"):
        ld.lightning_decode(**_cpu_inputs(K=80, initial_state=None))


def test_supports(monkeypatch):
    monkeypatch.setattr(ld, "GPU_VALIDATED", False)
    assert ld.supports(**_cpu_inputs()) == "not validated on GPU yet"
    monkeypatch.setattr(ld, "GPU_VALIDATED", True)
    assert "tokens" in ld.supports(**_cpu_inputs(T=12))
    assert "float64" in ld.supports(**_cpu_inputs(q=torch.randn(2, 1, 2, 128, dtype=torch.float64)))
    assert "CUDA" in ld.supports(**_cpu_inputs())


def test_module_meets_the_dispatch_contract():
    from cula import _dispatch

    _dispatch.clear_caches()
    module, reason = _dispatch.load_kernel("lightning_decode")
    assert reason is None and module is ld
    kwargs = {name: None for name in _dispatch.KERNEL_ARGS["lightning_decode"]}
    kwargs.update(_cpu_inputs(), output_final_state=False, inplace=False)
    assert isinstance(ld.supports(**kwargs), str)


# ------------------------------------------------------------------------------------------------ GPU

POOLS = ("plain", "pool", "inplace", "none")
GRID = list(itertools.product((1, 3, 64), (1, 8, 32), (1, 4), (1, 2, 8)))


def _check(case, o_tol=6e-3, s_tol=2e-5):
    from cula.kernels.sm90.decode_bench import make_inputs, reference, rel_err

    inputs = make_inputs(case)
    h0 = inputs["initial_state"]
    o_ref, s_ref = reference(case, {**inputs, "initial_state": None if h0 is None else h0.clone()})
    before = h0.clone() if h0 is not None else None
    out = torch.full_like(inputs["v"], float("nan"))
    o, ht = ld.lightning_decode(**inputs, out=out)
    torch.cuda.synchronize()
    e_o, e_s = rel_err(o, o_ref), rel_err(ht, s_ref)
    assert e_o < o_tol, f"{case.label}: o rel err {e_o:.2e}"
    assert e_s < s_tol, f"{case.label}: state rel err {e_s:.2e}"
    if case.pool == "inplace":
        assert ht is h0
        idx = inputs["state_indices"]
        untouched = torch.ones(ht.shape[0], dtype=torch.bool, device=ht.device)
        untouched[idx[idx >= 0].long()] = False
        assert torch.equal(ht[untouched], before[untouched])
    elif case.pool == "pool":
        assert torch.equal(h0, before)


@pytest.mark.parametrize("B,H,G,T", GRID, ids=[f"B{b}-H{h}-G{g}-T{t}" for b, h, g, t in GRID])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_reference_over_the_grid(B, H, G, T):
    from cula.kernels.sm90.decode_bench import DecodeCase

    i = GRID.index((B, H, G, T))
    _check(DecodeCase("lightning", B, T, H, H * G, pool=POOLS[i % len(POOLS)], seed=i))


@pytest.mark.parametrize("dtype,K", [(torch.float32, 128), (torch.bfloat16, 64), (torch.bfloat16, 256)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dtypes_and_head_dims(dtype, K):
    from cula.kernels.sm90.decode_bench import DecodeCase

    tol = 2e-5 if dtype == torch.float32 else 6e-3
    _check(DecodeCase("lightning", 3, 8, 2, 4, K=K, V=K, dtype=dtype, pool="inplace", seed=K), o_tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_fla():
    from cula.kernels.sm90.decode_bench import DecodeCase, fla_call, make_inputs, rel_err

    case = DecodeCase("lightning", 8, 1, 8, 8, seed=21)
    inputs = make_inputs(case)
    o_fla, s_fla = fla_call(case, inputs)()
    o, ht = ld.lightning_decode(**inputs)
    assert rel_err(o, o_fla) < 6e-3 and rel_err(ht, s_fla) < 2e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replay_equals_eager():
    from cula.kernels.sm90.decode_bench import DecodeCase, make_inputs

    inputs = make_inputs(DecodeCase("lightning", 5, 2, 4, 8, pool="inplace", seed=23))
    eager_pool = inputs["initial_state"].clone()
    graph_pool = inputs["initial_state"].clone()
    o_eager = torch.empty_like(inputs["v"])
    o_graph = torch.empty_like(inputs["v"])
    ld.lightning_decode(**{**inputs, "initial_state": eager_pool.clone()}, out=o_eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ld.lightning_decode(**{**inputs, "initial_state": graph_pool}, out=o_graph)
    for _ in range(3):
        graph.replay()
        ld.lightning_decode(**{**inputs, "initial_state": eager_pool}, out=o_eager)
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(graph_pool, eager_pool)
    assert not torch.equal(graph_pool, inputs["initial_state"])

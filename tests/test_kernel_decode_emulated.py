"""The decode kernels' own source, run on the CPU under tests/_dsl_emulator.py, against the references.

The host functions run unchanged (validation, buffers, compile-cache keys, launch arguments); only the
compiled launch is swapped for the emulator, which executes the kernel source of that configuration
with one Python thread per CUDA thread and checks bounds, alignment assumptions, reads of unwritten
memory and barrier / shuffle participation. Small shapes (one CTA per head at V = 32) keep it fast;
the GPU tests cover the full grid.
"""

from __future__ import annotations

import pytest
import torch

import _dsl_emulator as emu
from cula.kernels.common import decode_host, decode_tile
from cula.kernels.sm90 import decode_bench as db
from cula.kernels.sm90 import kda_decode as kd
from cula.kernels.sm90 import lightning_decode as ld

HELPERS = {name: getattr(decode_tile, name) for name in ("vec", "load1", "butterfly_sum", "warp_sum")}


def run_emulated(monkeypatch, module, inputs):
    """Call the module's host function with its launches running on the emulator."""
    mem = emu.Memory()
    mem.register(*[x for x in inputs.values() if isinstance(x, torch.Tensor)])
    out = torch.full_like(inputs["v"], float("nan"))  # every output element must be written
    mem.register(out)
    make_final = decode_host.new_state
    kernel_cls = kd.KdaDecode if module is kd else ld.LightningDecode

    def new_final_state(*args, **kwargs):
        t = make_final(*args, **kwargs)
        mem.register(t)
        return t

    def launcher(key):
        config, dtypes = key
        kernel = emu.emulated_instance(kernel_cls(*config), HELPERS)
        specs = module._specs(dtypes)

        def launch(*values):
            args, backs = mem.pointers(specs, values)
            kernel(*args)
            emu.Memory.write_back(backs)
        return launch

    monkeypatch.setattr(decode_host, "new_state", new_final_state)
    monkeypatch.setattr(module, "_launcher", launcher)
    monkeypatch.setattr(module, "_runners", {})  # runners made earlier hold other launchers
    monkeypatch.setattr(module, "cuda_tensors", lambda *tensors: True)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(module, "stream_query", lambda: (lambda index: 0))
    host = kd.kda_decode if module is kd else ld.lightning_decode
    o, ht = host(**inputs, out=out)
    assert o is out
    return o, ht


CASES = [
    # (variant, B, T, H, HV, K, V, v_first, pool, flags, dtype, warps per CTA)
    ("kda", 3, 2, 1, 2, 64, 32, False, "inplace", db.KDA_SERVING_FLAGS, torch.bfloat16, 4),
    ("kda", 3, 3, 1, 1, 128, 32, True, "pool", db.KDA_SERVING_FLAGS, torch.bfloat16, 1),
    ("kda", 1, 5, 1, 1, 64, 64, True, "none", db.KDA_SERVING_FLAGS, torch.bfloat16, 2),
    ("kda", 1, 2, 1, 1, 64, 64, False, "plain", {}, torch.float32, 1),
    ("lightning", 3, 2, 1, 2, 64, 32, False, "inplace", {}, torch.bfloat16, 4),
    ("lightning", 1, 3, 1, 1, 64, 32, False, "pool", {}, torch.bfloat16, 1),
]


@pytest.mark.parametrize("variant,B,T,H,HV,K,V,v_first,pool,flags,dtype,warps", CASES,
                         ids=[f"{c[0]}-B{c[1]}-T{c[2]}-HV{c[4]}-K{c[5]}-{'vf' if c[7] else 'kf'}-{c[8]}-w{c[11]}"
                              for c in CASES])
def test_emulated_kernel_matches_reference(monkeypatch, variant, B, T, H, HV, K, V, v_first, pool, flags, dtype,
                                           warps):
    module = kd if variant == "kda" else ld
    monkeypatch.setattr(module, "pick_warps", lambda B, HV, V: warps)
    case = db.DecodeCase(variant, B, T, H, HV, K=K, V=V, dtype=dtype, state_v_first=v_first, pool=pool,
                         flags=flags, seed=B * 31 + T)
    inputs = db.make_inputs(case, device="cpu")
    h0 = inputs["initial_state"]
    before = h0.clone() if h0 is not None else None
    o_ref, s_ref = db.reference(case, {**inputs, "initial_state": before.clone() if h0 is not None else None})
    o, ht = run_emulated(monkeypatch, module, inputs)
    o_tol = 1e-6 if dtype == torch.float32 else 6e-3  # bf16 outputs round to 2^-9
    assert db.rel_err(o, o_ref) < o_tol
    assert db.rel_err(ht, s_ref) < 1e-6
    if pool == "inplace":
        assert ht is h0
        idx = inputs["state_indices"]
        kept = torch.ones(h0.shape[0], dtype=torch.bool)
        kept[idx[idx >= 0].long()] = False
        assert torch.equal(h0[kept], before[kept])  # skipped and unused slots are bit-equal
    elif pool == "pool":
        assert torch.equal(h0, before)


def test_emulator_catches_a_wrong_reduction(monkeypatch):
    # the emulator must be able to fail: drop one butterfly step of the K-first reduction
    inner = emu.rebind(decode_tile.butterfly_sum, {"cute": emu.cute, "cutlass": emu.cutlass})
    broken = dict(HELPERS, butterfly_sum=lambda frag, n, offsets: inner(frag, n, offsets[:-1]))
    monkeypatch.setitem(globals(), "HELPERS", broken)
    case = db.DecodeCase("lightning", 1, 1, 1, 1, K=64, V=32, pool="plain", seed=3)
    inputs = db.make_inputs(case, device="cpu")
    o_ref, _ = db.reference(case, {**inputs, "initial_state": inputs["initial_state"].clone()})
    o, _ = run_emulated(monkeypatch, ld, inputs)
    assert db.rel_err(o, o_ref) > 0.1


def _missing_barrier(buf):
    if emu.cute.arch.thread_idx()[0] != 5:
        emu.cute.arch.sync_threads()


def _missing_shuffle(buf):
    if emu.cute.arch.thread_idx()[0] != 33:
        emu.cute.arch.shuffle_sync_bfly(emu.cutlass.Float32(1.0), offset=1)


def _past_the_end(buf):
    buf[emu.cute.arch.thread_idx()[0] + 1] = emu.cutlass.Float32(1.0)


def _unwritten_register(buf):
    r = emu.cute.make_rmem_tensor(emu.cute.make_layout(2), emu.cutlass.Float32)
    r[0] = emu.cutlass.Float32(1.0)
    buf[0] = r[1]


def _butterfly_total(buf):
    tid = emu.cute.arch.thread_idx()[0]
    x = emu.cutlass.Float32(float(tid))
    for s in range(5):  # many shuffles in a row: each lane must see the value of this round
        x = x + emu.cute.arch.shuffle_sync_bfly(x, offset=1 << s)
    emu.cute.arch.sync_threads()
    buf[tid] = x


@pytest.mark.parametrize("kernel, message", [
    (_missing_barrier, "a barrier was broken"), (_missing_shuffle, "a barrier was broken"),
    (_past_the_end, "flat index 64 of"), (_unwritten_register, "read of an element never written"),
])
def test_emulator_reports_what_a_gpu_run_would_hide(kernel, message):
    """The emulator's own checks: a thread missing a barrier or a shuffle (deadlock), an access out of
    bounds, a read of a register never written."""
    buf = emu.Tensor(emu.Pointer([float("nan")] * 64, 0, emu.Float32, "out"), emu.Layout(64))
    with pytest.raises(AssertionError, match=message):
        emu.launch(kernel, [1, 1, 1], 64, (buf,), timeout=0.5)


def test_emulator_shuffles_exchange_each_rounds_values():
    buf = emu.Tensor(emu.Pointer([float("nan")] * 64, 0, emu.Float32, "out"), emu.Layout(64))
    emu.launch(_butterfly_total, [1, 1, 1], 64, (buf,))
    assert [float(buf[i]) for i in range(64)] == [float(sum(range(32)))] * 32 + [float(sum(range(32, 64)))] * 32

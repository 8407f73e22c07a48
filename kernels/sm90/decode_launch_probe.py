"""How much of a decode call's host time is the CuTe DSL's launch, and what a bare driver launch costs.

A measurement, not a code path: ``python -m cula.kernels.sm90.decode_launch_probe`` (needs a GPU).
It compiles the KDA decode kernel for B1 H32 (serving flags, plain initial state), then

1. relaunches the same kernel with ``cuLaunchKernel`` from ``libcuda`` through ctypes (the kernel's
   own parameters: 11 pointers, T, H, HV, scale, lower_bound; grid ``(V / 32, HV, B)``, 128 threads,
   the dynamic shared memory the DSL's host function passes, read from its IR), checks that o and the
   final state are bitwise those of the DSL's launch, and
2. times host microseconds per launch of both (200 queued launches, best of 3), and the public op.

Measured on the H200 host (session 8): bare 7.74 µs against 9.06 through cula's launcher, outputs
bitwise equal. The driver's launch is most of the cost there, so the DSL's launch stays (decode.md).
"""

from __future__ import annotations

import ctypes
import re

import torch


def _host_us(fn) -> float:
    from cula.kernels.sm90.decode_bench import host_time

    return host_time(fn) * 1e6


def dynamic_smem(compiled) -> int:
    """The dynamic shared memory bytes the compiled host function launches with (from its IR)."""
    text = str(getattr(compiled, "ir_module", None) or "")
    if "dynamicSmemBytes" not in text:  # IR not kept: the kernel's SmemAllocator sizes at K = 128, 4 warps
        return 3 * 8 * 128 * 4 + 8 * 32 * 4 + 8 * 2 * 4  # sQ, sK, sD + sV + (beta, q.k): 13,376 B
    m = re.search(r"dynamicSmemBytes = (%\w+)", text)
    if m is None:
        raise RuntimeError("no dynamicSmemBytes in the host function's IR")
    name = m.group(1)
    m2 = re.search(re.escape(name) + r" = arith\.extsi (%\w+)", text)
    if m2 is not None:
        name = m2.group(1)
    m3 = re.search(re.escape(name) + r" = arith\.constant (\d+)", text)
    if m3 is None:
        raise RuntimeError(f"dynamic smem {name} is not a constant")
    return int(m3.group(1))


def load_function(compiled) -> int:
    """Our own module of the compiled kernel's cubin (kept by CUTE_DSL_KEEP_CUBIN) and its CUfunction:
    the DSL's host function loads its library inside C, so no handle of it reaches Python."""
    cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    if not isinstance(cubin, bytes) or not isinstance(ptx, str):
        raise RuntimeError("no cubin / PTX kept: set CUTE_DSL_KEEP_CUBIN=1 and CUTE_DSL_KEEP_PTX=1 first")
    name = re.search(r"\.entry\s+(\w+)", ptx).group(1)
    lib = ctypes.CDLL("libcuda.so.1")
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(cubin, len(cubin))
    rc = lib.cuModuleLoadData(ctypes.byref(module), buf)
    if rc:
        raise RuntimeError(f"cuModuleLoadData: {rc}")
    rc = lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode())
    if rc:
        raise RuntimeError(f"cuModuleGetFunction({name}): {rc}")
    return fn.value


def main() -> int:
    import os
    import tempfile

    # before the first compile: keep the cubin and PTX, and compile afresh (a disk-cache hit keeps none)
    os.environ.update(CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DISABLE_FILE_CACHING="1",
                      CUTE_DSL_DUMP_DIR=tempfile.mkdtemp())
    from cula.kernels.sm90 import decode_bench as db
    from cula.kernels.sm90 import kda_decode as m

    case = db.DecodeCase("kda", 1, 1, 32, 32, flags=db.KDA_SERVING_FLAGS)
    inputs = db.make_inputs(case)
    o, ht = m.kda_decode(**inputs)
    torch.cuda.synchronize()
    launcher = next(lau for lau in m._cache.values() if lau._last_values)
    vals = launcher._last_values
    compiled = launcher.compiled
    handle = load_function(compiled)
    smem = dynamic_smem(compiled)
    B, T, H, HV = vals[11:15]
    scale, lower_bound, stream = vals[15], vals[16], vals[17]
    warps = 4
    grid = (case.V // (8 * warps), HV, B)
    print(f"handle {handle:#x} smem {smem} grid {grid} T {T} H {H} HV {HV} scale {scale} lb {lower_bound}",
          flush=True)

    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    cells = [ctypes.c_void_p(v) for v in vals[:11]]
    cells += [ctypes.c_int32(T), ctypes.c_int32(H), ctypes.c_int32(HV)]
    cells += [ctypes.c_float(scale), ctypes.c_float(lower_bound)]
    params = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])

    def bare():
        rc = launch(handle, grid[0], grid[1], grid[2], 32 * warps, 1, 1, smem, stream, params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel: {rc}")

    o_ref, ht_ref = o.clone(), ht.clone()
    o.zero_()
    ht.zero_()
    bare()
    torch.cuda.synchronize()
    same = torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    print(f"bare launch == DSL launch: {same}", flush=True)

    dsl = launcher.call_public
    fast = launcher
    t_bare = _host_us(bare)
    t_fast = _host_us(lambda: fast(*vals))
    t_dsl = _host_us(lambda: dsl(*vals))
    t_entry = _host_us(lambda: m.kda_decode(**inputs))
    import cula

    t_public = _host_us(lambda: cula.kda.fused_recurrent_kda(**inputs))
    print(f"host us per launch: bare cuLaunchKernel {t_bare:.2f}, cula fast launcher {t_fast:.2f}, "
          f"DSL call path {t_dsl:.2f}; kernel entry {t_entry:.2f}, public op {t_public:.2f}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Ahead-of-time compiled CuTe DSL host functions: compiled where there is no GPU, loaded where there is.

Each device process compiles every KDA flag set it launches (~40 s each): ``cute.compile`` never uses the DSL's
file cache. The DSL does compile a whole module, cubin inside, without a driver when the environment's arch
differs from the compile's (``CUTE_DSL_ARCH=sm_90`` with ``--gpu-arch=sm_90a``): only the host JIT, which needs
the CUDA libraries, is skipped. :func:`save` writes such a module as MLIR bytecode with what the DSL needs to
rebuild its compiled function (entry name, argument spec, kernel attributes); :func:`load`, on the GPU machine,
parses it and runs the host JIT, which is what the DSL's own file cache does on a hit: no lowering, no ptxas.

A file is named by the launch key and a fingerprint of the kernel sources and the DSL version
(:func:`entry_name`), so an edited kernel never loads a stale module. :func:`find` is consulted only where
``CULA_AOT_DIR`` is set, and a module that fails to load is compiled instead, with one warning.

Build (on any machine, CPU only): ``python -m cula.kernels.common.aot build DIR [--scenarios a,b] [--jobs N]``
(``cula.kernels.common.aot_build``: which launches the device steps make, compiled one module each).
"""

from __future__ import annotations

import functools
import hashlib
import io
import lzma
import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

AOT_ENV = "CULA_AOT_DIR"
HOST_ARCH_ENV = "sm_90"  # the environment's arch while compiling: differs from GPU_ARCH, so no host JIT
GPU_ARCH = "sm_90a"
SUFFIX = ".cuteaot.xz"


#: Files under ``cula.kernels`` that no ahead-of-time module is built from: which modules to build (aot_build),
#: the tools that read PTX, SASS and profiles, the KDA check / profile drivers, and the other ops' kernels (none
#: built ahead of time). Editing them renames no module (a full rebuild costs ~14 min on the 2-core CPU machine).
#: tests/test_aot.py checks that the other sources import them only where no kernel is built (``fake_args``,
#: ``layout_facts``, ``main``); a new file is a kernel source until it is named here.
NOT_KERNEL_SOURCES = frozenset({
    "common/aot_build.py", "common/ptx_check.py", "common/sass.py", "common/ncu_phases.py",
    "common/decode_host.py", "common/decode_tile.py",
    "sm90/kda_fwd_check.py", "sm90/kda_fwd_profile.py",
    "sm90/decode_bench.py", "sm90/decode_launch_probe.py", "sm90/decode_profile.py", "sm90/kda_decode.py",
    "sm90/lightning_decode.py", "sm90/lightning_fwd.py", "sm90/lightning_fwd_check.py",
})


def kernel_sources() -> list[Path]:
    """The ``*.py`` files under ``cula.kernels`` that a module's content can depend on (all but
    :data:`NOT_KERNEL_SOURCES`), sorted."""
    import cula.kernels

    root = Path(cula.kernels.__path__[0])
    return [p for p in sorted(root.rglob("*.py")) if p.relative_to(root).as_posix() not in NOT_KERNEL_SOURCES]


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 of the kernel sources (:func:`kernel_sources`) and of the DSL's compiler driver source (the
    device's DSL is a repacked tree without package metadata; its Python sources equal the wheel's)."""
    import cutlass.base_dsl.dsl as dsl_source

    import cula.kernels

    h = hashlib.sha256(Path(dsl_source.__file__).read_bytes())
    root = Path(cula.kernels.__path__[0])
    for path in kernel_sources():
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _spec_key(specs: Sequence[Any]) -> tuple:
    return tuple((s.kind, repr(s.dtype), s.align) for s in specs)


def entry_name(kind: str, key: Any, specs: Sequence[Any]) -> str:
    """File name of the module compiled for launch ``(kind, key)`` with argument ``specs`` from the current
    kernel sources."""
    h = hashlib.sha256(repr((kind, key, _spec_key(specs), source_fingerprint())).encode())
    return f"{kind}-{h.hexdigest()[:24]}{SUFFIX}"


def compile_for_export(fn: Any, specs: Sequence[Any]):
    """``cute.compile`` for sm_90a without a host JIT. The process must have ``CUTE_DSL_ARCH`` set to
    ``HOST_ARCH_ENV`` before ``cutlass`` was imported (:func:`main` does)."""
    from cutlass.base_dsl.compiler import Compiler

    from cula.kernels.common import dsl_compile
    from cula.kernels.common.fast_launch import compile_args

    if os.environ.get("CUTE_DSL_ARCH") != HOST_ARCH_ENV:
        raise RuntimeError(f"CUTE_DSL_ARCH: expected {HOST_ARCH_ENV} (set before cutlass is imported), "
                           f"got {os.environ.get('CUTE_DSL_ARCH')!r}")
    Compiler._check_cuda_dependencies_once = lambda *a, **k: None
    from cula.kernels.sm90.kda_fwd_intra_tc import _compile_without_driver

    _compile_without_driver()  # launch bounds ask the device's shared memory per SM: the H200's without one
    return dsl_compile.compile(fn, *compile_args(specs), options=f"--gpu-arch={GPU_ARCH}")


def save(path: str | os.PathLike, compiled: Any) -> int:
    """Write ``compiled`` (a :func:`compile_for_export` result) to ``path``; returns the file's size."""
    buf = io.BytesIO()
    compiled.ir_module.operation.write_bytecode(buf)
    # the signature as the DSL got it (ExecutionArgs filters it again when the function is rebuilt)
    args_spec = compiled.args_spec.original_args_spec if compiled.args_spec is not None else None
    blob = dict(bytecode=buf.getvalue(), function_name=compiled.function_name, args_spec=args_spec,
                kernel_info=compiled.kernel_info)
    data = lzma.compress(pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL), preset=6)
    # through a temporary name: a build killed mid-write leaves no truncated module for the next build to skip
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)


def read(path: str | os.PathLike) -> dict:
    """The pickled parts of a saved module (bytecode, entry name, argument spec, kernel attributes)."""
    return pickle.loads(lzma.decompress(Path(path).read_bytes()))


def load(path: str | os.PathLike):
    """The compiled host function saved at ``path``, ready to call (needs the GPU machine's CUDA libraries:
    the host JIT resolves them)."""
    from cutlass._mlir import ir
    from cutlass.cutlass_dsl import CuTeDSL
    from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction

    blob = read(path)
    dsl = CuTeDSL._get_dsl()
    with ir.Context():
        module = ir.Module.parse(blob["bytecode"])
    engine = dsl.compiler_provider.jit(module, shared_libs=dsl.get_shared_libs())
    capi = engine.lookup(blob["function_name"])
    return CudaDialectJitCompiledFunction(module, engine, capi, blob["args_spec"], blob["function_name"],
                                          blob["kernel_info"], False, None)


def find(kind: str, key: Any, specs: Sequence[Any]):
    """The ahead-of-time module for this launch, if ``CULA_AOT_DIR`` holds one that loads; else None."""
    root = os.environ.get(AOT_ENV)
    if not root:
        return None
    path = Path(root) / entry_name(kind, key, specs)
    if not path.exists():
        return None
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - compiled instead
        warnings.warn(f"cula: ahead-of-time module {path.name} did not load ({type(exc).__name__}: {exc}); "
                      "compiling it instead", RuntimeWarning, stacklevel=3)
        return None


if __name__ == "__main__":  # the build's command line (cula.kernels.common.aot_build)
    import sys

    os.environ["CUTE_DSL_ARCH"] = HOST_ARCH_ENV  # before cutlass is imported: no host JIT
    from cula.kernels.common.aot_build import main

    sys.exit(main(sys.argv[1:]))

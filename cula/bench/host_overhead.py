"""Host (Python) time of a call of cula's public ops, on any machine, GPU or not.

CPU tensors are made to look like sm_90 tensors (the same probes ``tests/test_dispatch.py``'s
``hopper`` fixture patches). Per op it prints median microseconds per call of:

- ``public``: the public op over a *fake* kernel module whose host function returns at once: binding,
  validation and dispatch, the part cula's op layers add (``layers`` = ``public`` minus the fake host
  function called directly).
- ``full`` (decode ops): the public op over the *real* kernel module, i.e. the whole host path up to
  (not including) the CUDA launch: the op layers, the kernel module's checks, its compile-cache
  lookup, the output allocation, the argument packing and the launcher's ctypes call. Only what needs
  a GPU is stubbed: the kernel's "CUDA tensors" test passes for CPU tensors, the compiled kernel is a
  C function that returns at once (:func:`cula.kernels.common.fast_launch.null_launcher`), the stream
  query returns 0. On a GPU add the launch itself and the CUDA caching allocator's time.
- ``entry`` (decode ops): the real kernel host function called directly, as ``decode_bench`` times
  ``cula_host_us`` on the GPU.

::

    python3 -m cula.bench.host_overhead [--calls 1000] [--rounds 5]

Each column is the lowest of ``rounds`` medians of ``calls`` calls (on a shared machine noise only
ever adds time). ``main`` makes glibc keep freed large blocks
(``mallopt``): a decode call allocates its outputs (e.g. a 128 MiB fp32 final state), which on the GPU
comes from torch's caching allocator, while glibc would ``mmap``/``munmap`` it on every call
(``--no-malloc-cache`` times that instead). Everything patched is restored on exit.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from cula import _dispatch

#: Decode shapes of a serving step: 64 sequences, one token, 32 heads, head dim 128.
B, T, H, HV, K, V = 64, 1, 32, 32, 128, 128
#: Prefill shapes for the two chunked ops.
PB, PT = 1, 2048
POOL = B + 8
#: Kernels whose real host function the ``full`` / ``entry`` columns run (with the launch stubbed).
REAL_KERNELS = ("kda_decode", "lightning_decode")


@contextmanager
def fake_hopper(real: tuple[str, ...] = ()) -> Iterator[dict[str, types.ModuleType]]:
    """Patch the environment probes to sm_90 and install kernel modules: fakes, except the kernels
    named in ``real``, which are the real modules with their GPU-only steps stubbed
    (:func:`stub_gpu_steps`). Undo it all after."""
    saved_attrs = {name: getattr(_dispatch, name) for name in ("device_arch", "cuda_available", "_current_arch",
                                                              "fla_installed")}
    names = list(_dispatch.KERNEL_ARGS)
    saved_modules = {n: sys.modules.get(f"{_dispatch.KERNEL_PACKAGE}.{n}", _MISSING) for n in names}
    modules: dict[str, types.ModuleType] = {}
    with ExitStack() as stack:
        try:
            for name in real:  # imported before any fake takes its place in sys.modules
                modules[name] = importlib.import_module(f"{_dispatch.KERNEL_PACKAGE}.{name}")
                stack.enter_context(stub_gpu_steps(modules[name]))
            _dispatch.device_arch = lambda device: (9, 0)
            _dispatch.cuda_available = lambda: True
            _dispatch._current_arch = lambda: (9, 0)
            _dispatch.fla_installed = lambda: True
            for name in names:
                if name not in modules:
                    module = types.ModuleType(f"{_dispatch.KERNEL_PACKAGE}.{name}")
                    module.supports = _supports
                    setattr(module, name, _host)
                    modules[name] = module
                sys.modules[modules[name].__name__] = modules[name]
            _dispatch.clear_caches()
            yield modules
        finally:
            for name, value in saved_attrs.items():
                setattr(_dispatch, name, value)
            for name, module in saved_modules.items():
                key = f"{_dispatch.KERNEL_PACKAGE}.{name}"
                if module is _MISSING:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = module
            _dispatch.clear_caches()


@contextmanager
def stub_gpu_steps(module: types.ModuleType) -> Iterator[None]:
    """Let a real decode kernel module run its host function on CPU tensors up to the launch: CPU
    tensors pass its "CUDA tensors" test, kernels "compile" to a null launcher, the stream is 0, and its
    compile and runner caches are fresh dicts (restored after, so no stub outlives the measurement)."""
    from cula.kernels.common import fast_launch

    patches = {
        "cuda_tensors": _all_cuda,
        "compile_launcher": lambda fn, specs, fast=True: fast_launch.null_launcher(specs),
        "stream_query": lambda: _zero_stream,
        "_cache": {},
        "_runners": {},
    }
    saved = {name: getattr(module, name) for name in patches if hasattr(module, name)}
    try:
        for name, value in patches.items():
            setattr(module, name, value)
        yield
    finally:
        for name in patches:
            if name in saved:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)


_MISSING = object()
_RESULT = (None, None)


def _zero_stream(device_index: int | None) -> int:
    return 0


def _all_cuda(*tensors: Any) -> bool:
    return True


def _supports(**kwargs: Any) -> None:
    return None


def _host(**kwargs: Any) -> tuple[None, None]:
    return _RESULT


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(calls):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples) / 1e3


def _cases() -> list[tuple[str, str, str, Callable[[], dict[str, Any]]]]:
    """``(label, public op target, kernel name, make_kwargs)`` per measured call."""
    bf = torch.bfloat16

    def act(b: int, t: int, h: int, d: int) -> torch.Tensor:
        return torch.randn(b, t, h, d, dtype=bf)

    def kda_decode() -> dict[str, Any]:
        return dict(q=act(B, T, H, K), k=act(B, T, H, K), v=act(B, T, HV, V), g=act(B, T, HV, K),
                    beta=torch.rand(B, T, HV, dtype=bf), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K),
                    initial_state=torch.empty(POOL, HV, K, V), use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, ssm_state_indices=torch.randperm(POOL)[:B].to(torch.int32),
                    inplace_final_state=True)

    def kda_decode_plain() -> dict[str, Any]:
        return dict(q=act(B, T, H, K), k=act(B, T, H, K), v=act(B, T, HV, V), g=act(B, T, HV, K),
                    beta=torch.rand(B, T, HV, dtype=bf), initial_state=torch.zeros(B, HV, K, V),
                    output_final_state=True)

    def lightning_decode() -> dict[str, Any]:
        return dict(q=act(B, T, H, K), k=act(B, T, H, K), v=act(B, T, HV, V), decay=torch.rand(HV),
                    initial_state=torch.empty(POOL, HV, K, V),
                    state_indices=torch.randperm(POOL)[:B].to(torch.int32), inplace=True)

    def lightning_fwd() -> dict[str, Any]:
        return dict(q=act(PB, PT, H, K), k=act(PB, PT, H, K), v=act(PB, PT, HV, V), decay=torch.rand(HV),
                    initial_state=torch.zeros(PB, HV, K, V), output_final_state=True)

    def chunk_kda() -> dict[str, Any]:
        return dict(q=act(PB, PT, H, K), k=act(PB, PT, H, K), v=act(PB, PT, HV, V), g=act(PB, PT, HV, K),
                    beta=torch.rand(PB, PT, HV, dtype=bf), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K),
                    initial_state=torch.zeros(PB, HV, K, V), output_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)

    return [
        ("fused_recurrent_kda (pool, gate)", "cula.kda:fused_recurrent_kda", "kda_decode", kda_decode),
        ("fused_recurrent_kda (plain)", "cula.kda:fused_recurrent_kda", "kda_decode", kda_decode_plain),
        ("lightning_attn_decode (pool)", "cula.lightning:lightning_attn_decode", "lightning_decode",
         lightning_decode),
        ("lightning_attn_fwd", "cula.lightning:lightning_attn_fwd", "lightning_fwd", lightning_fwd),
        ("chunk_kda", "cula.kda:chunk_kda", "kda_fwd", chunk_kda),
    ]


#: Columns of :func:`measure`'s rows, after the label.
COLUMNS = ("public", "host", "full", "entry")


def measure(calls: int = 1000, rounds: int = 5) -> list[tuple[str, float, float, float | None, float | None]]:
    """``(label, public us, fake host us, full us, entry us)`` per case (``full`` / ``entry``: None for
    ops whose kernel is not in :data:`REAL_KERNELS`). Each is the lowest of ``rounds`` medians of
    ``calls`` calls; the rounds go round-robin over all cases, so a slow spell of a shared machine
    does not sit on one case's every round."""
    torch.manual_seed(0)
    jobs = []  # (label, column, real kernels, make the timed function under that fake_hopper)
    for label, target, kernel, make in _cases():
        kwargs = make()
        jobs.append((label, "public", (), _public_call(label, target, kwargs)))
        jobs.append((label, "host", (), _fake_host_call(kernel)))
        if kernel in REAL_KERNELS:
            jobs.append((label, "full", (kernel,), _public_call(label, target, kwargs)))
            jobs.append((label, "entry", (kernel,), _entry_call(target, kernel, kwargs)))
    samples: dict[tuple[str, str], list[float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback here would mean the kernel path is not what is timed
        for _ in range(rounds):
            for label, column, real, timed in jobs:
                with fake_hopper(real=real) as modules:
                    fn = timed(modules)
                    for _ in range(min(200, calls)):  # warm caches (imports, first-call checks, plans)
                        fn()
                    samples.setdefault((label, column), []).append(_median_us(fn, calls))
    labels = list(dict.fromkeys(label for label, *_ in jobs))
    return [(label, *(min(samples[label, c]) if (label, c) in samples else None for c in COLUMNS))
            for label in labels]


def _public_call(label: str, target: str, kwargs: dict[str, Any]) -> Callable[[dict], Callable[[], Any]]:
    def make(modules: dict[str, types.ModuleType]) -> Callable[[], Any]:
        op = _dispatch.resolve(target)
        _expect_kernel(label, op, kwargs)
        return lambda: op(**kwargs)
    return make


def _fake_host_call(kernel: str) -> Callable[[dict], Callable[[], Any]]:
    def make(modules: dict[str, types.ModuleType]) -> Callable[[], Any]:
        host = getattr(modules[kernel], kernel)
        direct = {name: None for name in _dispatch.KERNEL_ARGS[kernel]}
        return lambda: host(**direct)
    return make


def _entry_call(target: str, kernel: str, kwargs: dict[str, Any]) -> Callable[[dict], Callable[[], Any]]:
    def make(modules: dict[str, types.ModuleType]) -> Callable[[], Any]:
        inputs = _dispatch.resolve(target).prepare_inputs(**kwargs)
        entry, entry_kwargs = getattr(modules[kernel], kernel), _dispatch.kernel_kwargs(kernel, inputs)
        return lambda: entry(**entry_kwargs)
    return make


def _expect_kernel(label: str, op: Any, kwargs: dict[str, Any]) -> None:
    backend = _dispatch.explain(op.op_name, **kwargs).backend
    if backend != _dispatch.CULA_SM90:
        raise RuntimeError(f"{label}: dispatched to {backend}, not the kernel")


def cache_large_cpu_allocations() -> bool:
    """Make glibc keep freed blocks of any size for reuse (as torch's CUDA caching allocator does)
    instead of ``mmap``-ing / ``munmap``-ing each large one; for the rest of the process. Returns
    whether it could."""
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per round (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per case; the lowest median is kept")
    parser.add_argument("--no-malloc-cache", action="store_true",
                        help="leave glibc's malloc as is (large outputs are mmap-ed per call)")
    args = parser.parse_args(argv)
    cached = False if args.no_malloc_cache else cache_large_cpu_allocations()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {args.calls} calls x {args.rounds} rounds, "
          f"lowest median us per call; large blocks {'cached' if cached else 'mmap-ed'} by malloc")
    print(f"{'op':36s} {'public':>8s} {'layers':>7s} {'full':>8s} {'entry':>8s}")

    def cell(x: float | None) -> str:
        return f"{x:8.2f}" if x is not None else f"{'-':>8s}"

    for label, public_us, host_us, full_us, entry_us in measure(args.calls, args.rounds):
        print(f"{label:36s} {public_us:8.2f} {public_us - host_us:7.2f} {cell(full_us)} {cell(entry_us)}")


if __name__ == "__main__":
    main()

"""Host (Python) time that cula's public-op layers add on top of the kernel's host function.

Runs on any machine, GPU or not: CPU tensors are made to look like sm_90 tensors (the same probes
``tests/test_dispatch.py``'s ``hopper`` fixture patches) and each ``cula.kernels.sm90.<name>`` is
replaced by a fake module whose host function returns at once. What is left of a public-op call is
then binding, validation and dispatch: the part cula itself adds. Per op it prints the median
microseconds of the public op minus the median of calling the fake host function directly::

    python3 -m cula.bench.host_overhead [--calls 2000]

Everything patched is restored on exit (the real kernel modules, if imported, come back too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cula import _dispatch

#: Decode shapes of a serving step: 64 sequences, one token, 32 heads, head dim 128.
B, T, H, HV, K, V = 64, 1, 32, 32, 128, 128
#: Prefill shapes for the two chunked ops.
PB, PT = 1, 2048
POOL = B + 8


@contextmanager
def fake_hopper() -> Iterator[dict[str, types.ModuleType]]:
    """Patch the environment probes to sm_90 and install fake kernel modules; undo it all after."""
    saved_attrs = {name: getattr(_dispatch, name) for name in ("device_arch", "cuda_available", "_current_arch",
                                                              "fla_installed")}
    names = list(_dispatch.KERNEL_ARGS)
    saved_modules = {n: sys.modules.get(f"{_dispatch.KERNEL_PACKAGE}.{n}", _MISSING) for n in names}
    fakes: dict[str, types.ModuleType] = {}
    try:
        _dispatch.device_arch = lambda device: (9, 0)
        _dispatch.cuda_available = lambda: True
        _dispatch._current_arch = lambda: (9, 0)
        _dispatch.fla_installed = lambda: True
        for name in names:
            module = types.ModuleType(f"{_dispatch.KERNEL_PACKAGE}.{name}")
            module.supports = _supports
            setattr(module, name, _host)
            sys.modules[module.__name__] = module
            fakes[name] = module
        _dispatch.clear_caches()
        yield fakes
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


_MISSING = object()
_RESULT = (None, None)


def _supports(**kwargs: Any) -> None:
    return None


def _host(**kwargs: Any) -> tuple[None, None]:
    return _RESULT


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(min(200, calls)):  # warm caches (imports, first-call checks)
        fn()
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


def measure(calls: int = 2000) -> list[tuple[str, float, float]]:
    """``(label, public op us, fake host us)`` per case (medians of ``calls`` calls)."""
    torch.manual_seed(0)
    rows = []
    with fake_hopper(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback here would mean the fast path is not what is timed
        for label, target, kernel, make in _cases():
            op = _dispatch.resolve(target)
            kwargs = make()
            if True:
                backend = _dispatch.explain(op.op_name, **kwargs).backend
                if backend != _dispatch.CULA_SM90:
                    raise RuntimeError(f"{label}: dispatched to {backend}, not the (fake) kernel")
                host = getattr(sys.modules[f"{_dispatch.KERNEL_PACKAGE}.{kernel}"], kernel)
                direct = {name: None for name in _dispatch.KERNEL_ARGS[kernel]}
                public_us = _median_us(lambda: op(**kwargs), calls)
                host_us = _median_us(lambda: host(**direct), calls)
            rows.append((label, public_us, host_us))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per op (default 2000)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {args.calls} calls, median us per call")
    print(f"{'op':36s} {'public':>8s} {'host':>6s} {'cula adds':>10s}")
    for label, public_us, host_us in measure(args.calls):
        print(f"{label:36s} {public_us:8.2f} {host_us:6.2f} {public_us - host_us:10.2f}")


if __name__ == "__main__":
    main()

"""The GPU kernels a callable launches, by name (torch profiler), for tests that pin a call's launches."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernels_of(fn: Callable[[], object], calls: int = 1) -> list[str]:
    """Names of the CUDA kernels ``calls`` calls of ``fn`` run, after one untraced call that warms its
    caches (compiled kernels, tables, plans)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

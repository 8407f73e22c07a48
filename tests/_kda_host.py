"""The kda_fwd host path without a GPU: kernel launches recorded instead of run, CPU tensors posing as tensors
on an sm_90 GPU (shared by tests/test_kernel_kda_fwd.py, tests/test_kda_train.py and tests/test_aot.py)."""

from __future__ import annotations

import torch


def record_kda_launches(monkeypatch) -> list[tuple]:
    """Make ``kda_fwd`` record each launch as ``(kind, key, specs, values)`` instead of compiling and
    running it; also fakes the stream handle, the current device and the SM count (132)."""
    import cula.kernels.common.fast_launch as fl
    from cula.kernels.sm90 import kda_fwd

    calls: list[tuple] = []

    def fake_launcher(kind, key, make_kernel, specs):
        def launch(*values):
            calls.append((kind, key, specs, values))
        return launch

    monkeypatch.setattr(kda_fwd, "_launcher", fake_launcher)
    monkeypatch.setattr(fl, "current_stream_handle", lambda index: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kda_fwd, "sm_count", lambda device: 132)
    return calls


def fake_sm90(monkeypatch) -> None:
    """Make dispatch and the real ``kda_fwd.supports`` see CPU tensors as tensors on an sm_90 GPU (unlike
    tests/test_dispatch.py's ``hopper`` fixture, the kernel modules stay the real ones)."""
    from cula import _dispatch

    monkeypatch.setattr(_dispatch, "device_arch", lambda device=None: (9, 0))
    monkeypatch.setattr(_dispatch, "_current_arch", lambda: (9, 0))
    monkeypatch.setattr(_dispatch, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def record_allocations(monkeypatch) -> list:
    """Make ``torch.empty`` remember every tensor it returns (the kda_fwd host path's buffers)."""
    allocs: list = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        allocs.append(t)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return allocs

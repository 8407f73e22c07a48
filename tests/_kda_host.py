"""The kda_fwd host path without a GPU: kernel launches recorded instead of run (shared by
tests/test_kernel_kda_fwd.py and tests/test_kda_train.py)."""

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

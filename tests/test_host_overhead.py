"""cula.bench.host_overhead: it times the real decode host path (launch stubbed), and leaves nothing
patched behind."""

from __future__ import annotations

import sys

import torch

from cula import _dispatch
from cula.bench import host_overhead as ho


def test_measure_reports_every_column_and_restores_everything():
    from cula.kernels.sm90 import kda_decode, lightning_decode

    before = {name: sys.modules.get(f"{_dispatch.KERNEL_PACKAGE}.{name}") for name in _dispatch.KERNEL_ARGS}
    attrs = {m: (m.cuda_tensors, m.compile_launcher, m._cache, m._runners) for m in (kda_decode, lightning_decode)}
    probes = _dispatch.probes_key()
    rows = ho.measure(calls=5, rounds=1)
    assert [r[0] for r in rows] == [label for label, *_ in ho._cases()]
    for label, public, host, full, entry in rows:
        assert public > 0 and host > 0
        decode = "decode" in label or "fused_recurrent" in label
        assert (full is not None and entry is not None) == decode, label
    assert {n: sys.modules.get(f"{_dispatch.KERNEL_PACKAGE}.{n}") for n in _dispatch.KERNEL_ARGS} == before
    for m, saved in attrs.items():
        assert all(a is b for a, b in zip((m.cuda_tensors, m.compile_launcher, m._cache, m._runners), saved))
    assert _dispatch.probes_key() == probes


def test_full_path_runs_the_real_host_function_up_to_the_null_launch():
    from cula.kernels.sm90 import kda_decode as kd

    x = dict(q=torch.randn(2, 1, 2, 128), k=torch.randn(2, 1, 2, 128), v=torch.randn(2, 1, 4, 128),
             g=torch.randn(2, 1, 4, 128), beta=torch.rand(2, 1, 4), initial_state=torch.zeros(2, 4, 128, 128),
             output_final_state=True)
    with ho.fake_hopper(real=("kda_decode",)) as modules:
        assert modules["kda_decode"] is kd
        o, ht = kd.kda_decode(**x)
        assert o.shape == x["v"].shape and ht.shape == x["initial_state"].shape
        (launcher,) = kd._cache.values()
        assert launcher.is_fast and launcher.compiled is None  # the null launcher, not a compiled kernel
    assert not any(lau.compiled is None for lau in kd._cache.values())

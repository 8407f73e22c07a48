"""GPU checks of the bench service: timer (flush, CUDA graphs, capture failure) and a tiny
end-to-end run of the fla / cula / ref impls. Skipped without CUDA; run on the device with
``python -m pytest -q tests/test_bench_gpu.py``."""

from __future__ import annotations

import math

import pytest
import torch

from cula.bench.runner import Plan, execute
from cula.bench.schema import OK
from cula.bench.store import Store
from cula.bench.timing import Timer, TimingSettings
from cula.suites import load_suite

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = """
name = "gpu_tiny"
description = "tiny GPU grid for the bench service's own test"
device = "cuda"
[defaults]
H = 2
K = 64
V = 64
dtype = "bfloat16"
state = true
[[grid]]
variant = "kda"
phase = "prefill"
mode = "fixed"
flags = { use_qk_l2norm_in_kernel = true, use_gate_in_kernel = true, use_beta_sigmoid_in_kernel = true, safe_gate = true, lower_bound = -5.0 }
B = [2]
T = [256]
[[grid]]
variant = "kda"
phase = "prefill"
mode = "varlen"
flags = { use_qk_l2norm_in_kernel = true, use_gate_in_kernel = true, use_beta_sigmoid_in_kernel = true, safe_gate = true, lower_bound = -5.0 }
dist = ["skewed"]
n_seqs = [3]
T = [300]
[[grid]]
variant = "lightning"
phase = "prefill"
mode = "fixed"
B = [1]
T = [200]
[[grid]]
variant = "kda"
phase = "decode"
mode = "fixed"
flags = { use_qk_l2norm_in_kernel = true, use_gate_in_kernel = true, use_beta_sigmoid_in_kernel = true, lower_bound = -5.0 }
B = [4]
T = [1]
[[grid]]
variant = "gla"
phase = "train"
mode = "fixed"
state = false
B = [1]
T = [128]
"""


def test_timer_eager_graph_and_failed_capture():
    x = torch.randn(256, 256, device="cuda")
    timer = Timer("cuda", TimingSettings(max_reps=10, max_time_s=0.05))
    eager = timer.eager(lambda: x @ x)
    graph = timer.graph(lambda: x @ x)
    assert eager.reps >= 3 and eager.median_ms > 0 and graph.median_ms > 0, (eager, graph)
    bad = timer.graph(lambda: (x @ x).sum().item())  # a host sync cannot be captured
    assert math.isnan(bad.median_ms) and bad.note.startswith("capture failed"), bad
    assert (x @ x).shape == (256, 256)  # the context still works
    assert torch.randn(8, device="cuda").isfinite().all()  # and so does the RNG
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # and work goes where it went before
    torch.cuda.synchronize()


def test_the_flush_evicts_the_inputs():
    """A 32 MiB read fits in L2 (50 MiB): timed without a real flush (4 KiB) it re-reads L2, after the
    256 MiB write flush it comes from HBM and takes longer (graph replays, so launch gaps do not hide
    it). A read-only flush failed this on the H200 (17.4 against 17.0 us) and was removed."""
    x = torch.ones(8 << 20, device="cuda")  # 32 MiB
    flushed = Timer("cuda", TimingSettings(max_reps=30, max_time_s=0.05))
    cached = Timer("cuda", TimingSettings(max_reps=30, max_time_s=0.05, flush_bytes=4096))
    t_flushed = flushed.graph(lambda: x.sum()).median_ms
    t_cached = cached.graph(lambda: x.sum()).median_ms
    assert t_flushed > 1.15 * t_cached, (t_flushed, t_cached)


def test_failed_captures_do_not_keep_memory():
    """What an op allocates before the host sync that breaks its capture is given back (the private
    pool of the failed graph is released): five failures of an op that allocates 512 MiB first must
    not leave GBs reserved."""
    timer = Timer("cuda", TimingSettings(max_reps=3, max_time_s=0.01))

    def op():
        big = torch.empty(128 << 20, dtype=torch.float32, device="cuda")  # 512 MiB
        return big.sum().item()  # a host sync: capture fails after the allocation

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for _ in range(5):
        assert timer.graph(op).note.startswith("capture failed")
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - before < (1 << 30), torch.cuda.memory_summary()
    # the RNG left capture mode with the failed graphs (the next config's randn raised before)
    assert torch.randn(8, device="cuda").isfinite().all()


def test_tiny_run_end_to_end(tmp_path):
    path = tmp_path / "gpu_tiny.toml"
    path.write_text(TINY)
    configs = list(load_suite("gpu_tiny", path).configs)
    plan = Plan(suites=["gpu_tiny"], mode="both", impls=["fla", "cula", "ref"], device="cuda",
                configs=configs, results_dir=tmp_path / "res")
    res = execute(plan, TimingSettings(max_reps=5, max_time_s=0.05), quick=True)
    rows = Store(tmp_path / "res").read_run(res.run_id).rows
    assert len(rows) == 3 * len(configs)
    report = [(r.config_id, r.impl, r.status, r.note, r.graph_note) for r in rows]
    fla = [r for r in rows if r.impl == "fla"]
    assert all(r.status == OK for r in fla), report
    assert all(r.eager_ms > 0 and r.tbps > 0 for r in fla), report
    assert all(not math.isnan(r.graph_ms) for r in fla if r.mode == "fixed" and r.phase != "train"), report
    assert all(r.status in (OK, "fail", "error", "unavailable") for r in rows)
    first = rows[0]
    assert first.device_kind == "cuda" and first.sm_count > 0 and first.ceil_tbps > 0.5 and first.ceil_tflops > 10
    train = [r for r in fla if r.phase == "train"]
    assert train and not math.isnan(train[0].grad_rel_l2)

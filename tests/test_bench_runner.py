"""The runner on CPU with fake implementations: statuses, parts per config, resume, plan errors."""

from __future__ import annotations

import math

import pytest
import torch

from cula.bench import counting
from cula.bench.impls import Impl, Prepared, Unavailable, fit_kwargs, op_kwargs
from cula.bench.inputs import build_inputs
from cula.bench.runner import BenchError, canonical_command, execute, parse_impls, resolve_plan
from cula.bench.schema import ERROR, FAIL, OK, UNAVAILABLE
from cula.bench.store import Store
from cula.bench.timing import Timer, TimingSettings, event_ms, percentile, summarize
from cula.suites import load_suite

FAST = TimingSettings(max_reps=3, min_reps=2, max_time_s=0.01, warmup_ms=0.0)
FP = {"device_kind": "cpu", "gpu_name": "cpu (test)", "cula_sha": "0123456789", "cula_dirty": False}
CEIL = (0.05, 0.5, "test ceilings")


def fake_oracle(inputs):
    """Cheap stand-in: o = v (shape [B,T,HV,V]), state = h0 + 1."""
    t = inputs.tensors
    ht = inputs.h0 + 1 if inputs.h0 is not None else None
    return (t["v"].double(), ht.double() if ht is not None else None, None), "fake oracle"


class Exact(Impl):
    def __init__(self, name):
        self.name = name
        self.calls = 0

    def prepare(self, inputs):
        t, h0 = inputs.tensors, inputs.h0

        def call():
            self.calls += 1
            return t["v"].clone(), (h0 + 1 if h0 is not None else None), None
        return Prepared(call=call, backend=f"{self.name}-backend")


class Off(Impl):
    """Output off by 10 %: must be flagged FAIL, never hidden."""
    name = "off"

    def prepare(self, inputs):
        t, h0 = inputs.tensors, inputs.h0
        return Prepared(call=lambda: (t["v"] * 1.1, h0 + 1 if h0 is not None else None, None), backend="x")


class Boom(Impl):
    name = "boom"

    def prepare(self, inputs):
        def call():
            raise RuntimeError("kernel exploded\nsecond line")
        return Prepared(call=call, backend="x")


class Missing(Impl):
    name = "missing"

    def prepare(self, inputs):
        raise Unavailable("not built for this config")


class InterruptAt(Exact):
    """Raises KeyboardInterrupt on the n-th prepared config, like Ctrl-C mid-run."""

    def __init__(self, name, at):
        super().__init__(name)
        self.at, self.seen = at, 0

    def prepare(self, inputs):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt
        return super().prepare(inputs)


def smoke_plan(tmp_path, impls, mode="fixed"):
    return resolve_plan(["smoke"], mode, impls, "cpu", results_dir=tmp_path, cuda_available=False)


def run(plan, impls, **kw):
    return execute(plan, FAST, impls=impls, oracle=fake_oracle, fingerprint=FP, ceilings=CEIL, **kw)


def test_statuses_and_one_part_per_config(tmp_path):
    names = ["cula", "off", "boom", "missing"]
    plan = smoke_plan(tmp_path, ["cula", "ref"])
    plan.impls = names
    impls = {"cula": Exact("cula"), "off": Off(), "boom": Boom(), "missing": Missing()}
    res = run(plan, impls)
    rows = Store(tmp_path).read_run(res.run_id).rows
    n_cfg = len(plan.configs)
    assert res.rows == len(rows) == n_cfg * 4
    by = {}
    for r in rows:
        by.setdefault(r.impl, []).append(r)
    assert {r.status for r in by["cula"]} == {OK}
    assert {r.status for r in by["off"]} == {FAIL}
    assert all("o rel-L2" in r.note for r in by["off"])
    assert all(r.o_rel_l2 == pytest.approx(0.1, rel=1e-6) for r in by["off"])
    assert {r.status for r in by["boom"]} == {ERROR}
    assert by["boom"][0].note == "RuntimeError: kernel exploded"
    assert {r.status for r in by["missing"]} == {UNAVAILABLE}
    ok = by["cula"][0]
    assert ok.o_rel_l2 == 0.0 and ok.backend == "cula-backend" and ok.oracle == "fake oracle"
    assert ok.eager_ms > 0 and 2 <= ok.eager_reps <= 3 and ok.eager_p20_ms <= ok.eager_p80_ms
    assert math.isnan(ok.graph_ms) and "CPU" in ok.graph_note
    assert ok.bytes > 0 and ok.flops > 0 and ok.tbps > 0 and ok.pct_bw == pytest.approx(100 * ok.tbps / 0.05)
    assert ok.gpu_name == "cpu (test)" and ok.cula_sha == "0123456789" and ok.run_id == res.run_id
    assert ok.command.startswith("cula bench --suite smoke --mode fixed")
    # finished run: compacted into one bundle
    assert res.bundle == tmp_path / f"{res.run_id}.parquet" and res.bundle.is_file()


def test_interrupt_keeps_finished_configs_and_resume_skips_them(tmp_path):
    plan = smoke_plan(tmp_path, ["cula"])
    with pytest.raises(KeyboardInterrupt) as info:
        run(plan, {"cula": InterruptAt("cula", at=3)})
    run_id = info.value.args[0]
    store = Store(tmp_path)
    assert len(store.read_run(run_id).rows) == 2  # configs 1 and 2 were stored, 3 was in flight
    assert store.read_meta(run_id)["status"] == "interrupted"
    again = Exact("cula")
    res = run(plan, {"cula": again}, resume=run_id)
    assert res.configs_skipped == 2 and again.calls > 0
    rows = store.read_run(run_id).rows
    assert len(rows) == len(plan.configs)
    assert [r.config_index for r in rows] == sorted(c.index for c in plan.configs)


def test_resume_adds_a_new_impl_only(tmp_path):
    plan = smoke_plan(tmp_path, ["cula"])
    res = run(plan, {"cula": Exact("cula")})
    plan.impls = ["cula", "ref"]
    first, second = Exact("cula"), Exact("ref")
    run(plan, {"cula": first, "ref": second}, resume=res.run_id)
    assert first.calls == 0 and second.calls > 0
    assert len(Store(tmp_path).read_run(res.run_id).rows) == 2 * len(plan.configs)


def test_resume_unknown_run(tmp_path):
    with pytest.raises(BenchError, match="unknown run id 'nope'"):
        run(smoke_plan(tmp_path, ["cula"]), {"cula": Exact("cula")}, resume="nope")


def test_out_dir_gets_one_file(tmp_path):
    res = run(smoke_plan(tmp_path / "store", ["cula"]), {"cula": Exact("cula")}, out_dir=tmp_path / "out")
    files = list((tmp_path / "out").iterdir())
    assert files == [tmp_path / "out" / f"{res.run_id}.parquet"]


def test_plan_falls_back_to_smoke_without_gpu(tmp_path):
    plan = resolve_plan(["kda"], "both", None, "auto", cuda_available=False)
    assert plan.fallback and plan.suites == ["smoke"] and plan.device == "cpu"
    assert plan.impls == ["cula", "ref"]
    assert "No CUDA GPU" in plan.notices[0] and "smoke" in plan.notices[0]
    assert "cula" in str(plan.results_dir) and "reports" not in plan.results_dir.parts[-2:]
    p2 = resolve_plan(["kda"], "both", ["fla", "ref"], "auto", cuda_available=False)
    assert p2.impls == ["ref"] and any("fla" in n for n in p2.notices)


def test_plan_on_gpu_keeps_the_suite(tmp_path):
    plan = resolve_plan(["kda"], "varlen", ["fla", "ref"], "auto", cuda_available=True)
    assert plan.device == "cuda" and len(plan.configs) == 18 and not plan.notices
    assert plan.results_dir.parts[-2:] == ("reports", "results")


@pytest.mark.parametrize("kwargs,match", [
    (dict(suites=["nope"]), "unknown suite 'nope'"),
    (dict(suites=["kda"], device="cuda"), "no CUDA GPU"),
    (dict(suites=["kda"], device="cpu"), "needs a GPU"),
    (dict(suites=["smoke"], mode="sideways"), "--mode"),
    (dict(suites=["kda"], impls=["fla"]), "none of the requested impls runs on CPU"),
])
def test_plan_errors(kwargs, match):
    with pytest.raises(BenchError, match=match):
        resolve_plan(cuda_available=False, **kwargs)


def test_parse_impls():
    assert parse_impls("fla, ref,fla") == ["fla", "ref"]
    assert parse_impls(None) is None
    with pytest.raises(BenchError, match="unknown impl 'triton'"):
        parse_impls("fla,triton")


def test_canonical_command(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("CULA_", "FLA_")):
            monkeypatch.delenv(name)
    plan = resolve_plan(["kda"], "both", ["fla", "ref"], "auto", cuda_available=True)
    assert canonical_command(plan, TimingSettings(), quick=False) == "cula bench --suite kda --mode both --impl fla,ref"
    assert canonical_command(plan, TimingSettings(max_time_s=0.5), quick=False).endswith("--max-time 0.5")
    # knobs that change what runs lead the command; labels (the git sha) and FLA's pinned flag do not
    monkeypatch.setenv("CULA_KERNELS", "kda_fwd")
    monkeypatch.setenv("CULA_KDA_RECUR_VARIANT", "v1")
    monkeypatch.setenv("CULA_GIT_SHA", "abc")
    monkeypatch.setenv("FLA_FLASH_KDA", "0")
    monkeypatch.setenv("CULA_AOT_DIR", "/work/x/.device/aot")  # prebuilt modules of the same kernels
    assert canonical_command(plan, TimingSettings(), quick=False) == (
        "CULA_KDA_RECUR_VARIANT=v1 CULA_KERNELS=kda_fwd cula bench --suite kda --mode both --impl fla,ref")


def test_stored_commands_lose_their_labels():
    from cula.bench.fingerprint import without_labels

    stored = "CULA_AOT_DIR=/work/main/.device/aot CULA_KERNELS=kda_fwd_train cula bench --suite kda --max-time 0.2"
    assert without_labels(stored) == "CULA_KERNELS=kda_fwd_train cula bench --suite kda --max-time 0.2"
    assert without_labels("cula bench --suite kda --impl a=b") == "cula bench --suite kda --impl a=b"


def test_percentiles_and_cpu_timer():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 20) == pytest.approx(1.8)
    t = summarize([5.0, 1.0, 3.0])
    assert (t.median_ms, t.reps) == (3.0, 3)
    calls = []
    timing = Timer("cpu", TimingSettings(max_reps=7, min_reps=2, max_time_s=10)).eager(lambda: calls.append(1))
    assert timing.reps == 7 and timing.median_ms >= 0 and len(calls) >= 8


def test_event_ms_brackets_one_call(monkeypatch):
    """event_ms records its start event, calls fn once, records and waits for the end event, and returns the
    events' elapsed time (fake events on the CPU: the order is what is checked)."""
    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.name = "start" if not any(isinstance(x, Event) for x in log) else "end"
            log.append(self)

        def record(self):
            log.append(f"record {self.name}")

        def synchronize(self):
            log.append(f"sync {self.name}")

        def elapsed_time(self, end):
            log.append(f"elapsed {self.name}->{end.name}")
            return 2.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    assert event_ms(lambda: log.append("fn")) == 2.5
    assert [x for x in log if isinstance(x, str)] == ["record start", "fn", "record end", "sync end",
                                                      "elapsed start->end"]


def test_timer_refuses_an_unknown_flush():
    with pytest.raises(ValueError, match="flush: expected one of"):
        Timer("cpu", TimingSettings(flush="sideways"))


def test_counting_formulas():
    # KDA prefill B1 T64 H=HV=1 K=V=2 bf16 with state: q,k,v,g 4*64*2*2 B, beta 64*2, params 4+8,
    # o 64*2*2, h0 + ht 2*4*4
    w = counting.count("kda", "prefill", B=1, T=64, H=1, HV=1, K=2, V=2, dtype="bfloat16", num_seqs=1, state=True)
    assert w.bytes == 4 * 64 * 2 * 2 + 64 * 2 + 12 + 64 * 2 * 2 + 2 * 16
    C = 64
    per_chunk = 6 * C * C * 2 + 4 * C * C * 2 + (2 / 3) * C ** 3 + 6 * C * 2 * 2
    assert w.flops == pytest.approx(per_chunk)
    big = counting.count("kda", "prefill", B=2, T=8192, H=64, HV=64, K=128, V=128, dtype="bfloat16", num_seqs=2, state=True)
    half = counting.count("kda", "prefill", B=1, T=8192, H=64, HV=64, K=128, V=128, dtype="bfloat16", num_seqs=1, state=True)
    params = 64 * 4 + 64 * 128 * 4  # A_log, dt_bias: read once whatever the batch
    assert big.flops == pytest.approx(2 * half.flops) and big.bytes == 2 * half.bytes - params
    dec = counting.count("lightning", "decode", B=8, T=1, H=8, HV=8, K=128, V=128, dtype="bfloat16", num_seqs=8, state=True)
    assert dec.bytes > 2 * 8 * 8 * 128 * 128 * 4  # the state round trip dominates decode traffic
    tr = counting.count("gla", "train", B=1, T=128, H=2, HV=2, K=8, V=8, dtype="bfloat16", num_seqs=1, state=False)
    fw = counting.count("gla", "prefill", B=1, T=128, H=2, HV=2, K=8, V=8, dtype="bfloat16", num_seqs=1, state=False)
    assert tr.flops == pytest.approx(3 * fw.flops) and tr.bytes > 2 * fw.bytes
    with pytest.raises(ValueError, match="variant"):
        counting.count("rwkv", "prefill", B=1, T=1, H=1, HV=1, K=1, V=1, dtype="bfloat16", num_seqs=1, state=False)


def test_inputs_are_seeded_and_shaped():
    cfg = [c for c in load_suite("smoke").configs if c.variant == "kda" and c.mode == "varlen"][0]
    a, b = build_inputs(cfg, "cpu"), build_inputs(cfg, "cpu")
    assert torch.equal(a.tensors["q"], b.tensors["q"]) and torch.equal(a.h0, b.h0)
    assert a.tensors["q"].shape == (1, cfg.T, cfg.H, cfg.K) and a.tensors["g"].shape == (1, cfg.T, cfg.HV, cfg.K)
    assert a.cu_seqlens.tolist() == [0, *torch.tensor(cfg.lengths).cumsum(0).tolist()]
    assert a.h0.shape == (cfg.n_seqs, cfg.HV, cfg.K, cfg.V) and a.h0.dtype == torch.float32
    kw = op_kwargs(a, "fla")
    assert kw["use_gate_in_kernel"] and kw["lower_bound"] == -5.0 and kw["cu_seqlens_cpu"] is a.cu_seqlens_cpu
    assert op_kwargs(a, "ref")["dtype"] == torch.float32


def test_fit_kwargs_refuses_to_drop_a_flag():
    def op(q, k, v, scale=None):
        return q

    assert fit_kwargs(op, {"q": 1, "k": 2, "v": 3, "cu_seqlens_cpu": None, "safe_gate": False}) == {"q": 1, "k": 2, "v": 3}
    with pytest.raises(Unavailable, match="safe_gate=True"):
        fit_kwargs(op, {"q": 1, "k": 2, "v": 3, "safe_gate": True})


def test_fla_and_cula_kwargs_bind_to_the_real_signatures():
    """Every op the fla/cula/ref impls call accepts the arguments the runner builds (checked by
    binding to inspect.signature on CPU, since the Triton kernels themselves need a GPU)."""
    import inspect

    from cula.bench.impls import OPS, _load, kind_of

    seen = set()
    for cfg in load_suite("smoke").configs:
        key = (cfg.variant, kind_of(cfg.phase), cfg.mode)
        if key in seen:
            continue
        seen.add(key)
        inputs = build_inputs(cfg, "cpu")
        for impl, api in (("fla", "fla"), ("cula", "public"), ("ref", "ref")):
            module, name = OPS[(cfg.variant, kind_of(cfg.phase))][impl]
            fn = _load(module, name)
            kw = fit_kwargs(fn, op_kwargs(inputs, api))
            inspect.signature(fn).bind(**kw)  # raises TypeError on a wrong name
            if impl == "fla" and cfg.variant == "lightning":
                assert torch.equal(kw["g_gamma"], -inputs.tensors["decay"])
            if cfg.variant == "kda" and impl != "ref" and kind_of(cfg.phase) == "decode":
                assert "safe_gate" not in kw  # fused_recurrent_* bound the gate by lower_bound alone
    assert len(seen) >= 6


def test_error_metrics_slice_by_slice(monkeypatch):
    from cula.bench import correctness as c

    monkeypatch.setattr(c, "_SLICE", 7)  # force many slices on a small tensor
    x = torch.randn(5, 13, dtype=torch.float64)
    r = x + 0.01 * torch.randn(5, 13, dtype=torch.float64)
    assert c.rel_l2(x, r) == pytest.approx(((x - r).norm() / r.norm()).item(), rel=1e-12)
    assert c.max_abs(x, r) == pytest.approx((x - r).abs().max().item())
    x[2, 3] = float("nan")
    assert math.isnan(c.rel_l2(x, r)) and math.isnan(c.max_abs(x, r))
    ok, why = c.verdict(c.compare((x, None, None), (r, None, None)), {"o": 1e-2})
    assert not ok and "o rel-L2 nan" in why
    with pytest.raises(ValueError, match="shape mismatch"):
        c.rel_l2(x, r[:2])


# --- the oracle's out-of-memory retry -----------------------------------------------------------------
def _flaky_oracle(failures, message="CUDA out of memory. Tried to allocate 5.13 GiB"):
    calls = []

    def oracle(inputs):
        calls.append(inputs)
        if len(calls) <= failures:
            raise RuntimeError(message)
        return ("outputs", "name")

    return oracle, calls


def test_oracle_out_of_memory_is_retried_once_after_freeing(monkeypatch):
    import torch

    from cula.bench import runner

    freed = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(1))
    oracle, calls = _flaky_oracle(1)
    assert runner._oracle_with_retry(oracle, "inp", "cuda") == ("outputs", "name")
    assert len(calls) == 2 and freed


def test_oracle_second_out_of_memory_names_the_memory_in_use(monkeypatch):
    import torch

    from cula.bench import runner

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 36 * 2**30)
    oracle, calls = _flaky_oracle(2)
    with pytest.raises(RuntimeError, match=r"138.0 GiB in use, 36.0 GiB held by torch tensors"):
        runner._oracle_with_retry(oracle, "inp", "cuda")
    assert len(calls) == 2


@pytest.mark.parametrize("device, message", [("cuda", "shape mismatch"), ("cpu", "CUDA out of memory")])
def test_oracle_other_errors_and_cpu_runs_are_not_retried(device, message):
    from cula.bench import runner

    oracle, calls = _flaky_oracle(1, message)
    with pytest.raises(RuntimeError, match=message):
        runner._oracle_with_retry(oracle, "inp", device)
    assert len(calls) == 1


def test_failed_capture_releases_its_memory_pool(monkeypatch):
    """A capture that fails (host sync inside the op) hands its private memory pool back: otherwise
    every failed capture keeps what the op allocated while being captured (the growth that made the
    fp32 oracle run out of memory in the varlen rows of the 2026-12-03 kda run). No GPU: torch.cuda's
    pieces are stand-ins that record what the timer does."""
    import contextlib

    import torch

    from cula.bench import timing
    from cula.bench.timing import Timer

    released, emptied, rng_reset, restored = [], [], [], []

    class FakeGraph:
        def pool(self):  # torch refuses pool() after a failed capture
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")

    class FakeStream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def fake_graph_ctx(graph, pool=None):
        assert pool == (7, 3), "the capture must allocate from the pool the timer releases"
        yield  # the op inside raises, as a host sync during capture does

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (7, 3))
    monkeypatch.setattr(torch.cuda, "graph", fake_graph_ctx)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda dev, pool: released.append((dev, pool)),
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                        lambda dev, pool: released.append(("end", dev, pool)), raising=False)
    monkeypatch.setattr(timing, "_end_generator_capture", lambda: rng_reset.append(True))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: restored.append(s))
    calls = []

    def op():
        calls.append(1)
        if len(calls) > 2:  # the two warm-up calls pass, the captured one syncs the host
            raise RuntimeError("operation not permitted when stream is capturing")

    t = Timer("cuda", TimingSettings()).graph(op)
    assert math.isnan(t.median_ms) and t.note.startswith("capture failed")
    # the pool's allocation routing is ended (capture_end raised before doing it), then the pool released
    assert released == [("end", 0, (7, 3)), (0, (7, 3))] and emptied
    assert rng_reset, "the CUDA RNG must be taken out of capture mode, or the next randn raises"
    assert len(restored) == 1 and isinstance(restored[0], FakeStream), "the caller's stream is current again"

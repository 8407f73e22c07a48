"""Lockstep (kda_fwd.LOCKSTEP, session 41): stage 2 on a few SMs beside stage 1, each chunk waited for by its flag.

CPU: the launch-order table follows every stage-2 CTA's consumption order; the host path (buffers, keys, streams,
the first pair in sequence); the kernels' PTX (release store, acquire polls, no spills). GPU (``-m gpu``): o and
the final state bitwise those of the sequential launch, several CTA counts, twice, and inside a CUDA graph.
"""

from __future__ import annotations

import re

import pytest
import torch

from _kda_host import record_allocations, record_kda_launches
from cula.kernels.sm90 import kda_fwd
from cula.kernels.sm90.kda_fwd_check import LOCKSTEP_CASES


def _decode(order: torch.Tensor) -> list[tuple[int, int]]:
    return [((int(c) >> 16) & 0xFFFF, int(c) & 0xFFFF) for c in order]


def test_order_codes_past_2_15_chunks():
    """Chunk indices of 2^15 and more (the stage-1 grid allows NC up to 65,535) fill the int32's sign bit: they
    decode back, with the mask KdaFwdIntraTC.my_coords applies."""
    order = kda_fwd.lockstep_order(1, 40000, 2, 2, "cpu")
    assert order.dtype == torch.int32 and int(order.min()) < 0
    assert sorted(_decode(order)) == [(c, h) for c in range(40000) for h in range(2)]


@pytest.mark.parametrize("B, ncs, HV, ctas", [(1, 5, 4, 4), (2, 7, 3, 4), (2, 3, 64, 40), (3, 4, 5, 6),
                                              (1, 9, 2, 8), (2, 2, 2, 2)])
def test_order_follows_each_stage2_cta(B, ncs, HV, ctas):
    """Every (chunk, head) launched once, and each stage-2 CTA's chunks (its items b, b + ctas, ..., each walked
    first chunk to last) launched in the order the CTA reads them; a round of ctas / 2 pairs goes chunk by chunk."""
    order = _decode(kda_fwd.lockstep_order(B, ncs, HV, ctas, "cpu"))
    nc = B * ncs
    assert sorted(order) == sorted((c, h) for c in range(nc) for h in range(HV))
    pos = {ch: i for i, ch in enumerate(order)}
    items = 2 * B * HV
    for b in range(min(ctas, items)):
        seen = []
        for item in range(b, items, ctas):
            pair = item // 2
            hv, seq = pair % HV, pair // HV
            seen += [pos[(seq * ncs + j, hv)] for j in range(ncs)]
        assert seen == sorted(seen), b
    g = ctas // 2  # round r's chunk j comes before its chunk j + 1 for every pair of the round
    for r in range(0, B * HV, g):
        pairs = range(r, min(r + g, B * HV))
        for j in range(ncs - 1):
            last_j = max(pos[((p // HV) * ncs + j, p % HV)] for p in pairs)
            first_next = min(pos[((p // HV) * ncs + j + 1, p % HV)] for p in pairs)
            assert last_j < first_next


def test_ctas_even_bounded(monkeypatch):
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_CTAS", 41)
    assert kda_fwd.lockstep_ctas(64, 132) == 40
    assert kda_fwd.lockstep_ctas(3, 132) == 6  # one CTA a work item
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_CTAS", 100)
    assert kda_fwd.lockstep_ctas(128, 132) == 66  # half the SMs: stage 1 keeps the rest
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_CTAS", 1)
    assert kda_fwd.lockstep_ctas(128, 132) == 2


class _Stream:
    def __init__(self, handle: int, log: list):
        self.cuda_stream, self.log = handle, log

    def wait_stream(self, other):
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


def _suite_case(B=2, T=300, H=4):
    g = torch.Generator().manual_seed(0)
    q, k, v, gate = (torch.randn(B, T, H, 128, generator=g).bfloat16() for _ in range(4))
    beta = torch.randn(B, T, H, generator=g).bfloat16()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=torch.randn(H, generator=g), dt_bias=torch.randn(H * 128, generator=g), lower_bound=-5.0,
              safe_gate=True, initial_state=torch.zeros(B, H, 128, 128), output_final_state=True)
    return (q, k, v, gate, beta), kw


def test_host_path(monkeypatch):
    """LOCKSTEP on a fixed-length call: γ's buffer carries the zeroed flags and the launch order; stage 1 is built with
    ``lockstep`` and stage 2 with ``wait_flags`` on LOCKSTEP_CTAS CTAs. The first call launches stage 1 then stage 2
    on the caller's stream (lazy module loads); the next, stage 2 first on its own stream (after it waits for the
    caller's), then stage 1, then the caller's stream waits for stage 2. Varlen, short inputs and return_scratch
    keep the sequential launch and the default keys."""
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_recur as recur

    calls = record_kda_launches(monkeypatch)
    launchers: dict = {}  # one launcher per key, as kda_fwd's own cache gives (the pairs are launcher objects)
    recorded = kda_fwd._launcher
    monkeypatch.setattr(kda_fwd, "_launcher", lambda kind, key, *a: launchers.setdefault(
        (kind, key), recorded(kind, key, *a)))
    allocs = record_allocations(monkeypatch)
    log: list = []
    main = _Stream(1234, log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: _Stream(777, log))
    monkeypatch.setattr(kda_fwd, "_LOCKSTEP_STREAMS", {})
    monkeypatch.setattr(kda_fwd, "_LOCKSTEP_LOADED", set())
    monkeypatch.setattr(kda_fwd, "_LOCKSTEP_ORDERS", {})
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_CTAS", 4)
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_MIN_STAGE1_CTAS", 0)
    args, kw = _suite_case()
    kda_fwd.kda_fwd(*args, **kw)  # sequential: LOCKSTEP off
    default = [(kind, key) for kind, key, _, _ in calls]
    calls.clear()
    monkeypatch.setattr(kda_fwd, "LOCKSTEP", True)
    for _ in range(2):
        allocs.clear()
        kda_fwd.kda_fwd(*args, **kw)
    (k1, key1, _, v1), (k2, key2, _, v2), (k3, key3, _, v3), (k4, key4, _, v4) = calls
    assert (k1, k2, k3, k4) == ("intra_tc", "recur", "recur", "intra_tc")
    assert dict(key1[0])["lockstep"] is True and dict(key2[0])["wait_flags"] is True and key2[4] is False  # no PDL
    assert {n: x for n, x in dict(key1[0]).items() if n != "lockstep"} == dict(default[0][1][0])
    assert v1[-1] == 1234 and v2[-1] == 1234 and v3[-1] == 777 and v4[-1] == 1234
    assert v2[-2] == 4 and v3[-2] == 4  # stage 2's CTAs
    assert log == [("wait", 777, 1234), ("wait", 1234, 777)]
    HV, NC = 4, 2 * 5
    gam = next(t for t in allocs if t.data_ptr() == v4[13])
    pitch = recur.GAM_PITCH_PACK if dict(key1[0]).get("pack") else 128
    assert gam.numel() == HV * NC * pitch + 2 * HV * NC  # γ, then the flags and the order
    tail = gam[HV * NC * pitch:].view(torch.int32)
    assert torch.equal(tail[:HV * NC], torch.zeros(HV * NC, dtype=torch.int32))
    assert torch.equal(tail[HV * NC:], kda_fwd.lockstep_order(2, 5, HV, 4, "cpu"))
    calls.clear()
    cu = torch.tensor([0, 250, 600], dtype=torch.int32)
    flat = tuple(x.reshape(1, 600, *x.shape[2:]) for x in args)
    kda_fwd.kda_fwd(*flat, **{**kw, "initial_state": torch.zeros(2, 4, 128, 128)}, cu_seqlens=cu)  # varlen
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_MIN_STAGE1_CTAS", 10 ** 6)
    kda_fwd.kda_fwd(*args, **kw)  # short
    assert [k for k, _, _, _ in calls] == ["intra_tc", "recur"] * 2
    assert all("lockstep" not in dict(key[0]) and "wait_flags" not in dict(key[0]) for _, key, _, _ in calls)


def test_kernels_refuse_what_they_cannot_do():
    pytest.importorskip("cutlass")
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc
    from cula.kernels.sm90 import kda_fwd_recur as recur

    flags = dict(use_qk_l2norm=True, has_a_log=True, has_dt_bias=True, use_beta_sigmoid=True, allow_neg_eigval=False,
                 group=1)
    with pytest.raises(ValueError, match="lockstep"):
        intra_tc.KdaFwdIntraTC(**flags, lockstep=True, diag=("clock",))
    with pytest.raises(ValueError, match="lockstep"):
        intra_tc.KdaFwdIntraTC(**flags, lockstep=True, order="chunk")
    with pytest.raises(ValueError, match="wait_flags"):
        recur.KdaFwdRecur(True, True, False, variant="v1", wait_flags=True)


def test_ptx():
    """Stage 1 with ``lockstep`` stores its flag with release semantics (one st.release.gpu) after waiting for its bulk
    stores' writes; stage 2 with ``wait_flags`` polls with acquire loads, backs off with nanosleep and can trap; both
    without spills or local memory, at the default's registers bound."""
    pytest.importorskip("cutlass")
    from cula.kernels.common.ptx_check import ptx_reports

    s1 = ptx_reports("cula.kernels.sm90.kda_fwd_intra_tc", ["t_out_block32_pack_x_ctas3_lockstep"])
    s2 = ptx_reports("cula.kernels.sm90.kda_fwd_recur", ["v2_t_in_pack_x_wait"])
    (r1,), (r2,) = s1.values(), s2.values()
    for r in (r1, r2):
        assert not isinstance(r, Exception), r
        assert all(k.spill_store_bytes == 0 and k.spill_load_bytes == 0 for k in r.kernels)
        assert ".local" not in r.ptx
    assert r1.ptx.count("st.release.gpu.global.u32") == 1 and "cp.async.bulk.wait_group 0;" in r1.ptx
    assert re.search(r"shr\.u32\s+%r\d+, %r\d+, 16;", r1.ptx)  # the table's chunk: a logical shift (codes < 0)
    assert all(k.registers <= 168 for k in r1.kernels)  # three CTAs an SM still fit
    assert "ld.acquire.gpu.global.u32" in r2.ptx and "nanosleep.u32" in r2.ptx and "trap;" in r2.ptx


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B, T, H, HV, ctas", LOCKSTEP_CASES)
def test_gpu_bitwise_equals_sequential(B, T, H, HV, ctas, monkeypatch):
    """o and the final state under LOCKSTEP (the first call sequential, the next ones overlapped) are bitwise the
    sequential launch's, with and without a state; and inside a CUDA graph, whose launch order is not cached."""
    from cula.kernels.sm90 import kda_fwd_check as chk

    monkeypatch.setattr(kda_fwd, "LOCKSTEP_MIN_STAGE1_CTAS", 0)
    monkeypatch.setattr(kda_fwd, "LOCKSTEP_CTAS", ctas)
    args, kw = chk.lockstep_inputs(B, T, H, HV, torch.device("cuda"))
    for state in (kw, {**kw, "initial_state": None, "output_final_state": False}):
        monkeypatch.setattr(kda_fwd, "LOCKSTEP", False)
        o_ref, ht_ref = kda_fwd.kda_fwd(*args, **state)
        monkeypatch.setattr(kda_fwd, "LOCKSTEP", True)
        for _ in range(3):
            o, ht = kda_fwd.kda_fwd(*args, **state)
            torch.cuda.synchronize()
            assert torch.equal(o, o_ref)
            assert (ht is None and ht_ref is None) or torch.equal(ht, ht_ref)
    monkeypatch.setattr(kda_fwd, "_LOCKSTEP_ORDERS", {})  # the order then built inside the capture, not cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = kda_fwd.kda_fwd(*args, **state)
    assert not kda_fwd._LOCKSTEP_ORDERS  # (its memory is the graph's pool)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_ref)


def test_model_bounds():
    """kda_fwd_profile.lockstep_model: with stage 2 free the end is stage 1's waves on the slots left to it; with stage
    1 free it is the steps of the busiest stage-2 CTA; a stage 2 slower than stage 1 keeps more hand-off alive."""
    from cula.kernels.sm90.kda_fwd_profile import lockstep_model

    B, T, HV, ctas = 2, 64 * 10, 8, 6  # 160 stage-1 CTAs, 32 items of 10 chunks on 6 CTAs
    r = lockstep_model(B, T, HV, ctas, t2_us=1e-6, life_us=10.0, sms=10, per_sm=2)  # 8 slots: 20 waves
    assert r["stage1_end_ms"] == pytest.approx(20 * 10.0 / 1e3) and r["end_ms"] == pytest.approx(0.2, rel=1e-6)
    r = lockstep_model(B, T, HV, ctas, t2_us=1.0, life_us=1e-6, sms=10, per_sm=2)
    assert r["end_ms"] == pytest.approx(6 * 10 * 1.0 / 1e3, rel=1e-3)  # ceil(32 / 6) = 6 items of 10 steps
    slow = lockstep_model(B, T, HV, ctas, t2_us=5.0, life_us=10.0, sms=10, per_sm=2)
    fast = lockstep_model(B, T, HV, ctas, t2_us=0.1, life_us=10.0, sms=10, per_sm=2)
    assert slow["peak_mb"] > fast["peak_mb"]

"""One KDA forward call with the `kda` suite's flags, for a profiler to attach to (no timing loop).

    ncu --clock-control none -k regex:<kernel name part> --launch-count 1 \\
        python3 -m cula.kernels.sm90.kda_fwd_profile [--B 1] [--T 4096] [--H 64] [--stage intra|recur|both]
            [--dist uniform --n 20]

``--dist`` / ``--n`` make it a varlen call of ``n`` sequences over ``T`` tokens with the suite's lengths
(`suites/lengths.py`), as the `kda` suite's varlen rows.

``--l2-premise`` (timing, no profiler): stage 2 alone on a few CTAs, its inputs in L2 or flushed out of it
(:func:`l2_premise`).
"""

from __future__ import annotations

import argparse

import torch


def suite_call(B: int, T: int, H: int, dist: str | None = None, n: int = 20, dev: str = "cuda"):
    """``(args, kwargs)`` of one ``kda_fwd`` call with the `kda` suite's flags: bf16 q, k, v, raw gate [B, T, H, 128],
    beta logits [B, T, H], A_log / dt_bias, lower bound -5, zero fp32 initial states and the final state; with
    ``dist``, ``n`` sequences packed over ``T`` tokens (B = 1) with the suite's lengths."""
    from cula.suites.lengths import cu_seqlens_from_lengths, varlen_lengths

    dev = torch.device(dev)
    cu = None
    if dist is not None:
        B = 1
        cu = torch.tensor(cu_seqlens_from_lengths(varlen_lengths(dist, n, T)), device=dev, dtype=torch.int32)
    n_state = B if cu is None else cu.numel() - 1
    q, k, v, g = (torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=torch.randn(H, device=dev), dt_bias=torch.randn(H * 128, device=dev) * 0.1,
              lower_bound=-5.0, safe_gate=True, initial_state=torch.zeros(n_state, H, 128, 128, device=dev),
              output_final_state=True, cu_seqlens=cu)
    return (q, k, v, g, beta), kw


#: (B, T, H, CTAs) of ``l2_premise``: two small calls whose stage-2 bytes (~23 MB) fit the 50 MB L2, on as many
#: CTAs as items (one item a CTA) and on fewer (several items a CTA), then the issue's bar row on all SMs and on 40
PREMISE_ROWS = ((1, 2048, 8, 16), (1, 2048, 8, 4), (1, 8192, 2, 4), (1, 8192, 2, 1), (2, 16384, 64, 132),
                (2, 16384, 64, 40))


def l2_premise(rows=PREMISE_ROWS, reps: int = 20) -> list[dict]:
    """What a stage-2 chunk costs a CTA when its inputs come from L2 (session 41's premise for running stage 2
    beside stage 1, chunk by chunk, so the hand-off never leaves L2). Per row: stage 2 alone (``stages=("recur",)``
    on the scratch of a full call), its persistent grid capped at ``CTAs`` (``kda_fwd.sm_count`` patched), timed
    per launch by events, median of ``reps``: *cold* after an L2 flush, *warm* right after an untimed launch on
    the same buffers (what it reads is then in L2 where it fits). ``us/step`` is the time over the chunks one CTA
    walks (items x chunks / CTAs)."""
    from cula.kernels.sm90 import kda_fwd as kf

    flush = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    saved = kf.sm_count
    out = []
    try:
        for B, T, H, ctas in rows:
            args, kw = suite_call(B, T, H)
            kf.kda_fwd(*args, **kw)  # compile / load, and leave the scratch this row's stage 2 reads
            kf.sm_count = lambda device, n=ctas: n
            items, chunks = 2 * B * H, T // 64

            def stage2():
                kf.kda_fwd(*args, **kw, stages=("recur",))

            times = {"cold": [], "warm": []}
            stage2()
            for _ in range(reps):
                for mode in times:
                    if mode == "cold":
                        flush.zero_()
                    else:
                        stage2()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    stage2()
                    b.record()
                    torch.cuda.synchronize()
                    times[mode].append(a.elapsed_time(b))
            kf.sm_count = saved
            row = dict(B=B, T=T, H=H, ctas=min(ctas, items), items=items, chunks=chunks)
            steps = items * chunks / row["ctas"]
            for mode, t in times.items():
                ms = sorted(t)[len(t) // 2]
                row[f"{mode}_ms"], row[f"{mode}_us_per_step"] = ms, 1e3 * ms / steps
            print("[l2_premise] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items()), flush=True)
            out.append(row)
    finally:
        kf.sm_count = saved
    return out


#: A stage-1 CTA's life at three CTAs per SM on the H100 (B2 T16384: 1.309 ms for 32,768 CTAs in 396 slots, session
#: 40) and the hand-off bytes of one (chunk, head): qg, kgᵀ, −X (48 KB), the packed [Aqk | T'] (8 KB), γ's row
STAGE1_LIFE_US = 15.8
HANDOFF_BYTES = 3 * 64 * 128 * 2 + 64 * 64 * 2 + 160 * 4


def lockstep_model(B: int, T: int, HV: int, ctas: int, t2_us: float, life_us: float = STAGE1_LIFE_US,
                   sms: int = 132, per_sm: int = 3) -> dict:
    """Event model of LOCKSTEP (kda_fwd.lockstep_order) on the CPU: stage 1's CTAs start in launch order on the
    (sms - ctas) * per_sm slots left by stage 2, each living ``life_us``; stage 2's CTA b walks its items b, b + ctas,
    ... chunk by chunk, a step taking ``t2_us`` once the chunk's flag is set. Returns the end (us), stage 1's end,
    stage 2's waiting share and the most hand-off bytes alive (written, not yet read by both V tiles): what must
    stay in L2 for stage 2 to read it there."""
    import heapq

    from cula.kernels.sm90.kda_fwd import lockstep_order

    ncs = -(-T // 64)
    order = lockstep_order(B, ncs, HV, ctas, "cpu").tolist()
    slots = [0.0] * ((sms - ctas) * per_sm)
    done = {}
    for code in order:  # the earliest free slot takes the next CTA
        start = heapq.heappop(slots)
        done[((code >> 16) & 0xFFFF, code & 0xFFFF)] = start + life_us
        heapq.heappush(slots, start + life_us)
    items = 2 * B * HV
    read = {}
    wait = end = 0.0
    for b in range(min(ctas, items)):
        t = 0.0
        for item in range(b, items, ctas):
            pair = item // 2
            hv, seq = pair % HV, pair // HV
            for j in range(ncs):
                ready = done[(seq * ncs + j, hv)]
                wait += max(0.0, ready - t)
                t = max(t, ready) + t2_us
                key = (seq * ncs + j, hv)
                read[key] = max(read.get(key, 0.0), t)
        end = max(end, t)
    events = sorted([(w, 1) for w in done.values()] + [(r, -1) for r in read.values()])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    stage1_end = max(done.values())
    return dict(B=B, T=T, HV=HV, ctas=ctas, t2_us=t2_us, end_ms=max(end, stage1_end) / 1e3,
                stage1_end_ms=stage1_end / 1e3, stage2_wait=wait / (min(ctas, items) * max(end, 1e-9)),
                peak_mb=peak * HANDOFF_BYTES / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--stage", default="both", choices=("intra", "recur", "both"))
    ap.add_argument("--dist", default=None, help="varlen: uniform, random or skewed lengths")
    ap.add_argument("--n", type=int, default=20, help="varlen: number of sequences")
    ap.add_argument("--l2-premise", action="store_true", help="time stage 2 on few CTAs, inputs in L2 or not")
    ap.add_argument("--lockstep-model", action="store_true", help="CPU: LOCKSTEP's event model by CTAs and t2")
    a = ap.parse_args()
    if a.l2_premise:
        l2_premise()
        return
    if a.lockstep_model:
        for t2 in (0.7, 1.0, 1.5, 2.1):
            for ctas in (24, 32, 40, 48, 56, 66):
                r = lockstep_model(a.B, a.T, a.H, ctas, t2)
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        return
    from cula.kernels.sm90.kda_fwd import kda_fwd

    args, kw = suite_call(a.B, a.T, a.H, a.dist, a.n)
    stages = ("intra", "recur") if a.stage == "both" else (a.stage,)
    for _ in range(2):
        kda_fwd(*args, **kw, stages=stages)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

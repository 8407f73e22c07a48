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
    from cula.bench.timing import event_ms
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
                    times[mode].append(event_ms(stage2))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--stage", default="both", choices=("intra", "recur", "both"))
    ap.add_argument("--dist", default=None, help="varlen: uniform, random or skewed lengths")
    ap.add_argument("--n", type=int, default=20, help="varlen: number of sequences")
    ap.add_argument("--l2-premise", action="store_true", help="time stage 2 on few CTAs, inputs in L2 or not")
    a = ap.parse_args()
    if a.l2_premise:
        l2_premise()
        return
    from cula.kernels.sm90.kda_fwd import kda_fwd

    args, kw = suite_call(a.B, a.T, a.H, a.dist, a.n)
    stages = ("intra", "recur") if a.stage == "both" else (a.stage,)
    for _ in range(2):
        kda_fwd(*args, **kw, stages=stages)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

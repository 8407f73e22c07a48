"""One KDA forward call with the `kda` suite's flags, for a profiler to attach to (no timing loop).

    ncu --clock-control none -k regex:<kernel name part> --launch-count 1 \\
        python3 -m cula.kernels.sm90.kda_fwd_profile [--B 1] [--T 4096] [--H 64] [--stage intra|recur|both]
            [--dist uniform --n 20]

``--dist`` / ``--n`` make it a varlen call of ``n`` sequences over ``T`` tokens with the suite's lengths
(`suites/lengths.py`), as the `kda` suite's varlen rows.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--stage", default="both", choices=("intra", "recur", "both"))
    ap.add_argument("--dist", default=None, help="varlen: uniform, random or skewed lengths")
    ap.add_argument("--n", type=int, default=20, help="varlen: number of sequences")
    a = ap.parse_args()
    from cula.kernels.sm90.kda_fwd import kda_fwd

    args, kw = suite_call(a.B, a.T, a.H, a.dist, a.n)
    stages = ("intra", "recur") if a.stage == "both" else (a.stage,)
    for _ in range(2):
        kda_fwd(*args, **kw, stages=stages)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Per-phase GPU time of one rank's context-parallel work, on one GPU and without a process group.

    python -m cula.cp.phases --T 65536 --H 16          # a rank's piece of T tokens (one sequence)

What a middle or last rank does besides the plain local forward, each phase timed alone with CUDA events
(median of ``--reps``, after warm-up): Lightning's forward with its final state and the closed-form
correction ``o += w_t q_t h0``; KDA's forward with the kernel's identity response (the second stage-2
pass on a side stream), each stage alone, and the correction ``o += o_I h0``. The multi-GPU script times
the whole; this says where the difference between CP and the plain local forward goes.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from cula.bench.timing import event_ms


def _median_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = sorted(event_ms(fn) for _ in range(reps))
    return times[len(times) // 2]


def lightning_phases(T: int, H: int, D: int, reps: int) -> dict[str, float]:
    from cula.cp._local import add_state_product
    from cula.cp.multigpu import make_inputs
    from cula.lightning import lightning_attn_fwd

    dev = torch.device("cuda")
    x = make_inputs("lightning", T, H, D, D, torch.bfloat16, dev, seed=0)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    h0 = torch.randn(H, D, D, device=dev) * 0.01
    o, _ = lightning_attn_fwd(**x, cu_seqlens=cu, output_final_state=True)
    steps = torch.arange(1, T + 1, device=dev, dtype=torch.float32)
    weight = D ** -0.5 * torch.exp(-x["decay"][None, :] * steps[:, None])
    return {
        "forward": _median_ms(lambda: lightning_attn_fwd(**x, cu_seqlens=cu), reps),
        "forward, final state": _median_ms(lambda: lightning_attn_fwd(**x, cu_seqlens=cu, output_final_state=True),
                                           reps),
        "correction o + w q h0": _median_ms(lambda: add_state_product(o, x["q"][0], h0, weight), reps),
    }


def kda_phases(T: int, H: int, D: int, reps: int) -> dict[str, float]:
    from cula.cp._local import add_state_product
    from cula.cp.multigpu import make_inputs
    from cula.kernels.sm90.kda_fwd import kda_fwd

    dev = torch.device("cuda")
    x = make_inputs("kda", T, H, D, D, torch.bfloat16, dev, seed=0)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    h0 = torch.randn(H, D, D, device=dev) * 0.01
    o, _, o_id, _ = kda_fwd(**x, cu_seqlens=cu, output_final_state=True, identity_response=True)

    def correct():
        return add_state_product(o, o_id[0], h0)

    return {
        "forward": _median_ms(lambda: kda_fwd(**x, cu_seqlens=cu), reps),
        "forward, final state": _median_ms(lambda: kda_fwd(**x, cu_seqlens=cu, output_final_state=True), reps),
        "forward + identity response": _median_ms(
            lambda: kda_fwd(**x, cu_seqlens=cu, output_final_state=True, identity_response=True), reps),
        "stage 1 alone": _median_ms(lambda: kda_fwd(**x, cu_seqlens=cu, stages=("intra",)), reps),
        "stage 2 alone": _median_ms(lambda: kda_fwd(**x, cu_seqlens=cu, output_final_state=True,
                                                    stages=("recur",)), reps),
        "correction o + o_I h0": _median_ms(correct, reps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=lambda s: [int(v) for v in s.split(",")], default=[65536])
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", type=lambda s: s.split(","), default=["lightning", "kda"])
    args = p.parse_args(argv)
    for T in args.T:
        for variant in args.variants:
            phases = (lightning_phases if variant == "lightning" else kda_phases)(T, args.H, args.D, args.reps)
            for name, ms in phases.items():
                print(f"[phase] {variant:9s} T={T:>8d} H={args.H}: {name:30s} {ms:8.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

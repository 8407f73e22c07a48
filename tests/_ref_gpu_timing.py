"""Time the references at the GPU-oracle shape (T=16384, H=64, K=V=128) and compare with FLA's Triton op.

Not a test (not collected): ``PYTHONPATH=. python tests/_ref_gpu_timing.py`` on a CUDA machine.
Prints one line per (variant, form): wall time of one forward, peak memory, and the relative RMS
difference against FLA's bf16 op on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("FLA_FLASH_KDA", "0")

from cula.ref import _core, gdn, kda, lightning  # noqa: E402

DEV = "cuda"


def rms_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def timed(fn, repeat=2):
    fn()  # warm-up (allocator, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / repeat, torch.cuda.max_memory_allocated() / 2**30


def main(T=16384, H=64, K=128, V=128):
    torch.manual_seed(0)
    q = torch.randn(1, T, H, K, device=DEV).bfloat16()
    k = F.normalize(torch.randn(1, T, H, K, device=DEV), dim=-1).bfloat16()
    v = torch.randn(1, T, H, V, device=DEV).bfloat16()
    g_kda = F.logsigmoid(torch.randn(1, T, H, K, device=DEV) + 4.0).bfloat16()
    g_gdn = F.logsigmoid(torch.randn(1, T, H, device=DEV) + 4.0).bfloat16()
    beta = torch.rand(1, T, H, device=DEV).bfloat16()
    decay = torch.rand(H, device=DEV) * 0.1
    with torch.no_grad():
        fla = {}
        if os.environ.get("WITH_FLA") == "1":  # FLA's autotuning costs minutes per new shape
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda
            from fla.ops.simple_gla import chunk_simple_gla

            fla = {
                "kda": chunk_kda(q, k, v, g_kda, beta, output_final_state=True),
                "gdn": chunk_gated_delta_rule(q, k, v, g_gdn, beta, output_final_state=True),
                "lightning": chunk_simple_gla(q, k, v, g_gamma=-decay, output_final_state=True),
            }
        runs = {
            ("lightning", "chunked"): lambda: lightning.chunked(q, k, v, decay, output_final_state=True),
            ("gdn", "chunked"): lambda: gdn.chunked(q, k, v, g_gdn, beta, output_final_state=True),
            ("kda", "chunked"): lambda: kda.chunked(q, k, v, g_kda, beta, output_final_state=True),
            ("gdn", "recurrent"): lambda: gdn.recurrent(q, k, v, g_gdn, beta, output_final_state=True),
        }
        budgets = [int(b) for b in sys.argv[1:]] or [_core.PAIRWISE_BUDGET]
        for i, budget in enumerate(budgets):
            _core.PAIRWISE_BUDGET = budget  # elements per pairwise-decay temporary (KDA only)
            for (name, form), fn in runs.items():
                if i > 0 and name != "kda":
                    continue
                (o, s), sec, gib = timed(fn, repeat=1 if form == "recurrent" else 2)
                vs = ""
                if name in fla:
                    fo, fs = fla[name]
                    vs = f", rms vs fla o={rms_rel(fo, o):.2e} state={rms_rel(fs, s):.2e}"
                print(f"{name:9s} {form:9s} budget=2^{budget.bit_length() - 1} T={T} H={H} K={K}: "
                      f"{sec * 1e3:8.1f} ms, peak {gib:6.1f} GiB{vs}", flush=True)
                del o, s
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""FLA's saved Aqk / Akk against ours, on the CPU: FLA 0.6.0's own Triton intra-chunk kernels run under the
Triton interpreter (a child process with ``TRITON_INTERPRET=1``), our side is the torch model of the
tensor-core stage 1 (``kda_fwd_intra_tc.emulate``, whose ``akk`` is what ``emit_akk`` stores) gathered into
FLA's layout by ``kda_fwd.token_rows``. cula-sm90+fla-bwd hands these two tensors to FLA's backward in
place of its own, so their meaning (scale, β on the rows of A, the unit diagonal of T, which entries are
defined) must be FLA's; the GPU test (tests/test_kda_train.py) checks the kernel against FLA's too.

The interpreter needs three adjustments, made in the child only: one autotune config (it cannot
benchmark), no ``gather`` (a GPU-only intrinsic; FLA has a load fallback) and ieee dot precision (it
lacks bf16x3). A child that cannot set this up (another Triton or FLA version) skips the test with its
error; a mismatch fails it. Only FLA's gate-cumsum and intra kernels are used: its w/u recompute kernel
gives garbage under this interpreter, so nothing else is compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r'''
import json, os, sys
try:
    import torch
    import triton.language as tl
    import triton.runtime.autotuner as at
    _init = at.Autotuner.__init__
    def one_config(self, fn, arg_names, configs, *a, **kw):
        _init(self, fn, arg_names, configs[:1], *a, **kw)
    at.Autotuner.__init__ = one_config
    import warnings
    warnings.simplefilter("ignore")
    import fla.ops.kda.chunk_intra as ci
    ci.IS_GATHER_SUPPORTED = False
    ci.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices
except Exception as exc:
    print(json.dumps({"setup": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)

from cula.kernels.sm90 import kda_fwd
from cula.kernels.sm90 import kda_fwd_intra_tc as tc

out = {}
for name, (H, HV, cu, lb) in {"varlen-zero-gva": (1, 2, [0, 0, 70, 150], -5.0),
                              "T64-lb1": (2, 2, [0, 64], -1.0)}.items():
    gen = torch.Generator().manual_seed(0)
    TT = cu[-1]
    q, k = (torch.randn(1, TT, H, 128, generator=gen).bfloat16() for _ in range(2))
    v, g = (torch.randn(1, TT, HV, 128, generator=gen).bfloat16() for _ in range(2))
    beta = torch.randn(1, TT, HV, generator=gen).bfloat16()
    a_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV * 128, generator=gen) * 0.1
    cu_t = torch.tensor(cu, dtype=torch.int64)
    try:  # FLA's forward up to its intra pass, as chunk_kda runs it (l2norm, gate cumsum, intra)
        ci_idx = prepare_chunk_indices(cu_t, 64)
        qn, _ = l2norm_fwd(q)
        kn, _ = l2norm_fwd(k)
        gk = kda_gate_chunk_cumsum(g=g, A_log=a_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=64,
                                   cu_seqlens=cu_t, chunk_indices=ci_idx, lower_bound=lb)
        bs = torch.sigmoid(beta.float())
        _, _, _, _, aqk_f, akk_f = ci.chunk_kda_fwd_intra(q=qn, k=kn, v=v, gk=gk, beta=bs, scale=128 ** -0.5,
                                                          cu_seqlens=cu_t, chunk_indices=ci_idx,
                                                          safe_gate=True, lower_bound=lb)
    except Exception as exc:
        print(json.dumps({"setup": f"FLA under the interpreter: {type(exc).__name__}: {exc}"}))
        sys.exit(0)
    chunks, _, _ = kda_fwd.chunk_tables(cu_t)
    model = tc.emulate(q[0], k[0], v[0], g[0], beta[0], chunks, 128 ** -0.5, lb, a_log, dt_bias,
                       use_qk_l2norm=True, use_beta_sigmoid=True)
    rows = kda_fwd.token_rows(chunks, TT)
    aqk_c, akk_c = (model[n].transpose(0, 1).index_select(0, rows).float() for n in ("aqk", "akk"))
    aqk_f, akk_f = aqk_f[0].float(), akk_f[0].float()
    pos = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]) % 64
    lower = (torch.arange(64)[None, :] <= pos[:, None])[:, None, :]  # [TT, 1, 64]: j <= i in the chunk
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    out[name] = dict(
        aqk=rel(torch.where(lower, aqk_c, 0.0), torch.where(lower, aqk_f, 0.0)),
        akk=rel(akk_c, akk_f),
        akk_upper_fla=float(torch.where(lower, 0.0, akk_f).abs().max()),
        akk_upper_ours=float(torch.where(lower, 0.0, akk_c).abs().max()),
        diag_fla=float((akk_f[torch.arange(TT), :, pos] - 1).abs().max()),  # T[i, i] of each token
    )
print(json.dumps({"cases": out}))
'''


def test_fla_saved_aqk_akk_are_what_we_store():
    pytest.importorskip("fla")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the child printed no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    if "setup" in result:
        pytest.skip(f"FLA's kernels do not run under this Triton interpreter: {result['setup']}")
    for name, r in result["cases"].items():
        # both bf16 roundings of one quantity (ours from fp32 q̂, k̂ and our factorisation, FLA's from its
        # bf16 q̂, k̂): a few bf16 ulps apart, norm-relative 2e-2; above the diagonal both are exactly 0,
        # and T's diagonal is 1 (bf16-exact)
        assert r["aqk"] < 2e-2 and r["akk"] < 2e-2, (name, r)
        assert r["akk_upper_fla"] == 0 and r["akk_upper_ours"] == 0, (name, r)
        assert r["diag_fla"] == 0, (name, r)

"""``stmatrix ... .trans`` from a CuTe DSL kernel, with the addresses given lane by lane.

The DSL's tiled ``StMatrix`` copies place a fragment where a tensor's layout says; a kernel that scatters a
matrix *transposed* into a hand-addressed, swizzled tile (kda_fwd's packed [Aqk | T'] tile) names each lane's
16-byte line itself. PTX semantics (m8n8, b16, ``.trans``): lanes 8k .. 8k + 7 give the shared-memory lines of
matrix k (16-byte aligned); lane t's register k holds two values of matrix k at (row t / 4, columns 2 (t % 4)
and 2 (t % 4) + 1) of the fragment, and ``.trans`` writes fragment element (a, b) to position a of line b.
"""

from __future__ import annotations

import cutlass
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx


def _i32(x, loc, ip):
    return cutlass.Int32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def stmatrix_x4_trans(addr, r0, r1, r2, r3, *, loc=None, ip=None) -> None:
    """Four 8x8 bf16 matrices, transposed: ``addr`` this lane's line (a 32-bit shared address), ``r0``-``r3`` its
    four registers (two bf16 each, the lower half the even column). Every lane of the warp must execute it."""
    ops = [_i32(v, loc, ip) for v in (addr, r0, r1, r2, r3)]
    ptx(None, ops, "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r,~{memory}", loc=loc, ip=ip)


@dsl_user_op
def stmatrix_x1_trans(addr, r0, *, loc=None, ip=None) -> None:
    """One 8x8 bf16 matrix, transposed: lanes 0-7 give its lines (the other lanes' ``addr`` is not read)."""
    ops = [_i32(v, loc, ip) for v in (addr, r0)]
    ptx(None, ops, "stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [$0], {$1};", "r,r,~{memory}", loc=loc, ip=ip)

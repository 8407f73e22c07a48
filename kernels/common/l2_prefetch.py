"""L2 prefetch of one cache line from a CuTe DSL kernel: ``prefetch.global.L2``.

A thread that knows which bytes its CTA will read a little later asks for them now: the line moves
into L2 without a register, a wait or the TMA engine (whose queue a bulk prefetch would share with
the CTA's own tensor copies), so the later load hits L2 instead of waiting on DRAM.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx

LINE_BYTES = 128  # what one prefetch moves: the L2 line holding the address


@dsl_user_op
def prefetch_line_l2(ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """Prefetch the 128-byte line holding global address ``ptr`` into L2 (fire and forget)."""
    ptx(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)], "prefetch.global.L2 [$0];", "l", loc=loc, ip=ip)

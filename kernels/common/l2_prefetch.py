"""Bulk L2 prefetch from a CuTe DSL kernel: ``cp.async.bulk.prefetch.L2.global``.

A CTA that knows which bytes a CTA launched after it will read can ask for them early: the copy
engine pulls them into L2 without registers, shared memory or a wait, so the later CTA's loads hit
L2 and the DRAM reads run under the earlier CTAs' compute instead of at the later CTA's start.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

BULK_ALIGN = 16  # bytes: the address and the size of a bulk prefetch are multiples of it


@dsl_user_op
def prefetch_l2(ptr: cute.Pointer, nbytes: cutlass.Constexpr, *, loc=None, ip=None) -> None:
    """Prefetch ``nbytes`` (a multiple of 16) of global memory at ``ptr`` (16-byte aligned) into L2.

    Fire and forget: nothing waits for it, and a prefetch of bytes nobody reads costs only bandwidth."""
    assert nbytes % BULK_ALIGN == 0, nbytes
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )

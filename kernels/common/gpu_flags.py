"""Counters one kernel raises and another, running at the same time, waits on (CuTe DSL inline PTX).

A producer CTA makes its global writes visible and then adds to a counter with release semantics at GPU
scope; a consumer polls the counter with acquire loads and, once it has the value it waits for, reads what
the producers wrote. The DSL has fences but no acquire load or release reduction, hence these wrappers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx


@dsl_user_op
def release_add(ptr: cute.Pointer, value, *, loc=None, ip=None) -> None:
    """``*ptr += value`` (u32 in global memory) with release semantics at GPU scope: this thread's earlier
    writes, and those it has observed (through a CTA barrier), are visible to whoever acquires the sum."""
    ptx(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.u32 [$0], $1;", "l,r", loc=loc, ip=ip)


@dsl_user_op
def acquire_load(ptr: cute.Pointer, *, loc=None, ip=None) -> cutlass.Int32:
    """The u32 at global ``ptr``, loaded with acquire semantics at GPU scope (never from a stale line)."""
    return cutlass.Int32(ptx(cutlass.Int32.mlir_type, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                             "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", loc=loc, ip=ip))


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    """Suspend the warp for about ``ns`` nanoseconds (a polling loop's back-off: leaves issue slots to the
    other warps of the SM)."""
    ptx(None, [cutlass.Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r", loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (the launch fails with an error): for a wait that can only have gone wrong."""
    ptx(None, [], "trap;", "", loc=loc, ip=ip)

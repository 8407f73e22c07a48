"""Flags one kernel sets and another, running at the same time, waits for (CuTe DSL inline PTX).

A producer CTA makes its global writes visible, then stores 1 to a flag with release semantics at GPU scope; a
consumer polls the flag with acquire loads and, once it reads 1, may read what the producer wrote (through the
async proxy too, after a proxy fence). The DSL has fences but no acquire load or release store: hence these.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx


@dsl_user_op
def store_release(ptr: cute.Pointer, value, *, loc=None, ip=None) -> None:
    """``*ptr = value`` (u32, global) with release semantics at GPU scope: this thread's earlier writes, and those
    it has observed (through a CTA barrier), are visible to whoever acquires the value."""
    ptx(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "st.release.gpu.global.u32 [$0], $1;", "l,r", loc=loc, ip=ip)


@dsl_user_op
def load_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> cutlass.Int32:
    """The u32 at global ``ptr``, loaded with acquire semantics at GPU scope (never a stale line)."""
    return cutlass.Int32(ptx(cutlass.Int32.mlir_type, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
                             "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", loc=loc, ip=ip))


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    """Suspend the warp for about ``ns`` ns: a polling loop's back-off, leaving issue slots to other warps."""
    ptx(None, [cutlass.Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r", loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (the launch fails): for a wait that can only have gone wrong."""
    ptx(None, [], "trap;", "", loc=loc, ip=ip)

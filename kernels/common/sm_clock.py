"""An SM's cycle counter and id from a CuTe DSL kernel (``%clock64``, ``%clock``, ``%smid``), for phase timing.

``%clock64`` counts the cycles of the SM the reading warp runs on: differences are exact within one CTA, and
comparable between the CTAs of one SM (not across SMs). The read is volatile inline PTX, so it keeps its place
among the kernel's other side effects (barriers, stores); it does not wait for loads still in flight.
"""

from __future__ import annotations

import cutlass
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx


@dsl_user_op
def clock64(*, loc=None, ip=None) -> cutlass.Int64:
    """The SM's cycle counter now."""
    return cutlass.Int64(ptx(cutlass.Int64.mlir_type, [], "mov.u64 $0, %clock64;", "=l", loc=loc, ip=ip))


@dsl_user_op
def clock32(*, loc=None, ip=None) -> cutlass.Int32:
    """The low 32 bits of the SM's cycle counter now (``%clock``): half the registers of :func:`clock64` for
    a kernel that keeps many stamps; differences wrap modulo 2^32 (~2 s at 1.98 GHz), so they unwrap exactly
    for spans shorter than that."""
    return cutlass.Int32(ptx(cutlass.Int32.mlir_type, [], "mov.u32 $0, %clock;", "=r", loc=loc, ip=ip))


@dsl_user_op
def smid(*, loc=None, ip=None) -> cutlass.Int32:
    """The id of the SM this thread runs on."""
    return cutlass.Int32(ptx(cutlass.Int32.mlir_type, [], "mov.u32 $0, %smid;", "=r", loc=loc, ip=ip))

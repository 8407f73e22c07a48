"""An L2 eviction-priority policy for a TMA load's ``cache_policy`` (``createpolicy``).

Data a kernel reads once (stage 1's q, k and g) can be marked evict-first, so the lines L2 keeps at the
kernel's end are the ones it wrote (stage 1's hand-off to stage 2) rather than the inputs it is done with.
"""

from __future__ import annotations

import cutlass
from cutlass.cutlass_dsl import dsl_user_op

from cula.kernels.common.inline_ptx import ptx


@dsl_user_op
def evict_first_policy(*, loc=None, ip=None) -> cutlass.Int64:
    """A 64-bit cache policy that gives every line it touches L2's evict-first priority."""
    text = "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;"
    return cutlass.Int64(ptx(cutlass.Int64.mlir_type, [], text, "=l", loc=loc, ip=ip))

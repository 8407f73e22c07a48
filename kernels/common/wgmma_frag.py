"""Register-fragment layouts of Hopper wgmma operands that the kernels build by hand.

A 16-bit wgmma A operand can come from registers (``OperandSource.RMEM``). Its per-thread layout is the
layout of an m64nNk16 accumulator (C) fragment with the column groups regrouped into k-blocks, so an
accumulator converted to bf16 can feed the next product in place, and a kernel that fills A values
itself can address them through the C fragment's coordinates (``partition_C`` of an identity tensor).
"""

from __future__ import annotations

import cutlass.cute as cute


def a_operand_layout(c_layout: cute.Layout) -> cute.Layout:
    """Register layout of a 16-bit wgmma A operand over the registers of an m64nNk16 C fragment.

    A C fragment holds, per thread, values ((2 cols, 2 rows, N/8 col groups), M=1, N=1). The A operand
    of a k16 instruction holds ((2 k, 2 rows, 2 k-halves), M=1, K/16 blocks): k-block b, half h is C's
    column group 2b + h, so the same registers serve with the third mode split into (2, N/16).
    """
    shape0 = c_layout.shape[0]
    stride0 = c_layout.stride[0]
    n_groups = shape0[2]
    return cute.make_layout(
        ((shape0[0], shape0[1], 2), 1, n_groups // 2),
        stride=((stride0[0], stride0[1], stride0[2]), 0, stride0[2] * 2),
    )

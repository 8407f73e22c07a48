"""Device-side pieces shared by the decode kernels (``kernels/sm90/*_decode.py``).

Decode kernels keep a slice of an fp32 recurrent state in registers and move it with 128-bit loads and
stores. The DSL only emits ``ld.global.v4`` / ``st.global.v4`` when it can prove a 16-byte alignment, and
it loses that proof through dynamic strides, so these helpers address memory from a base pointer plus an
element offset that the caller computes and that :func:`vec` marks as a multiple of the vector length.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def vec(ptr: cute.Pointer, off, n: cutlass.Constexpr, divby: cutlass.Constexpr) -> cute.Tensor:
    """A ``(n,)`` contiguous view at ``ptr + off``; ``off`` is known (by the caller) to divide ``divby``.

    With a pointer aligned to ``divby * element size`` bytes or more, copies of the view vectorize.
    """
    return cute.make_tensor(ptr + cute.assume(off, divby=divby), cute.make_layout(n))


@cute.jit
def load1(ptr: cute.Pointer, off):
    """The element at ``ptr + off``."""
    return cute.make_tensor(ptr + off, cute.make_layout(1))[0]


@cute.jit
def butterfly_sum(frag: cute.Tensor, n: cutlass.Constexpr, offsets: cutlass.Constexpr):
    """Sum each of the ``n`` values of ``frag`` over the lanes that differ in the bits ``offsets``.

    An xor (butterfly) all-reduce: every lane of a group ends with the group's sum, so the lanes that
    share a reduced value need no broadcast afterwards.
    """
    for s in cutlass.range_constexpr(len(offsets)):
        for m in cutlass.range_constexpr(n):
            frag[m] = frag[m] + cute.arch.shuffle_sync_bfly(frag[m], offset=offsets[s])


@cute.jit
def warp_sum(x: cutlass.Float32) -> cutlass.Float32:
    """Sum of ``x`` over the 32 lanes of the warp, on every lane."""
    for s in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << s)
    return x

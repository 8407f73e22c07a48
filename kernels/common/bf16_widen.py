"""bf16 -> fp32 widening of a register vector in one integer instruction an element.

A bf16 value is the upper half of the fp32 with the same value, so widening is exact bit moving: the low
element of a 32-bit word pair becomes ``word << 16`` (SHF or IMAD.U32) and the high one ``word & 0xFFFF0000``
(LOP3). ``TensorSSA.to(Float32)`` lowers to one ``cvt.f32.bf16`` an element, and ptxas turns the conversion
of a word's upper half into PRMT + SHF: three instructions a pair instead of two. Widening g, q and k this way
took 72 of the 4,952 SASS instructions a thread off stage 1 of the KDA forward (``kda_fwd_intra_tc``, packed,
three CTAs an SM; session 37).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

WIDEN_MODES = ("int", "cvt")  # "int": word shifts and masks (this module); "cvt": TensorSSA.to(Float32)
_HIGH_HALF = -65536  # 0xFFFF0000 as an Int32


@cute.jit
def widen_bf16(src: cute.Tensor, dst: cute.Tensor, mode: cutlass.Constexpr = WIDEN_MODES[0]):
    """``dst[i] = float(src[i])``: ``src`` an even-length bf16 register tensor (contiguous), ``dst`` an fp32
    register tensor of the same length. Exact in both modes (the same bits). Any other ``src`` type (an fp32 gate) is
    converted as ``TensorSSA.to`` does."""
    if cutlass.const_expr(mode == "cvt" or src.element_type is not cutlass.BFloat16):  # (an fp32 source: a copy)
        dst.store(src.load().to(cutlass.Float32))
    else:
        n = cute.size(src)
        words = cute.recast_tensor(src, cutlass.Int32)
        out = cute.recast_tensor(dst, cutlass.Int32)
        for i in cutlass.range_constexpr(n // 2):
            w = words[i]
            out[2 * i] = w << 16
            out[2 * i + 1] = w & cutlass.Int32(_HIGH_HALF)

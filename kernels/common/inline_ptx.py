"""One PTX instruction from a CuTe DSL kernel, as LLVM inline assembly: the one place that knows the DSL's
``llvm.inline_asm`` call (side effects kept, AT&T dialect), for the wrappers in ``l2_prefetch``."""

from __future__ import annotations

from cutlass._mlir.dialects import llvm


def ptx(result_type, operands: list, text: str, constraints: str, *, loc=None, ip=None):
    """Emit ``text`` with ``operands`` (IR values) under ``constraints``; returns the result value, if any."""
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )

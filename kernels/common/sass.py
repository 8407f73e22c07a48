"""SASS of a compile target on a machine without a GPU: ptxas to a cubin, then ``cuobjdump -sass``.
Its phases are cut where ``ncu_phases`` cuts a profile's SASS, so the two read side by side.

PTX instruction counts are a poor proxy for what the SM issues (ptxas folds negations into MUFU
operands, merges address arithmetic, unpacks bf16 pairs with SHF / PRMT). The SASS is what an ncu
profile attributes stalls to, so instruction budgets and per-phase mixes are counted here, on the CPU.

``cuobjdump`` comes with a CUDA toolkit; without one, the copy Triton bundles (a dependency of the
CUDA builds of torch) is used. :func:`find_cuobjdump` returns None when neither exists, and callers
(tests) skip.

Usage::

    python -m cula.kernels.common.sass cula.kernels.sm90.kda_fwd intra_tc   # total, mix, phases
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from cula.kernels.common.ncu_phases import SEGMENT_ENDS, opcode
from cula.kernels.common.ptx_check import ARCH

_INS_RE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;")


def find_cuobjdump() -> str | None:
    """Path of a ``cuobjdump``: on PATH, under ``CUDA_HOME``, or the one Triton bundles; else None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "cuobjdump")):
            return os.path.join(root, "bin", "cuobjdump")
    try:
        import triton
    except ImportError:
        return None
    bundled = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    return bundled[0] if bundled else None


def parse(sass_text: str) -> list[str]:
    """The instructions of ``cuobjdump -sass`` output, in order, without addresses, encodings or the
    trailing semicolon (a predicate guard, e.g. ``@!P0``, stays in front)."""
    return [m.group(1) for line in sass_text.splitlines() if (m := _INS_RE.match(line))]


def mix(instructions: list[str]) -> collections.Counter:
    """Instruction count by base opcode."""
    return collections.Counter(opcode(i) for i in instructions)


@dataclasses.dataclass
class Phase:
    """A run of instructions between two phase ends (``ncu_phases.SEGMENT_ENDS``: the same cut as the
    profile's segments); ``first`` is its start."""

    start: int
    instructions: list[str]

    @property
    def first(self) -> str:
        return self.instructions[0] if self.instructions else ""


def phases(instructions: list[str]) -> list[Phase]:
    """Split at CTA barriers and warpgroup-MMA waits (each such instruction starts the next phase)."""
    out: list[Phase] = []
    start = 0
    for n, ins in enumerate(instructions):
        body = ins.split(None, 1)[1] if ins.startswith("@") else ins
        if n > start and body.startswith(SEGMENT_ENDS):
            out.append(Phase(start, instructions[start:n]))
            start = n
    out.append(Phase(start, instructions[start:]))
    return out


def sass_of(ptx: str, ptxas: str | None = None, cuobjdump: str | None = None, timeout: float = 600) -> str:
    """``cuobjdump -sass`` of ``ptx`` assembled for sm_90a (raises ``FileNotFoundError`` without tools)."""
    ptxas = ptxas or shutil.which("ptxas")
    cuobjdump = cuobjdump or find_cuobjdump()
    if not ptxas or not cuobjdump:
        raise FileNotFoundError(f"ptxas={ptxas} cuobjdump={cuobjdump}: both are needed for SASS")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={ARCH}", src, "-o", cubin], check=True, capture_output=True,
                       timeout=timeout)
        res = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True,
                             timeout=timeout)
    return res.stdout


def summary(instructions: list[str], top: int = 12, min_phase: int = 30) -> str:
    """Total, mix and the phases of at least ``min_phase`` instructions, as text."""
    lines = [f"{len(instructions)} instructions: "
             + ", ".join(f"{k} {v}" for k, v in mix(instructions).most_common(top))]
    for ph in phases(instructions):
        if len(ph.instructions) >= min_phase:
            common = ", ".join(f"{k} {v}" for k, v in mix(ph.instructions).most_common(top))
            lines.append(f"@{ph.start:5d} {len(ph.instructions):5d}  {ph.first[:36]:36s} | {common}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from cula.kernels.common.ptx_check import ptx_report

    if len(argv) != 2:
        print(__doc__)
        return 2
    module, target = argv
    print(summary(parse(sass_of(ptx_report(module, target).ptx))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

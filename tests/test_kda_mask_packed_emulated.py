"""Stage 2's packed-tile masks (kda_fwd_recur, pack=True: ``mask_packed_words``, the default, and
``mask_packed_rows``, CULA_KDA_PACK_MASK=rows), their own source run on the CPU over shared memory as bytes.

The packed [Aqk | T'] tile P is loaded twice; the 128 math threads must leave the Aqk copy with P on and below the
diagonal and zeros above, and the T' copy with P above the diagonal, bf16(β_r) (from the tail of γ's row) on it and
zeros below. Both functions reinterpret bf16 pairs as 32-bit words (``cute.recast_ptr``), which the value-level
emulator (``_dsl_emulator``) does not model, so this test gives them a byte-level shared memory: each CUDA thread
runs in turn (neither has a barrier before its last one), and every byte records which thread wrote it, so a byte
written by two threads, or read by one after another wrote it, fails the test as the race it would be on a GPU.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("cutlass")

import _dsl_emulator as emu  # noqa: E402
from cula.kernels.sm90 import kda_fwd_recur as recur  # noqa: E402

CHUNK, THREADS = recur.CHUNK, recur.V2_MATH_THREADS
TILE = CHUNK * CHUNK  # bf16 elements of one stage's tile
STAGES = 2


class _Mem:
    """Shared memory as bytes, with the thread that last wrote each byte (-1: nobody) for the race checks."""

    def __init__(self, nbytes: int):
        self.bytes = np.zeros(nbytes, np.uint8)
        self.writer = np.full(nbytes, -1, np.int32)
        self.tid = 0

    def read(self, at: int, n: int) -> bytes:
        w = self.writer[at:at + n]
        assert np.all((w == -1) | (w == self.tid)), f"thread {self.tid} reads bytes another thread wrote"
        return self.bytes[at:at + n].tobytes()

    def write(self, at: int, data: bytes) -> None:
        w = self.writer[at:at + len(data)]
        assert np.all((w == -1) | (w == self.tid)), f"thread {self.tid} writes bytes another thread wrote"
        self.bytes[at:at + len(data)] = np.frombuffer(data, np.uint8)
        self.writer[at:at + len(data)] = self.tid


class _Dt:
    def __init__(self, name: str, size: int, fmt: str):
        self.name, self.size, self.fmt = name, size, fmt

    def __call__(self, x):  # cutlass.Int32(x): Python ints stand for i32 (two's complement at the store)
        return int(x)


I32 = _Dt("i32", 4, "<i4")
BF16 = _Dt("bf16", 2, "<u2")  # bf16 as its bit pattern: the function only moves and masks bits


class _Ptr:
    def __init__(self, mem, byte: int, dtype: _Dt):
        self.mem, self.byte, self.dtype = mem, byte, dtype

    def __add__(self, n) -> _Ptr:
        return _Ptr(self.mem, self.byte + int(n) * self.dtype.size, self.dtype)


class _Tensor:
    """A contiguous 1-D tensor over shared memory (``mem``) or over its own registers (``mem`` None)."""

    def __init__(self, ptr: _Ptr | None, n: int, dtype: _Dt):
        self.ptr, self.n, self.dtype = ptr, n, dtype
        self.regs = [None] * n if ptr is None else None

    def _at(self, i: int) -> int:
        assert 0 <= i < self.n, f"index {i} of {self.n}"
        return self.ptr.byte + i * self.dtype.size

    def __getitem__(self, i):
        if self.regs is not None:
            assert self.regs[i] is not None, "a register read before its write"
            return self.regs[i]
        raw = self.ptr.mem.read(self._at(int(i)), self.dtype.size)
        return int(np.frombuffer(raw, self.dtype.fmt)[0])

    def __setitem__(self, i, value) -> None:
        value = int(value) & ((1 << 8 * self.dtype.size) - 1)
        if self.regs is not None:
            self.regs[i] = value
            return
        self.ptr.mem.write(self._at(int(i)), value.to_bytes(self.dtype.size, "little"))

    def fill(self, value) -> None:
        assert value == 0, "only zero fills are modelled (bf16 +0.0 is all-zero bits)"
        for i in range(self.n):
            self[i] = 0

    def load(self):
        return [self[i] for i in range(self.n)]

    def store(self, values) -> None:
        assert len(values) == self.n, "store: sizes differ"
        for i, v in enumerate(values):
            self[i] = v


def _make_tensor(ptr: _Ptr, layout: emu.Layout) -> _Tensor:
    assert layout.stride == (1,), "only contiguous 1-D views are modelled"
    return _Tensor(ptr, layout.size, ptr.dtype)


def _namespace(barriers: list) -> dict:
    arch = types.SimpleNamespace(
        fence_proxy=lambda *a, **k: None,
        barrier=lambda barrier_id, number_of_threads: barriers.append((barrier_id, number_of_threads)),
        ProxyKind=types.SimpleNamespace(async_shared="async_shared"),
        SharedSpace=types.SimpleNamespace(shared_cta="shared_cta"))
    cute = types.SimpleNamespace(
        arch=arch, make_layout=lambda shape, stride=None: emu.Layout(shape, stride),
        make_tensor=_make_tensor, make_rmem_tensor=lambda layout, dtype: _Tensor(None, layout.size, dtype),
        recast_ptr=lambda ptr, dtype: _Ptr(ptr.mem, ptr.byte, dtype), assume=emu._assume)
    cutlass = types.SimpleNamespace(Int32=I32, BFloat16=BF16, range_constexpr=range, const_expr=lambda x: x)
    return {"cute": cute, "cutlass": cutlass}


def _offset(st: int, r: int, c: int) -> int:
    """Element (r, c) of stage st's tile, 128-byte swizzled (layout_facts' pack_mask_offset_mismatches checks the
    piece offsets against CuTe's layout)."""
    return recur.packed_piece_offset(st, r, c // 8) + c % 8


def _run(seed: int, mask, threads: int = THREADS):
    """Both stages' copies filled with random packed tiles P, γ rows with β's bf16 in the tail, then every math
    thread's ``mask`` for each stage (``threads``: 256 for stage 2 as pairs, whose two math warpgroups share the
    masking); returns P, β and the two copies in (stage, r, c) order."""
    rng = np.random.default_rng(seed)
    p = rng.integers(1, 1 << 16, size=(STAGES, CHUNK, CHUNK), dtype=np.uint16)  # never 0: a zero must be a mask
    beta = rng.integers(1, 1 << 16, size=(STAGES, CHUNK), dtype=np.uint16)
    gam_floats = recur.GAM_PITCH_PACK
    aqk0, tp0, gam0 = 0, STAGES * TILE * 2, 2 * STAGES * TILE * 2
    mem = _Mem(gam0 + STAGES * gam_floats * 4)
    flat = np.zeros(STAGES * TILE, np.uint16)
    for st in range(STAGES):
        for r in range(CHUNK):
            for c in range(CHUNK):
                flat[_offset(st, r, c)] = p[st, r, c]
    mem.bytes[aqk0:tp0] = flat.view(np.uint8)
    mem.bytes[tp0:gam0] = flat.view(np.uint8)
    gam = np.zeros((STAGES, gam_floats * 2), np.uint16)  # γ's row as bf16 halves: DK floats, then β's bf16 pairs
    gam[:, 2 * recur.DK:2 * recur.DK + CHUNK] = beta
    mem.bytes[gam0:] = gam.reshape(-1).view(np.uint8)
    barriers: list = []
    fn = emu.rebind(mask, _namespace(barriers))
    kern = types.SimpleNamespace(math_threads=threads)
    for st in range(STAGES):
        for tid in range(threads):
            mem.tid = tid
            fn(kern, _Ptr(mem, aqk0, BF16), _Ptr(mem, tp0, BF16), _Ptr(mem, gam0, BF16), st, tid)
        mem.writer[:] = -1  # the barrier at the end orders this stage's writes before anything after it
    assert barriers == [(recur.PACK_BARRIER, threads)] * (STAGES * threads)
    out = np.frombuffer(mem.bytes[:gam0].tobytes(), np.uint16).reshape(2, STAGES * TILE)
    idx = np.array([[[_offset(st, r, c) for c in range(CHUNK)] for r in range(CHUNK)] for st in range(STAGES)])
    return p, beta, out[0][idx], out[1][idx]


@pytest.mark.parametrize("name,threads", [("mask_packed_words", THREADS), ("mask_packed_rows", THREADS),
                                          ("mask_packed_words", recur.PAIR_MATH_THREADS)],
                         ids=["words", "rows", "words-pair"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mask_packed_leaves_aqk_and_t_prime(name, seed, threads):
    p, beta, aqk, tp = _run(seed, getattr(recur.KdaFwdRecur, name), threads)
    r = np.arange(CHUNK)[:, None]
    c = np.arange(CHUNK)[None, :]
    for st in range(STAGES):
        np.testing.assert_array_equal(aqk[st], np.where(c <= r, p[st], 0), err_msg=f"Aqk copy, stage {st}")
        want_tp = np.where(c > r, p[st], np.where(c == r, beta[st][:, None], 0))
        np.testing.assert_array_equal(tp[st], want_tp, err_msg=f"T' copy, stage {st}")


def test_a_planted_bug_fails():
    """The check can fail: mask_packed_rows' source with Aqk's diagonal dropped from its copy (2w < d for 2w <= d)."""
    import ast
    import inspect
    import textwrap

    src = recur.KdaFwdRecur.mask_packed_rows.__wrapped__
    tree = ast.parse(textwrap.dedent(inspect.getsource(src)))
    planted = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and ast.unparse(node) == "2 * w <= d":
            node.ops = [ast.Lt()]
            planted += 1
    assert planted == 1, "the planted condition is no longer in mask_packed_rows' source"
    tree.body[0].decorator_list = []
    glb = dict(src.__globals__)
    exec(compile(ast.fix_missing_locations(tree), "<planted mask_packed>", "exec"), glb)
    p, beta, aqk, tp = _run(0, glb["mask_packed_rows"])
    r = np.arange(CHUNK)[:, None]
    c = np.arange(CHUNK)[None, :]
    assert not np.array_equal(aqk[0], np.where(c <= r, p[0], 0))


def test_pack_mask_is_validated_and_defaults():
    """CULA_KDA_PACK_MASK names one of PACK_MASKS; the split launch's default is "rows" (GPU-tested and faster since
    session 44), the 384-thread launches (pair, raw_in) take the word mask unless told otherwise."""
    assert recur.PACK_MASKS[0] == "rows" and recur.WIDE_PACK_MASK == "words"
    with pytest.raises(ValueError, match="CULA_KDA_PACK_MASK"):
        recur.KdaFwdRecur(True, True, False, variant="v2", t_in=True, pack=True, pack_mask="bogus")
    flags = dict(variant="v2", t_in=True, pack=True)
    assert recur.KdaFwdRecur(True, True, False, **flags, pack_mask="words").pack_mask == "words"
    assert recur.KdaFwdRecur(True, True, False, **flags, pack_mask=None).pack_mask == recur.PACK_MASK
    assert recur.KdaFwdRecur(True, True, False, **flags, x_in=True, pair=True).pack_mask == "words"
    assert recur.KdaFwdRecurRaw(True, True, False, pack=True).pack_mask == "words"


def test_ptx_rows_mask():
    """The two-pass mask: no spills, no local memory, no more registers than the default and the same wgmma; the
    diagonal piece is one 16-byte read (of the word-typed ``ld.shared.v4.u32`` the mask alone uses) and two 16-byte
    writes, where the word mask's four unrolled diagonal pieces a thread take 8 of each (and 4 scalar reads of β)."""
    from cula.kernels.common.ptx_check import ptx_reports

    names = ["recur_v2_t_in_pack_x_words", "recur_v2_t_in_pack_x"]
    r = ptx_reports("cula.kernels.sm90.kda_fwd", names)
    words, rows = (r[n] for n in names)
    for rep in (words, rows):
        assert rep.spill_bytes == 0 and ".local" not in rep.ptx
    assert rows.max_registers <= words.max_registers
    assert rows.count("wgmma.mma_async") == words.count("wgmma.mma_async")
    assert (words.count("ld.shared.v4.u32"), words.count("st.shared.v4.u32"), words.count("ld.shared.u32")) == (8, 8, 4)
    assert (rows.count("ld.shared.v4.u32"), rows.count("st.shared.v4.u32"), rows.count("ld.shared.u32")) == (1, 2, 1)
    assert len(rows.ptx.splitlines()) < len(words.ptx.splitlines())

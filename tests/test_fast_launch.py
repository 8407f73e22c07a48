"""cula.kernels.common.fast_launch: the cached-cell launch path against a stand-in compiled function.

The stand-in mimics what the CuTe DSL's ``JitCompiledFunction`` does on a call (one ctypes pointer per
argument, then a C entry point reading them through a packed ``void*`` array), so the fast path's packing
is checked on the CPU; the real kernels repeat the comparison on the GPU (tests/test_kernel_*_decode.py).
"""

from __future__ import annotations

import ctypes

import cutlass
import pytest

from cula.kernels.common.fast_launch import ArgSpec, Launcher

SPECS = (ArgSpec("ptr", cutlass.Float32), ArgSpec("ptr", cutlass.BFloat16), ArgSpec("i32"), ArgSpec("f32"),
         ArgSpec("stream"))
_READ = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p)


class _Executor:
    """What the launcher reads off ``compiled._default_executor``: a C entry point and its extras."""

    def __init__(self, calls: list, n_args: int):
        self.cuda_result = ctypes.c_int32(0)
        self.extra = ctypes.c_void_p(0xABC0)

        def entry(packed):
            arr = ctypes.cast(packed, ctypes.POINTER(ctypes.c_void_p))
            got = [_READ[i].from_address(arr[i]).value for i in range(n_args)]
            # the slots after the arguments: the result cell, then the kernel function pointers
            assert arr[n_args] == ctypes.addressof(self.cuda_result)
            assert arr[n_args + 1] == 0xABC0
            calls.append(tuple(got))

        self._entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(entry)
        self.jit_module = type("M", (), {"capi_func": self._entry})()
        self.exec_context = type("C", (), {"kernel_functions_ptrs": [0xABC0]})()


class FakeCompiled:
    """A compiled host function: packs arguments the way the DSL does (or deliberately wrong)."""

    def __init__(self, corrupt: int | None = None):
        self.calls: list[tuple] = []
        self.public_calls = 0
        self.corrupt = corrupt
        self._default_executor = None

    def generate_execution_args(self, *objs):
        from cutlass.base_dsl.typing import get_c_pointers
        from cutlass.base_dsl.runtime.jit_arg_adapters import JitArgAdapterRegistry

        exe = []
        self._keep = []
        for i, obj in enumerate(objs):
            adapter = JitArgAdapterRegistry.get_registered_adapter(type(obj))
            if adapter:
                obj = adapter(obj)
                self._keep.append(obj)
            ptrs = get_c_pointers(obj)
            if i == self.corrupt:
                bogus = ctypes.c_int64(12345)
                self._keep.append(bogus)
                ptrs = [ctypes.addressof(bogus)]
            exe.extend(ptrs)
        return exe, []

    def run_compiled_program(self, exe_args):
        self.public_calls += 1
        if self._default_executor is None:
            self._default_executor = _Executor(self.calls, len(SPECS))

    def __call__(self, *objs):
        self.run_compiled_program(self.generate_execution_args(*objs)[0])


def test_fast_path_passes_every_value_through_its_cell():
    fake = FakeCompiled()
    launch = Launcher(fake, SPECS)
    launch(0x1000, 0x2000, 7, 0.5, 0x99)  # first call: public path, then the check
    assert fake.public_calls == 1 and launch.is_fast and launch.fast_reason is None
    launch(0x3010, 0x4020, -3, 2.25, 0x77)
    launch(0x5000, 0x6000, 1 << 20, -1.5, 0)
    assert fake.calls == [(0x3010, 0x4020, -3, 2.25, 0x77), (0x5000, 0x6000, 1 << 20, -1.5, None)]
    assert fake.public_calls == 1  # later calls never went through the DSL


def test_fast_path_reports_a_failed_launch():
    fake = FakeCompiled()
    launch = Launcher(fake, SPECS)
    launch(0x1000, 0x2000, 7, 0.5, 0x99)
    fake._default_executor.cuda_result.value = 700
    with pytest.raises(RuntimeError, match="700"):
        launch(0x1000, 0x2000, 7, 0.5, 0x99)


@pytest.mark.parametrize("corrupt", [0, 2, 3])
def test_a_packing_mismatch_falls_back_to_the_public_path(corrupt):
    fake = FakeCompiled(corrupt=corrupt)
    launch = Launcher(fake, SPECS)
    with pytest.warns(RuntimeWarning, match="fast kernel launch disabled"):
        launch(0x1000, 0x2000, 7, 0.5, 0x99)
    assert not launch.is_fast and f"argument {corrupt}" in launch.fast_reason
    launch(0x1000, 0x2000, 8, 0.5, 0x99)
    assert fake.public_calls == 2 and fake.calls == []


def test_fast_path_can_be_turned_off():
    fake = FakeCompiled()
    launch = Launcher(fake, SPECS, fast=False)
    for _ in range(3):
        launch(0x1000, 0x2000, 7, 0.5, 0x99)
    assert fake.public_calls == 3 and not launch.is_fast


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        ArgSpec("tensor")


def test_null_launcher_is_fast_and_calls_nothing():
    from cula.kernels.common.fast_launch import null_launcher

    launch = null_launcher(SPECS)
    assert launch.is_fast
    for _ in range(3):
        launch(0x1000, 0x2000, 7, 0.5, 0x99)
    assert [c.value for c in launch._cells] == [0x1000, 0x2000, 7, 0.5, 0x99]


def test_bound_launch_fixes_the_scalars_and_passes_the_pointers():
    fake = FakeCompiled()
    launch = Launcher(fake, SPECS)
    assert launch.bind({2: 7, 3: 0.5}) is None  # not verified yet
    launch(0x1000, 0x2000, 7, 0.5, 0x99)
    bound = launch.bind({2: 7, 3: 0.5})
    bound((0x3010, 0x4020, 0x77))
    bound((0x5000, 0x6000, 0))
    assert fake.calls == [(0x3010, 0x4020, 7, 0.5, 0x77), (0x5000, 0x6000, 7, 0.5, None)]
    assert launch._last_values == (0x5000, 0x6000, 7, 0.5, 0)
    launch(0x1000, 0x2000, 9, 1.5, 0x99)  # the launcher's own cells are not the bound ones
    bound((0x1, 0x2, 0x3))
    assert fake.calls[-2:] == [(0x1000, 0x2000, 9, 1.5, 0x99), (0x1, 0x2, 7, 0.5, 0x3)]
    fake._default_executor.cuda_result.value = 700
    with pytest.raises(RuntimeError, match="700"):
        bound((0x1, 0x2, 0x3))
    with pytest.raises(ValueError, match="argument 2 \\(i32\\) must be fixed"):
        launch.bind({3: 0.5})

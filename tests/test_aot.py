"""Ahead-of-time compiled kernels (``cula.kernels.common.aot``): built on the CPU, loaded on the GPU machine.

CPU: a module compiles without a driver and round-trips through its file; names follow the launch key and the
sources; without a GPU (or ``CULA_AOT_DIR``) nothing is loaded and the launch compiles as before. GPU: the
loaded modules give the compiled path's outputs bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from cula.kernels.common import aot, aot_build

pytest.importorskip("cutlass")


def _build_child(out_dir: str, scenario: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """Record ``scenario``'s launches and compile the first ``limit`` of them in a fresh process (the DSL
    takes its arch from the environment when ``cutlass`` is first imported)."""
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["CUTE_DSL_ARCH"] = {aot.HOST_ARCH_ENV!r}
        from cula.kernels.common import aot, aot_build
        launches = aot_build.record_launches({scenario!r})[:{limit!r}]
        for kind, key, make_kernel, specs in launches:
            name = aot.entry_name(kind, key, specs)
            aot.save(os.path.join({out_dir!r}, name), aot.compile_for_export(make_kernel(), specs))
            print("built", name, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)


def test_entry_names_follow_the_launch():
    from cula.kernels.common.fast_launch import ArgSpec

    specs = (ArgSpec("ptr", None, 16), ArgSpec("i32"))
    a = aot.entry_name("recur", (("x", 1),), specs)
    assert a == aot.entry_name("recur", (("x", 1),), specs) and a.startswith("recur-") and a.endswith(aot.SUFFIX)
    assert a != aot.entry_name("recur", (("x", 2),), specs)
    assert a != aot.entry_name("intra_tc", (("x", 1),), specs)
    assert a != aot.entry_name("recur", (("x", 1),), specs[:1])


def test_scenarios_record_the_device_steps_launches():
    """The recorded launches of a scenario are distinct and carry its module settings (u in stage 2: t_out /
    t_in)."""
    u = aot_build.record_launches("u_in_recur")
    assert len({(k, key) for k, key, _, _ in u}) == len(u) > 0
    assert all(dict(key[0]).get("t_out" if k == "intra_tc" else "t_in") for k, key, _, _ in u)
    # diag_split's modules: the default stage 1 (t_out) with the one diagnostic, the module setting restored
    from cula.kernels.sm90 import kda_fwd_intra_tc as intra_tc

    dg = [key for k, key, _, _ in aot_build.record_launches("diag_no_wu_store") if k == "intra_tc"]
    assert dg and all(dict(key[0])["diag"] == ("no_wu_store",) and dict(key[0])["t_out"] for key in dg)
    assert intra_tc.DIAG == ()
    # gate_factors' and subst's modules: the default stage 1 with the other factor form or substitution order
    for name, key, mode in (("gate", "gate_factors", "direct"), ("subst", "subst", "left")):
        for scenario in (f"{name}_{mode}_checks", f"{name}_{mode}_split"):
            alt = [k_ for k, k_, _, _ in aot_build.record_launches(scenario) if k == "intra_tc"]
            assert alt and all(dict(k_[0]).get(key) == mode and dict(k_[0])["t_out"] for k_ in alt)
    assert (intra_tc.GATE_FACTORS, intra_tc.SUBST) == ("halves", "right")
    # the default modules: 32-row factor blocks exactly where the bound allows them (not the softplus floor, not -11)
    for scenario in ("checks", "split"):
        keys = [dict(k_[0]) for k, k_, _, _ in aot_build.record_launches(scenario) if k == "intra_tc"]
        assert any(k_.get("factor_block") == 32 for k_ in keys)
        assert all(k_.get("factor_block", 16) == 16 for k_ in keys if k_.get("softplus_gate"))
    # fused_premise's modules: the diagnostics in the order device_round's environment gives them
    for scenario, diag in (("diag_no_stores", aot_build.NO_STORES),
                           ("diag_one_cta_no_stores", ("one_cta", *aot_build.NO_STORES))):
        keys = [dict(k_[0]) for k, k_, _, _ in aot_build.record_launches(scenario) if k == "intra_tc"]
        assert keys and all(k_["diag"] == diag for k_ in keys)
    keys = [dict(k_[0]) for k, k_, _, _ in aot_build.record_launches("block16_split") if k == "intra_tc"]
    assert keys and all(k_.get("factor_block", 16) == 16 for k_ in keys)
    assert intra_tc.FACTOR_BLOCK == 32  # the default, restored after the scenarios


def test_train_scenario_covers_the_training_gpu_tests(monkeypatch):
    """Every launch the training GPU tests make through the public op (their inference calls, on a faked sm_90
    with the launcher recorded) is a module of the ``train`` scenario: on the H100 a case without one compiled
    for minutes and ran its step out of time (session 19)."""
    pytest.importorskip("fla")
    import contextlib

    import test_kda_train as train_tests
    from _kda_host import fake_sm90, record_kda_launches

    from cula.kda import chunk_kda

    want = {(k, key) for k, key, _, _ in aot_build.record_launches("train")}
    fake_sm90(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    calls = record_kda_launches(monkeypatch)
    monkeypatch.setenv("CULA_KERNELS", train_tests.OPT_IN)
    real_to, real_tensor = torch.Tensor.to, torch.tensor
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: real_to(
        self, *("cpu" if x == "cuda" else x for x in a), **k))
    monkeypatch.setattr(torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k))
    for case in train_tests.GPU_CASES:
        B, T, H, HV, cu, lb, sigmoid, h0, v_first, gate = case.values
        x, kw = train_tests._gpu_case(B, T, H, HV, cu, 0, lb, sigmoid, h0, v_first, gate)
        with torch.no_grad():
            chunk_kda(**x, **kw)
    seen = {(kind, key) for kind, key, _, _ in calls}
    assert seen and seen <= want, sorted(seen - want)


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_parallel_build_shards_compile_each_module_once(tmp_path, monkeypatch, jobs):
    """build_parallel's processes split the modules by name: every module of the scenarios is compiled by
    exactly one shard, and a shard skips modules already on disk."""
    built: list[str] = []
    monkeypatch.setattr(aot_build, "compile_for_export", lambda fn, specs: None)
    monkeypatch.setattr(aot_build, "save", lambda path, compiled: built.append(os.path.basename(path)) or 1)
    scenarios = ["u_in_recur", "split"]
    want = {aot.entry_name(k, key, specs) for sc in scenarios for k, key, _, specs in aot_build.record_launches(sc)}
    for i in range(jobs):
        aot_build.build(str(tmp_path), scenarios, (i, jobs))
    assert sorted(built) == sorted(want) and len(want) > 2
    if jobs == 2:
        assert {aot_build.shard_of(n, 2) for n in want} == {0, 1}  # both processes get work
    (tmp_path / sorted(want)[0]).write_bytes(b"")  # on disk already: not compiled again
    built.clear()
    aot_build.build(str(tmp_path), scenarios)
    assert sorted(built) == sorted(want)[1:]


@pytest.mark.parametrize("argv, pruned", [(["build", "D"], True), (["build", "D", "--jobs", "1"], True),
                                          (["build", "D", "--scenarios", "split"], False)])
def test_full_builds_remove_modules_of_older_sources(tmp_path, monkeypatch, argv, pruned):
    """A full build deletes the modules no scenario needs (older kernel sources) and nothing else; a build of
    some scenarios cannot tell, so it deletes nothing."""
    monkeypatch.setattr(aot_build, "build", lambda out_dir, scenarios, shard=(0, 1): [])
    monkeypatch.setattr(aot_build, "build_parallel", lambda out_dir, scenarios, jobs: 0)
    current = sorted(aot_build.expected_names(["split"]))[:2]
    monkeypatch.setattr(aot_build, "expected_names", lambda scenarios: set(current))
    stale = f"intra_tc-{'0' * 24}{aot.SUFFIX}"
    for name in [*current, stale, "notes.txt"]:
        (tmp_path / name).write_bytes(b"x")
    argv = [str(tmp_path) if a == "D" else a for a in argv]
    assert aot_build.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*current, "notes.txt"] + ([] if pruned else [stale]))


@pytest.mark.parametrize("argv, want", [(["build", "D"], "core"), (["build", "D", "--all"], "all"),
                                        (["build", "D", "--scenarios", "split,train"], ["split", "train"])])
def test_a_plain_build_compiles_the_queued_steps_scenarios_and_keeps_what_all_built(tmp_path, monkeypatch, argv,
                                                                                   want):
    """``build`` alone compiles CORE_SCENARIOS, ``--all`` every scenario, ``--scenarios`` the ones named; the prune
    after a plain build keeps the modules of every scenario (an ``--all`` build's extras survive it)."""
    asked, kept = [], []
    monkeypatch.setattr(aot_build, "build", lambda out_dir, scenarios, shard=(0, 1): asked.append(scenarios) or [])
    monkeypatch.setattr(aot_build, "expected_names", lambda scenarios: kept.append(scenarios) or set())
    argv = [str(tmp_path) if a == "D" else a for a in argv]
    assert aot_build.main([*argv, "--jobs", "1"]) == 0
    expect = list(aot_build.CORE_SCENARIOS) if want == "core" else list(aot_build.SCENARIOS) if want == "all" else want
    assert asked == [expect]
    assert kept == ([] if "--scenarios" in argv else [list(aot_build.SCENARIOS)])
    assert set(aot_build.CORE_SCENARIOS) < set(aot_build.SCENARIOS)


def test_default_jobs_is_one_per_core_up_to_four():
    assert 1 <= aot_build.default_jobs() <= 4


def test_a_module_builds_without_a_gpu_and_round_trips(tmp_path, monkeypatch):
    """The recurrence of the u-in-stage-2 scenario compiles for sm_90a on the CPU, and its file holds MLIR
    bytecode that parses, the host entry's name and argument spec. Loading it needs the GPU machine's CUDA
    libraries: on a machine without them find() warns and returns None (the launch then compiles)."""
    proc = _build_child(str(tmp_path), "u_in_recur", limit=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.iterdir())
    assert len(files) >= 1 and all(f.name.endswith(aot.SUFFIX) for f in files)
    blob = aot.read(files[-1])
    from cutlass._mlir import ir

    with ir.Context():
        module = ir.Module.parse(blob["bytecode"])
    assert "gpu.binary" in str(module.operation)[:10 ** 7] or blob["kernel_info"]
    assert blob["function_name"].startswith("cutlass___call___")
    assert blob["args_spec"].args[:3] in (["self", "pW", "pQG"], ["pW", "pQG", "pAqk"],
                                           ["self", "pQ", "pK"], ["pQ", "pK", "pV"])
    if torch.cuda.is_available():
        return  # the GPU test below loads them
    kind = files[-1].name.split("-")[0]
    launches = [x for x in aot_build.record_launches("u_in_recur")
                if aot.entry_name(x[0], x[1], x[3]) == files[-1].name]
    assert len(launches) == 1 and launches[0][0] == kind
    monkeypatch.delenv(aot.AOT_ENV, raising=False)
    assert aot.find(*launches[0][:2], launches[0][3]) is None  # not asked for: nothing read
    monkeypatch.setenv(aot.AOT_ENV, str(tmp_path))
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert aot.find(*launches[0][:2], launches[0][3]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_aot_modules_equal_compiled_ones(tmp_path, monkeypatch):
    """Modules built ahead of time (in a child process that cannot JIT, as on the CPU machine) load on the GPU
    and give the freshly compiled kernels' o and final state bit for bit (tc-T1, default and u in stage 2); each
    launch took its module (no compile)."""
    from cula.kernels.sm90 import kda_fwd
    from cula.kernels.sm90 import kda_fwd_check as chk

    # the first case's launches (stage 1, stage 2 with / without state) with u formed in stage 1 and in stage 2, each
    # named by its setting (session 36's H100 run built "default" and "u_in_recur", the same launches since u in
    # stage 2 became the default, and the u-in-stage-1 pass found no module)
    for scenario in ("u_in_stage1", "u_in_recur"):
        proc = _build_child(str(tmp_path), scenario, limit=3)
        assert proc.returncode == 0, proc.stderr[-3000:]
    dev = torch.device("cuda")
    for u in (False, True):
        monkeypatch.setattr(kda_fwd, "U_IN_RECUR", u)
        for name in ("tc-T1",):
            case = next(c for c in chk.CASES if c[0] == name)
            args, kw = chk._inputs(*case, dev=dev)
            monkeypatch.delenv(aot.AOT_ENV, raising=False)
            kda_fwd._LAUNCHERS.clear()
            o_ref, ht_ref = kda_fwd.kda_fwd(*args, **kw)
            monkeypatch.setenv(aot.AOT_ENV, str(tmp_path))
            kda_fwd._LAUNCHERS.clear()
            loaded = []
            real_find = aot.find

            def find(kind, key, specs):
                got = real_find(kind, key, specs)
                loaded.append(got is not None)
                return got

            monkeypatch.setattr(aot, "find", find)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                o, ht = kda_fwd.kda_fwd(*args, **kw)
            torch.cuda.synchronize()
            monkeypatch.setattr(aot, "find", real_find)
            assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
            assert loaded and all(loaded), (name, u, loaded)


#: functions of kernel sources that may import a file outside them: CPU-only helpers and command lines, never run
#: while a kernel is built (placeholder pointers for PTX checks, layout facts, ``main``)
_NO_BUILD_FUNCTIONS = {"fake_args", "layout_facts", "main"}


def _imports_of_non_sources(path, excluded: set[str]) -> list[tuple[int, str, str | None]]:
    """(line, module, enclosing function or None) of each import in ``path`` of a module in ``excluded``;
    imports under ``if __name__ == "__main__"`` count as in ``main``."""
    import ast

    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in (n for n in names if n in excluded):
            where, up = None, node
            while up in parents and where is None:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = up.name
                elif isinstance(up, ast.If) and "__main__" in ast.unparse(up.test):
                    where = "main"
            found.append((node.lineno, name, where))
    return found


def test_files_left_out_of_the_fingerprint_feed_no_kernel():
    """Editing a file of ``NOT_KERNEL_SOURCES`` renames no module, so no kernel may be built from it: the kernel
    sources import those files only inside CPU-only helpers or command lines (a new import elsewhere fails here,
    naming the file to take off the list); every listed file exists (a renamed file is a kernel source again)."""
    from pathlib import Path

    import cula.kernels

    root = Path(cula.kernels.__path__[0])
    assert all((root / rel).is_file() for rel in aot.NOT_KERNEL_SOURCES), sorted(
        rel for rel in aot.NOT_KERNEL_SOURCES if not (root / rel).is_file())
    excluded = {"cula.kernels." + rel[:-3].replace("/", ".") for rel in aot.NOT_KERNEL_SOURCES}
    sources = aot.kernel_sources()
    assert {p.relative_to(root).as_posix() for p in sources} >= {
        "common/aot.py", "common/fast_launch.py", "common/wgmma_frag.py", "sm90/kda_fwd.py",
        "sm90/kda_fwd_intra_tc.py", "sm90/kda_fwd_recur.py", "sm90/kda_fwd_clock.py"}
    bad = [(p.relative_to(root).as_posix(), line, name, fn) for p in sources
           for line, name, fn in _imports_of_non_sources(p, excluded) if fn not in _NO_BUILD_FUNCTIONS]
    assert not bad, bad


def test_the_import_check_sees_module_level_and_function_imports(tmp_path):
    """The check above is able to fail: an import at module level, or in a function that builds kernels, is
    reported with its place; one in ``fake_args`` or under ``__main__`` is reported as allowed."""
    src = tmp_path / "k.py"
    src.write_text(textwrap.dedent("""
        from cula.kernels.common.ptx_check import fake_ptr
        def make_kernel():
            import cula.kernels.common.sass
        def fake_args():
            from cula.kernels.common import ptx_check
        if __name__ == "__main__":
            import cula.kernels.common.sass
    """))
    got = _imports_of_non_sources(src, {"cula.kernels.common.ptx_check", "cula.kernels.common.sass"})
    assert got == [(2, "cula.kernels.common.ptx_check", None), (4, "cula.kernels.common.sass", "make_kernel"),
                   (6, "cula.kernels.common.ptx_check", "fake_args"), (8, "cula.kernels.common.sass", "main")]

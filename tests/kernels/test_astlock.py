"""TileLang lowers kernels in threads, and CPython 3.11 shares one AST recursion counter between threads.

The race needs a garbage collection with a Python finaliser in the middle of `ast.parse`; the script
below forces that, reproduces the `SystemError` a CI run once hit in a kernel build (`AST constructor
recursion depth mismatch`), and shows that `serial_ast_parse` removes it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ast, contextlib, gc, inspect, json, sys, threading
    import json.decoder
    from laya_aot.kernels.astlock import serial_ast_parse

    source = inspect.getsource(json.decoder) * 3
    gc.set_threshold(10, 1, 1)
    sys.setswitchinterval(1e-6)

    class Cyclic:  # only the collector frees these, and their finaliser runs Python code
        def __del__(self):
            [i for i in range(50)]

    errors = []

    def work():
        for _ in range(60):
            junk = [Cyclic() for _ in range(20)]
            for obj in junk:
                obj.me = obj
            del junk
            try:
                ast.parse(source)
            except SystemError as e:
                errors.append(str(e))

    with (serial_ast_parse() if sys.argv[1] == "locked" else contextlib.nullcontext()):
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(json.dumps({"errors": len(errors), "first": errors[:1], "restored": not hasattr(ast.parse, "__wrapped__")}))
""")


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the race script runs for 10-25 s on 2 cores
def test_serial_ast_parse_removes_the_thread_race():
    locked = _run("locked")
    assert locked["errors"] == 0, locked["first"]
    assert locked["restored"]   # the block leaves ast.parse as it found it


@pytest.mark.slow  # the race script runs for 10-25 s on 2 cores
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the race was shown on CPython 3.11; "
                    "this baseline says nothing about other versions")
def test_the_race_is_real_without_the_lock():
    """Without this baseline the test above could pass because the script never races."""
    unlocked = _run("unlocked")
    assert unlocked["errors"] > 0
    assert "AST constructor recursion depth mismatch" in unlocked["first"][0]


def test_compile_catalogue_holds_the_lock_while_its_pool_runs(monkeypatch, tmp_path):
    import ast

    from laya_aot.kernels import cross_compile as comp

    seen = []
    monkeypatch.setattr(comp, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(comp, "nvcc_version", lambda nvcc=None: "0")
    monkeypatch.setattr(comp, "kernel_cache_dir", lambda arch, nvcc: None)
    monkeypatch.setattr(comp, "elaborate", lambda spec: object())
    monkeypatch.setattr(comp, "_run_one", lambda spec, func, arch, out, cache: (
        seen.append(hasattr(ast.parse, "__wrapped__")), comp._entry(spec))[1])
    monkeypatch.setattr(comp, "_versions", lambda: {"tilelang_version": "x", "laya_version": "y"})
    from laya_aot.kernels.catalogue import KernelSpec

    specs = [KernelSpec("gemm_kernel", (("N", n),)) for n in (64, 128)]
    comp.compile_catalogue(specs, "sm_90a", tmp_path, jobs=2, progress=False)
    assert seen == [True, True]
    assert not hasattr(ast.parse, "__wrapped__")

"""The start benchmarks write each timed start as a Python program from a str.format template: a template that does
not format (a literal brace) or does not compile would fail only on the GPU host, after minutes of building; here it
fails in CI."""
from __future__ import annotations

import pytest

from tests.bench_scripts.conftest import load_script


@pytest.mark.parametrize("name", ["START", "START_EAGER"])
@pytest.mark.parametrize("prefer", ["", ", prefer='tilelang'"])
def test_every_start_template_formats_into_a_program(name, prefer):
    gpu_start = load_script("gpu_start")
    code = getattr(gpu_start, name).format(ckpt="/models/ckpt", bundle="/models/bundle", q=gpu_start.ONE,
                                           device="cuda", prefer=prefer)
    compile(code, name, "exec")
    assert "/models/ckpt" in code and (prefer in code or name == "START_EAGER")


@pytest.mark.parametrize("mode", ["handover", "wait", "aoti"])
def test_the_handover_start_template_formats_into_a_program(mode):
    handover = load_script("handover_start")
    code = handover.CHILD.format(bench="/repo/benchmarks", ckpt="/models/ckpt", bundle="/models/bundle",
                                 device="cuda", load_kwargs=handover.MODES[mode], q=handover.ONE, repeats=3)
    compile(code, mode, "exec")
    assert "harness.emit(out)" in code and repr(handover.MODES[mode]) in code

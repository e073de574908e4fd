"""benchmarks/gpu_start.py writes each timed start as a Python program from a str.format template: a template
that does not format (a literal brace) or does not compile fails only on the H200, after minutes of building
(session 17); here it fails in CI."""
from __future__ import annotations

import pytest

from tests.bench_scripts import load_script


@pytest.fixture(scope="module")
def gpu_start():
    return load_script("gpu_start")


@pytest.mark.parametrize("name", ["START", "START_EAGER"])
@pytest.mark.parametrize("prefer", ["", ", prefer='tilelang'"])
def test_every_start_template_formats_into_a_program(gpu_start, name, prefer):
    code = getattr(gpu_start, name).format(ckpt="/tmp/ckpt", bundle="/tmp/bundle", q=gpu_start.ONE, device="cuda",
                                           prefer=prefer)
    compile(code, name, "exec")
    assert "/tmp/ckpt" in code and (prefer in code or name == "START_EAGER")

"""Tests of the benchmark scripts' CPU-runnable parts."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module of its own (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location("%s_under_test" % name, BENCHMARKS / ("%s.py" % name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

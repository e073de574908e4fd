"""Loading a benchmark script as a module, as `python benchmarks/NAME.py` would find its imports (the harness)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (its `main` not run), with benchmarks/ on sys.path for `import harness`."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if name == "harness":  # the one the scripts import
        return importlib.import_module("harness")
    spec = importlib.util.spec_from_file_location("bench_%s" % name, BENCHMARKS / ("%s.py" % name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

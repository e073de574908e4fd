"""The test suite's own shape: folders that mirror the package, and a `slow` mark that cannot go stale."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import GUARDED, SECONDS, TOGETHER

TESTS = Path(__file__).resolve().parents[1]
PKG = TESTS.parent / "laya_aot"


def test_every_test_file_sits_in_an_area_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py")), "tests/ holds only conftest.py and helpers"
    areas = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    subpackages = {p.parent.name for p in PKG.glob("*/__init__.py")} - {"configs"}
    assert subpackages <= areas, "a package folder without its test folder: %s" % sorted(subpackages - areas)


def test_no_test_folder_shadows_an_installed_package():
    """transformers 5.25 imports `kernels` (a dependency now) when it is installed: with tests/ itself on sys.path,
    tests/kernels answered instead and laya's model could not be built. tests/ is a package, so its folders import
    as tests.kernels, tests.runtime and so on; none may be found under a top-level name."""
    assert (TESTS / "__init__.py").is_file()
    for folder in sorted(p.parent for p in TESTS.glob("*/__init__.py")):
        spec = importlib.util.find_spec(folder.name)
        assert spec is None or TESTS not in Path(spec.origin or "/").resolve().parents, \
            "`import %s` finds the test folder %s: tests/ is on sys.path" % (folder.name, folder)


@pytest.mark.parametrize("module, name, what", GUARDED)
def test_each_way_to_build_is_guarded(module, name, what):
    fn = getattr(importlib.import_module(module), name)
    assert getattr(fn, "refuses_outside_slow", None) == what, \
        "%s.%s is not wrapped by tests/conftest.py (renamed?): update GUARDED" % (module, name)


def test_the_units_of_work_name_tests_that_exist():
    """SECONDS and TOGETHER (how the workers share the suite) name modules and test functions that are there."""
    missing = []
    for name in [*SECONDS, *TOGETHER, *TOGETHER.values()]:
        module, _, function = name.partition("::")
        path = TESTS.parent / module
        if not path.is_file() or (function and "def %s(" % function.split("[", 1)[0] not in path.read_text()):
            missing.append(name)
    assert SECONDS and not missing, "tests/conftest.py names a test that is not there (renamed?): %s" % missing


def test_a_test_not_marked_slow_cannot_export():
    import torch

    with pytest.raises(AssertionError, match="is not marked slow"):
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))

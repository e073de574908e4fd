"""The test suite's own shape: folders that mirror the package, and a `slow` mark that cannot go stale."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import GUARDED, SECONDS, TOGETHER

TESTS = Path(__file__).resolve().parents[1]
PKG = TESTS.parent / "laya_aot"


def test_every_test_file_sits_in_an_area_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py")), "tests/ holds only conftest.py and helpers"
    areas = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    subpackages = {p.parent.name for p in PKG.glob("*/__init__.py")} - {"configs"}
    assert subpackages <= areas, "a package folder without its test folder: %s" % sorted(subpackages - areas)


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

"""The route tables are what to re-check on a laya upgrade: every private laya name the package touches is in one."""
from __future__ import annotations

import ast

from laya_aot import laya_internals as laya_api
from tests.project.test_architecture import (
    INTERNALS,
    MODULES,
    _laya_private_names,
    _own_private_names,
    _private_laya_uses,
)


def _touched_inside():
    laya_names = _laya_private_names()
    ours = set()
    for m, path in MODULES.items():
        if not m.startswith(INTERNALS):
            ours |= _own_private_names(ast.parse(path.read_text(encoding="utf-8")))
    return {m: {n for _, n in _private_laya_uses(path, laya_names, ours)}
            for m, path in MODULES.items() if m.startswith(INTERNALS)}


def test_every_private_laya_name_the_package_touches_is_in_a_route_table():
    """`check(routes=...)` reports a laya that lacks a name before anything runs, so a name missing from the tables
    would fail mid-call instead; names the package works without are listed as optional."""
    tables = {path.split(".")[-1] for _, path in laya_api.MODULE_NAMES}
    tables |= set(laya_api.AGENT_NAMES) | set(laya_api.ROUTER_NAMES) | set(laya_api.APP_CELLS)
    touched = _touched_inside()
    assert touched["laya_aot.laya_internals.host_path"] >= {"_decode_answers"}, touched  # the scan sees them
    untabled = {m: sorted(names - tables - set(laya_api.OPTIONAL_NAMES)) for m, names in touched.items()}
    assert not any(untabled.values()), "private laya names in no route table: %s" % untabled


def test_optional_names_are_all_used():
    used = set().union(*_touched_inside().values())
    assert set(laya_api.OPTIONAL_NAMES) <= used, sorted(set(laya_api.OPTIONAL_NAMES) - used)


def test_each_route_module_is_reached_through_the_package():
    """Callers import the package (`laya_aot.laya_internals`), never a route module: the split stays internal."""
    for m, path in MODULES.items():
        if m.startswith(INTERNALS):
            continue
        text = path.read_text(encoding="utf-8")
        for route in ("core", "routes", "serve", "host_path"):
            assert "laya_internals.%s" % route not in text and "laya_internals import %s" % route not in text, \
                "%s imports laya_internals.%s directly" % (m, route)
    assert set(laya_api.__all__) == {n for n in dir(laya_api) if not n.startswith("_")} - {
        "core", "routes", "serve", "host_path"}

"""The package's shape, read from its source: layers, no import cycles, one place per artifact kind."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path
from typing import Dict, Set

import pytest

from laya_aot import kinds
from laya_aot.config import StagesConfig

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "laya_aot"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(module: str, level: int, name: str, importer: str) -> str:
    if level:
        base = importer.split(".")
        is_pkg = MODULES[importer].name == "__init__.py"
        base = base[: len(base) - level + (1 if is_pkg else 0)]
        return ".".join(base + ([name] if name else []))
    return name


def imports_of(module: str) -> Set[str]:
    """Every package module `module` imports, at the top or inside a function: `from .x import y` counts
    as importing `x.y` when that is a module, else `x`."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module or "", module)
            targets = ["%s.%s" % (base, a.name) if "%s.%s" % (base, a.name) in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import laya_aot.kinds.aoti` names a module; trim attributes
                t = t.rpartition(".")[0]
            if t.startswith("laya_aot") and t != module:
                out.add(t)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def reachable(start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_runtime_and_pipeline_never_reach_each_other():
    for m in MODULES:
        if m.startswith("laya_aot.runtime"):
            bad = sorted(x for x in reachable(m) if x.startswith("laya_aot.pipeline"))
            assert not bad, "%s reaches the build pipeline through %s" % (m, bad)
        if m.startswith("laya_aot.pipeline"):
            bad = sorted(x for x in reachable(m) if x.startswith("laya_aot.runtime"))
            assert not bad, "%s reaches the runtime through %s" % (m, bad)


COMMANDS_LAYER = {"laya_aot.cli", "laya_aot.cli.usage", "laya_aot.cli.build_help", "laya_aot.cli.hub_reach",
                  "laya_aot.cli.__main__", "laya_aot.commands", "laya_aot.serve", "laya_aot.serve_batching",
                  "laya_aot.serve_workers", "laya_aot.serve_ray"}


def test_commands_are_imported_by_commands_only_and_the_server_never_reaches_the_build():
    for m in MODULES:
        if m not in COMMANDS_LAYER:
            bad = sorted(GRAPH[m] & COMMANDS_LAYER)
            assert not bad, "%s (below the commands layer) imports %s" % (m, bad)
    bad = sorted(x for x in reachable("laya_aot.serve") if x.startswith("laya_aot.pipeline"))
    assert not bad, "laya-aot serve reaches the build pipeline through %s" % bad


# layers below the halves, and what they must never reach (docs/architecture.md's table)
BELOW_THE_HALVES = {
    "laya_aot.distribution": ("laya_aot.pipeline", "laya_aot.runtime", "laya_aot.cli", "laya_aot.commands"),
    "laya_aot.kinds.usable": ("laya_aot.pipeline", "laya_aot.runtime", "laya_aot.distribution"),
    "laya_aot.staging": ("laya_aot.pipeline", "laya_aot.runtime", "laya_aot.distribution", "laya_aot.kinds"),
}


@pytest.mark.parametrize("layer", sorted(BELOW_THE_HALVES))
def test_layers_below_the_halves_never_reach_up(layer):
    mods = [m for m in MODULES if m == layer or m.startswith(layer + ".")]
    assert mods, layer
    for m in mods:
        bad = sorted(x for x in reachable(m) if x.startswith(BELOW_THE_HALVES[layer]))
        assert not bad, "%s reaches %s" % (m, bad)
    # the loader turns hf:// and packs into a directory through the distribution layer
    assert "laya_aot.distribution.fetch" in GRAPH["laya_aot.runtime.loader"]


# the shared layer (docs/architecture.md's table): what both halves need, reaching no layer above it; of the kinds
# layer only each kind's torch-free settings module, which the build schema (config.py) composes
SHARED = ("errors", "config", "demo", "progress", "staging", "manifest", "bundle_format", "verification", "numerics",
          "modeling", "padding", "variant", "checkpoint", "files", "laya_internals", "tokenizer_snapshot", "kernels",
          "_version")
ABOVE_SHARED = ("laya_aot.pipeline", "laya_aot.runtime", "laya_aot.distribution", "laya_aot.kinds", "laya_aot.probe",
                *sorted(COMMANDS_LAYER))


def _above_shared(module: str) -> bool:
    if module.startswith("laya_aot.kinds.") and module.endswith("_settings"):
        return False
    return any(module == up or module.startswith(up + ".") for up in ABOVE_SHARED)


def test_the_shared_layer_never_reaches_up():
    assert all(any(m == "laya_aot." + s or m.startswith("laya_aot.%s." % s) for m in MODULES) for s in SHARED)
    for s in SHARED:
        for m in (m for m in MODULES if m == "laya_aot." + s or m.startswith("laya_aot.%s." % s)):
            bad = sorted(x for x in reachable(m) if _above_shared(x))
            assert not bad, "%s (shared layer) reaches %s" % (m, bad)
    # a check that cannot fail proves nothing: the schema does reach the kinds' settings modules, which are allowed
    assert "laya_aot.kinds.exported_program_settings" in reachable("laya_aot.config")
    assert _above_shared("laya_aot.kinds.aoti") and _above_shared("laya_aot.cli.usage")


def test_every_top_level_module_is_in_a_layer_and_there_are_at_most_20():
    """The top level holds the layers' entry points and the shared modules; everything else lives in a package."""
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
    layered = set(SHARED) | {m.rpartition(".")[2] for m in COMMANDS_LAYER} | {"probe"}
    assert not sorted(set(top) - layered), "top-level modules in no layer: %s" % sorted(set(top) - layered)
    assert len(top) + 1 <= 20, "%d top-level modules (with __init__.py): %s" % (len(top) + 1, top)


def test_no_import_cycles():
    cycles = sorted(m for m in MODULES if m in reachable(m))
    assert not cycles, "modules that import themselves through others: %s" % cycles


def test_the_graph_sees_lazy_imports():
    # a check that cannot fail proves nothing: the loader imports the probe inside a function only
    assert "laya_aot.probe" in GRAPH["laya_aot.runtime.loader"]
    # the kinds package loads its registry inside its module __getattr__ only
    assert "laya_aot.kinds.registry" in GRAPH["laya_aot.kinds"]
    assert "laya_aot.kinds.aoti" in GRAPH["laya_aot.kinds.registry"]


def _string_literals(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


# the same word meaning something else: the `tilelang` extra and package, which laya's TileLang modules import
# (laya_internals.require names the extra); `laya.load`'s own `compile=` keyword (laya_internals.accelerated)
OTHER_MEANING = {("tilelang", "laya_aot.laya_internals.routes"), ("compile", "laya_aot.laya_internals.core")}


@pytest.mark.parametrize("name", kinds.NAMES)
def test_each_kind_is_spelled_in_one_module(name):
    where = sorted(_module_name(p) for p in PKG.rglob("*.py") if name in set(_string_literals(p))
                   and (name, _module_name(p)) not in OTHER_MEANING)
    assert where == [kinds.get(name).build.__module__], "the kind %r is spelled out in %s" % (name, where)


@pytest.mark.parametrize("name", kinds.NAMES)
def test_a_kinds_module_is_named_after_its_stage(name):
    """One name per kind for its module, its stage and its `stages.<stage>` switch; a kind whose manifest name
    differs (`compile`, stage `inductor_cache`) says so in its own module only."""
    kind = kinds.get(name)
    assert kind.build.__module__ == "laya_aot.kinds.%s" % kind.stage


def test_each_kinds_settings_live_beside_it_in_a_module_the_schema_can_import():
    """A kind's own build settings are the `BuildConfig` section its `config_section` names, typed by a dataclass
    of `kinds/<stage>_settings.py`; every section typed there belongs to one kind. Those modules import nothing
    of the package, so config.py (checked before torch is imported) composes them without reaching a kind."""
    from laya_aot.config import BuildConfig

    hints = typing.get_type_hints(BuildConfig)
    owned = {k.config_section: k for k in kinds.REGISTRY if k.config_section}
    for section, kind in owned.items():
        assert section in hints, "%s: BuildConfig has no %r section" % (kind.name, section)
        assert hints[section].__module__ == "laya_aot.kinds.%s_settings" % kind.stage, (kind.name, hints[section])
    from_kinds = {f for f, t in hints.items() if getattr(t, "__module__", "").startswith("laya_aot.kinds")}
    assert from_kinds == set(owned), "BuildConfig sections typed in a kind's module but claimed by no kind"
    settings = [m for m in MODULES if m.startswith("laya_aot.kinds.") and m.endswith("_settings")]
    assert sorted(settings) == sorted("laya_aot.kinds.%s_settings" % k.stage for k in owned.values())
    for m in settings:
        assert not GRAPH[m], "%s imports %s: the schema must reach no kind module" % (m, sorted(GRAPH[m]))
    reached = sorted(x for x in reachable("laya_aot.config") if x.startswith("laya_aot.kinds"))
    assert reached == sorted(settings), reached


def test_the_schema_and_the_kinds_package_import_no_torch():
    p = subprocess.run([sys.executable, "-c", "import sys, laya_aot.config, laya_aot.kinds; "
                        "print(sorted(m for m in ('torch', 'laya') if m in sys.modules))"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.split() == ["[]"], p.stdout + p.stderr


def test_no_module_is_named_after_a_builtin():
    import builtins

    shadowing = sorted(m for m, p in MODULES.items() if p.stem in dir(builtins))
    assert not shadowing, shadowing


def test_registry_gives_every_kind_build_load_and_facts():
    switches = {f.name for f in dataclasses.fields(StagesConfig)}
    assert len(set(kinds.NAMES)) == len(kinds.REGISTRY)
    assert kinds.REGISTRY[0] is kinds.PORTABLE and not kinds.PORTABLE.optional
    for k in kinds.REGISTRY:
        assert callable(k.build) and callable(k.load) and callable(k.needs) and callable(k.variant), k.name
        assert isinstance(k.order, int) and isinstance(k.native, bool) and isinstance(k.verified_at_build, bool)
        assert (k.probe_env is not None) == k.native, "%s: native kinds say what a probe child loads" % k.name
        if k.optional:
            assert k.stage in switches, "%s: stages.%s is not a config switch" % (k.name, k.stage)
    assert set(kinds.RUNTIME_ORDER) == {k.name for k in kinds.REGISTRY if k.serves}
    with pytest.raises(KeyError, match="unknown artifact kind 'tensorrt'"):
        kinds.get("tensorrt")


def test_no_folder_named_build_runtime_kernels_at_the_top():
    for name in ("build", "runtime", "kernels"):
        assert not (ROOT / ("%s.py" % name)).exists() and not (ROOT / name / "__init__.py").exists()
    assert not (PKG / "build").exists(), "ruff and pytest skip folders named build by default"


def test_ruff_check_passes():
    ruff = Path(sys.executable).with_name("ruff")
    cmd = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    p = subprocess.run(cmd + ["check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def _error_classes():
    """Every exception class the package defines (from the source): (module, class name)."""
    out = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Refused", "Missing", "Forbidden",
                                                                      "Unavailable", "Incompatible", "NotFound")):
                out.append((m, node.name))
    return out


def test_every_public_error_is_a_laya_aot_error_and_keeps_its_builtin_base():
    import importlib

    from laya_aot import LayaAotError

    found = _error_classes()
    assert len(found) >= 10, found
    for m, name in found:
        if name == "LayaAotError":
            continue
        cls = getattr(importlib.import_module(m), name)
        assert issubclass(cls, LayaAotError), "%s.%s is not under laya_aot.LayaAotError" % (m, name)
        builtin = (RuntimeError, ValueError, TypeError, IndexError)
        assert issubclass(cls, builtin), "%s.%s lost its builtin base" % (m, name)
    from laya_aot.checkpoint import CheckpointNotFound
    from laya_aot.runtime.backend import TokenIdError

    assert issubclass(CheckpointNotFound, FileNotFoundError)  # `except FileNotFoundError` around load() still works
    assert issubclass(TokenIdError, IndexError)  # what laya's own forward raises for such an id


def _calls(module: str, name: str) -> bool:
    """Whether `module`'s source calls a function named `name` (`name(...)` or `x.name(...)`)."""
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                return True
    return False


@pytest.mark.parametrize("module", ["laya_aot.pipeline.stages", "laya_aot.runtime.trial", "laya_aot.commands"])
def test_build_loader_and_verify_command_call_the_one_verification(module):
    assert "laya_aot.verification" in GRAPH[module], "%s does not import laya_aot.verification" % module
    assert _calls(module, "verify_artifact"), "%s does not call verification.verify_artifact" % module


def test_only_verification_runs_an_artifact_against_its_rule():
    """verify_runner (the cases, the rule, the decision statement) is verification.verify_artifact's own step."""
    users = sorted(m for m in MODULES if m != "laya_aot.verification"
                   and (_calls(m, "verify_runner") or _calls(m, "rule_for") or _calls(m, "EagerFigures")))
    assert not users, "these modules verify an artifact themselves instead of calling verify_artifact: %s" % users


@pytest.mark.parametrize("name, owner", [
    ("verify_artifact", "laya_aot.verification"), ("usable_here", "laya_aot.kinds.usable"),
    ("default_device", "laya_aot.kinds.usable"), ("staged", "laya_aot.staging"),
    ("may_replace", "laya_aot.staging"),
])
def test_each_decision_is_defined_once(name, owner):
    where = sorted(m for m, path in MODULES.items()
                   if any(isinstance(n, ast.FunctionDef) and n.name == name
                          for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))))
    assert where == [owner], "%s is defined in %s" % (name, where)


def test_no_second_staging_transaction_or_default_device():
    """staging.staged is the one new/publish/discard, for bundles and the demo checkpoint; usable.default_device
    the one cuda-or-cpu default; checkpoint.mismatch the one comparison of a bundle's fingerprint with a
    checkpoint's."""
    for m, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if m != "laya_aot.staging":
            assert "new_staging(" not in text and ".publish(" not in text, "%s stages a bundle itself" % m
            # a directory assembled beside its destination and renamed into place (make-demo's checkpoint too)
            assert not _calls(m, "mkdtemp"), "%s stages a directory itself (staging.staged)" % m
        if m != "laya_aot.kinds.usable":
            assert '"cuda" if torch.cuda.is_available() else "cpu"' not in text, "%s picks a default device" % m
        # merge compares two parts' fingerprints with each other, not a bundle's with a checkpoint
        if m not in ("laya_aot.checkpoint", "laya_aot.distribution.merge"):
            assert "fingerprint.sha256 !=" not in text and "fingerprint.sha256 ==" not in text, \
                "%s compares a bundle's fingerprint itself (checkpoint.mismatch)" % m


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.AST) -> Set[str]:
    """The `_`-prefixed names a module defines itself: functions, classes, arguments, module and local names and
    `self._x`/`cls._x` attributes. An assignment to another object's attribute (`agent._x = ...`) defines nothing."""
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for x in ast.walk(target):
                    if isinstance(x, ast.Name):
                        out.add(x.id)
                    elif isinstance(x, ast.Attribute) and getattr(x.value, "id", None) in ("self", "cls"):
                        out.add(x.attr)
    return {n for n in out if _private(n)}


def _laya_private_names() -> Set[str]:
    import laya

    out: Set[str] = set()
    for path in Path(laya.__file__).parent.rglob("*.py"):
        try:
            out |= _own_private_names(ast.parse(path.read_text(encoding="utf-8")))
        except SyntaxError:
            continue
    return out


INTERNALS = "laya_aot.laya_internals"


def _private_laya_uses(path: Path, laya_names: Set[str], ours: Set[str]):
    """(line, name) of each private laya name `path` touches: imported from laya, read off `laya.x`, read or set on
    an `agent`/`router`, or any attribute or string (getattr, `__dict__[...]`) naming one of laya's private names
    that the package itself never defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "laya" and not node.level:
            yield from ((node.lineno, a.name) for a in node.names if _private(a.name))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("laya", "agent", "router"):
                yield node.lineno, node.attr
            elif node.attr in laya_names and node.attr not in ours:
                yield node.lineno, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in laya_names \
                and node.value not in ours:
            yield node.lineno, node.value


def test_only_laya_internals_touches_laya_private_names():
    """laya's `_`-prefixed names (its Agent's `_gate`, `_restore_runtime`, `_decode_answers`, the app's
    `_run_inference`, ...) are read and patched in laya_aot/laya_internals/ only: the one package to re-check on a
    laya upgrade."""
    laya_names = _laya_private_names()
    outside = {m: p for m, p in MODULES.items() if m != INTERNALS and not m.startswith(INTERNALS + ".")}
    ours: Set[str] = set()
    for path in outside.values():
        ours |= _own_private_names(ast.parse(path.read_text(encoding="utf-8")))
    found = {m: sorted(set(_private_laya_uses(p, laya_names, ours))) for m, p in outside.items()}
    found = {m: uses for m, uses in found.items() if uses}
    assert not found, "laya private names touched outside laya_internals: %s" % found
    # a check that cannot fail proves nothing: the package itself touches them, and the scan sees it
    inside = {n for m, p in MODULES.items() if m.startswith(INTERNALS)
              for _, n in _private_laya_uses(p, laya_names, ours)}
    assert {"_gate", "_restore_runtime", "_decode_answers", "_run_inference", "_TOKENIZERS"} <= inside, sorted(inside)


def test_one_reader_of_a_checkpoints_weights():
    """checkpoint.Weights is the one reader of model.safetensors (the artifacts' constants, the thin agent's meta
    shell, the probe child's stand-ins, the build's key list), and checkpoint.WEIGHTS_FILE the one spelling of its
    name; its safetensors dtype table is the one table."""
    readers = sorted(m for m in MODULES if _calls(m, "safe_open"))
    assert readers == ["laya_aot.checkpoint"], readers
    spelled = sorted(m for m, p in MODULES.items() if "model.safetensors" in set(_string_literals(p)))
    assert spelled == ["laya_aot.checkpoint"], spelled
    tables = sorted(m for m, p in MODULES.items() if '"BF16"' in p.read_text(encoding="utf-8"))
    assert tables == ["laya_aot.checkpoint"], tables

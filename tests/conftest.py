"""Shared fixtures: demo checkpoints and bundles made once per test session (AOTInductor takes ~20 s), and
the `slow` and `heavy` markers.

`slow` marks what builds: a bundle, an AOTInductor package, an Inductor cache, TileLang kernels, a
checkpoint by training, or a build in a child process (and the few other tests that take tens of seconds,
each saying why). Any test whose fixtures include one of BUILDS is marked here; a test that builds in its own
body carries `@pytest.mark.slow`. A test left unmarked that builds in this process fails, naming what it
started (`_Guard`), so `python -m pytest -m "not slow"` stays the fast loop it claims to be.
`heavy` marks the long reliability runs: they run only when `-m` names `heavy`.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no probe child started ahead (probe.start_ahead) by whichever test first looks up `laya_aot.load`: that would
# depend on the tests' order; tests/runtime/test_probe_ahead.py turns it on where it checks it
os.environ.setdefault("LAYA_AOT_PROBE_AHEAD", "0")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Probe verdicts and digests go to a per-session directory, never the user's ~/.cache."""
    os.environ["LAYA_AOT_CACHE_DIR"] = str(tmp_path_factory.mktemp("laya-aot-cache"))
    yield


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo", "tiny", seed=0)


@pytest.fixture(scope="session")
def alt_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "alt", "tiny-alt", seed=3)


def build_bundle(ckpt: Path, out: Path, *overrides: str) -> dict:
    from laya_aot.config import compose
    from laya_aot.pipeline import build

    cfg = compose(["checkpoint.path=%s" % ckpt, "output_dir=%s" % out, *overrides])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(cfg).bundle.to_dict()


@pytest.fixture(scope="session")
def demo_bundle(demo_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "demo"
    build_bundle(demo_ckpt, out)
    return out


@pytest.fixture(scope="session")
def alt_bundle(alt_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "alt"
    build_bundle(alt_ckpt, out)
    return out


# the exported program and ONNX only, 8 rows: a real bundle built in seconds (the safety and archive tests)
SMALL = ["stages.aoti=false", "stages.inductor_cache=false", "export.max_rows=8"]


@pytest.fixture(scope="session")
def small_bundle(demo_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "small"
    build_bundle(demo_ckpt, out, *SMALL)
    return out


@pytest.fixture
def bundle_copy(demo_bundle, tmp_path) -> Path:
    """A private copy of the demo bundle that a test may damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(demo_bundle, dst)
    return dst


# fixtures that build a bundle, compile a package, train a checkpoint or start builds in child processes; a
# test that uses one (directly or through another fixture) is marked slow
BUILDS = {
    "demo_bundle", "alt_bundle", "small_bundle", "bundle_copy",  # this file
    "parts",             # distribution/test_distribution.py: two `laya-aot build` processes
    "tiny_build",        # kernels/test_kernels.py: the tiny demo's TileLang kernels for two architectures
    "eager_and_bundle",  # pipeline/test_matrix.py: a bundle per matrix checkpoint
    "multirun",          # pipeline/test_multirun.py: a Ray sweep of four builds
    "bf16_bundle",       # shared/test_precision.py: a bf16 AOTInductor bundle
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark what builds slow; leave `heavy` out unless `-m` names it (a `-m "not slow"` given on the command
    line replaces pyproject's `-m`, so the heavy runs are held back here rather than there)."""
    for item in items:
        if BUILDS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if "heavy" not in (config.option.markexpr or ""):
        heavy = [i for i in items if i.get_closest_marker("heavy")]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [i for i in items if not i.get_closest_marker("heavy")]


class _Guard:
    """Set while a test not marked slow sets up and runs: then exporting a program, packaging with
    AOTInductor, torch.compile, compiling a TileLang kernel and training a demo checkpoint raise in this
    process (a build in a child process is not seen here: such tests carry the mark themselves). The wrappers
    are installed once and stay, so a test's own monkeypatching of the same names undoes cleanly."""
    on = False


def _refused(what: str) -> None:
    raise AssertionError("this test %s but is not marked slow: mark it @pytest.mark.slow or use a fixture from "
                         "conftest.BUILDS" % what)


def _guarded(fn, what: str):
    def guarded(*args, **kwargs):
        if _Guard.on:
            _refused(what)
        return fn(*args, **kwargs)
    guarded.__wrapped__ = fn
    guarded.refuses_outside_slow = what
    return guarded


# what building means in this process: (module, attribute, what the refusal says)
GUARDED = [
    ("torch.export", "export", "exports a program (torch.export.export)"),
    ("torch", "compile", "compiles with torch.compile"),
    ("torch._inductor", "aoti_compile_and_package", "compiles an AOTInductor package"),
    ("laya_aot.demo_training", "train", "trains a demo checkpoint"),
    ("laya_aot.kernels.cross_compile", "_compile_one", "compiles a TileLang kernel"),
]


def _install_guard() -> None:
    """Wrap each GUARDED name once; a name that no longer exists is left out here and named by
    tests/project/test_layout.py, rather than failing every test of the session."""
    import importlib

    for module, name, what in GUARDED:
        try:
            mod = importlib.import_module(module)
            setattr(mod, name, _guarded(getattr(mod, name), what))
        except (ImportError, AttributeError):
            continue


def pytest_sessionstart(session):
    _install_guard()


@contextlib.contextmanager
def _guard(item):
    _Guard.on = item.get_closest_marker("slow") is None
    try:
        yield
    finally:
        _Guard.on = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guard(item):
        return (yield)

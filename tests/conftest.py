"""Shared fixtures: demo checkpoints and bundles made once per test session (AOTInductor takes ~20 s), and
the `slow` and `heavy` markers.

`slow` marks what builds: a bundle, an AOTInductor package, an Inductor cache, TileLang kernels, a
checkpoint by training, or a build in a child process (and the few other tests that take tens of seconds,
each saying why). Any test whose fixtures include one of BUILDS is marked here; a test that builds in its own
body carries `@pytest.mark.slow`. A test left unmarked that builds in this process fails, naming what it
started (`_Guard`), so `python -m pytest -m "not slow"` stays the fast loop it claims to be.
`heavy` marks the long reliability runs: they run only when `-m` names `heavy`.

With pytest-xdist installed (the test extra installs it), a run that names no test file runs on WORKERS
worker processes (`-n 0` runs in this process, `-n N` on N): each worker is a session of its own, so the
session's demo checkpoints and bundles are made once for the whole run under a lock (`_made_once`), and the
tests of a module run in one worker, in order (`pytest_xdist_make_scheduler`), so that its fixtures are made
once too; the long units of work start first (SECONDS).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Tuple

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no probe child started ahead (probe.start_ahead) by whichever test first looks up `laya_aot.load`: that would
# depend on the tests' order; tests/runtime/test_probe_ahead.py turns it on where it checks it
os.environ.setdefault("LAYA_AOT_PROBE_AHEAD", "0")


# worker processes of a whole-suite run, when pytest-xdist is installed (2 cores: builds are mostly one core each)
WORKERS = 2


def _xdist_worker():
    """This worker's name under pytest-xdist (set by the worker before it imports this file), else None."""
    return os.environ.get("PYTEST_XDIST_WORKER")


if _xdist_worker() is not None:
    # one compute thread per worker (torch, and ONNX Runtime, which follows torch's count), before torch is
    # imported: two workers on two cores each spinning two threads ran the eager and ONNX phases 2-3x slower
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _shared_root(tmp_path_factory) -> Path:
    """The directory every worker of this run sees: the parent of the workers' own base directories."""
    root = tmp_path_factory.getbasetemp().parent / "shared"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Probe verdicts and digests go to a per-session directory, never the user's ~/.cache. Under pytest-xdist
    the TileLang kernel cache (otherwise inside that directory) is one for the whole run, as it is for a run in
    one process: a kernel compiled by one worker is not compiled again by the other."""
    os.environ["LAYA_AOT_CACHE_DIR"] = str(tmp_path_factory.mktemp("laya-aot-cache"))
    if _xdist_worker() is not None:
        os.environ.setdefault("LAYA_AOT_KERNEL_CACHE", str(_shared_root(tmp_path_factory) / "tilelang-kernels"))
    yield


def _made_once(tmp_path_factory, folder: str, name: str, make: Callable[[Path], object]) -> Path:
    """`make(folder/name)` once for the run; returns that path. In one process: a new directory of the session,
    as a session fixture makes it. Under pytest-xdist: the first worker to need it makes it in the run's shared
    directory while holding a lock, and the other workers wait for it and use the same one."""
    if _xdist_worker() is None:
        out = tmp_path_factory.mktemp(folder) / name
        make(out)
        return out
    root = _shared_root(tmp_path_factory)
    out, done = root / ("%s-%s" % (folder, name)) / name, root / ("%s-%s.done" % (folder, name))
    with open(root / ("%s-%s.lock" % (folder, name)), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            if out.parent.exists():  # what a worker that failed to make it left
                shutil.rmtree(out.parent)
            out.parent.mkdir()
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return _made_once(tmp_path_factory, "ckpt", "demo", lambda out: make_checkpoint(out, "tiny", seed=0))


@pytest.fixture(scope="session")
def alt_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return _made_once(tmp_path_factory, "ckpt", "alt", lambda out: make_checkpoint(out, "tiny-alt", seed=3))


def build_bundle(ckpt: Path, out: Path, *overrides: str) -> dict:
    from laya_aot.config import compose
    from laya_aot.pipeline import build

    cfg = compose(["checkpoint.path=%s" % ckpt, "output_dir=%s" % out, *overrides])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(cfg).bundle.to_dict()


@pytest.fixture(scope="session")
def demo_bundle(demo_ckpt, tmp_path_factory) -> Path:
    """The default CPU build but for the frozen AOTInductor package, turned on (`aoti.cpu_frozen=true`, off by
    default): the tests of that package (its library, its load, its probe) use this bundle, at no build of their
    own. `alt_bundle` is the default build as it is."""
    return _made_once(tmp_path_factory, "bundles", "demo",
                      lambda out: build_bundle(demo_ckpt, out, "aoti.cpu_frozen=true"))


@pytest.fixture(scope="session")
def alt_bundle(alt_ckpt, tmp_path_factory) -> Path:
    """The second shape's bundle, the default build: one AOTInductor package (a second frozen package cost ~25 of
    the suite's CPU-seconds, issue 23)."""
    return _made_once(tmp_path_factory, "bundles", "alt", lambda out: build_bundle(alt_ckpt, out))


# the exported program and ONNX only, 8 rows: a real bundle built in seconds (the safety and archive tests); the
# program shipped (export.ship_program, off by default) so these bundles hold an artifact that never serves
SMALL = ["stages.aoti=false", "stages.inductor_cache=false", "export.max_rows=8", "export.ship_program=true"]


@pytest.fixture(scope="session")
def small_bundle(demo_ckpt, tmp_path_factory) -> Path:
    return _made_once(tmp_path_factory, "bundles", "small", lambda out: build_bundle(demo_ckpt, out, *SMALL))


# the decision suite of a 16-bit artifact verified on this CPU in a test build that checks something else (what
# an sm_90 build skips, its dtype, a sweep, a merge): 256 decisions instead of verify.tolerance.decisions' 2,048,
# and 128 near ties from 2,048 candidate rows instead of 512 from 8,192. fp16 runs slowly on a CPU: the full suite
# took 26 s of a 31 s sm_90 build of the tiny checkpoint, 256 take 5 s. The full suite and what it finds are
# checked on the bf16 CPU bundle (tests/numerics/test_precision.py), the near ties in tests/shared/test_faithful.py
FEW_DECISIONS = ("verify.tolerance.decisions=256", "verify.tolerance.near_ties=128",
                 "verify.tolerance.near_tie_pool=2048")


@pytest.fixture(scope="session")
def cuda_bundle(tmp_path_factory) -> Callable[[Optional[str]], Tuple[Path, Path]]:
    """`cuda_bundle(amp_dtype)`: (checkpoint, bundle) of a decisive tiny checkpoint (head gain 8) with that
    amp_dtype (None: left out), built for sm_90 on this CPU machine without ONNX: the exported program in laya's
    CUDA dtype, shipped (export.ship_program) and verified here against laya eager in that dtype (on
    FEW_DECISIONS), and TileLang kernels cross-compiled for sm_90a.
    Each made once for the run: tests/numerics/test_precision.py checks its dtypes, tests/pipeline/test_build.py
    (amp_dtype absent) the stages a CPU machine skips and the kernels' hashes."""
    from laya_aot.demo import demo_shape, make_checkpoint

    def make(root: Path, amp: Optional[str]) -> None:
        root.mkdir()
        ckpt = make_checkpoint(root / "ckpt", demo_shape("tiny", amp_dtype=amp, head_gain=8.0), seed=2)
        build_bundle(ckpt, root / "bundle", "target=sm_90", "stages.onnx=false", "export.ship_program=true",
                     *FEW_DECISIONS)

    made = {}

    def get(amp: Optional[str]) -> Tuple[Path, Path]:
        pytest.importorskip("tilelang", reason="the tilelang extra is not installed")
        if amp not in made:
            made[amp] = _made_once(tmp_path_factory, "cuda", amp or "absent", lambda out: make(out, amp))
        return made[amp] / "ckpt", made[amp] / "bundle"

    return get


@pytest.fixture
def bundle_copy(demo_bundle, tmp_path) -> Path:
    """A private copy of the demo bundle that a test may damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(demo_bundle, dst)
    return dst


@pytest.fixture
def other_facts_bundle(demo_bundle, tmp_path) -> Path:
    """The demo bundle as a build on a machine with other facts (another CPU ISA, GPU or torch) would ship it: no
    artifact's probe verdict is this machine's, so a first start here runs the probe child."""
    dst = tmp_path / "other-facts-bundle"
    shutil.copytree(demo_bundle, dst)
    data = json.loads((dst / "bundle.json").read_text())
    for art in data["artifacts"]:
        if art.get("probe_verdict"):
            art["probe_verdict"]["key"] = hashlib.sha256(b"another machine " + art["name"].encode()).hexdigest()
    (dst / "bundle.json").write_text(json.dumps(data))
    return dst


def another_torch() -> str:
    """A torch version this process does not have (the minor version before its own)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "%d.%d.0" % ((major, minor - 1) if minor else (major - 1, 99))


def built_with_torch(bundle: Path, version: str) -> List[str]:
    """Make `bundle`'s manifest say its AOTInductor packages were built with torch `version` (their needs and
    variant, as a build under that torch writes them); returns their names. The files are untouched: only the
    manifest changes, and with it its sha256."""
    from laya_aot.variant import torch_tag

    data = json.loads((bundle / "bundle.json").read_text())
    names = []
    for art in data["artifacts"]:
        if art["kind"] == "aoti":
            art["needs"]["torch"] = version
            art["variant"] = torch_tag(version) + art["variant"][art["variant"].index("-"):]
            names.append(art["name"])
    (bundle / "bundle.json").write_text(json.dumps(data))
    return names


def readme_serving_blocks() -> Tuple[List[str], List[str]]:
    """The README's Serving section: the block that builds and serves, and the block that asks."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("\n## Serving\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [[line for line in b.splitlines() if line and not line.startswith("#")] for b in blocks]
    serve = next(c for c in commands if any(line.endswith("laya-aot serve") for line in c))
    ask = next(c for c in commands if all(line.startswith("curl ") for line in c))
    return serve, ask


def readme_python(heading: str) -> str:
    """The Python block of the README's section whose heading is `heading` (`## Serving`, `### Ask typed
    questions`), as written."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("\n%s\n" % heading) + 1:]
    level = heading.split(" ", 1)[0]
    ends = [i for i in (section.find("\n%s " % ("#" * n), 1) for n in range(2, len(level) + 1)) if i != -1]
    section = section[:min(ends)] if ends else section
    [block] = re.findall(r"```python\n(.*?)```", section, re.S)
    return block


class ReadmeDemo(NamedTuple):
    """Where the README's `laya-aot demo` ran (a fresh directory, as a fresh clone), how it ended, its output."""

    dir: Path
    returncode: int
    output: str


@pytest.fixture(scope="session")
def readme_demo(tmp_path_factory) -> ReadmeDemo:
    """The README serving block's command after its install, `laya-aot demo`, run as written in a fresh
    directory (the environment is already made): it trains the demo checkpoint and builds its bundle there.
    Run once: the README serving test serves from that directory, and the demo-training test checks the
    checkpoint it trained (and trains one itself to compare)."""
    (build_line, _), _ = readme_serving_blocks()
    build = build_line.split(" && ", 1)[1]
    venv_bin = shlex.quote(str(Path(sys.executable).parent)) + "/"
    env = dict(os.environ, PYTHONUNBUFFERED="1", LAYA_THREADS="1")

    def make(clone: Path) -> None:
        clone.mkdir()
        p = subprocess.run(["bash", "-c", build.replace(".venv/bin/", venv_bin)], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=1200)
        (clone.parent / "run.json").write_text(json.dumps({"returncode": p.returncode,
                                                           "output": p.stdout[-3000:] + p.stderr[-3000:]}))

    clone = _made_once(tmp_path_factory, "readme", "clone", make)
    run = json.loads((clone.parent / "run.json").read_text())
    return ReadmeDemo(clone, run["returncode"], run["output"])


# fixtures that build a bundle, compile a package, train a checkpoint or start builds in child processes; a
# test that uses one (directly or through another fixture) is marked slow
BUILDS = {
    "demo_bundle", "alt_bundle", "small_bundle", "bundle_copy",  # this file
    "parts",             # distribution/test_distribution.py: two `laya-aot build` processes
    "tiny_build",        # kernels/test_kernels.py: the tiny demo's TileLang kernels for two architectures
    "eager_and_bundle",  # pipeline/test_matrix.py: a bundle per matrix checkpoint
    "faulty_build",      # pipeline/test_build.py: a build with an ONNX fault and a program-load fault
    "multirun",          # pipeline/test_multirun.py: a Ray sweep of two builds
    "two_dtype_bundle",  # numerics/test_precision.py: fp32 and bf16 AOTInductor packages
    "bf16_bundle",       # numerics/test_precision.py: the bf16 half of two_dtype_bundle
    "cuda_bundle",       # this file: sm_90 bundles (16-bit exported program, TileLang kernels) of a tiny checkpoint
    "readme_demo",       # this file: `laya-aot demo` in a fresh directory (trains the demo checkpoint, builds)
}


# Units of work under pytest-xdist. The tests of a module run in one worker, in order, so that the module's
# fixtures are made once and a test that relies on an earlier one of its module still sees it. A key naming a
# test function in SECONDS makes each of its tests (each parameter) a unit of its own: it builds what it checks
# itself or takes it from a session fixture, and shares no module fixture with the rest of its module. TOGETHER
# puts a test in another unit, after that unit's tests in collection order, because it checks what they made
# (the other worker would wait for it under the session fixture's lock).
# SECONDS: roughly how long each long unit takes in a whole-suite run on the 2-core machine (--durations; only
# the order matters). The longest units start first and the short modules (any unit not listed) fill in at the
# end, so that neither worker idles while the other finishes a long one.
SECONDS = {
    "tests/pipeline/test_multirun.py": 110,               # the Ray sweep: two builds, after cuda_bundle(None)
    "tests/serve/test_serve.py": 170,                     # `laya-aot demo` in a fresh directory (conftest.readme_demo)
    "tests/numerics/test_precision.py": 135,                # bf16_bundle and what it serves
    "tests/pipeline/test_build.py": 80,                  # the alt bundle
    "tests/distribution/test_distribution.py": 90,        # two `laya-aot build` processes
    "tests/kernels/test_kernels.py": 85,                  # TileLang kernels for two architectures
    "tests/runtime/test_runtime.py": 80,
    "tests/pipeline/test_matrix.py::test_matrix_checkpoint_serves_from_the_bundle_like_eager": 40,
    "tests/numerics/test_precision.py::test_cuda_target_builds_in_lavas_dtype_tilelang_included": 60,
    # made by the sweep's fixture by the time it starts (or else 60)
    "tests/numerics/test_precision.py::test_cuda_target_builds_in_lavas_dtype_tilelang_included[None-float16]": 5,
    "tests/kinds/test_compile_artifact.py::test_a_cache_saved_under_other_inductor_config_fails_the_fresh_process_check":
        60,
    "tests/kinds/test_compile_artifact.py": 200,
    "tests/kinds/test_compile_artifact.py::test_a_precompiled_function_that_fails_the_fresh_process_check_ships_the_saved_cache":
        100,
    "tests/reliability/test_build_kills.py::test_builds_killed_mid_compile_leave_nothing_running_and_nothing_half_written":
        45,
    "tests/distribution/test_safety.py": 45,
    "tests/reliability/test_cache_fuzz.py": 45,          # 200 whole loads against damaged caches
    "tests/pipeline/test_build.py::test_aoti_failure_is_recorded_and_the_build_goes_on": 35,
    "tests/pipeline/test_build.py::test_onnx_failure_is_recorded_and_the_build_goes_on": 40,
    "tests/shared/test_progress.py": 27,
    "tests/reliability/test_build_kills.py::test_two_builds_into_one_output_at_once": 25,
    "tests/pipeline/test_multirun.py::test_a_failed_job_fails_the_multirun_after_the_others_ran": 25,
    "tests/pipeline/test_build.py::test_artifact_over_tolerance_is_marked_unusable_with_the_figure": 18,
    "tests/kernels/test_kernels.py::test_catalogue_is_exactly_what_fastlaya_requests": 15,
    "tests/pipeline/test_build.py::test_nothing_to_build_fails": 10,
}
TOGETHER = {
    # the checkpoint `laya-aot demo` trained (conftest.readme_demo)
    "tests/demo/test_demo.py::test_the_demo_command_checkpoint_is_trained_and_routes_its_states":
        "tests/serve/test_serve.py",
    # conftest.cuda_bundle(None)
    "tests/pipeline/test_build.py::test_cuda_target_on_a_cpu_machine_cross_compiles_tilelang":
        "tests/numerics/test_precision.py::test_cuda_target_builds_in_lavas_dtype_tilelang_included[None-float16]",
    # test_build.faulty_build
    "tests/pipeline/test_build.py::test_a_program_torch_cannot_load_back_is_not_shipped":
        "tests/pipeline/test_build.py::test_onnx_failure_is_recorded_and_the_build_goes_on",
}
_BY_MODULE = pytest.StashKey[bool]()  # set when pytest_cmdline_main chose the workers


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to (SECONDS, TOGETHER): its module, itself, or the unit it joins."""
    module, _, rest = nodeid.partition("::")
    function = "%s::%s" % (module, rest.split("[", 1)[0])
    if function in TOGETHER:
        return TOGETHER[function]
    return nodeid if function in SECONDS else module


def unit_seconds(unit: str) -> int:
    """SECONDS of a unit (0 for a short one); a test that is a unit of its own is known by its function."""
    module, _, rest = unit.partition("::")
    return SECONDS.get(unit, SECONDS.get("%s::%s" % (module, rest.split("[", 1)[0]), 0))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run that names no test file (the whole suite, or folders of it) runs on WORKERS pytest-xdist workers
    when that plugin is here and no `-n` or `--dist` was given; `-n 0` keeps it in this process."""
    opt = config.option
    if not config.pluginmanager.hasplugin("xdist") or _xdist_worker() is not None:
        return None
    if getattr(opt, "numprocesses", None) is not None or getattr(opt, "dist", "no") != "no" or opt.collectonly \
            or getattr(opt, "usepdb", False) or getattr(opt, "tx", None):
        return None
    if any(not os.path.isdir(arg.split("::")[0]) for arg in config.args):
        return None
    opt.numprocesses, opt.dist = WORKERS, "loadscope"
    config.stash[_BY_MODULE] = True
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's hook: the scheduler of a run that pytest_cmdline_main distributed. The units of work
    (`unit_of`), longest first (`unit_seconds`), each handed to whichever worker is about to run out."""
    if not config.stash.get(_BY_MODULE, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_longest_first", False):  # the first call: the queue is full, nothing handed out
                self._longest_first = True
                order = sorted(self.workqueue, key=lambda unit: -unit_seconds(unit))  # ties keep xdist's order
                self.workqueue = type(self.workqueue)((unit, self.workqueue[unit]) for unit in order)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # the next unit goes to a worker only when it is down to its last test (which a worker runs once
            # it knows what comes after it), not two tests ahead as LoadScopeScheduling does: a unit handed out
            # early waits behind a long test while the other worker may run out of work
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return ByUnit(config, log)


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
    ("laya_aot.demo.training", "train", "trains a demo checkpoint"),
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

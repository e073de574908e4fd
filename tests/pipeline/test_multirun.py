"""Builds at scale (issue 13): `laya-aot build -m` over checkpoints x targets through Hydra's Ray launcher.

One multirun on a local Ray cluster builds a checkpoint for two targets (the CPU artifacts, and TileLang
cross-compiled for sm_90a) into two partial bundles, one per job, which `laya-aot merge` joins into one bundle.
The jobs run in Ray worker processes, so this also checks that a job resolves the caller's relative paths and
that two jobs making the same demo checkpoint at once do not collide. A sweep over two checkpoints (one part
directory each) is the basic launcher's test below; the Ray sweep had four jobs, 125 s of the 2-core suite's
~700, until issue 23 asked for the whole suite in under 10 minutes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FEW_DECISIONS

pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the test extra installs hydra-ray-launcher")

CHECKPOINT = """defaults:
  - base_checkpoint
name: {name}
demo_shape: tiny
demo_seed: {seed}
demo_dir: shared-checkpoints
"""


def _cli(args, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    return subprocess.run([sys.executable, "-m", "laya_aot.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def multirun(tmp_path_factory, cuda_bundle) -> Path:
    # the sm_90 jobs cross-compile the tiny checkpoint's TileLang kernels: conftest.cuda_bundle(None) has compiled
    # the same ones into the run's kernel cache first, so that the two jobs, which would each compile them at the
    # same time in two Ray workers, take them from there (compiling is what tests/kernels checks; this, the sweep)
    if importlib.util.find_spec("tilelang") is not None:
        cuda_bundle(None)
    work = tmp_path_factory.mktemp("multirun")
    (work / "cfg" / "checkpoint").mkdir(parents=True)
    (work / "cfg" / "checkpoint" / "alpha.yaml").write_text(CHECKPOINT.format(name="alpha", seed=1))
    # the cpu and sm_90 jobs of the checkpoint make its demo checkpoint at the same time in two Ray workers.
    # 8 rows, not fewer: an sm_90 job verifies its fp16 program on the 2,048-decision suite in calls of up to
    # max_rows rows, which at 2 rows took 50 s a job instead of 30 s; on conftest.FEW_DECISIONS, which takes 5 s of
    # those 30 instead of 26 (every job: the parts of a checkpoint merge only with one tolerance)
    # no Ray dashboard: nothing here looks at it, and its processes took ~8 of the sweep's ~85 CPU seconds
    p = _cli(["build", "--config-dir", "cfg", "-m", "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
              "+hydra.launcher.ray.init.include_dashboard=false", "checkpoint=alpha", "target=cpu,sm_90",
              "stages.aoti=false", "stages.inductor_cache=false", "export.max_rows=8", *FEW_DECISIONS, "jobs=1"], work)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return work


def test_ray_multirun_builds_one_partial_bundle_per_job(multirun):
    parts = sorted(str(p.parent.relative_to(multirun)) for p in multirun.glob("artifacts/parts/*/*/bundle.json"))
    assert parts == ["artifacts/parts/alpha/cpu", "artifacts/parts/alpha/sm_90"]
    for part in parts:
        m = json.loads((multirun / part / "bundle.json").read_text())
        assert m["checkpoint"]["name"] == part.split("/")[2]
        kinds = {a["kind"] for a in m["artifacts"] if a["status"] in ("verified", "unverified")}
        assert ("tilelang" in kinds) == part.endswith("sm_90"), (part, kinds)
    # Hydra's own record of the sweep stays under artifacts/, not in the caller's directory
    assert not (multirun / "multirun").exists()
    assert list(multirun.glob("artifacts/.multirun/*/multirun.yaml"))


def test_partial_bundles_merge_into_one(multirun, demo_bundle):
    p = _cli(["merge", "artifacts/alpha", "artifacts/parts/alpha/cpu", "artifacts/parts/alpha/sm_90"], multirun,
             timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = json.loads((multirun / "artifacts" / "alpha" / "bundle.json").read_text())
    kinds = {a["kind"] for a in m["artifacts"]}
    assert {"onnx", "tilelang"} <= kinds, kinds
    # a part of another checkpoint (the demo checkpoint's bundle) is another model: it never merges
    p = _cli(["merge", "artifacts/mixed", "artifacts/parts/alpha/cpu", str(demo_bundle)], multirun, timeout=300)
    assert p.returncode != 0
    assert "fingerprint" in (p.stdout + p.stderr)
    assert not (multirun / "artifacts" / "mixed").exists()


@pytest.mark.slow  # a sweep of `laya-aot build` jobs
def test_a_failed_job_fails_the_multirun_after_the_others_ran(tmp_path):
    """A job that cannot build makes the sweep exit non-zero, naming the job; the other job still wrote its part."""
    (tmp_path / "cfg" / "checkpoint").mkdir(parents=True)
    (tmp_path / "cfg" / "checkpoint" / "good.yaml").write_text(CHECKPOINT.format(name="good", seed=1))
    (tmp_path / "cfg" / "checkpoint" / "gone.yaml").write_text(
        "defaults:\n  - base_checkpoint\nname: gone\npath: /nonexistent/checkpoint\n")
    p = _cli(["build", "--config-dir", "cfg", "-m", "checkpoint=gone,good", "target=cpu", "stages.aoti=false",
              "stages.inductor_cache=false", "export.max_rows=2", "jobs=1"], tmp_path)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "checkpoint=gone" in out and "/nonexistent/checkpoint" in out
    assert (tmp_path / "artifacts" / "parts" / "good" / "cpu" / "bundle.json").exists()
    assert not (tmp_path / "artifacts" / "parts" / "gone").exists()

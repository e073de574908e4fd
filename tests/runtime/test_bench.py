"""`laya-aot bench`: the artifacts timed on the machine that serves them, the ranking stored in the cache keyed by
bundle and machine (runtime/bench.py), and the loader ranking by it where one exists, saying so."""
from __future__ import annotations

import json
import time

import pytest

import laya_aot
from laya_aot import kinds
from laya_aot.bundle_format import bundle_sha256, read_bundle
from laya_aot.kinds.usable import here as here_for
from laya_aot.runtime import bench

pytestmark = pytest.mark.slow


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _here(demo_ckpt):
    from laya_aot import checkpoint as ckpt_mod

    return here_for(ckpt_mod.read_config(demo_ckpt), "cpu")


def _ranking(bundle, ckpt, fastest: str) -> None:
    """A ranking of this machine in which `fastest` is far ahead of the others (as `laya-aot bench` stores one)."""
    arts = read_bundle(bundle, kinds.BY_NAME).artifacts
    timed = [a for a in arts if a.latency_ms.get("cpu")]
    figures = {a.name: {s: (1.0 if a.name == fastest else 100.0) for s in a.latency_ms["cpu"]} for a in timed}
    bench.store(bundle_sha256(bundle), arts, _here(ckpt), bench.Measured(figures, when="now", rounds=3, threads=2))


def test_bench_times_every_usable_artifact_and_stores_what_the_loader_reads(demo_ckpt, bundle_copy, cache, capsys):
    from laya_aot.commands import bench as bench_command

    assert bench_command([str(bundle_copy), "--checkpoint", str(demo_ckpt), "--device", "cpu", "--rounds", "2"],
                         time.perf_counter()) == 0
    out = capsys.readouterr().out
    arts = read_bundle(bundle_copy, kinds.BY_NAME).artifacts
    got = bench.known(bundle_sha256(bundle_copy), arts, _here(demo_ckpt))
    usable = {a.name for a in arts if a.latency_ms.get("cpu") and _here(demo_ckpt).reject_reason(a) is None}
    assert got is not None and set(got.figures) == usable and got.rounds == 2 and not got.not_timed, out
    for name in usable:
        assert set(got.figures[name]) == set(read_bundle(bundle_copy, kinds.BY_NAME).artifact(name).latency_ms["cpu"])
        assert name in out
    assert "stored in %s" % (cache / "rankings") in out
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    ranked_first = min(got.figures, key=lambda n: sum(got.figures[n].values()))
    assert agent.backend_object.artifact.name == ranked_first
    assert agent.backend_object.load_stats["ranking"].startswith("measured here by `laya-aot bench`")


@pytest.mark.parametrize("fastest", ["onnx-fp32", "aoti-cpu"])
def test_the_loader_ranks_by_the_ranking_measured_here(demo_ckpt, bundle_copy, cache, fastest, caplog):
    _ranking(bundle_copy, demo_ckpt, fastest)
    with caplog.at_level("INFO", logger="laya_aot.runtime.loader"):
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend_object.artifact.name == fastest
    assert agent.backend_object.load_stats["ranking"] == "measured here by `laya-aot bench` at now (3 rounds, 2 " \
                                                         "threads)"
    assert any("chosen by its latency measured here by `laya-aot bench`" in r.getMessage() for r in caplog.records)


def test_a_ranking_measured_with_another_openmp_wait_policy_ranks_before_the_builds(demo_ckpt, bundle_copy, cache,
                                                                                    monkeypatch):
    """`laya-aot bench` runs with OMP_WAIT_POLICY=PASSIVE; a service that imported torch before laya-aot runs with
    it unset. Its load takes the ranking measured on this machine all the same (saying so), and a ranking of its
    own wait policy where both exist."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    _ranking(bundle_copy, demo_ckpt, "onnx-fp32")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend_object.artifact.name == "onnx-fp32"
    assert agent.backend_object.load_stats["ranking"] == (
        "measured here by `laya-aot bench` at now (3 rounds, 2 threads; OpenMP's wait policy PASSIVE there, unset "
        "in this process)")
    _ranking(bundle_copy, demo_ckpt, "aoti-cpu")  # this process's own (unset)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend_object.artifact.name == "aoti-cpu"
    own = "measured here by `laya-aot bench` at now (3 rounds, 2 threads)"
    assert agent.backend_object.load_stats["ranking"] == own


def test_a_ranking_that_is_not_this_bundles_or_not_one_is_not_used(demo_ckpt, bundle_copy, cache):
    """An entry damaged, of other artifacts (another sha256) or of another bundle is a miss: the build's figures
    rank, and load_stats says so."""
    _ranking(bundle_copy, demo_ckpt, "onnx-fp32")
    sha = bundle_sha256(bundle_copy)
    arts = read_bundle(bundle_copy, kinds.BY_NAME).artifacts
    path = bench.path(sha, _here(demo_ckpt))
    entry = json.loads(path.read_text())
    assert bench.known(sha, arts, _here(demo_ckpt)) is not None
    for damaged in ({**entry, "bundle_sha256": "0" * 64},
                    {**entry, "artifacts": {n: {**e, "sha256": "1" * 64} for n, e in entry["artifacts"].items()}},
                    {**entry, "artifacts": {n: {**e, "latency_ms": {"1x128x4": -1}} for n, e in
                                            entry["artifacts"].items()}},
                    {**entry, "rounds": "3"}):
        path.write_text(json.dumps(damaged))
        assert bench.known(sha, arts, _here(demo_ckpt)) is None, damaged
    path.write_text("{not json")
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend_object.load_stats["ranking"] == "build"

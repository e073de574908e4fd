"""A first start's probe child, started ahead (`probe.start_ahead`): it imports torch beside the service and
probes the artifact `start` hands it; it is used only when started as a child would be now, and never outlives
the load it was for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laya_aot import probe

FIRST_START = """
import json, sys, laya_aot
agent = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device="cpu", prefer="aoti", strict=True)
from laya_aot import probe
s = agent.backend_object.load_stats
print("RESULT " + json.dumps({"probe": s["probe"], "timeline": s.get("probe_timeline"), "backend": agent.backend,
                              "left": probe._ahead is not None}))
"""


def _first_start(ckpt, bundle, cache, **env):
    p = subprocess.run([sys.executable, "-c", FIRST_START, str(ckpt), str(bundle)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, LAYA_AOT_CACHE_DIR=str(cache), **env))
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[7:])


def test_a_first_start_probes_with_the_child_started_ahead_and_a_later_one_reads_its_verdict(demo_ckpt,
                                                                                            other_facts_bundle,
                                                                                            tmp_path):
    demo_bundle = other_facts_bundle  # built on a machine with other facts: this one's first start probes
    first = _first_start(demo_ckpt, demo_bundle, tmp_path / "cache", LAYA_AOT_PROBE_AHEAD="1")
    assert first["probe"] == "ran" and first["backend"].startswith("aot:") and not first["left"]
    assert first["timeline"]["imported_ahead_s"] > 0 and first["timeline"]["imports_s"] < 0.5
    later = _first_start(demo_ckpt, demo_bundle, tmp_path / "cache", LAYA_AOT_PROBE_AHEAD="1")
    assert later["probe"] == "cached" and later["backend"] == first["backend"]
    off = _first_start(demo_ckpt, demo_bundle, tmp_path / "other-cache", LAYA_AOT_PROBE_AHEAD="0")
    assert off["probe"] == "ran" and "imported_ahead_s" not in off["timeline"]   # a child started when needed


def test_a_first_start_of_a_pinned_bundle_on_a_machine_like_the_builds_runs_no_child(demo_ckpt, demo_bundle,
                                                                                     tmp_path):
    """The build probed the artifact on a machine with these facts and shipped the verdict, and the start pins the
    bundle: no child, none left."""
    from laya_aot.bundle_format import bundle_sha256

    first = _first_start(demo_ckpt, demo_bundle, tmp_path / "cache", LAYA_AOT_PROBE_AHEAD="1",
                         LAYA_AOT_BUNDLE_SHA256=bundle_sha256(demo_bundle))
    assert first["probe"] == "shipped" and first["backend"].startswith("aot:") and not first["left"]
    assert first["timeline"] is None


@pytest.fixture
def ahead(monkeypatch, tmp_path):
    """This process's one chance to start a child ahead, given back; a fresh cache; the feature on."""
    monkeypatch.setattr(probe, "_ahead_tried", False)
    monkeypatch.setattr(probe, "_ahead", None)
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LAYA_AOT_PROBE_AHEAD", "1")
    yield
    probe.end_ahead()


def _aoti(bundle):
    """The AOTInductor entry as a build on another machine ships it (no verdict for this one): a child runs."""
    import dataclasses

    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle

    return dataclasses.replace(read_bundle(bundle, kinds.BY_NAME).artifact("aoti-cpu"), probe_verdict=None)


def test_a_child_started_ahead_under_other_settings_is_not_used(ahead, demo_ckpt, demo_bundle, monkeypatch):
    from laya_aot.variant import current_machine

    assert probe.start_ahead() and not probe.start_ahead()   # once per process
    proc = probe._ahead[0]
    monkeypatch.setenv("PYTHONHASHSEED", "123")   # a variable its imports may have read: it is not that child
    pending = probe.begin(demo_bundle, _aoti(demo_bundle), demo_ckpt, "cpu", current_machine("cpu"))
    assert pending.proc is not proc and proc.poll() is not None   # ended, and a child started now instead
    stats = {}
    assert probe.finish(pending, stats) is None and "imported_ahead_s" not in stats["probe_timeline"]


def test_a_child_started_ahead_takes_the_environment_of_its_artifacts_start(ahead, demo_ckpt, demo_bundle,
                                                                             monkeypatch):
    from laya_aot.variant import current_machine

    assert probe.start_ahead()
    proc = probe._ahead[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # read when the child probes, not when it imports
    pending = probe.begin(demo_bundle, _aoti(demo_bundle), demo_ckpt, "cpu", current_machine("cpu"))
    assert pending.proc is proc
    stats = {}
    assert probe.finish(pending, stats) is None and stats["probe_timeline"]["imported_ahead_s"] > 0


def test_no_child_is_started_ahead_where_a_verdict_is_cached_or_it_is_off(ahead, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_AOT_PROBE_AHEAD", "0")
    assert not probe.start_ahead()
    monkeypatch.setattr(probe, "_ahead_tried", False)
    monkeypatch.setenv("LAYA_AOT_PROBE_AHEAD", "1")
    (tmp_path / "cache" / "probes").mkdir(parents=True)
    (tmp_path / "cache" / "probes" / "some-verdict.json").write_text("{}")
    assert not probe.start_ahead() and probe._ahead is None


def test_a_child_started_ahead_that_no_start_took_ends_with_the_load(ahead, demo_bundle, alt_ckpt):
    import warnings

    import laya_aot

    assert probe.start_ahead()
    proc = probe._ahead[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(alt_ckpt), bundle=str(demo_bundle), device="cpu")   # another checkpoint's bundle
    assert agent.backend == "eager" and probe._ahead is None and proc.poll() is not None


def test_an_entry_larger_than_an_environment_variable_is_probed(ahead, demo_ckpt, demo_bundle, monkeypatch):
    """A TileLang artifact's entry (a record per kernel: 182 for a ModernBERT-large) is larger than the 128 KiB
    Linux allows one environment variable; passed in one, the child could not start (E2BIG on the H200). The
    child reads it from a file, which is gone once the verdict is in."""
    import dataclasses
    import tempfile

    from laya_aot.variant import current_machine

    monkeypatch.setenv("LAYA_AOT_PROBE_AHEAD", "0")   # a child started when needed: the path that failed
    art = _aoti(demo_bundle)
    big = dataclasses.replace(art, details=dict(art.details, notes=["k%06d" % i + "x" * 90 for i in range(3000)]))
    assert len(json.dumps(big.to_dict())) > 256 * 1024
    pending = probe.begin(demo_bundle, big, demo_ckpt, "cpu", current_machine("cpu"))
    entry_file = pending.entry_file
    assert pending.proc is not None and entry_file and os.path.exists(entry_file)
    assert os.path.dirname(entry_file) == tempfile.gettempdir()
    stats = {}
    assert probe.finish(pending, stats) is None, stats
    assert stats["probe"] == "ran"
    # this probe's own file: another test worker's probe may hold one of the same prefix at this moment (a glob of
    # the whole directory failed so under pytest-xdist in CI)
    assert not os.path.exists(entry_file)


def test_an_entry_file_changed_after_the_loader_wrote_it_is_refused(ahead, demo_ckpt, demo_bundle, monkeypatch):
    from laya_aot.variant import current_machine

    monkeypatch.setenv("LAYA_AOT_PROBE_AHEAD", "0")
    real = probe._write_entry

    def tampered(entry):
        name, digest = real(entry)
        with open(name, "a", encoding="utf-8") as f:
            f.write(" ")
        return name, digest

    monkeypatch.setattr(probe, "_write_entry", tampered)
    pending = probe.begin(demo_bundle, _aoti(demo_bundle), demo_ckpt, "cpu", current_machine("cpu"))
    why = probe.finish(pending, {})
    assert why and "entry file changed" in why

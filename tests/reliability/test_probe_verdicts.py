"""Probe verdicts: keyed by the entry's loaded fields and the machine; the build's passing verdict is shipped and
taken only where the machine's facts are the build's; a child killed from outside is retried once and never cached
as the artifact's fault; concurrent writers never leave a half-written verdict."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import time

import pytest

from laya_aot import kinds, probe
from laya_aot.bundle_format import read_bundle
from laya_aot.variant import current_machine


@pytest.fixture
def aoti(demo_bundle):
    """The demo's AOTInductor entry as a build on another machine ships it (no verdict for this one): a child runs."""
    return dataclasses.replace(read_bundle(demo_bundle, kinds.NAMES).artifact("aoti-cpu"), probe_verdict=None)


def test_entries_that_differ_in_anything_do_not_share_a_verdict(aoti):
    machine = current_machine("cpu")
    twin = dataclasses.replace(aoti, ranges=dataclasses.replace(aoti.ranges, max_tokens=4096))  # same sha256
    assert probe.verdict_path(aoti, machine, "cpu") != probe.verdict_path(twin, machine, "cpu")
    assert probe.verdict_path(aoti, machine, "cpu") == probe.verdict_path(dataclasses.replace(aoti), machine, "cpu")


def test_the_build_and_a_later_start_key_one_verdict_alike(aoti):
    """A build records the traced packages in its machine's facts; a start does not read them (package
    metadata). The verdict the build's probe cached still serves the starts on that machine."""
    from laya_aot.variant import build_machine

    built, here = build_machine("cpu"), current_machine("cpu")
    assert built.traced_packages and here.traced_packages is None
    assert probe.verdict_path(aoti, built, "cpu") == probe.verdict_path(aoti, here, "cpu")
    other = dataclasses.replace(here, cpu_isa="AVX2" if here.cpu_isa != "AVX2" else "AVX512")  # another CPU
    assert probe.verdict_path(aoti, other, "cpu") != probe.verdict_path(aoti, built, "cpu")


def test_the_builds_outcome_does_not_change_the_key(aoti):
    """The build writes status, verification and latency after its probe: the verdict it cached keys later starts."""
    machine = current_machine("cpu")
    later = dataclasses.replace(aoti, status="failed_verification", verify=None, latency_ms={"cpu": {"1x8x2": 9.0}})
    assert probe.verdict_key(aoti, machine, "cpu") == probe.verdict_key(later, machine, "cpu")


def test_the_builds_verdict_is_taken_for_a_pinned_bundle_on_a_machine_with_its_facts(demo_bundle, demo_ckpt,
                                                                                      tmp_path, monkeypatch):
    """A first start (empty cache) of a pinned bundle on a machine like the build's runs no child, and every later
    start takes the bundle's verdict again (nothing is written to the cache); a machine with other facts finds none
    and probes."""
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    art = read_bundle(demo_bundle, kinds.NAMES).artifact("aoti-cpu")
    machine = current_machine("cpu")
    assert art.probe_verdict is not None and art.probe_verdict.key == probe.verdict_key(art, machine, "cpu")
    assert not probe.verdict_path(art, machine, "cpu").exists()
    pending = probe.begin(demo_bundle, art, demo_ckpt, "cpu", machine, pinned=True)
    stats = {}
    assert pending.proc is None and probe.finish(pending, stats) is None and stats["probe"] == "shipped"
    assert not probe.verdict_path(art, machine, "cpu").exists()
    assert probe.cached_verdict(art, machine, "cpu:0", pinned=True)["shipped"]   # an indexed device of that type
    other = dataclasses.replace(machine, cpu_isa="AVX2" if machine.cpu_isa != "AVX2" else "AVX512")
    assert probe.cached_verdict(art, other, "cpu", pinned=True) is None
    monkeypatch.setenv("LAYA_AOT_PROBE_SHIPPED", "0")   # an operator who wants every new machine probed
    assert probe.cached_verdict(art, machine, "cpu", pinned=True) is None


def test_a_manifests_verdict_does_not_skip_the_child_for_an_unpinned_bundle(demo_bundle, demo_ckpt, tmp_path,
                                                                           monkeypatch):
    """The key of a shipped verdict is public (the entry's fields and the machine's facts): any manifest can carry one
    that matches this machine, a replaced native library's included. Unpinned, it is not taken: this machine's own
    child probes the artifact, and its verdict is what later starts read."""
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    art = read_bundle(demo_bundle, kinds.NAMES).artifact("aoti-cpu")
    machine = current_machine("cpu")
    assert art.probe_verdict.key == probe.verdict_key(art, machine, "cpu")   # recomputed for this machine
    assert probe.cached_verdict(art, machine, "cpu") is None
    pending = probe.begin(demo_bundle, art, demo_ckpt, "cpu", machine)
    stats = {}
    assert pending.proc is not None and probe.finish(pending, stats) is None and stats["probe"] == "ran"
    assert probe.cached_verdict(art, machine, "cpu") == json.loads(probe.verdict_path(art, machine, "cpu").read_text())


ABORTS = """
#include <stdlib.h>
__attribute__((constructor)) static void on_load(void) { abort(); }
"""


def test_a_replaced_native_library_with_a_recomputed_verdict_key_runs_only_in_the_child(demo_ckpt, bundle_copy,
                                                                                        tmp_path):
    """The frozen package's library replaced by one that calls abort() when loaded, the manifest rewritten to match
    (files, sha256) with its shipped verdict's key recomputed for this machine and its latency made the best: an
    unpinned start loads it only in the probe child, which dies; the service process lives and serves the other
    package. Before, the shipped verdict let the library into the service process, which it killed."""
    import shutil
    import subprocess
    import sys

    from laya_aot.bundle_format import record_files, write_manifest

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the aborting library with")
    src = tmp_path / "aborts.c"
    src.write_text(ABORTS)
    m = read_bundle(bundle_copy, kinds.BY_NAME)
    art = m.artifact("aoti-cpu-frozen")
    lib = bundle_copy / art.path / "model.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    record_files(bundle_copy, art)
    art.probe_verdict = dataclasses.replace(art.probe_verdict, key=probe.verdict_key(art, current_machine("cpu"),
                                                                                     "cpu"))
    art.latency_ms = {dev: {shape: 1e-3 for shape in lat} for dev, lat in art.latency_ms.items()}
    write_manifest(bundle_copy, m)
    code = ("import json, sys, laya_aot; a = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device='cpu', "
            "prefer='aoti'); print('RESULT ' + json.dumps({'served': a.backend_object.artifact.name, "
            "'rejected': a.backend_object.rejected}))")
    p = subprocess.run([sys.executable, "-c", code, str(demo_ckpt), str(bundle_copy)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, LAYA_AOT_CACHE_DIR=str(tmp_path / "cache")))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert ["aoti-cpu-frozen", "loading it crashed a probe process: SIGABRT"] in got["rejected"]
    assert got["served"] == "aoti-cpu"


def test_a_shipped_verdict_for_another_entry_is_not_taken(demo_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    art = read_bundle(demo_bundle, kinds.NAMES).artifact("aoti-cpu")
    twin = dataclasses.replace(art, ranges=dataclasses.replace(art.ranges, max_tokens=4096))  # the same verdict key
    assert probe.cached_verdict(twin, current_machine("cpu"), "cpu", pinned=True) is None


def _kill_soon(pending, sig):
    deadline = time.time() + 30
    while pending.proc.poll() is None and time.time() < deadline:
        try:
            os.kill(pending.proc.pid, sig)
            return
        except ProcessLookupError:
            return


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_probe_killed_from_outside_is_retried_and_its_verdict_is_the_retrys(demo_bundle, demo_ckpt, aoti, sig,
                                                                               tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    machine = current_machine("cpu")
    pending = probe.begin(demo_bundle, aoti, demo_ckpt, "cpu", machine)
    _kill_soon(pending, sig)      # as the out-of-memory killer or a shutdown would
    stats = {}
    assert probe.finish(pending, stats) is None          # the second child ran it
    assert stats["probe_retried_after"] == sig.name
    cached = json.loads(probe.verdict_path(aoti, machine, "cpu").read_text())
    assert cached["reason"] is None


def test_a_probe_killed_twice_is_not_cached(demo_bundle, demo_ckpt, aoti, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    machine = current_machine("cpu")
    pending = probe.begin(demo_bundle, aoti, demo_ckpt, "cpu", machine)
    relaunch = pending.relaunch

    def relaunch_and_kill():
        relaunch()
        _kill_soon(pending, signal.SIGKILL)
    pending.relaunch = relaunch_and_kill
    _kill_soon(pending, signal.SIGKILL)
    why = probe.finish(pending, {})
    assert "killed from outside (SIGKILL) twice" in why and "not cached" in why
    assert not probe.verdict_path(aoti, machine, "cpu").exists()


def test_a_crash_of_the_artifact_itself_is_cached(demo_bundle, demo_ckpt, aoti, tmp_path, monkeypatch):
    # SIGABRT is what a broken package does (std::terminate): that is the artifact's fault, remembered
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    machine = current_machine("cpu")
    pending = probe.begin(demo_bundle, aoti, demo_ckpt, "cpu", machine)
    _kill_soon(pending, signal.SIGABRT)
    assert probe.finish(pending, {}) == "loading it crashed a probe process: SIGABRT"
    assert json.loads(probe.verdict_path(aoti, machine, "cpu").read_text())["reason"].endswith("SIGABRT")


def _writer(args):
    """Write and read verdict-sized JSON at one path as fast as possible; count failures and torn reads."""
    from laya_aot.files import write_json_atomic

    path, seconds, me = args
    failed = torn = n = 0
    end = time.time() + seconds
    while time.time() < end:
        try:
            write_json_atomic(path, {"writer": me, "pad": "x" * 4000, "n": n})
        except OSError:
            failed += 1
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except ValueError:
            torn += 1
        except OSError:
            pass
        n += 1
    return failed, torn, n


def _race(tmp_path, procs, seconds):
    path = tmp_path / "verdict.json"
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        res = pool.map(_writer, [(path, seconds, i) for i in range(procs)])
    failed, torn, n = (sum(r[i] for r in res) for i in range(3))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "verdict.json"]
    return failed, torn, n, leftovers


@pytest.mark.slow  # four spawned processes race for 3 s: 10-15 s on 2 cores
def test_four_processes_writing_one_verdict_at_once(tmp_path):
    failed, torn, n, leftovers = _race(tmp_path, 4, 3.0)
    print("\ncache race: %d writes+reads, %d failed writes, %d torn reads" % (n, failed, torn))
    assert n > 200 and failed == 0 and torn == 0 and not leftovers


@pytest.mark.heavy
def test_four_processes_writing_one_verdict_at_once_heavy(tmp_path):
    failed, torn, n, leftovers = _race(tmp_path, 4, 60.0)
    print("\ncache race (heavy): %d writes+reads, %d failed writes, %d torn reads" % (n, failed, torn))
    assert n > 10000 and failed == 0 and torn == 0 and not leftovers


def test_threads_asking_for_one_files_digest_hash_it_once(tmp_path, monkeypatch):
    """A start's head start and its loader both check the checkpoint's fingerprint; the second waits for the
    first's digest rather than hashing a large file again (`files.cached_sha256`)."""
    import threading

    from laya_aot import files

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(1 << 20))
    hashed = []
    real = files.sha256_file

    def slow_sha256(path):
        hashed.append(path)
        time.sleep(0.3)
        return real(path)
    monkeypatch.setattr(files, "sha256_file", slow_sha256)
    got = []
    threads = [threading.Thread(target=lambda: got.append(files.cached_sha256(big))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(hashed) == 1 and len(set(got)) == 1 and len(got) == 3

"""The per-machine cache fuzzed under whole loads: a cache warmed by real starts (digests, the tokenizer snapshot,
start costs, an unpacked pack; under `-m heavy` also the probe verdicts of the AOTInductor packages), then, case
by case, a copy of it with one to three entries damaged, stale, swapped, poisoned, replaced by a FIFO, a link to
/dev/zero, a directory or valid JSON of the wrong type (cache_damage.py), and a whole `laya_aot.load` against it
in a service stand-in process (cache_worker.py) that answers a batch of typed questions.

What must hold, every case: the process lives, nothing escapes load() or the call, the answers are laya eager's,
and the load ends within HANG_S. A cache can make a start slower, never wrong, dead or hung.
"""
from __future__ import annotations

import collections
import json
import os
import random
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from tests.questions import assert_same_answers
from tests.reliability.cache_damage import GENERIC, damage, kind_of, poison

HERE = Path(__file__).resolve().parent
CASES = 200          # the default run's cases (each one load)
HEAVY_CASES = 500    # -m heavy, the AOTInductor packages' probe verdicts included (a damaged one: a child, seconds)
HANG_S = 240.0       # a load that takes longer is a hang (a probe child on a busy 2-core machine takes ~20 s)


class CacheWorker:
    """cache_worker.py in a child process; restarted after it dies or hangs, counting each."""

    def __init__(self, checkpoint: Path, log: Path):
        self.checkpoint, self.log = checkpoint, log
        self.deaths: List[Dict[str, Any]] = []
        self.hangs: List[Dict[str, Any]] = []
        self.proc: Optional[subprocess.Popen] = None
        self._start()

    def _start(self) -> None:
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "cache_worker.py"), str(self.checkpoint)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                             [str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])))
        assert json.loads(self.proc.stdout.readline())["ready"]

    def ask(self, req: Dict[str, Any], what: str) -> Optional[Dict[str, Any]]:
        """The worker's answer, or None when the request killed it or did not end within HANG_S."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], HANG_S)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            self.proc.kill()
            self.hangs.append({"case": what})
        rc = self.proc.wait()
        if ready:
            self.deaths.append({"case": what, "returncode": rc,
                                "stderr_tail": self.log.read_bytes()[-2000:].decode(errors="replace")})
        self._start()
        return None

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def demo_pack(demo_bundle, tmp_path_factory) -> Path:
    from laya_aot.distribution.pack import pack

    out = tmp_path_factory.mktemp("pack") / "demo.tar.zst"
    pack(demo_bundle, out)
    return out


@pytest.fixture(scope="module")
def cache_worker(demo_ckpt, tmp_path_factory):
    w = CacheWorker(demo_ckpt, tmp_path_factory.mktemp("cache-worker") / "stderr.txt")
    yield w
    w.close()


def _warm(worker: CacheWorker, root: Path, routes: List[Dict[str, Any]], eager) -> Path:
    """A cache warmed by real starts of every route (twice: the second reads what the first wrote)."""
    for route in routes + routes:
        got = worker.ask(dict(route, cache=str(root)), "warm-up %s" % route)
        assert got is not None and got["exc"] is None, got
        for a, r in zip(got["answers"], eager):
            assert_same_answers(a, r)
    return root


def _entries(root: Path) -> Dict[str, List[Path]]:
    by_kind: Dict[str, List[Path]] = collections.defaultdict(list)
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            by_kind[kind_of(p, root)].append(p)
    return by_kind


def _fuzz(worker: CacheWorker, base: Path, routes: List[Dict[str, Any]], eager, cases: int, seed: int,
          work: Path) -> None:
    rng = random.Random(seed)
    done: collections.Counter = collections.Counter()
    raised, wrong, seconds = [], [], []
    t0 = time.monotonic()
    for _ in range(cases):
        case = work / "case"
        if case.exists():
            shutil.rmtree(case)
        shutil.copytree(base, case, symlinks=True, copy_function=os.link)   # `damage` never writes into a file
        entries = _entries(case)
        kinds = sorted(entries)
        what = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            kind = rng.choice(kinds)
            path = rng.choice(entries[kind])
            how = rng.choice(GENERIC + ("poison",) * 4)
            other = rng.choice([p for p in entries[kind] if p != path] or [path])
            said = poison(path, kind, rng) if how == "poison" else damage(path, how, rng, other)
            what.append("%s %s: %s" % (kind, path.relative_to(case), said))
            done[(kind, said.split(":")[0].split()[0])] += 1
        route = rng.choice(routes)
        if any(w.startswith("pack ") for w in what):
            route = next((r for r in routes if str(r["bundle"]).endswith(".tar.zst")), route)
        got = worker.ask(dict(route, cache=str(case)), "; ".join(what))
        if got is None:
            continue
        seconds.append((got["seconds"], got.get("backend"), got.get("probe"), what))
        if got["exc"] is not None:
            raised.append((what, got["exc"]))
            continue
        for a, r in zip(got["answers"], eager):
            try:
                assert_same_answers(a, r)
            except AssertionError as e:
                wrong.append((what, got.get("backend"), got.get("tok"), str(e)[:200]))
                break
    shutil.rmtree(work / "case", ignore_errors=True)
    print("\ncache fuzz: %d loads in %.0f s (median %.2f s each): %d process deaths, %d hangs, %d exceptions out of "
          "load() or the call, %d answers unlike laya eager's; %d damaged entries by kind and way: %s"
          % (cases, time.monotonic() - t0, sorted(seconds)[len(seconds) // 2][0] if seconds else 0,
             len(worker.deaths), len(worker.hangs), len(raised), len(wrong), sum(done.values()),
             dict(sorted(done.items()))))
    print("slowest loads: %s" % sorted(seconds, key=lambda x: -x[0])[:8])
    assert not worker.deaths and not worker.hangs and not raised and not wrong, \
        (worker.deaths[:2], worker.hangs[:2], raised[:3], wrong[:3])


def test_a_damaged_cache_never_kills_hangs_raises_or_changes_an_answer(cache_worker, demo_bundle, demo_pack,
                                                                      tmp_path):
    """ONNX serves (no probe child: a damaged verdict's child costs seconds a case, the heavy run's), from the
    directory and from the pack; the verdicts' own reads are test_cache_entries.py's."""
    eager = cache_worker.ask({"eager": True}, "eager")["answers"]
    routes = [{"bundle": str(demo_bundle), "prefer": "onnx"}, {"bundle": str(demo_pack), "prefer": "onnx"}]
    base = _warm(cache_worker, tmp_path / "warm", routes, eager)
    _fuzz(cache_worker, base, routes, eager, CASES, seed=0, work=tmp_path)


@pytest.mark.heavy
def test_a_damaged_cache_under_every_route_heavy(cache_worker, demo_bundle, demo_pack, tmp_path):
    """The same with the loader's own choice and the AOTInductor packages (their probe verdicts: a damaged one
    runs the child again), pinned and unpinned."""
    from laya_aot.bundle_format import bundle_sha256

    eager = cache_worker.ask({"eager": True}, "eager")["answers"]
    routes = [{"bundle": str(demo_bundle)}, {"bundle": str(demo_pack)}, {"bundle": str(demo_bundle), "prefer": "aoti"},
              {"bundle": str(demo_bundle), "prefer": "aoti", "pin": bundle_sha256(demo_bundle)}]
    base = _warm(cache_worker, tmp_path / "warm", routes, eager)
    _fuzz(cache_worker, base, routes, eager, HEAVY_CASES, seed=1, work=tmp_path)

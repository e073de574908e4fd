"""One agent under 16 threads, several processes loading one bundle at once, resident memory over many calls."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import laya_aot

Q = {"team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech", "account"]},
     "urgent": {"type": "noul", "instructions": "It is urgent."}}


def _states(i: int):
    rng = np.random.default_rng(i)
    words = ["refund", "invoice", "outage", "password", "login", "error", "charged", "twice", "please", "now"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 60)))) for _ in range(1 + i % 3)]


def _key(results):
    return [(r["answers"]["team"]["choice"], round(r["answers"]["urgent"]["noul"], 4)) for r in results]


@pytest.fixture(scope="module")
def agent(demo_ckpt, demo_bundle):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti", strict=True)
    return a


# the heavy runs stop at this many seconds (then report how many calls they made), so they end on a loaded
# 2-core machine too; unset or 0: no limit
HEAVY_BUDGET_S = float(os.environ.get("LAYA_AOT_HEAVY_BUDGET_S", "300"))


def _threads(agent, n_threads, calls, budget_s: float = 0.0):
    """Every thread asks each of `calls` batches (from another start) and compares with the serial answer;
    with a budget, threads stop when it is spent. Returns (errors, wrong answers, calls made by threads)."""
    deadline = time.monotonic() + budget_s if budget_s else float("inf")
    serial = {i: _key(agent.predict_batch(_states(i), Q)) for i in range(calls)}
    errors, wrong, made = [], [], [0] * n_threads

    def run(t):
        try:
            for i in range(calls):
                if time.monotonic() > deadline:
                    return
                j = (i + t) % calls
                if _key(agent.predict_batch(_states(j), Q)) != serial[j]:
                    wrong.append((t, j))
                made[t] += 1
        except Exception as e:  # noqa: BLE001 - counted
            errors.append(repr(e))
    ts = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors, wrong, made


def test_sixteen_threads_answer_as_serial(agent):
    errors, wrong, made = _threads(agent, 16, 20)
    assert not errors and not wrong, (errors[:3], wrong[:3])
    assert sum(made) == 16 * 20
    assert agent.backend == "aot:aoti"


@pytest.mark.heavy
def test_sixteen_threads_by_two_hundred_calls_answer_as_serial(agent):
    t0 = time.monotonic()
    errors, wrong, made = _threads(agent, 16, 200, HEAVY_BUDGET_S)
    print("\n16 threads x up to 200 calls: %d calls by threads in %.0f s (budget %.0f s; fewest per thread %d), "
          "%d errors, %d answers unlike serial" % (sum(made), time.monotonic() - t0, HEAVY_BUDGET_S, min(made),
                                                  len(errors), len(wrong)))
    assert not errors and not wrong, (errors[:3], wrong[:3])
    assert min(made) >= 5 and sum(made) >= 400, made   # enough concurrent calls to mean something


LOADER = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import laya_aot
a = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device="cpu", prefer="aoti", strict=True)
r = a.predict_batch(["I was charged twice, refund please"], {"t": {"type": "choice", "instructions": "Which team?",
                    "criteria": ["billing", "tech", "account"]}})
print(json.dumps({"backend": a.backend, "answer": r[0]["answers"]["t"]["choice"],
                  "probe": a.backend_object.load_stats.get("probe")}))
"""


def _processes(demo_ckpt, demo_bundle, tmp_path, n):
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(tmp_path / "cold-cache"))   # all of them probe at once
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, str(demo_ckpt), str(demo_bundle)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-800:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert {r["backend"] for r in results} == {"aot:aoti"}
    assert len({r["answer"] for r in results}) == 1
    return results


def test_four_processes_load_one_bundle_at_once(demo_ckpt, demo_bundle, tmp_path):
    _processes(demo_ckpt, demo_bundle, tmp_path, 4)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _memory(agent, calls, budget_s: float = 0.0):
    """RSS after a warm-up, and its growth at each quarter of `calls` (with a budget: of the calls made
    before it was spent, sampled every 10 calls). Returns (start MB, marks, calls made)."""
    for i in range(50):   # warm-up: allocator pools, tokenizer caches
        agent.predict_batch(_states(i), Q)
    deadline = time.monotonic() + budget_s if budget_s else float("inf")
    start = _rss_mb()
    samples = []
    made = 0
    for i in range(calls):
        if time.monotonic() > deadline:
            break
        agent.predict_batch(_states(i % 97), Q)
        made += 1
        if made % 10 == 0:
            samples.append(_rss_mb() - start)
    quarters = [samples[max(0, (len(samples) * q) // 4 - 1)] for q in (1, 2, 3, 4)] if samples else [0.0] * 4
    return start, [round(x, 1) for x in quarters], made


def test_resident_memory_is_flat_over_calls(agent):
    start, marks, made = _memory(agent, 200)
    print("\nRSS after warm-up %.0f MB, growth at each quarter of 200 calls: %s MB" % (start, marks))
    assert made == 200 and marks[-1] < 30, marks


@pytest.mark.heavy
def test_resident_memory_is_flat_over_two_thousand_calls(agent):
    t0 = time.monotonic()
    start, marks, made = _memory(agent, 2000, HEAVY_BUDGET_S)
    print("\nRSS after warm-up %.0f MB, growth at each quarter of %d calls (of 2000; %.0f s, budget %.0f s): %s MB"
          % (start, made, time.monotonic() - t0, HEAVY_BUDGET_S, marks))
    assert made >= 500, made
    assert marks[-1] < 30 and marks[-1] - marks[0] < 10, marks

"""The hand-over: an artifact that starts quicker answers first, and the best measured mix takes over in the
background (`select.plan`, runtime/handover.py)."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path

import laya
import numpy as np
import pytest

import laya_aot
from laya_aot import laya_internals as laya_api
from laya_aot.runtime import handover
from laya_aot.runtime.handover import Handover
from laya_aot.runtime.select import MIX_TIE, START_SLACK_S, plan, rank
from tests.questions import assert_same_answers, question_suite, state_text
from tests.runtime.test_select import _entry

STATES = [state_text(np.random.default_rng(11), n) for n in (10, 60)]
QUESTIONS = dict(list(question_suite().items())[::6])  # every question type, a few option counts
# the export takes at most 256 padded tokens: this state at laya's max_len=512 is beyond it, so laya's eager
# forward answers it
LONG = " ".join(["delivery late invoice refund"] * 80)
LONG_QUESTION = {"n": {"type": "noul", "instructions": "is it late?"}}
# a mix far better than any other artifact's (demo figures: 1-2 ms and 15-30 ms)
BEST_MIX = {"cpu": {"1x128x4": 0.2, "8x256x4": 2.0}}


def _names(order):
    return [a.name for a in order]


# ---------------------------------------------------------------------------------------------------------------
# select.plan, on manifest entries alone (it takes `rank`'s order, as the loader, the head start and inspect give it)


def _plan(arts, starts=None, handover=True, prefer=None):
    return plan(rank(arts, "cpu", prefer, starts)[0], "cpu", starts, handover)


def test_a_best_mix_that_runs_layas_module_hands_over_from_a_kind_that_does_not():
    # catches: the kind rule gone (compile/tilelang would make the start wait for laya's module) or the hand-over
    # target not being the best mix
    compile_, aoti = _entry("compile", "compile", lat=1.0), _entry("aoti", "aoti", lat=2.0)
    p = _plan([compile_, aoti])
    assert _names(p.order) == ["aoti", "compile"] and p.handover_to is compile_
    assert "compile runs laya's own module" in p.why and "takes over once loaded" in p.why
    # the quick one need not be rank's second: a kind that also runs the module is passed over
    tl = _entry("tl", "tilelang", lat=1.5)
    p = _plan([compile_, tl, aoti])
    assert _names(p.order) == ["aoti", "compile", "tl"] and p.handover_to is compile_
    # no kind that starts quicker, or a best mix that runs no module: rank's order, no hand-over
    for arts, order in (([compile_, tl], ["compile", "tl"]), ([aoti, _entry("onnx", "onnx", lat=3.0)],
                                                              ["aoti", "onnx"])):
        p = _plan(arts)
        assert _names(p.order) == order and p.handover_to is None and p.why is None


def test_recorded_starts_only_cancel_a_hand_over():
    # catches: recorded starts alone making a hand-over (between two packages of one kind, whenever one start was
    # slow), START_SLACK_S ignored, or recorded starts ignored where both are known
    best, other = _entry("best", "aoti", lat=1.0), _entry("other", "aoti", lat=2.0)
    p = _plan([best, other], starts={"best": 30.0, "other": 1.0})
    assert _names(p.order) == ["best", "other"] and p.handover_to is None and p.why is None
    compile_, aoti = _entry("compile", "compile", lat=1.0), _entry("aoti", "aoti", lat=2.0)
    slow = {"compile": 3.0 + START_SLACK_S + 0.5, "aoti": 3.0}
    p = _plan([compile_, aoti], starts=slow)
    assert _names(p.order) == ["aoti", "compile"] and p.handover_to is compile_
    assert "compile runs laya's own module and started in %.2f s here, aoti in 3.00 s" % slow["compile"] in p.why
    # slower by less than the slack (or exactly it): the module's route serves the start itself
    for lag in (START_SLACK_S - 0.5, START_SLACK_S, -1.0):
        p = _plan([compile_, aoti], starts={"compile": 3.0 + lag, "aoti": 3.0})
        assert _names(p.order) == ["compile", "aoti"] and p.handover_to is None and p.why is None
    # only one of them recorded: the kind decides
    p = _plan([compile_, aoti], starts={"compile": 3.2})
    assert _names(p.order) == ["aoti", "compile"] and p.handover_to is compile_


def test_within_the_mix_tie_the_quick_one_serves_and_nothing_takes_over():
    # catches: a hand-over for a gain within MIX_TIE (a second load for nothing)
    compile_ = _entry("compile", "compile", lat=1.0)
    aoti = _entry("aoti", "aoti", lat=1.0 * (1 + MIX_TIE) - 0.001)
    p = _plan([compile_, aoti])
    assert _names(p.order) == ["aoti", "compile"] and p.handover_to is None
    assert "within %d%% of compile's mix" % round(MIX_TIE * 100) in p.why
    # just beyond the tie: a hand-over
    beyond = _entry("aoti", "aoti", lat=1.0 * (1 + MIX_TIE) + 0.01)
    assert _plan([compile_, beyond]).handover_to is compile_


def test_without_handover_or_a_second_candidate_the_order_is_ranks():
    # catches: handover=False, one candidate, or a `prefer` that leaves one kind still reordering or handing over
    compile_, aoti = _entry("compile", "compile", lat=1.0), _entry("aoti", "aoti", lat=2.0)
    for starts in (None, {"compile": 30.0, "aoti": 1.0}):
        p = _plan([compile_, aoti], starts=starts, handover=False)
        assert _names(p.order) == ["compile", "aoti"] and p.handover_to is None and p.why is None
        p = _plan([compile_], starts=starts)
        assert _names(p.order) == ["compile"] and p.handover_to is None and p.why is None
        p = _plan([compile_, aoti], starts=starts, prefer="compile")
        assert _names(p.order) == ["compile"] and p.handover_to is None and p.why is None


# ---------------------------------------------------------------------------------------------------------------
# end to end on the CPU, with a bundle copy whose best mix is edited into its manifest


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: the start costs it plants (and the probe verdicts and start costs its loads
    record) reach no other test."""
    path = tmp_path / "cache"
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(path))
    return path


@pytest.fixture
def held(monkeypatch):
    """Hand-overs, once begun, wait for `held.set()` before they load anything, so that a test sees the first
    artifact serve (a hand-over on this CPU takes seconds, but a test should not depend on that). Each one armed
    is begun, released and joined at the end of the test whatever happened (no timer left to fire in a later
    test)."""
    gate = threading.Event()
    armed = []
    real_start, real_run = Handover.start, Handover._run

    def start(self):
        armed.append(self)
        real_start(self)

    def run(self):
        gate.wait(120)
        real_run(self)
    monkeypatch.setattr(Handover, "start", start)
    monkeypatch.setattr(Handover, "_run", run)
    yield gate
    gate.set()
    for h in armed:
        h.begin()
        h.join(120)


def _best_mix(bundle: Path, name: str) -> dict:
    """Make `name` the bundle's best measured mix on the CPU; the manifest's entries, by name."""
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle

    path = bundle / "bundle.json"
    m = json.loads(path.read_text())
    for a in m["artifacts"]:
        if a["name"] == name:
            a["latency_ms"] = BEST_MIX
    path.write_text(json.dumps(m, indent=1))
    return {a.name: a for a in read_bundle(bundle, kinds.BY_NAME).artifacts}


def _plant_starts(arts: dict, seconds: dict) -> None:
    from laya_aot.runtime import start_costs
    from laya_aot.variant import current_machine

    for name, s in seconds.items():
        start_costs.record(arts[name], current_machine("cpu"), "cpu", s)


@pytest.fixture
def onnx_best(bundle_copy, cache, monkeypatch) -> dict:
    """The bundle copy's ONNX artifact made the best measured mix, and ONNX a kind that runs laya's own module (as
    the compile route and TileLang do, which this CPU machine does not build): a start answers from an
    AOTInductor package and ONNX takes over. The hand-over begins on the first call (IDLE_S is one minute)."""
    from laya_aot.kinds import registry

    monkeypatch.setitem(registry._BY_NAME, "onnx", dataclasses.replace(registry._BY_NAME["onnx"],
                                                                       needs_module=True))
    monkeypatch.setattr(handover, "IDLE_S", 60.0)
    return _best_mix(bundle_copy, "onnx-fp32")


@pytest.fixture(scope="module")
def eager(demo_ckpt):
    """laya's own answers: STATES on QUESTIONS, and LONG at max_len=512."""
    agent = laya.load(str(demo_ckpt), device="cpu")
    return (agent.predict_batch(STATES, QUESTIONS),
            agent.predict_batch([LONG], LONG_QUESTION, max_len=512)[0]["answers"])


def _same(got, ref):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert_same_answers(g["answers"], r["answers"])


def test_the_quick_artifact_answers_first_and_the_best_mix_takes_over(demo_ckpt, bundle_copy, onnx_best, held,
                                                                      eager):
    # catches: plan not starting with the quick artifact (ONNX, building laya's module first, would serve from
    # the start), a hand-over that does not wait for the first call, never installs the best mix, or changes the
    # answers
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    first = agent.backend_object
    assert first.artifact.kind == "aoti"
    record = first.load_stats["handover"]
    assert record["from"] == first.artifact.name and record["to"] == "onnx-fp32" and record["state"] == "waiting"
    assert "onnx-fp32 runs laya's own module, which a start would build first" in record["why"]
    before = agent.predict_batch(STATES, QUESTIONS)
    assert first.stats["artifact_calls"] >= 1                            # the quick one answered those
    assert record["state"] == "running"                                  # and its first call began the hand-over
    held.set()
    assert first.handover.join(60)
    best = agent.backend_object
    assert best is not first and best.artifact.name == "onnx-fp32" and best.installed and not first.installed
    assert best.load_stats["handover"] is record and best.handover is first.handover
    assert record["state"] == "done" and record["seconds"] > 0 and "reason" not in record
    calls = first.stats["artifact_calls"]
    after = agent.predict_batch(STATES, QUESTIONS)
    assert best.stats["artifact_calls"] >= 1 and first.stats["artifact_calls"] == calls
    _same(before, eager[0])
    _same(after, before)
    # a start told not to hand over waits for the best mix (laya's module built first), and answers the same
    direct = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True, handover=False)
    assert direct.backend_object.artifact.name == "onnx-fp32" and not laya_api.is_thin(direct)
    assert direct.backend_object.handover is None and "handover" not in direct.backend_object.load_stats
    _same(direct.predict_batch(STATES, QUESTIONS), after)


def test_a_best_mix_that_runs_layas_module_takes_it_to_the_agent(demo_ckpt, bundle_copy, onnx_best, held, eager,
                                                                 monkeypatch):
    # catches: install_backend not giving the agent the backend's module (the agent stays a shell: the eager
    # forward a request beyond the export needs would run on meta tensors), or the module installed on the agent
    # ahead of the hand-over's backend (under the quick artifact, still serving)
    installs = []   # (artifact, whether the agent was still a shell as its backend came to be installed)
    real_install = laya_api.install_backend

    def install_backend(agent, backend):
        installs.append((backend.artifact.name, laya_api.is_thin(agent)))
        real_install(agent, backend)
    monkeypatch.setattr(laya_api, "install_backend", install_backend)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    first = agent.backend_object
    assert first.artifact.kind == "aoti" and laya_api.is_thin(agent)
    before = agent.predict_batch(STATES, QUESTIONS)
    assert first.stats["artifact_calls"] >= 1 and laya_api.is_thin(agent)
    assert first.load_stats["handover"]["state"] == "running"
    held.set()
    assert first.handover.join(60)
    best = agent.backend_object
    assert first.load_stats["handover"]["state"] == "done", first.load_stats["handover"]
    assert best.artifact.name == "onnx-fp32" and best.name == "aot:onnx"
    assert not laya_api.is_thin(agent) and agent.model is best.model and first.model is not agent.model
    # laya's module came to the agent with the ONNX backend, in one step: not ahead of it
    assert installs == [(first.artifact.name, True), ("onnx-fp32", True)]
    _same(before, eager[0])
    _same(agent.predict_batch(STATES, QUESTIONS), before)
    assert best.stats.get("eager_calls", 0) == 0
    # beyond the export's 256 tokens: laya's eager forward, on the module the hand-over installed
    got = agent.predict_batch([LONG], LONG_QUESTION, max_len=512)[0]["answers"]
    assert best.stats["eager_calls"] == 1 and best.stats["eager_tokens"] == 1
    assert_same_answers(got, eager[1])


def test_serving_pauses_while_the_artifact_taking_over_makes_its_first_calls(demo_ckpt, bundle_copy, onnx_best,
                                                                              held, monkeypatch):
    # catches: the hand-over's smoke check run while a serving forward may run beside it (a CUDA graph it captures
    # in torch's global mode fails then, with that forward), serving paused on a start (nothing serves yet: the
    # lock taken whatever `handover` says), or the pause not recorded in load_stats["handover"]
    from laya_aot.runtime import trial

    seen = []     # (artifact, laya's write lock held, a forward from another thread began during the check)
    readers = []
    real = trial._smoke_check

    def smoke_check(agent, backend, art, manifest):
        began = threading.Event()

        def forward():
            with agent._gate.read_lock():   # as laya's Agent runs each forward
                began.set()
        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
        readers.append(reader)
        seen.append((art.name, agent._gate._writers == 1, began.wait(0.5)))
        return real(agent, backend, art, manifest)
    monkeypatch.setattr(trial, "_smoke_check", smoke_check)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    first = agent.backend_object
    assert first.artifact.kind == "aoti" and "serving_paused_s" not in first.load_stats
    agent.predict_batch(STATES[:1], QUESTIONS)   # its first call begins the hand-over
    held.set()
    assert first.handover.join(60)
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive()   # each forward got in once the check (and the pause) ended
    assert seen == [(first.artifact.name, False, True), ("onnx-fp32", True, False)]
    best = agent.backend_object
    record = best.load_stats["handover"]
    assert record["state"] == "done" and best.artifact.name == "onnx-fp32", record
    assert isinstance(record["serving_paused_s"], float) and record["serving_paused_s"] >= 0.5   # the reader's wait
    assert record["serving_paused_s"] == best.load_stats["serving_paused_s"] <= record["seconds"]
    # the start's own checks and a start told not to hand over: nothing serves yet, nothing pauses
    direct = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True, handover=False)
    assert direct.backend_object.artifact.name == "onnx-fp32"
    assert "serving_paused_s" not in direct.backend_object.load_stats and seen[2:] == [("onnx-fp32", False, True)]


def test_a_hand_over_that_fails_leaves_the_first_artifact_serving(demo_ckpt, bundle_copy, onnx_best, held, eager,
                                                                    caplog, monkeypatch):
    # catches: a failed hand-over taking the agent down or installing a damaged artifact, its failure not
    # recorded, or a hand-over that never begins on a start no call follows
    monkeypatch.setattr(handover, "IDLE_S", 0.2)    # no call here: the timer begins it
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    first = agent.backend_object
    assert first.artifact.kind == "aoti" and first.load_stats["handover"]["state"] in ("waiting", "running")
    # damaged after the start, before the hand-over reads it
    model = bundle_copy / "onnx" / "model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="laya_aot.runtime.handover"):
        held.set()
        assert first.handover.join(60)
    record = first.load_stats["handover"]
    assert record["state"] == "failed" and "sha256" in record["reason"] and "changed after the build" in \
        record["reason"], record
    assert agent.backend_object is first and first.installed and laya_api.is_thin(agent)
    assert any("%s keeps serving; the hand-over to onnx-fp32 failed" % first.artifact.name in r.getMessage()
               for r in caplog.records)
    assert first.stats.get("artifact_calls", 0) == 0
    _same(agent.predict_batch(STATES, QUESTIONS), eager[0])
    assert first.stats["artifact_calls"] >= 1                           # the first artifact answered them


def test_inspect_names_the_artifact_that_takes_over(bundle_copy, onnx_best, capsys):
    # catches: `laya-aot inspect` naming the best mix as what load() serves where a start hands over to it, or
    # not following the recorded starts that cancel a hand-over
    import re
    import time

    from laya_aot.commands import inspect

    def would_serve():
        assert inspect([str(bundle_copy)], time.perf_counter()) == 0
        out = " ".join(capsys.readouterr().out.split())   # the line may be wrapped
        return re.search(r"would serve: (\S+) \(", out).group(1), out

    quick, out = would_serve()
    assert quick.startswith("aoti-cpu")
    assert "once it answers, onnx-fp32 takes over in the background" in out
    # recorded here: ONNX starts within START_SLACK_S of the AOTInductor packages, so it serves the start itself
    _plant_starts(onnx_best, {"onnx-fp32": 2.0, "aoti-cpu": 1.5, "aoti-cpu-frozen": 1.5})
    served, out = would_serve()
    assert served == "onnx-fp32" and "takes over" not in out
    _plant_starts(onnx_best, {"onnx-fp32": 9.0})
    served, out = would_serve()
    assert served == quick and "onnx-fp32 runs laya's own module and started in 9.00 s here" in out
    assert "once it answers, onnx-fp32 takes over in the background" in out


EXITS = """
import atexit, dataclasses, sys
from laya_aot.kinds import registry
registry._BY_NAME["onnx"] = dataclasses.replace(registry._BY_NAME["onnx"], needs_module=True)
import laya_aot
seen = {}
# registered before the load, so it runs after the hand-over's own exit handler (atexit runs the latest first)
atexit.register(lambda: print("AT EXIT", seen["first"].load_stats["handover"]["state"],
                              seen["agent"].backend_object.artifact.kind, flush=True))
agent = seen["agent"] = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device="cpu", strict=True)
first = seen["first"] = agent.backend_object
agent.predict_batch(["the door is open"], {"n": {"type": "noul", "instructions": "is it open?"}})
print("ANSWERED", first.artifact.kind, first.load_stats["handover"]["state"], flush=True)
"""


def test_a_process_that_exits_during_a_hand_over_stops_it_and_exits_cleanly(demo_ckpt, bundle_copy, onnx_best):
    # catches: no exit handler (the hand-over's thread left running inside torch while the interpreter finalises:
    # its record still says "running" at exit), or an exit handler that lets the hand-over run on to the end
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", EXITS, str(demo_ckpt), str(bundle_copy)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "ANSWERED aoti running" in lines, p.stdout
    assert "AT EXIT stopped aoti" in lines, p.stdout + p.stderr[-3000:]   # the AOTInductor package still serves
    assert "Traceback" not in p.stderr, p.stderr[-3000:]

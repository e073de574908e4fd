"""benchmarks/harness.py, the one module every benchmark uses for its arguments, timing, environment and result
files; and the shape of benchmarks/ it keeps: every script on the harness, no machine path as a default."""
from __future__ import annotations

import json
import re
import sys

import pytest

from tests.bench_scripts.conftest import BENCHMARKS, load_script

HELPERS = ("harness", "jit_guard")  # modules the scripts import (jit_guard: the TileLang compile counter), not scripts
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS)


@pytest.fixture(scope="module")
def harness():
    return load_script("harness")


def test_a_result_travels_with_its_command_hardware_and_versions(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "gpu_start.py"), "--starts", "2"])
    path = harness.write(tmp_path, "start_x", {"calls": {"1x1": 1.5}}, "| a | b |", title="Starts")
    doc = json.loads(path.read_text())
    env = doc["environment"]
    assert doc["calls"] == {"1x1": 1.5}
    assert env["command"] == "python benchmarks/gpu_start.py --starts 2"
    assert env["versions"]["torch"] and env["versions"]["laya"] and env["cores"] >= 1 and env["cpu"]
    page = (tmp_path / "start_x.md").read_text()
    assert page.startswith("# Starts\n")
    assert "Command: `python benchmarks/gpu_start.py --starts 2`" in page
    assert "Hardware: " in page and "Versions: python " in page and "torch %s" % env["versions"]["torch"] in page
    assert page.rstrip().endswith("| a | b |")


def test_a_partial_write_keeps_the_figures_without_a_page(harness, tmp_path):
    harness.write(tmp_path, "run", {"starts": [1]}, partial=True)
    assert json.loads((tmp_path / "run.partial.json").read_text())["starts"] == [1]
    assert not (tmp_path / "run.md").exists()


def test_a_child_reports_its_result_and_its_first_answer(harness):
    run = harness.python_child("import time, json; print('noise'); print('FIRST', time.time()); "
                               "print('RESULT ' + json.dumps({'ok': 1}))", timeout=60)
    assert run.rc == 0 and run.result() == {"ok": 1} and run.result("STATS") is None
    assert 0 <= run.since_spawn() < 60
    failed = harness.python_child("import sys; sys.exit('no luck')", timeout=60)
    assert failed.result() is None and failed.result_or_failure() == {"rc": 1, "stderr": "no luck\n"}


def test_a_child_past_its_time_is_stopped_and_says_so(harness):
    run = harness.python_child("import time; time.sleep(30)", timeout=0.5)
    assert run.rc is None and "timed out" in run.failure()["stderr"]


def test_timing_warms_up_then_times_each_call(harness):
    calls = []
    times = harness.times_ms(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)
    assert harness.spread([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], with_median=True)[1] == 5.5


def test_a_decision_is_what_a_caller_acts_on(harness):
    assert harness.decision({"type": "noul", "noul": 0.7}) is True
    assert harness.decision({"type": "choice", "choice": "billing", "probabilities": {"billing": 0.6}}) == "billing"
    assert harness.decision({"type": "score", "probabilities": {"0": 0.2, "1": 0.5, "2": 0.3}}) == "1"
    assert harness.margin({"probabilities": {"a": 0.5, "b": 0.3}}) == pytest.approx(0.2)


def test_the_workload_is_seeded(harness):
    assert harness.states(2, 12) == harness.states(2, 12) and len(harness.states(3, 5)) == 3
    ids = harness.forward_args(2, 32, vocab=100)[0]
    assert ids.shape == (2, 32) and int(ids.max()) < 100


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_runs_on_the_harness_and_defaults_to_no_machine_path(name):
    text = (BENCHMARKS / ("%s.py" % name)).read_text()
    assert re.search(r"^import harness$", text, re.M), "%s.py does not use benchmarks/harness.py" % name
    assert not re.search(r"""["']/tmp/""", text), "%s.py names a /tmp path: take it as an argument" % name


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports_and_answers_help(name, monkeypatch, capsys):
    module = load_script(name)
    if not hasattr(module, "main"):  # a plain script (start_once.py): importing it ran nothing
        return
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / ("%s.py" % name)), "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0 and "--out" in capsys.readouterr().out

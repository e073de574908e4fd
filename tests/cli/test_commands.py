"""The commands a person runs: `laya-aot demo` end to end on an existing bundle (the README's first command
builds one first; CI's fresh clone runs that)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import another_torch, built_with_torch

ROOT = Path(__file__).resolve().parents[2]


def test_demo_answers_from_the_bundle_and_names_the_artifact(demo_bundle, demo_ckpt, capsys):
    from laya_aot.commands import demo

    assert demo(["--bundle", str(demo_bundle), "--checkpoint", str(demo_ckpt)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    # which artifact serves follows the build's timings (aoti-cpu or onnx on this machine): the one named is the
    # bundle's, of the kind the backend names
    from laya_aot.bundle_format import read_manifest

    kinds = {a["name"]: a["kind"] for a in read_manifest(demo_bundle)["artifacts"]}
    named = re.search(r"backend: aot:(\S+)\s+artifact: ([\w.-]+)", out)
    assert named and kinds.get(named.group(2)) == named.group(1), out
    assert "first answer" in out
    assert "not used" not in out   # built with this torch: nothing refused


def test_the_demos_start_is_the_process_time_to_its_first_answer(demo_bundle, demo_ckpt):
    """The printed figure is the whole process's, from its start (interpreter, imports and all) to the first
    answer: measured here from just before the process was made to the moment its line arrives, it agrees within
    0.1 s (and is never more: the process cannot have started before it was made; the kernel's start time is in
    10 ms ticks)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "laya_aot.cli", "demo", "--bundle", str(demo_bundle),
                             "--checkpoint", str(demo_ckpt)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("first answer "):
                seen = time.monotonic() - t0
                break
        else:
            raise AssertionError("no first-answer line")
    finally:
        rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, rest
    printed = float(re.match(r"first answer ([\d.]+) s after the process started; ", line).group(1))
    assert printed <= seen + 0.011 and seen - printed < 0.1, (printed, seen, line)
    assert "building the bundle" not in line   # it was there: nothing else to name


def test_demo_names_what_this_torch_refuses_with_the_fix(bundle_copy, demo_ckpt, capsys):
    """A bundle built under another torch: ONNX answers, and the demo names each package the install would bring
    back (the load stopped at ONNX and never examined them); `inspect` says which torch they need."""
    from laya_aot.commands import demo, inspect

    version = another_torch()
    names = built_with_torch(bundle_copy, version)
    assert demo(["--bundle", str(bundle_copy), "--checkpoint", str(demo_ckpt)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    assert "backend: aot:onnx" in out
    for name in names:
        assert re.search(r"not used: %s: built for torch %s, this process has torch [\d.]+: install the torch it was "
                         r"built with \(`pip install torch==%s`\), or rebuild" % (name, re.escape(version),
                                                                                  re.escape(version)), out), out
    assert inspect([str(bundle_copy)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    says = "needs torch %s where it serves" if len(names) == 1 else "need torch %s where they serve"
    assert "torch: %s %s (`pip install torch==%s` before laya-aot), not this one; " \
        % (", ".join(names), says % version, version) in out, out


def test_inspect_says_what_load_would_serve_here_and_lists_cleanly_when_piped(demo_bundle, demo_ckpt, capsys):
    """The last line names the artifact `laya_aot.load` then serves (the loader's own ranking); piped output is a
    plain list, no table; --json keeps its keys (issue 22, item 6)."""
    import json
    import re

    import laya_aot
    from laya_aot.commands import inspect

    assert inspect([str(demo_bundle)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    assert "┃" not in out and "│" not in out                                   # a list, not a folded table
    assert re.search(r"build latency: cpu [\d.]+ ms @1x128x4", out)
    served = re.search(r"on this machine `load\(\)` would serve: (\S+) \(", out.strip().splitlines()[-1])
    assert served, out[-500:]
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu")
    assert agent.backend_object.artifact.name == served.group(1)
    assert inspect([str(demo_bundle), "--json"], time.perf_counter()) == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == {"bundle", "bundle_sha256", "checkpoint", "machine", "device", "serving_dtype", "artifacts",
                          "torch_needed", "would_serve"}
    # the same facts as the text: what load() serves and why, each artifact's build latencies and torch
    assert facts["would_serve"]["artifact"] == served.group(1) and "[bold]" not in facts["would_serve"]["why"]
    assert "measured on cpu" in facts["would_serve"]["why"]
    recorded = json.loads((demo_bundle / "bundle.json").read_text())["artifacts"]
    assert [r["latency_ms"] for r in facts["artifacts"]] == [a.get("latency_ms", {}) for a in recorded]
    assert [r["needs_torch"] for r in facts["artifacts"]] == [(a.get("needs") or {}).get("torch") for a in recorded]


def test_inspect_refuses_a_device_this_machine_cannot_see(demo_bundle, capsys):
    """A GPU's facts are not known on a machine without one: `inspect --device cuda` said laya serves in fp16 on
    cuda here, and that eager would serve."""
    import torch

    from laya_aot.commands import inspect

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU sees cuda")

    with pytest.raises(SystemExit) as e:
        inspect([str(demo_bundle), "--device", "cuda"], time.perf_counter())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cuda is not visible here (no CUDA device); run the command on the GPU machine" in err, err


def test_inspect_says_whether_a_start_here_runs_a_probe_child(demo_bundle, other_facts_bundle, demo_ckpt, tmp_path,
                                                             monkeypatch, capsys):
    """The build's verdict fits the machine that built it: no child for a start that pins the bundle, as the loader
    then says; a bundle built on a machine with other facts: a child on the first start, and none once a start here
    probed it."""
    import json

    import laya_aot
    from laya_aot.bundle_format import bundle_sha256
    from laya_aot.commands import inspect

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    for bundle, before, after in ((demo_bundle, "shipped", "shipped"), (other_facts_bundle, "child", "cached")):
        assert inspect([str(bundle), "--json"], time.perf_counter()) == 0
        rows = {r["name"]: r["probe_here"] for r in json.loads(capsys.readouterr().out)["artifacts"]}
        assert rows["aoti-cpu"] == rows["aoti-cpu-frozen"] == before
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle), device="cpu", prefer="aoti",
                              bundle_sha256=bundle_sha256(bundle) if before == "shipped" else None)
        assert agent.backend_object.load_stats["probe"] == {"shipped": "shipped", "child": "ran"}[before]
        # which of the two packages serves follows the build's latency figures (noisy on a busy machine)
        served = agent.backend_object.artifact.name
        assert inspect([str(bundle)], time.perf_counter()) == 0
        out = capsys.readouterr().out
        assert "%s %s" % (served, "none when the start pins the bundle (the build's verdict fits" if after == "shipped"
                          else "none (probed here before)") in out, out
        assert "probe child (native artifacts, on a start here): " in out, out

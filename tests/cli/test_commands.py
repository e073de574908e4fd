"""The commands a person runs: `laya-aot demo` end to end on an existing bundle (the README's first command
builds one first; CI's fresh clone runs that)."""
from __future__ import annotations

import time


def test_demo_answers_from_the_bundle_and_names_the_artifact(demo_bundle, demo_ckpt, capsys):
    from laya_aot.commands import demo

    assert demo(["--bundle", str(demo_bundle), "--checkpoint", str(demo_ckpt)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    assert "backend: aot:" in out and "artifact: aoti-cpu" in out and "first answer" in out


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
    assert set(facts) == {"bundle", "bundle_sha256", "checkpoint", "machine", "device", "serving_dtype", "artifacts"}


def test_inspect_says_whether_a_start_here_runs_a_probe_child(demo_bundle, other_facts_bundle, demo_ckpt, tmp_path,
                                                             monkeypatch, capsys):
    """The build's verdict fits the machine that built it: no child, as the loader then says; a bundle built on a
    machine with other facts: a child on the first start, and none once a start here probed it."""
    import json

    import laya_aot
    from laya_aot.commands import inspect

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    for bundle, before, after in ((demo_bundle, "shipped", "shipped"), (other_facts_bundle, "child", "cached")):
        assert inspect([str(bundle), "--json"], time.perf_counter()) == 0
        rows = {r["name"]: r["probe_here"] for r in json.loads(capsys.readouterr().out)["artifacts"]}
        assert rows["aoti-cpu"] == rows["aoti-cpu-frozen"] == before and rows["exported_program-fp32"] is None
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle), device="cpu", prefer="aoti")
        assert agent.backend_object.load_stats["probe"] == {"shipped": "shipped", "child": "ran"}[before]
        # which of the two packages serves follows the build's latency figures (noisy on a busy machine)
        served = agent.backend_object.artifact.name
        assert inspect([str(bundle)], time.perf_counter()) == 0
        out = capsys.readouterr().out
        assert "%s %s" % (served, "none (the build's verdict fits" if after == "shipped"
                          else "none (probed here before)") in out, out
        assert "probe child (native artifacts, on a start here): " in out, out

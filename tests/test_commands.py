"""The commands a person runs: `laya-aot demo` end to end on an existing bundle (the README's first command
builds one first; CI's fresh clone runs that)."""
from __future__ import annotations

import time


def test_demo_answers_from_the_bundle_and_names_the_artifact(demo_bundle, demo_ckpt, capsys):
    from laya_aot.commands import demo

    assert demo(["--bundle", str(demo_bundle), "--checkpoint", str(demo_ckpt)], time.perf_counter()) == 0
    out = capsys.readouterr().out
    assert "backend: aot:" in out and "artifact: aoti-cpu" in out and "first answer" in out

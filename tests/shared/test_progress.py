"""Long work shows a live line with its elapsed time on a terminal, and nothing when piped or quiet (issue 22,
item 4)."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from laya_aot import progress

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _on_a_terminal(args, cwd: Path, timeout: float = 600) -> str:
    """Run the CLI with a pseudo-terminal as stdout and stderr; everything it drew, escape codes removed."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=os.environ.get("TEST_COLUMNS", "150"), LINES="40",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "laya_aot.cli", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            p.kill()
            raise AssertionError("no output for %s s:\n%s" % (timeout, out.decode(errors="replace")[-3000:]))
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    p.wait(timeout=60)
    os.close(master)
    assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    return ANSI.sub("", out.decode(errors="replace").replace("\r", "\n"))


@pytest.mark.slow  # a `laya-aot build` process
def test_a_cpu_build_shows_a_live_line_per_stage_and_per_artifact_and_case(demo_ckpt, tmp_path):
    # AOTInductor is left out to keep the test short: its stage is a stage like the others
    text = _on_a_terminal(["build", "checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % (tmp_path / "b"),
                           "stages.aoti=false"], tmp_path)
    ran = re.findall(r"^ok\s+(\w+)\s+([\d.]+) s", text, re.M)
    assert {"load", "exported_program", "onnx", "verify"} <= {name for name, _ in ran}, text[-3000:]
    for name, seconds in ran:
        if float(seconds) > 2:
            assert re.search(r"stage %s\s.*\d:\d\d:\d\d" % name, text), (name, text[-3000:])  # live, with elapsed
    assert re.search(r"verify: onnx-fp32\s+\d/\d", text), text[-3000:]                # per artifact, counted
    assert re.search(r"cases of onnx-fp32\s+\d/\d", text), text[-3000:]               # per case, counted


def test_no_live_line_when_quiet_or_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.shown()
    progress.set_quiet()
    try:
        assert not progress.shown()
        with progress.task("quiet", total=3) as t:
            t.advance()                                   # a no-op task: nothing drawn, nothing raised
    finally:
        progress.set_quiet(False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not progress.shown()


def test_pack_and_unpack_count_their_bytes(small_bundle, tmp_path, monkeypatch):
    """pack and unpack open a live line counting bytes (issue 22, item 4); the column shows megabytes."""
    import contextlib

    from rich.progress import Progress

    from laya_aot.distribution.pack import pack, unpack

    opened = []
    real = progress.task

    @contextlib.contextmanager
    def spy(description, total=None, unit=None):
        with real(description, total, unit) as t:
            calls = []
            t.advance = lambda n=1, calls=calls: calls.append(n)
            opened.append((description.split()[0], total, unit, calls))
            yield t

    monkeypatch.setattr(progress, "task", spy)
    info = pack(small_bundle, tmp_path / "b.tar.zst")
    unpack(info.path, tmp_path / "out")
    assert [(name, unit) for name, _, unit, _ in opened] == [("pack", "bytes"), ("unpack", "bytes")]
    for _, total, _, calls in opened:
        assert total > 0 and sum(calls) == total   # every byte counted once
    with Progress(progress._count_column()) as p:
        tid = p.add_task("x", total=3_500_000, unit="bytes", completed=1_200_000)
        task = next(t for t in p.tasks if t.id == tid)
        assert progress._count_column().render(task).plain == "1.2/3.5 MB"

"""Fixtures of the reliability suite: a service stand-in process, counts kept across a run.

The fast half runs in CI with the rest of the tests; the heavy variants are marked `heavy` and run with
`python -m pytest tests/reliability -m heavy` (figures in benchmarks/results/reliability.md).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

HERE = Path(__file__).resolve().parent


class Worker:
    """`worker.py` in a child process; restarted after it dies, counting each death."""

    def __init__(self, checkpoint: Path, env: Dict[str, str], stderr_path: Path):
        self.checkpoint, self.env, self.stderr_path = checkpoint, env, stderr_path
        self.deaths: list = []
        self.proc: Optional[subprocess.Popen] = None
        self._start()

    def _start(self) -> None:
        with open(self.stderr_path, "wb") as err:  # a fresh log per worker: what a death leaves is its own
            self.proc = subprocess.Popen([sys.executable, str(HERE / "worker.py"), str(self.checkpoint)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env=self.env)
        ready = self.proc.stdout.readline()
        assert json.loads(ready)["ready"], ready

    def ask(self, bundle: Path, manifest_text: str, verify: bool = False,
            probe: bool = False) -> Optional[Dict[str, Any]]:
        """The worker's answer, or None when the request killed it (the manifest is kept with the death)."""
        # the AOTInductor packages are asked for: native code in this process is what a manifest must not reach
        self.proc.stdin.write(json.dumps({"bundle": str(bundle), "verify": verify, "probe": probe,
                                          "prefer": "aoti"}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        rc = self.proc.wait()
        tail = self.stderr_path.read_bytes()[-3000:].decode(errors="replace")
        self.deaths.append({"returncode": rc, "manifest": manifest_text, "stderr_tail": tail})
        self._start()
        return None

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(demo_ckpt, tmp_path_factory):
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(tmp_path_factory.mktemp("worker-cache")))
    w = Worker(demo_ckpt, env, tmp_path_factory.mktemp("worker-log") / "stderr.txt")
    yield w
    w.close()


@pytest.fixture(scope="module")
def fuzz_bundle(demo_bundle, tmp_path_factory) -> Path:
    """A copy of the demo bundle (files hard-linked: regular files, no copy of the packages) whose
    bundle.json the fuzz tests rewrite."""
    dst = tmp_path_factory.mktemp("fuzz") / "bundle"
    shutil.copytree(demo_bundle, dst, copy_function=os.link)
    return dst

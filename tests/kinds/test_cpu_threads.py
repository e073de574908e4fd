"""OpenMP's wait policy is set before torch starts (`kinds.cpu_threads.settle`): by `laya_aot.load` and by every
`laya-aot` command, unless the environment chose one, and never after torch is imported (libgomp read it then)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SEEN = """
import json, os, sys
{before}
print("RESULT " + json.dumps({{"policy": os.environ.get("OMP_WAIT_POLICY"), "torch": "torch" in sys.modules}}))
"""


def _policy(before: str, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    p = subprocess.run([sys.executable, "-c", SEEN.format(before=before)], capture_output=True, text=True,
                       timeout=120, env=dict(base, **env))
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[7:])


LOAD = """
import laya_aot
try:
    laya_aot.load("/no/such/checkpoint", bundle="/no/such/bundle")
except FileNotFoundError:
    pass
"""


def test_load_and_the_command_set_a_passive_wait_policy_before_torch(tmp_path):
    assert _policy(LOAD) == {"policy": "PASSIVE", "torch": False}
    command = "from laya_aot import cli\ncli.main(['inspect', %r])" % str(tmp_path / "no-bundle")
    assert _policy(command)["policy"] == "PASSIVE"


def test_the_environments_choice_stands_and_nothing_is_set_after_torch():
    assert _policy(LOAD, OMP_WAIT_POLICY="ACTIVE")["policy"] == "ACTIVE"
    assert _policy(LOAD, GOMP_SPINCOUNT="300000")["policy"] is None
    assert _policy("import torch\n" + LOAD) == {"policy": None, "torch": True}

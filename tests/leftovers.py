"""What a killed laya-aot command leaves beside its output, and directories a user names like it: the material of
the tests of what laya-aot may delete (`staging.stale_reason`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

_KILLED = """
import os, sys
from pathlib import Path
from laya_aot import staging
p = staging.new_staging(Path(sys.argv[1]))
(p / "half-written.bin").write_bytes(b"x" * 4096)
print(p, flush=True)
os._exit(0)  # gone without cleaning up, as a command killed with SIGKILL is
"""


def killed_leftover(out: Path) -> Path:
    """The marked staging directory of a command writing `out` that was killed: its process is gone."""
    r = subprocess.run([sys.executable, "-c", _KILLED, str(out)], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    return Path(r.stdout.strip())


def user_lookalikes(out: Path) -> Dict[Path, str]:
    """Directories of a user's named like laya-aot's leftovers beside `out`, each holding a file: path -> content.

    Unmarked (a short name, laya-aot's name pattern, an `.old-` backup), a marker naming another token, and a
    marker whose owner is this very process (a live command's staging)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    made: Dict[Path, str] = {}
    for i, suffix in enumerate(["partial-mine", "partial-0123456789abcdef", "old-1234", "old-fedcba9876543210",
                                "partial-00000000000000aa", "partial-00000000000000bb"]):
        d = out.parent / (".%s.%s" % (out.name, suffix))
        d.mkdir()
        (d / "thesis.tex").write_text("years of work %d" % i)
        made[d / "thesis.tex"] = "years of work %d" % i
    from laya_aot import staging

    forged = {"written_by": "laya-aot staging", "uid": os.getuid(), "pid": 2 ** 22 + 7, "started": None,
              "token": "0000000000000000"}  # a dead owner, but the token is not the directory's
    (out.parent / (".%s.partial-00000000000000aa" % out.name) / staging.MARKER).write_text(json.dumps(forged))
    live = dict(forged, pid=os.getpid(), token="00000000000000bb")  # this process: a command still running
    (out.parent / (".%s.partial-00000000000000bb" % out.name) / staging.MARKER).write_text(json.dumps(live))
    return made


def intact(made: Dict[Path, str]) -> None:
    for path, text in made.items():
        assert path.read_text() == text, path

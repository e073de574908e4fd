"""laya's own server tests (its sdist's tests/test_serve.py) against laya's app and against `laya-aot serve`'s.

`laya-aot serve` promises every route laya defines answers as in `laya serve`; laya's own test suite is the
reference for what that means. It runs twice in the same environment: once as laya ships it, once with
`laya.serve.create_app` made laya-aot's (benchmarks/laya_serve_swap/sitecustomize.py, on PYTHONPATH, so the
children some tests start get it too). The two pass/fail sets must be equal; the script exits 1 otherwise.

    pip download --no-deps --no-binary :all: laya==0.4.15 -d artifacts/laya-sdist
    tar xzf artifacts/laya-sdist/laya-0.4.15.tar.gz -C artifacts/laya-sdist
    python benchmarks/laya_serve_tests.py --sdist artifacts/laya-sdist/laya-0.4.15

Writes laya_serve_tests<tag>.json and .md to --out.

The sdist ships no docs/ directory, so laya's tests that read docs/*.md fail in both runs alike (each failure's
message is listed).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Tuple

import harness

ROOT = harness.ROOT
SWAP = ROOT / "benchmarks" / "laya_serve_swap"


def run(sdist: Path, swapped: bool, workdir: Path) -> Tuple[Dict[str, str], float, list, Dict[str, str]]:
    """Outcome per test id (passed, failed, error, skipped), seconds, the command run, and each failure's message."""
    xml = workdir / ("%s.xml" % ("laya-aot" if swapped else "laya"))
    paths = [str(SWAP)] if swapped else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [str(ROOT)]))
    # -P: the sdist's own laya/ is not imported from the working directory; the installed laya is under test
    cmd = [sys.executable, "-P", "-m", "pytest", "tests/test_serve.py", "-q", "-p", "no:cacheprovider",
           "--junitxml", str(xml)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=sdist, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    took = time.perf_counter() - t0
    outcomes: Dict[str, str] = {}
    messages: Dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = "%s::%s" % (case.get("classname"), case.get("name"))
        kinds = {child.tag for child in case}
        for child in case:
            if child.tag in ("failure", "error"):
                messages[tid] = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
        outcomes[tid] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                         else "skipped" if "skipped" in kinds else "passed")
    return outcomes, took, ["PYTHONPATH=" + env["PYTHONPATH"]] + cmd, messages


SWAP_CHECK = """
import laya.serve
from fastapi.testclient import TestClient
assert getattr(laya.serve.create_app, "laya_aot_swapped", False), "laya.serve.create_app was not swapped"
class R:
    loaded, _agents = [], {}
    def predict(self, state, questions, model=None):
        return {"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}
client = TestClient(laya.serve.create_app(router=R()))
assert client.post("/v1/systemone", json={"state": "x", "questions": {}}).status_code == 200
r = client.get("/v1/aot")
assert r.status_code == 200 and set(r.json()) == {"backends", "bundles", "strict", "near_ties", "batching"}, r.text
batching = r.json()["batching"]
assert batching["enabled"] and batching["calls"]["alone"] == 1, batching  # the request went through the batcher
print("swapped: GET /v1/aot", r.status_code, "batching enabled, calls", batching["calls"])
"""


def swap_works() -> str:
    """Proof that the swapped run tests laya-aot's app: laya.serve.create_app answers laya-aot's own route."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SWAP), str(ROOT)]))
    r = subprocess.run([sys.executable, "-P", "-c", SWAP_CHECK], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit("the swap did not take: %s" % r.stderr[-2000:])
    return r.stdout.strip()


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--sdist", type=Path, required=True, help="an extracted laya sdist (laya-0.4.15/)")
    args = ap.parse_args()
    sdist = args.sdist.resolve()
    proof = swap_works()
    with tempfile.TemporaryDirectory() as tmp:
        laya, t_laya, cmd_laya, why_laya = run(sdist, False, Path(tmp))
        aot, t_aot, cmd_aot, why_aot = run(sdist, True, Path(tmp))
    fail = {"failed", "error"}
    failed_laya = sorted(t for t, o in laya.items() if o in fail)
    failed_aot = sorted(t for t, o in aot.items() if o in fail)
    differ = sorted(t for t in set(laya) | set(aot) if laya.get(t) != aot.get(t))

    def count(outcomes: Dict[str, str]) -> str:
        return ", ".join("%d %s" % (sum(1 for o in outcomes.values() if o == k), k)
                         for k in ("passed", "failed", "error", "skipped"))

    lines = [
        "laya %s's sdist `tests/test_serve.py`, run twice in one environment: against laya's app as laya "
        "ships it, and with `laya.serve.create_app` made laya-aot serve's (`benchmarks/laya_serve_swap/`: "
        "laya's app built by `laya_aot.serve.create_app`, with `GET /v1/aot` added as a middleware and its "
        "batcher on, as by default, in the test process and in the child processes some tests start)."
        % sdist.name.split("-")[-1],
        "",
        "- the swap takes (checked in a child first): `%s`" % proof,
        "- laya's app: `%s` (%.0f s): %s" % (" ".join(cmd_laya), t_laya, count(laya)),
        "- laya-aot serve's app: `%s` (%.0f s): %s" % (" ".join(cmd_aot), t_aot, count(aot)),
        "- **tests whose outcome differs: %d**%s" % (len(differ), "" if not differ else ": " + ", ".join(
            "`%s` (laya %s, laya-aot %s)" % (t, laya.get(t), aot.get(t)) for t in differ)),
        "",
        "## Failing against laya's app (%d)" % len(failed_laya),
        "",
    ] + ["- `%s`: %s" % (t, why_laya.get(t, "")) for t in failed_laya] + [
        "",
        "## Failing against laya-aot serve's app (%d)" % len(failed_aot),
        "",
    ] + ["- `%s`: %s" % (t, why_aot.get(t, "")) for t in failed_aot] + [""]
    result = {"laya": laya, "laya_aot": aot, "differ": differ, "swap_check": proof}
    harness.write(args.out, "laya_serve_tests" + args.tag, result, "\n".join(lines),
                  title="laya's own server tests against `laya serve` and `laya-aot serve`")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

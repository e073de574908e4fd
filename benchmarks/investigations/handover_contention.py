"""How much do serving calls slow down while a hand-over runs beside them, and does a shorter GIL switch
interval during it help? (CPU, a project-made checkpoint.)

    python benchmarks/investigations/handover_contention.py --ckpt CKPT --bundle BUNDLE [--seconds 12] [--switch 0.0005]

A copy of BUNDLE whose ONNX artifact has the best mix, with ONNX made a kind that runs laya's own module (as the
compile route and TileLang do; this machine builds neither), so `load` serves the AOTInductor package and ONNX
takes over after the first call. From that call on, one-state one-question calls run back to back for --seconds;
each call's latency is recorded with the hand-over's state when it ended. Then the same with the interpreter's
switch interval set to --switch (restored after). Each run is a fresh process. Prints the medians and p90s during
the hand-over and after it, and writes JSON to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import dataclasses, json, sys, time
import laya_aot
from laya_aot.kinds import registry
from laya_aot.runtime import handover
registry._BY_NAME["onnx"] = dataclasses.replace(registry._BY_NAME["onnx"], needs_module=True)
handover.IDLE_S = 60.0
switch = {switch!r}
agent = laya_aot.load({ckpt!r}, bundle={bundle!r}, device="cpu")
state = ["I was charged twice for the March invoice"]
q = {{"team": {{"type": "choice", "instructions": "Which team should handle this?",
               "criteria": {{"billing": "payments, refunds", "technical": "errors, outages", "account": "login"}}}}}}
old = sys.getswitchinterval()
if switch:
    sys.setswitchinterval(switch)
first = agent.backend_object
calls = []
t_end = time.perf_counter() + {seconds!r}
while time.perf_counter() < t_end:
    t = time.perf_counter(); agent.predict_batch(state, q); dt = time.perf_counter() - t
    ho = first.handover
    calls.append((round(dt * 1e3, 3), ho.stats.get("state") if ho else None, agent.backend_object.artifact.name))
sys.setswitchinterval(old)
print("RESULT", json.dumps(dict(calls=calls, handover=first.load_stats.get("handover") or
                                (first.handover.stats if first.handover else None))), flush=True)
"""


def one(args, bundle: Path, switch: float) -> dict:
    code = CHILD.format(ckpt=str(args.ckpt), bundle=str(bundle), switch=switch, seconds=args.seconds)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LAYA_AOT_CACHE_DIR=str(args.cache)))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(p.stderr[-3000:])


def summary(calls) -> dict:
    out = {}
    for phase, sel in (("during", lambda c: c[1] in ("waiting", "running")), ("after", lambda c: c[1] == "done")):
        xs = sorted(c[0] for c in calls if sel(c))
        if xs:
            out[phase] = dict(n=len(xs), median_ms=round(statistics.median(xs), 3),
                              p90_ms=round(xs[int(0.9 * (len(xs) - 1))], 3), max_ms=xs[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--switch", type=float, default=0.0005)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    args.cache = tmp / "cache"
    copy = tmp / "bundle"
    shutil.copytree(args.bundle, copy)
    m = json.loads((copy / "bundle.json").read_text())
    for a in m["artifacts"]:
        if a["name"] == "onnx-fp32":
            a["latency_ms"] = {"cpu": {"1x128x4": 0.01, "8x256x4": 0.01}}
    (copy / "bundle.json").write_text(json.dumps(m, indent=1))
    one(args, copy, 0.0)  # the probe verdicts and start costs: later runs are later starts
    runs = []
    for r in range(args.rounds):
        for switch in (0.0, args.switch):
            res = one(args, copy, switch)
            s = summary(res["calls"])
            runs.append(dict(round=r, switch=switch or sys.getswitchinterval(), summary=s, handover=res["handover"]))
            print(json.dumps(runs[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(command=" ".join(sys.argv), runs=runs), indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

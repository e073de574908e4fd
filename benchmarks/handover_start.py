"""A start whose best mix starts slowly: the first answer, the hand-over, and the calls after it (issue 20).

    python3 benchmarks/handover_start.py --ckpt CKPT --bundle BUNDLE --out $OUT [--starts 3] [--tag _s25]

Each start is a fresh `python3 -c` as a user's process runs it: import, `laya_aot.load`, answer one question
(timed from the parent's spawn to the child's first answer, nothing inside it). Then, untimed by that clock, the
child waits for the hand-over (`backend_object.handover`), records it, and times the three realistic calls of
`gpu_start.py` (median of --repeats after 3 warm-ups) on what serves after it, with the compile counters of the
serving process. Modes alternate start by start: `handover` (load's default), `wait` (`handover=False`: the
start waits for the best mix itself) and `aoti` (`prefer="aoti"`: the AOTInductor artifact alone, no hand-over:
the same bundle's start without one). The first start of the run has an empty laya-aot cache (the probe child
runs); later starts reuse its verdicts and the start costs it recorded.
Writes handover<tag>.json and .md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_start import CALLS, ONE  # noqa: E402  (a sibling benchmark script)

CHILD = """
import json, statistics, sys, time
sys.path.insert(0, {bench!r})
import laya_aot
agent = laya_aot.load({ckpt!r}, bundle={bundle!r}, device={device!r}, **{load_kwargs!r})
agent.predict_batch(["I was charged twice for the March invoice"], {q!r})
import torch
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
sync(); print("FIRST", time.time(), flush=True)
first = agent.backend_object
out = dict(first=getattr(first.artifact, "name", None), first_stats=first.load_stats)
ho = getattr(first, "handover", None)
if ho is not None:
    t = time.perf_counter(); ho.join(600); out["handover_wait_s"] = round(time.perf_counter() - t, 3)
now = agent.backend_object
out.update(serving=getattr(now.artifact, "name", None), handover=(now.load_stats or dict()).get("handover"))
from gpu_start import CALLS, states
calls = dict()
for name, n, words, qs in CALLS:
    st = states(n, words, seed=n * 1000 + words)
    for _ in range(3):
        agent.predict_batch(st, qs)
    ts = []
    for _ in range({repeats}):
        sync(); t = time.perf_counter(); agent.predict_batch(st, qs); sync(); ts.append(time.perf_counter() - t)
    calls[name] = round(statistics.median(ts) * 1e3, 3)
out["calls_ms"] = calls
runner = getattr(now, "runner", None)
out["runner_stats"] = getattr(runner, "stats", None)
try:
    from laya_aot.kinds.inductor_cache import compile_counters
    out["compile_counters"] = compile_counters()
except Exception as e:
    out["compile_counters"] = repr(e)
print("RESULT", json.dumps(out, default=str), flush=True)
"""


MODES = {"handover": {}, "wait": {"handover": False}, "aoti": {"prefer": "aoti"}}


def one_start(args, mode: str, env: dict) -> dict:
    code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), ckpt=str(args.ckpt),
                        bundle=str(args.bundle), device=args.device, load_kwargs=MODES[mode], q=ONE,
                        repeats=args.repeats)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=args.timeout)
    res = {"mode": mode, "rc": p.returncode}
    for line in p.stdout.splitlines():
        if line.startswith("FIRST "):
            res["first_answer_s"] = round(float(line.split()[1]) - t0, 3)
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    if p.returncode:
        res["stderr"] = p.stderr[-3000:]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--starts", type=int, default=3, help="starts per mode")
    ap.add_argument("--modes", default="handover,wait", help="of %s, comma-separated" % ", ".join(MODES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/laya-aot-handover-cache"),
                    help="the runs' laya-aot cache (emptied first: the first start probes)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import shutil

    shutil.rmtree(args.cache, ignore_errors=True)
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(args.cache))
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error("--modes: use %s" % ", ".join(MODES))
    runs = []
    for _ in range(args.starts):
        for mode in modes:
            r = one_start(args, mode, env)
            r["start"] = "first" if not runs else "later"
            runs.append(r)
            print(json.dumps({k: r.get(k) for k in ("mode", "start", "rc", "first_answer_s", "first", "serving",
                                                    "handover_wait_s", "calls_ms")}), flush=True)
            if r.get("stderr"):
                print(r["stderr"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"ckpt": str(args.ckpt), "bundle": str(args.bundle), "device": args.device, "runs": runs}
    (args.out / ("handover%s.json" % args.tag)).write_text(json.dumps(doc, indent=1, default=str))
    (args.out / ("handover%s.md" % args.tag)).write_text(markdown(runs))


def markdown(runs) -> str:
    lines = ["| mode | start | first answer s | first served by | then serving | hand-over s (after the start) | "
             "1x1 / 8x3 / 32x3 ms after |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        ho = r.get("handover") or {}
        calls = r.get("calls_ms") or {}
        lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            r["mode"], r["start"], r.get("first_answer_s", "rc %s" % r["rc"]), r.get("first"), r.get("serving"),
            "%s (%s)" % (ho.get("seconds"), ho.get("state")) if ho else "-",
            " / ".join(str(calls.get(c[0], "-")) for c in CALLS)))
    med = {}
    for mode in MODES:
        xs = [r["first_answer_s"] for r in runs if r["mode"] == mode and r["start"] == "later"
              and "first_answer_s" in r]
        if xs:
            med[mode] = statistics.median(xs)
    if med:
        lines += ["", "Later starts, median first answer: " + ", ".join("%s %.2f s" % kv for kv in med.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

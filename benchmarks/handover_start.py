"""A start whose best mix starts slowly: the first answer, the hand-over, and the calls after it.

    python3 benchmarks/handover_start.py --ckpt CKPT --bundle BUNDLE [--starts 3] [--modes handover,wait,aoti]

Each start is a fresh `python3 -c` as a user's process runs it: import, `laya_aot.load`, answer one question
(timed from the parent's spawn to the child's first answer, nothing inside it). Then, untimed by that clock, the
child waits for the hand-over (`backend_object.handover`), records it, and times the three realistic calls
(`harness.CALLS`, median of --repeats after 3 warm-ups) on what serves after it, with the compile counters of the
serving process. Modes alternate start by start: `handover` (load's default), `wait` (`handover=False`: the
start waits for the best mix itself) and `aoti` (`prefer="aoti"`: the AOTInductor artifact alone, no hand-over:
the same bundle's start without one). The first start of the run has an empty laya-aot cache (the probe child
runs); later starts reuse its verdicts and the start costs it recorded.
The bundle must hold an artifact kind that runs laya's own module (the compile route or TileLang) with the best
mix beside a quicker one: build the parts (`target=sm_90 stages.tilelang=false`, and TileLang for sm_90a), merge
them, and in a copy give that kind the best mix by editing its `latency_ms` in `bundle.json`.
Writes handover<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import harness
from harness import CALLS, ONE

CHILD = """
import sys, time
import laya_aot
agent = laya_aot.load({ckpt!r}, bundle={bundle!r}, device={device!r}, **{load_kwargs!r})
agent.predict_batch(["I was charged twice for the March invoice"], {q!r})
import torch
torch.cuda.synchronize() if torch.cuda.is_available() else None; print("FIRST", time.time(), flush=True)
sys.path.insert(0, {bench!r})
import harness
first = agent.backend_object
out = dict(first=getattr(first.artifact, "name", None), first_stats=first.load_stats)
ho = getattr(first, "handover", None)
if ho is not None:
    t = time.perf_counter(); ho.join(600); out["handover_wait_s"] = round(time.perf_counter() - t, 3)
now = agent.backend_object
out.update(serving=getattr(now.artifact, "name", None), handover=(now.load_stats or dict()).get("handover"))
out["calls_ms"] = dict((name, harness.predict_ms(agent, harness.states(n, words), qs, {repeats}, device={device!r})[0])
                      for name, n, words, qs in harness.CALLS)
runner = getattr(now, "runner", None)
out["runner_stats"] = getattr(runner, "stats", None)
try:
    from laya_aot.kinds.inductor_cache import compile_counters
    out["compile_counters"] = compile_counters()
except Exception as e:
    out["compile_counters"] = repr(e)
harness.emit(out)
"""


MODES = {"handover": {}, "wait": {"handover": False}, "aoti": {"prefer": "aoti"}}


def one_start(args, mode: str, env: dict) -> dict:
    code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), ckpt=str(args.ckpt),
                        bundle=str(args.bundle), device=args.device, load_kwargs=MODES[mode], q=ONE,
                        repeats=args.repeats)
    run = harness.python_child(code, env=env, timeout=args.timeout)
    res = {"mode": mode, "rc": run.rc, **(run.result() or {})}
    if run.since_spawn() is not None:
        res["first_answer_s"] = run.since_spawn()
    if run.rc:
        res["stderr"] = run.stderr[-3000:]
    return res


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--starts", type=int, default=3, help="starts per mode")
    ap.add_argument("--modes", default="handover,wait", help="of %s, comma-separated" % ", ".join(MODES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=400.0)
    args = ap.parse_args()
    cache = args.work / "laya-aot-cache"  # emptied first: the first start probes
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(cache))
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error("--modes: use %s" % ", ".join(MODES))
    doc = {"ckpt": str(args.ckpt), "bundle": str(args.bundle), "device": args.device,
           "environment": harness.environment(), "runs": []}
    for _ in range(args.starts):
        for mode in modes:
            r = one_start(args, mode, env)
            r["start"] = "first" if not doc["runs"] else "later"
            doc["runs"].append(r)
            print(json.dumps({k: r.get(k) for k in ("mode", "start", "rc", "first_answer_s", "first", "serving",
                                                    "handover_wait_s", "calls_ms")}), flush=True)
            if r.get("stderr"):
                print(r["stderr"], flush=True)
    harness.write(args.out, "handover" + args.tag, doc, markdown(doc["runs"]), title="Starts with a hand-over")


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

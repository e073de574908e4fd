"""Resident memory of `laya-aot serve` against `laya serve` right after start, on the demo checkpoint (CPU).

Per round, each server is started as its command runs it (`python -m laya_aot.cli serve`, `python -m laya.serve`)
with the same LAYA_* settings, and its process's VmRSS is read from /proc when `GET /health` first answers
(after the preload), then after one `POST /v1/systemone`. laya-aot serve is also run with each artifact kind
it can serve here (`prefer` is not a server setting, so a bundle copy holding only that kind's artifacts is
used), since what it costs depends on which artifact serves. Where the extra memory goes is then measured in
one process: the modules each server's start imports beyond the other's, and the RSS after each step.

    python benchmarks/serve_memory.py --checkpoint CKPT --bundle BUNDLE --rounds 3

Writes serve_memory<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import harness

ROOT = harness.ROOT
QUESTION = {"team": {"type": "choice", "instructions": "Which team should handle this?",
                     "criteria": {"billing": "payments, refunds", "technical": "errors, outages"}}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS for %d" % pid)


def measure(cmd: List[str], env: Dict[str, str], log: Path) -> Dict[str, float]:
    port = _port()
    full = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(port), LAYA_THREADS="1", **env)
    url = "http://127.0.0.1:%d" % port
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + log.read_text(errors="replace")[-3000:])
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
            if time.monotonic() - t0 > 300:
                raise RuntimeError("server not ready:\n" + log.read_text(errors="replace")[-3000:])
        ready = _rss_mb(proc.pid)
        body = json.dumps({"model": "demo", "state": "I was charged twice for the March invoice",
                           "questions": QUESTION}).encode()
        req = urllib.request.Request(url + "/v1/systemone", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        return {"ready_mb": round(ready, 1), "after_request_mb": round(_rss_mb(proc.pid), 1)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def only_kind(bundle: Path, kind: str, dst: Path) -> Path:
    """A copy of `bundle` whose manifest lists only the exported program and `kind`'s artifacts."""
    shutil.copytree(bundle, dst)
    manifest = json.loads((dst / "bundle.json").read_text())
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["kind"] in (kind, "exported_program")]
    (dst / "bundle.json").write_text(json.dumps(manifest))
    return dst


STEPS = """
import json, os, sys
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
steps = [("python", rss())]
mode = sys.argv[1]
import laya.serve
steps.append(("import laya.serve", rss()))
if mode != "laya":
    import laya_aot.serve, laya_aot.runtime.loader
    steps.append(("import laya_aot.serve and its loader", rss()))
    create_app = laya_aot.serve.create_app
else:
    create_app = laya.serve.create_app
app = create_app()
steps.append(("create_app (preload)", rss()))
print(json.dumps({"steps": steps, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def in_process(env: Dict[str, str], mode: str) -> Dict[str, object]:
    full = dict(os.environ, LAYA_THREADS="1", PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=full, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(r: Dict[str, object]) -> str:
    lines = ["Medians of %d rounds, MB of resident memory (VmRSS):" % len(next(iter(r["rounds"].values()))), "",
             "| server | when `/health` first answers | after one request |", "|---|---|---|"]
    for name, m in r["median"].items():
        lines.append("| %s | %.1f | %.1f |" % (name, m["ready_mb"], m["after_request_mb"]))
    lines += ["", "In one process, RSS (MB) after each step:", ""]
    for name, v in r["in_process"].items():
        lines.append("- %s: %s" % (name, ", ".join("%s %.1f" % (step, mb) for step, mb in v["steps"])))
    lines += ["", "Top-level modules laya-aot serve's start imports beyond laya serve's: %s"
              % ", ".join(r["extra_top_level_modules"])]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    environment = harness.environment()
    ckpt, bundle = args.checkpoint.resolve(), args.bundle.resolve()
    base = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(ckpt)}), "LAYA_MODELS": "demo"}
    manifest = json.loads((bundle / "bundle.json").read_text())
    kinds = sorted({a["kind"] for a in manifest["artifacts"] if a["kind"] != "exported_program"
                    and a.get("needs", {}).get("device", "cpu") == "cpu"})
    results: Dict[str, List[Dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        modes = {"laya serve": ([sys.executable, "-m", "laya.serve"], base),
                 "laya-aot serve": ([sys.executable, "-m", "laya_aot.cli", "serve"],
                                    dict(base, LAYA_AOT_BUNDLES=json.dumps({"demo": str(bundle)})))}
        for kind in kinds:
            copy = only_kind(bundle, kind, tmp_path / ("only-" + kind))
            modes["laya-aot serve, only %s" % kind] = ([sys.executable, "-m", "laya_aot.cli", "serve"],
                                                       dict(base, LAYA_AOT_BUNDLES=json.dumps({"demo": str(copy)})))
        for r in range(args.rounds):
            for name, (cmd, env) in modes.items():
                env = dict(env, PYTHONPATH=str(ROOT))
                results.setdefault(name, []).append(measure(cmd, env, tmp_path / ("%s-%d.log" % (name, r))))
                print(name, results[name][-1], flush=True)
        steps = {"laya serve": in_process(base, "laya"),
                 "laya-aot serve": in_process(dict(base, LAYA_AOT_BUNDLES=json.dumps({"demo": str(bundle)})), "aot")}
    extra = sorted(set(steps["laya-aot serve"]["modules"]) - set(steps["laya serve"]["modules"]))
    summary = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    payload = {"environment": environment, "rounds": results, "median": summary, "in_process": steps,
               "extra_top_level_modules": extra}
    harness.write(args.out, "serve_memory" + args.tag, payload, markdown(payload),
                  title="Resident memory right after start: `laya-aot serve` against `laya serve`")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HTTP benchmark: `laya-aot serve` (bundle) against `laya serve` (eager), each a real server process.

Per mode: the time from spawning the server process to its first successful `POST /v1/systemone` (the
process imports, loads the checkpoint, and for the bundle checks and loads the artifact), then
requests/s and p50/p99 latency at each concurrency level (1, 8, 32 clients, each a thread with its own
keep-alive connection). The client is the standard library only (http.client), so it runs on a host
without httpx; the servers need fastapi and uvicorn. Both servers get the same settings, including
LAYA_MAX_CONCURRENT above the largest client count (laya's default, 16, answers 503 beyond it), and
their answers are compared (max |difference| of any probability, and equal decisions).

    python benchmarks/http_bench.py --requests 300                               # CPU, demo checkpoint
    python benchmarks/http_bench.py --device cuda --shape large-1024 --target sm_90 --requests 400
    python benchmarks/http_bench.py --checkpoint DIR --bundle BUNDLE_DIR         # an existing bundle

The servers need laya-aot's `serve` extra (laya's server, fastapi, uvicorn).
Writes http_<tag>.json and .md to --out.
"""
from __future__ import annotations

import http.client
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT))

from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES  # noqa: E402  (the repository, not an install)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(conn: http.client.HTTPConnection, body: bytes) -> tuple:
    conn.request("POST", "/v1/systemone", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()


def _bodies(states: List[str]) -> List[bytes]:
    return [json.dumps({"model": "bench", "state": s, "questions": DEMO_QUESTIONS}).encode() for s in states]


class Server:
    def __init__(self, mode: str, env: Dict[str, str], log_path: Path):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "laya_aot.cli", "serve"] if mode == "bundle" else \
            [sys.executable, "-m", "laya.serve"]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(self.port), **env))

    def first_answer(self, body: bytes, timeout: float) -> float:
        """Seconds from spawning the process to its first 200 on POST /v1/systemone."""
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited %s; log:\n%s" % (self.proc.returncode, self.log()[-4000:]))
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
                status, _ = _post(conn, body)
                conn.close()
                if status == 200:
                    return time.time() - self.t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("no answer within %.0f s; log:\n%s" % (timeout, self.log()[-4000:]))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def load_level(port: int, bodies: List[bytes], clients: int, requests: int) -> Dict[str, Any]:
    """`requests` POSTs shared by `clients` threads, each on its own keep-alive connection."""
    lat: List[float] = []
    statuses: Dict[int, int] = {}
    lock = threading.Lock()
    counter = iter(range(requests))
    barrier = threading.Barrier(clients + 1)

    def worker():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        barrier.wait()
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            t = time.perf_counter()
            try:
                status, _ = _post(conn, bodies[i % len(bodies)])
            except (OSError, http.client.HTTPException):
                status = -1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            dt = time.perf_counter() - t
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    lat.append(dt)
        conn.close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 2)) if lat else (lambda q: None)
    return {"clients": clients, "requests": requests, "ok": len(lat), "statuses": statuses,
            "wall_s": round(wall, 3), "rps": round(len(lat) / wall, 1), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None}


def reload_answer(srv: Server, body: bytes, idle_s: float, timeout: float) -> float:
    """Seconds of the first request after laya's idle unload (LAYA_IDLE_UNLOAD_SECONDS): the in-process reload."""
    deadline = time.time() + idle_s + timeout
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/health")
        loaded = json.loads(conn.getresponse().read()).get("loaded")
        conn.close()
        if loaded == []:
            break
        if time.time() > deadline:
            raise RuntimeError("the server never unloaded its checkpoint")
        time.sleep(0.1)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    t = time.perf_counter()
    status, raw = _post(conn, body)
    took = time.perf_counter() - t
    conn.close()
    assert status == 200, raw
    return round(took, 3)


def answers(port: int, bodies: List[bytes]) -> List[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    out = []
    for b in bodies:
        status, raw = _post(conn, b)
        assert status == 200, raw
        out.append(json.loads(raw)["answers"])
    conn.close()
    return out


def compare(a: List[dict], b: List[dict]) -> Dict[str, Any]:
    """Bundle answers `a` against eager answers `b`: the largest probability difference, decisions equal, and
    eager's margin wherever a decision differs (a near-tie flips between two reduced-precision computations)."""
    worst, same, total, differ = 0.0, 0, 0, []
    for x, y in zip(a, b):
        for qid in y:
            total += 1
            px, py = x[qid].get("probabilities") or {}, y[qid].get("probabilities") or {}
            for k in py:
                worst = max(worst, abs(px[k] - py[k]))
            if "noul" in y[qid]:
                worst = max(worst, abs(x[qid]["noul"] - y[qid]["noul"]))
            worst = max(worst, abs(x[qid]["action"]["act_probability"] - y[qid]["action"]["act_probability"]))
            if harness.decision(x[qid]) == harness.decision(y[qid]):
                same += 1
            else:
                differ.append({"question": qid, "eager_margin": round(harness.margin(y[qid]), 6)})
    return {"max_abs_diff": round(worst, 6), "same_decisions": same, "decisions": total, "differing": differ}


def summarise(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the rounds (and the spread of requests/s); the first start apart from later ones (the
    first bundle start runs the probe child, later ones find its verdict cached)."""
    med = statistics.median
    levels = []
    for i, lv in enumerate(runs[0]["levels"]):
        same = [r["levels"][i] for r in runs]
        statuses: Dict[str, int] = {}
        for x in same:
            for k, v in x["statuses"].items():
                statuses[str(k)] = statuses.get(str(k), 0) + v
        levels.append({"clients": lv["clients"], "rps": med([x["rps"] for x in same]),
                       "rps_range": [min(x["rps"] for x in same), max(x["rps"] for x in same)],
                       "p50_ms": med([x["p50_ms"] for x in same]), "p99_ms": med([x["p99_ms"] for x in same]),
                       "statuses": statuses})
    return {"first_answer_s": runs[0]["first_answer_s"],
            "later_first_answer_s": med([r["first_answer_s"] for r in runs[1:]]) if len(runs) > 1 else None,
            "reload_answer_s": med([r["reload_answer_s"] for r in runs]), "levels": levels,
            "answers": runs[0]["answers"], "load_lines": runs[0].get("load_lines"), "runs": runs}


def prepare(a, work: Path) -> tuple:
    ckpt = a.checkpoint
    if ckpt is None:
        from laya_aot.demo import make_checkpoint

        ckpt = str(make_checkpoint(work / ("ckpt-%s" % a.shape), a.shape, seed=0))
    bundle, build_s = a.bundle, None
    if bundle is None:
        bundle = str(work / "bundle")
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt, "output_dir=%s" % bundle,
               "target=%s" % a.target] + shlex.split(a.build_args)
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        build_s = round(time.perf_counter() - t, 1)
    return ckpt, bundle, build_s


def run_mode(mode: str, a, ckpt: str, bundle: str, bodies: List[bytes], work: Path, rnd: int) -> Dict[str, Any]:
    env = {"LAYA_EXTRA_MODELS": json.dumps({"bench": ckpt}), "LAYA_MODELS": "bench",
           "LAYA_MAX_CONCURRENT": str(max(a.clients) * 2), "LAYA_LOG_LEVEL": "warning",
           "LAYA_AOT_CACHE_DIR": str(work / "aot-cache"), "LAYA_IDLE_UNLOAD_SECONDS": str(a.idle_unload)}
    if a.device:
        env["LAYA_DEVICE"] = a.device
    if a.threads:
        env["LAYA_THREADS"] = str(a.threads)
    if mode == "bundle":
        env["LAYA_AOT_BUNDLES"] = json.dumps({"bench": bundle})
    srv = Server(mode, env, work / ("%s-%d.log" % (mode, rnd)))
    try:
        first = srv.first_answer(bodies[0], a.timeout)
        out: Dict[str, Any] = {"first_answer_s": round(first, 2)}
        load_level(srv.port, bodies, 1, a.warmup)
        out["answers"] = answers(srv.port, bodies)
        out["levels"] = [load_level(srv.port, bodies, c, a.requests) for c in a.clients]
        out["reload_answer_s"] = reload_answer(srv, bodies[0], a.idle_unload, a.timeout)
        if mode == "bundle":
            out["load_lines"] = [ln.strip() for ln in srv.log().splitlines() if "load #" in ln]
    finally:
        srv.stop()
    return out


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--checkpoint", default=None, help="a Laya checkpoint dir (default: a demo checkpoint --shape)")
    p.add_argument("--shape", default="tiny", help="demo checkpoint shape when --checkpoint is not given")
    p.add_argument("--bundle", default=None, help="a bundle built from --checkpoint (default: build one)")
    p.add_argument("--target", default="cpu", help="build target when building the bundle (sm_90 on the H200)")
    p.add_argument("--build-args", default="", help="extra `laya-aot build` overrides")
    p.add_argument("--device", default=None, help="LAYA_DEVICE for both servers (cuda on the GPU host)")
    p.add_argument("--threads", type=int, default=None, help="LAYA_THREADS for both servers")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--requests", type=int, default=300, help="requests per concurrency level")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--state-words", type=int, default=0, help="0: the demo's three states; N: 16 states of N words")
    p.add_argument("--modes", default="eager,bundle")
    p.add_argument("--rounds", type=int, default=3, help="server runs per mode, in alternating order; medians")
    p.add_argument("--idle-unload", type=float, default=3.0,
                   help="LAYA_IDLE_UNLOAD_SECONDS for both servers: after the load levels the benchmark waits for "
                        "the unload and times the request that reloads the checkpoint")
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    a.clients = [int(c) for c in a.clients.split(",")]
    tag = a.tag or (a.device or "cpu").split(":")[0]
    if a.state_words:
        import numpy as np

        from laya_aot.demo import state_text

        rng = np.random.default_rng(0)
        states = [state_text(rng, a.state_words) for _ in range(16)]
    else:
        states = list(DEMO_STATES)
    bodies = _bodies(states)
    environment = harness.environment()
    with tempfile.TemporaryDirectory(prefix="http-bench-") as tmp:
        work = Path(tmp)
        ckpt, bundle, build_s = prepare(a, work)
        names = a.modes.split(",")
        runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in names}
        for r in range(a.rounds):  # alternate the order, so neither mode always runs on a quieter machine
            for m in (names if r % 2 == 0 else names[::-1]):
                runs[m].append(run_mode(m, a, ckpt, bundle, bodies, work, r))
        modes = {m: summarise(rs) for m, rs in runs.items()}
    result = {
        "environment": environment, "loadavg_at_end": os.getloadavg(),
        "checkpoint": a.checkpoint or "demo shape %s" % a.shape, "bundle": a.bundle or "built here", "build_s": build_s,
        "states": len(states), "questions": list(DEMO_QUESTIONS), "modes": modes,
    }
    if "eager" in modes and "bundle" in modes:
        result["bundle_vs_eager"] = compare(modes["bundle"]["answers"], modes["eager"]["answers"])
        result["answers"] = {m: modes[m]["answers"] for m in ("eager", "bundle")}
    for m in modes.values():
        m.pop("answers", None)
        for run in m["runs"]:
            run.pop("answers", None)
    harness.write(a.out, "http_%s" % tag, result, markdown(result),
                  title="HTTP serving: laya-aot serve (bundle) against laya serve (eager)")
    return 0


def markdown(r: Dict[str, Any]) -> str:
    lines = ["Load average (1, 5, 15 min) at the end: %s." % " ".join("%.2f" % x for x in r["loadavg_at_end"]),
             "Checkpoint: %s; bundle: %s%s. Each request: one state (of %d, in turn), %d typed questions, "
             "`model` explicit." % (r["checkpoint"], r["bundle"],
                                    " (build %.1f s)" % r["build_s"] if r["build_s"] else "", r["states"],
                                    len(r["questions"])), ""]
    if "bundle_vs_eager" in r:
        c = r["bundle_vs_eager"]
        lines += ["Answers, bundle against eager over HTTP: max |difference| %.6f, %d of %d decisions equal%s." % (
            c["max_abs_diff"], c["same_decisions"], c["decisions"],
            "; eager's margin where they differ: %s" % ", ".join("%.3g" % d["eager_margin"] for d in c["differing"])
            if c.get("differing") else ""), ""]
    for line in r["modes"].get("bundle", {}).get("load_lines") or []:
        lines += ["Bundle server's log (first round): `%s`" % line]
    rounds = len(next(iter(r["modes"].values()))["runs"])
    lines += ["", "Medians of %d rounds (one server process per mode and round, modes in alternating order); "
              "requests/s range in brackets. First start: the first process of the mode (for the bundle, the probe "
              "child runs: its verdict cache is empty); later starts: the median of the others (verdict cached). "
              "Reload: the first request after laya's idle unload (LAYA_IDLE_UNLOAD_SECONDS), in the same process."
              % rounds, "",
              "| mode | first start -> first answer (s) | later starts (s) | request after idle unload (s) | clients "
              "| requests/s | p50 ms | p99 ms | non-200 |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        for i, lv in enumerate(m["levels"]):
            bad = {k: v for k, v in lv["statuses"].items() if k != "200"}
            head = [name, m["first_answer_s"], m["later_first_answer_s"], m["reload_answer_s"]] if i == 0 else [""] * 4
            lines.append("| %s | %s | %s | %s | %d | %.1f [%.1f-%.1f] | %s | %s | %s |" % (
                tuple(head) + (lv["clients"], lv["rps"], lv["rps_range"][0], lv["rps_range"][1], lv["p50_ms"],
                               lv["p99_ms"], bad or 0)))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

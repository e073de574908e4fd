"""Load benchmark (issue 59): `laya-aot serve` (its dynamic batcher) against `laya serve` over HTTP, and the
Python batcher against laya-cuda's BatchEngine in one process, under 1 / 8 / 32 / 128 concurrent clients.

Two request streams: `short` (one short state, the demo's three questions) and `mixed` (states of 40-1,000
tokens, 1-5 questions: the first k of five). Per server, stream and client count: requests/s, p50 and p99
latency, non-200 answers, GPU utilisation (nvidia-smi, sampled every 0.2 s; CPU: none), and whether every
answer's decisions equal those of the same request sent alone to that server before the load. Each level runs
for a fixed time (--seconds), so the whole run is bounded. The client is the standard library (http.client,
keep-alive), spread over processes (--client-procs) so that its own cost stays below the server's: the run
starts by measuring the client against a stub server that answers at once (`client_ceiling`).

    # CPU (the acceptance figure: requests/s at 32 clients against 1, base-512, LAYA_MAX_CONCURRENT=64 or more)
    python benchmarks/http_load.py --checkpoint CKPT --bundle BUNDLE --threads 2 --streams short --clients 1,32
    # GPU (H100/H200, about 5-6 minutes): laya-aot serve with 1 and 4 worker processes and laya serve, short and
    # mixed streams, 1/8/32/128 clients, then the Python batcher against laya-cuda's; writes $OUT/http_load_gpu.*
    python benchmarks/http_load.py --checkpoint /tmp/w/ckpt-large --bundle /tmp/w/bundle-large --device cuda \
        --python --servers laya-aot,laya-aot:4,laya --seconds 2.5 --client-procs 8 --out $OUT --tag _gpu
    # the checkpoint and bundle it takes (about 6 minutes on an H100, once):
    laya-aot make-demo /tmp/w/ckpt-large --shape large-1024
    laya-aot build checkpoint.path=/tmp/w/ckpt-large output_dir=/tmp/w/bundle-large target=sm_90 \
        stages.tilelang=false stages.onnx=false stages.inductor_cache=false

Builds a demo checkpoint (--shape) and its bundle (--target) when --checkpoint/--bundle are not given (shared
with benchmarks/http_bench.py). Writes http_load<tag>.json and .md to --out. `--ray 1,2` also runs the Ray Serve
deployment (`python -m laya_aot.serve_ray`) with that many replicas (LAYA_THREADS each), the same streams and
clients: the figure for issue 59's Ray criterion (`--servers ""` leaves the two servers out). A server named
`laya-aot:N` is `laya-aot serve` with LAYA_AOT_WORKERS=N (N processes on one port), `laya-aot:Ne` the same over one
engine process (LAYA_AOT_ENGINE=1: the workers' artifact calls merged in one device process); each laya-aot server's own
ceiling over a Router that answers at once is measured with as many processes.
"""
from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import harness
import http_bench  # the server process and the bundle's preparation, shared

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT))

from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES  # noqa: E402

# the mixed stream's questions: a request asks the first k (1-5) of these
EXTRA_QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "channel": {"type": "choice", "instructions": "Where should the answer go?",
                "criteria": {"email": "reply by email", "phone": "call back", "chat": "answer in the chat"}},
}
MIXED_QUESTIONS = {**DEMO_QUESTIONS, **EXTRA_QUESTIONS}
SERVER_MODES = {"laya-aot": "bundle", "laya": "eager"}


def server_kind(name: str) -> Tuple[str, int]:
    """("laya-aot" or "laya", worker processes) of a server named "laya-aot", "laya-aot:N", "laya-aot:Ne" (N workers
    over one engine process, LAYA_AOT_ENGINE=1) or "laya"."""
    app, colon, n = name.partition(":")
    engine = n.endswith("e")
    n = n[:-1] if engine else n
    if app not in SERVER_MODES or (colon and (app != "laya-aot" or not n.isdigit() or int(n) < (2 if engine else 1))):
        raise SystemExit("unknown server %r: use laya-aot, laya-aot:N (N worker processes), laya-aot:Ne (N workers "
                         "over one engine, N >= 2) or laya" % name)
    return app, int(n or 1)


# ------------------------------------------------------------------------------------------------ requests
def short_requests() -> List[Dict[str, Any]]:
    return [{"model": "bench", "state": s, "questions": DEMO_QUESTIONS} for s in DEMO_STATES]


def mixed_requests(ckpt: str, n: int = 48, seed: int = 0) -> List[Dict[str, Any]]:
    """`n` requests: states of 40-1,000 tokens of the checkpoint's tokenizer (log-uniform), 1-5 questions."""
    import numpy as np
    from tokenizers import Tokenizer

    from laya_aot.demo import state_text

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer" / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    sample = state_text(rng, 400)
    per_word = len(tok.encode(sample, add_special_tokens=False).ids) / 400.0
    names = list(MIXED_QUESTIONS)
    out = []
    for i in range(n):
        tokens = int(round(float(np.exp(rng.uniform(np.log(40), np.log(1000))))))
        k = 1 + i % len(names)
        out.append({"model": "bench", "state": state_text(rng, max(1, int(tokens / per_word))),
                    "questions": {q: MIXED_QUESTIONS[q] for q in names[:k]}})
    return out


def decisions(answers: Dict[str, Any]) -> Dict[str, Any]:
    return {q: harness.decision(a) for q, a in answers.items()}


# -------------------------------------------------------------------------------------------------- client
def _client_proc(port: int, bodies: List[bytes], threads: int, offset: int, start_at: float, stop_at: float,
                 path: str, queue: Any) -> None:
    """One client process: `threads` keep-alive connections sending bodies in turn from `start_at` to `stop_at`;
    puts (latencies of 200s, {status: count}, [(body index, response bytes)] of a sample) on `queue`."""
    lat: List[float] = []
    statuses: Dict[int, int] = {}
    seen: List[Tuple[int, bytes]] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        i = offset + t * 7919
        mine, codes, kept = [], {}, []
        while time.time() < start_at:
            time.sleep(0.001)
        while True:
            now = time.time()
            if now >= stop_at:
                break
            b = i % len(bodies)
            t0 = time.perf_counter()
            try:
                conn.request("POST", path, body=bodies[b], headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                raw = r.read()
                status = r.status
            except (OSError, http.client.HTTPException):
                status, raw = -1, b""
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            dt = time.perf_counter() - t0
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                mine.append(dt)
                if len(kept) < 64:
                    kept.append((b, raw))
            i += 1
        conn.close()
        with lock:
            lat.extend(mine)
            seen.extend(kept)
            for k, v in codes.items():
                statuses[k] = statuses.get(k, 0) + v

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    queue.put((lat, statuses, seen))


def load(port: int, bodies: List[bytes], clients: int, seconds: float, procs: int,
         path: str = "/v1/systemone") -> Dict[str, Any]:
    """`clients` connections spread over up to `procs` processes, for `seconds`."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    nproc = max(1, min(procs, clients))
    per = [clients // nproc + (1 if p < clients % nproc else 0) for p in range(nproc)]
    start_at = time.time() + 0.5 + 0.05 * nproc
    stop_at = start_at + seconds
    ps = [ctx.Process(target=_client_proc, args=(port, bodies, n, p * 104729, start_at, stop_at, path, queue))
          for p, n in enumerate(per)]
    for p in ps:
        p.start()
    parts = [queue.get() for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for part in parts for x in part[0])
    statuses: Dict[str, int] = {}
    for part in parts:
        for k, v in part[1].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 2)) if lat else (lambda q: None)
    return {"clients": clients, "seconds": seconds, "ok": len(lat), "statuses": statuses,
            "rps": round(len(lat) / seconds, 1), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "sample": [s for part in parts for s in part[2]]}


STUB = r'''
import asyncio, sys
BODY = b'{"model":"laya-rl-agent","answers":{}}'
RESP = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            if n:
                await reader.readexactly(n)
            writer.write(RESP)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
'''


def _ceiling(proc: Any, port: int, ready: Any, bodies: List[bytes], clients: int, seconds: float,
             procs: int) -> Dict[str, Any]:
    """The load against the server `proc` (on `port`) once `ready()` returned; the server is stopped after."""
    try:
        ready()
        out = load(port, bodies, clients, seconds, procs)
    finally:
        proc.terminate()
        proc.wait()
    out.pop("sample")
    return out


def client_ceiling(bodies: List[bytes], clients: int, seconds: float, procs: int) -> Dict[str, Any]:
    """The client's own ceiling: the same load against a stub server answering at once."""
    port = http_bench._free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)], stdout=subprocess.PIPE)
    return _ceiling(stub, port, stub.stdout.readline, bodies, clients, seconds, procs)  # type: ignore[union-attr]


INSTANT = r'''
import json, os, sys
for name in ("LAYA_AOT_BUNDLES", "LAYA_API_KEY"):
    os.environ.pop(name, None)
ANSWER = {"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}
class Instant:
    """A Router that answers at once: what is left is the server's own cost per request."""
    loaded, _agents = [], {}
    def resolve(self, name):
        return name
    def predict(self, state, questions, model=None, **kw):
        return dict(ANSWER)
    def predict_batch(self, requests, **kw):
        return [dict(ANSWER) for _ in requests]
if sys.argv[1] == "laya":
    from laya.serve import create_app
else:
    from laya_aot.serve import create_app
import uvicorn
from laya_aot.serve_workers import listen
app = create_app(router=Instant())
sock = listen("127.0.0.1", int(sys.argv[2]))  # SO_REUSEPORT: as laya-aot serve's workers, one port for N processes
print("bound", flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
'''


def server_ceiling(app: str, bodies: List[bytes], clients: int, seconds: float, procs: int,
                   workers: int = 1) -> Dict[str, Any]:
    """`app`'s (laya or laya-aot) own ceiling: the same load against its HTTP app over a Router that answers at
    once (laya-aot's: its batcher merging the requests into calls that cost nothing), in `workers` processes on one
    port as `laya-aot serve`'s LAYA_AOT_WORKERS runs them."""
    port = http_bench._free_port()
    env = dict(os.environ, LAYA_MAX_CONCURRENT=str(max(64, 2 * clients)),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    group = [subprocess.Popen([sys.executable, "-c", INSTANT, app, str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE) for _ in range(workers)]

    def ready() -> None:
        for proc in group:  # every process bound before the load, so that each takes its share of the connections
            if proc.stdout.readline().strip() != b"bound":  # type: ignore[union-attr]
                raise RuntimeError("an instant %s server did not start (status %s)" % (app, proc.poll()))
        deadline = time.time() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("POST", "/v1/systemone", body=bodies[0], headers={"Content-Type": "application/json"})
                if conn.getresponse().status == 200:
                    return
            except OSError:
                if time.time() > deadline or any(p.poll() is not None for p in group):
                    raise RuntimeError("the instant %s server did not start" % app) from None
                time.sleep(0.2)

    return _ceiling(_Group(group), port, ready, bodies, clients, seconds, procs)


class _Group:
    """Processes stopped together, as `_ceiling` stops one."""

    def __init__(self, procs: List[subprocess.Popen]):
        self.procs = procs

    def terminate(self) -> None:
        for p in self.procs:
            p.terminate()

    def wait(self) -> None:
        for p in self.procs:
            p.wait()


class GpuSampler:
    """Mean GPU utilisation (%) over a level, from nvidia-smi every 0.2 s (None without a GPU)."""

    def __init__(self) -> None:
        self.values: List[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def available() -> bool:
        try:
            return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def __enter__(self) -> "GpuSampler":
        def run() -> None:
            while not self._stop.wait(0.2):
                r = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                    "-i", "0"], capture_output=True, text=True)
                try:
                    self.values.append(float(r.stdout.strip().splitlines()[0]))
                except (ValueError, IndexError):
                    pass

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> Optional[float]:
        return round(sum(self.values) / len(self.values), 1) if self.values else None


# ---------------------------------------------------------------------------------------------- HTTP modes
def _alone(port: int, bodies: List[bytes]) -> List[Dict[str, Any]]:
    """Each request's decisions, sent alone (one connection, one at a time)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    out = []
    for b in bodies:
        conn.request("POST", "/v1/systemone", body=b, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        assert r.status == 200, raw[:500]
        out.append(decisions(json.loads(raw)["answers"]))
    conn.close()
    return out


def _check(level: Dict[str, Any], ref: List[Dict[str, Any]]) -> None:
    """Decisions of the sampled answers under load against the same requests alone."""
    sample = level.pop("sample")
    differ = sum(1 for b, raw in sample if decisions(json.loads(raw)["answers"]) != ref[b])
    level["decisions_checked"] = len(sample)
    level["decisions_differ"] = differ


def start_ray(a, ckpt: str, bundle: str, replicas: int, work: Path, env: Dict[str, str]) -> Any:
    """The Ray Serve deployment (`python -m laya_aot.serve_ray`) with `replicas` replicas, as a server."""
    srv = http_bench.Server.__new__(http_bench.Server)
    srv.port = http_bench._free_port()
    srv.log_path = work / ("ray-%d.log" % replicas)
    srv._log = open(srv.log_path, "wb")
    srv.t0 = time.time()
    full = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(srv.port), LAYA_AOT_RAY_REPLICAS=str(replicas),
                **env)
    srv.proc = subprocess.Popen([sys.executable, "-m", "laya_aot.serve_ray"], cwd=ROOT, stdout=srv._log,
                                stderr=subprocess.STDOUT, env=full, start_new_session=True)
    return srv


def aot_counts(port: int) -> Dict[str, float]:
    """laya-aot serve's running totals from `GET /v1/aot`: the batchers' calls (every worker's), the requests, rows
    and queue wait in them, and the artifact calls (the engine's, or one worker's without one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/aot")
    aot = json.loads(conn.getresponse().read())
    conn.close()
    batching = (aot.get("workers") or {}).get("batching") or aot.get("batching") or {}
    out = {"batcher_calls": batching.get("batch_requests", {}).get("count", 0),
           "requests": batching.get("batch_requests", {}).get("sum", 0),
           "rows": batching.get("batch_rows", {}).get("sum", 0),
           "queue_wait_ms": batching.get("queue_wait_ms", {}).get("sum", 0.0)}
    for b in (aot.get("bundles") or {}).values():
        calls = b.get("calls") or {}
        out["artifact_calls"] = out.get("artifact_calls", 0) + calls.get("artifact_calls", 0)
        for k, v in (calls.get("engine") or {}).items():  # one engine's: where its device thread's time went
            if k.endswith("_s"):
                out["engine_" + k] = v
    return out


def level_calls(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Optional[float]]:
    """What one level's load did between two `aot_counts`: requests and rows per batcher call, batcher calls per
    artifact call (above 1: the engine merged the workers' calls), mean queue wait."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    calls, art = d.get("batcher_calls") or 0, d.get("artifact_calls") or 0
    return {"batcher_calls": calls, "artifact_calls": art,
            "requests_per_call": round(d["requests"] / calls, 2) if calls else None,
            "rows_per_call": round(d["rows"] / calls, 2) if calls else None,
            "batcher_calls_per_artifact_call": round(calls / art, 2) if art else None,
            "queue_wait_ms_mean": round(d["queue_wait_ms"] / d["requests"], 2) if d.get("requests") else None,
            **{k: round(v, 3) for k, v in d.items() if k.startswith("engine_")}}


def run_server(name: str, a, ckpt: str, bundle: str, streams: Dict[str, List[Dict[str, Any]]], work: Path,
               gpu: bool) -> Dict[str, Any]:
    app, workers = server_kind(name) if not name.startswith("ray:") else ("laya-aot", 1)
    env = {"LAYA_EXTRA_MODELS": json.dumps({"bench": ckpt}), "LAYA_MODELS": "bench",
           "LAYA_MAX_CONCURRENT": str(max(64, 2 * max(a.clients))), "LAYA_LOG_LEVEL": "warning",
           "LAYA_AOT_CACHE_DIR": str(work / "aot-cache")}
    if a.device:
        env["LAYA_DEVICE"] = a.device
    if a.threads:
        env["LAYA_THREADS"] = str(a.threads)
    if app != "laya":
        env["LAYA_AOT_BUNDLES"] = json.dumps({"bench": bundle})
    env.update(dict(kv.split("=", 1) for kv in a.env))
    if workers > 1:
        env["LAYA_AOT_WORKERS"] = str(workers)
    if name.startswith("laya-aot:") and name.endswith("e"):
        env["LAYA_AOT_ENGINE"] = "1"
    if name.startswith("ray:"):
        srv = start_ray(a, ckpt, bundle, int(name.split(":")[1]), work, env)
    else:
        srv = http_bench.Server(SERVER_MODES[app], env, work / ("%s.log" % name.replace(":", "-")))
    out: Dict[str, Any] = {"env": {k: v for k, v in env.items() if k not in ("LAYA_EXTRA_MODELS", "LAYA_AOT_BUNDLES")}}
    try:
        first_body = json.dumps(short_requests()[0]).encode()
        out["first_answer_s"] = round(srv.first_answer(first_body, a.timeout), 2)
        out["streams"] = {}
        for stream, reqs in streams.items():
            bodies = [json.dumps(r).encode() for r in reqs]
            ref = _alone(srv.port, bodies)
            for c in a.clients:  # warm-up: every level's call shapes seen (and captured as CUDA graphs) before
                load(srv.port, bodies, c, min(1.0, a.seconds), a.client_procs)
            levels = []
            for c in a.clients:
                before = aot_counts(srv.port) if app != "laya" else {}
                with GpuSampler() if gpu else _Null() as sampler:
                    lv = load(srv.port, bodies, c, a.seconds, a.client_procs)
                lv["gpu_util_pct"] = sampler.mean() if gpu else None
                if before:
                    lv["calls"] = level_calls(before, aot_counts(srv.port))
                _check(lv, ref)
                levels.append(lv)
                print("%-10s %-6s %4d clients: %7.1f req/s  p50 %7.1f ms  p99 %7.1f ms  %s  decisions differ %d/%d  %s"
                      % (name, stream, c, lv["rps"], lv["p50_ms"] or -1, lv["p99_ms"] or -1, lv["statuses"],
                         lv["decisions_differ"], lv["decisions_checked"], lv.get("calls", "")), flush=True)
            out["streams"][stream] = levels
        if app != "laya" and not name.startswith("ray:"):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("GET", "/v1/aot")
            out["aot"] = json.loads(conn.getresponse().read())
            conn.close()
    finally:
        if name.startswith("ray:"):
            import signal

            os.killpg(srv.proc.pid, signal.SIGTERM)
            try:
                srv.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(srv.proc.pid, signal.SIGKILL)
                srv.proc.wait()
            srv._log.close()
        else:
            srv.stop()
    return out


class _Null:
    def __enter__(self) -> "_Null":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


# --------------------------------------------------------------------------------------- in-process batchers
def _callers(submit, reqs: List[Dict[str, Any]], callers: int, seconds: float) -> Dict[str, Any]:
    """`callers` threads each submitting a request and waiting for its answer, for `seconds`."""
    lat: List[float] = []
    errors = [0]
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds
    answers: List[Tuple[int, Any]] = []

    def worker(t: int) -> None:
        i, mine, kept = t * 7919, [], []
        while time.perf_counter() < stop_at:
            r = reqs[i % len(reqs)]
            t0 = time.perf_counter()
            try:
                ans = submit(r)
            except Exception:  # noqa: BLE001 - counted: a refused or failed request
                with lock:
                    errors[0] += 1
                continue
            mine.append(time.perf_counter() - t0)
            if len(kept) < 32:
                kept.append((i % len(reqs), ans))
            i += 1
        with lock:
            lat.extend(mine)
            answers.extend(kept)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(callers)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 2)) if lat else (lambda q: None)
    return {"callers": callers, "ok": len(lat), "errors": errors[0], "rps": round(len(lat) / wall, 1),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99), "answers": answers}


def run_python(a, ckpt: str, bundle: str, streams: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """laya-aot's Python batcher on laya_aot.load's agent, and laya-cuda's BatchEngine on the same checkpoint."""
    import laya_aot
    from laya_aot.runtime.batcher import Batcher

    out: Dict[str, Any] = {}
    agent = laya_aot.load(ckpt, bundle=bundle, **({"device": a.device} if a.device else {}))
    out["laya_aot_backend"] = agent.backend
    engines: Dict[str, Any] = {}
    with Batcher(agent) as batcher:
        engines["laya-aot Batcher"] = lambda r: batcher.submit(r["state"], r["questions"]).result()
        cuda = None
        try:
            from laya_cuda import BatchEngine

            cuda = BatchEngine(ckpt, **json.loads(a.cuda_engine_args))
            engines["laya-cuda BatchEngine"] = lambda r: cuda.submit(r["state"], r["questions"]).result()
        except ImportError as e:
            out["laya_cuda"] = "not installed here (%s): its column is left out" % e
        try:
            for stream, reqs in streams.items():
                for name, submit in engines.items():
                    # each engine's own answer to the request alone: what its batching may not change
                    ref = [decisions(submit(r)["answers"]) for r in reqs]
                    levels = []
                    for c in a.clients:  # warm-up: every level's call shapes seen (and captured) before
                        _callers(submit, reqs, c, min(1.0, a.seconds))
                    for c in a.clients:
                        before = _graph_counts(agent) if name == "laya-aot Batcher" else None
                        lv = _callers(submit, reqs, c, a.seconds)
                        kept = lv.pop("answers")
                        lv["decisions_differ"] = sum(1 for i, ans in kept if decisions(ans["answers"]) != ref[i])
                        lv["decisions_checked"] = len(kept)
                        if before is not None:  # what the level's calls did with CUDA graphs (captures' seconds)
                            lv["cuda_graphs"] = {k: round(v - before.get(k, 0), 3)
                                                 for k, v in _graph_counts(agent).items() if v != before.get(k, 0)}
                        levels.append(lv)
                        print("%-22s %-6s %4d callers: %7.1f req/s  p50 %7.1f ms  p99 %7.1f ms  errors %d  "
                              "decisions differ %d/%d%s" % (name, stream, c, lv["rps"], lv["p50_ms"] or -1,
                                                             lv["p99_ms"] or -1, lv["errors"], lv["decisions_differ"],
                                                             lv["decisions_checked"],
                                                             "  graphs %s" % lv["cuda_graphs"] if before else ""),
                              flush=True)
                    out.setdefault(stream, {})[name] = levels
        finally:
            if cuda is not None:
                cuda.close()
    out["batcher_stats"] = {k: v for k, v in batcher.stats.snapshot().items() if k in ("calls", "batch_requests")}
    out["backend_stats"] = {k: v for k, v in agent.backend_object.stats.items() if k != "host_path"}
    out["shape_bits"] = shape_bits(agent, short_requests()[0])
    return out


def _graph_counts(agent: Any) -> Dict[str, float]:
    """The agent's CUDA graph counters now (numbers only; none without graphs)."""
    graphs = agent.backend_object.stats.get("cuda_graphs") or {}
    return {k: v for k, v in graphs.items() if isinstance(v, (int, float))}


def shape_bits(agent: Any, req: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One request's rows alone and as the first rows of calls of more rows (copies of its own), at every stepped
    row count up to the export's: whether its outputs keep their bits as the call grows (the GEMMs' algorithm
    chosen by row count), and whether a CUDA graph's replay gives the plain call's bits at the same shape (a
    stepped row count of these rows is their call's shape: nothing is padded). Plain: the runner's graphs set
    aside for the call; graphed: the call made three times, the third replayed where a graph was captured."""
    import torch

    from laya_aot.padding import option_probs, step_up

    backend = agent.backend_object
    runner = backend.runner
    seen: List[Tuple[Any, ...]] = []
    forward = backend.model.forward

    def record(*args: Any, **kw: Any) -> Any:
        seen.append(args[:5])
        return forward(*args, **kw)

    backend.model.forward = record
    try:
        agent.system_one(req["state"], req["questions"])
    finally:
        backend.model.forward = forward
    own = tuple(x.detach() for x in seen[0])
    n, k = own[0].shape[0], own[3].shape[1]
    graphs = getattr(runner, "graphs", None)

    def call(rows: int, graphed: bool) -> Tuple[Any, Any]:
        batch = tuple(torch.cat([x] * -(-rows // n))[:rows] for x in own)
        runner.graphs = graphs if graphed else None
        try:
            with torch.no_grad():
                return tuple(o[:n].float().cpu() for o in backend.forward(*batch))
        finally:
            runner.graphs = graphs

    def same(x: Tuple[Any, Any], y: Tuple[Any, Any]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(x, y))

    alone = call(n, graphed=False)
    out = []
    for rows in sorted({step_up(r) for r in range(n, backend.ranges.max_rows + 1)} | {n}):
        plain = call(rows, graphed=False)
        replays = (graphs.stats.get("replays", 0) if graphs is not None else 0)
        graphed = [call(rows, graphed=True) for _ in range(3)][-1]
        p_alone, p_got = option_probs(alone[0], k), option_probs(plain[0], k)
        out.append({"rows": rows, "plain_bits_equal_alone": same(plain, alone),
                    "replayed": graphs is not None and graphs.stats.get("replays", 0) > replays,
                    "graphed_bits_equal_plain": same(graphed, plain),
                    "max_option_prob_diff": float((p_got - p_alone).abs().max()),
                    "decisions_equal": bool(torch.equal(p_got.argmax(-1), p_alone.argmax(-1)))})
    print("shape bits (one short request's rows in calls of more rows):", json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------------------------------------------- main
def markdown(r: Dict[str, Any]) -> str:
    lines = ["Checkpoint: %s; bundle: %s. A shared machine's figures are noisy. Each level runs %g s; the client "
             "spreads its connections over up to %d processes; its own ceiling against a stub server answering at "
             "once, at %d clients: %.0f requests/s." % (r["checkpoint"], r["bundle"], r["seconds"], r["client_procs"],
                                                       r["client_ceiling"]["clients"], r["client_ceiling"]["rps"]),
             "The servers' own ceilings, each over a Router that answers at once (HTTP, laya's request handling "
             "and, for laya-aot, the batcher), at 32 clients: %s." % ", ".join(
                 "%s %.0f requests/s" % (k, v["rps"]) for k, v in r.get("server_ceiling", {}).items()), ""]
    lines += ["Decisions: each answer sampled under load against the same request sent alone to the same server "
              "first (`differ` of `checked`).", "",
              "`requests / call`: requests per batcher call (every worker's); `calls / artifact call`: batcher calls "
              "per artifact call (over one engine: above 1 where it merged the workers' calls); `wait`: mean "
              "milliseconds a request waited in a batcher's queue.", "",
              "| server | stream | clients | requests/s | p50 ms | p99 ms | GPU % | non-200 | decisions differ "
              "| requests / call | calls / artifact call | wait ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, srv in r["servers"].items():
        for stream, levels in srv.get("streams", {}).items():
            for lv in levels:
                bad = {k: v for k, v in lv["statuses"].items() if k != "200"}
                calls = lv.get("calls") or {}
                lines.append("| %s | %s | %d | %.1f | %s | %s | %s | %s | %d / %d | %s | %s | %s |" % (
                    name, stream, lv["clients"], lv["rps"], lv["p50_ms"], lv["p99_ms"],
                    lv.get("gpu_util_pct") if lv.get("gpu_util_pct") is not None else "-", bad or 0,
                    lv["decisions_differ"], lv["decisions_checked"], calls.get("requests_per_call", "-"),
                    calls.get("batcher_calls_per_artifact_call", "-"), calls.get("queue_wait_ms_mean", "-")))
    for name, srv in r["servers"].items():
        levels = srv.get("streams", {}).get("short") or []
        by = {lv["clients"]: lv["rps"] for lv in levels}
        if 1 in by and 32 in by and by[1]:
            lines += ["", "%s, short stream: %.2fx the requests/s at 32 clients of those at 1."
                      % (name, by[32] / by[1])]
    for name, srv in r["servers"].items():
        calls = ((srv.get("aot") or {}).get("bundles", {}).get("bench") or {}).get("calls")
        if calls:
            lines += ["", "%s's artifact calls (one worker's, over the whole run): %s" % (name, _calls(calls))]
    if "python" in r:
        p = r["python"]
        lines += ["", "## In process: laya-aot's Batcher against laya-cuda's BatchEngine", "",
                  "laya-aot backend: %s.%s" % (p.get("laya_aot_backend"),
                                              " laya-cuda: %s." % p["laya_cuda"] if "laya_cuda" in p else ""),
                  "`decisions differ`: against the same engine's answer to the request sent alone first.", "",
                  "| engine | stream | callers | requests/s | p50 ms | p99 ms | errors | decisions differ | "
                  "CUDA graphs in the level |", "|---|---|---|---|---|---|---|---|---|"]
        for stream in r["streams"]:
            for name, levels in (p.get(stream) or {}).items():
                for lv in levels:
                    lines.append("| %s | %s | %d | %.1f | %s | %s | %d | %d / %d | %s |" % (
                        name, stream, lv["callers"], lv["rps"], lv["p50_ms"], lv["p99_ms"], lv["errors"],
                        lv["decisions_differ"], lv["decisions_checked"],
                        ", ".join("%s %s" % kv for kv in lv.get("cuda_graphs", {}).items()) or "-"))
        if p.get("backend_stats"):
            lines += ["", "laya-aot Batcher's artifact calls: %s" % _calls(p["backend_stats"])]
        if p.get("shape_bits"):
            lines += ["", "One short request's rows alone and as the first rows of calls of more rows (copies of its "
                      "own): a plain call's bits against the request alone, a CUDA graph's replay against the plain "
                      "call at the same shape.", "",
                      "| rows | plain: bits equal alone | replayed | replay: bits equal plain | max option prob "
                      "diff | decisions equal |", "|---|---|---|---|---|---|"]
            for b in p["shape_bits"]:
                lines.append("| %d | %s | %s | %s | %.3g | %s |" % (
                    b["rows"], b["plain_bits_equal_alone"], b["replayed"], b["graphed_bits_equal_plain"],
                    b["max_option_prob_diff"], b["decisions_equal"]))
    return "\n".join(lines) + "\n"


def _calls(stats: Dict[str, Any]) -> str:
    """The backend's counts in one line: calls, pieces, calls padded to a graph's shape, and the graphs."""
    graphs = stats.get("cuda_graphs") or {}
    words = ["%s %s" % (k.replace("_", " "), stats[k]) for k in ("artifact_calls", "chunks", "stepped_calls",
                                                                 "stepped_cells", "eager_calls") if k in stats]
    words += ["CUDA graphs %s" % ", ".join("%s %s" % (k, v) for k, v in graphs.items() if k != "refused")] \
        if graphs else []
    return "; ".join(words) or "none"


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--checkpoint", default=None, help="a Laya checkpoint dir (default: a demo checkpoint --shape)")
    p.add_argument("--shape", default="base-512", help="demo checkpoint shape when --checkpoint is not given")
    p.add_argument("--bundle", default=None, help="a bundle built from --checkpoint (default: build one)")
    p.add_argument("--target", default="cpu", help="build target when building the bundle (sm_90 on an H100)")
    p.add_argument("--build-args", default="", help="extra `laya-aot build` overrides")
    p.add_argument("--device", default=None, help="LAYA_DEVICE for the servers and the in-process batchers")
    p.add_argument("--threads", type=int, default=None, help="LAYA_THREADS for the servers")
    p.add_argument("--servers", default="laya-aot,laya", help="laya-aot, laya (comma-separated; may be empty)")
    p.add_argument("--ray", default="", help="also the Ray Serve deployment with these replica counts, e.g. 1,2")
    p.add_argument("--streams", default="short,mixed")
    p.add_argument("--clients", default="1,8,32,128")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per level")
    p.add_argument("--client-procs", type=int, default=4, help="client processes at most")
    p.add_argument("--python", action="store_true", help="also the in-process batchers (laya-cuda where installed)")
    p.add_argument("--cuda-engine-args", default="{}", help="JSON keyword arguments of laya_cuda.BatchEngine")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the servers (repeatable)")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    a.clients = [int(c) for c in a.clients.split(",")]
    servers = [s for s in a.servers.split(",") if s] + ["ray:%s" % n for n in a.ray.split(",") if n]
    ceilings = ["laya", "laya-aot"] + [s for s in servers if not s.startswith("ray:") and server_kind(s)[1] > 1]
    with tempfile.TemporaryDirectory(prefix="http-load-") as tmp:
        work = Path(tmp)
        ckpt, bundle, build_s = http_bench.prepare(a, work)
        streams = {}
        for s in a.streams.split(","):
            streams[s] = short_requests() if s == "short" else mixed_requests(ckpt)
        ceiling = client_ceiling([json.dumps(r).encode() for r in streams[next(iter(streams))]], 32,
                                 min(3.0, a.seconds), a.client_procs)
        print("client ceiling (stub server, 32 clients): %.0f req/s" % ceiling["rps"], flush=True)
        bodies0 = [json.dumps(r).encode() for r in short_requests()]
        servers_ceiling = {name: server_ceiling(server_kind(name)[0], bodies0, 32, min(5.0, a.seconds),
                                                a.client_procs, workers=server_kind(name)[1])
                           for name in dict.fromkeys(ceilings)}
        for app, c in servers_ceiling.items():
            print("%s's own ceiling (a Router answering at once, 32 clients): %.0f req/s" % (app, c["rps"]),
                  flush=True)
        result: Dict[str, Any] = {
            "checkpoint": a.checkpoint or "demo shape %s" % a.shape, "bundle": a.bundle or "built here",
            "build_s": build_s, "seconds": a.seconds, "client_procs": a.client_procs, "client_ceiling": ceiling,
            "server_ceiling": servers_ceiling, "streams": {k: len(v) for k, v in streams.items()}, "servers": {}}
        gpu = GpuSampler.available()
        for name in servers:
            result["servers"][name] = run_server(name, a, ckpt, bundle, streams, work, gpu)
            harness.write(a.out, "http_load" + a.tag, result, partial=True)  # a run cut short keeps what it measured
        if a.python:
            result["python"] = run_python(a, ckpt, bundle, streams)
    harness.write(a.out, "http_load" + a.tag, result, markdown(result),
                  title="HTTP load: laya-aot serve's dynamic batcher against laya serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())

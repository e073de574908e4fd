"""`laya-aot serve` with LAYA_AOT_WORKERS=N: N worker processes answering on one port.

One process answers at most what its host work allows (HTTP, laya's request handling, tokenising, decoding,
the batcher: one interpreter), whatever the GPU does: about 1,600 requests/s on an H200 host over a Router that
answers at once. With N > 1 the command is a supervisor: it checks the settings once, then starts N copies of
itself, each a whole laya app (its own Router, agents, batcher, weights and CUDA context) on the same device.
Each worker binds its own listening socket to LAYA_HOST:LAYA_PORT with SO_REUSEPORT, so the kernel spreads new
connections over them; none binds before every worker has loaded (an early one would take every keep-alive
connection made meanwhile). SIGTERM or SIGINT to the supervisor stops the workers; a worker that exits stops the
others and the supervisor, with its status (a supervisor such as systemd restarts the whole). A worker whose
supervisor dies is sent SIGTERM (Linux: PR_SET_PDEATHSIG).

`GET /v1/aot` answers from the worker the connection reached, and says which (`worker`), with every worker's
figures (`workers`); `GET /metrics` sums every worker's: each worker writes its own to a shared directory every
PUBLISH_S seconds (`Board`), and the age of each is exported beside them.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

log = logging.getLogger("laya_aot.serve")

ENV_WORKERS = "LAYA_AOT_WORKERS"
ENV_WORKER = "LAYA_AOT_WORKER"            # set by the supervisor for each worker: "INDEX/COUNT"
ENV_WORKER_DIR = "LAYA_AOT_WORKER_DIR"    # the shared directory of the workers' figures
ENV_WORKER_FDS = "LAYA_AOT_WORKER_FDS"    # "READY_W,GO_R": the pipes of the start handshake
PUBLISH_S = 1.0                           # how often a worker writes its figures for the others
MAX_WORKERS = 64
ENV_SWITCH = "LAYA_AOT_GIL_SWITCH_MS"     # Python's thread switch interval in every process of the server
STOP_S = 30.0                             # how long stopping workers may take before they are killed


Number = Any  # int or float, as `cast` makes it


def number_from_env(env: Mapping[str, str], name: str, cast: Callable[[str], Number], low: Number,
                    high: Optional[Number], use: str, error: Callable[[str], Exception]) -> Optional[Number]:
    """The number a `laya-aot serve` setting holds (None when unset); outside [low, high] or not a number raises
    `error("invalid NAME 'value': use " + use)`, one line naming the setting and the fix."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or not (low <= value and (high is None or value <= high)):  # NaN fails both
        raise error("invalid %s %r: use %s" % (name, env.get(name), use))
    return value


def count_from_env(env: Mapping[str, str], error: Callable[[str], Exception]) -> int:
    """LAYA_AOT_WORKERS (1 when unset: one process, as `laya serve`); a bad value raises `error(message)`."""
    n = number_from_env(env, ENV_WORKERS, int, 1, MAX_WORKERS, "a number of worker processes from 1 (the default: "
                        "one process) to %d" % MAX_WORKERS, error) or 1
    if n > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise error("%s=%d needs SO_REUSEPORT sockets, which this system lacks: use %s=1"
                    % (ENV_WORKERS, n, ENV_WORKERS))
    return n


def switch_interval_from_env(env: Mapping[str, str], error: Callable[[str], Exception]) -> Optional[float]:
    """LAYA_AOT_GIL_SWITCH_MS in seconds (None when unset: Python's own, 5 ms). A server process runs its event loop,
    its batcher's thread and, over an engine, the threads that carry calls to it: a thread woken by an answer waits
    for the interpreter lock until the running thread gives it up, at most this long. `sys.setswitchinterval`."""
    ms = number_from_env(env, ENV_SWITCH, float, 0.01, 100, "milliseconds from 0.01 to 100 (unset: Python's own 5)",
                         error)
    return None if ms is None else ms / 1000.0


def this_worker(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """(index, count) in a worker the supervisor started, else None."""
    raw = (os.environ if env is None else env).get(ENV_WORKER, "")
    try:
        index, count = (int(x) for x in raw.split("/"))
    except ValueError:
        return None
    return index, count


# ------------------------------------------------------------------------------------------------ the workers
def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def _die_with_parent() -> None:
    """In a worker before it runs (`preexec_fn`): SIGTERM to it when the supervisor dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_worker(app: Any, host: str, port: int, level: str) -> int:
    """A worker, its app built (its models loaded): tells the supervisor, waits until every worker is, then serves
    `app` on its own SO_REUSEPORT socket until stopped."""
    import uvicorn

    fds = os.environ.get(ENV_WORKER_FDS, "")
    if fds:
        ready, go = (int(x) for x in fds.split(","))
        os.write(ready, b"r")
        os.close(ready)
        answer = os.read(go, 1)  # the supervisor's go, or end of file if it died meanwhile
        os.close(go)
        if answer != b"g":
            log.error("laya-aot serve worker %s: the supervisor is gone; exiting", os.environ.get(ENV_WORKER))
            return 1
    sock = listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=level))
    server.run(sockets=[sock])
    return 0


# --------------------------------------------------------------------------------------------- the supervisor
class _Worker:
    def __init__(self, index: int, count: int, directory: str):
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        env = dict(os.environ, **{ENV_WORKER: "%d/%d" % (index, count), ENV_WORKER_DIR: directory,
                                  ENV_WORKER_FDS: "%d,%d" % (ready_w, go_r)})
        env.pop(ENV_WORKERS, None)
        self.index = index
        self.proc = subprocess.Popen([sys.executable, "-m", "laya_aot.cli", "serve"], env=env,
                                     pass_fds=(ready_w, go_r), preexec_fn=_die_with_parent)
        os.close(ready_w)
        os.close(go_r)
        self.ready_fd, self.go_fd = ready_r, go_w
        self.ready = False

    def go(self) -> None:
        try:
            os.write(self.go_fd, b"g")
        except OSError:
            pass  # it exited meanwhile: its status is seen below
        os.close(self.go_fd)
        self.go_fd = -1


class _EngineProcess:
    """The engine (laya_aot/runtime/engine.py): `laya-aot serve` run with the engine's settings, which make it the
    one process that loads the bundled checkpoints and runs every worker's artifact calls."""

    def __init__(self, directory: str):
        from .runtime import engine

        ready_r, ready_w = os.pipe()
        self.env = {engine.ENV_ENGINE_ADDRESS: os.path.join(directory, "engine.sock"),
                    engine.ENV_ENGINE_KEY: os.urandom(16).hex()}
        env = dict(os.environ, **self.env, **{engine.ENV_ENGINE_READY_FD: str(ready_w)})
        env.pop(ENV_WORKERS, None)
        self.index = "engine"
        self.proc = subprocess.Popen([sys.executable, "-m", "laya_aot.cli", "serve"], env=env, pass_fds=(ready_w,),
                                     preexec_fn=_die_with_parent)
        os.close(ready_w)
        self.ready_fd = ready_r

    def wait_ready(self, stop: threading.Event) -> int:
        """0 once the engine listens, its status if it exited first, 0 on a signal."""
        try:
            while not stop.is_set():
                readable, _, _ = select.select([self.ready_fd], [], [], 0.2)
                if readable:
                    if os.read(self.ready_fd, 16):
                        return 0
                    self.proc.wait()
                    log.error("laya-aot serve engine exited before it was ready (status %s)", self.proc.returncode)
                    return max(1, self.proc.returncode)
            return 0
        finally:
            os.close(self.ready_fd)


PORT_IN_USE = 3  # the status of one process (uvicorn's) whose port is taken


def port_taken(host: str, port: int) -> Optional[str]:
    """Why host:port cannot be this server's (None: it is free): bound without SO_REUSEPORT, a test bind fails where
    any server listens, another laya-aot's workers included, whose SO_REUSEPORT group this server's workers would
    otherwise join, each server answering part of the other's connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return "%s:%d is in use (%s): another server listens there; stop it or set LAYA_PORT" % (host, port,
                                                                                                   e.strerror or e)
    return None


def refuse_taken_port(host: str, port: int) -> Optional[int]:
    """PORT_IN_USE, said in one line, where another server has host:port (None: free): checked before anything loads,
    by one process as by the supervisor, where uvicorn's own bind would fail only after every model had loaded."""
    taken = port_taken(host, port)
    if taken is None:
        return None
    log.error(taken)
    return PORT_IN_USE


def supervise(count: int, host: str, port: int, engine: bool = False) -> int:
    """Start `count` workers (after the engine, with `engine`), let them serve once all have loaded, and stop them
    all when told to or when one exits. Returns the exit status: 0 when stopped by a signal, else the first
    worker's (or the engine's) to exit; PORT_IN_USE, before anything starts, where another server has the port."""
    refused = refuse_taken_port(host, port)
    if refused is not None:
        return refused
    with tempfile.TemporaryDirectory(prefix="laya-aot-workers-") as directory:  # figures (`Board`), the engine's socket
        return _supervise(count, host, port, directory, engine)


def _supervise(count: int, host: str, port: int, directory: str, engine: bool = False) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    helpers: List[Any] = []
    status = 0
    if engine:
        helpers.append(_EngineProcess(directory))
        status = helpers[0].wait_ready(stop)
        os.environ.update(helpers[0].env)  # the workers' way to it
    workers = [_Worker(i, count, directory) for i in range(count)] if status == 0 and not stop.is_set() else []
    try:
        if not workers:
            return status
        status = _start(workers, stop)
        if status == 0 and not stop.is_set():
            log.info("%d workers serving on %s:%d (%s=%d)", count, host, port, ENV_WORKERS, count)
            while not stop.is_set():
                gone = [w for w in helpers + workers if w.proc.poll() is not None]
                if gone:
                    status = max(1, gone[0].proc.returncode)  # killed by a signal (negative): 1
                    log.error("laya-aot serve %s exited with status %s; stopping the others", _name(gone[0]),
                              gone[0].proc.returncode)
                    break
                stop.wait(0.2)
    finally:
        _stop(workers)
        _stop(helpers)
        for s, handler in old.items():
            signal.signal(s, handler)
    return status


def _name(process: Any) -> str:
    """'engine', or 'worker N': a supervised process as the log names it."""
    return "engine" if isinstance(process, _EngineProcess) else "worker %s" % process.index


def _start(workers: List[_Worker], stop: threading.Event) -> int:
    """Wait until every worker has loaded (0), a worker exited first (its status), or a signal came (0)."""
    waiting = {w.ready_fd: w for w in workers}
    while waiting and not stop.is_set():
        readable, _, _ = select.select(list(waiting), [], [], 0.2)
        for fd in readable:
            w = waiting.pop(fd)
            w.ready = os.read(fd, 1) == b"r"
            os.close(fd)
            if not w.ready:
                w.proc.wait()
                log.error("laya-aot serve worker %d exited before it was ready (status %s)", w.index,
                          w.proc.returncode)
                return max(1, w.proc.returncode)
        for w in [w for w in waiting.values() if w.proc.poll() is not None]:
            return max(1, w.proc.returncode)
    for fd in waiting:
        os.close(fd)
    if stop.is_set():
        return 0
    for w in workers:
        w.go()
    return 0


def _stop(workers: List[_Worker]) -> None:
    """SIGTERM to each live worker (uvicorn's graceful stop), SIGKILL to any still running after STOP_S."""
    for w in workers:
        if getattr(w, "go_fd", -1) >= 0:
            os.close(w.go_fd)  # a worker still loading reads end of file and exits
            w.go_fd = -1
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("laya-aot serve %s did not stop within %.0f s: killed", _name(w), STOP_S)
            w.proc.kill()
            w.proc.wait()


# ------------------------------------------------------------------------------------------ figures, shared
class Board:
    """This worker's figures for the others, and theirs: each worker writes its own (`figures()`, a JSON object)
    to the shared directory every PUBLISH_S seconds; `gather` reads the others' latest beside this one's own."""

    def __init__(self, index: int, count: int, directory: Path):
        self.index, self.count, self.directory = index, count, Path(directory)
        self._thread: Optional[threading.Thread] = None

    def _path(self, index: int) -> Path:
        return self.directory / ("worker-%d.json" % index)

    def start(self, figures: Callable[[], Dict[str, Any]]) -> None:
        """Write `figures()` now and every PUBLISH_S seconds, in a daemon thread (once)."""
        if self._thread is not None:
            return

        def run() -> None:
            while True:
                try:
                    self.write(figures())
                except Exception:  # noqa: BLE001 - the others see this worker's figures age, never a crash here
                    log.debug("laya-aot serve worker %d: figures not written", self.index, exc_info=True)
                time.sleep(PUBLISH_S)

        self._thread = threading.Thread(target=run, name="laya-aot-worker-figures", daemon=True)
        self._thread.start()

    def write(self, figures: Dict[str, Any]) -> None:
        """This worker's figures, replaced whole (a reader never sees half a file)."""
        part = self._path(self.index).with_suffix(".part")
        part.write_text(json.dumps(dict(figures, index=self.index, pid=os.getpid(), time=time.time())),
                        encoding="utf-8")
        part.replace(self._path(self.index))

    def gather(self, own: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every worker's figures, this one's (`own`, now) first; each with `index`, `pid` and `age_s` (seconds
        since written). A worker that has written none yet is absent."""
        now = time.time()
        out = [dict(own, index=self.index, pid=os.getpid(), age_s=0.0)]
        for i in range(self.count):
            if i == self.index:
                continue
            try:
                theirs = json.loads(self._path(i).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            out.append(dict(theirs, age_s=round(max(0.0, now - float(theirs.get("time", now))), 3)))
        return out


def report(board: Board, figures: List[Dict[str, Any]]) -> Dict[str, Any]:
    """`GET /v1/aot`'s entries in a worker: `worker` (the one that answered) and `workers` (every worker's pid,
    figures' age, resident backends and queue, and the batcher's statistics summed over them)."""
    from .runtime.batcher import merge_snapshots

    return {"worker": {"index": board.index, "count": board.count, "pid": os.getpid()},
            "workers": {"seen": [{k: f.get(k) for k in ("index", "pid", "age_s", "queued", "backends")}
                                 for f in sorted(figures, key=lambda f: f["index"])],
                        "batching": merge_snapshots([f["batching"] for f in figures])}}


def board() -> Optional[Board]:
    """This worker's Board (None outside a worker the supervisor started)."""
    me = this_worker()
    directory = os.environ.get(ENV_WORKER_DIR)
    if me is None or not directory:
        return None
    return Board(me[0], me[1], Path(directory))


__all__ = ["Board", "ENV_WORKERS", "board", "count_from_env", "listen", "refuse_taken_port", "report", "run_worker",
           "supervise", "this_worker"]

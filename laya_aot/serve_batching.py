"""`laya-aot serve`'s dynamic batcher: laya's HTTP app with its inferences merged (laya_aot/runtime/batcher.py).

laya's app runs each inference alone: under one asyncio.Lock, on a one-thread pool. Here that lock becomes a
shared one (requests reach the pool together; `locked()` still says whether one is in flight, which is all laya's
idle reaper asks) and that pool hands each inference to one `Batcher` over the app's Router: a single request
(`router.predict`) goes straight into its queue; a batch request or a tournament runs its own laya code on a
thread of its own, with the router it calls replaced by one whose `predict`/`predict_batch` enter the same queue;
anything else submitted to the pool (the idle unload) runs on the batcher's worker between calls, never beside
one, as it ran on laya's one thread. A full queue answers laya's own 503, as does an engine process gone (a worker
of LAYA_AOT_ENGINE=1 whose server is stopping). Nothing else of the request changes.

Settings (environment, read once at start): LAYA_AOT_BATCH (1, the default: on; 0: laya's one-at-a-time),
LAYA_AOT_BATCH_MAX_ROWS, LAYA_AOT_BATCH_MAX_TOKENS, LAYA_AOT_BATCH_MAX_WAIT_MS, LAYA_AOT_BATCH_QUEUE,
LAYA_AOT_BATCH_BUCKETS (1, the default: a merged call holds requests of one length group; 0: of any length),
LAYA_AOT_ENGINE_LANES (in a worker over an engine: the calls its batcher sends at once, which the engine merges
with the other workers'; elsewhere one call runs at a time, as a device's artifact must) and LAYA_AOT_METRICS (0,
the default; 1: `GET /metrics` in Prometheus's text format).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional

from . import laya_internals as laya_api
from .runtime import batcher as engine
from .runtime.batcher import Batcher, BatcherClosed, Limits, Overloaded, RouterTarget, Stats, Work
from .runtime.engine import ENV_ENGINE_ADDRESS, EngineGone
from .serve_workers import number_from_env

log = logging.getLogger("laya_aot.serve")

ENV_BATCH = "LAYA_AOT_BATCH"
ENV_METRICS = "LAYA_AOT_METRICS"
LIMIT_SETTINGS = {"max_rows": ("LAYA_AOT_BATCH_MAX_ROWS", engine.DEFAULT_MAX_ROWS),
                  "max_tokens": ("LAYA_AOT_BATCH_MAX_TOKENS", engine.DEFAULT_MAX_TOKENS),
                  "max_wait_ms": ("LAYA_AOT_BATCH_MAX_WAIT_MS", engine.DEFAULT_MAX_WAIT_MS),
                  "max_queue": ("LAYA_AOT_BATCH_QUEUE", engine.DEFAULT_MAX_QUEUE)}
ENV_BUCKETS = "LAYA_AOT_BATCH_BUCKETS"
ENV_LANES = "LAYA_AOT_ENGINE_LANES"
DEFAULT_ENGINE_LANES = 1  # a worker's calls in flight to the engine: more buy little on a GPU (docs/batching.md)
MAX_LANES = 64
SIDE_THREADS = 64  # batch requests and tournaments waiting on the queue at once (more wait for a thread)
METRICS_ROUTE = "/metrics"


def limits_from_env(env: Mapping[str, str], error: Callable[[str], Exception]) -> Limits:
    """The batcher's limits from LAYA_AOT_BATCH_*; a bad value raises `error(message)` naming the setting."""
    values: Dict[str, Any] = {}
    for field_name, (setting, default) in LIMIT_SETTINGS.items():
        raw = env.get(setting, "").strip()
        if not raw:
            values[field_name] = default
            continue
        try:
            values[field_name] = float(raw) if field_name == "max_wait_ms" else int(raw)
            Limits(**{field_name: values[field_name]})
        except ValueError:
            kind = ("a number of milliseconds from 0 to %g" % engine.MAX_WAIT_LIMIT_MS if field_name == "max_wait_ms"
                    else "a positive integer")
            raise error("invalid %s %r: use %s (default %s)" % (setting, env.get(setting), kind, default)) from None
    raw = env.get(ENV_BUCKETS, "").strip().lower()
    if raw in ("0", "false", "no", "off"):
        values["length_buckets"] = False
    elif raw not in ("", "1", "true", "yes", "on"):
        raise error("invalid %s %r: use 1 (on, the default) or 0 (off)" % (ENV_BUCKETS, env.get(ENV_BUCKETS)))
    return Limits(**values)


def lanes_from_env(env: Mapping[str, str], error: Callable[[str], Exception]) -> int:
    """The calls this process's batcher runs at once: LAYA_AOT_ENGINE_LANES in a worker over an engine (its forward
    is the engine's, which takes calls from any thread and merges them), else 1: an artifact on this process's
    device runs one call at a time. A bad value raises `error(message)` wherever it is read."""
    lanes = number_from_env(env, ENV_LANES, int, 1, MAX_LANES, "a number of calls from 1 to %d (default %d)"
                            % (MAX_LANES, DEFAULT_ENGINE_LANES), error) or DEFAULT_ENGINE_LANES
    return lanes if env.get(ENV_ENGINE_ADDRESS) else 1


class SharedGate:
    """What laya's app holds around each inference, shared: any number of requests hold it at once, and `locked()`
    says whether one does (laya's idle reaper waits while it is). Used on the event loop only."""

    def __init__(self) -> None:
        self.held = 0

    async def __aenter__(self) -> "SharedGate":
        self.held += 1
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.held -= 1

    def locked(self) -> bool:
        return self.held > 0


def _escape(value: Any) -> str:
    """A Prometheus label value: backslash, newline and double quote escaped."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Once:
    """Whether something was said already in this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.said = False

    def first(self) -> bool:
        with self._lock:
            first, self.said = not self.said, True
        return first


ENGINE_GONE = _Once()


def engine_gone(error: EngineGone) -> Exception:
    """laya's 503 for a request whose engine process is gone (the supervisor is stopping the server: a client may
    retry), said once per process with its cause, then at debug level: each request in flight raises it, and laya's
    own handler would log each as a 500 "inference failed" with its traceback."""
    if ENGINE_GONE.first():
        log.error("laya-aot serve: %s; requests are answered 503 until this server stops", error)
    else:
        log.debug("laya-aot serve: %s (a request answered 503)", error)
    return laya_api.overloaded_error()


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


class _Router:
    """The app's Router as a batch request or a tournament sees it: `predict` and `predict_batch` wait on the
    batcher (their own call when alone); every other attribute is the Router's."""

    def __init__(self, router: Any, pool: "LayaPool"):
        self.__dict__.update(_router=router, _pool=pool)

    def predict(self, state: Any, questions: Any, *args: Any, **controls: Any) -> Any:
        if args:  # positional controls: laya's call as it is, alone
            return self._pool.wait(Work(None, [], lambda: self._router.predict(state, questions, *args, **controls),
                                        1, 1))
        return self._pool.wait(self._pool.target.work(state, questions, controls))

    def _predict_batch(self, requests: Any, *args: Any, **controls: Any) -> Any:
        if args:
            return self._pool.wait(Work(None, [], lambda: self._router.predict_batch(requests, *args, **controls),
                                        1, 1, many=True))
        return self._pool.wait(self._pool.target.work_many(requests, controls))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._router, name)  # AttributeError where the Router has none (laya's hasattr checks)
        return self._predict_batch if name == "predict_batch" else value


class _SideRequest:
    """The batcher futures one batch request or tournament waits on from its side thread. The future laya awaits
    for it is cancelled when its client is gone (`serve.dropped_when_gone`, as for a single request); that cancels
    these too, so its calls not yet started are dropped, and the rounds it has not asked for yet are refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self.futures: List[Future] = []
        self.model: Optional[str] = None  # the model of its first call: None while it has made none

    def add(self, future: Future) -> None:
        with self._lock:
            if not self.cancelled:
                self.futures.append(future)
                return
        future.cancel()

    def discard(self, future: Future) -> None:
        with self._lock:
            if future in self.futures:
                self.futures.remove(future)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            futures, self.futures = self.futures, []
        for future in futures:
            future.cancel()  # a call that has started is computed with its neighbours and its answer discarded


class LayaPool:
    """What laya's app submits its inferences and its idle unload to, in place of its one-thread pool."""

    def __init__(self, cells: Dict[str, Any], limits: Limits, stats: Stats, lanes: int = 1):
        self.router = cells["router"].cell_contents
        self.run_inference = cells["run_inference"].cell_contents
        self.target = RouterTarget(self.router)
        self.batcher = Batcher(self.target, limits, name="laya-infer-batcher", wrap=self._call, stats=stats,
                               lanes=lanes)
        self.proxy = _Router(self.router, self)
        self.threads = ThreadPoolExecutor(max_workers=SIDE_THREADS, thread_name_prefix="laya-infer-side")
        self.closed = False
        self._side = threading.local()  # `.request`: the _SideRequest of the side thread's request

    def _call(self, call: Callable[[], Any]) -> Any:
        """laya's `_run_inference(call)` for one batcher call; an engine gone is laya's 503 (`engine_gone`)."""
        try:
            return self.run_inference(call)
        except EngineGone as e:
            raise engine_gone(e) from None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        if fn is self.run_inference and len(args) == 1 and not kwargs:
            return self._inference(args[0])
        return self._job(functools.partial(fn, *args, **kwargs))

    def _job(self, job: Callable[[], Any]) -> Future:
        try:
            return self.batcher.submit_job(job)
        except BatcherClosed as e:
            return _failed(e)

    def _inference(self, run: Any) -> Future:
        call = laya_api.predict_call(run, self.router)
        if call is not None:
            try:
                return self.batcher.submit_work(self.target.work(*call))
            except Overloaded:
                return _failed(laya_api.overloaded_error())
            except BatcherClosed as e:
                return _failed(e)
        swapped = laya_api.with_router(run, self.router, self.proxy)
        if swapped is None:  # work laya-aot does not know: laya's own way, alone on the worker
            return self._job(functools.partial(self._call, run))
        if self.batcher.full():
            self.batcher.stats.count("refused", "overloaded")
            return _failed(laya_api.overloaded_error())
        return self._on_side_thread(swapped)

    def _on_side_thread(self, run: Callable[[], Any]) -> Future:
        """laya's `run` on a side thread, behind a future that stays pending until it is answered: cancelling it
        (laya's await cancelled, its client gone) cancels the batcher futures `run` waits on (`_SideRequest`),
        where a running thread's own future cannot be cancelled and the work would be computed for no one."""
        outer: Future = Future()
        request = _SideRequest()
        outer.add_done_callback(lambda f: request.cancel() if f.cancelled() else None)
        submitted = time.perf_counter()

        def side() -> None:
            if request.cancelled:
                return
            self._side.request = request
            try:
                result = self.run_inference(run)
            except BaseException as e:  # noqa: BLE001 - handed to laya's await, as the pool's would be
                self._answered(request, submitted, ok=False, cancelled=isinstance(e, CancelledError))
                if outer.set_running_or_notify_cancel():
                    outer.set_exception(e)
                if not isinstance(e, Exception):
                    raise
            else:
                self._answered(request, submitted, ok=True)
                if outer.set_running_or_notify_cancel():
                    outer.set_result(result)
            finally:
                self._side.request = None

        inner = self.threads.submit(side)
        inner.add_done_callback(lambda f: outer.cancel() if f.cancelled() else None)  # dropped by a shutdown
        return outer

    def _answered(self, request: _SideRequest, submitted: float, ok: bool, cancelled: bool = False) -> None:
        """A side request counted once in the statistics' requests and latency (its calls are not: `Work.counted`),
        as a single request is; one that made no call, or was dropped with its client, is not."""
        if request.model is not None and not cancelled:
            self.batcher.stats.answered(request.model, ok, (time.perf_counter() - submitted) * 1000.0)

    def wait(self, work: Work) -> Any:
        """`work`'s answer through the batcher, on a side thread (a full queue: laya's 503, raised there; a request
        whose client is gone: CancelledError, before or instead of its call)."""
        request: Optional[_SideRequest] = getattr(self._side, "request", None)
        if request is not None and request.cancelled:
            raise CancelledError()
        if request is not None:
            work.counted = False
        try:
            future = self.batcher.submit_work(work)
        except Overloaded:
            raise laya_api.overloaded_error() from None
        if request is None:
            return future.result()
        request.add(future)
        if request.model is None:
            request.model = work.model
        try:
            return future.result()
        finally:
            request.discard(future)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """laya's app shutting down: what was accepted is answered (or cancelled, as laya asks), then both stop."""
        self.closed = True
        self.batcher.close(wait=wait, cancel=cancel_futures)
        self.threads.shutdown(wait=wait, cancel_futures=cancel_futures)


class ServeBatching:
    """One app's batching: its limits and statistics, the pool and gate it gives laya's app (again after laya's
    lifespan restarts, which resets them), and what `GET /v1/aot` and `/metrics` say about it."""

    def __init__(self, app: Any, limits: Optional[Limits], metrics: bool = False, lanes: int = 1):
        self.limits = None if limits is None else Limits.check(limits)  # the batcher is made at the first request
        self.metrics = metrics
        self.lanes = lanes
        self.stats = Stats()
        self.cells = laya_api.app_cells(app) if limits is not None else None
        if limits is not None and self.cells is None:
            raise laya_api.LayaIncompatible(["laya.serve.create_app's %s" % "/".join(laya_api.APP_CELLS)],
                                            "laya-aot serve's batcher (%s=0 serves without it)" % ENV_BATCH)
        self.pool: Optional[LayaPool] = None
        self.gate: Optional[SharedGate] = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.cells is not None

    def ensure(self) -> None:
        """Give laya's app the shared gate and the batching pool, unless it holds them (called on each request,
        before laya's app sees it: laya's lifespan resets its gate, and replaces a pool it shut down)."""
        cells = self.cells
        if cells is None:
            return
        pool, gate = self.pool, self.gate
        if pool is not None and not pool.closed and cells["pool"].cell_contents is pool \
                and cells["gate"].cell_contents is gate:
            return
        with self._lock:
            if self.pool is None or self.pool.closed or cells["pool"].cell_contents is not self.pool:
                laya_pool = cells["pool"].cell_contents
                self.pool = LayaPool(cells, self.limits, self.stats, self.lanes)  # type: ignore[arg-type]
                cells["pool"].cell_contents = self.pool
                if isinstance(laya_pool, ThreadPoolExecutor):  # laya's own, idle: nothing will submit to it again
                    laya_pool.shutdown(wait=False)
            if self.gate is None or cells["gate"].cell_contents is not self.gate:
                self.gate = SharedGate()
                cells["gate"].cell_contents = self.gate

    def report(self) -> Dict[str, Any]:
        """`GET /v1/aot`'s `batching` entry: on or off, the limits, the queue, and the statistics."""
        if not self.enabled:
            return {"enabled": False}
        pool = self.pool
        return {"enabled": True, "limits": dict(vars(self.limits)), "queued": pool.batcher.queued() if pool else 0,
                **self.stats.snapshot()}

    def figures(self, backends: Dict[str, Dict[str, Any]], loads: Mapping[str, int]) -> Dict[str, Any]:
        """This process's figures (its statistics, queue, each resident model's backend and the loads of each): what
        `/metrics` exports, and what a worker of several (serve_workers.py) shares with the others."""
        return {"batching": self.stats.snapshot(), "queued": self.pool.batcher.queued() if self.pool else 0,
                "backends": backends, "loads": dict(loads)}

    def metrics_text(self, figures: List[Dict[str, Any]]) -> str:
        """The Prometheus text exposition (version 0.0.4) of the batcher's statistics and each model's backend,
        summed over `figures` (this process's, then any other worker's; each other one with its `age_s`)."""
        out: List[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append("# HELP %s %s" % (name, help_text))
            out.append("# TYPE %s %s" % (name, kind))

        def labels(**kv: Any) -> str:
            return "{%s}" % ",".join('%s="%s"' % (k, _escape(v)) for k, v in kv.items())

        snap = engine.merge_snapshots([f["batching"] for f in figures])
        family("laya_aot_requests_total", "counter", "HTTP requests answered through the batcher (one per request, "
               "whatever calls it took), by model asked for (auto: routed) and outcome.")
        for row in snap["requests"]:
            out.append("laya_aot_requests_total%s %d" % (labels(model=row["model"], outcome=row["outcome"]),
                                                        row["count"]))
        family("laya_aot_calls_total", "counter", "Calls the batcher made: merged, alone, split after an error, "
               "jobs (idle unloads).")
        for kind, n in snap["calls"].items():
            out.append("laya_aot_calls_total%s %d" % (labels(kind=kind), n))
        family("laya_aot_refused_total", "counter", "Requests refused (queue full: 503) or cancelled before their "
               "call.")
        for reason, n in snap["refused"].items():
            out.append("laya_aot_refused_total%s %d" % (labels(reason=reason), n))
        family("laya_aot_queue_length", "gauge", "Requests waiting in the batcher's queue.")
        out.append("laya_aot_queue_length %d" % sum(f["queued"] for f in figures))
        for name, key, scale, help_text in (
                ("laya_aot_batch_requests", "batch_requests", 1.0, "Requests per call."),
                ("laya_aot_batch_rows", "batch_rows", 1.0, "Question rows (states x questions) per call."),
                ("laya_aot_queue_wait_seconds", "queue_wait_ms", 1e-3, "Time from a request's arrival in the "
                 "queue to the start of its call."),
                ("laya_aot_request_latency_seconds", "latency_ms", 1e-3, "Time from a request's arrival at the "
                 "batcher to its answer (all its calls).")):
            family(name, "histogram", help_text)
            hist = snap[key]
            running = 0
            for bound, count in hist["buckets"].items():
                running += count
                le = bound if bound == "+Inf" else "%g" % (float(bound) * scale)
                out.append("%s_bucket%s %d" % (name, labels(le=le), running))
            out.append("%s_sum %s" % (name, "%g" % (hist["sum"] * scale)))
            out.append("%s_count %d" % (name, hist["count"]))
        serving: Dict[tuple, int] = {}
        loads: Dict[str, int] = {}
        for f in figures:
            for model, info in f["backends"].items():
                key = (model, info.get("backend") or "", info.get("artifact") or "")
                serving[key] = serving.get(key, 0) + 1
            for model, n in f["loads"].items():
                loads[model] = loads.get(model, 0) + n
        family("laya_aot_backend_info", "gauge", "For each resident model and the backend and artifact serving it: "
               "the processes where it is so (1 without workers).")
        for (model, backend, artifact), n in sorted(serving.items()):
            out.append("laya_aot_backend_info%s %d" % (labels(model=model, backend=backend, artifact=artifact), n))
        family("laya_aot_loads_total", "counter", "Loads of each bundled model from its bundle.")
        for model, n in sorted(loads.items()):
            out.append("laya_aot_loads_total%s %d" % (labels(model=model), n))
        if any("index" in f for f in figures):
            family("laya_aot_worker_figures_age_seconds", "gauge", "Worker processes (LAYA_AOT_WORKERS): the age "
                   "of each one's figures summed above (0: the worker that answered).")
            for f in sorted(figures, key=lambda f: f["index"]):
                out.append("laya_aot_worker_figures_age_seconds%s %g" % (labels(worker=f["index"]), f["age_s"]))
        return "\n".join(out) + "\n"


__all__ = ["ENV_BATCH", "ENV_METRICS", "LIMIT_SETTINGS", "LayaPool", "ServeBatching", "SharedGate", "limits_from_env"]

"""`laya-aot serve`'s dynamic batcher in laya's app (laya_aot/serve_batching.py), in this process over the demo
bundle: concurrent requests share calls and are answered as alone; /v1/aot and /metrics report it; and the edge
cases: a full queue answers laya's own 503 at once, a request that crashes inference or fails validation fails
alone, a client that goes away mid-batch leaves the others answered, an idle unload waits for the batch. In each,
nothing hangs (every wait is bounded) and every other request is answered."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Dict, List

import httpx
import pytest

from laya_aot import laya_internals as laya_api
from laya_aot import serve_batching
from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
from laya_aot.runtime.engine import EngineGone
from tests.questions import assert_same_answers

KEY = "batch-key"
AUTH = {"Authorization": "Bearer " + KEY}
BAD_QUESTION = {"q": {"type": "riddle", "instructions": "?"}}


def _one(state: str, questions: Dict[str, Any] = DEMO_QUESTIONS) -> Dict[str, Any]:
    return {"model": "demo", "state": state, "questions": questions}


@pytest.fixture
def make_app(demo_ckpt, demo_bundle, monkeypatch):
    """`make_app(**env)`: laya-aot serve's app over the demo bundle, with these LAYA_* settings."""
    def make(**env: str):
        base = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}), "LAYA_MODELS": "demo",
                "LAYA_AOT_BUNDLES": json.dumps({"demo": str(demo_bundle)}), "LAYA_API_KEY": KEY,
                "LAYA_MAX_CONCURRENT": "64", "LAYA_THREADS": "1"}
        for k, v in {**base, **env}.items():
            monkeypatch.setenv(k, v)
        from laya_aot.serve import create_app

        return create_app()
    return make


def _router(app: Any) -> Any:
    return laya_api.app_cells(app)["router"].cell_contents


class Hold:
    """The resident agent's predict_batch (every call of laya's, system_one's included), wrapped: it raises for a
    state "CRASH" (as a forward that crashed) and "ENGINE-GONE" (as a worker's whose engine process died), and the
    calls `arm(n)` names wait inside until the test opens them (bounded)."""

    def __init__(self, agent: Any):
        self.stock = agent.predict_batch
        self.calls: List[int] = []
        self.gates: Dict[int, Any] = {}

        def predict_batch(states, questions, *a, **k):
            i = len(self.calls)
            self.calls.append(len(states))
            if i in self.gates:
                entered, gate = self.gates[i]
                entered.set()
                assert gate.wait(30), "the test never opened call %d" % i
            if "CRASH" in states:
                raise RuntimeError("the forward crashed (a stand-in for a CUDA error)")
            if "ENGINE-GONE" in states:
                raise EngineGone("the engine process is gone (EOFError)")
            return self.stock(states, questions, *a, **k)

        agent.predict_batch = predict_batch

    def arm(self, n: int) -> List[Any]:
        """The next `n` calls, each held until its gate is set: [(entered, gate), ...]."""
        start = len(self.calls)
        for i in range(start, start + n):
            self.gates[i] = (threading.Event(), threading.Event())
        return [self.gates[i] for i in range(start, start + n)]


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out waiting for " + what
        await asyncio.sleep(0.01)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH, timeout=120)


def test_concurrent_requests_share_calls_and_are_answered_as_alone(make_app):
    app = make_app(LAYA_AOT_METRICS="1")

    async def drive():
        async with _client(app) as c:
            alone = [(await c.post("/v1/systemone", json=_one(s))).json() for s in DEMO_STATES]
            batch_alone = (await c.post("/v1/systemone/batch", json={"model": "demo", "states": DEMO_STATES,
                                                                     "questions": DEMO_QUESTIONS})).json()
            singles = [c.post("/v1/systemone", json=_one(DEMO_STATES[i % 3])) for i in range(36)]
            batches = [c.post("/v1/systemone/batch", json={"model": "demo", "states": DEMO_STATES,
                                                           "questions": DEMO_QUESTIONS}) for _ in range(4)]
            got = await asyncio.gather(*singles, *batches)
            report = (await c.get("/v1/aot")).json()
            metrics = await c.get("/metrics")
            denied = await c.get("/metrics", headers={"Authorization": "Bearer wrong"})
            return alone, batch_alone, got, report, metrics, denied

    alone, batch_alone, got, report, metrics, denied = asyncio.run(drive())
    assert {r.status_code for r in got} == {200}
    for i, r in enumerate(got[:36]):
        assert_same_answers(r.json()["answers"], alone[i % 3]["answers"])
        assert r.json()["usage"] == alone[i % 3]["usage"] and r.json()["routing"] == alone[i % 3]["routing"]
    for r in got[36:]:
        for g, ref in zip(r.json()["results"], batch_alone["results"]):
            assert_same_answers(g["answers"], ref["answers"])
        assert r.json()["total_usage"] == batch_alone["total_usage"]
    batching = report["batching"]
    assert batching["enabled"] and batching["calls"]["merged"] >= 1, batching
    assert batching["batch_requests"]["sum"] == 3 + 1 + 36 + 4 and batching["batch_requests"]["count"] < 44
    assert batching["queue_wait_ms"]["count"] == 44 and "+Inf" in batching["queue_wait_ms"]["buckets"]
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = metrics.text
    for family in ("laya_aot_requests_total", "laya_aot_batch_requests_bucket", "laya_aot_queue_wait_seconds_sum",
                   "laya_aot_request_latency_seconds_count", 'laya_aot_backend_info{model="demo",backend="aot:'):
        assert family in text, family
    assert 'laya_aot_requests_total{model="demo",outcome="ok"} 44' in text
    assert denied.status_code == 401 and denied.json() == {"detail": "invalid or missing bearer token"}


def test_metrics_are_off_by_default_and_laya_answers_the_path(make_app):
    app = make_app()

    async def drive():
        async with _client(app) as c:
            return await c.get("/metrics")

    assert asyncio.run(drive()).status_code == 404   # laya's own answer: the route is not laya's


def test_another_method_on_v1_aot_or_metrics_is_405_as_on_layas_routes(make_app):
    """laya's routes answer a method they do not take with FastAPI's 405 and an Allow header; /v1/aot and /metrics,
    answered by laya-aot's middleware, do the same (they answered 404, as if there were no such route)."""
    app = make_app(LAYA_AOT_METRICS="1")

    async def drive():
        async with _client(app) as c:
            laya_405 = await c.post("/health")
            got = {(m, p): await c.request(m, p) for m in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS")
                   for p in ("/v1/aot", "/metrics")}
            return laya_405, got, (await c.get("/v1/aot")).status_code, (await c.head("/metrics")).status_code

    laya_405, got, get_aot, head_metrics = asyncio.run(drive())
    assert laya_405.status_code == 405 and laya_405.headers["allow"] == "GET"
    for key, r in got.items():
        assert r.status_code == 405 and r.content == laya_405.content, (key, r.status_code, r.content)
        assert r.headers["allow"] == "GET, HEAD" and r.headers["content-type"] == laya_405.headers["content-type"]
    assert get_aot == head_metrics == 200


def test_metrics_count_each_http_request_once_whatever_rounds_it_took(make_app):
    """A tournament (LAYA_TOURNAMENT_GROUP) answers a request in several calls, one per elimination round: the
    request counts once in `laya_aot_requests_total` and the latency histogram, as any request does."""
    app = make_app(LAYA_AOT_METRICS="1", LAYA_TOURNAMENT_GROUP="2")   # the 3-option choice: two rounds

    async def drive():
        async with _client(app) as c:
            singles = [c.post("/v1/systemone", json=_one(s)) for s in DEMO_STATES]
            batch = c.post("/v1/systemone/batch", json={"model": "demo", "states": DEMO_STATES,
                                                        "questions": DEMO_QUESTIONS})
            got = await asyncio.gather(*singles, batch)
            return got, (await c.get("/v1/aot")).json()["batching"], (await c.get("/metrics")).text

    got, batching, text = asyncio.run(drive())
    assert {r.status_code for r in got} == {200}
    assert "x_tournament" in got[0].json()["answers"]["team"]   # narrowed in rounds
    n = len(DEMO_STATES) + 1
    assert batching["batch_requests"]["sum"] > n, batching   # the rounds' calls
    assert batching["requests"] == [{"model": "demo", "outcome": "ok", "count": n}]
    assert batching["latency_ms"]["count"] == n
    assert 'laya_aot_requests_total{model="demo",outcome="ok"} %d\n' % n in text


def test_batching_off_serves_one_request_at_a_time_as_laya(make_app):
    app = make_app(LAYA_AOT_BATCH="0")

    async def drive():
        async with _client(app) as c:
            got = await asyncio.gather(*[c.post("/v1/systemone", json=_one(s)) for s in DEMO_STATES])
            return got, (await c.get("/v1/aot")).json()

    got, report = asyncio.run(drive())
    assert {r.status_code for r in got} == {200} and report["batching"] == {"enabled": False}
    assert isinstance(laya_api.app_cells(app)["gate"].cell_contents, asyncio.Lock)   # laya's own gate


def _laya_overload() -> httpx.Response:
    """laya's own app refusing a request over its admission bound (LAYA_MAX_CONCURRENT=1), for comparison."""
    import laya.serve

    class Slow:
        loaded, _agents = [], {}
        entered = threading.Event()

        def predict(self, state, questions, model=None):
            self.entered.set()
            time.sleep(1.0)
            return {"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}

    router = Slow()

    async def drive():
        import os
        from unittest import mock

        with mock.patch.dict(os.environ, {"LAYA_MAX_CONCURRENT": "1"}):
            app = laya.serve.create_app(router=router)
        async with _client(app) as c:
            first = asyncio.ensure_future(c.post("/v1/systemone", json=_one("a")))
            await _until(router.entered.is_set, "laya's first request")
            second = await c.post("/v1/systemone", json=_one("b"))
            await first
            return second

    return asyncio.run(drive())


def test_a_full_queue_answers_layas_own_503_at_once(make_app):
    app = make_app(LAYA_AOT_BATCH_QUEUE="2")
    (entered, gate), = Hold(_router(app).load("demo")).arm(1)

    async def drive():
        async with _client(app) as c:
            first = asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[0])))
            await _until(entered.is_set, "the first call")
            queued = [asyncio.ensure_future(c.post("/v1/systemone", json=_one(s))) for s in DEMO_STATES[1:]]
            await _until(lambda: laya_api.app_cells(app)["pool"].cell_contents.batcher.queued() == 2, "the queue")
            t0 = time.perf_counter()
            refused = await c.post("/v1/systemone", json=_one(DEMO_STATES[0]))
            refused_batch = await c.post("/v1/systemone/batch", json={"model": "demo", "states": DEMO_STATES,
                                                                      "questions": DEMO_QUESTIONS})
            took = time.perf_counter() - t0
            gate.set()
            rest = await asyncio.gather(first, *queued)
            after = await c.post("/v1/systemone", json=_one(DEMO_STATES[2]))
            return refused, refused_batch, took, rest, after

    refused, refused_batch, took, rest, after = asyncio.run(drive())
    laya_503 = _laya_overload()
    for r in (refused, refused_batch):
        assert r.status_code == laya_503.status_code == 503
        assert r.content == laya_503.content and r.headers["retry-after"] == laya_503.headers["retry-after"] == "1"
    assert took < 5, "a full queue must refuse at once, not wait"
    assert [r.status_code for r in rest] == [200, 200, 200] and after.status_code == 200


def test_a_request_that_crashes_inference_or_fails_validation_fails_alone(make_app):
    app = make_app()
    hold = Hold(_router(app).load("demo"))

    async def drive():
        async with _client(app) as c:
            alone = {s: (await c.post("/v1/systemone", json=_one(s))).json() for s in DEMO_STATES}
            bad_alone = await c.post("/v1/systemone", json=_one("x", BAD_QUESTION))
            (entered, gate), = hold.arm(1)
            first = asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[0])))
            await _until(entered.is_set, "the first call")
            states = [DEMO_STATES[i % 3] for i in range(12)]
            bodies = [_one(s) for s in states] + [_one("CRASH"), _one("x", BAD_QUESTION)]
            tasks = [asyncio.ensure_future(c.post("/v1/systemone", json=b)) for b in bodies]
            await _until(lambda: laya_api.app_cells(app)["pool"].cell_contents.batcher.queued() == len(bodies),
                         "the queue")
            gate.set()
            got = await asyncio.gather(first, *tasks)
            return alone, bad_alone, states, got

    alone, bad_alone, states, got = asyncio.run(drive())
    first, *rest = got
    answers, crashed, invalid = rest[:12], rest[12], rest[13]
    assert first.status_code == 200
    for s, r in zip(states, answers):
        assert r.status_code == 200
        assert_same_answers(r.json()["answers"], alone[s]["answers"])
    assert crashed.status_code == 500 and crashed.json() == {"detail": "inference failed"}   # laya's own 500
    assert invalid.status_code == bad_alone.status_code == 422 and invalid.json() == bad_alone.json()
    assert max(hold.calls) >= 12, hold.calls   # the neighbours did share a call before it was split


def test_requests_in_flight_when_the_engine_dies_get_layas_503_and_one_log_line(make_app, monkeypatch, caplog):
    """The engine process gone (the supervisor is stopping the server) is not the request's fault: each request in
    flight gets laya's 503 with Retry-After, as a full queue does, not a 500 "inference failed" with a traceback
    each; the cause is logged once per process."""
    monkeypatch.setattr(serve_batching, "ENGINE_GONE", serve_batching._Once())
    app = make_app()
    Hold(_router(app).load("demo"))

    async def drive():
        async with _client(app) as c:
            singles = [c.post("/v1/systemone", json=_one("ENGINE-GONE")) for _ in range(6)]
            batches = [c.post("/v1/systemone/batch", json={"model": "demo", "states": ["ENGINE-GONE", "x"],
                                                           "questions": DEMO_QUESTIONS}) for _ in range(2)]
            return await asyncio.gather(*singles, *batches)

    with caplog.at_level("DEBUG"):
        got = asyncio.run(drive())
    laya_503 = _laya_overload()
    for r in got:
        assert r.status_code == 503 and r.content == laya_503.content and r.headers["retry-after"] == "1", r.content
    errors = [rec for rec in caplog.records if rec.levelname in ("ERROR", "CRITICAL")]
    assert len(errors) == 1 and "the engine process is gone" in errors[0].getMessage(), errors
    assert not any("inference failed" in rec.getMessage() for rec in caplog.records)


def test_a_client_that_goes_away_mid_batch_leaves_the_others_answered(make_app):
    app = make_app()
    hold = Hold(_router(app).load("demo"))
    pool = laya_api.app_cells(app)["pool"]

    async def drive():
        async with _client(app) as c:
            await c.post("/v1/systemone", json=_one(DEMO_STATES[0]))   # the batcher is in place
            (entered0, gate0), (entered1, gate1) = hold.arm(2)
            first = asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[0])))
            await _until(entered0.is_set, "the first call")
            tasks = [asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[i % 3]))) for i in range(9)]
            await _until(lambda: pool.cell_contents.batcher.queued() == 9, "the queue")
            tasks[4].cancel()   # gone while waiting for its call
            await asyncio.sleep(0.05)
            gate0.set()
            await _until(entered1.is_set, "the merged call")
            tasks[6].cancel()   # gone while its merged call runs
            await asyncio.sleep(0.05)
            gate1.set()
            done = await asyncio.gather(first, *tasks, return_exceptions=True)
            after = await c.post("/v1/systemone", json=_one(DEMO_STATES[1]))
            return done, after

    done, after = asyncio.run(drive())
    first, *rest = done
    assert first.status_code == 200 and after.status_code == 200
    for i, r in enumerate(rest):
        if i in (4, 6):
            assert isinstance(r, asyncio.CancelledError)
        else:
            assert r.status_code == 200, r
    stats = pool.cell_contents.batcher.stats.snapshot()
    assert stats["refused"]["cancelled"] == 1 and hold.calls[2] == 8, hold.calls   # 9 queued, 1 gone before its call
    assert stats["requests"] == [{"model": "demo", "outcome": "ok", "count": 11}]   # 6 was answered, to no one


async def _gone_request(app: Any, path: str, body: bytes, gone: asyncio.Event, sent: List[Any]) -> None:
    """One request to `app` as uvicorn gives it: its body, then nothing until its client disconnects (`gone`)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("t", 80),
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"authorization", AUTH["Authorization"].encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Dict[str, Any]:
        if messages:
            return messages.pop(0)
        await gone.wait()   # as uvicorn's receive: nothing more until the connection closes
        return {"type": "http.disconnect"}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)


@pytest.mark.parametrize("route", ["single", "batch", "tournament"])
def test_a_client_that_disconnects_before_its_call_is_dropped_not_computed(make_app, route):
    """A server does not cancel a handler whose client disconnected (uvicorn: its `receive()` answers
    `http.disconnect`, nothing more): the request waiting for its call is dropped all the same, counted as
    cancelled, and nothing is sent to no one; a client that stays is answered. A batch request and a tournament
    wait on a side thread of their own, and are dropped as a single request is."""
    app = make_app(**({"LAYA_TOURNAMENT_GROUP": "2"} if route == "tournament" else {}))
    hold = Hold(_router(app).load("demo"))
    pool = laya_api.app_cells(app)["pool"]
    path, body = (("/v1/systemone/batch", {"model": "demo", "states": DEMO_STATES[1:], "questions": DEMO_QUESTIONS})
                  if route == "batch" else ("/v1/systemone", _one(DEMO_STATES[1])))

    small = {k: v for k, v in DEMO_QUESTIONS.items() if k != "team"}   # no choice to narrow: one call

    async def drive():
        async with _client(app) as c:
            await c.post("/v1/systemone", json=_one(DEMO_STATES[0]))   # the batcher is in place
            calls, before = len(hold.calls), pool.cell_contents.batcher.stats.snapshot()["refused"]["cancelled"]
            (entered, gate), = hold.arm(1)
            first = asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[0], small)))
            await _until(entered.is_set, "the first call")
            gone, sent = asyncio.Event(), []
            left = asyncio.ensure_future(_gone_request(app, path, json.dumps(body).encode(), gone, sent))
            await _until(lambda: pool.cell_contents.batcher.queued() == 1, "the queue")
            stays = asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[2], small)))
            await _until(lambda: pool.cell_contents.batcher.queued() == 2, "the queue")
            gone.set()
            await asyncio.wait_for(left, 10)   # returns once dropped: no answer to write
            gate.set()
            first, stays = await first, await stays
            await asyncio.sleep(0.2)   # a side thread still going would ask for its next call now
            return calls, before, sent, first, stays

    calls, before, sent, first, stays = asyncio.run(drive())
    assert sent == [] and first.status_code == 200 and stays.status_code == 200
    cancelled = pool.cell_contents.batcher.stats.snapshot()["refused"]["cancelled"] - before
    assert cancelled == 1 and hold.calls[calls:] == [1, 1], hold.calls   # never computed


def test_an_idle_unload_waits_for_the_batch_in_flight(make_app):
    app = make_app(LAYA_IDLE_UNLOAD_SECONDS="0.2")
    router = _router(app)
    seen_unloaded_while_held: List[bool] = []

    async def drive():
        async with app.router.lifespan_context(app):   # laya's idle reaper runs in its lifespan
            async with _client(app) as c:
                ref = (await c.post("/v1/systemone", json=_one(DEMO_STATES[0]))).json()
                (entered, gate), = Hold(router.load("demo")).arm(1)   # the agent resident now, just used
                tasks = [asyncio.ensure_future(c.post("/v1/systemone", json=_one(DEMO_STATES[0])))
                         for _ in range(6)]
                await _until(entered.is_set, "the call")
                for _ in range(10):   # 1 s held: five idle windows, and laya's reaper checks every 0.05 s
                    await asyncio.sleep(0.1)
                    seen_unloaded_while_held.append("demo" not in router.loaded)
                gate.set()
                got = await asyncio.gather(*tasks)
                await _until(lambda: "demo" not in router.loaded, "the idle unload", timeout=10)
                again = await c.post("/v1/systemone", json=_one(DEMO_STATES[0]))
                report = (await c.get("/v1/aot")).json()
                return ref, got, again, report

    ref, got, again, report = asyncio.run(drive())
    assert not any(seen_unloaded_while_held), "unloaded under a call in flight"
    for r in got + [again]:
        assert r.status_code == 200
        assert_same_answers(r.json()["answers"], ref["answers"])
    assert report["bundles"]["demo"]["loads"] >= 2 and report["batching"]["calls"]["jobs"] >= 1

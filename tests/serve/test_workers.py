"""`laya-aot serve` with LAYA_AOT_WORKERS=2 (laya_aot/serve_workers.py): two processes on one port answer laya's
routes as one process does; `GET /v1/aot` names the worker that answered, `GET /metrics` sums both; a worker that
exits stops the server, and a supervisor killed takes its workers with it. Each server here is a real
`laya-aot serve` over the demo bundle, on the CPU."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import httpx
import pytest

from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
from laya_aot.serve import ServeConfigError
from laya_aot.serve_batching import DEFAULT_ENGINE_LANES, lanes_from_env
from laya_aot.serve_workers import count_from_env, switch_interval_from_env
from tests.serve.test_serve import AUTH, Server, _env, _free_port

BODIES: List[Any] = [
    {"model": "demo", "state": s, "questions": DEMO_QUESTIONS} for s in DEMO_STATES
] + [
    {"model": "demo", "state": "x", "questions": DEMO_QUESTIONS, "max_len": "long"},          # 422
    {"model": "demo", "state": "x"},                                                         # 400
    {"model": "demo", "state": "x", "questions": {"q": {"type": "riddle", "instructions": "?"}}},
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(demo_ckpt, demo_bundle, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    env = _env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_AOT_METRICS="1", LAYA_MAX_CONCURRENT="64")
    started = {"one": Server(tmp, "one", env), "two": Server(tmp, "two", dict(env, LAYA_AOT_WORKERS="2"))}
    try:
        yield {k: s.wait_ready() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _answers(server: Server) -> List[Dict[str, Any]]:
    out = []
    for body in BODIES:
        r = server.post("/v1/systemone", body)
        out.append({"status": r.status_code, "body": r.json()})
    r = server.post("/v1/systemone/batch", {"model": "demo", "states": DEMO_STATES, "questions": DEMO_QUESTIONS})
    out.append({"status": r.status_code, "body": r.json()})
    r = server.post("/v1/systemone", BODIES[0], headers=None)
    out.append({"status": r.status_code, "body": r.json()})                                 # no key: 401
    health = server.health()
    # `loaded` is each process's most-recently-used order: the worker that answers /health may not be the one that
    # answered the requests above, so the set is compared, not the order
    out.append(dict({k: health.get(k) for k in ("status", "revisions")}, loaded=sorted(health.get("loaded") or [])))
    return out


def _alike(a: Any, b: Any, tol: float) -> bool:
    """`a == b`, but for numbers (not booleans), which may differ by `tol`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_alike(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_alike(x, y, tol) for x, y in zip(a, b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return abs(a - b) <= tol
    return a == b


def test_two_workers_answer_laya_routes_as_one_process(servers):
    """The same answers, bit for bit where every process serves the same artifact. Two artifacts within the
    loader's tie may still serve different processes (a start recorded more than `select.START_TIE` quicker puts
    another first); fp32 artifacts verified against laya, their rounded numbers may then differ in the last digit."""
    one, two = _answers(servers["one"]), _answers(servers["two"])
    assert [a.get("status") for a in one] == [200, 200, 200, 422, 400, 422, 200, 401, "ok"]
    served = {servers["one"].aot()["bundles"]["demo"]["artifact"]}
    served |= {w["backends"]["demo"]["artifact"] for w in _seen(servers["two"]) if "demo" in w["backends"]}
    assert _alike(two, one, 0.0 if len(served) == 1 else 1e-3), (served, two, one)


def test_v1_aot_names_the_worker_that_answered_and_metrics_sum_both(servers):
    two = servers["two"]
    seen = {}
    for _ in range(24):  # new connections: the kernel spreads them over both workers' sockets
        with httpx.Client(headers=AUTH, timeout=30) as client:
            r = client.post(two.url + "/v1/systemone", json=BODIES[0])
            assert r.status_code == 200
            aot = client.get(two.url + "/v1/aot").json()
        seen[aot["worker"]["index"]] = aot["worker"]["pid"]
        assert aot["worker"]["count"] == 2
    assert sorted(seen) == [0, 1] and len(set(seen.values())) == 2 and two.proc.pid not in seen.values()
    time.sleep(1.5)  # each worker's figures are at most PUBLISH_S old
    aot = httpx.get(two.url + "/v1/aot", headers=AUTH, timeout=10).json()
    assert [w["index"] for w in aot["workers"]["seen"]] == [0, 1]
    assert all(w["backends"]["demo"]["artifact"] for w in aot["workers"]["seen"])
    total = sum(r["count"] for r in aot["workers"]["batching"]["requests"])
    mine = sum(r["count"] for r in aot["batching"]["requests"])
    assert total >= 24 and 0 < mine < total           # one worker's own figures, and both summed
    text = httpx.get(two.url + "/metrics", headers=AUTH, timeout=10).text
    line = [x for x in text.splitlines() if x.startswith('laya_aot_requests_total{model="demo",outcome="ok"}')]
    ok = sum(r["count"] for r in aot["workers"]["batching"]["requests"] if r["outcome"] == "ok")
    assert int(line[0].split()[-1]) == ok
    assert 'laya_aot_worker_figures_age_seconds{worker="1"}' in text
    # one backend per worker, summed by artifact: two artifacts within the loader's tie may each serve one worker
    info = [x for x in text.splitlines() if x.startswith("laya_aot_backend_info{") and 'model="demo"' in x]
    assert sum(int(x.split()[-1]) for x in info) == 2
    assert {w["backends"]["demo"]["artifact"] for w in aot["workers"]["seen"]} == \
        {x.split('artifact="')[1].split('"')[0] for x in info}
    assert httpx.get(two.url + "/metrics", timeout=10).status_code == 401     # authorised as laya's detail
    one = servers["one"].aot()
    assert "worker" not in one and "workers" not in one                     # one process: as before


def test_a_worker_that_exits_stops_the_server_and_a_killed_supervisor_its_workers(demo_ckpt, demo_bundle, tmp_path):
    env = _env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_AOT_WORKERS="2")
    for stop in ("worker", "supervisor"):
        server = Server(tmp_path, stop, env).wait_ready()
        try:
            pids = {w["index"]: w["pid"] for w in _seen(server)}
            assert sorted(pids) == [0, 1]
            if stop == "worker":
                os.kill(pids[1], signal.SIGKILL)
                assert server.proc.wait(30) != 0
            else:
                os.kill(server.proc.pid, signal.SIGKILL)
                server.proc.wait(30)
            left = list(pids.values())
            _until(lambda: not any(_alive(p) for p in left), "a worker outlived its server")  # noqa: B023
        finally:
            server.stop()


def _seen(server: Server) -> List[Dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        seen = server.aot()["workers"]["seen"]
        if len(seen) == 2 or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


@pytest.mark.parametrize("value, says", [("x", "invalid LAYA_AOT_WORKERS 'x'"), ("0", "from 1"),
                                         ("65", "to 64")])
def test_a_bad_workers_setting_is_one_clear_error(value, says):
    with pytest.raises(ServeConfigError, match=says):
        count_from_env({"LAYA_AOT_WORKERS": value}, ServeConfigError)
    assert count_from_env({}, ServeConfigError) == 1 and count_from_env({"LAYA_AOT_WORKERS": " 3 "}, ValueError) == 3


@pytest.mark.parametrize("value", ["x", "0", "-1", "nan", "101"])
def test_a_bad_switch_interval_is_one_clear_error(value):
    with pytest.raises(ServeConfigError, match="invalid LAYA_AOT_GIL_SWITCH_MS .*milliseconds from 0.01 to 100"):
        switch_interval_from_env({"LAYA_AOT_GIL_SWITCH_MS": value}, ServeConfigError)


def test_the_switch_interval_is_read_in_milliseconds_and_unset_keeps_pythons():
    assert switch_interval_from_env({}, ServeConfigError) is None
    assert switch_interval_from_env({"LAYA_AOT_GIL_SWITCH_MS": " 0.5 "}, ServeConfigError) == pytest.approx(0.0005)


def test_lanes_are_for_a_worker_over_an_engine_and_a_bad_value_is_one_clear_error():
    """Several calls at once only where the forward is the engine's (it merges them); a process's own artifact runs
    one call at a time whatever the setting says."""
    over = {"LAYA_AOT_ENGINE_ADDRESS": "/tmp/x/engine"}
    assert lanes_from_env(over, ServeConfigError) == DEFAULT_ENGINE_LANES
    assert lanes_from_env(dict(over, LAYA_AOT_ENGINE_LANES=" 8 "), ServeConfigError) == 8
    assert lanes_from_env({"LAYA_AOT_ENGINE_LANES": "8"}, ServeConfigError) == 1
    for bad in ("x", "0", "65"):
        with pytest.raises(ServeConfigError, match="invalid LAYA_AOT_ENGINE_LANES .*from 1 to 64"):
            lanes_from_env({"LAYA_AOT_ENGINE_LANES": bad}, ServeConfigError)


def test_the_command_says_a_bad_workers_setting_once_before_starting_any(demo_ckpt, bundle_dir):
    env = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(_free_port()), LAYA_AOT_WORKERS="two",
               **_env(demo_ckpt, {"demo": str(bundle_dir)}))
    r = subprocess.run([sys.executable, "-m", "laya_aot.cli", "serve"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("laya-aot serve: invalid LAYA_AOT_WORK")
    assert r.stderr.count("LAYA_AOT_WORKERS") == 1


def test_a_port_another_servers_workers_hold_is_refused_before_anything_starts():
    """Workers bind with SO_REUSEPORT: a second server's workers would join the first's group on the same port and
    each answer part of the other's connections. The supervisor's test bind (without it) finds the port taken."""
    from laya_aot import serve_workers

    held = serve_workers.listen("127.0.0.1", 0)   # as a worker of another server holds it
    port = held.getsockname()[1]
    try:
        why = serve_workers.port_taken("127.0.0.1", port)
        assert why is not None and "127.0.0.1:%d is in use" % port in why and "set LAYA_PORT" in why
        assert serve_workers.supervise(2, "127.0.0.1", port) == serve_workers.PORT_IN_USE
    finally:
        held.close()
    assert serve_workers.port_taken("127.0.0.1", port) is None



def test_one_process_refuses_a_taken_port_before_loading_as_workers_do(demo_ckpt, demo_bundle):
    """One process checks the port as the supervisor does: one line and PORT_IN_USE before any model loads, where
    uvicorn's bind failed only after the load and a false "ready" line."""
    from laya_aot import serve_workers

    held = serve_workers.listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    env = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(port), **_env(demo_ckpt, {"demo": str(demo_bundle)}))
    try:
        r = subprocess.run([sys.executable, "-m", "laya_aot.cli", "serve"], env=env, capture_output=True, text=True,
                           timeout=300)
    finally:
        held.close()
    assert r.returncode == serve_workers.PORT_IN_USE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR:     laya_aot.serve: 127.0.0.1:%d is in use" % port), lines
    assert lines[0].endswith("stop it or set LAYA_PORT")

"""`python -m laya_aot.serve_ray` on a local Ray cluster: the Ray Serve deployment (two replicas, one compute
thread each) answers laya's routes as `laya-aot serve`'s own app does, errors and auth included, and stops
with its cluster on SIGTERM. Needs Ray Serve (the `ray` extra)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
from tests.questions import assert_same_answers
from tests.serve.test_serve import AUTH, KEY, _free_port

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install \"laya-aot[ray]\"")

START_TIMEOUT_S = 150


def _env(ckpt: Path, bundle: Path) -> dict:
    return {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(ckpt)}), "LAYA_MODELS": "demo", "LAYA_API_KEY": KEY,
            "LAYA_AOT_BUNDLES": json.dumps({"demo": str(bundle)}), "LAYA_THREADS": "1"}


REQUESTS = [
    ("POST", "/v1/systemone", {"model": "demo", "state": DEMO_STATES[0], "questions": DEMO_QUESTIONS}, AUTH),
    ("POST", "/v1/systemone", {"model": "demo", "state": DEMO_STATES[1], "questions": DEMO_QUESTIONS}, AUTH),
    ("POST", "/v1/systemone/batch", {"model": "demo", "states": DEMO_STATES, "questions": DEMO_QUESTIONS}, AUTH),
    ("POST", "/v1/systemone", {"model": "demo", "state": "x", "questions": DEMO_QUESTIONS}, None),         # 401
    ("POST", "/v1/systemone", {"model": "demo", "state": "x"}, AUTH),                                     # 400
    ("POST", "/v1/systemone", {"model": "demo", "state": "x", "questions": {"q": {"type": "riddle"}}}, AUTH),
    ("GET", "/health", None, None),
    ("GET", "/v1/aot", None, None),                                                                       # 401
]


def _same(got: httpx.Response, ref: httpx.Response) -> None:
    assert got.status_code == ref.status_code, (got.text, ref.text)
    g, r = got.json(), ref.json()
    if got.status_code != 200 or "results" not in r and "answers" not in r:
        assert g == r
        return
    for x, y in zip(g.get("results", [g]), r.get("results", [r])):
        assert_same_answers(x["answers"], y["answers"])
        assert x["usage"] == y["usage"] and x["routing"] == y["routing"]


def _reference(env: dict) -> list:
    """The same requests to `laya-aot serve`'s app in this process."""
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        from laya_aot.serve import create_app

        app = create_app()

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.request(m, p, json=b, headers=h or {}) for m, p, b, h in REQUESTS]

    return asyncio.run(ask())


def test_the_ray_serve_deployment_answers_laya_routes_as_laya_aot_serve(demo_ckpt, demo_bundle, tmp_path):
    env = _env(demo_ckpt, demo_bundle)
    port = _free_port()
    log_path = tmp_path / "ray.log"
    full = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(port), LAYA_AOT_RAY_REPLICAS="2", RAY_DEDUP_LOGS="0",
                PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                           + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                **env)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "laya_aot.serve_ray"], env=full, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = "http://127.0.0.1:%d" % port
    try:
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() - t0 < START_TIMEOUT_S, log_path.read_text(errors="replace")
            if "'laya-aot' ready" in log_path.read_text(errors="replace"):   # serve.run returned: every replica up
                break
            time.sleep(0.5)
        got = [httpx.request(m, url + p, json=b, headers=h or {}, timeout=60) for m, p, b, h in REQUESTS]
        # both replicas answer (Ray's proxy spreads concurrent requests), each with its own batcher
        report = httpx.get(url + "/v1/aot", headers=AUTH, timeout=30).json()
        assert report["batching"]["enabled"] and report["backends"]["demo"].startswith("aot:"), report
        assert log_path.read_text(errors="replace").count("'demo' load #1") == 2   # one load per replica
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    for g, r in zip(got, _reference(env)):
        _same(g, r)


def test_bad_ray_settings_are_one_clear_error():
    from laya_aot.serve import ServeConfigError
    from laya_aot.serve_ray import options

    assert options({}, 0)["num_replicas"] == 1 and options({}, 4)["num_replicas"] == 4   # one per GPU
    assert options({}, 4)["ray_actor_options"]["num_gpus"] == 1
    shared = options({"LAYA_AOT_RAY_PER_GPU": "4"}, 2)   # four processes on each GPU
    assert shared["num_replicas"] == 8 and shared["ray_actor_options"]["num_gpus"] == 0.25
    assert options({"LAYA_DEVICE": "cpu"}, 4)["ray_actor_options"]["num_gpus"] == 0
    assert options({"LAYA_MAX_CONCURRENT": "64"}, 0)["max_ongoing_requests"] == 64
    auto = options({"LAYA_AOT_RAY_AUTOSCALING": '{"min_replicas": 1, "max_replicas": 3}'}, 0)
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3} and "num_replicas" not in auto
    with pytest.raises(ServeConfigError, match="invalid LAYA_AOT_RAY_REPLICAS 'two': use a positive integer"):
        options({"LAYA_AOT_RAY_REPLICAS": "two"}, 0)
    with pytest.raises(ServeConfigError, match="invalid LAYA_AOT_RAY_AUTOSCALING: not JSON"):
        options({"LAYA_AOT_RAY_AUTOSCALING": "{"}, 0)
    with pytest.raises(ServeConfigError, match="a fixed count or autoscaling, not both"):
        options({"LAYA_AOT_RAY_AUTOSCALING": "{}", "LAYA_AOT_RAY_REPLICAS": "2"}, 0)

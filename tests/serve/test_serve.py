"""`laya-aot serve` against real servers: uvicorn in a child process on a free localhost port, httpx as the
client, and `laya serve` itself (eager) beside it as the reference for answers, auth and errors."""
from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import httpx
import pytest

from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
from tests.conftest import another_torch, built_with_torch, readme_python, readme_serving_blocks
from tests.questions import assert_same_answers

KEY = "test-key"
AUTH = {"Authorization": "Bearer " + KEY}
START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (`laya-aot serve`, or laya's own with `laya=True`) and its log."""

    def __init__(self, tmp: Path, name: str, env: Dict[str, str], laya: bool = False):
        self.port = _free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log_path = tmp / ("%s.log" % name)
        full = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(self.port), LAYA_THREADS="1",
                    PYTHONUNBUFFERED="1", **env)
        cmd = [sys.executable, "-m", "laya.serve"] if laya else [sys.executable, "-m", "laya_aot.cli", "serve"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=full, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[2])

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited with %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready in %d s:\n%s" % (START_TIMEOUT_S, self.log()))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body, headers: Optional[dict] = AUTH, **kw) -> httpx.Response:
        kw.setdefault("timeout", 60)
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, headers={**(headers or {}),
                                                                      "content-type": "application/json"}, **kw)
        return httpx.post(self.url + path, json=body, headers=headers or {}, **kw)

    def health(self, headers: Optional[dict] = AUTH) -> dict:
        r = httpx.get(self.url + "/health", headers=headers or {}, timeout=10)
        assert r.status_code == 200
        return r.json()

    def aot(self) -> dict:
        """`GET /v1/aot` as an authorised caller."""
        r = httpx.get(self.url + "/v1/aot", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _env(ckpt: Path, bundles: Optional[dict] = None, **extra: str) -> Dict[str, str]:
    env = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(ckpt), "plain": str(ckpt)}), "LAYA_MODELS": "demo,plain",
           "LAYA_API_KEY": KEY}
    if bundles is not None:
        env["LAYA_AOT_BUNDLES"] = json.dumps(bundles)
    env.update(extra)
    return env


def _tamper(bundle: Path, only: Optional[str] = None) -> list:
    """Change one byte range of every artifact that can serve (or of kind `only`); returns their names."""
    from laya_aot import kinds
    from laya_aot.bundle_format import artifact_path, read_bundle

    names = []
    for art in read_bundle(bundle, kinds.NAMES).artifacts:
        if not kinds.get(art.kind).serves or only not in (None, art.kind):
            continue
        p = artifact_path(bundle, art)
        target = max((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size) if p.is_dir() else p
        with open(target, "ab") as f:
            f.write(b"tampered")
        names.append(art.name)
    assert names
    return names


@pytest.fixture(scope="module")
def tampered(demo_bundle, tmp_path_factory):
    dst = tmp_path_factory.mktemp("serve") / "tampered"
    shutil.copytree(demo_bundle, dst)
    return dst, _tamper(dst)


@pytest.fixture(scope="module")
def aoti_damaged(demo_bundle, tmp_path_factory):
    """The demo bundle with both AOTInductor packages changed: the ONNX artifact still serves."""
    dst = tmp_path_factory.mktemp("serve") / "aoti-damaged"
    shutil.copytree(demo_bundle, dst)
    return dst, _tamper(dst, only="aoti")


@pytest.fixture(scope="module")
def other_torch(demo_bundle, tmp_path_factory):
    """The demo bundle as a build under another torch would record its AOTInductor packages: (bundle, their
    names, that torch). A service whose torch is not the build's (a fresh `pip install` picks the newest) cannot
    use them; ONNX serves."""
    dst = tmp_path_factory.mktemp("serve") / "other-torch"
    shutil.copytree(demo_bundle, dst)
    version = another_torch()
    return dst, built_with_torch(dst, version), version


@pytest.fixture(scope="module")
def servers(demo_ckpt, demo_bundle, tampered, aoti_damaged, other_torch, tmp_path_factory):
    """Started together so their starts overlap: bundled (idle unload after 2 s), laya's eager, tampered bundle,
    strict over a bundle whose AOTInductor packages are damaged, and a bundle whose packages need another torch."""
    tmp = tmp_path_factory.mktemp("servers")
    started = {
        "aot": Server(tmp, "aot", _env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_IDLE_UNLOAD_SECONDS="2")),
        "laya": Server(tmp, "laya", _env(demo_ckpt), laya=True),
        "tampered": Server(tmp, "tampered", _env(demo_ckpt, {"demo": str(tampered[0])})),
        "strict": Server(tmp, "strict", _env(demo_ckpt, {"demo": str(aoti_damaged[0])}, LAYA_AOT_STRICT="1")),
        "torch": Server(tmp, "torch", _env(demo_ckpt, {"demo": str(other_torch[0])})),
    }
    try:
        yield {k: s.wait_ready() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _ask(server: Server, state: str, model: str = "demo") -> dict:
    r = server.post("/v1/systemone", {"model": model, "state": state, "questions": DEMO_QUESTIONS})
    assert r.status_code == 200, r.text
    return r.json()


def _same(got: dict, ref: dict) -> None:
    assert_same_answers(got["answers"], ref["answers"])
    for key in ("model", "usage", "routing"):
        assert got[key] == ref[key], key


def test_answers_over_http_equal_laya_serves_eager_answers(servers):
    aot, eager = servers["aot"], servers["laya"]
    for state in DEMO_STATES:
        _same(_ask(aot, state), _ask(eager, state))
    batch = {"model": "demo", "states": DEMO_STATES, "questions": DEMO_QUESTIONS}
    got, ref = aot.post("/v1/systemone/batch", batch), eager.post("/v1/systemone/batch", batch)
    assert got.status_code == ref.status_code == 200
    for g, r in zip(got.json()["results"], ref.json()["results"]):
        _same(g, r)
    assert got.json()["total_usage"] == ref.json()["total_usage"]
    report = aot.aot()
    assert report["backends"]["demo"].startswith("aot:"), report
    demo = report["bundles"]["demo"]
    assert demo["artifact"] and demo["refused"] == [] and demo["resident"] and demo["loads"] >= 1
    assert 0 <= demo["near_tie_margin"] < 1e-3   # an fp32 artifact: near-ties are float noise
    assert demo["near_ties"] == "off" and report["strict"] is False   # the default: the artifact's answers
    assert demo["handover"] is None   # no artifact of the demo bundle runs laya's module: nothing takes over
    assert "served by aot:" in aot.log() and "'demo' load #1" in aot.log()


@pytest.mark.slow  # `laya-aot demo` trains and builds (conftest.readme_demo)
def test_the_readmes_typed_questions_in_python_answer_from_the_bundle(readme_demo):
    """The README's Python example, run as written where command 1's `laya-aot demo` ran: one question of each of
    laya's types, for two states."""
    assert readme_demo.returncode == 0, readme_demo.output
    env = dict(os.environ, PYTHONUNBUFFERED="1", LAYA_THREADS="1")
    ran = subprocess.run([sys.executable, "-c", readme_python("### Ask typed questions")], cwd=readme_demo.dir,
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.strip().splitlines()
    assert len(lines) == 2, ran.stdout
    for line in lines:
        assert re.fullmatch(r".+ \| team: (billing|technical|account) \((0\.\d\d|1\.00)\) \| "
                            r"urgency: ([0-3]\.\d\d) of 3 \| angry: (0\.\d\d|1\.00)", line), line


def test_a_checkpoint_without_a_bundle_loads_as_laya_serve_loads_it(servers):
    aot, eager = servers["aot"], servers["laya"]
    _same(_ask(aot, DEMO_STATES[0], "plain"), _ask(eager, DEMO_STATES[0], "plain"))
    report = aot.aot()
    assert report["backends"]["plain"] == "eager"
    assert "plain" not in report["bundles"] and "'plain'" not in aot.log()


def test_health_is_laya_serves_and_v1_aot_is_authorised_as_its_detail(servers):
    aot, eager = servers["aot"], servers["laya"]
    for headers in (None, {"Authorization": "Bearer wrong"}):
        assert aot.health(headers) == eager.health(headers) == {"status": "ok"}
        got = httpx.get(aot.url + "/v1/aot", headers=headers or {}, timeout=10)
        ref = httpx.post(eager.url + "/v1/systemone", json={}, headers=headers or {}, timeout=10)
        assert got.status_code == ref.status_code == 401 and got.json() == ref.json()  # laya's own 401
    full, ref = aot.health(), eager.health()
    idle = {"idle_unload_seconds", "idle_seconds"}  # laya's own keys, there because only this server unloads idle
    assert set(full) - idle == set(ref) and full["status"] == ref["status"], "laya's /health, nothing added"
    assert httpx.get(eager.url + "/v1/aot", headers=AUTH, timeout=10).status_code == 404  # not a laya route


@pytest.mark.parametrize("body, headers", [
    ({"model": "demo", "state": "x", "questions": DEMO_QUESTIONS}, None),                       # no key: 401
    ({"model": "demo", "state": "x", "questions": DEMO_QUESTIONS}, {"Authorization": "Bearer no"}),
    ({"model": "demo", "state": "x"}, AUTH),                                                   # no questions: 400
    (b"{not json", AUTH),
    ({"model": "./elsewhere", "state": "x", "questions": DEMO_QUESTIONS}, AUTH),               # a path: 422
    ({"model": "demo", "state": "x", "questions": DEMO_QUESTIONS, "max_len": "long"}, AUTH),
    ({"model": "demo", "state": "x", "questions": DEMO_QUESTIONS, "hooks": ["x"]}, AUTH),
    ({"model": "demo", "state": "x", "questions": {"q": {"type": "riddle", "instructions": "?"}}}, AUTH),
])
def test_auth_and_error_responses_are_laya_serves(servers, body, headers):
    got = servers["aot"].post("/v1/systemone", body, headers=headers)
    ref = servers["laya"].post("/v1/systemone", body, headers=headers)
    assert got.status_code == ref.status_code and got.status_code >= 400
    assert got.json() == ref.json()


def test_an_idle_unload_reloads_from_the_bundle(servers):
    aot, eager = servers["aot"], servers["laya"]
    _ask(aot, DEMO_STATES[0])
    loads_before = aot.log().count("'demo' load #")
    deadline = time.monotonic() + 30
    while "demo" in aot.health()["loaded"]:  # LAYA_IDLE_UNLOAD_SECONDS=2
        assert time.monotonic() < deadline, "laya's idle unload never unloaded the checkpoint"
        time.sleep(0.5)
    _same(_ask(aot, DEMO_STATES[1]), _ask(eager, DEMO_STATES[1]))
    log = aot.log()
    assert log.count("'demo' load #") == loads_before + 1
    last = [line for line in log.splitlines() if "'demo' load #" in line][-1]
    assert "served by aot:" in last, last
    assert aot.aot()["backends"]["demo"].startswith("aot:")


def test_a_tampered_bundle_falls_back_with_the_reason_in_the_log_once(servers, tampered):
    server, eager = servers["tampered"], servers["laya"]
    demo = server.aot()["bundles"]["demo"]
    assert demo["backend"] == "eager" and demo["artifact"] is None
    log = server.log()
    assert log.count("fell back to laya's eager forward") == 1 and "RuntimeWarning" not in log, log
    for name in tampered[1]:
        assert any(reason.startswith(name + ": ") and "file was changed after the build" in reason
                   for reason in demo["refused"]), name
        assert log.count("%s: sha256 of" % name) == 1, log
    _same(_ask(server, DEMO_STATES[2]), _ask(eager, DEMO_STATES[2]))


def test_strict_names_every_damaged_artifact_once_when_another_serves(servers, aoti_damaged):
    server, eager = servers["strict"], servers["laya"]
    report = server.aot()
    demo = report["bundles"]["demo"]
    assert report["strict"] and demo["backend"].startswith("aot:") and demo["artifact"] not in aoti_damaged[1]
    log = server.log()
    line = [x for x in log.splitlines() if "'demo' load #1" in x]
    assert len(line) == 1 and line[0].startswith("WARNING") and "served by aot:" in line[0], log
    for name in aoti_damaged[1]:
        assert any(reason.startswith(name + ": ") and "file was changed after the build" in reason
                   for reason in demo["refused"]), (name, demo)
        assert log.count("%s: sha256 of" % name) == 1, log
    _same(_ask(server, DEMO_STATES[0]), _ask(eager, DEMO_STATES[0]))


def _torch_reason(name: str, version: str) -> str:
    """How the load's reasons name an AOTInductor package built with torch `version`: the refusal and its fix."""
    import torch

    return "%s: built for torch %s, this process has torch %s: install the torch it was built with (`pip install " \
           "torch==%s`), or rebuild the bundle with this torch (`laya-aot build`)" % (
               name, version, torch.__version__.split("+")[0], version)


def test_artifacts_for_another_torch_are_named_with_the_fix_where_another_serves(servers, other_torch):
    """The fastest artifacts need the build's torch; the load serves ONNX, never examining them, and still names
    each with the install that fixes it: in its warning (the load's log line), in GET /v1/aot's `refused`."""
    server, eager = servers["torch"], servers["laya"]
    bundle, names, version = other_torch
    demo = server.aot()["bundles"]["demo"]
    assert demo["backend"] == "aot:onnx" and demo["artifact"] == "onnx-fp32", demo
    assert sorted(demo["refused"]) == sorted(_torch_reason(name, version) for name in names), demo["refused"]
    line = [x for x in server.log().splitlines() if "'demo' load #1" in x]
    assert len(line) == 1 and line[0].startswith("WARNING") and "served by aot:onnx" in line[0], server.log()
    for name in names:
        assert _torch_reason(name, version) in line[0], line[0]
    _same(_ask(server, DEMO_STATES[1]), _ask(eager, DEMO_STATES[1]))


def test_a_checkpoint_loaded_on_first_use_names_them_at_start(demo_ckpt, other_torch, caplog):
    """LAYA_PRELOAD=0: nothing loads at start, and the start's log already names what this torch refuses."""
    import logging

    from laya_aot import serve

    bundle, names, version = other_torch
    config = serve.config_from_env({"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}),
                                    "LAYA_AOT_BUNDLES": json.dumps({"demo": str(bundle)})})
    with caplog.at_level(logging.INFO, logger="laya_aot.serve"):
        serve._precheck_lazy(type("Router", (), {"loaded": {}, "device": "cpu"})(), config)
    [record] = [r for r in caplog.records if "loads on first use" in r.getMessage()]
    assert record.levelname == "WARNING", record.getMessage()
    for name in names:
        assert _torch_reason(name, version) in record.getMessage()


def _run_cli(env: Dict[str, str], timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    full = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(_free_port()), LAYA_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "laya_aot.cli", "serve"], env=full, capture_output=True,
                          text=True, timeout=timeout)


def test_a_tampered_bundle_refuses_to_start_under_strict(demo_ckpt, tampered):
    r = _run_cli(_env(demo_ckpt, {"demo": str(tampered[0])}, LAYA_AOT_STRICT="1"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("laya-aot serve: no artifact of %s can serve" % tampered[0]), last  # said once
    assert r.stderr.count("no artifact of") == 1, r.stderr  # said once, by the command
    assert "Uvicorn running" not in r.stderr


def test_a_wrong_pin_names_the_setting_it_came_from(demo_ckpt, demo_bundle):
    r = _run_cli(_env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_AOT_STRICT="1",
                      LAYA_AOT_BUNDLE_SHA256S=json.dumps({"demo": "a" * 64})))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "is not the pinned bundle" in last and "the pin (LAYA_AOT_BUNDLE_SHA256S['demo']) says" in last, last
    assert "LAYA_AOT_BUNDLE_SHA256)" not in r.stderr and r.stderr.count("is not the pinned bundle") == 1


def test_strict_refuses_at_start_even_for_a_checkpoint_loaded_on_first_use(demo_ckpt, demo_bundle, tmp_path):
    foreign = tmp_path / "foreign"
    shutil.copytree(demo_bundle, foreign)
    manifest = json.loads((foreign / "bundle.json").read_text())
    manifest["checkpoint"]["fingerprint"]["sha256"] = "0" * 64
    (foreign / "bundle.json").write_text(json.dumps(manifest))
    r = _run_cli(_env(demo_ckpt, {"demo": str(foreign)}, LAYA_AOT_STRICT="1", LAYA_PRELOAD="0"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "built from another checkpoint" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("bundles, says", [
    ("{not json", "invalid LAYA_AOT_BUNDLES: not JSON"),
    ('["/bundles/demo"]', "a JSON object of model name to bundle directory is needed, got a JSON list"),
    ('{"nosuch": "%(bundle)s"}', "no checkpoint is named 'nosuch'; this server knows demo, english"),
    ('{"demo": "%(tmp)s/missing"}', "bundle directory %(tmp)s/missing of 'demo' does not exist; build it with"),
    ('{"demo": "%(tmp)s"}', "has no bundle.json, so it is not a finished bundle"),
    ('{"demo": 3}', "the bundle of 'demo' must be a directory path"),
])
def test_bad_laya_aot_bundles_is_one_clear_error(demo_ckpt, bundle_dir, tmp_path, bundles, says):
    from laya_aot.serve import ServeConfigError, config_from_env

    subst = {"bundle": bundle_dir, "tmp": tmp_path}
    env = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}), "LAYA_AOT_BUNDLES": bundles % subst}
    with pytest.raises(ServeConfigError) as e:
        config_from_env(env)
    assert says % subst in str(e.value)


def test_a_bad_setting_stops_the_command_with_one_line(demo_ckpt):
    r = _run_cli({"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}),
                  "LAYA_AOT_BUNDLES": '{"demo": "/no/such"}'}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "laya-aot serve: invalid LAYA_AOT_BUNDLES: bundle directory /no/such of 'demo' does not exist; build it with "
        "`laya-aot build checkpoint.path=CHECKPOINT output_dir=/no/such`"]
    # laya's own settings, refused by laya as it builds its Router: one line too (its message), not a traceback
    r = _run_cli({"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}), "LAYA_MODELS": "nosuch"}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("laya-aot serve: laya refused its settings: unknown model "
                                                        "'nosuch'; choose one of"), r.stderr


def test_strict_and_pins_are_checked(demo_ckpt, bundle_dir):
    from laya_aot.runtime.loader import load
    from laya_aot.serve import ServeConfigError, config_from_env

    base = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}),
            "LAYA_AOT_BUNDLES": json.dumps({"demo": str(bundle_dir)})}
    cfg = config_from_env(dict(base, LAYA_AOT_STRICT="1"))
    assert cfg.strict and cfg.bundles["demo"].checkpoint == demo_ckpt
    with pytest.raises(ServeConfigError, match="invalid LAYA_AOT_STRICT 'maybe': use 1"):
        config_from_env(dict(base, LAYA_AOT_STRICT="maybe"))
    assert cfg.near_ties == "off" and config_from_env(dict(base, LAYA_AOT_NEAR_TIES="0")).near_ties == "off"
    assert [config_from_env(dict(base, LAYA_AOT_NEAR_TIES=v)).near_ties for v in ("1", "Rows", "off")] == \
        ["call", "rows", "off"]
    with pytest.raises(ServeConfigError,
                       match="invalid LAYA_AOT_NEAR_TIES .some.: use 0 \\(off, the default\\), call or rows"):
        config_from_env(dict(base, LAYA_AOT_NEAR_TIES="some"))
    pins = dict(base, LAYA_AOT_BUNDLE_SHA256S=json.dumps({"english": "a" * 64}))
    if "bundle_sha256" in inspect.signature(load).parameters:
        with pytest.raises(ServeConfigError, match="'english' has no bundle in LAYA_AOT_BUNDLES"):
            config_from_env(pins)
        pinned = config_from_env(dict(base, LAYA_AOT_BUNDLE_SHA256S=json.dumps({"demo": "A" * 64})))
        assert pinned.bundles["demo"].sha256 == "a" * 64
        two = dict(base, LAYA_AOT_BUNDLE_SHA256="a" * 64, LAYA_EXTRA_MODELS=json.dumps({"demo": str(demo_ckpt),
                                                                                      "other": str(demo_ckpt)}),
                   LAYA_AOT_BUNDLES=json.dumps({"demo": str(bundle_dir), "other": str(bundle_dir)}))
        with pytest.raises(ServeConfigError, match="LAYA_AOT_BUNDLE_SHA256 pins one bundle, and this server loads 2"):
            config_from_env(two)
    else:  # this laya_aot.load cannot pin: the setting is refused rather than ignored
        with pytest.raises(ServeConfigError, match="LAYA_AOT_BUNDLE_SHA256S needs a laya_aot.load that takes "
                                                   "bundle_sha256="):
            config_from_env(pins)


@pytest.mark.parametrize("setting, value, says", [
    ("LAYA_AOT_PROBE_SHIPPED", "banana", "invalid LAYA_AOT_PROBE_SHIPPED 'banana': use 1 (on) or 0 (off)"),
    ("LAYA_AOT_PROBE_AHEAD", "banana", "invalid LAYA_AOT_PROBE_AHEAD 'banana': use 1 (on) or 0 (off)"),
    ("LAYA_AOT_PROBE_TIMEOUT", "soon", "LAYA_AOT_PROBE_TIMEOUT='soon' is not a number of seconds"),
    ("LAYA_AOT_UNPACK_MAX_RATIO", "abc", "invalid LAYA_AOT_UNPACK_MAX_RATIO='abc': use a number >= 1"),
    ("LAYA_AOT_CACHE_DIR", "FILE", "it is a file; name a directory laya-aot may write its per-machine cache in"),
    ("LAYA_AOT_BUNDLE_SHA256", "c7e24794", "invalid LAYA_AOT_BUNDLE_SHA256 'c7e24794': a pin is 64 hex digits"),
])
def test_the_settings_a_load_reads_later_are_checked_as_the_server_starts(demo_ckpt, bundle_dir, tmp_path, setting,
                                                                          value, says):
    """Each used to start the server and then fall back to eager (the pin, the ratio), be read as on (the probe's
    switches) or cache nothing with no word (a file as the cache directory)."""
    from laya_aot.serve import ServeConfigError, config_from_env

    if value == "FILE":
        value = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("")
    base = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)}),
            "LAYA_AOT_BUNDLES": json.dumps({"demo": str(bundle_dir)})}
    with pytest.raises(ServeConfigError, match=re.escape(says)):
        config_from_env(dict(base, **{setting: value}))
    assert config_from_env(dict(base, **{setting: {"LAYA_AOT_PROBE_TIMEOUT": "30", "LAYA_AOT_UNPACK_MAX_RATIO": "80",
                                                   "LAYA_AOT_CACHE_DIR": str(tmp_path / "cache"),
                                                   "LAYA_AOT_BUNDLE_SHA256": "a" * 64}.get(setting, "0")}))


def test_this_laya_has_what_serve_relies_on():
    from laya.router import Router

    from laya_aot import laya_internals

    assert laya_internals.check(router=Router()) == []


@pytest.mark.slow  # `laya-aot demo` trains and builds (conftest.readme_demo, shared with tests/demo/test_demo.py)
def test_the_readmes_serve_commands_start_and_answer_from_the_bundle(readme_demo, tmp_path):
    """The README's Serving commands, run as written in a fresh directory (the environment is already made: CI's
    serve environment is the README's `pip install -e ".[serve]"` without the tilelang extra), answer from the
    bundle."""
    (build_line, serve_line), ask = readme_serving_blocks()
    install = build_line.split(" && ", 1)[0]
    assert install == '.venv/bin/pip install -e ".[serve]"', "the install the README gives for serving"
    venv_bin = shlex.quote(str(Path(sys.executable).parent)) + "/"
    env = dict(os.environ, PYTHONUNBUFFERED="1", LAYA_THREADS="1")
    assert readme_demo.returncode == 0, readme_demo.output
    # a fresh directory: the demo made the checkpoint and the bundle first, counted in its start and named apart
    start = re.search(r"first answer ([\d.]+) s after the process started; of it finding or making the demo "
                      r"checkpoint ([\d.]+) s, building the bundle ([\d.]+) s; ", readme_demo.output)
    assert start and float(start[1]) > float(start[2]) + float(start[3]), readme_demo.output
    port = _free_port()
    assert "LAYA_PORT=8000 " in serve_line and all(a.startswith("curl -s localhost:8000/") for a in ask)
    serve_line = serve_line.replace("LAYA_PORT=8000 ", "LAYA_PORT=%d " % port).replace(".venv/bin/", venv_bin)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", serve_line], cwd=readme_demo.dir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # its group is stopped below
    try:
        url = "http://127.0.0.1:%d" % port
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        answers = []
        for line in ask:  # curl -s URL [-H HEADER] [-d BODY], sent as curl would
            args = shlex.split(line)[2:]
            target = url + args[0][len("localhost:8000"):]
            headers = dict(h.split(": ", 1) for h in args[args.index("-H") + 1:][:1]) if "-H" in args else {}
            if "-d" in args:
                answers.append(httpx.post(target, content=args[args.index("-d") + 1], headers=headers, timeout=60))
            else:
                answers.append(httpx.get(target, headers=headers, timeout=10))
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        decision = answers[0].json()
        assert decision["answers"]["team"]["choice"] in ("billing", "technical"), decision
        report = answers[1].json()
        assert report["bundles"]["demo"]["backend"].startswith("aot:"), report
        assert report["bundles"]["demo"]["refused"] == [], report
        assert "served by aot:" in log_path.read_text(errors="replace")
        # 4. laya's own Python client, as written
        client = readme_python("## Serving")
        assert client.count("http://localhost:8000") == 1
        asked = subprocess.run([sys.executable, "-c", client.replace("localhost:8000", "127.0.0.1:%d" % port)],
                               cwd=readme_demo.dir, env=env, capture_output=True, text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr[-3000:]
        team, urgency, angry = asked.stdout.split()
        assert team in ("billing", "technical") and 0 <= float(urgency) <= 1 and 0 <= float(angry) <= 1, asked.stdout
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

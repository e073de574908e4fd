"""`laya-aot serve` with LAYA_AOT_WORKERS=2 and LAYA_AOT_ENGINE=1 (laya_aot/runtime/engine.py): one engine process
runs the artifact calls of both workers, merged; the workers answer laya's routes as one process does; a call
that fails in a merged call fails alone; the engine exiting stops the server. Servers here are real `laya-aot
serve` processes over the demo bundle, on the CPU."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, List

import pytest
import torch

from laya_aot.runtime import engine
from tests.questions import assert_same_answers
from tests.serve.test_serve import Server, _env
from tests.serve.test_workers import _alike, _alive, _answers, _until


def _fake_forward(ids, att, mpos, mmask, qtype, actions: int = 2):
    """Outputs that depend on each row's own real tokens and markers only, like the model's (`actions` columns of
    action logits)."""
    real = (ids * att).sum(1, keepdim=True).float()
    logits = torch.where(mmask, mpos.float() * 10 + real, torch.full_like(mpos, -1e4, dtype=torch.float))
    act = torch.stack([real[:, 0] + i if i % 2 == 0 else qtype.float() - i for i in range(actions)], 1)
    return logits, act


def _call(rows: int, tokens: int, markers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 90, (rows, tokens), generator=g)
    att = torch.ones(rows, tokens, dtype=torch.long)
    att[:, tokens - 3:] = 0
    mpos = torch.randint(1, tokens - 3, (rows, markers), generator=g)
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    mmask[0, -1] = markers < 3
    return ids, att, mpos, mmask, torch.randint(0, 3, (rows,), generator=g)


@pytest.mark.parametrize("actions", [2, 3, 6])
def test_a_merged_call_gives_each_call_its_own_rows_and_markers(actions):
    """6 actions: as many as the merged call's markers, which must not make the action logits a marker dimension
    (a request's action probabilities changed with its neighbours)."""
    calls = [_call(2, 16, 4, 0), _call(3, 48, 2, 1), _call(1, 32, 6, 2)]
    inputs, spans = engine.merge(calls, pad_id=0)
    assert inputs[0].shape == (6, 48) and inputs[2].shape == (6, 6)
    parts = engine.split(_fake_forward(*inputs, actions=actions), spans)
    for call, part in zip(calls, parts):
        alone = _fake_forward(*call, actions=actions)
        assert [p.shape for p in part] == [a.shape for a in alone]
        assert all(torch.equal(p, a) for p, a in zip(part, alone))


class _Backend:
    pad_id = 0
    stats: dict = {}

    def forward(self, ids, att, mpos, mmask, qtype):
        if int(ids.max()) >= 100:
            raise IndexError("token id %d is past the embedding rows" % int(ids.max()))
        return _fake_forward(ids, att, mpos, mmask, qtype)


class _Agent:
    backend_object = _Backend()


def test_tensors_travel_exactly_in_their_dtypes():
    ts = [torch.randn(3, 4).to(torch.bfloat16), torch.randn(2, 2).half(), torch.arange(6).reshape(2, 3),
          torch.tensor([True, False]), torch.randn(5, 3)[:, 1]]
    back = engine.unpack(engine.pack(ts))
    assert [b.dtype for b in back] == [t.dtype for t in ts]
    assert all(torch.equal(b, t) for b, t in zip(back, ts))


def test_a_call_that_fails_in_a_merged_call_fails_alone():
    eng = engine.Engine(lambda key, request: _Agent(), lambda agent: {})
    eng.describe("demo", {})
    got: List[Any] = []
    good, bad = _call(2, 16, 4, 0), _call(1, 16, 4, 1)
    bad = (bad[0] + 100,) + bad[1:]
    eng._answer([engine._Call("demo", good, {}, got.append), engine._Call("demo", bad, {}, got.append)])
    assert got[0][0] == "ok" and all(torch.equal(p, a) for p, a in zip(engine.unpack(got[0][1]), _fake_forward(*good)))
    assert got[1][:2] == ("error", "IndexError") and "past the embedding" in got[1][2]
    counts = {k: v for k, v in eng.stats.items() if not k.endswith("_s")}
    assert counts == {"calls": 2, "artifact_calls": 1, "merged_calls": 0} and eng.stats["forward_s"] > 0


class _Recording(_Backend):
    def __init__(self):
        self.widths: List[List[int]] = []

    def forward(self, ids, att, mpos, mmask, qtype):
        self.widths.append([ids.shape[0], ids.shape[1]])
        return super().forward(ids, att, mpos, mmask, qtype)


def test_calls_waiting_together_merge_within_their_length_group():
    """Calls from several workers wait together: the short ones merge, the long ones merge, and no short call is
    padded to a long one's width; each still gets its own answer."""
    backend = _Recording()
    agent = type("A", (), {"backend_object": backend})()
    eng = engine.Engine(lambda key, request: agent, lambda agent: {})
    eng.describe("demo", {})
    got: dict = {}
    calls = [_call(1, 16, 4, 0), _call(2, 300, 3, 1), _call(1, 24, 2, 2), _call(1, 520, 4, 3)]
    for i, c in enumerate(calls):  # all queued before the device thread looks: one pass takes them together
        eng.calls.put(engine._Call("demo", c, {}, lambda m, i=i: got.__setitem__(i, m)))
    threading.Thread(target=eng.run, daemon=True).start()
    _until(lambda: len(got) == 4, "the four calls answered", timeout=30)
    assert sorted(backend.widths) == [[2, 24], [3, 520]]
    for i, c in enumerate(calls):
        assert got[i][0] == "ok"
        assert all(torch.equal(p, a) for p, a in zip(engine.unpack(got[i][1]), _fake_forward(*c)))


@pytest.fixture(scope="module")
def servers(demo_ckpt, demo_bundle, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    env = _env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_MAX_CONCURRENT="64")
    started = {"one": Server(tmp, "one", env),
               "engine": Server(tmp, "engine", dict(env, LAYA_AOT_WORKERS="2", LAYA_AOT_ENGINE="1",
                                                    LAYA_AOT_ENGINE_LANES="3"))}
    try:
        yield {k: s.wait_ready() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def test_workers_over_one_engine_answer_laya_routes_as_one_process(servers):
    """Bit for bit where the engine serves the one process's artifact. Two artifacts within the loader's tie may
    serve the two servers (the one started second sees the first one's recorded start: `select.START_TIE`); both
    verified against laya, their rounded numbers may then differ in the last digit."""
    one, two = _answers(servers["one"]), _answers(servers["engine"])
    assert [a.get("status") for a in one] == [200, 200, 200, 422, 400, 422, 200, 401, "ok"]
    aot = servers["engine"].aot()
    served = aot["bundles"]["demo"]
    alone = servers["one"].aot()["bundles"]["demo"]["artifact"]
    assert _alike(two, one, 0.0 if served["artifact"] == alone else 1e-3), (served["artifact"], alone, two, one)
    assert served["backend"].startswith(engine.REMOTE)
    assert served["calls"].get("artifact_calls", 0) >= 1  # the engine's own count of its artifact calls
    own = served["calls"]["engine"]  # the engine's device thread: calls taken, and where its time went
    assert own["calls"] >= own["artifact_calls"] >= 1 and own["forward_s"] > 0 and own["idle_s"] > 0


def test_concurrent_requests_over_the_engine_with_lanes_answer_as_one_process(servers):
    """Each worker sends up to three calls at once (LAYA_AOT_ENGINE_LANES=3), which the engine merges with the other
    worker's: every answer to 24 concurrent requests is the one process's answer to that request."""
    from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES

    bodies = [{"model": "demo", "state": DEMO_STATES[i % len(DEMO_STATES)] + " #%d" % i, "questions": DEMO_QUESTIONS}
              for i in range(24)]
    alone = [servers["one"].post("/v1/systemone", b).json() for b in bodies]
    got: List[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        got[i] = servers["engine"].post("/v1/systemone", bodies[i]).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(g is not None for g in got)
    for g, a in zip(got, alone):  # the same decisions, probabilities within laya's rounding
        assert_same_answers(g["answers"], a["answers"])


def _engine_pid(server: Server) -> int:
    for child in Path("/proc/%d/task/%d/children" % (server.proc.pid, server.proc.pid)).read_text().split():
        environ = Path("/proc/%s/environ" % child).read_bytes()
        if engine.ENV_ENGINE_READY_FD.encode() in environ:
            return int(child)
    raise AssertionError("no engine process under the server")


def test_the_engine_exiting_stops_the_server(demo_ckpt, demo_bundle, tmp_path):
    env = _env(demo_ckpt, {"demo": str(demo_bundle)}, LAYA_AOT_WORKERS="2", LAYA_AOT_ENGINE="1")
    server = Server(tmp_path, "engine-exits", env).wait_ready()
    try:
        workers = [int(p) for p in Path("/proc/%d/task/%d/children" % (server.proc.pid, server.proc.pid))
                   .read_text().split()]
        os.kill(_engine_pid(server), signal.SIGKILL)
        assert server.proc.wait(30) != 0
        _until(lambda: not any(_alive(p) for p in workers), "a worker outlived its server")
        assert "laya-aot serve engine exited with status -9; stopping the others" in server.log(), server.log()
    finally:
        server.stop()


def test_a_real_merged_call_answers_each_request_as_alone(demo_ckpt, demo_bundle):
    """Two requests of different lengths and question sets (so different markers) collated by laya, merged into
    one artifact call of the demo bundle: each one's options and decisions as in its call alone."""
    import laya_aot
    from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
    from laya_aot.verification import option_probs

    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu")
    backend = agent.backend_object
    seen: List[Any] = []
    forward = backend.model.forward

    def record(*args, **kwargs):
        seen.append(tuple(a.detach().clone() for a in args[:5]))
        return forward(*args, **kwargs)

    backend.model.forward = backend.forward = record  # both ways in: laya's `_infer`, and `host_call`
    try:
        agent.system_one(DEMO_STATES[0], DEMO_QUESTIONS)
        agent.system_one(DEMO_STATES[1] * 3, {k: DEMO_QUESTIONS[k] for k in list(DEMO_QUESTIONS)[:1]})
    finally:
        backend.model.forward = forward
        del backend.forward
    assert len(seen) == 2 and seen[0][0].shape != seen[1][0].shape
    eng = engine.Engine(lambda key, request: agent, lambda a: {})
    eng.describe("demo", {})
    merged: List[Any] = []
    eng._answer([engine._Call("demo", c, {}, merged.append) for c in seen])
    assert eng.stats["merged_calls"] == 1 and [m[0] for m in merged] == ["ok", "ok"]
    for call, (_, packed) in zip(seen, merged):
        outs = engine.unpack(packed)
        with torch.no_grad():
            alone = [o.float() for o in backend.forward(*call)]
        k = call[2].shape[1]
        p_alone, p_merged = option_probs(alone[0], k), option_probs(outs[0].float(), k)
        assert torch.equal(p_alone.argmax(-1), p_merged.argmax(-1))
        assert float((p_alone - p_merged).abs().max()) < 1e-4
        assert torch.allclose(alone[1], outs[1].float(), atol=1e-4)


def test_a_request_to_an_engine_that_is_gone_fails_at_once(tmp_path):
    """A worker's calls waiting on an engine that exits, and the calls after, raise EngineGone: none waits for ever."""
    import threading
    from multiprocessing.connection import Listener

    key = os.urandom(16)
    listener = Listener(str(tmp_path / "engine.sock"), family="AF_UNIX", authkey=key)
    got: List[Any] = []

    def engine_that_dies() -> None:
        conn = listener.accept()
        got.append(engine._recv(conn))  # the first request arrives, then the engine is gone
        conn.close()

    t = threading.Thread(target=engine_that_dies)
    t.start()
    remote = engine.EngineClient(str(tmp_path / "engine.sock"), key)
    with pytest.raises(engine.EngineGone, match="^the engine process is gone"):
        remote.request("forward", "demo", ((), {}))
    with pytest.raises(engine.EngineGone, match="^the engine process is gone"):
        remote.request("forward", "demo", ((), {}))
    t.join(5)
    assert got and got[0][1:3] == ("forward", "demo")
    listener.close()


def test_a_checkpoint_leaves_the_engine_when_no_worker_holds_it():
    loads: List[str] = []
    eng = engine.Engine(lambda key, request: loads.append(key) or _Agent(), lambda agent: {})
    eng.describe("demo", {})
    eng.describe("demo", {})  # a second worker's agent: loaded once, held twice
    eng.release("demo")
    assert "demo" in eng.agents and loads == ["demo"]
    eng.release("demo")
    assert "demo" not in eng.agents and "demo" not in eng.holds
    eng.describe("demo", {})  # a later request loads it again, as a cold start
    assert loads == ["demo", "demo"]


def test_a_workers_agent_going_or_its_connection_closing_frees_the_engine(demo_ckpt, tmp_path):
    """A worker's thin agent collected (laya's eviction or idle unload) releases the engine's checkpoint; a worker
    whose connection closes releases what it held."""
    import gc
    from multiprocessing.connection import Client, Listener

    key = os.urandom(16)
    address = str(tmp_path / "engine.sock")
    info = {"backend": "aoti-cpu", "artifact": None, "variant": None, "refused": []}
    eng = engine.Engine(lambda k, request: _Agent(), lambda agent: info)
    threading.Thread(target=eng.serve, args=(Listener(address, family="AF_UNIX", authkey=key),), daemon=True).start()
    worker = engine.EngineClient(address, key)
    agent = engine.remote_agent(worker, "demo", str(demo_ckpt), {}, {})
    assert agent.backend_object.name == "engine:aoti-cpu" and eng.holds == {"demo": 1}
    del agent
    gc.collect()
    _until(lambda: "demo" not in eng.agents, "the engine dropped the checkpoint")
    other = Client(address, family="AF_UNIX", authkey=key)  # a worker that loads, then exits
    engine._send(other, (1, "load", "demo", {}))
    assert engine._recv(other)[:2] == (1, "ok") and eng.holds == {"demo": 1}
    other.close()
    _until(lambda: "demo" not in eng.agents, "the closed connection released its checkpoint")
